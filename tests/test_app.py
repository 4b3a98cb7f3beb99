"""Dashboard tests with streamlit.testing.v1.AppTest: every page renders, bad input is reported next to its input,
and a tiny benchmark started from the Run page (a real `python -m workbench bench` subprocess) lands in the store.

Every test works in its own store / jobs folder / Optuna journal / zoo cache (tmp_path), never in results/ or
zoo_cache/.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from results.store import ResultStore
from ui import jobs

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
PAGES = ["run", "tune", "results", "serving", "models", "gpu"]
RUN_TIMEOUT_S = 240


@pytest.fixture()
def workspace(tmp_path, monkeypatch):
    ws = {"store": tmp_path / "store", "jobs": tmp_path / "jobs", "journal": tmp_path / "journal.log",
          "zoo": tmp_path / "zoo"}
    monkeypatch.setenv("WORKBENCH_STORE", str(ws["store"]))
    # non-committed presets (trained or being trained) live here, not in the repo's zoo_cache/
    monkeypatch.setenv("WORKBENCH_ZOO_DIR", str(ws["zoo"]))
    monkeypatch.setenv("WORKBENCH_JOBS", str(ws["jobs"]))
    monkeypatch.setenv("WORKBENCH_STUDY_STORAGE", str(ws["journal"]))
    # the CLI's default SQLite storage: a file of this test (absent unless a test makes it), never results/studies.db
    monkeypatch.setenv("WORKBENCH_CLI_STUDY_STORAGE", f"sqlite:///{tmp_path / 'studies.db'}")
    yield ws
    for job in jobs.list_jobs(status=jobs.RUNNING):  # never leave a subprocess behind
        job.cancel(wait_s=10)


def open_page(page: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=90)
    at.run()
    if page != "run":
        at.switch_page(f"ui/{page}_page.py").run()
    return at


def errors_of(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def error_next_to(at: AppTest, key: str) -> list[str]:
    """Error messages drawn right after the widget `key` in the same block (before the next input widget)."""
    def walk(block):
        kids = list(block.children.values())
        for i, node in enumerate(kids):
            if getattr(node, "key", None) == key:
                found = []
                for after in kids[i + 1:]:
                    if getattr(after, "type", None) == "alert" or type(after).__name__ == "Error":
                        found.append(after.value)
                    elif getattr(after, "key", None):
                        break
                return found
            if hasattr(node, "children"):
                got = walk(node)
                if got is not None:
                    return got
        return None

    return walk(at._tree) or []


def wait_for(job: jobs.Job, timeout_s: float) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status = job.status()
        if status != jobs.RUNNING:
            return status
        time.sleep(0.5)
    job.cancel(wait_s=10)
    raise AssertionError(f"job {job.id} still running after {timeout_s} s; log:\n{job.log_tail()}")


# ---- every page -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES)
def test_page_renders(workspace, page):
    at = open_page(page)
    assert not at.exception, at.exception
    assert at.title[0].value.lower().startswith({"run": "run"}.get(page, page)[:3])


@pytest.mark.parametrize("path", ["start", "run"])
def test_direct_links_open_the_run_page(workspace, path):
    """A browser at /<path> asks for the page by that name; Streamlit answers "Page not found" when no page of the
    app's navigation carries it (the default page's own url_path is not served)."""
    from streamlit.runtime.pages_manager import PagesManager

    at = AppTest.from_file(APP, default_timeout=90).run()
    assert not at.exception, at.exception
    pages = PagesManager(APP)
    pages.set_script_intent("", path)
    found = pages.set_pages_and_resolve(at._registered_pages)  # no fallback: what decides "Page not found"
    assert found is not None and Path(found["script_path"]) == ROOT / "ui" / "run_page.py"


def test_pages_do_not_import_torch(workspace):
    """Long work runs in subprocesses: rendering every page must not pull torch into the server."""
    code = ("import sys\nfrom streamlit.testing.v1 import AppTest\n"
            f"at = AppTest.from_file({APP!r}, default_timeout=90).run()\n"
            "for p in ['tune', 'results', 'serving', 'models', 'gpu']:\n"
            "    at.switch_page(f'ui/{p}_page.py').run()\n"
            "    assert not at.exception, at.exception\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


# ---- Run page -------------------------------------------------------------------------------------------------

def test_run_page_rejects_bad_numbers(workspace):
    at = open_page("run")
    at.text_input(key="run_k").input("abc")
    at.text_input(key="run_batch").input("0")
    at.text_input(key="run_temperature").input("9")
    at.run()
    assert not at.exception
    assert error_next_to(at, "run_k") == ["k must be a whole number, got 'abc'"]
    assert error_next_to(at, "run_batch") == ["batch must be between 1 and 256, got 0"]
    assert error_next_to(at, "run_temperature") == ["temperature must be between 0 and 2, got 9"]
    assert at.button(key="run_start").disabled
    at.text_input(key="run_k").input("4")
    at.text_input(key="run_batch").input("2")
    at.text_input(key="run_temperature").input("0.5")
    at.run()
    assert error_next_to(at, "run_k") == [] and error_next_to(at, "run_batch") == []
    assert not at.button(key="run_start").disabled


def widget_keys(at) -> set[str]:
    """Keys of the widgets in an AppTest's page, or in one of its blocks (an expander)."""
    def walk(block):
        for node in getattr(block, "children", {}).values():
            if getattr(node, "key", None):
                yield node.key
            yield from walk(node)

    return set(walk(at._tree if isinstance(at, AppTest) else at))


@pytest.fixture()
def gpu_visible(monkeypatch):
    """The forms' GPU probe says a CUDA GPU is here (the GPU-only knobs show)."""
    from ui import gpu_page

    monkeypatch.setattr(gpu_page, "gpu_state", lambda: {"cuda_available": True, "reason": None})


@pytest.fixture()
def no_gpu(monkeypatch):
    from ui import gpu_page

    monkeypatch.setattr(gpu_page, "gpu_state", lambda: {"cuda_available": False, "reason": "fixture: no GPU"})


def keys_in(at: AppTest, label: str) -> set[str]:
    """Widget keys inside the expander `label`."""
    [box] = [e for e in at.expander if e.label == label]
    return set(widget_keys(box))


def test_forms_offer_every_knob_of_the_registry(workspace, gpu_visible):
    """The Run and Tune forms are generated from workbench.settings: a knob added there gets a field on both."""
    from studies.space import SEARCH_KNOBS, SETTING_KNOBS
    from workbench.settings import KNOBS, METHODS

    at = open_page("run")
    shown = set()
    for method in METHODS:  # each method shows the knobs it reads; together they show every knob
        at.selectbox(key="run_method").set_value(method).run()
        shown |= widget_keys(at)
    assert {f"run_{name}" for name in KNOBS} <= shown
    at = open_page("tune")
    script = at.selectbox(key="tune_script").value
    assert {f"tune_{name}_{script}" for name in SEARCH_KNOBS} | {f"tune_{name}" for name in SETTING_KNOBS} \
        <= widget_keys(at)


def test_forms_show_gpu_knobs_only_where_a_gpu_is_visible(workspace, monkeypatch):
    from studies.space import SEARCH_KNOBS
    from ui import gpu_page
    from workbench.settings import GPU_ONLY_KNOBS, KNOBS

    assert set(GPU_ONLY_KNOBS) <= set(KNOBS)
    for visible in (False, True):
        monkeypatch.setattr(gpu_page, "gpu_state", lambda v=visible: {"cuda_available": v, "reason": "fixture"})
        at = open_page("run")
        assert not at.exception, at.exception
        keys = widget_keys(at)
        assert ({f"run_{n}" for n in GPU_ONLY_KNOBS} <= keys) is visible, sorted(keys)
        assert bool({f"run_{n}" for n in GPU_ONLY_KNOBS} & keys) is visible
        assert ("fp8" in at.selectbox(key="run_target_quant").options) is visible
        assert "fp8" in at.selectbox(key="run_target_kv_quant").options  # the KV format runs on a CPU too
        assert any("No GPU visible" in c.value for c in at.caption) is (not visible)
        at = open_page("tune")
        assert not at.exception, at.exception
        script = at.selectbox(key="tune_script").value
        gpu_dims = {f"tune_{n}_{script}" for n in GPU_ONLY_KNOBS if n in SEARCH_KNOBS}
        assert gpu_dims and (gpu_dims <= widget_keys(at)) is visible
        assert bool(gpu_dims & widget_keys(at)) is visible
        assert ("fp8" in at.multiselect(key=f"tune_target_quant_{script}").options) is visible


def test_forms_show_the_basic_knobs_first_and_the_rest_under_advanced(workspace, no_gpu):
    at = open_page("run")
    basic = {"run_k", "run_batch", "run_max_new_tokens", "run_num_prompts", "run_temperature", "run_top_p"}
    advanced = keys_in(at, "Advanced")
    assert basic <= widget_keys(at) and not basic & advanced, sorted(advanced)
    assert {"run_repeats", "run_warmup", "run_dtype", "run_seed", "run_device", "run_target_quant"} <= advanced
    at.selectbox(key="run_method").set_value("eagle").run()
    assert {"run_tree_depth", "run_tree_topk", "run_tree_budget"} <= widget_keys(at) - keys_in(at, "Advanced")
    at.text_input(key="run_batch").input("0").run()  # a basic field still shows its error next to it
    assert error_next_to(at, "run_batch") == ["batch must be between 1 and 256, got 0"]

    at = open_page("tune")
    script = at.selectbox(key="tune_script").value
    advanced = keys_in(at, "Advanced")
    assert {f"tune_k_{script}", f"tune_batch_{script}", "tune_max_new_tokens", "tune_num_prompts"} \
        <= keys_in(at, "Search space and run settings (defaults: the script's)")
    assert {f"tune_dtype_{script}", "tune_repeats", "tune_device", "tune_workers"} <= advanced
    assert f"tune_k_{script}" not in advanced


def test_graph_settings_are_checked_on_both_forms(workspace, gpu_visible):
    at = open_page("run")
    at.text_input(key="run_graph_batch_sizes").input("4,2").run()
    assert error_next_to(at, "run_graph_batch_sizes") == [
        "graph_batch_sizes=4,2 must be strictly increasing (sorted, no duplicates), e.g. 2,4"]
    at.text_input(key="run_graph_batch_sizes").input("1,2")
    at.text_input(key="run_batch").input("4").run()
    assert at.selectbox(key="run_cuda_graphs").value == "auto"  # auto: off where the batch fits no bucket, no error
    assert not errors_of(at) and not at.button(key="run_start").disabled
    at.selectbox(key="run_cuda_graphs").set_value(True).run()
    assert any(m.startswith("batch 4 exceeds the largest graph bucket 2") for m in errors_of(at)), errors_of(at)
    assert at.button(key="run_start").disabled
    at.selectbox(key="run_cuda_graphs").set_value(False).run()
    assert not errors_of(at) and not at.button(key="run_start").disabled

    at = open_page("tune")
    at.selectbox(key="tune_script").set_value("pareto").run()  # batch 1,2,4
    at.text_input(key="tune_graph_batch_sizes").input("1,2")
    at.multiselect(key="tune_cuda_graphs_pareto").set_value([False, True])
    at.multiselect(key="tune_compile_pareto").set_value(["off", "default"]).run()
    assert any(m.startswith("batch 4 exceeds the largest graph bucket 2") for m in errors_of(at)), errors_of(at)
    assert at.button(key="tune_launch").disabled
    at.text_input(key="tune_graph_batch_sizes").input("1,2,4").run()
    assert not errors_of(at), errors_of(at)
    assert not at.button(key="tune_launch").disabled


def _show_metrics_app(record: dict) -> AppTest:
    def app(record):
        from ui.run_page import show_metrics

        show_metrics(record, None)

    return AppTest.from_function(app, args=(record,), default_timeout=60).run()


def test_run_result_shows_ar_baseline_greedy_match_and_explains_a_slowdown(workspace):
    slow = {"status": "ok", "method": "draft", "speedup_vs_ar": 0.7, "tokens_per_s": 35.0, "ar_tokens_per_s": 50.0,
            "greedy_matches_ar": True, "plausible": True, "noisy": False}
    at = _show_metrics_app(slow)
    assert not at.exception, at.exception
    text = all_text(at)
    assert "Autoregressive baseline in the same run: **50.0 tokens/s**" in text
    assert "identical to autoregressive: **yes**" in text
    assert any(i.value.startswith("Slower than autoregressive decoding") for i in at.info)
    at = _show_metrics_app({**slow, "speedup_vs_ar": 1.4, "greedy_matches_ar": False})
    assert not any(i.value.startswith("Slower") for i in at.info)
    assert any("differs from plain autoregressive" in e.value for e in at.error)
    at = _show_metrics_app({**slow, "greedy_matches_ar": None})
    assert "not checked" in all_text(at)


def test_run_page_rejects_missing_model_and_bad_prompts(workspace, tmp_path):
    at = open_page("run")
    at.radio(key="run_model_source").set_value("Local model paths").run()
    at.text_input(key="run_target_path").input(str(tmp_path / "no-such-model")).run()
    assert any("does not exist" in m for m in error_next_to(at, "run_target_path"))
    assert at.button(key="run_start").disabled

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    at.radio(key="run_model_source").set_value("Built-in preset")
    at.radio(key="run_prompt_source").set_value("File on disk").run()
    at.text_input(key="run_prompt_path").input(str(bad)).run()
    msgs = error_next_to(at, "run_prompt_path")
    assert msgs and "bad.jsonl:2" in msgs[0], msgs
    assert at.button(key="run_start").disabled
    assert not jobs.list_jobs()  # nothing was started


def test_run_page_cuda_without_gpu_is_an_error(workspace):
    at = open_page("run")
    at.selectbox(key="run_device").set_value("cuda").run()
    probe = json.loads(subprocess.run([sys.executable, "-m", "ui.gpu_probe"], cwd=ROOT, capture_output=True,
                                      text=True, timeout=120).stdout)
    if probe.get("cuda_available"):
        pytest.skip("a CUDA GPU is here: this checks a machine without one")
    assert any("no CUDA GPU" in m for m in error_next_to(at, "run_device"))


def test_tiny_run_from_run_page_lands_in_store(workspace):
    at = open_page("run")
    for key, value in {"run_k": "2", "run_batch": "1", "run_max_new_tokens": "6", "run_num_prompts": "2",
                       "run_warmup": "0"}.items():
        at.text_input(key=key).input(value)
    at.selectbox(key="run_device").set_value("cpu")
    at.run()
    assert not errors_of(at), errors_of(at)
    at.button(key="run_start").click().run()
    assert not at.exception
    started = jobs.list_jobs(kind="bench")
    assert len(started) == 1
    job = started[0]
    assert "--store" in job.meta["argv"] and str(workspace["store"]) in job.meta["argv"]
    assert wait_for(job, RUN_TIMEOUT_S) == jobs.DONE, job.log_tail()

    df = ResultStore(workspace["store"]).load()
    assert len(df) == 1
    row = df.iloc[0]
    assert row["status"] == "ok" and row["method"] == "draft" and row["k"] == 2 and row["batch"] == 1
    assert row["max_new_tokens"] == 6
    assert len(ResultStore(workspace["store"]).load_traces([row["run_id"]])) > 0

    at.run()  # the page now shows the finished run's headline metrics and charts
    assert not at.exception
    labels = [m.label for m in at.metric]
    assert {"Speedup vs AR", "Acceptance rate", "Mean accepted tokens", "Tokens/s", "TTFT", "TPOT p50"} <= set(labels)

    fresh = open_page("run")  # a new session (a browser refresh) still finds the job and its result
    assert fresh.selectbox(key="run_job_pick").value == job.id
    assert "Speedup vs AR" in [m.label for m in fresh.metric]


def test_cancel_from_run_page_keeps_the_store_intact(workspace):
    seed_store(workspace["store"])
    before = ResultStore(workspace["store"]).load()
    at = open_page("run")
    # a valid run (prompt <= 256 tokens + 1500 fits the tiny models' 2048 context) that takes minutes on CPU: it must
    # be cancelled mid-generation, not fail on its own (a too-long max_new_tokens would end it with a failed row)
    at.text_input(key="run_max_new_tokens").input("1500")
    at.text_input(key="run_num_prompts").input("8")
    at.selectbox(key="run_device").set_value("cpu")
    at.run()
    assert not errors_of(at), errors_of(at)
    at.button(key="run_start").click().run()
    [job] = jobs.list_jobs(kind="bench")
    deadline = time.time() + 120
    while "repeat 1/" not in job.progress()["text"] and job.status() == jobs.RUNNING and time.time() < deadline:
        time.sleep(0.2)  # until the benchmark is generating (models loaded, settings checked)
    assert job.status() == jobs.RUNNING and "repeat 1/" in job.progress()["text"], job.log_tail()
    at.run()
    at.button(key=f"run_cancel_{job.id}").click().run()
    assert not at.exception
    assert wait_for(job, 30) == jobs.CANCELLED
    after = ResultStore(workspace["store"]).load()
    assert after["run_id"].tolist() == before["run_id"].tolist()  # nothing recorded was lost or half-written


# ---- Tune page ------------------------------------------------------------------------------------------------

def test_tune_page_rejects_bad_budget_and_name(workspace):
    at = open_page("tune")
    at.selectbox(key="tune_script").set_value("best_k")
    at.text_input(key="tune_device").input("gpu0")
    at.text_input(key="tune_trials").input("many").run()
    assert error_next_to(at, "tune_device") == ["device must be cpu, cuda or cuda:N, got 'gpu0'"]
    assert error_next_to(at, "tune_trials") == ["trials must be a whole number, got 'many'"]
    at.text_input(key="tune_trials").input("5000").run()
    assert error_next_to(at, "tune_trials") == ["trials must be between 1 and 1000, got 5000"]
    at.text_input(key="tune_trials").input("3")
    at.text_input(key="tune_study_name").input("bad name!").run()
    assert any("study name" in m for m in errors_of(at))
    assert at.button(key="tune_launch").disabled
    at.text_input(key="tune_study_name").input("ok-name")
    at.text_input(key="tune_k_best_k").input("1-99").run()
    assert any("k=99" in m for m in errors_of(at)), errors_of(at)


def test_tune_page_refuses_existing_study_with_other_space(workspace):
    url = f"journal://{workspace['journal']}"
    created = subprocess.run([sys.executable, "-m", "studies.run", "--study", "taken", "--script", "best_k",
                              "--trials", "2", "--storage", url, "--workers", "0"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert created.returncode == 0, created.stderr
    at = open_page("tune")
    at.text_input(key="tune_study_name").input("taken")
    at.selectbox(key="tune_script").set_value("pareto").run()
    msgs = errors_of(at)
    assert any("already exists with another search space" in m for m in msgs), msgs
    assert at.button(key="tune_launch").disabled
    at.selectbox(key="tune_script").set_value("best_k").run()  # same script, same space: resuming is fine
    assert not any("already exists" in m for m in errors_of(at)), errors_of(at)
    assert not at.button(key="tune_launch").disabled
    # the stored study is untouched by the refused attempt
    import optuna
    from studies.storage import open_storage
    assert optuna.get_all_study_names(open_storage(url)) == ["taken"]


def launch_small_study(at: AppTest, name: str, trials: int) -> None:
    """Fill the Tune page's budget with a tiny study, launch it, and wait until its job is done."""
    at.text_input(key="tune_study_name").input(name)
    at.text_input(key="tune_trials").input(str(trials))
    at.text_input(key="tune_max_new_tokens").input("4")
    at.text_input(key="tune_num_prompts").input("1")
    at.run()
    assert not errors_of(at), errors_of(at)
    at.button(key="tune_launch").click().run()
    [job] = jobs.list_jobs(kind="study")
    assert wait_for(job, RUN_TIMEOUT_S) == jobs.DONE, job.log_tail()


def test_tune_page_runs_a_study_and_shows_it(workspace):
    at = open_page("tune")
    launch_small_study(at, "ui-study", trials=2)
    at.run()
    assert not at.exception
    assert at.selectbox(key="tune_watch").value == "ui-study"
    tabs = [t.label for t in at.tabs]
    assert {"Trials", "Best settings", "Importances", "Parallel coordinates", "Slice"} <= set(tabs), tabs
    assert len(ResultStore(workspace["store"]).load(study="ui-study")) == 2


def test_tune_page_name_follows_script_unless_typed(workspace):
    at = open_page("tune")
    assert at.text_input(key="tune_study_name").value == "pareto-1"
    other = next(o for o in at.selectbox(key="tune_script").options if o != "pareto")
    at.selectbox(key="tune_script").set_value(other).run()
    assert at.text_input(key="tune_study_name").value == f"{other}-1"
    at.text_input(key="tune_study_name").input("my-study").run()
    at.selectbox(key="tune_script").set_value("pareto").run()
    assert at.text_input(key="tune_study_name").value == "my-study"


def test_tune_page_lists_studies_of_the_cli_default_storage(workspace, tmp_path):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from studies.study import SPEC_KEY

    study = optuna.create_study(study_name="from-cli", storage=f"sqlite:///{tmp_path / 'studies.db'}")
    study.set_user_attr(SPEC_KEY, {"script": "speed"})  # what studies.run stores (enough for the view)
    at = open_page("tune")
    assert not at.exception, at.exception
    watch = at.selectbox(key="tune_watch")
    assert "from-cli · CLI storage" in watch.options
    watch.set_value("from-cli · CLI storage").run()
    assert not at.exception, at.exception
    assert any(m.value.startswith("**from-cli**") for m in at.markdown)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_tune_history_best_line_runs_through_trusted_trials_only(workspace):
    """An implausible trial with the highest value is a grey "left out" marker; the best-value line never reaches it."""
    import optuna

    from studies.storage import open_storage
    from studies.study import SPEC_KEY

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="flagged", storage=open_storage(f"journal://{workspace['journal']}"),
                                direction="maximize")
    study.set_metric_names(["speedup_vs_ar"])
    study.set_user_attr(SPEC_KEY, {"script": "speed"})
    for value, attrs in ((1.1, {}), (3.0, {"plausible": False, "implausible_reason": "fixture: over the bound"}),
                         (1.3, {}), (2.0, {"noisy": True, "noisy_reason": "fixture: wide interval"})):
        study.add_trial(optuna.trial.create_trial(value=value, user_attrs={"feasible": True, "plausible": True,
                                                                           "noisy": False, **attrs}))
    at = open_page("tune")
    assert not at.exception, at.exception
    [fig] = [f for f in plotly_figs(at) if f["layout"].get("title", {}).get("text") == "Optimization history"]
    traces = {t["name"]: t for t in fig["data"]}
    best = traces["Best value (trusted trials)"]
    assert best["x"] == [0, 2, 3] and best["y"] == [1.1, 1.3, 1.3]
    left = traces["Left out (infeasible, noisy or implausible)"]
    assert left["x"] == [1, 3] and "implausible: fixture: over the bound" in left["text"][0]
    assert traces["speedup_vs_ar"]["x"] == [0, 2]


# ---- Results page ---------------------------------------------------------------------------------------------

def seed_store(root: Path) -> list[str]:
    """Two real-looking run rows written through the real store (values are fixtures, not measurements)."""
    store = ResultStore(root)
    ids = []
    for i, (method, k, batch) in enumerate((("draft", 2, 1), ("ngram", 4, 2), ("draft", 4, 2))):
        ids.append(store.append({
            "status": "ok", "method": method, "k": k, "batch": batch, "temperature": 0.0, "max_new_tokens": 8,
            "preset": "tiny", "device": "cpu", "dtype": "float32", "speedup_vs_ar": 1.2 + i / 10,
            "acceptance_rate": 0.5 + i / 10, "mean_accepted_tokens": 1.5, "acceptance_by_position": [0.8, 0.4],
            "tokens_per_s": 100.0 + i, "ar_tokens_per_s": 80.0, "ttft_ms": 5.0, "tpot_ms_p50": 3.0},
            pd.DataFrame({"seq": [0, 0], "step": [0, 1], "drafted": [k, k], "accepted": [1, 2], "emitted": [2, 3]})))
    return ids


def test_results_page_filters_compares_and_exports(workspace):
    ids = seed_store(workspace["store"])
    at = open_page("results")
    assert not at.exception
    assert any("3 of 3 runs" in c.value for c in at.caption)
    at.multiselect(key="res_filter_method").set_value(["draft"]).run()
    assert any("2 of 3 runs" in c.value for c in at.caption)
    at.multiselect(key="res_compare").set_value(ids[:2]).run()
    assert not at.exception
    diff_note = [c.value for c in at.caption if c.value.startswith("Yellow")]
    assert diff_note and "method" in diff_note[0] and "k" in diff_note[0] and "batch" in diff_note[0]
    assert "temperature" not in diff_note[0].split("differences:")[1]
    buttons = [b for b in at.get("download_button")]
    assert len(buttons) == 4  # CSV + Parquet of the filtered table and of the compared runs


def test_results_export_matches_store_export(workspace, tmp_path):
    import pyarrow.parquet as pq

    from results import schema
    from results.export import read_csv_export
    from ui.results_page import export_bytes
    seed_store(workspace["store"])
    store = ResultStore(workspace["store"])
    df = store.load()
    csv = export_bytes(df, "csv")
    assert csv.decode().splitlines()[0].startswith("run_id") and len(csv.decode().strip().splitlines()) == 4
    assert csv == store.export(df, tmp_path / "ref.csv", fmt="csv").read_bytes()  # what `results export` writes
    (tmp_path / "ui.csv").write_bytes(csv)
    pd.testing.assert_frame_equal(read_csv_export(tmp_path / "ui.csv"), df)
    parquet = export_bytes(df, "parquet")
    assert parquet[:4] == b"PAR1"
    (tmp_path / "ui.parquet").write_bytes(parquet)
    pd.testing.assert_frame_equal(schema.table_to_frame(pq.read_table(tmp_path / "ui.parquet")), df)


def seed_trust_store(root: Path, prompts: Path) -> dict[str, str]:
    """Hand-made runs for the trust views (values are fixtures, not measurements): draft runs over k x batch with
    intervals, one draft run of one repeat (no interval), a noisy run and an implausible run with the highest
    speedups (never "best"), an AR run; the prompt file has two categories, sequence i is prompt i."""
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}"]})
                                 for i, c in enumerate(["writing", "math", "writing", "math"])) + "\n")
    store = ResultStore(root)
    base = {"status": "ok", "temperature": 0.0, "max_new_tokens": 8, "preset": "tiny", "device": "cpu",
            "dtype": "float32", "acceptance_rate": 0.6, "mean_accepted_tokens": 2.0, "tokens_per_s": 120.0,
            "ar_tokens_per_s": 100.0, "tokens_per_s_cv": 0.01, "ar_tokens_per_s_cv": 0.01, "noisy": False,
            "plausible": True, "tpot_ms_p50": 3.0, "tpot_ms_p90": 4.0, "tpot_ms_p99": 6.0, "itl_ms_p50": 2.0,
            "itl_ms_p90": 5.0, "itl_ms_p99": 9.0, "prompts_source": str(prompts)}
    ids = {}
    # writing prompts (seq 0, 2) accept everything, math prompts (seq 1, 3) nothing
    traces = pd.DataFrame({"seq": [0, 1, 2, 3], "step": [0, 0, 0, 0], "drafted": [2, 2, 2, 2],
                           "accepted": [2, 0, 2, 0], "emitted": [3, 1, 3, 1]})
    for k, batch, speedup in ((2, 1, 1.10), (2, 1, 1.30), (4, 1, 1.40), (2, 2, 0.90), (4, 2, 1.05)):
        ids[f"draft k{k} b{batch} {speedup}"] = store.append(
            {**base, "method": "draft", "k": k, "batch": batch, "speedup_vs_ar": speedup,
             "speedup_ci_low": speedup - 0.05, "speedup_ci_high": speedup + 0.05,
             "acceptance_by_position": [0.9, 0.5, 0.2, 0.1][:k]}, traces)
    ids["no interval"] = store.append({**base, "method": "draft", "k": 6, "batch": 1, "speedup_vs_ar": 1.2,
                                       "acceptance_by_position": [0.8] * 6}, traces)
    ids["noisy"] = store.append({**base, "method": "draft", "k": 4, "batch": 1, "speedup_vs_ar": 3.0,
                                 "speedup_ci_low": 0.5, "speedup_ci_high": 5.0, "noisy": True,
                                 "noisy_reason": "fixture: the interval spans 1"}, traces)
    ids["implausible"] = store.append({**base, "method": "ngram", "k": 3, "batch": 1, "speedup_vs_ar": 9.0,
                                       "speedup_ci_low": 8.9, "speedup_ci_high": 9.1, "plausible": False,
                                       "implausible_reason": "fixture: faster than the bound"}, traces)
    ids["ar"] = store.append({**base, "method": "ar", "k": 0, "batch": 1, "speedup_vs_ar": 1.0,
                              "acceptance_rate": None})
    return ids


def all_text(at: AppTest) -> str:
    parts = [e.value for kind in ("markdown", "caption", "info", "warning", "success", "error") for e in at.get(kind)]
    return "\n".join(str(p) for p in parts)


def plotly_figs(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def test_results_page_marks_flags_and_never_crowns_them(workspace, tmp_path):
    ids = seed_trust_store(workspace["store"], tmp_path / "question.jsonl")
    at = open_page("results")
    assert not at.exception, at.exception
    best = [s.value for s in at.success]
    assert len(best) == 1 and "Best trusted speedup: **1.40x [1.35, 1.45]**" in best[0] and "k=4 b=1" in best[0]
    assert "2 flagged run(s) not considered" in best[0]
    table = at.dataframe[0].value
    by_id = table.set_index("run_id")
    assert by_id.at[ids["noisy"], "flags"] == "noisy: fixture: the interval spans 1"
    assert by_id.at[ids["implausible"], "flags"] == "implausible: fixture: faster than the bound"
    assert by_id.at[ids["draft k2 b1 1.1"], "flags"] == ""
    assert by_id.at[ids["draft k2 b1 1.1"], "speedup_interval"] == "1.10x [1.05, 1.15]"
    assert by_id.at[ids["no interval"], "speedup_interval"] == "1.20x (no interval)"
    assert any("2 flagged run(s)" in e.label for e in at.expander)
    # filtering to the flagged runs only: no best at all
    at.multiselect(key="res_filter_method").set_value(["ngram"]).run()
    assert not at.success and any("No trusted run" in i.value for i in at.info)


def test_results_page_calls_a_best_below_one_a_slowdown(workspace):
    store = ResultStore(workspace["store"])
    for k, speedup in ((2, 0.86), (4, 0.80)):
        store.append({"status": "ok", "method": "draft", "k": k, "batch": 1, "temperature": 0.0, "preset": "tiny",
                      "device": "cpu", "dtype": "float32", "speedup_vs_ar": speedup, "tokens_per_s": 86.0,
                      "ar_tokens_per_s": 100.0, "noisy": False, "plausible": True})
    at = open_page("results")
    assert not at.exception, at.exception
    assert not at.success  # no green box for a slowdown
    [slow] = [w.value for w in at.warning if "Slowdown" in w.value]
    assert "slower than autoregressive" in slow and "**0.86x (no interval)**" in slow and "k=2" in slow


def test_results_page_heatmap_and_grouped_lines(workspace, tmp_path):
    ids = seed_trust_store(workspace["store"], tmp_path / "question.jsonl")
    at = open_page("results")
    figs = {f["layout"]["title"]["text"]: f for f in plotly_figs(at)}
    heat = figs["Speedup heatmap · draft · median over runs · 1 flagged run(s) left out"]
    cells = {(y, x): t for y, row in zip(heat["data"][0]["y"], heat["data"][0]["text"])
             for x, t in zip(heat["data"][0]["x"], row)}
    assert cells[("2", "1")] == "1.20x<br>n=2"  # median of 1.10 and 1.30; the noisy 3.0 at k=4 is left out
    assert cells[("4", "1")] == "1.40x<br>n=1" and cells[("2", "2")] == "0.90x<br>n=1"
    assert "Speedup heatmap · ngram · median over runs · 1 flagged run(s) left out" not in figs  # nothing trusted
    assert any("ngram: no trusted run" in i.value for i in at.info)
    by_k = figs["Speedup vs draft length, one line per method, batch"]
    lines = {t["name"] for t in by_k["data"] if t.get("mode") == "lines"}
    assert lines == {"draft · b=1", "draft · b=2"}
    flagged = [t for t in by_k["data"] if t["name"].startswith("flagged")]
    assert flagged and flagged[0]["name"].endswith(": 2")
    with_bars = [t for t in by_k["data"] if t.get("error_y", {}).get("array")]
    assert with_bars and all(t["marker"]["symbol"] == "circle" for t in with_bars)
    assert any(t.get("marker", {}).get("symbol") == "circle-open" for t in by_k["data"])  # the no-interval run
    assert "Acceptance by draft position, per run" in figs
    assert "TPOT (time per output token) percentiles per run" in figs
    assert "ITL (inter-token latency) percentiles per run" in figs


def test_results_compare_shows_deltas_and_highlights_only_real_moves(workspace, tmp_path):
    from ui.results_page import HIGHLIGHT, _style, compare_frame

    ids = seed_trust_store(workspace["store"], tmp_path / "question.jsonl")
    runs = ResultStore(workspace["store"]).load()
    pair = runs[runs["run_id"].isin([ids["draft k2 b1 1.1"], ids["draft k2 b1 1.3"]])]
    table, differs, marked = compare_frame(pair, True, ids["draft k2 b1 1.1"])
    delta = [c for c in table.columns if c.startswith("Δ ")]
    ratio = [c for c in table.columns if c.startswith("ratio ")]
    assert len(delta) == 1 and len(ratio) == 1
    assert table.at["speedup_vs_ar", delta[0]] == pytest.approx(0.2)
    assert table.at["speedup_vs_ar", ratio[0]] == pytest.approx(1.3 / 1.1)
    fields = {f for f, _ in marked}
    assert "speedup_vs_ar" in fields  # +18 %, intervals +-4 %
    assert "tokens_per_s" not in fields and "acceptance_rate" not in fields  # equal
    at = open_page("results")
    at.multiselect(key="res_compare").set_value([ids["draft k2 b1 1.1"], ids["draft k2 b1 1.3"]]).run()
    assert not at.exception, at.exception
    note = [c.value for c in at.caption if c.value.startswith("Yellow")]
    assert note and "Metrics beyond the spread: speedup_ci_high, speedup_ci_low, speedup_vs_ar." in note[0]
    assert len(marked) == 9  # value, delta and ratio cells of the 3 moved metrics, nothing else
    css = _style(table, differs, marked)._compute().ctx  # cell -> CSS the Styler sends
    assert sum(1 for props in css.values() if ("background-color", HIGHLIGHT.split(": ")[1]) in props) == 9


def test_results_page_per_category_breakdown(workspace, tmp_path):
    ids = seed_trust_store(workspace["store"], tmp_path / "question.jsonl")
    at = open_page("results")
    at.selectbox(key="res_category_run").set_value(ids["draft k2 b1 1.1"]).run()
    assert not at.exception, at.exception
    figs = {f["layout"]["title"]["text"]: f for f in plotly_figs(at)}
    bars = figs["Acceptance by prompt category"]["data"][0]
    assert dict(zip(bars["x"], bars["y"])) == {"math": 0.0, "writing": 1.0}
    (tmp_path / "question.jsonl").unlink()
    at.run()
    assert any("prompt file is not here any more" in i.value for i in at.info)


def seed_tree_store(root: Path, prompts: Path) -> dict[str, str]:
    """Hand-made beam runs (fixtures, not measurements): redrafter at W = 1, 2, 4 (L = 2) and a draft chain (k = 2);
    the prompt file has two categories: code (seq 0, 2) and chat (seq 1, 3). In the traces, code steps merge their
    beams into W x L distinct nodes with disagreement 1, chat steps into one chain (L nodes) with disagreement 0."""
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}"]})
                                 for i, c in enumerate(["code", "chat", "code", "chat"])) + "\n")
    store = ResultStore(root)
    base = {"status": "ok", "temperature": 0.0, "max_new_tokens": 8, "preset": "tiny", "device": "cpu", "batch": 1,
            "dtype": "float32", "tokens_per_s": 100.0, "ar_tokens_per_s": 100.0, "speedup_vs_ar": 1.0,
            "noisy": False, "plausible": True, "prompts_source": str(prompts)}
    ids = {}
    for w in (1, 2, 4):
        drafted = [w * 2, 2, w * 2, 2]
        traces = pd.DataFrame({"seq": [0, 1, 2, 3], "step": [0, 0, 0, 0], "drafted": drafted,
                               "accepted": [2, 1, 1, 0], "emitted": [3, 2, 2, 1],
                               "path_ranks": ["[0, 0]", "[0]", "[1]", "[]"],
                               "beam_disagreement": [1.0, 0.0, 1.0, 0.0] if w > 1 else [None] * 4})
        ids[f"W{w}"] = store.append({**base, "method": "redrafter", "beam_width": w, "beam_length": 2, "k": 4,
                                     "beam_diversity_mean": sum(drafted) / (4 * w * 2),
                                     "beam_disagreement_mean": 0.5 if w > 1 else None,
                                     "acceptance_by_position": [0.75, 0.25] + [0.0] * (2 * w - 2),
                                     "acceptance_by_rank": [0.75, 0.25] if w > 1 else [1.0]}, traces)
    ids["draft"] = store.append({**base, "method": "draft", "k": 2, "beam_width": 2, "beam_length": 4,
                                 "acceptance_by_position": [0.5, 0.25], "acceptance_by_rank": [0.75]})
    return ids


def test_results_page_tree_charts(workspace, tmp_path):
    seed_tree_store(workspace["store"], tmp_path / "question.jsonl")
    at = open_page("results")
    assert not at.exception, at.exception
    figs = {f["layout"]["title"]["text"]: f for f in plotly_figs(at)}
    depth = figs["Acceptance by draft depth, per method (mean over runs)"]
    lines = {t["name"]: t["y"] for t in depth["data"]}
    # a beam run's N = W x L long list is cut at its beam length L = 2
    assert lines == {"draft": [0.5, 0.25], "redrafter · W=1": [0.75, 0.25], "redrafter · W=2": [0.75, 0.25],
                     "redrafter · W=4": [0.75, 0.25]}
    rank = figs["Acceptance by node rank, per run"]
    assert sorted(len(t["y"]) for t in rank["data"]) == [1, 1, 2, 2]
    by_method = figs["Diversity vs beam width, by method"]
    mean_lines = [t for t in by_method["data"] if t["mode"] == "lines"]
    assert [t["name"] for t in mean_lines] == ["redrafter", "redrafter"]  # one per panel; the chain has no beams
    assert mean_lines[0]["x"] == [1, 2, 4] and mean_lines[0]["y"] == pytest.approx([1.0, 0.75, 0.625])
    assert mean_lines[1]["x"] == [2, 4] and mean_lines[1]["y"] == pytest.approx([0.5, 0.5])  # none for W = 1
    at.radio(key="res_diversity_color").set_value("prompt category").run()
    assert not at.exception, at.exception
    figs = {f["layout"]["title"]["text"]: f for f in plotly_figs(at)}
    by_cat = {(t["name"], t["xaxis"]): (t["x"], t["y"]) for t in figs["Diversity vs beam width, by category"]["data"]
              if t["mode"] == "lines"}
    assert by_cat[("code", "x")] == ([1, 2, 4], [1.0, 1.0, 1.0])  # all W x L nodes distinct
    assert by_cat[("chat", "x")] == ([1, 2, 4], pytest.approx([1.0, 0.5, 0.25]))  # one chain: 1 / W
    assert by_cat[("code", "x2")] == ([2, 4], [1.0, 1.0]) and by_cat[("chat", "x2")] == ([2, 4], [0.0, 0.0])


# ---- Models page ----------------------------------------------------------------------------------------------

def test_models_page_lists_presets_and_validates_registration(workspace, tmp_path):
    at = open_page("models")
    assert not at.exception
    presets = at.dataframe[0].value
    assert "tiny" in presets["preset"].tolist()
    from workbench.zoo import resolve_preset  # sizes in MiB, as `zoo list` prints them (tests/test_zoo.py)
    folder = resolve_preset("tiny").root
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
    assert presets.set_index("preset").at["tiny", "size MiB"] == round(size, 1)
    at.text_input(key="models_reg_name").input("mine")
    at.text_input(key="models_reg_target").input(str(tmp_path / "nowhere"))
    at.button(key="models_reg_submit").click().run()
    assert any("does not exist" in m for m in errors_of(at))
    from ui import catalog
    assert catalog.registered_models() == []

    from workbench.zoo import resolve_preset
    paths = resolve_preset("tiny")  # committed to the repo: never a reason to skip
    at.text_input(key="models_reg_target").input(str(paths.target_dir))
    at.text_input(key="models_reg_draft").input(str(paths.draft_dir))
    at.button(key="models_reg_submit").click().run()
    assert not errors_of(at)
    assert [m["name"] for m in catalog.registered_models()] == ["mine"]
    assert "mine" in at.dataframe[1].value["name"].tolist()


def test_models_page_starts_training_in_background(workspace):
    at = open_page("models")
    at.selectbox(key="models_train_preset").set_value("small")
    at.selectbox(key="models_train_device").set_value("cpu").run()
    at.button(key="models_train_start").click().run()
    assert not at.exception
    [job] = jobs.list_jobs(kind="train")
    assert job.meta["argv"][1:] == ["-m", "workbench", "zoo", "train", "small", "--device", "cpu"]
    assert job.status() == jobs.RUNNING  # the page returned at once; the trainer runs on
    job.cancel(wait_s=20)
    assert job.status() == jobs.CANCELLED


def test_train_progress_reads_trainer_lines(workspace):
    from ui.models_page import train_fraction
    lines = ["[zoo] corpus: 10 files", "[target] step     10  ce 5.0  lr 1e-3  0.1 M tok/s    37.5 s",
             "[draft] step     10  ce 5.0  lr 1e-3  0.1 M tok/s    15.0 s"]
    code = "import sys\nfor line in sys.argv[1:]:\n    print(line, flush=True)"
    job = jobs.start_job("train", [sys.executable, "-c", code, *lines[:2]], "t", params={"preset": "tiny"})
    wait_for(job, 30)
    assert train_fraction(job) == pytest.approx(37.5 / 105)  # tiny: 75 s target + 30 s draft
    job = jobs.start_job("train", [sys.executable, "-c", code, *lines], "t", params={"preset": "tiny"})
    wait_for(job, 30)
    assert train_fraction(job) == pytest.approx((75 + 15.0) / 105)


# ---- GPU page -------------------------------------------------------------------------------------------------

def test_gpu_page_states_no_gpu(workspace):
    at = open_page("gpu")
    from ui.gpu_page import gpu_probe
    if gpu_probe().get("cuda_available"):
        assert not at.exception
        return
    assert any("No GPU on this machine" in i.value for i in at.info)


# ---- jobs (no Streamlit) --------------------------------------------------------------------------------------

def test_job_lifecycle_cancel_and_refresh(workspace):
    script = ("import time, sys\nfor i in range(4):\n    print(f'step {i+1}/4', flush=True); time.sleep(0.2)\n"
              "print('{\"ok\": 1}')")
    job = jobs.start_job("test", [sys.executable, "-c", script], "counts to four")
    assert wait_for(job, 30) == jobs.DONE
    assert job.result() == {"ok": 1} and job.progress()["fraction"] == 1.0
    # a new server process sees the same job from disk
    again = jobs.get_job(job.id)
    assert again.status() == jobs.DONE and "step 4/4" in again.log_tail()

    sleeper = jobs.start_job("test", [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"], "sleeps")
    time.sleep(0.5)
    assert sleeper.status() == jobs.RUNNING
    sleeper.cancel(wait_s=10)
    assert sleeper.status() == jobs.CANCELLED

    several = [jobs.start_job("test", [sys.executable, "-c", "import time; time.sleep(2)"], f"s{i}") for i in range(2)]
    assert [j.status() for j in several] == [jobs.RUNNING] * 2  # jobs run side by side
    assert all(wait_for(j, 30) == jobs.DONE for j in several)

    failing = jobs.start_job("test", [sys.executable, "-c", "raise SystemExit('boom')"], "fails")
    assert wait_for(failing, 30) == jobs.FAILED and "boom" in failing.error_text()
    assert {j.id for j in jobs.list_jobs(kind="test")} == {job.id, sleeper.id, failing.id, *(j.id for j in several)}


def test_tune_page_local_models_validated_and_launchable(workspace):
    tiny = ROOT / "workbench" / "zoo" / "weights" / "tiny"
    at = open_page("tune")
    at.radio(key="tune_model_source").set_value("Local model paths").run()
    msgs = errors_of(at)
    assert any("target model path is empty" in m for m in msgs), msgs
    assert at.button(key="tune_launch").disabled
    at.text_input(key="tune_target_path").input(str(tiny / "nope")).run()
    assert any("does not exist" in m for m in errors_of(at)), errors_of(at)
    at.text_input(key="tune_target_path").input(str(tiny / "target"))
    at.text_input(key="tune_draft_path").input(str(tiny / "draft"))
    at.text_input(key="tune_prompt_path").input(str(tiny / "prompts.jsonl"))
    launch_small_study(at, "local-ui", trials=1)
    [row] = ResultStore(workspace["store"]).load(study="local-ui").to_dict("records")
    assert row["target_path"] == str(tiny / "target") and row["prompts_source"] == str(tiny / "prompts.jsonl")


def test_run_form_leaves_auto_knobs_to_the_engine():
    """An auto knob left on auto puts no flag on the bench command line (bench resolves it per device); on / off and
    an explicit value do, and bench's own parser reads each back as given."""
    import argparse

    from ui.run_page import bench_argv
    from workbench.harness import bench_cli

    def parsed(settings):
        argv = bench_argv(settings, {"preset": "tiny"}, {})
        parser = argparse.ArgumentParser()
        bench_cli.register(parser.add_subparsers())
        return argv, parser.parse_args(argv[3:])

    argv, args = parsed({"cuda_graphs": "auto", "compile": "auto", "batch": 2})
    assert "--cuda-graphs" not in argv and "--no-cuda-graphs" not in argv and "--compile" not in argv
    assert (args.cuda_graphs, args.compile, args.batch) == ("auto", "auto", 2)
    argv, args = parsed({"cuda_graphs": False, "compile": "default"})
    assert "--no-cuda-graphs" in argv and (args.cuda_graphs, args.compile) == (False, "default")
