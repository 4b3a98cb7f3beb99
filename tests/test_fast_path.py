"""The fixed-shape step (workbench/engine/graphs.py) on CPU: bucketed, padded, persistent buffers, run eagerly.

On a GPU the same step is captured in CUDA graphs (scripts/gpu_fastpath.py records that parity); here we check what
does not need a GPU: every drafter still reproduces greedy decoding token for token through the padded step, padding
rows never change real rows, a batch above every bucket falls back and is counted, state persists across calls, and
bad settings are named.
"""
import pytest
import torch

from tests.test_engine import (DRAFTERS, PROMPTS, TwoBranchDrafter, draft, make_drafter,  # noqa: F401 (fixtures)
                               reference_greedy, target)
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DraftModelDrafter
from workbench.engine.graphs import GraphSettings, GraphSettingsError
from workbench.engine.sampling import SamplingParams


def fast(**kw) -> EngineConfig:
    kw.setdefault("graph_batch_sizes", (1, 2, 4))
    return EngineConfig(cuda_graphs=True, kv_block_size=4, **kw)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("kind", DRAFTERS)
def test_fixed_shape_greedy_equals_autoregressive(kind, paged, target, draft):
    n = 20
    expected = [reference_greedy(target, p, n) for p in PROMPTS]
    engine = SpecEngine(target, make_drafter(kind, draft, target), fast(max_new_tokens=n, paged=paged))
    for p, e in zip(PROMPTS, expected):  # batch 1: bucket 1, no padding
        assert engine.generate([p]).outputs == [e]
    res = engine.generate(PROMPTS)  # batch 3 -> bucket 4 (one padding row), shrinking as rows finish
    assert res.outputs == expected
    stats = res.graph_stats
    assert stats.misses == 0 and stats.hits >= len(res.steps)
    assert stats.padded_rows > 0 and 0 < stats.padding_waste < 1


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("kind", ["ar", "draft", "ngram", "eagle"])
def test_captured_prefill_pads_the_prompt_length_and_changes_nothing(kind, paged, target, draft):
    """prefill_graphs (on by default with cuda_graphs): the prompts' forward runs at the length padded up to a multiple
    of PREFILL_LEN_MULTIPLE (eagerly on CPU, over the same buffers a GPU graph reads), one key per (batch, padded
    length); outputs equal the unpadded prefill's and greedy AR's, in batches and alone."""
    n = 40  # room in the cache for a padded length of 32
    expected = [reference_greedy(target, p, n) for p in PROMPTS]
    engines = {on: SpecEngine(target, make_drafter(kind, draft, target),
                              fast(max_new_tokens=n, paged=paged, prefill_graphs=on)) for on in (True, False)}
    for on, engine in engines.items():
        assert engine.generate(PROMPTS).outputs == expected
        for p, e in zip(PROMPTS, expected):
            assert engine.generate([p]).outputs == [e]
    padded = engines[True]
    assert set(padded.prefill_step.fixed._buffers) == {(3, 32), (1, 32)}  # lengths 12 / 9, 3 -> 32
    assert padded.prefill_step.stats.hits == 4 and not engines[False].prefill_step.stats.hits
    if kind == "draft":
        assert set(padded.drafter.prefill_step.fixed._buffers) == {(3, 32), (1, 32)}
    if paged:  # the pool holds every row's padded prompt at once (3 rows x 32 / block 4), not just the longest's
        assert padded.cache.num_blocks >= 3 * 32 // 4


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_fixed_shape_tree_drafts_equal_autoregressive(paged, target):
    n = 20
    noisy = make_drafter("noisy-self-draft", None, target).model
    engine = SpecEngine(target, TwoBranchDrafter(noisy, k=3), fast(max_new_tokens=n, paged=paged))
    assert engine.generate(PROMPTS).outputs == [reference_greedy(target, p, n) for p in PROMPTS]


@torch.inference_mode()
def test_padding_rows_never_change_real_rows(target, draft):
    """The same batch through bucket 4, bucket 8 (five padding rows) and the eager step: identical outputs, and
    the rows' verify logits agree (padding rows write only to the scratch row)."""
    outs = []
    for sizes in [(4,), (8,)]:
        engine = SpecEngine(target, DraftModelDrafter(draft, k=3), fast(max_new_tokens=12, graph_batch_sizes=sizes))
        res = engine.generate(PROMPTS)
        assert res.graph_stats.padded_rows >= (sizes[0] - 3) * len(res.steps)
        outs.append(res.outputs)
    eager = SpecEngine(target, DraftModelDrafter(draft, k=3), EngineConfig(max_new_tokens=12, kv_block_size=4))
    outs.append(eager.generate(PROMPTS).outputs)
    assert outs[0] == outs[1] == outs[2]

    # logits of a verify pass: rows 0..2 real, padded to 8, against the same rows run unpadded
    engine = SpecEngine(target, None, fast(max_new_tokens=4, graph_batch_sizes=(8,)))
    engine.generate(PROMPTS)  # allocates the cache
    step, cache = engine.target_step, engine.cache
    prompts = [[4, 5, 6, 7], [8, 9], [10, 11, 12]]
    logits = []
    for padded in (True, False):
        cache.reset()
        rows = torch.arange(3)
        base = torch.zeros(3, dtype=torch.long)
        ids = torch.tensor([[p[0]] for p in prompts])
        if padded:
            out = step(rows, [0, 1, 2], ids, torch.zeros(3, 1, dtype=torch.long), base, [0, 0, 0])
        else:
            cache.begin(rows, base, [0, 0, 0], 1, rows_host=[0, 1, 2])
            out = target.compute_logits(target(ids, torch.zeros(3, 1, dtype=torch.long), cache))
        logits.append(out)
    torch.testing.assert_close(logits[0], logits[1])


def test_bucket_miss_falls_back_to_eager_and_is_counted(target, draft):
    n = 10
    engine = SpecEngine(target, DraftModelDrafter(draft, k=3), fast(max_new_tokens=n, graph_batch_sizes=(1, 2)))
    res = engine.generate(PROMPTS)  # batch 3 > largest bucket 2: misses until a row leaves
    assert res.outputs == [reference_greedy(target, p, n) for p in PROMPTS]
    assert res.graph_stats.misses >= 1
    assert res.graph_stats.hits + res.graph_stats.misses >= len(res.steps)


def test_state_persists_across_generate_calls(target, draft):
    engine = SpecEngine(target, DraftModelDrafter(draft, k=3), fast(max_new_tokens=8))
    engine.generate(PROMPTS)
    cache, step, draft_cache = engine.cache, engine.target_step, engine.drafter.cache
    engine.generate(PROMPTS[:2])
    engine.generate([PROMPTS[1]])
    assert engine.cache is cache and engine.target_step is step and engine.drafter.cache is draft_cache
    assert engine.graph_stats().hits > 0
    engine.generate([[1] * 300])  # longer than the cache holds: it grows, the step and its buckets are rebuilt
    assert engine.cache is not cache and engine.cache.max_len >= 300


def test_sampled_fixed_shape_matches_eager_sampling(target, draft):
    """Same seed, same prompts: the padded step draws exactly the tokens the eager step draws (sampling runs outside
    the fixed-shape forward on the same generator, so padding cannot shift the random stream)."""
    params = SamplingParams(temperature=1.0)
    outs = []
    for cfg in [fast(max_new_tokens=12, sampling=params, seed=3),
                EngineConfig(max_new_tokens=12, sampling=params, seed=3, kv_block_size=4)]:
        outs.append(SpecEngine(target, DraftModelDrafter(draft, k=3), cfg).generate(PROMPTS).outputs)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(compile="fast"), "unknown compile mode 'fast'"),
    (dict(graph_batch_sizes=()), "graph_batch_sizes is empty"),
    (dict(graph_batch_sizes=(4, 2)), "strictly increasing"),
    (dict(graph_batch_sizes=(1, 1, 2)), "strictly increasing"),
    (dict(graph_batch_sizes=(0, 2)), "integers >= 1"),
])
def test_bad_graph_settings_are_named(kwargs, message):
    with pytest.raises(GraphSettingsError, match=message):
        EngineConfig(cuda_graphs=True, **kwargs)


def test_bucket_choice():
    s = GraphSettings(True, (1, 2, 4, 8))
    assert [s.bucket(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert not GraphSettings().fixed_shape and GraphSettings(compile="default").fixed_shape


def test_compiled_fixed_shape_step_equals_eager(target):
    """torch.compile (inductor) over the fixed-shape step: the same greedy tokens as the reference."""
    n = 6
    engine = SpecEngine(target, None, EngineConfig(max_new_tokens=n, compile="default", graph_batch_sizes=(1, 4),
                                                   kv_block_size=4))
    assert engine.generate(PROMPTS).outputs == [reference_greedy(target, p, n) for p in PROMPTS]


def test_compiled_steps_of_two_attention_backends_on_one_model_stay_apart(target):
    """A step compiled over a kernel-path cache (the fused K/V write + attention, here its PyTorch reference: no GPU)
    must not be reused for a gather + SDPA cache of another engine on the same model: the compiled frames are guarded
    on whether the cache has the kernels (it once passed the SDPA cache unrotated q / k, and `attend` refused)."""
    from kernels.paged_attention import paged_attention_reference, paged_kv_write_reference

    def attention(q, k_pool, v_pool, table, rows, base, intra, block, rope=None, prefix_mask=None, bits=None,
                  k_scales=None, v_scales=None):
        return paged_attention_reference(q, k_pool, v_pool, table, rows, base, intra, block, rope=rope,
                                         prefix_mask=prefix_mask)

    def write_attention(q, k, v, slots, k_pool, v_pool, table, rows, base, intra, block, rope=None, prefix_mask=None,
                        bits=None):
        paged_kv_write_reference(k, v, k_pool, v_pool, slots, rope=rope)
        return attention(q, k_pool, v_pool, table, rows, base, intra, block, rope=rope, prefix_mask=prefix_mask)

    n = 5
    expected = [reference_greedy(target, p, n) for p in PROMPTS[:1]]
    config = EngineConfig(max_new_tokens=n, compile="default", graph_batch_sizes=(1, 2), kv_block_size=4)
    kernel_path = SpecEngine(target, None, config)
    kernel_path.generate(PROMPTS[:1])  # its cache exists now
    kernel_path.cache.kernel = torch.compiler.disable(attention)
    kernel_path.cache.write_kernel = torch.compiler.disable(write_attention)
    assert kernel_path.generate(PROMPTS[:1]).outputs == expected
    assert kernel_path.cache.fuses_rope()  # the step ran the fused path (q / k rotated in the kernel)
    sdpa = SpecEngine(target, None, config)
    assert sdpa.generate(PROMPTS[:1]).outputs == expected
    assert not sdpa.cache.fuses_rope()


def test_compiled_prefill_switch_compiles_the_prompt_forward_and_keeps_greedy_output(target, draft):
    """The `compile_prefill` knob (EngineConfig): the captured prompt forwards (target and draft model) compile with
    the decode steps' mode, and the greedy output stays the reference's; without it (the default), they stay
    uncompiled."""
    n = 6
    expected = [reference_greedy(target, p, n) for p in PROMPTS]
    for knob in (False, True):
        engine = SpecEngine(target, DraftModelDrafter(draft, k=3),
                            fast(max_new_tokens=n, compile="default", compile_prefill=knob))
        assert engine.generate(PROMPTS).outputs == expected
        steps = [engine.prefill_step.fixed, engine.drafter.prefill_step.fixed]
        assert [s._fn is not s.body for s in steps] == [knob, knob]


def test_triton_attention_without_a_gpu_is_a_named_error(target):
    with pytest.raises(ValueError, match="attention backend 'triton' needs a paged KV cache on a CUDA GPU"):
        SpecEngine(target, None, EngineConfig(attention="triton")).generate([[1, 2, 3]])
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        EngineConfig(attention="flash")


@torch.inference_mode()
def test_warm_up_before_a_capture_leaves_the_state_as_it_was(target, draft):
    """The fused verify step advances kv_len and writes tokens; the warm-up runs that precede a CUDA-graph capture
    (which happens on first use, mid-generation) must not advance them, or that step would count three times."""
    engine = SpecEngine(target, DraftModelDrafter(draft, k=3), fast(max_new_tokens=8))
    engine.generate(PROMPTS)
    step = engine.accept_step
    [(key, bufs)] = [(k, b) for k, b in step._buffers.items() if k[0] == 4]
    engine.kv_len[:3] = torch.tensor([10, 11, 12])
    before = engine.kv_len.clone(), engine.tokens.clone()
    step.warm_up(bufs, times=2)
    assert torch.equal(engine.kv_len, before[0]) and torch.equal(engine.tokens, before[1])
    step.body(**bufs.buf)  # without the restore, one run does advance the state (so the check above can fail)
    assert not torch.equal(engine.kv_len, before[0])


def assert_kernel_path_greedy(fixed, target, draft, monkeypatch):
    """The engine with the paged cache's kernel path forced on (whatever stands in for the kernels): draft model k=3,
    12 tokens, eager or fixed-shape; its greedy output equals the reference's."""
    import workbench.engine.kv_cache as kv

    monkeypatch.setattr(kv, "resolve_attention", lambda name, paged, device, kv_quant="none": "triton" if paged
                        else "sdpa")
    n = 12
    cfg = fast(max_new_tokens=n) if fixed else EngineConfig(max_new_tokens=n, kv_block_size=4)
    engine = SpecEngine(target, DraftModelDrafter(draft, k=3), cfg)
    assert engine.generate(PROMPTS).outputs == [reference_greedy(target, p, n) for p in PROMPTS]


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shape"])
def test_kernel_backend_path_equals_greedy_and_skips_prefill(fixed, target, draft, monkeypatch):
    """The engine's kernel path (cache.kernel, taken by attention="triton" on a GPU), run on CPU with the kernel's
    PyTorch reference standing in: the same greedy tokens, and never called for a prompt-length prefill (the Triton
    kernel specializes on T, so each new prompt length would compile: seen on the H200 as an 8.7x slower first repeat)."""
    import kernels.paged_attention as pa

    seen = []

    def spy(q, *args, **kwargs):
        seen.append(q.shape[2])
        return pa.paged_attention_reference(q, *args, **kwargs)

    def write_then_spy(q, k, v, slots, k_pool, v_pool, *rest, rope=None):  # an unquantized pool's fused path
        pa.paged_kv_write_reference(k, v, k_pool, v_pool, slots, rope=rope)
        return spy(q, k_pool, v_pool, *rest, rope=rope)

    monkeypatch.setattr(pa, "paged_attention_triton", spy)
    monkeypatch.setattr(pa, "paged_write_attention_triton", write_then_spy)
    assert_kernel_path_greedy(fixed, target, draft, monkeypatch)
    assert seen and set(seen) <= {1, 2, 4}  # draft forwards (2, 1) and verify (1 + k); no prompt lengths (3, 9, 12)


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shape"])
def test_fused_write_attention_path_equals_greedy(fixed, target, draft, monkeypatch):
    """An unquantized paged cache on the kernel path hands K/V write + attention to one call (`write_kernel`, the
    Triton write then the attention kernel on a GPU); here the two references stand in for them: the same greedy
    tokens, every kernel-path layer call went through it, and the K/V it wrote is what the next steps read."""
    import kernels.paged_attention as pa

    calls = []

    def fused(q, k, v, slots, k_pool, v_pool, *rest, rope=None):  # rope: folded on this path
        calls.append(q.shape[2])
        pa.paged_kv_write_reference(k, v, k_pool, v_pool, slots, rope=rope)
        return pa.paged_attention_reference(q, k_pool, v_pool, *rest, rope=rope)

    def attention_only(*args, **kwargs):
        raise AssertionError("an unquantized paged layer must take the fused call")

    monkeypatch.setattr(pa, "paged_write_attention_triton", fused)
    monkeypatch.setattr(pa, "paged_attention_triton", attention_only)
    assert_kernel_path_greedy(fixed, target, draft, monkeypatch)
    assert calls and set(calls) <= {1, 2, 4}


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shape"])
def test_rope_folded_into_the_fused_call_equals_greedy(fixed, target, draft, monkeypatch):
    """On the fused write + attention path the model hands q and k over unrotated with rope=(cos, sin_signed), and
    the kernels rotate them (here their references): the same greedy tokens, every kernel-path call got the rope,
    and prompt-length forwards (SDPA path) still rotate in the model."""
    import kernels.paged_attention as pa

    ropes = []

    def fused(q, k, v, slots, k_pool, v_pool, *rest, rope=None):
        ropes.append(rope is not None and rope[0].shape == (q.shape[0], q.shape[2], q.shape[3]))
        pa.paged_kv_write_reference(k, v, k_pool, v_pool, slots, rope=rope)
        return pa.paged_attention_reference(q, k_pool, v_pool, *rest, rope=rope)

    monkeypatch.setattr(pa, "paged_write_attention_triton", fused)
    assert_kernel_path_greedy(fixed, target, draft, monkeypatch)
    assert ropes and all(ropes)


OVERLAP_KINDS = ["ar", "draft", "self-draft", "noisy-self-draft", "ngram"]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("kind", OVERLAP_KINDS)
def test_overlapped_steps_equal_synchronous_steps(kind, paged, target, draft):
    """Step t + 1 launched before step t is read: the same tokens and the same per-step records as the synchronous
    loop (the wasted step after a sequence finishes is not recorded), for batch 1 and a ragged batch. Alone, a
    sequence that stops at max_new_tokens runs no wasted step: its last step is read before another is launched."""
    n = 19
    expected = [reference_greedy(target, p, n) for p in PROMPTS]
    runs = {}
    for overlap in (False, True):
        engine = SpecEngine(target, make_drafter(kind, draft, target), fast(max_new_tokens=n, paged=paged,
                                                                           overlap=overlap))
        singles = [engine.generate([p]) for p in PROMPTS]
        batch = engine.generate(PROMPTS)
        assert engine.overlaps() is overlap
        assert [r.outputs[0] for r in singles] == expected
        assert batch.outputs == expected
        assert [r.wasted_steps for r in singles] == [0] * len(PROMPTS)
        runs[overlap] = [[(s.step, s.rows, s.drafted, s.accepted, s.emitted, s.path_ranks, s.beam_pairs)
                          for s in r.steps] for r in singles + [batch]]
    assert runs[True] == runs[False]


def test_overlapped_steps_stop_on_eos_and_free_storage(target, draft):
    """A sequence that stops at EOS mid-batch: same outputs as the synchronous loop, and as many blocks back in the
    pool afterwards (the wasted step's and the kept rejected drafts' too; the padding row keeps its own)."""
    n = 24
    plain = SpecEngine(target, DraftModelDrafter(draft, k=3), fast(max_new_tokens=n))
    full = plain.generate(PROMPTS).outputs
    eos = full[1][5]  # a token the second sequence emits early: it stops there, the others may too
    outs, free = {}, {}
    for overlap in (False, True):
        engine = SpecEngine(target, DraftModelDrafter(draft, k=3),
                            fast(max_new_tokens=n, overlap=overlap, stop_on_eos=True, eos_token_id=eos))
        outs[overlap] = engine.generate(PROMPTS).outputs
        free[overlap] = (engine.cache.num_blocks - engine.cache.free_blocks,
                         engine.drafter.cache.num_blocks - engine.drafter.cache.free_blocks)
    assert outs[True] == outs[False]
    assert free[True] == free[False] and max(free[True]) <= 2  # blocks still held: the padding rows' only
    assert len(outs[True][1]) < n and outs[True][1][-1] == eos
    # an EOS cannot be foreseen: alone, the stopping sequence had the next step launched already (and counted)
    alone = engine.generate([PROMPTS[1]])
    assert alone.outputs == [outs[True][1]] and len(alone.outputs[0]) + 4 < n and alone.wasted_steps == 1


def test_overlap_applies_only_where_the_device_holds_the_next_step(target, draft):
    """Sampling accepts outside the fused step, the eager step has no fused step (and there ngram scans host
    tokens): none of them overlaps (they run the synchronous loop and still match the reference)."""
    n = 12
    expected = [reference_greedy(target, p, n) for p in PROMPTS]
    ngram = SpecEngine(target, make_drafter("ngram", draft, target), EngineConfig(max_new_tokens=n, overlap=True))
    assert ngram.generate(PROMPTS).outputs == expected and not ngram.overlaps()
    eager = SpecEngine(target, DraftModelDrafter(draft, k=3), EngineConfig(max_new_tokens=n, overlap=True))
    assert eager.generate(PROMPTS).outputs == expected and not eager.overlaps()
    sampled = SpecEngine(target, None, fast(max_new_tokens=n, overlap=True,
                                            sampling=SamplingParams(temperature=0.8)))
    sampled.generate(PROMPTS)
    assert not sampled.overlaps()


def test_overlapped_steps_time_their_phases(target, draft):
    """The cost ratio needs the AR step's verify time and the drafter's draft time: overlapped steps record both."""
    engine = SpecEngine(target, DraftModelDrafter(draft, k=3), fast(max_new_tokens=12, overlap=True, timing=True))
    res = engine.generate(PROMPTS)
    assert engine.overlaps()
    assert res.phase_ms["draft"] > 0 and res.phase_ms["verify"] > 0
    ar = SpecEngine(target, None, fast(max_new_tokens=12, overlap=True, timing=True)).generate(PROMPTS)
    assert ar.phase_ms["verify"] > 0


def test_recompile_limit_hits_are_counted():
    """A compiled frame that passes dynamo's recompile limit runs its new variants eagerly with one warning; the watch
    counts such frames (the bench's compile_fallbacks), and only those warnings."""
    import logging

    from workbench.engine import graphs

    before = graphs.recompile_limit_hits()
    logging.getLogger("torch._dynamo.convert_frame").warning("an unrelated dynamo warning")
    assert graphs.recompile_limit_hits() == before
    torch._dynamo.reset()

    @torch.compile(backend="eager", dynamic=False)
    def scale(x, n):
        return x * n

    # config.patch, not monkeypatch: monkeypatch's undo leaves a torch config module attribute hidden
    with torch._dynamo.config.patch(recompile_limit=2):
        for n in range(4):  # an int argument is a constant to dynamo: one graph per value, the third past the limit
            assert torch.equal(scale(torch.ones(2), n), torch.full((2,), float(n)))
    torch._dynamo.reset()
    assert graphs.recompile_limit_hits() == before + 1
    assert "recompile_limit" in graphs._WATCH.hits[-1]


def test_bench_records_compile_fallbacks_only_with_compile(monkeypatch):
    import dataclasses

    from workbench.harness import bench as bench_mod
    from workbench.harness.bench import BenchConfig, BenchSession

    session = BenchSession.load(preset="tiny", device="cpu")
    from workbench.engine import graphs

    def hits(values):  # the count before the run (bench) and after it (graphs.compile_fallback_columns)
        it = iter(values)
        for module in (bench_mod, graphs):
            monkeypatch.setattr(module, "recompile_limit_hits", lambda: next(it))

    hits([3, 3, 3])
    cfg = dict(method="ar", batch=1, max_new_tokens=4, num_prompts=1, warmup=0, repeats=1)
    rec = session.run(BenchConfig(**cfg)).record
    assert rec.get("compile_fallbacks") is None and rec.get("compile_fallbacks_in_process") is None
    hits([3, 5, 5])  # two frames passed the limit during this run
    eager_engine = BenchSession._engine  # run eagerly (a CPU compile is slow): only the record is checked here
    monkeypatch.setattr(bench_mod.BenchSession, "_engine",
                        lambda self, c, drafter: eager_engine(self, dataclasses.replace(c, compile="off"), drafter))
    rec = session.run(BenchConfig(**cfg, compile="default")).record
    assert rec["compile_fallbacks"] == 2 and rec["compile_fallbacks_in_process"] == 5
