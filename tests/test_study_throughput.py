"""Study throughput (issue 8): trial-time columns, what a session keeps across trials, scripts/study_throughput.py.

Real engine on the committed tiny models (CPU, a few tokens per run); no timing is asserted, only that the columns
exist, add up, and that what is reused gives the same results as what is rebuilt.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.util
import math
from pathlib import Path

import optuna
import pytest

from results.schema import RUN_COLUMNS, run_specs
from results.store import ResultStore
from studies.objective import ModelSpec
from studies.scripts import get_script
from studies.space import RunSettings
from studies.storage import open_storage
from studies.study import StudySpec, create_or_resume, run_trials
from workbench.harness import bench as bench_mod
from workbench.harness.bench import BenchConfig, BenchSession

ROOT = Path(__file__).resolve().parents[1]
BENCH_PARTS = ("trial_engine_s", "trial_warmup_s", "trial_quality_s")
PASS_PARTS = ("wall_prefill_s", "wall_decode_s", "wall_setup_s", "wall_finish_s", "wall_other_s")
STUDY_PARTS = ("trial_s", "trial_other_s", "trial_prev_store_s")

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def session():
    return BenchSession.load(preset="tiny", device="cpu", dtype="float32")


def small(**kw):
    base = dict(k=3, batch=2, max_new_tokens=8, num_prompts=4, warmup=1, repeats=1, cuda_graphs=True)
    base.update(kw)
    return BenchConfig(**base)


def _load_script():
    spec = importlib.util.spec_from_file_location("study_throughput", ROOT / "scripts" / "study_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trial_time_columns_are_declared_in_one_group():
    specs = run_specs()
    for name in BENCH_PARTS + STUDY_PARTS + PASS_PARTS:
        assert name in RUN_COLUMNS and specs[name].kind == "float" and specs[name].group == "trial_time", name


def test_a_run_records_where_its_time_went(session):
    rec = session.run(small(method="ngram")).record
    for name in BENCH_PARTS:
        assert isinstance(rec[name], float) and rec[name] >= 0.0, (name, rec[name])
    assert rec["wall_s"] > 0
    assert all(name not in rec for name in STUDY_PARTS)  # only a study's worker loop knows these


def test_the_timed_passes_are_split_into_prefill_decode_and_the_rest(session):
    rec = session.run(small(method="draft", repeats=2)).record
    for name in PASS_PARTS:
        assert isinstance(rec[name], float) and rec[name] >= 0.0, (name, rec[name])
    assert rec["wall_prefill_s"] > 0 and rec["wall_decode_s"] > 0
    assert sum(rec[name] for name in PASS_PARTS) == pytest.approx(rec["wall_s"])


def test_prefill_plus_decode_is_the_tokens_per_s_window(session):
    # method "ar", 1 repeat: the timed passes are the one AR pass that tokens/s is computed from
    rec = session.run(small(method="ar", repeats=1, warmup=0)).record
    window = rec["wall_prefill_s"] + rec["wall_decode_s"]
    assert rec["tokens_per_s"] == pytest.approx(rec["total_new_tokens"] / window, rel=1e-9)
    assert window < rec["wall_s"]  # the per-call setup and finish are outside it


def test_pass_split_doctest():
    import doctest

    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(bench_mod.PassSplit, "PassSplit", globs=vars(bench_mod)):
        runner.run(test)
    assert runner.tries >= 3 and runner.failures == 0


def test_study_rows_carry_trial_time_and_the_previous_store_write(tmp_path, session):
    s = get_script("best_k")
    spec = StudySpec(script=s.name, objective=s.objective, space=dataclasses.replace(s.space, methods=("ngram",)),
                     settings=RunSettings(max_new_tokens=8, num_prompts=2, repeats=1, warmup=1),
                     models=ModelSpec(preset="tiny"))
    study, spec = create_or_resume(open_storage(f"sqlite:///{tmp_path}/s.db"), "thr", spec, target_trials=3)
    store = ResultStore(tmp_path / "store")
    assert run_trials(study, spec, store=store, device="cpu", session_for=lambda dtype: session) == 3
    df = store.load(study="thr").sort_values("created_at").reset_index(drop=True)
    assert df["trial_prev_store_s"].isna().tolist() == [True, False, False]  # a row cannot time its own write
    assert (df["trial_prev_store_s"].iloc[1:] > 0).all()
    for _, row in df.iterrows():
        parts = sum(float(row[c]) for c in ("trial_engine_s", "trial_warmup_s", "wall_s", "trial_quality_s"))
        # the parts are measured inside the trial's span, so what is left is never negative
        assert float(row["trial_s"]) >= parts and row["trial_other_s"] == pytest.approx(row["trial_s"] - parts)


def test_ngram_sizes_share_one_engine_and_its_results_equal_a_fresh_one(session):
    session._engines.clear()
    first = session.run(small(method="ngram", ngram_min=1, ngram_max=1))
    engines = dict(session._engines)
    second = session.run(small(method="ngram", ngram_min=2, ngram_max=3))
    assert session._engines.keys() == engines.keys()  # no engine was built for the new n-gram sizes
    shared = [e for e in session._engines.values() if e.drafter is not None]
    assert len(shared) == 1 and shared[0].drafter.settings == {"k": 3, "ngram_min": 2, "ngram_max": 3}
    fresh = BenchSession.load(preset="tiny", device="cpu", dtype="float32").run(
        small(method="ngram", ngram_min=2, ngram_max=3))
    assert second.outputs == fresh.outputs and second.record["greedy_matches_ar"] is True
    for key in ("acceptance_rate", "mean_accepted_tokens", "target_steps"):
        assert second.record[key] == fresh.record[key], key
    assert first.record["ngram_max"] == 1 and second.record["ngram_max"] == 3


def test_the_engine_cache_drops_the_oldest_beyond_its_size(session, monkeypatch):
    monkeypatch.setattr(bench_mod, "ENGINE_CACHE_SIZE", 2)
    session._engines.clear()
    for k in (1, 2, 3):
        session.run(small(method="draft", k=k, warmup=0))
    keys = list(session._engines)
    assert len(keys) == 2 and keys[0][0] == "ar" and keys[1][:2] == ("draft", 3)  # draft k=1 and k=2 dropped
    assert not session._engines_over_memory()  # CPU: no device memory bound


def test_the_engine_cache_holds_the_whole_best_k_space(session):
    """AR plus draft and n-gram at k 1-8: a study that has visited every setting rebuilds (and recaptures) none."""
    session._engines.clear()
    space = [(m, k) for m in ("draft", "ngram") for k in range(1, 9)]
    tiny = dict(batch=1, max_new_tokens=2, num_prompts=1, warmup=0)
    for method, k in space:
        session.run(small(method=method, k=k, **tiny))
    kept = {id(e) for e in session._engines.values()}
    assert len(kept) == 1 + len(space)
    for method, k in space:  # every setting again: the same engines
        session.run(small(method=method, k=k, **tiny))
    assert {id(e) for e in session._engines.values()} == kept


def test_engine_bytes_count_the_target_and_draft_caches(session):
    session.run(small(method="draft", k=2, warmup=0))
    engine = next(e for key, e in session._engines.items() if key[:2] == ("draft", 2))
    assert bench_mod._engine_bytes(engine) == engine.cache.nbytes + engine.drafter.cache.nbytes > 0  # no graphs on CPU


def test_prompts_are_encoded_once_and_callers_get_copies(session):
    n = len(session.prompts) + 2  # cycles past the end, like before
    expected = [session.tokenizer.encode(session.prompts[i % len(session.prompts)].text).ids for i in range(n)]
    got = session.encode(n)
    assert got == expected
    got[0].append(-1)
    assert session.encode(1)[0] == expected[0]


def test_environment_is_read_once_per_session(monkeypatch):
    import workbench.harness.telemetry as T

    calls = []
    real = T.environment_info
    monkeypatch.setattr(T, "environment_info", lambda device=None: calls.append(device) or real(device))
    s = BenchSession.load(preset="tiny", device="cpu", dtype="float32")
    a, b = s.run(small(method="ar", warmup=0)).record, s.run(small(method="ar", warmup=0)).record
    assert len(calls) == 1 and a["git_commit"] == b["git_commit"] and a["torch_version"] == b["torch_version"]


# ---------------------------------------------------------------------------------------------- the script
def test_script_refuses_bad_settings_before_any_work(tmp_path, capsys):
    mod = _load_script()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("old")
    cases = [(["--seconds", "3"], "--seconds 3.0: give at least 10"),
             (["--device", "tpu"], "--device 'tpu': use cpu, cuda or cuda:N"),
             (["--preset", "no-such-preset"], "this script never trains"),
             (["--out", str(tmp_path / "full")], "is not empty")]
    for extra, message in cases:
        args = ["--device", "cpu", "--preset", "tiny", "--out", str(tmp_path / "new")] + extra
        assert mod.main(args) == 2
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "new").exists()


def test_summary_counts_steady_rate_and_breakdown(tmp_path):
    mod = _load_script()
    store = ResultStore(tmp_path / "store")
    t0 = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    for i in range(5):  # rows 6 s apart; the last one a failure (a trial cancelled at the window's end)
        ok = i < 4
        store.append({"study": "throughput", "trial_id": i, "status": "ok" if ok else "failed",
                      "method": "ngram" if i % 2 else "draft", "created_at": t0 + dt.timedelta(seconds=6 * i),
                      "trial_engine_s": 0.5 if ok else None, "trial_warmup_s": 0.25 if ok else None,
                      "wall_s": 4.0 if ok else None, "trial_quality_s": 0.0 if ok else None,
                      "trial_other_s": 1.0 if ok else None, "trial_prev_store_s": None if i == 0 else 0.25,
                      "device_name": "cpu (x86_64)", "git_commit": "abc",
                      **({"wall_prefill_s": 0.5, "wall_decode_s": 3.0, "wall_setup_s": 0.125, "wall_finish_s": 0.25,
                          "wall_other_s": 0.125} if ok and i > 1 else {})})  # row 1: written before the split
    args = mod.build_parser().parse_args(["--device", "cpu", "--preset", "tiny", "--out", str(tmp_path)])
    s = mod.summarize(tmp_path / "store", {"started_at": t0.timestamp() - 10, "stopped": "test", "exit_code": 0},
                      args)
    assert s["trials_completed"] == 4 and s["trials_failed"] == 1
    assert s["steady_span_s"] == pytest.approx(18.0) and s["trials_per_minute"] == pytest.approx(10.0)
    assert s["trials_per_10_min"] == pytest.approx(100.0) and s["goal_met"] is False
    parts = s["breakdown_s"]  # the first completed row is start-up: rows 1-3
    assert parts["timed passes"] == 4.0 and parts["store write"] == 0.25 and parts["everything else"] == 1.0
    assert parts["sum of parts"] == pytest.approx(6.0)  # = the 6 s between rows
    assert s["breakdown_by_method_s"]["ngram"]["trials"] == 2 and s["breakdown_by_method_s"]["draft"]["trials"] == 1
    table = mod.markdown(s)
    assert "| 4 | 1 | 18.0 s | 10.00 | **100** (missed) | 6.00 |" in table
    assert "| timed passes | 4.000 |" in table
    assert math.isclose(s["first_row_s"], 10.0)
    split = s["pass_split_s"]  # rows 2-3 have it; row 1 (older) does not count
    assert split["prefill (first tokens)"] == 0.5 and split["decode steps"] == 3.0
    assert split["sum of parts"] == pytest.approx(parts["timed passes"])
    assert "| per-call finish (after the last token) | 0.250 |" in table


def test_nvml_is_initialized_once_per_process(monkeypatch):
    import sys
    import types

    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=lambda: calls.append(1)))
    monkeypatch.setattr(bench_mod, "_NVML_HELD", [])
    bench_mod._hold_nvml()
    bench_mod._hold_nvml()
    assert calls == [1]

    def broken():
        raise OSError("no driver")
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=broken))
    monkeypatch.setattr(bench_mod, "_NVML_HELD", [])
    bench_mod._hold_nvml()  # best effort: no error, and nothing held
    assert bench_mod._NVML_HELD == []
