"""`serve-bench --endpoint URL` against `workbench serve` started here on loopback: the load goes out as streamed
completions, the client-side metrics are consistent, acceptance read from the server's /metrics equals the engine's
own counts over the run, max_concurrency holds, and the row lands in the store beside in-process rows (endpoint,
engine name and version); bad endpoints and settings are named errors."""
import doctest
from dataclasses import replace

import pytest

from tests.test_server import LiveServer, cfg as server_cfg
from workbench.serving import endpoint
from workbench.serving.config import ServeConfig, ServeError
from workbench.zoo.presets import preset_home

PROMPTS = ["def fib(n):", "import numpy as np\n", "class Stack:", "for i in range(10):", "x = [", "while True:"]


@pytest.fixture(scope="module")
def live():
    from workbench.harness.bench import BenchSession

    session = BenchSession.load(preset="tiny", device="cpu")
    srv = LiveServer(session, server_cfg(method="ngram", k=3, max_num_seqs=4, max_new_tokens=16), max_model_len=256)
    yield srv
    srv.stop()


def test_docstrings():
    assert doctest.testmod(endpoint).failed == 0


def test_endpoint_bench_measures_the_stream_and_reads_acceptance_from_metrics(live):
    cfg = ServeConfig(rate=0.0, num_requests=6, max_new_tokens=12)
    before = (live.worker.counters.drafted, live.worker.counters.accepted)
    out = endpoint.endpoint_bench(live.url + "/v1/", cfg, PROMPTS)
    rec = out.record
    drafted = live.worker.counters.drafted - before[0]
    accepted = live.worker.counters.accepted - before[1]
    assert rec["status"] == "ok" and rec["endpoint"] == live.url and rec["run_kind"] == "serve"
    assert (rec["served_model"], rec["engine_name"], rec["method"], rec["k"]) == ("tiny", "workbench", "ngram", 3)
    assert rec["engine_version"] == live.served.info["version"]
    assert rec["completed"] == 6 and rec["failed_requests"] == 0 and rec["total_new_tokens"] == 72
    assert rec["acceptance_source"] == "vllm_counters" and drafted > 0
    assert rec["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert len(rec["acceptance_by_position"]) <= 3 and rec["mean_accepted_tokens"] > 1
    assert rec["acceptance_by_position"] == sorted(rec["acceptance_by_position"], reverse=True)
    assert rec["kv_blocks"] is None and rec["max_num_seqs"] is None  # the server's, not the client's defaults
    assert 0 < rec["ttft_ms_p50"] <= rec["e2el_ms_p50"] and rec["itl_ms_mean"] > 0 and rec["tpot_ms_p50"] > 0
    assert rec["output_throughput"] == pytest.approx(72 / rec["duration_s"])
    # the server's own TTFT over the run: its queue and prefill parts add up to it; the client's includes HTTP
    assert rec["server_ttft_ms_mean"] == pytest.approx(rec["server_queue_ms_mean"] + rec["server_prefill_ms_mean"])
    assert 0 < rec["server_ttft_ms_mean"] < rec["ttft_ms_mean"]
    req = out.requests
    assert len(req) == 6 and req["output_len"].tolist() == [12] * 6 and req["error"].isna().all()
    assert all(s.prompt_tokens == len(live.served.tokenizer.encode(s.prompt).ids) for s in out.sent)


def test_warmup_and_max_concurrency(live):
    cfg = ServeConfig(arrival="concurrency", max_concurrency=2, num_requests=6, warmup_requests=2, max_new_tokens=8)
    out = endpoint.endpoint_bench(live.url, cfg, PROMPTS, model="tiny")
    measured = [s for s in out.sent if s.measured]
    assert out.record["completed"] == 6 and len(out.sent) == 8 and not any(s.error for s in out.sent)
    events = sorted([(s.t_sent, 1) for s in measured] + [(s.t_done, -1) for s in measured])
    in_flight, most = 0, 0
    for _, d in events:
        in_flight += d
        most = max(most, in_flight)
    assert most == 2


def test_serve_bench_endpoint_cli_stores_its_row_beside_in_process_rows(live, tmp_path, capsys):
    import json

    from results.store import ResultStore
    from workbench.__main__ import main

    prompts = str(preset_home("tiny") / "prompts.jsonl")
    rc = main(["serve-bench", "--endpoint", live.url, "--prompts", prompts, "--num-requests", "3", "--rate", "50",
               "--max-new-tokens", "4", "--store", str(tmp_path), "--json", "--study", "ext"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    store = ResultStore(tmp_path)
    rows = store.load()
    assert len(rows) == 1 and rows.loc[0, "endpoint"] == live.url and rows.loc[0, "run_kind"] == "serve"
    assert rows.loc[0, "engine_name"] == "workbench" and rows.loc[0, "study"] == "ext"
    assert rows.loc[0, "run_id"] == printed["run_id"] and rows.loc[0, "completed"] == 3
    assert len(store.load_requests([printed["run_id"]])) == 3
    # a bad endpoint: a named error, a failed row
    assert main(["serve-bench", "--endpoint", "http://127.0.0.1:9", "--prompts", prompts, "--num-requests", "1",
                 "--store", str(tmp_path)]) == 2
    assert "GET /v1/models failed" in capsys.readouterr().err
    failed = store.load()
    assert (failed["status"] == "failed").sum() == 1 and failed["endpoint"].eq("http://127.0.0.1:9").any()


def test_bad_endpoint_settings_are_named(live):
    cfg = ServeConfig(num_requests=2, max_new_tokens=4)
    with pytest.raises(ServeError, match="does not serve 'gpt-4'"):
        endpoint.endpoint_bench(live.url, cfg, PROMPTS, model="gpt-4")
    with pytest.raises(ServeError, match="--lengths file"):
        endpoint.endpoint_bench(live.url, replace(cfg, lengths="random"), PROMPTS)
    with pytest.raises(ServeError, match="http:// or https://"):
        endpoint.endpoint_bench("127.0.0.1:8000", cfg, PROMPTS)
    # a request the server refuses (longer than a row) counts as failed, not as measured
    out = endpoint.endpoint_bench(live.url, replace(cfg, max_new_tokens=250), ["a b c d e f g h i j k l"] * 2)
    assert out.record["status"] == "failed" and out.record["failed_requests"] == 2
    assert "HTTP 400" in out.record["error"] and out.record["completed"] == 0


def test_sglang_gauges_and_servers_without_speculation():
    text = ('# TYPE sglang:spec_accept_rate gauge\nsglang:spec_accept_rate{tp_rank="0"} 0.5\n'
            'sglang:spec_accept_rate{tp_rank="1"} 0.7\n# TYPE sglang:spec_accept_length gauge\n'
            'sglang:spec_accept_length{tp_rank="0"} 2.5\n')
    got = endpoint.acceptance_columns(None, endpoint.spec_counters(text))
    assert got["acceptance_source"] == "sglang_gauges" and got["acceptance_rate"] == pytest.approx(0.6)
    assert got["mean_accepted_tokens"] == 2.5 and got["spec_num_drafts"] is None
    plain = endpoint.spec_counters("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n")
    assert plain is None and endpoint.acceptance_columns(None, plain)["acceptance_source"] is None
    assert endpoint.server_time_columns(None, endpoint.server_times(text)) == dict.fromkeys(endpoint.SERVER_TIMES)
