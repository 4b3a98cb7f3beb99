"""kernels/paged_attention: the reference against a naive loop (always, on CPU), the engine's paged cache against the
reference, and the Triton kernel against the reference under the Triton interpreter (TRITON_INTERPRET=1)."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import kernels.paged_attention as pa
from kernels.paged_attention import (MASK_WINDOW, launch_plan, paged_attention, paged_attention_reference,
                                     paged_attention_triton, paged_kv_write_reference, paged_kv_write_triton,
                                     paged_write_attention_triton, rope_reference)
from workbench.engine.kv_cache import PagedKVCache, set_kernels
from workbench.engine.kv_quant import KV_FORMATS
from workbench.engine.tree import DraftTree, verify_mask

# The tree of workbench/engine/tree.py's docstring: root, then "a b" and "c" as two branches.
#   root: root | a: root a | b: root a b | c: root c
TWO_BRANCHES = torch.tensor([[1, 0, 0, 0],
                             [1, 1, 0, 0],
                             [1, 1, 1, 0],
                             [1, 0, 0, 1]], dtype=torch.bool)


def make_case(*, base_lens=(7, 20), hq=4, hkv=4, t=1, dim=16, block_size=4, tree=False, dtype=torch.float32,
              permute_rows=True, shuffle_table=True, table_dtype=torch.long, spare_blocks=1, seed=0, kv_quant="none",
              prefix=None):
    """Random inputs in the kernels' layout. Every slot of the pool holds noise, so anything read past a row's
    length or through a wrong block shows up in the output. kv_quant "int8" / "fp8": the pools hold quantized values
    (as the kernel reads them) and the case has k_scales / v_scales [slots, Hkv]. prefix = M: the case has a random
    prefix_mask [B, T, M] (about half of the M slots before each row's base visible to each query token)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(base_lens)
    num_rows = batch + 1
    max_blocks = math.ceil((max(base_lens) + t) / block_size) + spare_blocks
    num_blocks = num_rows * max_blocks
    table = torch.randperm(num_blocks, generator=g) if shuffle_table else torch.arange(num_blocks)
    rows = torch.randperm(num_rows, generator=g)[:batch] if permute_rows else torch.arange(batch)
    intra = None
    if tree and t == TWO_BRANCHES.shape[0]:
        intra = torch.stack([TWO_BRANCHES, TWO_BRANCHES.tril()])[torch.arange(batch) % 2]  # trees and chains mixed
    elif tree:
        parents = torch.stack([torch.randint(-1, i, (batch,), generator=g) for i in range(t - 1)], 1)  # [B, t-1]
        intra = verify_mask(DraftTree(torch.zeros_like(parents), parents, torch.ones_like(parents),
                                      torch.ones_like(parents).bool()))  # random trees of t-1 nodes
    q = torch.randn(batch, hq, t, dim, generator=g).to(dtype)  # [B, Hq, T, D]
    pools = [torch.randn(num_blocks * block_size, hkv, dim, generator=g) for _ in "kv"]  # [slots, Hkv, D]
    fmt = KV_FORMATS[kv_quant]
    extra = {}  # scales, prefix mask
    if fmt.quantized:
        (k, ks), (v, vs) = (fmt.quantize(x) for x in pools)
        pools = [fmt.kernel_view(k), fmt.kernel_view(v)]
        extra.update(k_scales=ks, v_scales=vs)  # [slots, Hkv]
    else:
        pools = [x.to(dtype) for x in pools]
    if prefix is not None:
        extra["prefix_mask"] = torch.rand(batch, t, prefix, generator=g) < 0.5  # [B, T, M]
    return dict(
        q=q,
        k_pool=pools[0],
        v_pool=pools[1],
        block_table=table.view(num_rows, max_blocks).to(table_dtype),  # [R, max_blocks]
        rows=rows,  # [B]
        base_len=torch.tensor(base_lens),  # [B]
        intra_mask=intra,  # [B, T, T] or None
        block_size=block_size,
        **extra)


def naive_attention(q, k_pool, v_pool, block_table, rows, base_len, intra_mask, block_size, k_scales=None,
                    v_scales=None):
    """One query at a time, in float64: list the positions it may see, look each one up, softmax, weigh.
    Quantized pools are first dequantized (value x scale, in float64)."""
    if k_scales is not None:
        k_pool = k_pool.double() * k_scales.double().unsqueeze(-1)
        v_pool = v_pool.double() * v_scales.double().unsqueeze(-1)
    batch, hq, t, dim = q.shape
    group = hq // k_pool.shape[1]
    out = torch.zeros(batch, hq, t, dim, dtype=torch.float64)
    for b in range(batch):
        base, row = int(base_len[b]), int(rows[b])
        for tok in range(t):
            step = [j for j in range(t) if (j <= tok if intra_mask is None else bool(intra_mask[b, tok, j]))]
            positions = list(range(base)) + [base + j for j in step]
            slots = [int(block_table[row, p // block_size]) * block_size + p % block_size for p in positions]
            for h in range(hq):
                keys = k_pool[slots, h // group].double()  # [n, D]
                values = v_pool[slots, h // group].double()
                weights = torch.softmax(keys @ q[b, h, tok].double() / math.sqrt(dim), 0)
                out[b, h, tok] = weights @ values
    return out


CASES = {
    "decode": dict(t=1),
    "causal_chunk": dict(t=5),
    "tree_two_branches": dict(t=4, tree=True),
    "gqa": dict(hq=8, hkv=2, t=5),
    "gqa_tree": dict(hq=8, hkv=2, t=4, tree=True),
    "random_trees": dict(base_lens=(3, 9, 0), t=9, tree=True),
    "ragged_from_empty": dict(base_lens=(0, 3, 17), t=5),
    "contiguous_table": dict(t=5, permute_rows=False, shuffle_table=False),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def test_two_branch_mask_is_the_engines():
    tree = DraftTree(torch.tensor([[5, 6, 7]]), parents=torch.tensor([[-1, 0, -1]]),
                     depths=torch.tensor([[1, 2, 1]]), valid=torch.ones(1, 3, dtype=torch.bool))
    assert torch.equal(verify_mask(tree)[0], TWO_BRANCHES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_reference_matches_naive(name, dtype):
    case = make_case(**CASES[name], dtype=dtype)
    got = paged_attention_reference(**case)
    assert got.dtype == dtype and got.shape == case["q"].shape
    torch.testing.assert_close(got.double(), naive_attention(**case), atol=TOLERANCE[dtype], rtol=0)


QUANT_CASES = {name: CASES[name] for name in ("decode", "tree_two_branches", "gqa_tree", "ragged_from_empty")}


@pytest.mark.parametrize("kv_quant", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", QUANT_CASES)
def test_quantized_reference_matches_naive(name, dtype, kv_quant):
    """The reference dequantizes a quantized pool (value x scale) before SDPA: the naive loop over the same
    dequantized values agrees (bf16 adds the cast of the dequantized keys and values to bf16)."""
    case = make_case(**QUANT_CASES[name], dtype=dtype, kv_quant=kv_quant)
    got = paged_attention_reference(**case)
    assert got.dtype == dtype and got.shape == case["q"].shape
    torch.testing.assert_close(got.double(), naive_attention(**case), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("kv_quant", ["none", "int8", "fp8"])
def test_reference_is_what_the_paged_cache_computes(kv_quant):
    """The engine's PagedKVCache (gather only the step's span, SDPA) and the reference agree on the same pool, in
    every KV format (a quantized cache hands the reference its stored values and scales)."""
    batch, hq, hkv, t, dim, bs = 3, 8, 2, 4, 16, 4
    cache = PagedKVCache(1, hkv, dim, max_rows=5, max_len=64, dtype=torch.float32, device="cpu", block_size=bs,
                         kv_quant=kv_quant)
    fmt = cache.format
    for pool, scales, seed in ((cache.k, cache.k_scale, 1), (cache.v, cache.v_scale, 2)):  # noise in every slot
        values, s = fmt.quantize(torch.randn(pool.shape, generator=torch.Generator().manual_seed(seed)))
        pool.copy_(values)
        if scales is not None:
            scales.copy_(s)
    cache._free.reverse()  # hand out blocks out of order, so the block table is not the identity
    rows, base_len = torch.tensor([3, 0, 4]), torch.tensor([9, 0, 22])
    intra = torch.stack([TWO_BRANCHES] * batch)
    cache.begin(rows, base_len, base_len.tolist(), t, intra)
    q, k_new, v_new = (torch.randn(batch, h, t, dim) for h in (hq, hkv, hkv))
    got = cache.attend(0, q, k_new, v_new)
    scales = dict(k_scales=cache.k_scale[0], v_scales=cache.v_scale[0]) if fmt.quantized else {}
    want = paged_attention_reference(q, fmt.kernel_view(cache.k[0]), fmt.kernel_view(cache.v[0]), cache.block_table,
                                     rows, base_len, intra, bs, **scales)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_dispatcher_uses_the_reference_on_cpu():
    case = make_case(t=5, hq=8, hkv=2)
    assert torch.equal(paged_attention(**case), paged_attention_reference(**case))


interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CUDA GPU is here: these run the Triton kernel under the interpreter, on a machine without one (on a GPU: "
           "scripts/gpu_kernels.py)")

TRITON_CASES = {
    "decode_d64": dict(base_lens=(37, 150), hq=8, hkv=2, dim=64, block_size=16),
    "decode_d128_mha": dict(base_lens=(100,), hq=2, hkv=2, dim=128, block_size=16),
    "causal_chunk": dict(base_lens=(0, 70, 129), hq=4, hkv=1, t=5, dim=64, block_size=16),
    "tree_two_branches": dict(base_lens=(65, 12), hq=8, hkv=2, t=4, tree=True, dim=64, block_size=16),
    "block32_int32_table": dict(base_lens=(90, 31), hq=4, hkv=2, t=5, dim=64, block_size=32,
                                table_dtype=torch.int32),
    "block64_contiguous": dict(base_lens=(200,), hq=4, hkv=4, t=5, dim=64, block_size=64, permute_rows=False,
                               shuffle_table=False),
    "one_wide_tile_t64": dict(base_lens=(30, 95), hq=4, hkv=2, t=64, dim=64, block_size=16),  # 128 rows, one tile
    "many_m_tiles_t80": dict(base_lens=(30, 95), hq=4, hkv=2, t=80, dim=64, block_size=16),  # 160 rows, 3 tiles
    "tree_t17_group4": dict(base_lens=(33, 7), hq=8, hkv=2, t=17, tree=True, dim=64, block_size=16),  # 68 of 128
    "random_trees_t64": dict(base_lens=(5, 80), hq=2, hkv=1, t=64, tree=True, dim=64, block_size=16),
}


def test_launch_plan_tiles_and_splits():
    """A 17-token tree step of a 4-query-head group (68 rows) takes one 128-row tile (64-row tiles at head dim 256);
    a wide tile's splits shrink as its programs grow and spread evenly over the KV tiles; narrower tiles keep two
    waves of programs; splits never exceed the KV tiles of a table row."""
    cpu = torch.device("cpu")  # 132 SMs assumed off the GPU
    assert launch_plan(1, 32, 8, 17, 576, cpu) == (128, 1, 9)
    assert launch_plan(4, 32, 8, 17, 576, cpu) == (128, 1, 2)
    assert launch_plan(16, 32, 8, 17, 576, cpu) == (128, 1, 1)
    assert launch_plan(1, 32, 8, 17, 2064, cpu) == (128, 1, 7)  # 33 KV tiles: 7 splits of 5
    assert launch_plan(1, 32, 8, 17, 576, cpu, head_dim=256) == (64, 2, 2)
    assert launch_plan(2, 4, 2, 80, 4096, cpu) == (64, 3, 6)  # 160 rows: three 64-row tiles
    assert launch_plan(1, 32, 8, 1, 576, cpu) == (16, 1, 9)  # two waves, capped by the 9 KV tiles
    assert launch_plan(4, 32, 8, 5, 576, cpu) == (32, 1, 9)
    assert launch_plan(4, 12, 4, 17, 576, cpu, head_dim=64) == (64, 1, 9)  # a narrow tile: two waves


@interpreter
@pytest.mark.parametrize("num_splits", [None, 1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_matches_reference(name, dtype, num_splits, interpreter_bf16_dot):
    case = make_case(**TRITON_CASES[name], dtype=dtype, seed=3)
    got = paged_attention_triton(**case, num_splits=num_splits)
    assert got.dtype == dtype and got.shape == case["q"].shape
    b, hq, t, d = got.shape  # stored [B, T, Hq, D]: the model's transpose back to [B, T, Hq * D] is a view
    assert got.transpose(1, 2).is_contiguous() and got.transpose(1, 2).reshape(b, t, hq * d).data_ptr() == \
        got.data_ptr()
    # against the float32 reference: the kernel accumulates in float32 whatever the input dtype
    want = paged_attention_reference(**{k: v.float() if k in ("q", "k_pool", "v_pool") else v
                                        for k, v in case.items()})
    torch.testing.assert_close(got.float(), want, atol=TOLERANCE[dtype], rtol=0)


TRITON_QUANT_CASES = {name: TRITON_CASES[name] for name in ("decode_d64", "decode_d128_mha", "tree_two_branches",
                                                            "block32_int32_table", "many_m_tiles_t80")}


@interpreter
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_quant", ["int8", "fp8"])
@pytest.mark.parametrize("name", TRITON_QUANT_CASES)
def test_triton_reads_quantized_kv(name, kv_quant, dtype, num_splits, interpreter_bf16_dot):
    """The kernel loads int8 / e4m3 pools and their scales in place: it matches the reference that dequantizes them
    in float32 (the same tolerance as for unquantized pools: the kernel never rounds a dequantized value)."""
    case = make_case(**TRITON_QUANT_CASES[name], dtype=dtype, seed=3, kv_quant=kv_quant)
    got = paged_attention_triton(**case, num_splits=num_splits)
    assert got.dtype == dtype and got.shape == case["q"].shape
    want = paged_attention_reference(**{**case, "q": case["q"].float()})
    torch.testing.assert_close(got.float(), want, atol=TOLERANCE[dtype], rtol=0)


# ---- prefix masks: a drafter's own tree levels, written just before the step by earlier forwards ------------------
def hand_masked_sdpa(q, k_pool, v_pool, block_table, rows, base_len, intra_mask, block_size, k_scales=None,
                     v_scales=None, prefix_mask=None):
    """Gather + SDPA written out by hand, in float32: each row's keys looked up position by position, and the [B, T, S]
    mask filled in from the rules: a position before the M prefix slots is seen, prefix slot i (position
    base - M + i) where prefix_mask[b, t, i], step token j where intra_mask[b, t, j] (j <= t when None), nothing past
    the row's base + T. Quantized pools are dequantized (value x scale)."""
    if k_scales is not None:
        k_pool, v_pool = k_pool.float() * k_scales.unsqueeze(-1), v_pool.float() * v_scales.unsqueeze(-1)
    batch, hq, t, dim = q.shape
    hkv = k_pool.shape[1]
    m = 0 if prefix_mask is None else prefix_mask.shape[-1]
    span = int(base_len.max()) + t
    keys, values = torch.zeros(batch, hkv, span, dim), torch.zeros(batch, hkv, span, dim)
    mask = torch.zeros(batch, t, span, dtype=torch.bool)
    for b in range(batch):
        base, row = int(base_len[b]), int(rows[b])
        for p in range(base + t):
            slot = int(block_table[row, p // block_size]) * block_size + p % block_size
            keys[b, :, p], values[b, :, p] = k_pool[slot].float(), v_pool[slot].float()
            for tok in range(t):
                if p < base - m:
                    mask[b, tok, p] = True
                elif p < base:
                    mask[b, tok, p] = bool(prefix_mask[b, tok, p - (base - m)])
                else:
                    mask[b, tok, p] = p - base <= tok if intra_mask is None else bool(intra_mask[b, tok, p - base])
    return F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=mask.unsqueeze(1), enable_gqa=hq != hkv)


PREFIX_CASES = {  # M + T <= 64; rows whose base is below M have fewer prefix slots (the first ones do not exist)
    "m3_t4_tree_gqa_ragged": dict(base_lens=(2, 40, 19), hq=8, hkv=2, t=4, tree=True, prefix=3, dim=32, block_size=4),
    "m8_t1_decode": dict(base_lens=(8, 30), hq=4, hkv=1, t=1, prefix=8, dim=32, block_size=16),
    "m12_t4_causal_block32": dict(base_lens=(12, 75, 33), hq=4, hkv=2, t=4, prefix=12, dim=32, block_size=32),
    "m0_t4_tree": dict(base_lens=(5, 21), hq=4, hkv=2, t=4, tree=True, prefix=0, dim=32, block_size=16),
    "m60_t4_sign_bit": dict(base_lens=(60, 70), hq=2, hkv=1, t=4, tree=True, prefix=60, dim=32, block_size=16),
}


@pytest.mark.parametrize("name", PREFIX_CASES)
def test_reference_prefix_mask_is_gather_and_sdpa_under_the_hand_built_mask(name):
    case = make_case(**PREFIX_CASES[name], seed=5)
    torch.testing.assert_close(paged_attention_reference(**case), hand_masked_sdpa(**case), atol=1e-6, rtol=0)
    if case["prefix_mask"].shape[-1]:  # the mask does bite: without it the output differs
        plain = {**case, "prefix_mask": None}
        assert not torch.allclose(paged_attention_reference(**plain), hand_masked_sdpa(**case), atol=1e-3)


def test_mask_bits_pack_prefix_then_step_tokens_and_refuse_more_than_one_word():
    intra = TWO_BRANCHES.expand(2, 4, 4)
    prefix = torch.zeros(2, 4, 60, dtype=torch.bool)
    prefix[1, 2, 59] = prefix[0, 0, 0] = True
    bits, m = pa.mask_bits(intra, prefix, 2, 4, "cpu")
    assert m == 60 and bits.dtype == torch.int64
    for b in range(2):
        for t in range(4):
            window = torch.cat([prefix[b, t], intra[b, t]]).tolist()
            assert [(int(bits[b, t]) >> i) & 1 for i in range(64)] == [int(x) for x in window]
    assert pa.mask_bits(None, None, 2, 100, "cpu") == (None, 0)  # causal: no bits, any T
    assert pa.mask_bits(None, prefix[:, :, :0], 2, 4, "cpu") == (None, 0)  # M = 0 is the plain path
    causal_one = (prefix[:, :1, :3].long() << torch.arange(3)).sum(-1) + 8  # causal T = 1: bit M = itself
    assert torch.equal(pa.mask_bits(None, prefix[:, :1, :3], 2, 1, "cpu")[0], causal_one)
    with pytest.raises(ValueError, match="M \\+ T = 61 prefix slots \\+ 4 step tokens exceeds 64"):
        pa.mask_bits(intra, torch.zeros(2, 4, 61, dtype=torch.bool), 2, 4, "cpu")
    with pytest.raises(ValueError, match="prefix_mask must be \\[B, T, M\\]"):
        pa.mask_bits(intra, torch.zeros(2, 3, 8, dtype=torch.bool), 2, 4, "cpu")
    assert MASK_WINDOW == 64
    # the same words from weights made once (what a KV cache passes every step), bit 63 included
    weights = pa.bit_weights(MASK_WINDOW, "cpu")
    assert torch.equal(pa.mask_bits(intra, prefix, 2, 4, "cpu", weights=weights)[0], bits)
    assert int(weights[63]) == -(1 << 63) and (bits[:, 3] < 0).all()  # the last token sees itself: bit 63


def test_doctests():
    import doctest

    assert doctest.testmod(pa).failed == 0


@pytest.mark.parametrize("kv_quant", ["none", "int8"])
@pytest.mark.parametrize("m", [0, 5])
def test_paged_cache_hands_the_prefix_mask_to_its_kernel(m, kv_quant):
    """prepare(prefix_mask=) on a cache with a kernel takes the kernel path (here the reference stands in for the
    kernels) and gives what gather + SDPA under the prefix mask gives, quantized pools included; a step whose
    M + T exceeds MASK_WINDOW goes through gather + SDPA."""
    batch, hq, hkv, t, dim, bs = 3, 4, 2, 4, 16, 4
    caches = []
    for with_kernel in (False, True):
        cache = PagedKVCache(1, hkv, dim, max_rows=4, max_len=64, dtype=torch.float32, device="cpu", block_size=bs,
                             kv_quant=kv_quant)
        if with_kernel:
            calls = []

            def kernel(*args, **kwargs):
                calls.append(kwargs.get("prefix_mask"))
                return paged_attention_reference(*args, **kwargs)

            def write_kernel(q, k, v, slots, k_pool, v_pool, *rest, **kwargs):
                paged_kv_write_reference(k, v, k_pool, v_pool, slots, rope=kwargs.get("rope"))
                return kernel(q, k_pool, v_pool, *rest, **kwargs)

            cache.kernel, cache.write_kernel = kernel, write_kernel
        caches.append(cache)
    g = torch.Generator().manual_seed(m)
    rows, base_len = torch.tensor([2, 0, 3]), torch.tensor([9, 6, 22])
    outs = []
    for cache in caches:  # the same history in both: committed tokens, then a step under a prefix mask
        gen = torch.Generator().manual_seed(7)
        cache.begin(rows, torch.zeros(3, dtype=torch.long), [0] * 3, 22, prefill=True)
        cache.attend(0, *(torch.randn(batch, h, 22, dim, generator=gen) for h in (hq, hkv, hkv)))
        for r, n in zip(rows.tolist(), base_len.tolist()):
            cache.truncate(r, n)
        cache.plan(rows.tolist(), base_len.tolist(), t)
        prefix = torch.rand(batch, t, m, generator=torch.Generator().manual_seed(m)) < 0.5
        cache.prepare(rows, base_len, t, TWO_BRANCHES.expand(batch, t, t), cache.static_span, prefix_mask=prefix)
        outs.append(cache.attend(0, *(torch.randn(batch, h, t, dim, generator=gen) for h in (hq, hkv, hkv))))
    assert caches[1]._use_kernel and len(calls) == 1 and (calls[0] is None) == (m == 0)
    if m:
        assert torch.equal(calls[0], prefix)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=0)
    caches[1].prepare(rows, base_len, t, None, caches[1].static_span,
                      prefix_mask=torch.ones(batch, t, MASK_WINDOW - t + 1, dtype=torch.bool))
    assert not caches[1]._use_kernel  # one bit too many for the kernel's word


TRITON_PREFIX_CASES = [  # (case, dtype, num_splits): a handful, the interpreter is slow
    ("m3_t4_tree_gqa_ragged", torch.float32, None),
    ("m8_t1_decode", torch.bfloat16, 3),
    ("m12_t4_causal_block32", torch.float32, 1),
    ("m12_t4_causal_block32", torch.bfloat16, None),
    ("m0_t4_tree", torch.bfloat16, None),
    ("m60_t4_sign_bit", torch.float32, 3),
]


@interpreter
@pytest.mark.parametrize("name, dtype, num_splits", TRITON_PREFIX_CASES,
                         ids=[f"{n}-{str(d)[6:]}-splits{s}" for n, d, s in TRITON_PREFIX_CASES])
def test_triton_prefix_mask_matches_reference_and_hand_built_mask(name, dtype, num_splits, interpreter_bf16_dot):
    """The kernel under a prefix mask against the float32 reference and against gather + SDPA under the mask built
    by hand; M = 0 is the plain path, bit for bit."""
    case = make_case(**PREFIX_CASES[name], dtype=dtype, seed=5)
    got = paged_attention_triton(**case, num_splits=num_splits)
    assert got.dtype == dtype and got.shape == case["q"].shape
    upcast = {k: v.float() if k in ("q", "k_pool", "v_pool") else v for k, v in case.items()}
    torch.testing.assert_close(got.float(), paged_attention_reference(**upcast), atol=TOLERANCE[dtype], rtol=0)
    torch.testing.assert_close(got.float(), hand_masked_sdpa(**upcast), atol=TOLERANCE[dtype], rtol=0)
    if not case["prefix_mask"].shape[-1]:
        assert torch.equal(got, paged_attention_triton(**{**case, "prefix_mask": None}, num_splits=num_splits))


@interpreter
def test_triton_prefix_mask_on_quantized_kv_and_fused_write(interpreter_bf16_dot):
    """An int8 pool with its scales under a prefix mask; the fused K/V write + attention (with RoPE) passes the mask on
    and refuses one that does not fit the word before writing anything."""
    case = make_case(**PREFIX_CASES["m3_t4_tree_gqa_ragged"], seed=6, kv_quant="int8")
    got = paged_attention_triton(**case)
    torch.testing.assert_close(got, paged_attention_reference(**case), atol=1e-5, rtol=0)
    torch.testing.assert_close(got, hand_masked_sdpa(**case), atol=1e-5, rtol=0)

    case, k, v, slots, rope = _step_case("tree_two_branches", torch.float32, seed=7)
    case["prefix_mask"] = torch.rand(case["q"].shape[0], 4, 12, generator=torch.Generator().manual_seed(7)) < 0.5
    want_pools = {n: case[n].clone() for n in ("k_pool", "v_pool")}
    paged_kv_write_reference(k, v, want_pools["k_pool"], want_pools["v_pool"], slots, rope=rope)
    with pytest.raises(ValueError, match="exceeds 64"):
        paged_write_attention_triton(case["q"], k, v, slots, case["k_pool"], case["v_pool"], case["block_table"],
                                     case["rows"], case["base_len"], case["intra_mask"], case["block_size"],
                                     rope=rope, prefix_mask=torch.ones(2, 4, 61, dtype=torch.bool))
    assert not torch.equal(case["k_pool"], want_pools["k_pool"])  # nothing written yet
    got = paged_write_attention_triton(case["q"], k, v, slots, case["k_pool"], case["v_pool"], case["block_table"],
                                       case["rows"], case["base_len"], case["intra_mask"], case["block_size"],
                                       rope=rope, prefix_mask=case["prefix_mask"])
    torch.testing.assert_close(case["k_pool"], want_pools["k_pool"], atol=1e-5, rtol=1e-5)
    want = paged_attention_reference(**case, rope=rope)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, hand_masked_sdpa(**{**case, "q": rope_reference(case["q"], rope)}), atol=1e-5,
                               rtol=0)


# ---- the fused K/V write -------------------------------------------------------------------------------------------
def _write_case(b, t, hq, hkv, d, dtype, seed=0):
    """k, v as the model hands them over: [B, Hkv, T, D] views into one fused qkv output (strided, not contiguous);
    pools with a few hundred slots; each token a distinct random slot."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, t, hq + 2 * hkv, d, generator=g).to(dtype)
    k = qkv[:, :, hq:hq + hkv].transpose(1, 2)
    v = qkv[:, :, hq + hkv:].transpose(1, 2)
    slots = torch.randperm(300, generator=g)[: b * t]
    pools = [torch.zeros(300, hkv, d, dtype=dtype) for _ in range(2)]
    return k, v, slots, pools


def test_kv_write_reference_puts_each_token_at_its_slot():
    k, v, slots, (kp, vp) = _write_case(2, 3, 4, 2, 8, torch.float32)
    paged_kv_write_reference(k, v, kp, vp, slots)
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(i, 3)
        assert torch.equal(kp[slot], k[b, :, t]) and torch.equal(vp[slot], v[b, :, t])
    assert int((kp.abs().sum((1, 2)) > 0).sum()) == 6  # nothing else written


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 4, 2, 16), (3, 5, 6, 3, 32), (2, 1, 8, 8, 64)],
                         ids=["decode_gqa", "verify_ragged_heads", "mha"])
@pytest.mark.parametrize("per", [8, 1, 2, 4], ids=lambda p: f"heads{p}")  # 8: every head of these in one program
def test_triton_kv_write_equals_reference(shape, dtype, per):
    """Bit for bit (a copy), with a token's heads in one program or split over programs (3 heads in blocks of 2:
    the last block masked)."""
    k, v, slots, (kp, vp) = _write_case(*shape, dtype, seed=sum(shape))
    want_k, want_v = kp.clone(), vp.clone()
    paged_kv_write_reference(k, v, want_k, want_v, slots)
    rope = _rope(k.shape[0], k.shape[2], k.shape[3], dtype, seed=2)
    kr, vr = kp.clone(), vp.clone()
    paged_kv_write_triton(k, v, kp, vp, slots, heads_per_program=per)
    assert torch.equal(kp, want_k) and torch.equal(vp, want_v)
    paged_kv_write_reference(k, v, want_k, want_v, slots, rope=rope)
    paged_kv_write_triton(k, v, kr, vr, slots, rope=rope, heads_per_program=per)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}[dtype]  # one rounding of the rotation against per-op ones
    torch.testing.assert_close(kr.float(), want_k.float(), atol=tol * 8, rtol=tol)
    assert torch.equal(vr, want_v)  # values are copied, never rotated


# ---- RoPE folded into the K/V write and the attention's q load (the fused path's default) --------------------------
def _rope(b, t, dim, dtype, seed=0):
    """(cos, sin_signed) [B, T, D] as the model builds them (workbench.models.llama.rope_tables) at random positions."""
    from workbench.models.llama import LlamaModel, ModelConfig

    cfg = ModelConfig(vocab_size=8, hidden_size=dim * 2, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    cos, sin = LlamaModel(cfg, init_weights=False).rope_tables(torch.device("cpu"), dtype)
    pos = torch.randint(0, 512, (b, t), generator=torch.Generator().manual_seed(seed))
    return cos[pos], sin[pos]


def test_rope_reference_is_the_models_rope():
    from workbench.models.llama import apply_rope

    x = torch.randn(2, 3, 5, 16)  # [B, H, T, D]
    cos, sin = _rope(2, 5, 16, torch.float32)
    want = apply_rope(x.transpose(1, 2), cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2)
    torch.testing.assert_close(rope_reference(x, (cos, sin)), want, atol=0, rtol=0)
    assert rope_reference(x, None) is x


def test_references_with_rope_equal_rotating_first():
    case = make_case(**TRITON_CASES["tree_two_branches"], seed=4)
    rope = _rope(case["q"].shape[0], case["q"].shape[2], case["q"].shape[3], torch.float32, seed=4)
    got = paged_attention_reference(**case, rope=rope)
    want = paged_attention_reference(**{**case, "q": rope_reference(case["q"], rope)})
    assert torch.equal(got, want)
    k, v, slots, (kp, vp) = _write_case(2, 3, 4, 2, 8, torch.float32)
    kp2, vp2 = kp.clone(), vp.clone()
    rope = _rope(2, 3, 8, torch.float32, seed=1)
    paged_kv_write_reference(k, v, kp, vp, slots, rope=rope)
    paged_kv_write_reference(rope_reference(k, rope), v, kp2, vp2, slots)
    assert torch.equal(kp, kp2) and torch.equal(vp, vp2)


def _step_case(name, dtype, seed):
    """An attention case of TRITON_CASES with the step's own K / V [B, Hkv, T, D] as views of one fused qkv output
    (strided, as the model hands them over), the slots the cache writes them to (positions base_len .. + T - 1 of
    each row, through the block table) and rope = (cos, sin_signed) [B, T, D]."""
    case = make_case(**TRITON_CASES[name], dtype=dtype, seed=seed)
    b, hq, t, dim = case["q"].shape
    hkv = case["k_pool"].shape[1]
    rope = _rope(b, t, dim, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(b, t, hq + 2 * hkv, dim, generator=g).to(dtype)
    k, v = qkv[:, :, hq:hq + hkv].transpose(1, 2), qkv[:, :, hq + hkv:].transpose(1, 2)
    slots = torch.stack([case["block_table"][r, (case["base_len"][i] + torch.arange(t)) // case["block_size"]]
                         * case["block_size"] + (case["base_len"][i] + torch.arange(t)) % case["block_size"]
                         for i, r in enumerate(case["rows"].tolist())]).reshape(-1)  # the step's own slots
    return case, k, v, slots, rope


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["decode_d64", "decode_d128_mha", "tree_two_branches", "many_m_tiles_t80",
                                  "tree_t17_group4"])
def test_triton_rotates_q_and_k_as_the_reference(name, dtype, interpreter_bf16_dot):
    """The fused write + attention with rope=(cos, sin_signed): q and k arrive unrotated; the keys land in the pool
    rotated (within one rounding of the reference's, which rounds per op), and the output matches the reference."""
    case, k, v, slots, rope = _step_case(name, dtype, seed=6)
    want_pools = {n: case[n].clone() for n in ("k_pool", "v_pool")}
    paged_kv_write_reference(k, v, want_pools["k_pool"], want_pools["v_pool"], slots, rope=rope)
    got = paged_write_attention_triton(case["q"], k, v, slots, case["k_pool"], case["v_pool"], case["block_table"],
                                       case["rows"], case["base_len"], case["intra_mask"], case["block_size"],
                                       rope=rope)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}[dtype]
    torch.testing.assert_close(case["k_pool"].float(), want_pools["k_pool"].float(), atol=tol * 8, rtol=tol)
    assert torch.equal(case["v_pool"], want_pools["v_pool"])  # values are copied, never rotated
    want = paged_attention_reference(**{**case, "q": case["q"].float(), "k_pool": case["k_pool"].float(),
                                        "v_pool": case["v_pool"].float()}, rope=tuple(r.float() for r in rope))
    torch.testing.assert_close(got.float(), want, atol=TOLERANCE[dtype], rtol=0)
