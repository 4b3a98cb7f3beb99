"""Serving page (ui/serving_page.py, ui/serving_view.py): hand-made serving rows drawn as the right lines and tables,
the launch form's checks, its command line read back by serve-bench's own parser, and a tiny serve-bench started
from the page landing in the store.

Every test works in its own store / jobs folder (the `workspace` fixture of tests/test_app.py).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import pandas as pd
import pytest

from results.store import ResultStore
from tests.test_app import (errors_of, error_next_to, open_page, plotly_figs, wait_for, widget_keys,  # noqa: F401
                            workspace)
from ui import jobs, serving_view as sv

RUN_TIMEOUT_S = 240


def seed_serve_store(root: Path) -> dict[str, str]:
    """Serving rows through the real store (values are fixtures, not measurements): off, fixed k=3 and adaptive
    ngram at rates 1 and 2 (fixed twice at rate 2, for a median), a failed run, and one bench row (never shown).
    Per-request rows: 3 measured requests + 1 warm-up per run."""
    store = ResultStore(root)
    base = {"status": "ok", "run_kind": "serve", "method": "ngram", "k": 3, "ngram_min": 1, "ngram_max": 3,
            "max_num_seqs": 8, "preset": "tiny", "device": "cpu", "k_by_batch": "", "arrival": "poisson",
            "spec_off_acceptance": 0.0, "spec_max_context": 0, "max_new_tokens": 8, "completed": 3}
    settings = {"off": {"method": "ar", "k": 0}, "fixed": {}, "adaptive": {"k_by_batch": "1-2:3,3-8:1"}}
    goodput = {"off": 1.0, "fixed": 2.0, "adaptive": 3.0}
    ids = {}
    for name, extra in settings.items():
        for rate in (1.0, 2.0):
            for rep in ((0, 1) if name == "fixed" and rate == 2.0 else (0,)):
                rec = {**base, **extra, "rate": rate, "goodput": goodput[name] * rate + rep,
                       "tpot_ms_p99": 10.0 * rate + rep, "request_throughput": rate,
                       "ttft_ms_mean": 5.0, "ttft_ms_p50": 4.0, "ttft_ms_p90": 6.0, "ttft_ms_p99": 7.0,
                       "tpot_ms_mean": 2.0, "tpot_ms_p50": 1.5, "tpot_ms_p90": 3.0,
                       "e2el_ms_p50": 40.0, "e2el_ms_p99": 80.0}
                if name != "off":
                    rec["acceptance_by_batch_size"] = json.dumps({"1": 0.75, "2": 0.5, "4": None})
                    rec["acceptance_by_context"] = json.dumps({"0": 0.6, "64": 0.4})
                reqs = pd.DataFrame({"request": [0, 1, 2, 3], "measured": [False, True, True, True],
                                     "prompt_len": [5, 6, 7, 8], "output_len": [8, 8, 8, 8],
                                     "ttft_ms": [999.0, 3.0, 4.0, 5.0], "tpot_ms": [1.0, 2.0, 2.5, 3.0],
                                     "e2el_ms": [9.0, 30.0, 40.0, 50.0]})
                ids[f"{name} {rate:g} {rep}"] = store.append(rec, requests=reqs)
    ids["failed"] = store.append({**base, "status": "failed", "error": "fixture", "rate": 1.0, "goodput": 99.0})
    ids["bench"] = store.append({"status": "ok", "method": "draft", "k": 2, "batch": 1, "tokens_per_s": 10.0})
    return ids


# ---- pure views -------------------------------------------------------------------------------------------------

def test_settings_and_schedules_of_rows():
    row = {"method": "ngram", "k": 3, "max_num_seqs": 16}
    assert sv.setting_of({**row, "k_by_batch": ""}) == "fixed"
    assert sv.setting_of({**row, "method": "ar", "k": 0}) == "off"
    assert sv.setting_of({**row, "spec_off_acceptance": 0.2}) == "adaptive"
    assert sv.setting_of({**row, "spec_max_context": 512}) == "adaptive"
    assert sv.setting_of({**row, "spec_off_queue": 4}) == "adaptive"
    assert sv.line_label({**row, "spec_off_queue": 4}) == "adaptive · ngram k=3 · off while queue>=4"
    # a gap between ranges and sizes above them get k; a range's k is capped at k; max_num_seqs ends the schedule
    assert sv.schedule_of({**row, "k_by_batch": "2-4:5,8-32:0"}) == [(1, 1, 3), (2, 4, 3), (5, 7, 3), (8, 16, 0)]
    assert sv.schedule_of({**row, "method": "ar", "k": 0}) == [(1, 16, 0)]
    snippets = sv.snippets_for({**row, "k_by_batch": "1-4:3,5-16:1"})
    vllm = json.loads(snippets["vllm"])["speculative_config"]
    assert vllm["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 16, 1]]
    assert json.loads(snippets["trtllm"])["speculative_config"]["draft_len_schedule"] == {"4": 3, "16": 1}


def test_rate_lines_are_medians_per_setting(workspace):
    seed_serve_store(workspace["store"])
    runs = sv.serve_runs(ResultStore(workspace["store"]).load())
    assert len(runs) == 8 and (runs["run_kind"] == "serve").all()  # the bench row is not a serving run
    fig = sv.rate_chart(runs, "goodput", "t", "y")
    lines = {t.name: (list(t.x), list(t.y)) for t in fig.data if t.mode == "lines+markers"}
    assert lines == {"off": ([1.0, 2.0], [1.0, 2.0]), "fixed · ngram k=3": ([1.0, 2.0], [2.0, 4.5]),
                     "adaptive · ngram k=3 · 1-2:3,3-8:1": ([1.0, 2.0], [3.0, 6.0])}  # 4.5: median of 4 and 5
    dots = [t for t in fig.data if t.name == "single runs"][0]
    assert len(dots.x) == 7 and 99.0 not in list(dots.y)  # the failed run is left out


def test_percentiles_acceptance_and_request_views(workspace):
    ids = seed_serve_store(workspace["store"])
    store = ResultStore(workspace["store"])
    runs = sv.serve_runs(store.load())
    fixed = runs[runs["run_id"] == ids["fixed 1 0"]]
    table = sv.percentile_table(fixed)
    ttft = table[table["latency"] == "TTFT"].iloc[0]
    assert (ttft["mean"], ttft["p50"], ttft["p90"], ttft["p99"]) == (5.0, 4.0, 6.0, 7.0)
    assert set(table["latency"]) == {"TTFT", "TPOT", "E2EL"}  # nothing recorded for ITL / queue: no row
    external = fixed.assign(server_ttft_ms_mean=3.0, server_queue_ms_mean=0.5, server_prefill_ms_mean=2.5)
    at_server = sv.percentile_table(external).set_index("latency").loc["TTFT at the server"]
    assert at_server["mean"] == 3.0 and at_server[["p50", "p90", "p99"]].isna().all()  # a server's means only
    acc = sv.json_frame(fixed, "acceptance_by_batch_size", "batch_size")
    assert acc[["batch_size", "acceptance"]].values.tolist() == [[1, 0.75], [2, 0.5]]  # a null cell is skipped
    labels = {r["run_id"]: sv.run_label(r) for _, r in fixed.iterrows()}
    box = sv.latency_distribution(store.load_requests(list(labels)), labels, "ttft_ms")
    # a run's label says how the loop ran where that differs from the defaults (worked examples: loop_note's)
    import doctest

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(sv.loop_note, "loop_note", globs={"loop_note": sv.loop_note}):
        runner.run(test)
    assert (runner.failures, runner.tries) == (0, 2)
    row = fixed.iloc[0].copy()
    assert " · loop" not in sv.run_label(row)  # the seeded rows predate the record: no note
    row["loop_overlap"], row["loop_batch_prefill"] = "full", 1
    assert " · loop full, prefill rows 1 · " in sv.run_label(row)
    assert sorted(box.data[0].y) == [3.0, 4.0, 5.0]  # the warm-up request (999 ms) is left out


# ---- the page ---------------------------------------------------------------------------------------------------

def test_serving_page_draws_every_view_and_exports(workspace):
    ids = seed_serve_store(workspace["store"])
    at = open_page("serving")
    assert not at.exception, at.exception
    assert any(c.value == "8 of 8 serving runs" for c in at.caption)
    titles = [f["layout"]["title"]["text"] for f in plotly_figs(at)]
    assert {"Goodput vs request rate", "p99 TPOT vs request rate", "Acceptance by batch size",
            "Acceptance by context length"} <= set(titles), titles
    assert any(t.startswith("Per-request TTFT (ms)") for t in titles)
    assert at.dataframe[0].value["latency"].tolist()[:3] == ["TTFT", "TPOT", "E2EL"]
    at.selectbox(key="srv_export_run").set_value(ids["adaptive 2 0"]).run()
    assert not at.exception, at.exception
    vllm = json.loads(at.code[0].value)
    assert vllm["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 8, 1]]
    assert [b.proto.label for b in at.get("download_button")] == ["Download snippets (JSON)"]
    at.multiselect(key="srv_filter_setting").set_value(["off"]).run()
    assert any(c.value == "2 of 8 serving runs" for c in at.caption)
    at.radio(key="srv_req_metric").set_value("e2el_ms").run()
    assert not at.exception, at.exception


def test_serving_page_empty_store(workspace):
    at = open_page("serving")
    assert not at.exception, at.exception
    assert any("No serving runs in the store yet" in i.value for i in at.info)


def test_serving_form_rejects_bad_input_before_starting(workspace):
    at = open_page("serving")
    at.text_input(key="srv_k_by_batch").input("1-4:4,3-8:2")
    at.text_input(key="srv_rate").input("-1").run()
    assert error_next_to(at, "srv_k_by_batch") == [
        "k_by_batch ranges must increase without overlap: '3-8:2' starts at or before 4"]
    assert error_next_to(at, "srv_rate") == ["rate must be between 0 and 1e+06, got -1"]
    assert at.button(key="srv_start").disabled
    at.text_input(key="srv_k_by_batch").input("1-4:4")
    at.text_input(key="srv_rate").input("5")
    at.selectbox(key="srv_arrival").set_value("concurrency").run()  # a rule between knobs, from check_serve
    assert any("arrival concurrency needs --max-concurrency" in m for m in errors_of(at)), errors_of(at)
    assert at.button(key="srv_start").disabled
    assert not jobs.list_jobs()


def test_serving_form_shows_gpu_knobs_only_where_a_gpu_is_visible(workspace, monkeypatch):
    from ui import gpu_page
    from workbench.settings import GPU_ONLY_KNOBS, SERVE_RUN_KNOBS

    gpu_keys = {f"srv_{n}" for n in GPU_ONLY_KNOBS if n in SERVE_RUN_KNOBS}
    assert {"srv_cuda_graphs", "srv_pdl"} <= gpu_keys
    for visible in (False, True):
        monkeypatch.setattr(gpu_page, "gpu_state", lambda v=visible: {"cuda_available": v, "reason": "fixture"})
        at = open_page("serving")
        assert not at.exception, at.exception
        keys = widget_keys(at)
        assert (gpu_keys <= keys) is visible and bool(gpu_keys & keys) is visible
        assert {"srv_rate", "srv_k", "srv_max_num_seqs"} <= keys


def test_form_command_line_reads_back_as_the_same_config():
    """serve_argv -> serve-bench's own argparse -> ServeConfig: every setting arrives as set."""
    from ui.serving_page import serve_argv
    from workbench.serving import cli
    from workbench.serving.config import ServeConfig

    s = {"method": "ngram", "k": 2, "ngram_min": 2, "ngram_max": 3, "rate": 7.5, "arrival": "gamma",
         "burstiness": 0.5, "prefix_caching": True, "cuda_graphs": False, "graph_batch_sizes": (1, 2, 4),
         "k_by_batch": "1-2:2,3-16:1", "sched_policy": "max_util", "spec_off_acceptance": 0.25, "num_requests": 9}
    argv = serve_argv(s, "tiny", "cpu")
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(argv[3:])
    cfg = ServeConfig(**{f.name: getattr(args, f.name) for f in fields(ServeConfig)})
    for name, value in s.items():
        assert getattr(cfg, name) == value, name
    assert args.preset == "tiny" and args.device == "cpu" and args.json and args.store


def test_tiny_serve_run_from_the_page_lands_in_the_store(workspace):
    at = open_page("serving")
    at.text_input(key="srv_num_requests").input("3")
    at.text_input(key="srv_max_new_tokens").input("6")
    at.selectbox(key="srv_device").set_value("cpu").run()
    assert not errors_of(at), errors_of(at)
    at.button(key="srv_start").click().run()
    assert not at.exception, at.exception
    [job] = jobs.list_jobs(kind="serve")
    assert job.meta["argv"][1:5] == ["-m", "workbench", "serve-bench", "--preset"]
    assert wait_for(job, RUN_TIMEOUT_S) == jobs.DONE, job.log_tail()
    [row] = ResultStore(workspace["store"]).load().to_dict("records")
    assert row["run_kind"] == "serve" and row["method"] == "ngram" and row["completed"] == 3
    at.run()
    assert not at.exception, at.exception
    assert "Requests/s" in [m.label for m in at.metric]  # the finished job's headline
    assert any(c.value == "1 of 1 serving runs" for c in at.caption)


def _calibrated_rows() -> tuple[dict, dict]:
    """A loop-calibrated run (a measured table from the H200; served with the old free rule, so no
    calibration_shape column) and a step-calibrated one."""
    from tests.test_serving_calibration import CALL_X

    measured = [{"batch_size": b, "k": k, "tokens_per_s": rate, "chosen": False} for b, row in CALL_X.items()
                for k, rate in enumerate(row)]
    served = {1: 4, 2: 4, 4: 4, 8: 4, 16: 0, 32: 3, 64: 2}
    for m in measured:
        m["chosen"] = served[m["batch_size"]] == m["k"]
    measured.append({"batch_size": 64, "k": 5, "tokens_per_s": None, "skipped": True})
    base = {"status": "ok", "run_kind": "serve", "method": "ngram", "k": 4, "max_num_seqs": 64, "rate": 1.0,
            "preset": "small", "device": "cuda", "calibration": "loop", "goodput": 1.0, "tpot_ms_p99": 2.0}
    loop = {**base, "k_by_batch": "1-8:4,9-16:0,17-32:3,33-64:2",
            "calibration_table": json.dumps({"measured": measured, "schedule": []})}
    step = {**base, "calibration": "step", "k_by_batch": "1-2:4,3-64:0", "max_num_seqs": 4, "calibration_table":
            json.dumps({"measured": [{"batch_size": b, "k": k, "step_ms": 1.0 + k, "mean_tokens": 1.0 + k / 2,
                                      "tokens_per_ms": b * (1.0 + k / 2) / (1.0 + k)}
                                     for b in (1, 2, 4) for k in (0, 4)], "schedule": []})}
    return loop, step


def test_calibration_views_read_the_stored_table():
    loop, step = _calibrated_rows()
    frame, kind = sv.calibration_frame(loop)
    assert kind == "loop" and len(frame) == 36 and frame["skipped"].sum() == 1
    assert set(zip(frame.loc[frame["chosen"], "batch_size"], frame.loc[frame["chosen"], "k"])) == {
        (1, 4), (2, 4), (4, 4), (8, 4), (16, 0), (32, 3), (64, 2)}
    assert sv.schedule_shapes(loop, frame) == {"sticky": "1-8:4,9-64:2", "monotone": "1-8:4,9-64:2",
                                               "free": "1-8:4,9-16:2,17-64:3"}
    assert not sv.calibration_uniform(loop)
    uniform = {**loop, "calibration_table": json.dumps({**json.loads(loop["calibration_table"]), "uniform": True})}
    assert sv.calibration_uniform(uniform) and not sv.calibration_uniform({**loop, "calibration_table": "{bad"})
    assert sv.schedule_shapes(uniform, frame) == {"sticky": "1-64:2", "monotone": "1-64:2", "free": "1-64:3"}
    fig = sv.calibration_chart(frame, kind)
    assert fig.data[0].z.shape == (7, 6) and "9738.6 *" in fig.data[0].text[4][0].replace(",", "")
    frame, kind = sv.calibration_frame(step)
    assert kind == "step" and sv.schedule_shapes(step, frame)  # recomputable, though step runs do not use it
    assert set(zip(frame.loc[frame["chosen"], "batch_size"], frame.loc[frame["chosen"], "k"])) == {
        (1, 4), (2, 4), (4, 0)}
    for bad in (None, "", "not json", json.dumps({"measured": []}), json.dumps({"schedule": []})):
        assert sv.calibration_frame({"calibration_table": bad}) is None


def test_serving_page_shows_a_calibrated_runs_table(workspace):
    loop, step = _calibrated_rows()
    store = ResultStore(workspace["store"])
    ids = {"loop": store.append(loop), "step": store.append(step)}
    at = open_page("serving")
    assert not at.exception, at.exception
    at.selectbox(key="srv_calibration_run").set_value(ids["loop"]).run()
    assert not at.exception, at.exception
    titles = [f["layout"]["title"]["text"] for f in plotly_figs(at)]
    assert "Calibration: output tokens/s of a closed-loop serve (* = served)" in titles
    text = " ".join(m.value for m in at.markdown)
    assert "served: `1-8:4,9-16:0,17-32:3,33-64:2` (free (a run from before calibration_shape))" in text
    assert "monotone: `1-8:4,9-64:2`" in text and "free: `1-8:4,9-16:2,17-64:3`" in text
    assert "sticky: `1-8:4,9-64:2`" in text
    at.selectbox(key="srv_calibration_run").set_value(ids["step"]).run()
    assert not at.exception, at.exception
    titles = [f["layout"]["title"]["text"] for f in plotly_figs(at)]
    assert any(t.startswith("Calibration: tokens per ms") for t in titles)


def test_serving_form_offers_trees_with_their_knobs_and_named_errors(workspace):
    """eagle and redrafter are served: picking one shows its tree / beam knobs (from the registry, no k); a tree the
    knobs cannot build and prefix caching with a feature drafter are named errors that keep the run from starting."""
    at = open_page("serving")
    at.selectbox(key="srv_method").set_value("eagle").run()
    assert not at.exception, at.exception
    keys = widget_keys(at)
    assert {"srv_tree_depth", "srv_tree_topk", "srv_tree_budget", "srv_greedy_check_requests"} <= keys
    assert "srv_k" not in keys and "srv_beam_width" not in keys
    assert not errors_of(at), errors_of(at)
    at.text_input(key="srv_tree_depth").input("2")
    at.text_input(key="srv_tree_topk").input("2")
    at.text_input(key="srv_tree_budget").input("9").run()
    assert "tree_budget=9 exceeds the 6 candidates that tree_depth=2, tree_topk=2 offer (K + (D-1) K^2): lower " \
        "tree_budget or raise tree_topk / tree_depth" in errors_of(at)  # a rule between knobs, from check_serve
    assert at.button(key="srv_start").disabled
    at.text_input(key="srv_tree_budget").input("6")
    at.toggle(key="srv_prefix_caching").set_value(True).run()
    assert any("prefix caching with method 'eagle' is not supported" in m for m in errors_of(at)), errors_of(at)
    at.toggle(key="srv_prefix_caching").set_value(False).run()
    assert not errors_of(at) and not at.button(key="srv_start").disabled
    at.selectbox(key="srv_method").set_value("redrafter").run()
    assert {"srv_beam_width", "srv_beam_length", "srv_diversity_penalty"} <= widget_keys(at)
    assert not jobs.list_jobs()


def test_tree_knobs_on_the_command_line_read_back():
    from ui.serving_page import serve_argv
    from workbench.serving import cli
    from workbench.serving.config import ServeConfig

    s = {"method": "eagle", "tree_depth": 3, "tree_topk": 2, "tree_budget": 6, "rate": 4.0, "k_by_batch": "1-2:1",
         "greedy_check_requests": 5}
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(serve_argv(s, "tiny", "cpu")[3:])
    cfg = ServeConfig(**{f.name: getattr(args, f.name) for f in fields(ServeConfig)})
    for name, value in s.items():
        assert getattr(cfg, name) == value, name


def test_tree_rows_are_labelled_by_shape():
    row = {"method": "eagle", "k": 4, "tree_depth": 4, "tree_topk": 4, "tree_budget": 16, "k_by_batch": "1-4:1"}
    assert sv.line_label(row) == "adaptive · eagle D4 K4 N16 · 1-4:1"
    assert sv.line_label({"method": "redrafter", "k": 4, "beam_width": 2, "beam_length": 4}) == \
        "fixed · redrafter W2 L4"
    assert sv.fidelity_note({"greedy_matches_solo": None}).endswith(
        "not checked (sampling, or greedy_check_requests 0)")


# ---- an OpenAI-compatible endpoint as the source ----------------------------------------------------------------

@pytest.fixture()
def started(monkeypatch):
    """jobs.start_job recorded, not run: the command line is what these tests check (no server is listening)."""
    calls = []

    class Started:
        id = "serve-fixture"

    def fake(kind, argv, title, params=None, env=None):
        calls.append({"kind": kind, "argv": argv, "title": title, "params": params})
        return Started()

    monkeypatch.setattr(jobs, "start_job", fake)
    return calls


def _endpoint_page():
    at = open_page("serving")
    at.radio(key="srv_source").set_value("endpoint").run()
    assert not at.exception, at.exception
    return at


def test_endpoint_source_starts_serve_bench_against_the_url(workspace, started):
    from workbench.serving import cli
    from workbench.serving.config import ServeConfig

    at = _endpoint_page()
    assert "srv_method" not in widget_keys(at) and {"srv_ep_url", "srv_rate", "srv_num_requests"} <= widget_keys(at)
    at.text_input(key="srv_ep_url").input("http://10.1.2.3:8011")
    at.text_input(key="srv_ep_model").input("llama-8b")
    at.text_input(key="srv_rate").input("4.5")
    at.text_input(key="srv_num_requests").input("7").run()
    assert not errors_of(at), errors_of(at)
    at.button(key="srv_ep_start").click().run()
    assert not at.exception, at.exception
    [call] = started
    argv = call["argv"]
    assert argv[1:4] == ["-m", "workbench", "serve-bench"] and call["kind"] == "serve"
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(argv[3:])  # serve-bench's own parser reads it back
    cfg = ServeConfig(**{f.name: getattr(args, f.name) for f in fields(ServeConfig)})
    assert args.endpoint == "http://10.1.2.3:8011" and args.model == "llama-8b"
    assert (cfg.rate, cfg.num_requests, cfg.max_new_tokens) == (4.5, 7, 16)
    assert args.json and args.store == str(workspace["store"]) and args.preset is None  # built-in prompts


def test_endpoint_template_starts_a_launch_study(workspace, started, monkeypatch):
    import studies.serving as studies_serving

    at = _endpoint_page()
    at.text_input(key="srv_ep_url").input("not a url")  # unused with a template: the launcher picks the port
    at.text_area(key="srv_ep_template").input("python -m workbench serve --port {port} --k {k} --w {w}").run()
    assert at.text_input(key="srv_ep_url").disabled
    assert error_next_to(at, "srv_ep_search") == [
        "--launch has {k} but no --search k=...: give its values (one value fixes it)"]
    at.text_area(key="srv_ep_search").input("k=1,2,3\nw=4").run()
    at.text_input(key="srv_ep_study").input("ep-k")
    at.text_input(key="srv_ep_trials").input("3")
    at.text_input(key="srv_rate").input("2").run()
    assert not errors_of(at), errors_of(at)
    assert at.button(key="srv_ep_start").label == "Start launch study"
    at.button(key="srv_ep_start").click().run()
    assert not at.exception, at.exception
    [call] = started
    argv = call["argv"]
    assert argv[1:3] == ["-m", "studies.serving"]
    read = {}  # studies.serving's own parser reads it back; the launch itself is not run here
    monkeypatch.setattr(studies_serving, "launch_main", lambda args, base: read.update(args=args, base=base) or 0)
    assert studies_serving.main(argv[3:]) == 0
    args, base = read["args"], read["base"]
    assert args.launch == "python -m workbench serve --port {port} --k {k} --w {w}"
    assert args.search == ["k=1,2,3", "w=4"] and (args.study, args.trials, args.launch_timeout) == ("ep-k", 3, 300)
    assert (base.rate, base.num_requests, base.max_new_tokens) == (2.0, 8, 16)
    assert args.store == str(workspace["store"]) and args.storage == f"journal://{workspace['journal']}"
    assert args.served_model is None and "--endpoint" not in argv  # the launcher picks the port; no model named


def test_endpoint_form_refuses_a_bad_url_and_a_template_off_its_search(workspace, started):
    at = _endpoint_page()
    at.text_input(key="srv_ep_url").input("127.0.0.1:8000").run()
    assert error_next_to(at, "srv_ep_url") == [
        "server URL must start with http:// or https:// (e.g. http://127.0.0.1:8000), got '127.0.0.1:8000'"]
    assert at.button(key="srv_ep_start").disabled
    at.text_input(key="srv_ep_url").input("http://127.0.0.1:8000").run()
    assert not errors_of(at) and not at.button(key="srv_ep_start").disabled
    at.text_area(key="srv_ep_template").input("vllm serve m --port {port} --num-speculative-tokens {k}")
    at.text_area(key="srv_ep_search").input("n=1,2").run()
    assert error_next_to(at, "srv_ep_search") == [
        "--search n is not a placeholder of --launch (its placeholders: k): add {n} to the template"]
    assert at.button(key="srv_ep_start").disabled
    at.text_area(key="srv_ep_template").input("vllm serve m --port {port} --k {k").run()
    assert error_next_to(at, "srv_ep_template") and "literal braces" in error_next_to(at, "srv_ep_template")[0]
    at.text_area(key="srv_ep_template").input("").run()
    assert error_next_to(at, "srv_ep_search") == [
        "search values need a launch template: give the server's command line with {name} placeholders, or clear "
        "the search values"]
    assert at.button(key="srv_ep_start").disabled
    at.text_area(key="srv_ep_search").input("").run()
    assert not errors_of(at) and not at.button(key="srv_ep_start").disabled
    assert not started


def test_endpoint_run_from_the_page_stores_its_row(workspace):
    """The command really runs: against a port nobody listens on, serve-bench stores a failed row naming the URL."""
    from workbench.serving.launcher import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    at = _endpoint_page()
    at.text_input(key="srv_ep_url").input(url)
    at.text_input(key="srv_num_requests").input("2").run()
    at.button(key="srv_ep_start").click().run()
    assert not at.exception, at.exception
    [job] = jobs.list_jobs(kind="serve")
    assert wait_for(job, RUN_TIMEOUT_S) == jobs.FAILED, job.log_tail()
    assert "is an OpenAI-compatible server running there?" in job.log_tail()
    [row] = ResultStore(workspace["store"]).load().to_dict("records")
    assert row["status"] == "failed" and row["endpoint"] == url and row["run_kind"] == "serve"
    at.run()
    assert not at.exception, at.exception


def test_the_forms_launch_checks_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, studies.launch, workbench.serving.launcher; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "False"


def _values(y) -> list:
    """A Plotly figure's array as the page sends it: a list, or typed bytes ({"dtype", "bdata"} in base64)."""
    if isinstance(y, dict):
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(y["bdata"]), dtype=y["dtype"]).tolist()
    return list(y)


def test_external_rows_show_beside_ours_labelled_by_their_engine(workspace):
    store = ResultStore(workspace["store"])
    base = {"status": "ok", "run_kind": "serve", "rate": 2.0, "goodput": 3.0, "tpot_ms_p99": 12.0,
            "max_new_tokens": 16, "completed": 8, "arrival": "poisson"}
    ours = store.append({**base, "method": "ngram", "k": 3, "k_by_batch": "", "preset": "tiny", "device": "cpu",
                         "max_num_seqs": 8})
    theirs = store.append({**base, "goodput": 5.0, "endpoint": "http://10.1.2.3:8011", "engine_name": "vllm",
                           "engine_version": "0.11.0", "served_model": "llama", "method": None, "k": None,
                           "launch_command": "vllm serve llama --port 8011 --k 4", "launch_params": "k=4"})
    at = open_page("serving")
    assert not at.exception, at.exception
    fig = [f for f in plotly_figs(at) if f["layout"]["title"]["text"] == "Goodput vs request rate"][0]
    lines = {t["name"]: _values(t["y"]) for t in fig["data"] if t.get("mode") == "lines+markers"}
    assert lines == {"fixed · ngram k=3": [3.0], "external · vllm 0.11.0 @ 10.1.2.3:8011 · k=4": [5.0]}
    runs = sv.serve_runs(store.load())
    assert sv.setting_of(runs[runs["run_id"] == theirs].iloc[0]) == "external"
    labels = at.multiselect(key="srv_runs").options
    assert any("external · vllm 0.11.0 @ 10.1.2.3:8011 · k=4" in o for o in labels), labels
    assert at.selectbox(key="srv_export_run").options == [sv.run_label(runs[runs["run_id"] == ours].iloc[0])]
