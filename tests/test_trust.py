"""Spread and plausibility of a run (workbench.harness.trust): hand-built cases, the docstring examples, and the
columns in a real tiny bench record."""
import doctest

import pytest

from workbench.harness import trust as T


def test_docstring_examples():
    assert doctest.testmod(T).failed == 0


def test_ngram_k1_with_3_19x_is_implausible():
    # n-gram k=1: at most 2 tokens per step (1 draft + the bonus); measured mean accepted 1.8
    cols = T.trust_columns([100.0, 101.0, 99.0], [319.0, 320.0, 318.0], 3.19, 1.8, 0.8)
    assert cols["plausible"] is False
    assert "speedup 3.19x > bound 1.98x" in cols["implausible_reason"]
    assert cols["noisy"] is False  # tight repeats: the flag is about plausibility, not spread


def test_clean_run_passes():
    cols = T.trust_columns([100.0, 102.0, 99.0], [150.0, 153.0, 149.0], 1.5, 2.4, 0.7, cost_ratio=0.05,
                           draft_forwards_per_step=4)
    assert cols["plausible"] is True and cols["implausible_reason"] is None
    assert cols["noisy"] is False and cols["noisy_reason"] is None
    assert cols["speedup_ci_low"] <= 1.5 <= cols["speedup_ci_high"]
    assert 0 < cols["ar_tokens_per_s_cv"] < 0.02 and 0 < cols["tokens_per_s_cv"] < 0.02


def test_one_repeat_has_no_spread():
    cols = T.trust_columns([100.0], [150.0], 1.5, 2.0, 0.5)
    assert cols["noisy"] is None and cols["noisy_reason"] == "1 repeat: no spread"
    assert cols["speedup_ci_low"] is None and cols["speedup_ci_high"] is None
    assert cols["ar_tokens_per_s_cv"] is None and cols["tokens_per_s_cv"] is None
    assert cols["plausible"] is True  # the bounds need no spread


def test_cost_ratio_tightens_the_bound_only_when_known():
    assert T.plausibility(1.8, 2.0, 0.5, [100.0, 100.0])[0] is True  # bound 2.0 (+10 %)
    ok, why = T.plausibility(1.8, 2.0, 0.5, [100.0, 100.0], cost_ratio=0.5, draft_forwards_per_step=2)
    assert ok is False and "cost ratio 0.5" in why  # bound 2.0 / (1 + 0.5 * 2) = 1.0


def test_acceptance_outside_unit_interval_and_drift_are_implausible():
    assert "acceptance rate -0.1" in T.plausibility(1.0, 1.0, -0.1, [100.0])[1]
    ok, why = T.plausibility(1.0, 1.0, None, [100.0, 200.0, 150.0])
    assert ok is False and "AR baseline drifted" in why


def test_interval_straddling_one_under_a_clear_headline_is_noisy():
    ar, cand = [100.0, 100.0, 100.0, 100.0], [60.0, 140.0, 150.0, 145.0]
    s = T.spread(ar, cand, 1.42)
    assert s.speedup_ci_low < 1.0 < s.speedup_ci_high and s.noisy is True
    assert "includes 1.0" in s.noisy_reason and "CV" in s.noisy_reason
    assert T.spread(ar, cand, 1.02).noisy_reason.count("includes 1.0") == 0  # "about even" is not contradicted


def test_interval_is_seeded():
    ar, cand = [100.0, 90.0, 110.0, 95.0], [130.0, 150.0, 120.0, 160.0]
    assert T.speedup_interval(ar, cand) == T.speedup_interval(ar, cand)
    with pytest.raises(ValueError):
        T.speedup_interval([1.0], [1.0, 2.0])


def test_columns_are_declared_in_the_schema():
    from results.schema import RUN_COLUMNS, run_specs

    cols = T.trust_columns([1.0, 1.0], [1.0, 1.0], 1.0, 1.0, None)
    assert set(cols) <= set(RUN_COLUMNS)
    assert {run_specs()[c].group for c in cols} == {"trust"}


def test_real_tiny_bench_record_has_the_trust_columns(tmp_path):
    from results.store import ResultStore
    from workbench.harness.bench import BenchConfig, BenchSession

    session = BenchSession.load(preset="tiny", device="cpu")
    rec = session.run(BenchConfig(method="ngram", k=2, batch=2, max_new_tokens=8, num_prompts=2, warmup=0,
                                  repeats=3)).record
    assert len(rec["ar_tokens_per_s_repeats"]) == 3 and len(rec["tokens_per_s_repeats"]) == 3
    for c in ("ar_tokens_per_s_cv", "tokens_per_s_cv", "speedup_ci_low", "speedup_ci_high"):
        assert isinstance(rec[c], float), c
    assert rec["speedup_ci_low"] <= rec["speedup_ci_high"]
    assert isinstance(rec["noisy"], bool) and isinstance(rec["plausible"], bool)
    assert (rec["noisy_reason"] is None) is (not rec["noisy"])
    assert (rec["implausible_reason"] is None) is rec["plausible"]
    store = ResultStore(tmp_path)
    store.append(rec)
    row = store.load().iloc[0]
    assert row["plausible"] == rec["plausible"] and list(row["tokens_per_s_repeats"]) == rec["tokens_per_s_repeats"]


def test_bench_cli_threads_flag_and_trust_columns(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-m", "workbench", "bench", "--preset", "tiny", "--device", "cpu",
                          "--threads", "1", "--method", "ngram", "--max-new-tokens", "4", "--num-prompts", "1",
                          "--repeats", "2", "--warmup", "0", "--no-store", "--json"],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["repeats"] == 2 and len(rec["tokens_per_s_repeats"]) == 2 and isinstance(rec["noisy"], bool)


def test_dashboard_jobs_run_with_a_thread_limit(tmp_path, monkeypatch):
    from ui import jobs

    seen = {}

    class FakePopen:
        pid = 12345

        def __init__(self, argv, env, **kw):
            seen.update(env)

    monkeypatch.setenv("WORKBENCH_JOBS", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(jobs.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(jobs, "_RUNNERS", {})
    jobs.start_job("bench", ["true"], "t")
    assert seen["OMP_NUM_THREADS"] == str(jobs.JOB_THREADS) and int(seen["OMP_NUM_THREADS"]) >= 1
    jobs.start_job("bench", ["true"], "t", env={"OMP_NUM_THREADS": "3"})  # an explicit choice is kept
    assert seen["OMP_NUM_THREADS"] == "3"


def test_run_page_shows_the_flags_with_their_reasons():
    from streamlit.testing.v1 import AppTest

    def page():
        import pandas as pd

        from ui.run_page import show_metrics

        show_metrics({"status": "ok", "method": "ngram", "k": 1, "speedup_vs_ar": 3.19, "plausible": False,
                      "implausible_reason": "speedup 3.19x > bound 2.2x", "noisy": True,
                      "noisy_reason": "AR tokens/s CV 0.31 > 0.15", "speedup_ci_low": 0.9, "speedup_ci_high": 4.0},
                     pd.DataFrame())

    at = AppTest.from_function(page).run(timeout=60)
    assert not at.exception
    assert "speedup 3.19x > bound 2.2x" in at.error[0].value and "CV 0.31" in at.warning[0].value
