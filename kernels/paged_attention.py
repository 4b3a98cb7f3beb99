"""Paged attention for decode (T = 1) and tree verify (T = 1 + N): a Triton kernel beside its PyTorch reference.

One layer's KV lives in a pool of fixed-size blocks; `block_table[r, j]` is the physical block holding logical
positions [j * block_size, (j + 1) * block_size) of cache row r. A step's T query tokens of row b attend to every
committed position p < base_len[b] and, among the step's own tokens (already written at base_len[b] + j), to those
`intra_mask[b, t, j]` allows (None = causal). An optional `prefix_mask` [B, T, M] narrows the M committed slots just
before the step, base_len[b] - M + i (a drafter's own tree levels, written by earlier forwards of the same step: an
EAGLE frontier node sees only its ancestors); slots before those stay fully visible.

The kernel is flash-decoding (split-K) so that batch 1 with a few KV heads still fills the GPU:
1. `_partial_kernel`, grid (B * Hkv * m_tiles, num_splits): a program takes one KV head and the rows of one tile,
   M = (Hq / Hkv) * T (every query head of the GQA group times every query token, so each KV tile is read once for
   all of them). Row b's KV tiles 0 .. ceil((base_len[b] + T) / BLOCK_N) - 1 are split evenly over the num_splits
   programs; each runs an online softmax over its share (tiles past the row's length are never visited) and writes
   its normalized partial output and its log-sum-exp (base 2). A tree mask reaches the kernel as one int64 per
   query token over the mask's window, the M prefix slots then the T step tokens (bit i = sees position
   base_len[b] - M + i, so M + T <= 64; M = 0 without a prefix mask); causal steps without a prefix mask need none.
2. `_combine_kernel`, grid (B * Hq * T): out = sum_s exp2(lse_s - max) * o_s / sum_s exp2(lse_s - max).
With one split the partial is already the answer and goes straight to the output.

Quantized KV (workbench/engine/kv_quant.py): the pools hold int8 or float8 e4m3 values and `k_scales`, `v_scales`
[num_slots, Hkv] float32 hold one scale per slot and KV head (key = value * scale). The kernel loads the values,
widens them exactly to q's dtype (int8 and e4m3 are exact in bf16 / fp16 / fp32) and applies the scales where they
cost least: a key's scale multiplies its column of q.k^T, a value's scale its column of the softmax weights before
the p.V product (the normalizer sums the unscaled weights). The reference dequantizes (value * scale in float32)
and runs SDPA. float8 loads need compute capability 8.9+ (`kv_dtype_problem` says so, the cache picks "sdpa").

The grid, the scratch sizes and num_splits depend only on shapes (B, Hq, Hkv, T, max_blocks, the SM count); lengths
and block tables are read on the device, so a step is CUDA-graph capturable. Accumulation is fp32 in any input dtype.

Verified on CPU only, under the Triton interpreter (TRITON_INTERPRET=1, triton 3.9.0; 3.6.0's interpreter cannot
run a loop with tensor bounds): tests/test_kernels.py matches the float32 reference within 1e-5 (fp32 inputs; seen
<= 4.2e-7), 3e-3 (fp16; seen <= 8.7e-4) and 3e-2 (bf16, the interpreter's bf16 tl.dot patched to widen first; seen
<= 1.5e-2 at |out| ~3) over decode, causal chunks, tree masks, GQA / MHA, head dims 64 / 128, block sizes 16 / 32 /
64, T up to 64 (4 row tiles), ragged lengths, permuted rows, shuffled int32 / int64 block tables and 1 to 64 splits;
prefix masks (M 3 to 60, bit 63 included) against the reference and SDPA under a mask built by hand. With PREFIX off
the sm_90 PTX is the same instructions as without the prefix code (checked on a CPU build).
Triton 3.6 compiles it for sm_90 on a CPU (ptxas: no register spills at 8 warps except 16 bytes at D = 128 with
64-row tiles). Speed and graph capture on a GPU are scripts/gpu_kernels.py's to show.

`paged_kv_write_triton` writes a step's K and V into the pools in one launch (bit-exact against `index_copy_`, under
the interpreter and through the engine's greedy parity on the H200); `paged_write_attention_triton` is that write
followed by the attention kernel, the one call an unquantized paged layer makes.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .pdl import use_pdl

try:
    import triton
    import triton.language as tl
    TRITON_AVAILABLE = True
    from .pdl import gdc_launch_dependents, gdc_wait
except ImportError:
    TRITON_AVAILABLE = False


MASK_WINDOW = 64  # prefix slots + step tokens one query token's mask bits cover (one int64 word)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)  # pools it loads


def kv_dtype_problem(dtype: torch.dtype, capability: tuple[int, int] | None) -> str | None:
    """Why the kernel cannot load a KV pool of `dtype` on a GPU of this compute capability; None when it can.

    >>> kv_dtype_problem(torch.float8_e4m3fn, (8, 0))
    'float8 e4m3 loads need compute capability 8.9 or newer (Ada, Hopper); this GPU is sm_80'
    """
    if dtype not in KV_DTYPES:
        return f"it loads KV pools of {', '.join(str(d) for d in KV_DTYPES)}, not {dtype}"
    if dtype == torch.float8_e4m3fn and capability is not None and tuple(capability) < (8, 9):
        return ("float8 e4m3 loads need compute capability 8.9 or newer (Ada, Hopper); this GPU is "
                f"sm_{capability[0]}{capability[1]}")
    return None


def dequantize_pool(pool: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """pool [..., D] (int8 / e4m3 values, or already real) and scales [...] float32 or None -> [..., D] in dtype."""
    return pool.to(dtype) if scales is None else (pool.float() * scales.unsqueeze(-1)).to(dtype)


def rope_reference(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """x [B, H, T, D] rotated as the model does (workbench.models.llama.apply_rope): x * cos + roll(x, D / 2) *
    sin_signed, with rope = (cos, sin_signed) [B, T, D] per token; x itself when rope is None."""
    if rope is None:
        return x
    cos, sin = (r.unsqueeze(1) for r in rope)  # [B, 1, T, D]
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def paged_attention_reference(q, k_pool, v_pool, block_table, rows, base_len, intra_mask, block_size, scale=None,
                              k_scales=None, v_scales=None, rope=None, prefix_mask=None, bits=None):
    """Gather every position of the block table, mask, and run SDPA (the engine's path; the kernels' reference).
    `bits` (the kernel's precomputed mask words) is accepted for the same signature and not read: the masks are.

    q [B, Hq, T, D]; k_pool, v_pool [num_slots, Hkv, D]; block_table [R, max_blocks] int; rows [B] long;
    base_len [B] long; intra_mask [B, T, T] bool or None (causal) -> [B, Hq, T, D] in q's dtype.
    k_scales, v_scales [num_slots, Hkv] float32 (quantized pools: int8 / float8 e4m3 values) or None; the gathered
    values are dequantized in float32 and cast to q's dtype. rope = (cos, sin_signed) [B, T, D]: q arrives before
    RoPE and is rotated first (`rope_reference`). prefix_mask [B, T, M] bool or None: query token t sees slot
    base_len[b] - M + i only where prefix_mask[b, t, i] (slots before base_len[b] - M stay visible).
    """
    q = rope_reference(q, rope)
    b, hq, t, _ = q.shape
    span = block_table.shape[1] * block_size
    pos = torch.arange(span, device=q.device)  # [S]
    slots = block_table[rows][:, pos // block_size] * block_size + pos % block_size  # [B, S]
    keys = k_pool[slots]  # [B, S, Hkv, D]
    values = v_pool[slots]
    if k_scales is not None:
        keys = dequantize_pool(keys, k_scales[slots], q.dtype)
        values = dequantize_pool(values, v_scales[slots], q.dtype)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, S, D]
    rel = pos.view(1, -1) - base_len.view(-1, 1)  # [B, S]: position relative to the step's first token
    if intra_mask is None:
        intra_mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril().expand(b, t, t)
    in_step = intra_mask.gather(2, rel.clamp(0, t - 1).unsqueeze(1).expand(b, t, span))  # [B, T, S]
    visible = (rel < 0).unsqueeze(1) | (in_step & (rel < t).unsqueeze(1))  # [B, T, S]
    m = 0 if prefix_mask is None else prefix_mask.shape[-1]
    if m:
        w = rel + m  # [B, S]: index among the M prefix slots
        in_prefix = ((w >= 0) & (w < m)).unsqueeze(1)  # [B, 1, S]
        seen = prefix_mask.gather(2, w.clamp(0, m - 1).unsqueeze(1).expand(b, t, span))  # [B, T, S]
        visible = visible & (~in_prefix | seen)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible.unsqueeze(1), scale=scale,
                                          enable_gqa=hq != keys.shape[1])


if TRITON_AVAILABLE:
    # one compiled kernel for every split count and every prefix length
    @triton.jit(do_not_specialize=["num_splits", "prefix_len"])
    def _partial_kernel(
            q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, base_ptr, intra_bits_ptr, o_ptr, lse_ptr,  # intra_bits [B, T]
            cos_ptr, sin_ptr,  # ROPE: cos, sin_signed [B * T, D] contiguous: q is rotated as it is loaded
            ks_ptr, vs_ptr,  # k_scales, v_scales [num_slots, Hkv] float32 (read only when QUANT)
            sq_b, sq_h, sq_t,  # q [B, Hq, T, D] (last stride 1)
            sk_s, sk_h, sv_s, sv_h,  # k_pool, v_pool [num_slots, Hkv, D] (last stride 1)
            sks_s, sks_h, svs_s, svs_h,  # k_scales, v_scales
            st_r, st_j,  # block_table [R, max_blocks]
            so_b, so_h, so_t, so_s,  # o [B, Hq, T, splits, D] (last stride 1); lse [B, Hq, T, splits] contiguous
            qk_scale_log2, m_tiles, num_splits,
            prefix_len,  # M: the mask window starts M slots before base (read only when PREFIX)
            T: tl.constexpr, GROUP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
            DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = False,
            ROPE: tl.constexpr = False, PREFIX: tl.constexpr = False):
        if PDL:  # kernels/pdl.py: every program waits (also one with no tiles), before any load or store
            gdc_wait()
        pid = tl.program_id(0)
        split = tl.program_id(1)
        m_tile = pid % m_tiles
        kv_head = (pid // m_tiles) % HKV
        b = pid // (m_tiles * HKV)

        m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # tile row = (query head in group, query token)
        row_ok = m < GROUP * T
        head = kv_head * GROUP + m // T
        tok = m % T
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + tok[:, None] * sq_t + d[None, :],
                    mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
        if ROPE:  # q * cos + roll(q, D / 2) * sin_signed in fp32, rounded once to q's dtype (as inductor's RoPE)
            d_roll = (d + D // 2) % D  # [D]: where roll(q, D / 2) reads each lane
            q_roll = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + tok[:, None] * sq_t + d_roll[None, :],
                             mask=row_ok[:, None], other=0.0)
            rope_at = (b * T + tok)[:, None] * D + d[None, :]  # [BLOCK_M, D]
            cos = tl.load(cos_ptr + rope_at, mask=row_ok[:, None], other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + rope_at, mask=row_ok[:, None], other=0.0).to(tl.float32)
            q = (q.to(tl.float32) * cos + q_roll.to(tl.float32) * sin).to(q_ptr.dtype.element_ty)
        if not CAUSAL:
            # [BLOCK_M] int64: bit i = sees window position i (the M prefix slots, then the step's tokens)
            intra_bits = tl.load(intra_bits_ptr + b * T + tok)

        row = tl.load(rows_ptr + b)
        base = tl.load(base_ptr + b).to(tl.int32)
        length = base + T
        tiles = tl.cdiv(length, BLOCK_N)
        per_split = tl.cdiv(tiles, num_splits)
        first = split * per_split
        last = tl.minimum(first + per_split, tiles)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for tile in range(first, last):
            pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical positions
            pos_ok = pos < length
            block = tl.load(table_ptr + row * st_r + (pos // BLOCK_SIZE) * st_j, mask=pos_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            k = tl.load(k_ptr + slot[None, :] * sk_s + kv_head * sk_h + d[:, None],
                        mask=pos_ok[None, :], other=0.0)  # [D, BLOCK_N]
            v = tl.load(v_ptr + slot[:, None] * sv_s + kv_head * sv_h + d[None, :],
                        mask=pos_ok[:, None], other=0.0)  # [BLOCK_N, D]
            if QUANT:  # int8 / e4m3 values widen exactly to q's dtype; the scales act on s and p below
                # through float32 (exact; same result): triton 3.9's interpreter casts int8 -> bf16 bitwise
                k = k.to(tl.float32).to(q.dtype)
                v = v.to(tl.float32).to(q.dtype)
                k_scale = tl.load(ks_ptr + slot * sks_s + kv_head * sks_h, mask=pos_ok, other=0.0)  # [BLOCK_N]
                v_scale = tl.load(vs_ptr + slot * svs_s + kv_head * svs_h, mask=pos_ok, other=0.0)
            # [BLOCK_M, BLOCK_N] in log2 units; the scale cast to fp32 (inductor may hand a Python float as fp64)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * tl.cast(qk_scale_log2, tl.float32)
            if QUANT:
                s = s * k_scale[None, :]

            j = pos - base  # index among the step's tokens (negative = committed before the step)
            if PREFIX:
                j = j + prefix_len  # index in the mask window, which starts M slots earlier
            if CAUSAL:
                in_step = j[None, :] <= tok[:, None]
            else:
                in_step = ((intra_bits[:, None] >> tl.maximum(j, 0).to(tl.int64)[None, :]) & 1) != 0
            visible = ((j < 0)[None, :] | in_step) & pos_ok[None, :]
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if QUANT:
                p = p * v_scale[None, :]  # after the normalizer: it sums the unscaled weights
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if PDL:  # the KV is read: the next kernel may take the SM slots this program frees
            gdc_launch_dependents()
        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(o_ptr + b * so_b + head[:, None] * so_h + tok[:, None] * so_t + split * so_s + d[None, :], o,
                 mask=row_ok[:, None])
        row_id = (b * GROUP * HKV + head) * T + tok  # [BLOCK_M]: (b, head, tok) in [B, Hq, T] order
        tl.store(lse_ptr + row_id * num_splits + split, lse, mask=row_ok)

    @triton.jit(do_not_specialize=["num_splits"])
    def _combine_kernel(o_ptr, lse_ptr, out_ptr, num_splits, HQ, T, SPLITS_POW2: tl.constexpr, D: tl.constexpr,
                        PDL: tl.constexpr = False):
        # o [B * Hq * T, splits, D], lse [B * Hq * T, splits] contiguous; out [B, T, Hq, D] contiguous (row r of
        # o is (b, h, t) in [B, Hq, T] order)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        r = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, SPLITS_POW2)
        d = tl.arange(0, D)
        lse = tl.load(lse_ptr + r * num_splits + s, mask=s < num_splits, other=float("-inf"))
        top = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # empty splits weigh 0
        o = tl.load(o_ptr + (r * num_splits + s[:, None]) * D + d[None, :], mask=(s < num_splits)[:, None], other=0.0)
        out = tl.sum(w[:, None] * o, 0) / tl.maximum(tl.sum(w, 0), 1e-30)
        bh, t = r // T, r % T
        bb, h = bh // HQ, bh % HQ
        tl.store(out_ptr + ((bb * T + t) * HQ + h) * D + d, out)


BLOCK_N = 64  # keys per inner iteration (several 16-slot pages; each key's page is looked up on its own)
MAX_BLOCK_M = 64  # rows of one tile; larger groups x tokens take several tiles (65..128 rows: one 128-row tile)
WIDE_TILE = 3 * 16 * 128  # q elements of a tile above which its splits are weighed (a 17-token step of 4 heads x 128)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132  # H200


def launch_plan(batch: int, q_heads: int, kv_heads: int, t: int, max_positions: int,
                device: torch.device, head_dim: int = 128) -> tuple[int, int, int]:
    """(block_m, m_tiles, num_splits), from shapes only. M = (Hq / Hkv) * T rows go in tiles of BLOCK_M (a power of
    two, 16 .. 64), except 65..128 rows at head dims <= 128: one 128-row tile, which reads each KV tile once rather
    than twice (a 17-token tree step of a 4-query-head group is 68 rows). Splits give ~2 waves of programs over the
    SMs, never more than the KV tiles of a full table row; a wide tile (more than WIDE_TILE q elements) weighs each
    program by its 16 x 128 slabs, since its splits' partial outputs and fixed costs grow with it: then all KV tiles
    split when that leaves at least half of them, else the rounded count, spread evenly (no empty splits)."""
    rows = q_heads // kv_heads * t
    kv_tiles = math.ceil(max_positions / BLOCK_N)
    if 64 < rows <= 128 and head_dim <= 128:
        block_m = 128
    else:
        block_m = min(MAX_BLOCK_M, max(16, 1 << (rows - 1).bit_length()))
    m_tiles = math.ceil(rows / block_m)
    programs = batch * kv_heads * m_tiles
    tile = min(rows, block_m) * head_dim  # q elements of one tile
    if tile <= WIDE_TILE:
        return block_m, m_tiles, max(1, min(math.ceil(2 * _sm_count(device) / programs), kv_tiles))
    want = 2 * _sm_count(device) / (programs * math.ceil(tile / (16 * 128)))
    splits = kv_tiles if want >= kv_tiles / 2 else max(1, min(round(want), kv_tiles))
    return block_m, m_tiles, math.ceil(kv_tiles / math.ceil(kv_tiles / splits))


def _rope_rows(rope, b: int, t: int, dim: int):
    """(cos, sin_signed) [B, T, D] -> two contiguous [B * T, D] tensors for the kernels."""
    cos, sin = rope
    assert cos.shape == (b, t, dim) and sin.shape == (b, t, dim), "rope = (cos, sin_signed), each [B, T, D]"
    return cos.reshape(b * t, dim).contiguous(), sin.reshape(b * t, dim).contiguous()


def check_prefix_mask(prefix_mask, b: int, t: int) -> int:
    """M of a prefix mask [B, T, M] (0 for None); ValueError for another shape or M + T > MASK_WINDOW (shapes only)."""
    if prefix_mask is None:
        return 0
    if prefix_mask.dim() != 3 or tuple(prefix_mask.shape[:2]) != (b, t):
        raise ValueError(f"prefix_mask must be [B, T, M] = [{b}, {t}, M], got {list(prefix_mask.shape)}")
    m = prefix_mask.shape[-1]
    if m and m + t > MASK_WINDOW:
        raise ValueError(f"the kernel packs a query token's mask into one int64 word: M + T = {m} prefix slots + {t} "
                         f"step tokens exceeds {MASK_WINDOW}; use gather + SDPA (attention 'sdpa') for this step")
    return m


def bit_weights(n: int, device) -> torch.Tensor:
    """[n] int64: 1 << i (bit 63 is the sign bit: the word's bit pattern is what counts)."""
    return torch.ones(n, dtype=torch.long, device=device) << torch.arange(n, device=device)


def mask_bits(intra_mask, prefix_mask, b: int, t: int, device,
              weights: torch.Tensor | None = None) -> tuple[torch.Tensor | None, int]:
    """(bits [B, T] int64 or None, M): each query token's mask over the window of the M = prefix_mask.shape[-1] slots
    before the step and the step's T tokens (bit i = sees window position i), built with tensor ops (no host read);
    None for a causal step without a prefix mask (the kernel needs no bits). ValueError when M + T > MASK_WINDOW.
    weights: `bit_weights` of at least M + T bits, made once by a caller that builds bits every step (None: made
    here).

    >>> mask_bits(torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool), torch.tensor([[[0, 1], [1, 0]]]).bool(), 1, 2,
    ...           "cpu")
    (tensor([[ 6, 13]]), 2)
    """
    m = check_prefix_mask(prefix_mask, b, t)
    if intra_mask is None and not m:
        return None, 0
    if m + t > MASK_WINDOW:
        raise ValueError(f"the kernel packs a query token's tree mask into one int64 word: {t} step tokens exceed "
                         f"{MASK_WINDOW}; use gather + SDPA (attention 'sdpa') for this step")
    if intra_mask is None:
        intra_mask = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(b, t, t)
    window = intra_mask if not m else torch.cat([prefix_mask.to(torch.bool), intra_mask.to(torch.bool)], -1)
    if weights is None:
        weights = bit_weights(m + t, device)
    return (window * weights[:m + t]).sum(-1), m  # distinct bits: the sum is an OR


def paged_attention_triton(q, k_pool, v_pool, block_table, rows, base_len, intra_mask, block_size, scale=None,
                           k_scales=None, v_scales=None, num_splits: int | None = None, rope=None, prefix_mask=None,
                           bits=None):
    """Same contract as `paged_attention_reference`; `num_splits` overrides the shape-derived split count (more than
    one: a second launch combines the splits, cheap behind a dependent launch); rope = (cos, sin_signed) [B, T, D]: q
    arrives before RoPE and is rotated as it is loaded; prefix_mask [B, T, M] with M + T <= MASK_WINDOW (M = 0 or
    None: the plain path); bits: `mask_bits(intra_mask, prefix_mask, ...)` computed once for a step's every layer
    (then the masks are not read here)."""
    b, hq, t, dim = q.shape
    hkv = k_pool.shape[1]
    group = hq // hkv
    assert hq == group * hkv and dim in (16, 32, 64, 128, 256) and block_size & (block_size - 1) == 0
    quant = k_scales is not None
    assert quant == (v_scales is not None) and quant == (k_pool.dtype in (torch.int8, torch.float8_e4m3fn)), \
        "int8 / float8 pools come with k_scales and v_scales, real-valued pools without"
    if not quant:
        k_scales = v_scales = base_len  # any tensor: never read (strides 0 below)
    q, k_pool, v_pool = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_pool, v_pool))
    block_m, m_tiles, default_splits = launch_plan(b, hq, hkv, t, block_table.shape[1] * block_size, q.device, dim)
    num_splits = num_splits or default_splits
    scale = 1.0 / math.sqrt(dim) if scale is None else scale

    # [B, Hq, T, D], stored as [B, T, Hq, D]: the model's transpose back to [B, T, Hq * D] for o_proj is then a view
    out = torch.empty(b, t, hq, dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(b, hq, t, num_splits, dtype=torch.float32, device=q.device)
    o = out.unsqueeze(3) if num_splits == 1 else torch.empty(b, hq, t, num_splits, dim, dtype=torch.float32,
                                                             device=q.device)  # [B, Hq, T, splits, D]
    intra_bits, prefix_len = bits if bits is not None else mask_bits(intra_mask, prefix_mask, b, t, q.device)
    causal = intra_bits is None
    if causal:
        intra_bits = base_len  # any tensor: never read
    scale_strides = (k_scales.stride(0), k_scales.stride(1), v_scales.stride(0), v_scales.stride(1)) if quant \
        else (0, 0, 0, 0)
    pdl = dict(PDL=True, launch_pdl=True) if use_pdl(q.device) else {}
    cos, sin = _rope_rows(rope, b, t, dim) if rope is not None else (lse, lse)  # (lse: never read without ROPE)
    _partial_kernel[(b * hkv * m_tiles, num_splits)](
        q, k_pool, v_pool, block_table, rows, base_len, intra_bits, o, lse, cos, sin,
        k_scales, v_scales,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), *scale_strides,
        block_table.stride(0), block_table.stride(1),
        o.stride(0), o.stride(1), o.stride(2), o.stride(3),
        scale * math.log2(math.e), m_tiles, num_splits, prefix_len,
        T=t, GROUP=group, HKV=hkv, D=dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        CAUSAL=causal, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANT=quant,
        ROPE=rope is not None, PREFIX=prefix_len > 0,
        num_warps=8, **pdl)  # ptxas for sm_90: 4 warps spill registers at D = 128 or 64-row tiles, 8 do not
    if num_splits > 1:
        _combine_kernel[(b * hq * t,)](o, lse, out, num_splits, hq, t,
                                       SPLITS_POW2=triton.next_power_of_2(num_splits), D=dim, **pdl)
    return out


def paged_attention(q, k_pool, v_pool, block_table, rows, base_len, intra_mask, block_size, scale=None,
                    k_scales=None, v_scales=None, prefix_mask=None):
    """The Triton kernel on CUDA when triton imports, else the reference (same arguments)."""
    fn = paged_attention_triton if TRITON_AVAILABLE and q.is_cuda else paged_attention_reference
    return fn(q, k_pool, v_pool, block_table, rows, base_len, intra_mask, block_size, scale, k_scales=k_scales,
              v_scales=v_scales, prefix_mask=prefix_mask)


# ---- the step's K/V written into the pool, one launch for both planes ----------------------------------------------
# What it replaces (seen in the H200 profile of an AR step): per layer, a copy of each strided
# K / V view to contiguous memory and an index_copy_ of each into its pool, four kernels of ~1-2.5 us plus their
# launch gaps inside the graph, for ~1 MB of data at 6.7 B. One program per written token copies all of its KV heads.
def paged_kv_write_reference(k, v, k_pool, v_pool, slots, rope=None):
    """k, v [B, Hkv, T, D] (any strides); pools [num_slots, Hkv, D]; slots [B * T] (token b * T + t -> its slot);
    rope = (cos, sin_signed) [B, T, D]: k arrives before RoPE and is rotated first (`rope_reference`)."""
    k = rope_reference(k, rope)
    for pool, x in ((k_pool, k), (v_pool, v)):
        pool.index_copy_(0, slots, x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[3]).to(pool.dtype))


if TRITON_AVAILABLE:
    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, slot_ptr, kp_ptr, vp_ptr, cos_ptr, sin_ptr, T, H,
                         sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, skp_s, skp_h, svp_s, svp_h,
                         BLOCK_H: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False,
                         ROPE: tl.constexpr = False):  # ROPE: cos, sin_signed [B * T, D]: keys rotated on the way
        if PDL:
            gdc_wait()
        i = tl.program_id(0)  # token b * T + t
        b = i // T
        t = i % T
        slot = tl.load(slot_ptr + i).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # this program's heads
        d = tl.arange(0, D)[None, :]
        mask = h < H
        key = tl.load(k_ptr + b * sk_b + t * sk_t + h * sk_h + d, mask=mask)
        if ROPE:  # key * cos + roll(key, D / 2) * sin_signed in fp32, rounded once to the pool's dtype
            key_roll = tl.load(k_ptr + b * sk_b + t * sk_t + h * sk_h + (d + D // 2) % D, mask=mask)
            cos = tl.load(cos_ptr + i * D + d).to(tl.float32)  # [1, D]
            sin = tl.load(sin_ptr + i * D + d).to(tl.float32)
            key = key.to(tl.float32) * cos + key_roll.to(tl.float32) * sin
        tl.store(kp_ptr + slot * skp_s + h * skp_h + d, key.to(kp_ptr.dtype.element_ty), mask=mask)
        val = tl.load(v_ptr + b * sv_b + t * sv_t + h * sv_h + d, mask=mask)
        if PDL:
            gdc_launch_dependents()
        tl.store(vp_ptr + slot * svp_s + h * svp_h + d, val.to(vp_ptr.dtype.element_ty), mask=mask)


# KV heads per program of the K/V write (a power of two): at decode (B * T = 1) one program per token copying every
# head kept one SM's loads serial; 4 heads a program was the fastest measured at 6.7 B and even at 1.45 B.
KV_WRITE_HEADS = 4


def paged_kv_write_triton(k, v, k_pool, v_pool, slots, rope=None, heads_per_program: int = KV_WRITE_HEADS):
    """Same contract as `paged_kv_write_reference`, one launch (grid B * T x head blocks of `heads_per_program`,
    default KV_WRITE_HEADS). Needs unit stride along D (views of the fused qkv projection have it) and a power-of-two
    head_dim."""
    b, h, t, dim = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1
    assert dim & (dim - 1) == 0 and slots.numel() == b * t
    block_h = min(triton.next_power_of_2(h), heads_per_program)
    assert block_h & (block_h - 1) == 0, f"heads per program must be a power of two, not {block_h}"
    cos, sin = _rope_rows(rope, b, t, dim) if rope is not None else (slots, slots)  # never read without ROPE
    _kv_write_kernel[(b * t, triton.cdiv(h, block_h))](
        k, v, slots, k_pool, v_pool, cos, sin, t, h,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        BLOCK_H=block_h, D=dim, ROPE=rope is not None, num_warps=4,
        **(dict(PDL=True, launch_pdl=True) if use_pdl(k.device) else {}))


def paged_write_attention_triton(q, k, v, slots, k_pool, v_pool, block_table, rows, base_len, intra_mask,
                                 block_size, scale=None, rope=None, prefix_mask=None, bits=None):
    """The step's K/V into the pool (`paged_kv_write_triton`), then `paged_attention_triton` over it: the two launches
    an unquantized paged layer makes on the kernel path, in one call the engine keeps outside torch.compile. With
    rope = (cos, sin_signed) [B, T, D], q and k arrive before RoPE and both kernels rotate them (no RoPE kernel).
    prefix_mask [B, T, M], bits: as for `paged_attention_triton` (checked before anything is written)."""
    check_prefix_mask(prefix_mask, q.shape[0], q.shape[2])
    paged_kv_write_triton(k, v, k_pool, v_pool, slots, rope=rope)
    return paged_attention_triton(q, k_pool, v_pool, block_table, rows, base_len, intra_mask, block_size, scale,
                                  rope=rope, prefix_mask=prefix_mask, bits=bits)
