"""int4 GEMV for 1-16 rows on the tensor cores: each weight dequantized once, in registers, straight into the MMA's
operand (Hopper's wgmma takes its A operand from registers), the activations the other operand.

Why: the CUDA-core GEMV (kernels/quant_gemv.py) spends about 4.3 instructions per weight on the H200 (a multiply-add
per weight with x, its widening, its scale), more than the 3.5 per weight an SM can issue while HBM delivers int4 at
its peak; it reached 60 % of its read floor. Here the multiply-adds with x run on the tensor cores, and per weight
the CUDA cores spend about two instructions on dequantization (3-3.8 in all in the loop's SASS, by tile): the output
is computed transposed, out^T = W x^T, so the dequantized weight tile is the MMA's A operand, which may live in
registers, and x^T (padded to 16 columns, M of them real) the B operand in shared memory.

Measured on the H200: at 2-16 rows a 6.7 B layer takes 75-77 us, against 110 us for the CUDA-core GEMV's multi-row form
and 101-238 us for tinygemm, so kernels/quant_gemv.py hands it those calls (KernelTuning.int4_mma_rows). At one row it
is slower than the CUDA-core GEMV (74 against 53 us), for reasons not yet found; decode stays there.

Weights: Int4Linear's "dequant" packing, [N, K / 2] bytes (byte j: k = 2j in the high nibble, 2j + 1 in the low),
read as int16 [N, K / 4]: element j holds k = 4j + 1 at bits 0-3, 4j at 4-7, 4j + 3 at 8-11, 4j + 2 at 12-15. A K tile
is one group of g weights: four MMAs of K = g / 4, one per nibble position, each with x's matching quarter. Per
pair of weights (two int16 lanes of a register, the MMA's k, k + 1) the dequantization is one shift (positions 1-3),
one lop3 that puts the nibble q under the exponent of 128 (bf16: exactly 128 + q; fp16: 1024 + q), one packed
subtraction to q - 8 (exact) and one packed multiply-add with the group's scale and zero: the weight (q - 8) s + z
rounded once to x's dtype, as the GEMV's multi-row tiles of whole groups round it (kernels/quant_gemv.py); products and
sums in fp32 on the tensor cores. Triton keeps the loaded int16 tile in the MMA operand layout (the load goes to shared
memory by async copy, and from there into the operand's registers), and the dequantization is an elementwise inline-asm
op on it.

Split K: programs over ranges of groups write fp32 partials; the last to arrive at a tile adds them up in order (as
kernels/quant_gemv.py does), so the result does not depend on arrival order.

The Triton interpreter runs no PTX: `EMULATE` computes the same weights in Triton ops.
"""
from __future__ import annotations

import math
import os

import torch

from .common import sm_count as _sm_count

try:
    import triton
    import triton.language as tl

    from .pdl import gdc_launch_dependents, gdc_wait
    from .common import sum_splits
    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - CPU machines without triton
    TRITON_AVAILABLE = False

MAX_ROWS = 16  # the B operand's columns: calls of 1..16 rows
MAX_SPLIT_K = 16


class Int4MmaError(ValueError):
    """Inputs the kernel does not take; the message says what to change."""


def int4_mma_config(m: int, n: int, k: int, group_size: int, sm_count: int = 132, **override) -> dict:
    """Tile and split for one call: BLOCK_N rows of W per program (the MMA's M: 64 per warpgroup), one group per K
    step, K split until the programs give each SM about `programs_per_sm`. The defaults, 64 rows, 4 warps, 3 stages,
    4 programs per SM, were the best single tile over the 6.7 B linears at 1, 5 and 16 rows and the 1.45 B ones at 1
    (within 2.2 % of each linear's own best tile summed over a layer).

    >>> c = int4_mma_config(5, 4096, 4096, 128)  # 6.7 B's o_proj: 64 tiles, 32 groups
    >>> c["BLOCK_N"], c["SPLIT_K"], c["groups_per_split"], c["num_warps"]
    (64, 8, 4, 4)
    >>> c = int4_mma_config(5, 22016, 4096, 128)  # gate / up: 344 tiles, split 2
    >>> c["BLOCK_N"], c["SPLIT_K"]
    (64, 2)
    """
    block_n = override.get("BLOCK_N", 64)
    warps = override.get("num_warps", 4)
    stages = override.get("num_stages", 3)
    per_sm = override.get("programs_per_sm", 4)
    groups = k // group_size
    tiles = math.ceil(n / block_n)
    split = override.get("SPLIT_K", max(1, min(math.ceil(per_sm * sm_count / tiles), groups, MAX_SPLIT_K)))
    per_split = math.ceil(groups / split)
    return dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages, SPLIT_K=math.ceil(groups / per_split),
                groups_per_split=per_split)


def check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> None:
    m, k = x.shape
    if m < 1 or m > MAX_ROWS:
        raise Int4MmaError(f"the tensor-core int4 GEMV takes 1..{MAX_ROWS} rows; got {m}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise Int4MmaError(f"x must be bf16 or fp16 (the MMA's operand type); got {x.dtype}")
    if group_size % 16 or group_size < 64 or k % group_size:
        raise Int4MmaError(f"group size {group_size} must be a multiple of 16, at least 64, and divide K = {k}")
    if weight.dtype != torch.uint8 or tuple(weight.shape) != (weight.shape[0], k // 2):
        raise Int4MmaError(f"weight must be uint8 [N, K / 2] = [N, {k // 2}]; got {weight.dtype} {tuple(weight.shape)}")
    groups = k // group_size
    if tuple(scale.shape) != (weight.shape[0], groups) or tuple(zero.shape) != tuple(scale.shape):
        raise Int4MmaError(f"scale and zero must be [N, K / g] = [{weight.shape[0]}, {groups}]")
    if scale.dtype != x.dtype or zero.dtype != x.dtype:
        raise Int4MmaError(f"scale and zero must be in x's dtype ({x.dtype}); got {scale.dtype} / {zero.dtype}")


if TRITON_AVAILABLE:
    @triton.jit
    def _nibble_weights(h, s, z, POS: tl.constexpr, F16: tl.constexpr, EMULATE: tl.constexpr):
        """(q - 8) s + z rounded once to s's dtype, q = bits 4 POS .. 4 POS + 3 of each int16 of `h`; s, z [.., ..]
        in bf16 (F16 False) or fp16."""
        if EMULATE:
            q = (h.to(tl.int32) >> (4 * POS)) & 15
            return ((q - 8).to(tl.float32) * s.to(tl.float32) + z.to(tl.float32)).to(s.dtype)
        else:
            if POS == 0:
                shift: tl.constexpr = ""
                src: tl.constexpr = "$1"
            elif POS == 1:
                shift: tl.constexpr = "shr.b32 t, $1, 4; "
                src: tl.constexpr = "t"
            elif POS == 2:
                shift: tl.constexpr = "shr.b32 t, $1, 8; "
                src: tl.constexpr = "t"
            else:
                shift: tl.constexpr = "shr.b32 t, $1, 12; "
                src: tl.constexpr = "t"
            if F16:  # 1024 + q; minus 1032
                consts: tl.constexpr = "mov.b32 one, 0x3C003C00; mov.b32 off, 0xE408E408; "
                magic: tl.constexpr = "0x64006400"
                fma: tl.constexpr = "fma.rn.f16x2"
            else:  # 128 + q; minus 136
                consts: tl.constexpr = "mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308; "
                magic: tl.constexpr = "0x43004300"
                fma: tl.constexpr = "fma.rn.bf16x2"
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, one, off; " + consts + shift
                + "lop3.b32 $0, " + src + ", 0x000F000F, " + magic + ", 0xEA; "
                + fma + " $0, $0, one, off; " + fma + " $0, $0, $2, $3; }",
                "=r,r,r,r", [h, s, z], dtype=s.dtype, is_pure=True, pack=2)

    @triton.jit
    def _group_inputs(x_ptr, s_ptr, z_ptr, nw_ptr, g, offs_m, mask_m, offs_n, mask_n, sx_m, ss_n, ss_g, K,
                      GROUP: tl.constexpr, GLU: tl.constexpr, NORM: tl.constexpr):
        """What group g needs besides its weights: (x [BM, G] or the gate, the up half (GLU; else x again), scale
        [BN], zero [BN], the norm weight [G] (NORM; else zeros, never read))."""
        offs_k = g * GROUP + tl.arange(0, GROUP)
        x_ptrs = x_ptr + offs_m[:, None] * sx_m + offs_k[None, :]
        a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        b = tl.load(x_ptrs + K, mask=mask_m[:, None], other=0.0) if GLU else a
        s = tl.load(s_ptr + offs_n * ss_n + g * ss_g, mask=mask_n, other=0.0)
        z = tl.load(z_ptr + offs_n * ss_n + g * ss_g, mask=mask_n, other=0.0)
        nw = tl.load(nw_ptr + offs_k) if NORM else tl.zeros([GROUP], dtype=x_ptr.dtype.element_ty)
        return a, b, s, z, nw

    @triton.jit(do_not_specialize=["M", "groups_per_split", "SPLIT_K"])
    def _int4_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, r_ptr, nw_ptr, sq_ptr,
                         M, N, K, groups_per_split, eps, sx_m, sw_n, ss_n, ss_g, so_m, sr_m, SPLIT_K,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                         GLU: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, F16: tl.constexpr,
                         EMULATE: tl.constexpr, PDL: tl.constexpr = False):
        # x [M, K] (GLU: [M, 2K] = [gate | up]); nw: the RMSNorm weight [K] (NORM); sq: [SPLIT_K, M] fp32 (NORM, split)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        offs_m = tl.arange(0, BLOCK_M)  # [BM]
        mask_n = offs_n < N
        mask_m = offs_m < M
        QG: tl.constexpr = GROUP // 4  # int16 elements per row and group
        g_start = pid_k * groups_per_split
        g_end = tl.minimum(g_start + groups_per_split, K // GROUP)
        if PDL:  # dependent launch (kernels/pdl.py): nothing above reads what an earlier kernel writes
            gdc_wait()
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # out^T
        sq2 = tl.zeros([BLOCK_M, GROUP], dtype=tl.float32)  # NORM: x^2 per row and lane, summed after the loop
        for g in range(g_start, g_end):
            a, b, s, z, nw = _group_inputs(x_ptr, s_ptr, z_ptr, nw_ptr, g, offs_m, mask_m, offs_n, mask_n, sx_m,
                                           ss_n, ss_g, K, GROUP, GLU, NORM)
            offs_j = g * QG + tl.arange(0, QG)
            h = tl.load(w_ptr + offs_n[:, None] * sw_n + offs_j[None, :], mask=mask_n[:, None], other=0)  # [BN, QG]
            s = tl.broadcast_to(s[:, None], [BLOCK_N, QG])
            z = tl.broadcast_to(z[:, None], [BLOCK_N, QG])
            if GLU:  # SwiGLU prologue: silu(gate) * up in fp32, rounded once to x's dtype
                gate = a.to(tl.float32)
                xa = (gate / (1.0 + tl.exp(-gate)) * b.to(tl.float32)).to(x_ptr.dtype.element_ty)  # [BM, G]: all
                # 16 rows, the padding too (in the SASS about 4 more instructions a weight at 64 rows per program)
            else:
                xa = a  # [BM, G]
            if NORM:  # RMSNorm prologue: x * norm weight here, 1 / rms(x) applied to the sums after the loop
                xf = xa.to(tl.float32)
                sq2 += xf * xf
                xa = (xf * nw.to(tl.float32)[None, :]).to(x_ptr.dtype.element_ty)
            even, odd = tl.split(tl.reshape(xa, [BLOCK_M, QG, 2, 2]))  # k = 4j + {0, 2} | {1, 3} (the last dim)
            x0, x2 = tl.split(even)
            x1, x3 = tl.split(odd)
            x0, x1, x2, x3 = tl.trans(x0), tl.trans(x1), tl.trans(x2), tl.trans(x3)  # [QG, BM]: x^T's quarters
            # element j's nibbles: bits 0-3 k = 4j + 1, 4-7 k = 4j, 8-11 k = 4j + 3, 12-15 k = 4j + 2
            acc = tl.dot(_nibble_weights(h, s, z, 0, F16, EMULATE), x1, acc)
            acc = tl.dot(_nibble_weights(h, s, z, 1, F16, EMULATE), x0, acc)
            acc = tl.dot(_nibble_weights(h, s, z, 2, F16, EMULATE), x3, acc)
            acc = tl.dot(_nibble_weights(h, s, z, 3, F16, EMULATE), x2, acc)
        if PDL:  # this program's weights are read: the next kernel may take the SM slots we free
            gdc_launch_dependents()
        sq = tl.sum(sq2, axis=1)  # [BM]: this split's sum of x^2 per row (NORM)
        out_ptrs = out_ptr + offs_m[None, :] * so_m + offs_n[:, None]  # [BN, BM]: out^T
        out_mask = mask_n[:, None] & mask_m[None, :]
        if SPLIT_K == 1:
            if NORM:
                acc = acc * (1.0 / tl.sqrt_rn(sq / K + eps))[None, :]
            if RESIDUAL:
                acc += tl.load(r_ptr + offs_m[None, :] * sr_m + offs_n[:, None], mask=out_mask, other=0.0).to(
                    tl.float32)
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            part = part_ptr + offs_m[None, :] * N + offs_n[:, None]  # partials [SPLIT_K, M, N] fp32
            tl.store(part + pid_k * M * N, acc, mask=out_mask)
            if NORM:  # every N tile of this split stores the same sums (the same x range): a benign race
                tl.store(sq_ptr + pid_k * M + offs_m, sq, mask=mask_m)
            tl.debug_barrier()  # every thread's partial is written before the counter says so
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last split of this tile: add them up in order
                total, sq_all = sum_splits(part, sq_ptr, offs_m, mask_m, out_mask, M, N, SPLIT_K,
                                           tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32),
                                           tl.zeros([BLOCK_M], dtype=tl.float32), NORM)
                if NORM:
                    total = total * (1.0 / tl.sqrt_rn(sq_all / K + eps))[None, :]
                if RESIDUAL:
                    total += tl.load(r_ptr + offs_m[None, :] * sr_m + offs_n[:, None], mask=out_mask,
                                     other=0.0).to(tl.float32)
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call


def int4_mma_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                  counters: torch.Tensor | None = None, *, glu: bool = False, residual: torch.Tensor | None = None,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6, pdl: bool = False,
                  **override) -> torch.Tensor:
    """x [M, K] (M <= 16, bf16 / fp16) times the int4 weight ("dequant" packing) -> [M, N] in x's dtype. The fusions
    of kernels/quant_gemv.py, with the same meaning: glu (x = [gate | up] [M, 2K], silu(gate) * up taken), norm_weight
    (x RMS-normalized: x * norm_weight rounded to x's dtype, 1 / rms in fp32 applied to the sums), residual [M, N]
    (added before the final rounding). `counters`: int32 zeros, at least one per N tile (quant_gemv.counters_for
    sizes them for any tile), used when K is split and left at zero. pdl: launch with programmatic dependent launch (the caller asks kernels/pdl.py). `override`:
    int4_mma_config's entries."""
    x = x.contiguous()
    m, k = x.shape
    k = k // 2 if glu else k
    check(x[:, :k], weight, scale, zero, group_size)
    n = weight.shape[0]
    index = x.device.index if x.device.type == "cuda" else None
    cfg = int4_mma_config(m, n, k, group_size, _sm_count(index), **override)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    split = cfg["SPLIT_K"]
    tiles = math.ceil(n / cfg["BLOCK_N"])
    if split > 1:
        part = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
        if counters is None or counters.numel() < tiles:
            counters = torch.zeros(tiles, dtype=torch.int32, device=x.device)
    else:
        part = out
        counters = counters if counters is not None else torch.zeros(1, dtype=torch.int32, device=x.device)
    if residual is not None and tuple(residual.shape) != (m, n):
        raise Int4MmaError(f"residual must be [M, N] = [{m}, {n}]; got {tuple(residual.shape)}")
    r = residual.contiguous() if residual is not None else out  # never read without RESIDUAL
    nw = norm_weight.contiguous() if norm_weight is not None else out  # never read without NORM
    sq = torch.empty(split, m, dtype=torch.float32, device=x.device) if norm_weight is not None and split > 1 \
        else part
    w16 = weight.view(torch.int16)
    _int4_mma_kernel[(tiles, split)](
        x, w16, scale, zero, out, part, counters, r, nw, sq,
        m, n, k, cfg["groups_per_split"], float(eps), x.stride(0), w16.stride(0), scale.stride(0), scale.stride(1),
        out.stride(0), r.stride(0), split,
        GROUP=group_size, BLOCK_N=cfg["BLOCK_N"], BLOCK_M=MAX_ROWS, GLU=glu, NORM=norm_weight is not None,
        RESIDUAL=residual is not None, F16=x.dtype == torch.float16,
        EMULATE=os.environ.get("TRITON_INTERPRET") == "1", num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **(dict(PDL=True, launch_pdl=True) if pdl else {}))
    return out
