"""KV-cache formats (workbench/engine/kv_quant.py): round-trip error bounds, bytes, paged == contiguous in every
format, greedy conformance of every drafter with a quantized target KV against AR with the same format, a
quantized draft KV (lossless), fixed-shape steps, and named errors. The Triton kernel's parity with quantized pools
is in tests/test_kernels.py (under TRITON_INTERPRET=1)."""
import pytest
import torch

from tests.test_engine import DRAFTERS, PROMPTS, draft, make_drafter, random_model, target  # noqa: F401 (fixtures)
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DraftModelDrafter
from workbench.engine.kv_cache import ContiguousKVCache, PagedKVCache, make_cache, resolve_attention
from workbench.engine.kv_quant import KV_FORMATS, KVFormatError, kv_format
from workbench.settings import KNOBS

QUANTIZED = ["int8", "fp8"]


def test_the_registry_offers_exactly_the_engines_formats():
    assert KNOBS["target_kv_quant"].choices == KNOBS["draft_kv_quant"].choices == tuple(KV_FORMATS)


def head_vectors(seed=0) -> torch.Tensor:
    """[1000, 4, 64] head vectors over six orders of magnitude, a few outliers, and an all-zero vector."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1000, 4, 64, generator=g) * 10 ** torch.empty(1000, 4, 1).uniform_(-3, 3, generator=g)
    x[::97, :, 5] *= 50  # outliers: one element far above the rest of its vector
    x[3, 2] = 0
    return x


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_error_is_within_the_documented_bound(name):
    fmt = kv_format(name)
    x = head_vectors()
    values, scale = fmt.quantize(x)
    assert values.dtype == fmt.storage and values.shape == x.shape and scale.shape == x.shape[:-1]
    back = fmt.dequantize(values, scale, torch.float32)
    err = (back - x).abs()
    a = x.abs().amax(-1, keepdim=True)
    bound = a / 254 if name == "int8" else x.abs() / 16 + a / (448 * 1024)
    assert (err <= bound * (1 + 1e-5) + 1e-30).all(), float((err - bound).max())
    assert (back[3, 2] == 0).all() and torch.isfinite(back).all()
    # the bound is tight, not loose by orders of magnitude: the worst element uses most of it
    assert (err / bound.clamp_min(1e-30)).max() > 0.9
    # the largest element of each vector is stored at full scale: exact for int8, within e4m3's rounding for fp8
    peak = x.abs().argmax(-1, keepdim=True)
    assert torch.allclose(back.gather(-1, peak), x.gather(-1, peak), rtol=1e-6 if name == "int8" else 1 / 16)


def test_none_stores_the_values_themselves():
    x = head_vectors()
    values, scale = kv_format("none").quantize(x)
    assert values is x and scale is None and kv_format("none").dequantize(values, None, torch.float32) is x


@pytest.mark.parametrize("name, per_token", [("none", 2 * 2 * 3 * 16 * 4), ("int8", 2 * 2 * 3 * (16 + 4)),
                                             ("fp8", 2 * 2 * 3 * (16 + 4))])
def test_bytes_per_token_is_what_the_cache_allocates(name, per_token):
    kw = dict(num_layers=2, num_kv_heads=3, head_dim=16, max_rows=2, max_len=8, dtype=torch.float32, device="cpu",
              kv_quant=name)
    contiguous, paged = ContiguousKVCache(**kw), PagedKVCache(**kw, block_size=4)
    assert contiguous.bytes_per_token == paged.bytes_per_token == per_token
    assert contiguous.nbytes == per_token * (2 + 1) * 8  # rows + pad_row, 8 slots each
    assert paged.nbytes == per_token * paged.k.shape[1]


def attend_steps(cache, seed=1) -> list[torch.Tensor]:
    """A prefill of 5, a decode, a 3-token tree step and a decode over rows [2, 0] -> each step's attention."""
    rows, base, outs = torch.tensor([2, 0]), [0, 0], []
    g = torch.Generator().manual_seed(seed)
    for t in [5, 1, 3, 1]:
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3) if t == 3 else None
        cache.begin(rows, torch.tensor(base), base, t, mask)
        q, k, v = (torch.randn(2, h, t, 8, generator=g) for h in (4, 2, 2))
        outs.append(cache.attend(0, q, k, v))
        base = [b + t for b in base]
    return outs


@pytest.mark.parametrize("name", QUANTIZED)
def test_paged_and_contiguous_agree_in_every_format(name):
    kw = dict(num_layers=1, num_kv_heads=2, head_dim=8, max_rows=3, max_len=40, dtype=torch.float32, device="cpu")
    contiguous = attend_steps(ContiguousKVCache(**kw, kv_quant=name))
    paged = attend_steps(PagedKVCache(**kw, block_size=3, kv_quant=name))
    for a, b in zip(contiguous, paged):
        torch.testing.assert_close(a, b)
    # and the format really changed what attention read: not the unquantized result
    plain = attend_steps(PagedKVCache(**kw, block_size=3))
    assert max((a - b).abs().max() for a, b in zip(paged, plain)) > 1e-4


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_move_carries_the_scales(name):
    """A tree's accepted node copied down to its depth slot reads back as the same dequantized K/V."""
    for cache in (ContiguousKVCache(1, 2, 8, 2, 16, torch.float32, "cpu", kv_quant=name),
                  PagedKVCache(1, 2, 8, 2, 16, torch.float32, "cpu", block_size=4, kv_quant=name)):
        rows = torch.tensor([1])
        cache.begin(rows, torch.tensor([0]), [0], 6)
        k = torch.randn(1, 2, 6, 8) * torch.arange(1, 7).view(1, 1, 6, 1)  # a different scale per token
        cache.attend(0, torch.randn(1, 2, 6, 8), k, k.clone())
        cache.move(rows, torch.tensor([[5]]), torch.tensor([[2]]))
        cache.begin(rows, torch.tensor([6]), [6], 1)
        keys, _ = cache._read(0)  # [1, Hkv, S, D]
        fmt = cache.format
        want = fmt.dequantize(*fmt.quantize(k[0, :, 5]), torch.float32)  # [Hkv, D]
        torch.testing.assert_close(keys[0, :, 2], want)


def engine(target_model, drafter, kv_quant, paged, fixed=False, n=20):
    extra = dict(cuda_graphs=True, graph_batch_sizes=(1, 2, 4)) if fixed else {}
    return SpecEngine(target_model, drafter, EngineConfig(max_new_tokens=n, paged=paged, kv_block_size=4,
                                                          kv_quant=kv_quant, **extra))


@pytest.fixture(scope="module")
def quantized_ar(target):
    """AR outputs of the test target with each quantized KV format (contiguous, eager): the conformance reference."""
    return {name: engine(target, None, name, paged=False).generate(PROMPTS).outputs for name in QUANTIZED}


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("kind", [d for d in DRAFTERS if d != "ar"])
def test_greedy_with_int8_kv_equals_autoregressive_with_int8_kv(kind, paged, target, draft, quantized_ar):
    """A quantized target KV is a different target, but a fixed one: every drafter reproduces AR with the same
    format token for token (batch 1 and a ragged batch)."""
    eng = engine(target, make_drafter(kind, draft, target), "int8", paged)
    for p, e in zip(PROMPTS, quantized_ar["int8"]):
        assert eng.generate([p]).outputs == [e]
    assert eng.generate(PROMPTS).outputs == quantized_ar["int8"]


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("kind", ["ar", "noisy-self-draft", "redrafter-w3"])
def test_every_format_paged_and_fixed_shape_match_the_reference(name, fixed, kind, target, draft, quantized_ar):
    """The fixed-shape (graph-bucketed) steps quantize inside the step body and pad into the scratch row: the same
    tokens as the eager contiguous AR with that format, in int8 and fp8 (the fused greedy chain step included)."""
    eng = engine(target, make_drafter(kind, draft, target), name, paged=True, fixed=fixed)
    res = eng.generate(PROMPTS)
    assert res.outputs == quantized_ar[name]
    if fixed:
        assert res.graph_stats.hits >= len(res.steps) and res.graph_stats.misses == 0


def test_quantized_kv_changes_the_target_measurably(target, quantized_ar):
    """The conformance above is not vacuous: on this random model a quantized KV changes some greedy tokens."""
    plain = engine(target, None, "none", paged=False).generate(PROMPTS).outputs
    assert any(quantized_ar[name] != plain for name in QUANTIZED)


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_quantized_draft_kv_keeps_the_output_exact(name, target):
    """The draft cache's format changes what the draft proposes, never what the engine emits."""
    plain = engine(target, None, "none", paged=True).generate(PROMPTS).outputs
    noisy = make_drafter("noisy-self-draft", None, target).model
    drafter = DraftModelDrafter(noisy, k=4, kv_quant=name)
    for fixed in (False, True):
        res = engine(target, drafter, "none", paged=True, fixed=fixed).generate(PROMPTS)
        assert res.outputs == plain
        assert drafter.cache.kv_quant == name and drafter.kv_caches() == [drafter.cache]
        assert sum(sum(s.accepted) for s in res.steps) > 0


def test_the_engine_reallocates_its_cache_when_the_format_changes(target):
    eng = engine(target, None, "none", paged=True, n=4)
    eng.generate(PROMPTS)
    assert eng.cache.kv_quant == "none"
    eng.config = EngineConfig(max_new_tokens=4, paged=True, kv_block_size=4, kv_quant="int8")
    eng.generate(PROMPTS)
    assert eng.cache.kv_quant == "int8" and eng.cache.k.dtype == torch.int8


# ---- named errors, before any work -------------------------------------------------------------------------------
def test_unknown_format_is_named_everywhere(target):
    message = "unknown KV-cache format 'int4'; choose one of none, int8, fp8"
    with pytest.raises(KVFormatError, match=message):
        EngineConfig(kv_quant="int4")
    with pytest.raises(KVFormatError, match=message):
        DraftModelDrafter(target, k=2, kv_quant="int4")
    with pytest.raises(KVFormatError, match=message):
        make_cache(True, num_layers=1, num_kv_heads=1, head_dim=8, max_rows=1, max_len=8, dtype=torch.float32,
                   device="cpu", kv_quant="int4")
    with pytest.raises(KVFormatError, match=message):
        resolve_attention("sdpa", True, "cpu", "int4")


def test_a_backend_that_cannot_read_the_format_is_named(monkeypatch):
    """The Triton kernel cannot load float8 before compute capability 8.9: asking for it names why and what to use;
    "auto" falls back to gather + SDPA, which dequantizes every format; int8 stays on the kernel."""
    import kernels.paged_attention as kernel

    monkeypatch.setattr(kernel, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(KVFormatError, match="attention backend 'triton' cannot read kv_quant='fp8' here: float8 e4m3 "
                                            "loads need compute capability 8.9 or newer .*; this GPU is sm_80; use "
                                            "attention 'sdpa' or 'auto'"):
        resolve_attention("triton", True, "cuda", "fp8")
    assert resolve_attention("auto", True, "cuda", "fp8") == "sdpa"
    assert resolve_attention("auto", True, "cuda", "int8") == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_attention("triton", True, "cuda", "fp8") == "triton"
    assert kernel.kv_dtype_problem(torch.int16, None).startswith("it loads KV pools of")


# ---- the run record ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def session():
    from workbench.harness.bench import BenchSession

    return BenchSession.load(preset="tiny", device="cpu")


def test_a_run_records_kv_bytes_memory_and_quality(session):
    """int8 target KV, fp8 draft KV on the tiny preset: the candidate still equals AR with the same target KV, and the
    record carries the KV bytes, the caches' memory and the agreement with model-dtype KV (a store-typed row)."""
    from results.schema import record_to_table
    from workbench.harness.bench import BenchConfig
    from workbench.harness.metrics import greedy_agreement

    cfg = BenchConfig(method="draft", k=3, batch=2, max_new_tokens=12, num_prompts=4, warmup=0, repeats=1,
                      target_kv_quant="int8", draft_kv_quant="fp8")
    res = session.run(cfg)
    rec = res.record
    tcfg, dcfg = session.target.config, session.draft.config
    assert rec["greedy_matches_ar"] is True and rec["acceptance_rate"] > 0
    assert rec["target_kv_quant"] == "int8" and rec["draft_kv_quant"] == "fp8"
    assert rec["kv_bytes_per_token"] == 2 * tcfg.num_hidden_layers * tcfg.num_key_value_heads * (tcfg.head_dim + 4)
    assert rec["draft_kv_bytes_per_token"] == 2 * dcfg.num_hidden_layers * dcfg.num_key_value_heads * (dcfg.head_dim + 4)
    assert rec["kv_cache_mb"] > 0 and rec["draft_kv_cache_mb"] > 0
    assert 0 <= rec["kv_token_agreement"] <= 1 and 0 <= rec["kv_divergent_sequences"] <= 4
    assert (rec["kv_token_agreement"] == 1) == (rec["kv_divergent_sequences"] == 0)
    table = record_to_table(rec)
    assert table.schema.field("kv_bytes_per_token").type == "int64"

    run = lambda **kw: session.run(BenchConfig(method="ar", batch=2, max_new_tokens=12, num_prompts=4, warmup=0,  # noqa: E731
                                               repeats=1, **kw))
    plain = run()
    rec = plain.record
    assert rec["kv_token_agreement"] == 1.0 and rec["kv_divergent_sequences"] == 0
    assert rec["draft_kv_bytes_per_token"] is None and rec["draft_kv_cache_mb"] is None
    assert rec["kv_bytes_per_token"] == 2 * tcfg.num_hidden_layers * tcfg.num_key_value_heads * tcfg.head_dim * 4
    # measured, not assumed: the same figures from the two AR runs' outputs
    ours = run(target_kv_quant="int8")
    assert ours.outputs == res.ar_outputs
    assert (ours.record["kv_token_agreement"], ours.record["kv_divergent_sequences"]) == greedy_agreement(
        ours.outputs, plain.outputs)
    sampled = run(target_kv_quant="fp8", temperature=1.0).record  # sampled runs get the greedy figure too
    assert 0 <= sampled["kv_token_agreement"] <= 1


@pytest.mark.parametrize("change, message", [
    (dict(target_kv_quant="int4"), "target_kv_quant='int4' is not supported by the engine; allowed: 'none', 'int8', "
                                   "'fp8'"),
    (dict(method="draft", draft_kv_quant="fp16"), "draft_kv_quant='fp16' is not supported"),
])
def test_bench_refuses_an_unknown_format_by_name(session, change, message):
    from workbench.harness.bench import BenchConfig, BenchError

    with pytest.raises(BenchError, match=message):
        session.run(BenchConfig(warmup=0, repeats=1, **change))


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shape"])
def test_the_kernel_path_reads_the_quantized_pool_in_place(name, fixed, target, draft, quantized_ar, monkeypatch):
    """The caches' kernel path (attention "triton" on a GPU), run on CPU with the kernel's reference standing in: the
    target's and the draft's caches hand it their int8 / e4m3 pools with the scales (no dequantized copy), and the
    tokens are those of AR with that format."""
    import kernels.paged_attention as pa
    import workbench.engine.kv_cache as kv

    seen = []

    def spy(q, k_pool, v_pool, *args, k_scales=None, v_scales=None, **kwargs):
        seen.append((k_pool.dtype, v_pool.dtype, k_scales is not None and v_scales is not None))
        return pa.paged_attention_reference(q, k_pool, v_pool, *args, k_scales=k_scales, v_scales=v_scales, **kwargs)

    monkeypatch.setattr(pa, "paged_attention_triton", spy)
    monkeypatch.setattr(kv, "resolve_attention", lambda name, paged, device, kv_quant="none": "triton")
    eng = engine(target, DraftModelDrafter(draft, k=3, kv_quant=name), name, paged=True, fixed=fixed)
    assert eng.generate(PROMPTS).outputs == quantized_ar[name]
    stored = torch.int8 if name == "int8" else torch.float8_e4m3fn
    assert seen and set(seen) == {(stored, stored, True)}
