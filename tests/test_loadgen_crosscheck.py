"""scripts/loadgen_crosscheck.py without aiperf: the schedule it hands aiperf is serve-bench's own load, its reading of
aiperf's summary export (the layout aiperf 0.13.0 writes), the comparison, and the error when aiperf is missing."""
import doctest
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import loadgen_crosscheck as lc  # noqa: E402


def test_docstrings():
    assert doctest.testmod(lc).failed == 0


def test_schedule_is_serve_bench_own_arrivals_and_prompts():
    from workbench.serving.config import ServeConfig
    from workbench.serving.endpoint import make_sent

    prompts = ["def a():", "class B:", "x = 1"]
    cfg = ServeConfig(arrival="poisson", rate=3.5, num_requests=7, warmup_requests=0, seed=11, max_new_tokens=8)
    sent = make_sent(cfg, prompts)
    lines = lc.schedule(prompts, 7, 3.5, 11)
    assert [line["text"] for line in lines] == [s.prompt for s in sent]
    assert [line["timestamp"] / 1e3 for line in lines] == pytest.approx([s.arrival_s for s in sent], abs=1e-6)
    assert lines[-1]["timestamp"] > lines[0]["timestamp"] > 0  # Poisson gaps, the first one included


# aiperf 0.13.0's profile_export_aiperf.json, cut to the fields read (one request failed: 5 sent, 4 succeeded)
EXPORT = {
    "aiperf_version": "0.13.0",
    "request_throughput": {"unit": "requests/sec", "avg": 2.5},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 80.0},
    "time_to_first_token": {"unit": "ms", "avg": 70.0, "p50": 61.0, "p99": 118.0, "min": 55.0, "max": 120.0},
    "inter_token_latency": {"unit": "ms", "avg": 8.0, "p50": 7.5, "p99": 11.0},
    "inter_chunk_latency": {"unit": "ms", "avg": 15.0, "p50": 14.0, "p99": 30.0},
    "request_latency": {"unit": "ms", "avg": 320.0, "p50": 300.0, "p99": 400.0},
    "output_sequence_length": {"unit": "tokens", "avg": 32.0, "min": 32.0, "max": 32.0},
    "request_count": {"unit": "requests", "avg": 4.0},
    "completed_request_count": {"unit": "requests", "avg": 5.0},
    "benchmark_duration": {"unit": "sec", "avg": 1.6},
    "replay_sched_lag_p99": {"unit": "ms", "avg": 3.2},
    "input_config": {"endpoint": {"type": "completions"}},
}


def test_parse_aiperf_summary_reads_the_export():
    got = lc.parse_aiperf_summary(EXPORT)
    assert got["output tok/s"] == 80.0 and got["requests/s"] == 2.5
    assert (got["TTFT p50 ms"], got["TTFT p99 ms"]) == (61.0, 118.0)
    assert got["TPOT p50 ms"] == 7.5 and got["chunk gap (ITL) p50 ms"] == 14.0 and got["E2E latency p50 ms"] == 300.0
    assert (got["completed"], got["failed"]) == (4, 1)
    assert (got["output_tokens_min"], got["output_tokens_max"]) == (32.0, 32.0)
    assert got["schedule_lag_ms_p99"] == 3.2 and got["version"] == "0.13.0"
    assert lc.parse_aiperf_summary({"request_count": {"avg": 3.0}})["TTFT p50 ms"] is None  # a metric it lacks


def test_serve_bench_row_lines_up_with_aiperf_columns():
    rec = {"output_throughput": 81.0, "request_throughput": 2.53, "ttft_ms_p50": 60.0, "ttft_ms_p99": 120.0,
           "tpot_ms_p50": 7.0, "itl_ms_p50": 15.0, "e2el_ms_p50": 310.0, "completed": 4, "failed_requests": 0,
           "total_new_tokens": 128, "duration_s": 1.58}
    got = lc.parse_serve_bench(rec)
    assert set(lc.parse_aiperf_summary(EXPORT)) == set(got)
    assert got["output_tokens_min"] == 32.0 and got["TPOT p50 ms"] == 7.0


def test_summarize_flags_disjoint_ranges():
    rows = {r["metric"]: r for r in lc.summarize({
        "aiperf": [{"output tok/s": 90.0, "TTFT p50 ms": 50.0}, {"output tok/s": 92.0, "TTFT p50 ms": 52.0}],
        "serve-bench": [{"output tok/s": 91.0, "TTFT p50 ms": 60.0}, {"output tok/s": 93.0, "TTFT p50 ms": 64.0}]})}
    assert rows["output tok/s"]["overlap"] and rows["output tok/s"]["ratio"] == pytest.approx(91 / 92, abs=1e-6)
    assert not rows["TTFT p50 ms"]["overlap"] and rows["TTFT p50 ms"]["aiperf_range"] == [50.0, 52.0]
    assert rows["requests/s"]["ratio"] is None and not rows["requests/s"]["overlap"]  # neither measured it


def test_missing_aiperf_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="aiperf not found.*pip install aiperf"):
        lc.find_aiperf(str(tmp_path / "no-such-aiperf"))
