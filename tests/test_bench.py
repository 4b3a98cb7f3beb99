"""Benchmark runner and CLI on the committed tiny preset: the JSON record, the store row, and bad input."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.harness.bench import BenchConfig, BenchError, BenchSession

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def session():
    return BenchSession.load(preset="tiny", device="cpu")


def small(**kw):
    base = dict(k=3, batch=2, max_new_tokens=12, num_prompts=4, warmup=0, repeats=1)
    base.update(kw)
    return BenchConfig(**base)


@pytest.fixture(scope="module")
def reference_outputs(session):
    """Cache-free greedy continuations of the first 4 prompts: the whole sequence recomputed for every token."""
    import torch

    from workbench.models import CausalAttention

    out = []
    with torch.no_grad():
        for prompt in session.encode(4):
            ids = list(prompt)
            for _ in range(12):
                h = session.target(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), CausalAttention())
                ids.append(int(session.target.compute_logits(h[0, -1]).argmax()))
            out.append(ids[len(prompt):])
    return out


@pytest.mark.parametrize("method", ["ar", "draft", "ngram"])
def test_greedy_runs_match_autoregressive_on_real_models(session, method, reference_outputs):
    res = session.run(small(method=method))
    rec = res.record
    # the independent check is against the cache-free reference decode; for method "ar" the candidate is the
    # baseline run itself, so the record says None (nothing was compared)
    assert res.outputs == reference_outputs and res.ar_outputs == reference_outputs
    assert rec["greedy_matches_ar"] is (None if method == "ar" else True)
    assert rec["total_new_tokens"] == 4 * 12
    if method == "draft":  # trained draft and target of one family: acceptance is real, not noise
        assert rec["acceptance_rate"] > 0.2 and rec["mean_accepted_tokens"] > 1.5
        assert len(rec["acceptance_by_position"]) == 3
        assert rec["acceptance_by_position"] == sorted(rec["acceptance_by_position"], reverse=True)
        assert rec["draft_target_cost_ratio"] > 0
    assert rec["speedup_vs_ar"] > 0 and rec["tokens_per_s"] > 0
    assert rec["decode_speedup_vs_ar"] > 0
    if method == "ar":
        assert rec["speedup_per_token_per_step"] is None and rec["decode_speedup_per_token_per_step"] is None
    else:
        assert rec["speedup_per_token_per_step"] == pytest.approx(rec["speedup_vs_ar"] / rec["mean_accepted_tokens"])
        assert rec["decode_speedup_per_token_per_step"] == pytest.approx(
            rec["decode_speedup_vs_ar"] / rec["mean_accepted_tokens"])
    assert rec["sm_util_pct"] is None and rec["telemetry_reason"]  # no GPU here: None with a reason, never 0


def test_sampled_run_reports_null_parity(session):
    rec = session.run(small(method="draft", temperature=0.8, top_k=50, top_p=0.95)).record
    assert rec["greedy_matches_ar"] is None
    assert 0 <= rec["acceptance_rate"] <= 1


@pytest.mark.parametrize("change, message", [
    (dict(k=0), "k=0 is outside what the engine supports: 1..16"),
    (dict(batch=0), "batch=0 is outside what the engine supports: 1..256"),
    (dict(max_new_tokens=5000), "context is 2048"),
    (dict(method="eagle9"), "method='eagle9' is not supported by the engine; allowed: 'ar', 'draft', 'ngram'"),
    (dict(ngram_min=3, ngram_max=2, method="ngram"), "ngram_min"),
    (dict(temperature=-1.0), "temperature"),
])
def test_bad_settings_fail_before_work(session, change, message):
    with pytest.raises(BenchError, match=message):
        session.run(small(**change))


@pytest.mark.parametrize("change, message", [
    (dict(compile="fast"), "compile='fast' is not supported by the engine; allowed: 'auto', 'off', 'default', 'max-autotune'"),
    (dict(graph_batch_sizes=()), "graph_batch_sizes is empty: give at least one batch bucket"),
    (dict(graph_batch_sizes=(4, 2, 8)), "graph_batch_sizes=4,2,8 must be strictly increasing (sorted, no duplicates)"),
    (dict(graph_batch_sizes=(1, 2, 2)), "graph_batch_sizes=1,2,2 must be strictly increasing"),
    (dict(graph_batch_sizes=(0, 2)), "graph_batch_sizes=0,2 must hold whole numbers >= 1"),
    (dict(cuda_graphs=True, graph_batch_sizes=(1,)), "batch 2 exceeds the largest graph bucket 1: add a bucket >= 2 "
                                                     "to --graph-batch-sizes or turn --cuda-graphs off"),
])
def test_bad_graph_and_compile_settings_are_named(session, change, message):
    with pytest.raises(BenchError, match=re.escape(message)):
        session.run(small(**change))


def test_graph_buckets_bound_the_batch_only_with_graphs_on(session):
    session.check(small(cuda_graphs=False, graph_batch_sizes=(1,)), session.encode(1))


def test_prompt_longer_than_context(session):
    with pytest.raises(BenchError, match="prompt has 3000 tokens"):
        session.run(small(), prompts=[[5] * 3000])


def test_draft_with_other_vocabulary(tmp_path):
    from workbench.models import LlamaModel, ModelConfig, save_model

    cfg = ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2)
    save_model(LlamaModel(cfg), tmp_path / "other")
    tiny = ROOT / "workbench/zoo/weights/tiny"
    with pytest.raises(BenchError, match="vocabulary size 100"):
        BenchSession.load(model=str(tiny / "target"), draft=str(tmp_path / "other"),
                          prompts=str(tiny / "prompts.jsonl"), device="cpu")


def test_missing_model_and_bad_prompt_file(tmp_path):
    with pytest.raises(BenchError, match="does-not-exist"):
        BenchSession.load(model=str(tmp_path / "does-not-exist"), device="cpu")
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(BenchError, match="p.jsonl:2: invalid JSON"):
        BenchSession.load(preset="tiny", prompts=str(bad), device="cpu")


def run_cli(*args, store):
    return subprocess.run([sys.executable, "-m", "workbench", "bench", *args, "--store", str(store)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_cli_json_record_lands_in_store(tmp_path):
    from results.store import ResultStore

    proc = run_cli("--preset", "tiny", "--method", "draft", "--k", "4", "--batch", "2", "--max-new-tokens", "16",
                   "--temperature", "0", "--num-prompts", "2", "--json", store=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    for key in ["method", "k", "batch", "acceptance_rate", "mean_accepted_tokens", "acceptance_by_position",
                "tokens_per_s", "ar_tokens_per_s", "speedup_vs_ar", "ttft_ms", "tpot_ms_p50", "tpot_ms_p99",
                "sm_util_pct", "gpu_busy_pct", "greedy_matches_ar", "device_name"]:
        assert key in rec, key
    assert rec["greedy_matches_ar"] is True and rec["k"] == 4 and rec["batch"] == 2
    df = ResultStore(tmp_path).load()
    assert list(df["run_id"]) == [rec["run_id"]]
    traces = ResultStore(tmp_path).load_traces([rec["run_id"]])
    assert len(traces) >= rec["target_steps"] and set(traces["run_id"]) == {rec["run_id"]}


def test_cli_bad_setting_is_recorded_as_failed(tmp_path):
    from results.store import ResultStore

    proc = run_cli("--preset", "tiny", "--k", "0", "--num-prompts", "1", store=tmp_path)
    assert proc.returncode == 2
    assert "k=0 is outside what the engine supports: 1..16" in proc.stderr
    df = ResultStore(tmp_path).load()
    assert list(df["status"]) == ["failed"] and "k=0 is outside" in df["error"].iloc[0]


def test_divergence_margin_is_the_fp32_logit_gap(session):
    import torch

    prompt = session.encode(1)
    res = session.run(small(method="ar", batch=1, num_prompts=1), prompts=prompt)
    ar = res.ar_outputs[0]
    with torch.no_grad():
        ids = torch.tensor([prompt[0] + ar[:3]])
        logits = session.target.compute_logits(session.target(ids, torch.arange(ids.shape[1]).unsqueeze(0))[0, -1])
    top2 = logits.topk(2)
    assert int(top2.indices[0]) == ar[3]
    ours = ar[:3] + [int(top2.indices[1])] + ar[4:]
    margins = session.divergence_margins(prompt, [ours, ar], [ar, ar])
    assert len(margins) == 1  # the identical sequence has no divergence
    assert abs(margins[0] - float(top2.values[0] - top2.values[1])) < 1e-4


def test_out_of_memory_is_reported_with_the_settings(session, monkeypatch):
    import torch

    from workbench.engine import SpecEngine

    def boom(self, prompts):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(SpecEngine, "generate", boom)
    with pytest.raises(BenchError, match="out of memory with method=draft k=3 batch=2 max_new_tokens=12"):
        session.run(small(method="draft"))
