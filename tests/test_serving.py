"""In-flight batching: outputs equal each request's solo greedy output under any arrival order, chunked prefill,
preemption + recompute and prefix reuse; the scheduler never exceeds the pool; no_evict never preempts; named errors;
Poisson arrivals pass a goodness-of-fit test; exported snippets parse; serve-bench writes its rows."""
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from tests.test_engine import draft, target  # noqa: F401 (fixtures)
from tests.test_verify import chi_square_pvalue
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DraftModelDrafter, NgramDrafter
from workbench.serving.adaptive import AdaptiveSpeculation
from workbench.serving.config import RequestTooLargeError, ServeConfig, ServeError, check_config
from workbench.serving.loadgen import arrival_times, make_requests
from workbench.serving.loop import ServingLoop, StepClock
from workbench.serving.prefix_cache import PrefixCachingKVCache
from workbench.serving.request import Request
from workbench.serving.tuning import ServeTuning, format_serve_tuning

ROOT = Path(__file__).resolve().parents[1]
BS = 4  # small KV blocks: prompts span several, so sharing and preemption happen with few tokens


def random_requests(seed: int, n: int = 8, shared: list[int] | None = None) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, (shared or []) + [rng.randrange(64) for _ in range(rng.randint(1, 14))], rng.randint(1, 12),
                    arrival_s=float(rng.randint(0, 12))) for i in range(n)]


@pytest.fixture(scope="module")
def solo(target):
    """Each request alone through `generate` with no drafter: the reference output."""
    engine = SpecEngine(target, None, EngineConfig(max_new_tokens=1, kv_block_size=BS))
    memo = {}

    def run(req: Request) -> list[int]:
        key = (tuple(req.prompt), req.max_new_tokens)
        if key not in memo:
            engine.config = EngineConfig(max_new_tokens=req.max_new_tokens, kv_block_size=BS)
            memo[key] = engine.generate([req.prompt]).outputs[0]
        return memo[key]
    return run


def make_engine(kind, target, draft, **kw):
    drafter = {"ar": None, "ngram": NgramDrafter(3), "draft": DraftModelDrafter(draft, 3)}[kind]
    return SpecEngine(target, drafter, EngineConfig(max_new_tokens=64, kv_block_size=BS, **kw))


def serve(engine, requests, **kw):
    return ServingLoop(engine, requests, clock=StepClock(), **{"max_num_seqs": 4, **kw}).run()


def assert_solo(result, requests, solo):
    for r in requests:
        assert result.outputs[r.id] == solo(r), f"request {r.id} differs from its solo greedy output"


# ---- outputs equal solo greedy outputs -------------------------------------------------------------------------
@pytest.mark.parametrize("batch_prefill", [4, 1], ids=["batched-prefill", "prefill-per-row"])
@pytest.mark.parametrize("kind", ["ar", "ngram", "draft"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_flight_outputs_equal_solo_greedy_in_random_arrival_orders(target, draft, solo, kind, seed, batch_prefill):
    reqs = random_requests(seed)
    res = serve(make_engine(kind, target, draft), reqs, tuning=ServeTuning(batch_prefill=batch_prefill))
    assert_solo(res, reqs, solo)
    assert res.batch_prefill == batch_prefill and res.tuning.batch_prefill == batch_prefill
    assert max(i.batch_size for i in res.iterations) > 1  # requests really shared steps
    assert len({i.batch_size for i in res.iterations if i.batch_size}) > 1  # rows joined and left


@pytest.mark.parametrize("kind", ["ngram", "draft"])
@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_interleaves_with_decode_and_keeps_outputs(target, draft, solo, kind, chunk):
    reqs = random_requests(3)
    res = serve(make_engine(kind, target, draft), reqs, prefill_chunk=chunk)
    assert_solo(res, reqs, solo)
    assert all(i.prefill_tokens <= chunk for i in res.iterations)
    assert any(i.prefill_tokens and i.batch_size for i in res.iterations)  # a chunk beside a decode step


@pytest.mark.parametrize("kind", ["ar", "ngram", "draft"])
def test_max_util_preempts_recomputes_and_keeps_outputs(target, draft, solo, kind):
    reqs = random_requests(4)
    pool = max(math.ceil((len(r.prompt) + r.max_new_tokens + 5) / BS) for r in reqs)  # the largest worst case
    res = serve(make_engine(kind, target, draft), reqs, policy="max_util", num_blocks=pool, prefill_chunk=6)
    assert res.preemptions > 0 and any(s.preemptions for s in res.states)
    assert_solo(res, reqs, solo)
    assert res.max_used_blocks <= pool


@pytest.mark.parametrize("kind", ["ar", "ngram"])
def test_prefix_reuse_hits_and_keeps_outputs(target, draft, solo, kind):
    shared = [random.Random(9).randrange(64) for _ in range(11)]  # two full blocks of 4 plus 3 tokens
    reqs = random_requests(5, shared=shared)
    res = serve(make_engine(kind, target, draft), reqs, prefix_caching=True, prefill_chunk=4)
    assert_solo(res, reqs, solo)
    assert res.prefix_hit_rate and res.prefix_hit_rate > 0.2
    assert sum(s.prefix_hit_tokens for s in res.states) >= 8 * (len(reqs) - 1) * 0.5


def test_prefix_reuse_with_preemption_keeps_outputs(target, draft, solo):
    shared = [random.Random(11).randrange(64) for _ in range(9)]
    reqs = random_requests(6, shared=shared)
    res = serve(make_engine("ngram", target, draft), reqs, prefix_caching=True, policy="max_util", num_blocks=13)
    assert_solo(res, reqs, solo)
    assert res.max_used_blocks <= 13


def test_adaptive_draft_length_keeps_outputs_and_follows_the_schedule(target, draft, solo):
    reqs = random_requests(7)
    adaptive = AdaptiveSpeculation(3, k_by_batch=[(1, 1, 3), (2, 2, 1), (3, 64, 0)], max_context=15,
                                   long_context_k=1)
    res = serve(make_engine("draft", target, draft), reqs, adaptive=adaptive)
    assert_solo(res, reqs, solo)
    for t in res.traces:
        want = {1: 3, 2: 1}.get(t.batch_size, 0)
        assert t.k == (min(want, 1) if t.context_len > 15 else want) and t.drafted <= t.k
    assert {t.num_nodes for t in res.traces} >= {0, 1}


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_adaptive_draft_length_with_fixed_shapes(target, draft, solo, kind):
    """The same schedule over fixed-shape steps (the draft model's chain step per length, the n-gram drafter's device
    lookup cut to the step's length): outputs equal solo greedy, no step drafts past its k."""
    reqs = random_requests(7)
    adaptive = AdaptiveSpeculation(3, k_by_batch=[(1, 1, 3), (2, 2, 1), (3, 64, 0)])
    engine = make_engine(kind, target, draft, cuda_graphs=True, graph_batch_sizes=(1, 2, 4))
    res = serve(engine, reqs, adaptive=adaptive)
    assert_solo(res, reqs, solo)
    assert all(t.drafted <= t.k == {1: 3, 2: 1}.get(t.batch_size, 0) for t in res.traces)
    assert {t.k for t in res.traces} == {0, 1, 3}
    if kind == "ngram":
        assert engine.drafter.step is not None and engine.drafter.step.stats.hits > 0


def test_switch_off_by_acceptance(target, draft, solo):
    reqs = random_requests(8)
    adaptive = AdaptiveSpeculation(3, off_acceptance=1.01, window=2)  # nothing reaches 101 %: off after 2 steps
    res = serve(make_engine("ngram", target, draft), reqs, adaptive=adaptive)
    assert_solo(res, reqs, solo)
    for s in res.states:
        drafting = [t for t in res.traces if t.request == s.req.id and t.drafted]
        assert len(drafting) <= 2


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_switch_off_by_queue(target, draft, solo, kind):
    """spec_off_queue: a step drafts nothing while at least that many requests wait for a row, and drafts again once
    the queue is shorter (a draft model then catches up); outputs equal solo greedy."""
    reqs = [Request(r.id, r.prompt, r.max_new_tokens, arrival_s=0.0) for r in random_requests(3, n=10)]
    seen = []

    class Logged(AdaptiveSpeculation):
        def batch_k(self, batch_size, queued=0):
            k = super().batch_k(batch_size, queued)
            seen.append((queued, k))
            return k

    res = serve(make_engine(kind, target, draft), reqs, adaptive=Logged(3, off_queue=3), max_num_seqs=2)
    assert_solo(res, reqs, solo)
    assert {k for q, k in seen if q >= 3} == {0} and {k for q, k in seen if q < 3} == {3}
    assert any(t.k == 0 for t in res.traces) and any(t.drafted for t in res.traces)


# ---- capacity ----------------------------------------------------------------------------------------------------
def test_no_evict_never_preempts_and_never_exceeds_the_pool(target, draft, solo):
    reqs = random_requests(10, n=10)
    res = serve(make_engine("ngram", target, draft), reqs, policy="no_evict", num_blocks=12)
    assert res.preemptions == 0 and all(s.preemptions == 0 for s in res.states)
    assert res.max_used_blocks <= 12
    assert any(s.t_admitted > s.t_arrival for s in res.states)  # some waited for room
    assert_solo(res, reqs, solo)


def test_scheduler_budget_invariant_per_iteration(target, draft):
    reqs = random_requests(12, n=10)
    for policy in ("no_evict", "max_util"):
        res = serve(make_engine("draft", target, draft), reqs, policy=policy, num_blocks=10)
        assert all(i.used_blocks <= 10 for i in res.iterations)


def test_request_larger_than_the_pool_is_a_named_error(target, draft):
    reqs = [Request(0, list(range(30)), 20)]
    with pytest.raises(RequestTooLargeError, match=r"needs up to \d+ KV blocks .* raise --kv-blocks"):
        ServingLoop(make_engine("ngram", target, draft), reqs, num_blocks=5, clock=StepClock())


def test_bad_serving_settings_are_named_errors():
    with pytest.raises(ServeError, match="max-concurrency"):
        check_config(ServeConfig(arrival="concurrency"))
    with pytest.raises(ServeError, match="k_by_batch"):
        check_config(ServeConfig(k_by_batch="4-1:2"))
    with pytest.raises(ServeError, match="sched_policy"):
        check_config(ServeConfig(sched_policy="lru"))
    with pytest.raises(ServeError, match="graph bucket"):
        check_config(ServeConfig(cuda_graphs=True, graph_batch_sizes=(1, 2), max_num_seqs=4))


def test_prefix_cache_refcounts_and_eviction():
    cache = PrefixCachingKVCache(1, 1, 2, 3, 16, torch.float32, "cpu", block_size=2, num_blocks=6)
    toks = [1, 2, 3, 4, 5]
    cache.begin(torch.tensor([0]), torch.tensor([0]), [0], 5, prefill=True)  # row 0 holds 3 blocks
    cache.register(0, toks, 5)  # two full blocks hashed
    hits = cache.match([1, 2, 3, 4, 9], 2)
    assert len(hits) == 2 and hits == cache._host_table[0][:2]
    cache.attach(1, hits)
    assert cache.used_blocks == 3  # shared blocks counted once
    cache.free(0)
    assert cache.used_blocks == 2  # row 1 still holds the shared ones
    cache.free(1)
    assert cache.used_blocks == 0 and len(cache._cached) == 2  # cached, evictable
    cache.begin(torch.tensor([2]), torch.tensor([0]), [0], 12, prefill=True)  # needs all 6: evicts the cached
    assert cache.used_blocks == 6 and not cache._cached and cache.match([1, 2, 3, 4], 2) == []


# ---- load generator ----------------------------------------------------------------------------------------------
def test_poisson_arrival_counts_pass_a_goodness_of_fit_test():
    rate, n = 5.0, 4000
    times = arrival_times(n, rate, "poisson", seed=123)
    horizon = int(times[-1])
    counts = [0] * horizon
    for t in times:
        if t < horizon:
            counts[int(t)] += 1
    top = 15
    observed = torch.zeros(top + 1)
    for c in counts:
        observed[min(c, top)] += 1
    pmf = torch.tensor([math.exp(-rate) * rate ** i / math.factorial(i) for i in range(top)])
    probs = torch.cat([pmf, (1 - pmf.sum()).view(1)])
    assert chi_square_pvalue(observed, probs) > 0.001
    # the test has power: arrivals at the right mean but evenly spaced fail it
    even = torch.zeros(top + 1)
    even[int(rate)] = horizon
    assert chi_square_pvalue(even, probs) < 1e-6


def test_gamma_arrivals_keep_the_mean_rate_and_loadgen_is_seeded():
    times = arrival_times(3000, 10.0, "gamma", burstiness=0.5, seed=1)
    assert abs(len(times) / times[-1] - 10.0) < 1.0
    cfg = ServeConfig(lengths="random", input_len=20, range_ratio=0.5, num_requests=6, warmup_requests=2, rate=4.0,
                      shared_prefix_len=3)
    a, b = make_requests(cfg, [], 64), make_requests(cfg, [], 64)
    assert a == b and len(a) == 8 and [r.measured for r in a[:3]] == [False, False, True]
    assert len({tuple(r.prompt[:3]) for r in a}) == 1 and 10 <= min(len(r.prompt) for r in a)


def test_fixed_concurrency_caps_requests_in_the_system(target, draft):
    reqs = [Request(i, [1 + i, 2, 3], 6) for i in range(6)]
    res = ServingLoop(make_engine("ar", target, draft), reqs, max_concurrency=2, clock=StepClock()).run()
    assert max(i.batch_size for i in res.iterations) <= 2
    assert all(s.t_admitted == s.t_arrival for s in res.states)  # a client-side wait, not queue time


# ---- exports -----------------------------------------------------------------------------------------------------
def test_exported_snippets_parse_and_carry_the_engines_keys():
    from workbench.serving.exports import export_snippets

    snippets = export_snippets([(1, 2, 4), (3, 8, 2), (9, 64, 0)], method="ngram", ngram=(1, 3))
    vllm = json.loads(snippets["vllm"])
    assert vllm["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 8, 2], [9, 64, 0]]
    trt = json.loads(snippets["trtllm"])
    # above the largest key TensorRT-LLM is off by itself: the trailing k = 0 range needs no key
    assert trt["speculative_config"]["draft_len_schedule"] == {"2": 4, "8": 2}
    assert trt["speculative_config"]["max_draft_len"] == 4 and trt["speculative_config"]["decoding_type"] == "NGram"
    sgl = json.loads(snippets["sglang"])
    assert sgl["server_args"]["speculative_num_draft_tokens"] == 5 and sgl["differs_from_schedule"]
    for s in (vllm, trt, sgl):
        assert s["checked_against"]


# ---- the CLI -----------------------------------------------------------------------------------------------------
def test_serve_bench_cli_prints_one_record_and_stores_rows(tmp_path):
    cmd = [sys.executable, "-m", "workbench", "serve-bench", "--preset", "tiny", "--method", "ngram", "--k", "3",
           "--rate", "20", "--num-requests", "6", "--max-new-tokens", "8", "--json", "--device", "cpu",
           "--store", str(tmp_path), "--prefill-chunk", "32"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("request_throughput", "output_throughput", "ttft_ms_p99", "tpot_ms_p99", "itl_ms_p99", "e2el_ms_p99",
                "goodput", "queue_ms_mean", "preemptions", "kv_cache_util_mean", "mean_batch_size",
                "acceptance_by_batch_size", "acceptance_by_context"):
        assert key in rec, key
    assert rec["completed"] == 6 and rec["run_kind"] == "serve"
    from results.store import ResultStore

    store = ResultStore(tmp_path)
    df = store.load()
    assert len(df) == 1 and df["run_kind"].iloc[0] == "serve" and df["prefill_chunk"].iloc[0] == 32
    # no fixed batch in serving: the row cap has its own column, the batch it ran is mean_batch_size
    assert pd.isna(df["batch"].iloc[0]) and df["max_num_seqs"].iloc[0] == 16 and df["mean_batch_size"].iloc[0] > 0
    req = store.load_requests([rec["run_id"]])
    assert len(req) == 6 and req["ttft_ms"].notna().all()
    assert len(store.load_traces([rec["run_id"]])) > 0


def test_an_unknown_method_is_refused_by_name_before_any_work():
    with pytest.raises(ServeError, match="method 'medusa'"):
        check_config(ServeConfig(method="medusa"))


def test_serve_bench_cli_names_an_oversized_request(tmp_path):
    cmd = [sys.executable, "-m", "workbench", "serve-bench", "--preset", "tiny", "--method", "ar", "--num-requests",
           "2", "--max-new-tokens", "8", "--kv-blocks", "2", "--device", "cpu", "--no-store"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "raise --kv-blocks" in out.stderr


# ---- replay ------------------------------------------------------------------------------------------------------
def test_match_lengths_worked_example():
    from types import SimpleNamespace as T

    from workbench.serving.replay import _match_at, match_lengths

    # k = 3: step at position 1 accepts 3 (all), at 5 accepts 1, at 7 accepts 0
    rows = [T(request=0, step=s, accepted=a) for s, a in ((0, 3), (1, 1), (2, 0))]
    runs = match_lengths(rows, 3)[0]
    assert runs == [(1, 3 + 1 + 1), (5, 1), (7, 0)]
    assert _match_at(runs, 2) == 4 and _match_at(runs, 5) == 1 and _match_at(runs, 6) == 0


def test_replay_at_the_recorded_setting_predicts_the_run(target, draft):
    from workbench.serving import metrics, replay

    reqs = [Request(i, [3 + i, 9, 4, 1, 3, 9], 20, arrival_s=float(i)) for i in range(8)]
    res = serve(make_engine("draft", target, draft), reqs)
    costs = replay.fit_costs(res.iterations)  # StepClock: every iteration costs 1 s
    pred = replay.replay(res.states, res.traces, 3, costs, lambda b: 3, max_num_seqs=4)
    real = metrics.summarize(res)
    assert abs(pred["output_throughput"] / real["output_throughput"] - 1) < 0.25


# ---- captured prefill (prefill_graphs): chunks padded to multiples of 32, replayed from one graph per length ------
def long_requests(seed: int, n: int = 6, shared: list[int] | None = None) -> list[Request]:
    """Requests with room behind their prompts for a chunk padded to 32 tokens (max_len = prompt + new + ...)."""
    rng = random.Random(seed)
    return [Request(i, (shared or []) + [rng.randrange(64) for _ in range(rng.randint(2, 20))], rng.randint(30, 40),
                    arrival_s=float(rng.randint(0, 12))) for i in range(n)]


@pytest.mark.parametrize("kind", ["ar", "ngram", "draft"])
@pytest.mark.parametrize("setting", ["whole", "chunked", "prefix", "preempt"])
def test_captured_prefill_in_serving_keeps_outputs(target, draft, solo, kind, setting):
    """With cuda_graphs (on a CPU: the padded buffers a GPU graph reads, run eagerly) every prefill chunk of the
    target and every draft-model prefill runs at a length padded up to a multiple of 32: outputs still equal each
    request's solo greedy output, under chunking, prefix reuse and preemption, and the padding's blocks go back.
    A forward per row (batch_prefill = 1): several rows' padding at once need not fit a tight pool, and such a forward
    then runs eagerly by design (test_batched_prefill_keeps_outputs covers the batched forwards)."""
    shared = [random.Random(12).randrange(64) for _ in range(9)] if setting == "prefix" else None
    reqs = long_requests(7, shared=shared)
    engine = make_engine(kind, target, draft, cuda_graphs=True, graph_batch_sizes=(1, 2, 4))
    kw = {"whole": {}, "chunked": {"prefill_chunk": 5}, "prefix": {"prefix_caching": True, "prefill_chunk": 4},
          "preempt": {"policy": "max_util", "prefill_chunk": 6,
                      "num_blocks": max(math.ceil((len(r.prompt) + r.max_new_tokens + 5) / BS) for r in reqs) + 2}}
    res = serve(engine, reqs, tuning=ServeTuning(batch_prefill=1), **kw[setting])
    assert_solo(res, reqs, solo)
    assert res.batch_prefill == 1
    step = engine.prefill_step
    keys = [length for (_, length) in step.fixed_at._buffers]
    assert keys and all(length % 32 == 0 for length in keys)
    assert step.fixed_at.stats.hits > 0 and step.fixed_at.stats.hits >= step.eager_chunks
    if setting == "preempt":
        assert res.preemptions > 0 and res.max_used_blocks <= kw["preempt"]["num_blocks"]
    if kind == "draft":  # the draft model's prefill at join, padded too
        assert all(length % 32 == 0 for (_, length) in engine.drafter.prefill_step.fixed._buffers)
    assert engine.cache.used_blocks == 0  # every row released, the padding's blocks included


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("kind", ["ar", "ngram", "draft"])
@pytest.mark.parametrize("setting", ["whole", "chunked", "prefix", "preempt"])
def test_batched_prefill_keeps_outputs(target, draft, solo, kind, setting, graphs):
    """batch_prefill = 3 (the default is 4): an iteration's prefill chunks run up to 3 rows per forward
    (engine.prefill_rows; right-padded to the longest, and with fixed shapes to a multiple of 32, each row's padding
    truncated after): outputs equal each request's solo greedy output under chunking, prefix reuse and preemption;
    some forward really held several rows; every block comes back."""
    shared = [random.Random(12).randrange(64) for _ in range(9)] if setting == "prefix" else None
    reqs = [Request(r.id, r.prompt, r.max_new_tokens, arrival_s=0.0) for r in long_requests(7, shared=shared)]
    extra = dict(cuda_graphs=True, graph_batch_sizes=(1, 2, 4)) if graphs else {}
    engine = make_engine(kind, target, draft, **extra)
    rows_per_forward, kept = [], []
    real = engine.prefill_rows

    def spy(rows, chunks, starts):
        rows_per_forward.append(len(rows))
        out = real(rows, chunks, starts)
        kept.extend((len(engine.cache._host_table[r]), math.ceil((st + len(c)) / BS))
                    for r, c, st in zip(rows, chunks, starts))  # the padding's blocks went back
        return out

    engine.prefill_rows = spy
    kw = {"whole": {}, "chunked": {"prefill_chunk": 12}, "prefix": {"prefix_caching": True, "prefill_chunk": 12},
          "preempt": {"policy": "max_util", "prefill_chunk": 12,
                      "num_blocks": max(math.ceil((len(r.prompt) + r.max_new_tokens + 5) / BS) for r in reqs) + 2}}
    res = serve(engine, reqs, tuning=ServeTuning(batch_prefill=3), **kw[setting])
    assert_solo(res, reqs, solo)
    assert rows_per_forward and max(rows_per_forward) in (2, 3)
    assert kept and all(have == want for have, want in kept)
    if setting == "preempt":
        assert res.preemptions > 0 and res.max_used_blocks <= kw["preempt"]["num_blocks"]
    assert engine.cache.used_blocks == 0


def static_outputs(monkeypatch, on: bool = True):
    """CUDA-graph outputs emulated on a CPU as a GPU replays them (graphs.STATIC_CPU_OUTPUTS, the default): each
    (bucket, key) keeps ONE output tensor and every call writes into it, so a view of an earlier call's output changes
    under whoever still holds it. on=False: a fresh tensor per call, which hides such aliasing (the baseline)."""
    from workbench.engine import graphs

    monkeypatch.setattr(graphs, "STATIC_CPU_OUTPUTS", on)


@pytest.mark.parametrize("kind", ["eagle", "redrafter-w3", "draft"])
@pytest.mark.parametrize("setting", ["whole", "chunked", "schedule-with-0"])
def test_serving_holds_no_view_of_a_replayed_output(target, draft, solo, kind, setting, monkeypatch):
    """With graph outputs that every replay overwrites (as on a GPU), in-flight serving drafts exactly as with fresh
    outputs: the same accepted / drafted counts at every step (a corrupted drafter input would only lower acceptance,
    never change the output, so parity alone could not show it). The prefill's hidden states that feature-based
    drafters (EAGLE, ReDrafter) keep until a request's prefill completes (across the chunks of several iterations,
    and the other rows' forwards of one iteration) must be copies, not views of a captured output. A schedule that
    drafts only at batch 1 runs these tree drafters' steps without drafts too (their commit then gets the root's
    hidden state alone)."""
    from tests.test_engine import make_drafter

    reqs = [Request(r.id, r.prompt, r.max_new_tokens, arrival_s=float(r.id // 3)) for r in long_requests(6, n=8)]

    def run():
        drafter = make_drafter(kind, draft, target)
        engine = SpecEngine(target, drafter, EngineConfig(
            max_new_tokens=64, kv_block_size=BS, cuda_graphs=True, graph_batch_sizes=(1, 2, 4)))
        kw = {"whole": {}, "chunked": {"prefill_chunk": 6},
              "schedule-with-0": {"adaptive": AdaptiveSpeculation(drafter.num_nodes, k_by_batch=[
                  (1, 1, drafter.num_nodes), (2, 64, 0)])}}[setting]
        res = serve(engine, reqs, **kw)
        assert_solo(res, reqs, solo)
        if setting == "schedule-with-0":
            assert {t.num_nodes for t in res.traces} == {0, drafter.num_nodes}  # steps with and without drafts
        return [(t.request, t.accepted, t.drafted) for t in res.traces], engine

    static_outputs(monkeypatch, on=False)
    fresh, _ = run()
    static_outputs(monkeypatch)
    static, engine = run()
    assert engine.prefill_step.fixed_at.stats.hits > 0  # the prefill really replayed captured (emulated) outputs
    if setting != "schedule-with-0":  # (drafting only at batch 1, few steps draft at all)
        assert sum(a for _, a, _ in fresh) > 0  # the drafter's drafts are accepted at all (else nothing to compare)
    assert static == fresh


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("kind", ["ar", "ngram", "draft"])
@pytest.mark.parametrize("setting", ["chunked", "prefix", "preempt"])
def test_prefill_enqueued_behind_the_step_in_flight(target, draft, solo, kind, setting, overlap, monkeypatch):
    """overlap_prefill (the default): an iteration's prefill is planned before its step is launched and runs between
    `launch_step` and `finish_step`; no row is released while a step is in flight (a preemption for a chunk's
    blocks happens before the launch); outputs equal each request's solo greedy output and the pool is never
    exceeded. Off: the step is read before any prefill."""
    shared = [random.Random(5).randrange(64) for _ in range(9)] if setting == "prefix" else None
    reqs = long_requests(3, n=8, shared=shared)
    engine = make_engine(kind, target, draft)
    calls, in_flight = [], []

    def spy(name):
        real = getattr(engine, name)

        def call(*args, **kwargs):
            if name == "release_row":
                in_flight.append(bool(calls) and calls[-1] == "launch_step")
            if name != "release_row":
                calls.append(name)
            return real(*args, **kwargs)
        return call

    for name in ("launch_step", "finish_step", "prefill_row", "prefill_rows", "release_row"):
        monkeypatch.setattr(engine, name, spy(name))
    kw = {"chunked": {"prefill_chunk": 6}, "prefix": {"prefix_caching": True, "prefill_chunk": 8},
          "preempt": {"policy": "max_util", "prefill_chunk": 6,
                      "num_blocks": max(math.ceil((len(r.prompt) + r.max_new_tokens + 5) / BS) for r in reqs) + 3}}
    res = serve(engine, reqs, tuning=ServeTuning(overlap_prefill=overlap), **kw[setting])
    assert_solo(res, reqs, solo)
    assert res.tuning.overlap_prefill == overlap
    assert res.overlap == ("prefill" if overlap else "none")  # eager steps: never full overlap
    between = [i for i, c in enumerate(calls) if c.startswith("prefill_row") and "launch_step" in calls[:i]
               and calls[:i][::-1].index("launch_step") < (calls[:i][::-1] + ["finish_step"]).index("finish_step")]
    assert (len(between) > 0) == overlap  # prefills ran while a step was in flight: only with the overlap
    assert in_flight and not any(in_flight)  # rows were released (finished or preempted), never under a step
    if setting == "preempt":
        assert res.preemptions > 0 and res.max_used_blocks <= kw["preempt"]["num_blocks"]
    assert engine.cache.used_blocks == 0


@pytest.mark.parametrize("freeze", [True, False])
def test_gc_freeze_covers_exactly_the_measured_run(target, draft, monkeypatch, freeze):
    """gc_freeze: the measured run sees a frozen heap (gc.freeze: the collector never rescans what was alive before
    it), the calibration's runs too, and the heap is unfrozen after; off leaves the collector alone."""
    import gc
    from types import SimpleNamespace

    from workbench.serving import bench

    seen = []
    real = ServingLoop.run

    def run(self):
        seen.append(gc.get_freeze_count())
        return real(self)

    monkeypatch.setattr(ServingLoop, "run", run)
    reqs = make_requests(ServeConfig(lengths="random", input_len=12, num_requests=3, max_new_tokens=4), [], 64)
    cfg = ServeConfig(method="ngram", k=2, num_requests=3, max_new_tokens=4, kv_block_size=BS, gc_freeze=freeze,
                      calibration="loop", calibration_budget_s=30.0, max_num_seqs=2, graph_batch_sizes=(1, 2))
    session = SimpleNamespace(device=torch.device("cpu"), dtype="float32", preset=None, target_path="random",
                              draft_path=None, prompts_source="random")
    engine = SpecEngine(target, NgramDrafter(2), EngineConfig(max_new_tokens=64, kv_block_size=BS))
    gc.unfreeze()
    out = bench.serve_bench(session, cfg, engine=engine, requests=reqs)
    assert out.record["gc_freeze"] is freeze and out.record["completed"] == 3
    assert len(seen) > 1  # the calibration's runs and the measured one
    assert all((n > 0) == freeze for n in seen), seen
    assert gc.get_freeze_count() == 0


def test_serving_uploads_host_values_without_a_device_argument(target, draft, solo, monkeypatch):
    """On a GPU `torch.tensor(values, device=cuda)` waits for the stream after its copy. The serving loop's
    per-step and per-request uploads (live rows, prefill chunks, a row's start, the drafter's prefill and catch-up)
    go through `upload` instead, which queues a pinned copy; on CPU it is the same tensor, so outputs are unchanged."""
    from workbench.engine import graphs as graphs_mod
    from workbench.engine import step as step_mod

    real, calls = torch.tensor, []

    def spy(*args, **kw):
        if kw.get("device") is not None:
            import traceback
            calls.append(traceback.extract_stack(limit=2)[0].name)
        return real(*args, **kw)

    class Torch:  # torch as the two modules see it, with `tensor` spied on
        def __getattr__(self, name):
            return spy if name == "tensor" else getattr(torch, name)

    engine = make_engine("draft", target, draft)  # a draft model: prefill, catch-up and start all run
    reqs = random_requests(6)
    serve(engine, reqs[:1])  # setup (buffers, pad rows) may upload once; the spy covers the runs after it
    monkeypatch.setattr(step_mod, "torch", Torch())
    monkeypatch.setattr(graphs_mod, "torch", Torch())
    uploads = []
    real_upload = step_mod.upload
    monkeypatch.setattr(step_mod, "upload", lambda v, d: uploads.append(1) or real_upload(v, d))
    res = serve(engine, reqs, prefill_chunk=5)
    assert_solo(res, reqs, solo)
    assert calls == [], f"syncing uploads in {sorted(set(calls))}"
    assert len(uploads) >= len(reqs)  # the uploads did happen, through `upload`


def test_serving_writes_no_host_scalar_into_engine_state(target, draft, solo, monkeypatch):
    """`state[row] = n` on a CUDA tensor copies a host scalar and synchronizes (3 such syncs per request were found
    in serving: a row's root token and kv_len at its start, its kv_len at release). The engine's per-row state
    (tokens, kv_len) is written by `upload` or `fill_` instead: no Python number ever reaches their __setitem__
    during a serve with chunked prefill (on CPU the same values land, so outputs are unchanged)."""
    engine = make_engine("draft", target, draft)
    reqs = random_requests(6)
    serve(engine, reqs[:1])
    state = (engine.tokens, engine.kv_len)
    real, scalars = torch.Tensor.__setitem__, []

    def spy(self, index, value):
        if any(self is t for t in state) and isinstance(value, (int, float, bool)):
            scalars.append(index)
        return real(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", spy)
    res = serve(engine, reqs, prefill_chunk=5)
    assert_solo(res, reqs, solo)
    assert scalars == [], f"host scalars written into engine state at {scalars[:5]}"


def test_serving_reads_an_iterations_first_tokens_at_once(target, draft, solo, monkeypatch):
    """Requests that finish their prefill in the same iteration have their first tokens read together: one
    device->host read per such iteration, not one per request (each read waits for the GPU). Requests all arriving at
    once make several finish together; the outputs still equal each request's solo greedy output."""
    import traceback

    from workbench.serving import loop as loop_mod

    reqs = [Request(i, r.prompt, r.max_new_tokens, arrival_s=0.0) for i, r in enumerate(random_requests(3))]
    engine = make_engine("ngram", target, draft)
    reads, real_tolist, real_int = [], torch.Tensor.tolist, torch.Tensor.__int__

    def site():
        return traceback.extract_stack(limit=3)[0].filename == loop_mod.__file__

    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (reads.append(self.numel()) if site() else None)
                        or real_tolist(self))
    monkeypatch.setattr(torch.Tensor, "__int__", lambda self: (reads.append("int") if site() else None)
                        or real_int(self))
    res = serve(engine, reqs, max_num_seqs=4)
    assert_solo(res, reqs, solo)
    assert "int" not in reads and sum(reads) == len(reqs)  # every first token read once, all through tolist
    assert len(reads) < len(reqs) and max(reads) == 4  # 4 rows joined together in the first iteration


def test_gpu_serving_parity_script_on_cpu(tmp_path):
    """scripts/gpu_serving_parity.py (the GPU record of in-flight parity) on a CPU with the committed tiny preset:
    every setting serves all requests equal to their solo greedy outputs, with real batching, preemptions and
    prefix hits; full overlap (the default) launches steps ahead in every setting it applies to, and the settings that
    switch it off, or that preempt (max_util), launch none; both files written; exit status 0."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving_parity

    assert gpu_serving_parity.main(["--device", "cpu", "--preset", "tiny", "--num-requests", "6",
                                    "--max-new-tokens", "10", "--graphs", "--out", str(tmp_path)]) == 0
    rows = {r["setting"]: r for r in json.loads((tmp_path / "serving_parity.json").read_text())["rows"]}
    assert set(rows) == set(gpu_serving_parity.SETTINGS)
    for name, r in rows.items():  # full overlap by default (fixed shapes), not where turned off or preempting
        assert (r["steps_ahead"] > 0) == ("no full overlap" not in name and "max_util" not in name), name
        assert r["serve_tuning"] == format_serve_tuning(ServeTuning(full_overlap="no full overlap" not in name)), name
    assert all(r["equal"] == r["requests"] == 6 and not r["differ"] for r in rows.values())
    assert rows["off"]["max_batch"] > 1
    assert rows["draft k=4, max_util preemption"]["preemptions"] > 0
    assert rows["ngram k=4, prefix reuse"]["prefix_hit_rate"] > 0
    assert "| off | 6/6 |" in (tmp_path / "serving_parity.md").read_text()


def test_serve_tuning_reads_its_fields_or_names_the_problem():
    """ServeTuning's text (the knob serve_tuning): empty is the defaults (4 rows per prefill forward, both overlaps
    on); each field takes its value; an unknown field or a bad value is a ValueError that names it and what to give
    (the worked examples too)."""
    import doctest

    from workbench.serving import tuning

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(tuning, "tuning"):
        runner.run(test)
    assert (runner.failures, runner.tries) == (0, 3)
    assert tuning.parse_serve_tuning("") == tuning.ServeTuning(4, True, True)
    assert tuning.parse_serve_tuning(" batch_prefill = 3 ").batch_prefill == 3
    for bad, match in (("batch_prefill=two", "batch_prefill='two': give a whole number"),
                       ("batch_prefill=-1", "batch_prefill=-1: give the most rows per prefill forward"),
                       ("full_overlap=2", "full_overlap='2': give 1 .on. or 0 .off."),
                       ("overlap=1", "unknown serve tuning field 'overlap'; the fields are batch_prefill")):
        with pytest.raises(ValueError, match=match):
            tuning.parse_serve_tuning(bad)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kind", ["eagle", "redrafter-w3", "draft", "ngram"])
@pytest.mark.parametrize("rule", ["switch-off", "long-context"])
def test_adaptive_rules_with_every_drafter_keep_outputs(target, draft, solo, kind, rule, graphs, monkeypatch):
    """Per-row switch-off by acceptance and the long-context cut give some rows k = 0 while others draft (tree
    drafters too: verified whole or not at all), eager and with fixed shapes: outputs equal solo greedy, and with
    graph outputs overwritten per replay (`static_outputs`) every step drafts and accepts as with fresh outputs."""
    from tests.test_engine import make_drafter

    reqs = [Request(r.id, r.prompt, r.max_new_tokens, arrival_s=float(r.id // 3)) for r in long_requests(6, n=8)]
    def run():
        drafter = make_drafter(kind, draft, target)
        n = drafter.num_nodes
        ad = AdaptiveSpeculation(n, off_acceptance=0.9, window=2) if rule == "switch-off" else \
            AdaptiveSpeculation(n, max_context=25, long_context_k=0)
        engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=64, kv_block_size=BS, cuda_graphs=graphs,
                                                          graph_batch_sizes=(1, 2, 4)))
        res = serve(engine, reqs, adaptive=ad)
        assert_solo(res, reqs, solo)
        return [(t.request, t.accepted, t.drafted, t.k) for t in res.traces]
    static_outputs(monkeypatch, on=False)
    fresh = run()
    assert any(k == 0 for *_, k in fresh) and any(k > 0 for *_, k in fresh)
    if graphs:
        static_outputs(monkeypatch)
        assert run() == fresh


@pytest.mark.parametrize("static", [False, True], ids=["fresh", "static-outputs"])
@pytest.mark.parametrize("kind", ["ar", "ngram", "draft"])
@pytest.mark.parametrize("setting", ["whole", "chunked", "prefix", "schedule"])
def test_full_overlap_launches_ahead_and_keeps_outputs(target, draft, solo, kind, setting, static, monkeypatch):
    """full_overlap (on by default): with fixed shapes (the device n-gram lookup and the draft model's
    fused chain read the device) each step is launched before the previous one is read: two steps are in flight at
    some point, outputs equal each request's solo greedy output, no row is released or prefilled while a step over
    it is in flight, and every block comes back; also when every replay overwrites its graph's one output tensor,
    as on a GPU (`static_outputs`: the next step's replay lands before the last one is read)."""
    static_outputs(monkeypatch, on=static)
    shared = [random.Random(5).randrange(64) for _ in range(9)] if setting == "prefix" else None
    reqs = long_requests(4, n=8, shared=shared)
    engine = make_engine(kind, target, draft, cuda_graphs=True, graph_batch_sizes=(1, 2, 4))
    pending: list[set[int]] = []  # rows of each launched, unread step (oldest first)
    events = {"most_pending": 0, "released_under_step": 0, "prefilled_under_step": 0}

    def spy(name, real):
        def call(*args, **kwargs):
            if name == "launch_step":
                out = real(*args, **kwargs)
                pending.append(set(args[0]))
                events["most_pending"] = max(events["most_pending"], len(pending))
                return out
            if name == "finish_step":
                pending.pop(0)
            elif name == "release_row":
                events["released_under_step"] += any(args[0] in rows for rows in pending)
            elif name in ("prefill_row", "prefill_rows"):
                rows = args[0] if name == "prefill_rows" else [args[0]]
                events["prefilled_under_step"] += any(r in p for r in rows for p in pending)
            return real(*args, **kwargs)
        return call

    for name in ("launch_step", "finish_step", "release_row", "prefill_row", "prefill_rows"):
        monkeypatch.setattr(engine, name, spy(name, getattr(engine, name)))
    kw = {"whole": {}, "chunked": {"prefill_chunk": 6}, "prefix": {"prefix_caching": True, "prefill_chunk": 8},
          "schedule": {"adaptive": AdaptiveSpeculation(3, k_by_batch=[(1, 1, 3), (2, 3, 2), (4, 64, 1)])}}
    res = serve(engine, reqs, tuning=ServeTuning(full_overlap=True), **kw[setting])
    assert_solo(res, reqs, solo)
    assert res.full_overlap and res.steps_ahead > 0 and events["most_pending"] == 2
    assert events["released_under_step"] == 0 and events["prefilled_under_step"] == 0
    assert not pending and engine.cache.used_blocks == 0


@pytest.mark.parametrize("adaptive", [AdaptiveSpeculation(3, k_by_batch=[(1, 64, 0)]), AdaptiveSpeculation(0)],
                         ids=["schedule-all-zero", "k0"])
def test_full_overlap_with_a_draft_model_that_never_drafts(target, draft, solo, adaptive, monkeypatch):
    """A draft-model engine whose schedule never drafts (k = 0 at every batch size: what a loop calibration measures
    as "off") launches ahead as speculation off does: steps in flight two at a time, outputs equal solo greedy, and
    the draft model never runs (no prefill at join, no catch-up). Before, it lost full overlap, so the calibration
    rated off below what serving off gives (by 1.15-1.29x on the H200)."""
    reqs = long_requests(4, n=8)
    engine = make_engine("draft", target, draft, cuda_graphs=True, graph_batch_sizes=(1, 2, 4))
    draft_calls = []
    for obj, name in ((engine, "catch_up_drafter"), (engine.drafter, "prefill"), (engine.drafter, "propose")):
        real = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, _r=real, _n=name, **k: draft_calls.append(_n) or _r(*a, **k))
    res = serve(engine, reqs, adaptive=adaptive, tuning=ServeTuning(full_overlap=True))
    assert_solo(res, reqs, solo)
    assert res.full_overlap and res.steps_ahead > 0
    assert res.draft_catch_up_tokens == 0 and not draft_calls
    assert all(t.k == 0 and t.drafted == 0 for t in res.traces)


@pytest.mark.parametrize("why", ["max_util", "eager", "draft-schedule-with-zero"])
def test_full_overlap_falls_back_where_it_cannot_apply(target, draft, solo, why):
    """Where a step needs the host's read of the one before (a host n-gram scan without fixed shapes), a draft model
    that some steps skip (catch-up reads exact lengths), or a policy that preempts, full_overlap leaves the loop as
    it was: no step launched ahead, outputs still equal solo greedy."""
    reqs = long_requests(4, n=6)
    kind, graphs, kw = {
        "max_util": ("ar", True, {"policy": "max_util"}),
        "eager": ("ngram", False, {}),
        "draft-schedule-with-zero": ("draft", True, {"adaptive": AdaptiveSpeculation(3, k_by_batch=[(1, 1, 3),
                                                                                                    (2, 64, 0)])}),
    }[why]
    extra = dict(cuda_graphs=True, graph_batch_sizes=(1, 2, 4)) if graphs else {}
    res = serve(make_engine(kind, target, draft, **extra), reqs, tuning=ServeTuning(full_overlap=True), **kw)
    assert_solo(res, reqs, solo)
    assert not res.full_overlap and res.steps_ahead == 0


def test_loop_runs_its_own_tuning_only(target, draft, solo):
    """A loop given no tuning runs ServeTuning's defaults and records them; each loop runs the tuning it was given,
    whatever loops before it ran (no state outside the loop), and says how it ran; anything but a ServeTuning is a
    named ServeError before any work."""
    reqs = long_requests(4, n=6)
    engine = make_engine("ngram", target, draft, cuda_graphs=True, graph_batch_sizes=(1, 2, 4))
    default = serve(engine, reqs)
    assert default.tuning == ServeTuning() and default.full_overlap and default.steps_ahead > 0
    assert (default.overlap, default.batch_prefill) == ("full", ServeTuning().batch_prefill)
    other = serve(engine, reqs, tuning=ServeTuning(batch_prefill=1, overlap_prefill=False, full_overlap=False))
    assert (other.overlap, other.batch_prefill, other.full_overlap, other.steps_ahead) == ("none", 1, False, 0)
    again = serve(engine, reqs)
    assert again.tuning == ServeTuning() and again.full_overlap and again.steps_ahead > 0
    for res in (default, other, again):
        assert_solo(res, reqs, solo)
    with pytest.raises(ServeError, match="tuning must be a ServeTuning.*parse_serve_tuning"):
        ServingLoop(engine, reqs, tuning="full_overlap=0")


def test_gpu_serving_parity_names_unknown_settings(tmp_path, capsys, monkeypatch):
    """An unknown --settings name stops the parity script before any model loads (exit 2), listing the known ones."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving_parity

    loads = []
    monkeypatch.setattr(gpu_serving_parity.BenchSession, "load", lambda *a, **kw: loads.append(1))

    assert gpu_serving_parity.main(["--device", "cpu", "--out", str(tmp_path), "--settings", "off;nonesuch"]) == 2
    err = capsys.readouterr().err
    assert "nonesuch" in err and "ngram k=4, prefix reuse" in err
    assert not (tmp_path / "serving_parity.json").exists()
    assert loads == []


def test_drain_metrics_count_the_tail_after_the_last_arrival(target, draft):
    """drain_s / drain_output_share (StepClock, one unit per iteration; a token at the last arrival's time counts in
    the tail): all requests at t = 0 put every token in the tail (share 1, drain = the whole run); a late last
    arrival leaves the earlier tokens out of it. The share
    counts each output token once: recounted here from each request's emission times and the steps' kept tokens.
    arrival_window_output_throughput is the rest over the arrival window (None when all arrive at once)."""
    from workbench.serving.metrics import summarize

    at_once = [Request(i, r.prompt, r.max_new_tokens, arrival_s=0.0) for i, r in enumerate(random_requests(4))]
    res = serve(make_engine("ngram", target, draft), at_once)
    rec = summarize(res)
    assert rec["drain_output_share"] == 1.0 and rec["drain_s"] == pytest.approx(rec["duration_s"])
    late = [Request(i, r.prompt, r.max_new_tokens, arrival_s=float(i)) for i, r in enumerate(random_requests(5))]
    late.append(Request(len(late), late[0].prompt, 2, arrival_s=60.0))  # arrives after the others finished
    res = serve(make_engine("ngram", target, draft), late)
    rec = summarize(res)
    last = max(s.t_arrival for s in res.states)
    assert last == 60.0 and rec["drain_s"] == pytest.approx(max(s.t_done for s in res.states) - 60.0)
    tokens = {s.req.id: len(s.output) for s in res.states}
    after = sum(1 for s in res.states if s.t_first_token >= last)  # first tokens, by their time
    after += sum(t.emitted for t in res.traces if res.iterations[t.step].t_end >= last)
    assert sum(t.emitted for t in res.traces) + len(res.states) == sum(tokens.values())  # each token counted once
    assert rec["drain_output_share"] == pytest.approx(after / sum(tokens.values()))
    assert 0 < rec["drain_output_share"] < 0.2
    assert after <= tokens[len(late) - 1]  # only the late request's tokens are in the tail
    # the output rate while requests arrive: the tokens before the last arrival over first -> last arrival
    first = min(s.t_arrival for s in res.states)
    assert rec["arrival_window_output_throughput"] == pytest.approx(
        (sum(tokens.values()) - after) / (last - first))
    assert summarize(serve(make_engine("ngram", target, draft), at_once))["arrival_window_output_throughput"] is None
