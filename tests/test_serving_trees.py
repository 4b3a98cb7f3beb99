"""Trees and beams served under load (eagle, redrafter): outputs equal each request's solo greedy output under Poisson
arrivals and under preemption; a preempted row's hidden states are recomputed (its drafts, and so its accepted
counts, step for step those of the run without preemption, with the trained tiny heads); adaptive speculation turns
the whole tree on or off by batch size; tree knobs are serving knobs with their named errors before any model
loads; `greedy_matches_solo` lands in the serve-bench row and is False when an output differs."""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from tests.test_engine import draft, make_drafter, target  # noqa: F401 (fixtures)
from tests.test_serving import BS, assert_solo, random_requests, serve, solo  # noqa: F401 (fixtures)
from workbench.engine import EngineConfig, SpecEngine
from workbench.serving import fidelity
from workbench.serving.adaptive import AdaptiveSpeculation
from workbench.serving.config import ServeConfig, ServeError, check_config
from workbench.serving.loadgen import arrival_times
from workbench.serving.request import Request

ROOT = Path(__file__).resolve().parents[1]
TREES = ["eagle", "redrafter-w3"]


def poisson_requests(seed: int, n: int = 8) -> list[Request]:
    """random_requests' prompts and lengths at Poisson arrival times (rate 0.5 per loop iteration)."""
    times = arrival_times(n, 0.5, "poisson", seed=seed)
    return [Request(r.id, r.prompt, r.max_new_tokens, arrival_s=t) for r, t in zip(random_requests(seed, n), times)]


def tree_engine(kind, target, draft, **kw):
    return SpecEngine(target, make_drafter(kind, draft, target), EngineConfig(max_new_tokens=64, kv_block_size=BS,
                                                                              **kw))


# ---- outputs equal solo greedy outputs ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", TREES)
@pytest.mark.parametrize("seed", [0, 1])
def test_served_trees_equal_solo_greedy_under_poisson_arrivals(target, draft, solo, kind, seed):
    reqs = poisson_requests(seed)
    assert len({r.arrival_s for r in reqs}) == len(reqs)  # really spread arrivals
    res = serve(tree_engine(kind, target, draft), reqs)
    assert_solo(res, reqs, solo)
    assert max(i.batch_size for i in res.iterations) > 1  # requests shared steps
    n = make_drafter(kind, draft, target).num_nodes
    assert {t.num_nodes for t in res.traces} == {n}  # every step verified the whole tree


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("kind", [*TREES, "eagle-hot"])
def test_served_trees_equal_solo_greedy_under_preemption(target, draft, solo, kind, graphs):
    reqs = poisson_requests(4)
    n = make_drafter(kind, draft, target).num_nodes
    pool = max(math.ceil((len(r.prompt) + r.max_new_tokens + n + 2) / BS) for r in reqs)  # the largest worst case
    extra = dict(cuda_graphs=True, graph_batch_sizes=(1, 2, 4)) if graphs else {}
    res = serve(tree_engine(kind, target, draft, **extra), reqs, policy="max_util", num_blocks=pool,
                prefill_chunk=6)
    assert res.preemptions > 0 and any(s.preemptions for s in res.states)
    assert_solo(res, reqs, solo)
    assert res.max_used_blocks <= pool


@pytest.fixture(scope="module")
def tiny():
    from workbench.harness.bench import BenchSession

    return BenchSession.load(preset="tiny", device="cpu")


@pytest.mark.parametrize("method", ["eagle", "redrafter"])
def test_preempted_rows_recompute_their_hidden_states(tiny, method):
    """With the committed (trained) tiny heads drafts are accepted, and a head fed wrong hidden states drafts worse:
    a run whose rows are preempted and re-prefilled (their hidden states recomputed from the context) accepts, step
    for step and request for request, exactly what the run without preemption accepts."""
    from workbench.serving.bench import engine_for
    from workbench.serving.loop import ServingLoop, StepClock

    prompts = tiny.encode(6)
    times = arrival_times(len(prompts), 2.0, seed=3)
    reqs = [Request(i, p, 24, times[i]) for i, p in enumerate(prompts)]
    cfg = ServeConfig(method=method, max_new_tokens=24, max_num_seqs=4, kv_block_size=16)

    def run(**kw):
        res = ServingLoop(engine_for(tiny, cfg), reqs, clock=StepClock(), max_num_seqs=4, **kw).run()
        accepted: dict[int, list[int]] = {}
        for t in sorted(res.traces, key=lambda t: t.step):
            accepted.setdefault(t.request, []).append(t.accepted)
        return res, accepted

    whole, accepted = run()
    worst = max(math.ceil((len(r.prompt) + 24 + 20) / 16) for r in reqs)
    preempted, accepted_preempted = run(policy="max_util", num_blocks=worst + 1, prefill_chunk=16)
    assert preempted.preemptions > 0 and whole.preemptions == 0
    assert preempted.outputs == whole.outputs
    assert sum(map(sum, accepted.values())) > len(reqs)  # the heads draft accepted tokens (else nothing to compare)
    assert accepted_preempted == accepted


def test_prefix_caching_with_a_feature_drafter_is_refused_by_name(target, draft):
    with pytest.raises(ServeError, match="prefix caching with method 'eagle' is not supported"):
        check_config(ServeConfig(method="eagle", prefix_caching=True))
    with pytest.raises(ServeError, match="prefix caching with method 'redrafter'"):
        check_config(ServeConfig(method="redrafter", prefix_caching=True))
    with pytest.raises(ServeError, match="prefix caching with method 'eagle'"):  # the loop itself, built directly
        serve(tree_engine("eagle", target, draft), random_requests(0), prefix_caching=True)
    check_config(ServeConfig(method="ngram", prefix_caching=True))  # chains keep it


# ---- adaptive speculation: the whole tree or none ----------------------------------------------------------------
def test_adaptive_rules_for_trees_choose_zero_or_the_whole_tree():
    a = AdaptiveSpeculation(16, k_by_batch=[(1, 2, 3), (3, 4, 0)], max_context=10, long_context_k=2, tree=True)
    assert [a.batch_k(b) for b in (1, 2, 3, 4, 5)] == [16, 16, 0, 0, 16]
    assert a.node_counts(8) == (0, 16) and a.granularity == "tree_on_off"
    from workbench.serving.request import RequestState

    state = RequestState(Request(0, [1], 4))
    assert a.row_k(state, 20, 16) == 16  # the long-context cut to 2 turns the tree on, not to 2 nodes
    assert AdaptiveSpeculation(16, max_context=10, long_context_k=0, tree=True).row_k(state, 20, 16) == 0
    chain = AdaptiveSpeculation(4, k_by_batch=[(1, 2, 3)], max_context=10, long_context_k=2)
    assert chain.batch_k(1) == 3 and chain.row_k(state, 20, 3) == 2 and chain.granularity == "draft_length"


@pytest.mark.parametrize("kind", TREES)
def test_adaptive_turns_the_tree_off_by_batch_size_and_outputs_match(target, draft, solo, kind):
    reqs = poisson_requests(2)
    engine = tree_engine(kind, target, draft)
    n = engine.num_nodes
    res = serve(engine, reqs, adaptive=AdaptiveSpeculation(n, k_by_batch=[(1, 1, 2), (2, 64, 0)], tree=True))
    assert_solo(res, reqs, solo)
    by_batch = {(t.batch_size, t.num_nodes) for t in res.traces}
    assert {nodes for b, nodes in by_batch if b == 1} == {n}  # alone: the whole tree (k_by_batch's 2 means "on")
    assert {nodes for b, nodes in by_batch if b > 1} == {0}  # shared: autoregressive steps
    assert all(t.drafted == 0 for t in res.traces if t.batch_size > 1)


# ---- greedy_matches_solo -----------------------------------------------------------------------------------------
def test_greedy_comparison_is_false_when_an_output_differs():
    ref = {0: [5, 6, 7], 1: [8, 9]}
    assert fidelity.compare_columns({0: [5, 6, 7], 1: [8, 9]}, ref, {0: [1], 1: [2]}) == {
        "greedy_matches_solo": True, "greedy_solo_compared": 2}
    margins = []

    def margin(prompts, ours, theirs):
        margins.append((prompts, ours, theirs))
        return [0.1]

    cols = fidelity.compare_columns({0: [5, 6, 7], 1: [8, 4]}, ref, {0: [1], 1: [2]}, margin, "bfloat16")
    assert cols["greedy_matches_solo"] is False and cols["greedy_divergent_sequences"] == 1
    assert margins == [([[2]], [[8, 4]], [[8, 9]])]  # only the differing request is scored
    assert cols["greedy_divergence_margin"] == 0.1 and cols["greedy_near_tie"] is True  # bf16, within the tie bound
    assert fidelity.compare_columns({0: [5, 6, 7], 1: [8, 4]}, ref, {0: [1], 1: [2]}, margin,
                                    "float32")["greedy_near_tie"] is False  # fp32 has no near-tie excuse
    assert fidelity.compare_columns({0: [5, 6, 7]}, ref, {0: [1], 1: [2]})["greedy_matches_solo"] is False  # missing
    assert [r.id for r in fidelity.checked_requests(random_requests(0), 3)] == [0, 1, 2]


def small_cfg(**kw) -> ServeConfig:
    return ServeConfig(**{"method": "eagle", "rate": 20.0, "num_requests": 4, "max_new_tokens": 12,
                          "max_num_seqs": 4, **kw})


def test_serve_bench_row_records_greedy_matches_solo(tiny, monkeypatch):
    from workbench.serving.bench import serve_bench

    rec = serve_bench(tiny, small_cfg(greedy_check_requests=3)).record
    assert rec["greedy_matches_solo"] is True and rec["greedy_solo_compared"] == 3 and rec["greedy_solo_s"] > 0
    assert rec["adaptive_granularity"] == "tree_on_off" and rec["tree_size_mean"] == 16
    assert (rec["tree_depth"], rec["tree_topk"], rec["tree_budget"]) == (4, 4, 16)
    # a solo reference that differs in one token: the row says so
    real = fidelity.solo_outputs

    def off_by_one(engine, requests, memo=None):
        out = real(engine, requests, memo)
        first = requests[0].id
        out[first] = out[first][:-1] + [(out[first][-1] + 1) % 64]
        return out

    monkeypatch.setattr(fidelity, "solo_outputs", off_by_one)
    rec = serve_bench(tiny, small_cfg(method="redrafter")).record
    assert rec["greedy_matches_solo"] is False and rec["greedy_divergent_sequences"] == 1
    assert rec["greedy_solo_compared"] == 4 and rec["greedy_near_tie"] is False  # fp32
    assert rec["greedy_divergence_margin"] >= 0
    monkeypatch.setattr(fidelity, "solo_outputs", real)
    for cfg in (small_cfg(method="ngram", temperature=0.7), small_cfg(method="ar", greedy_check_requests=0)):
        rec = serve_bench(tiny, cfg).record  # sampling, or the check turned off: not checked
        assert rec["greedy_matches_solo"] is None and rec["greedy_solo_compared"] is None


def test_solo_references_are_decoded_once_per_kept_solo_engine(tiny):
    """A study's trials serve the same prompts again: the kept solo engine decodes each (prompt, length) once."""
    from workbench.serving.bench import serve_bench

    fidelity._kept.clear()  # a solo engine of its own (earlier tests' one may hold these prompts already)
    fidelity._kept_memo.clear()
    serve_bench(tiny, small_cfg(method="ar", greedy_check_requests=2))
    solo = fidelity._kept[0]
    calls, real_generate = [], solo.generate
    solo.generate = lambda prompts: calls.append(prompts) or real_generate(prompts)
    try:
        rec = serve_bench(tiny, small_cfg(method="ar", greedy_check_requests=2)).record
        assert rec["greedy_matches_solo"] is True and rec["greedy_solo_compared"] == 2 and calls == []
        rec = serve_bench(tiny, small_cfg(method="ar", greedy_check_requests=3)).record  # one request more
        assert rec["greedy_matches_solo"] is True and rec["greedy_solo_compared"] == 3 and len(calls) == 1
    finally:
        del solo.generate


# ---- the CLI: tree knobs are serving knobs -----------------------------------------------------------------------
def test_serve_bench_cli_serves_eagle_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "workbench", "serve-bench", "--preset", "tiny", "--method", "eagle", "--tree-depth",
           "3", "--tree-topk", "2", "--tree-budget", "6", "--rate", "20", "--num-requests", "4", "--max-new-tokens",
           "8", "--max-num-seqs", "4", "--k-by-batch", "1-2:1,3-4:0", "--json", "--device", "cpu",
           "--store", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["completed"] == 4 and rec["method"] == "eagle"
    assert (rec["tree_depth"], rec["tree_topk"], rec["tree_budget"]) == (3, 2, 6)
    assert rec["greedy_matches_solo"] is True and rec["greedy_solo_compared"] == 4
    assert rec["adaptive_granularity"] == "tree_on_off"
    from results.store import ResultStore

    store = ResultStore(tmp_path)
    [row] = store.load().to_dict("records")
    assert row["greedy_matches_solo"] is True and row["greedy_solo_compared"] == 4 and row["tree_budget"] == 6
    traces = store.load_traces([rec["run_id"]])
    assert set(traces["num_nodes"]) <= {0, 6} and 6 in set(traces["num_nodes"])
    # the dashboard's export of this row: the head the run loaded, its tree, the served on / off schedule
    from tests.test_engine_exports import assert_expands_to
    from ui.serving_view import snippets_for

    assert row["draft_path"].endswith("tiny/eagle")
    snippets = {name: json.loads(text) for name, text in snippets_for(row).items()}
    assert snippets["vllm"]["speculative_config"]["model"] == row["draft_path"]
    assert_expands_to(snippets, [(1, 2, 3), (3, 4, 0)], 4)


@pytest.mark.parametrize("argv, message", [
    (["--method", "eagle", "--tree-depth", "2", "--tree-topk", "2", "--tree-budget", "9"],
     "tree_budget=9 exceeds the 6 candidates"),
    (["--method", "eagle", "--tree-depth", "5", "--tree-budget", "4"], "tree_budget=4 is below tree_depth=5"),
    (["--method", "eagle", "--tree-topk", "0"], "tree_topk"),
    (["--method", "redrafter", "--beam-width", "9"], "beam_width"),
    (["--method", "redrafter", "--diversity-penalty", "-1"], "diversity_penalty"),
    (["--method", "eagle", "--prefix-caching"], "prefix caching with method 'eagle' is not supported"),
])
def test_bad_tree_settings_on_serve_bench_are_named_before_any_model_loads(argv, message, monkeypatch, capsys):
    from workbench.harness import bench
    from workbench.serving import cli

    def no_load(*args, **kw):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(bench.BenchSession, "load", no_load)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve-bench", "--preset", "tiny", "--device", "cpu", "--no-store", *argv])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_tree_knobs_are_serving_knobs():
    from workbench.serving.config import SERVE_CONFIG_KNOBS, SERVE_METHODS
    from workbench.settings import METHODS

    names = {k.name for k in SERVE_CONFIG_KNOBS}
    assert {"tree_depth", "tree_topk", "tree_budget", "beam_width", "beam_length", "diversity_penalty",
            "greedy_check_requests"} <= names
    assert set(SERVE_METHODS) == set(METHODS)
    assert {f.name for f in fields(ServeConfig)} == names
    check_config(ServeConfig(method="eagle", tree_depth=3, tree_topk=2, tree_budget=6))


@pytest.mark.parametrize("method, knobs, shorter", [
    ("eagle", {"tree_depth": 4, "tree_topk": 1, "tree_budget": 4}, True),  # a chain: its commit takes a shorter path
    ("redrafter", {"beam_width": 1, "beam_length": 4}, True),  # one beam: a chain, verified at any length
])
def test_chain_shaped_heads_follow_what_the_engine_can_verify(target, solo, method, knobs, shorter):
    from workbench.engine.drafters import EagleHead, RedrafterHead
    from workbench.engine.drafters import make_drafter as registry_drafter
    from workbench.serving.loop import verifies_shorter

    heads = {"eagle": EagleHead.for_target(target, seed=4, std=0.3),
             "redrafter": RedrafterHead.for_target(target, seed=4, std=0.3)}
    drafter = registry_drafter(method, knobs, target=target, heads=heads)
    assert drafter.proposes_chains and verifies_shorter(drafter) is shorter
    reqs = poisson_requests(7)
    engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=64, kv_block_size=BS))
    res = serve(engine, reqs, adaptive=AdaptiveSpeculation(4, k_by_batch=[(1, 1, 2), (2, 2, 1), (3, 64, 0)]))
    assert_solo(res, reqs, solo)
    lengths = {t.num_nodes for t in res.traces}
    assert lengths == ({0, 1, 2} if shorter else {0, 4})


def test_a_calibrated_tree_schedule_is_recorded_as_on_and_off(target, draft, solo):
    """A step calibration of a tree times 0 and the whole tree only; the row's k_by_batch says on (1) / off (0) per
    batch range, as the knob reads it, and every step served so."""
    from tests.test_serving_adaptive import fake_session
    from workbench.serving import bench
    from workbench.serving.loop import StepClock
    from workbench.settings import parse_k_by_batch

    reqs = poisson_requests(5)
    engine = tree_engine("eagle", target, draft)
    n = engine.num_nodes
    cfg = ServeConfig(method="eagle", max_num_seqs=4, kv_block_size=BS, max_new_tokens=12, calibration="step",
                      graph_batch_sizes=(1, 2, 4))
    out = bench.serve_bench(fake_session(), cfg, clock=StepClock(), engine=engine, requests=reqs)
    assert_solo(out.result, reqs, solo)
    rec = out.record
    assert {r["k"] for r in json.loads(rec["calibration_table"])["measured"]} == {0, n}
    ranges = parse_k_by_batch(rec["k_by_batch"])
    assert ranges[0][0] == 1 and ranges[-1][1] == 4 and {k for *_, k in ranges} <= {0, 1}
    for t in out.result.traces:
        assert t.num_nodes == n * next(k for lo, hi, k in ranges if lo <= t.batch_size <= hi)
    assert rec["greedy_matches_solo"] is True and rec["greedy_solo_compared"] == len(reqs)
