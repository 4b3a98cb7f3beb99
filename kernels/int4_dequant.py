"""int4 group-wise weights dequantized in one pass, for the calls the GEMV does not take (prefill).

An `Int4Linear` with kernel "triton" keeps the "dequant" packing (uint8 [N, K/2], byte j of a row: weight 2j in the
high nibble, 2j + 1 in the low one; scale and zero [N, K/g] in the model dtype). Calls of more than GEMV_MAX_ROWS rows
dequantize it and run one matmul. In PyTorch ops that is six kernels per linear (stack, two shifts/ands, a cast, the
subtract, multiply and add), each reading and writing the whole weight in the model dtype: a
profile of a 6.7 B int4 model put them at about 71 ms of GPU time per 64-token prompt, against a
decode token of 2.2 ms. `int4_dequant_triton` does it in one kernel: the packed bytes read once, the model-dtype
weight written once.

It computes exactly what `int4_dequant_reference` (the PyTorch ops) computes: (q - 8) * scale, rounded to the model
dtype, + zero, rounded again (PyTorch's reduced-precision elementwise ops compute in fp32 and round each result).
Tests: tests/test_quant_gemv.py, bit for bit under the Triton interpreter. Measured 3.1-5.3x
faster per 6.7 B linear than the PyTorch ops, so kernel "triton" always takes it.
"""
from __future__ import annotations

import torch

from .quant_gemv import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

BLOCK_N, BLOCK_B = 32, 128  # a program's tile: rows x packed bytes (x 2 weights)


def int4_dequant_reference(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """uint8 [N, K/2] + scale / zero [N, K/g] -> [N, K] in scale's dtype, by PyTorch ops."""
    n = weight.shape[0]
    q = torch.stack((weight >> 4, weight & 15), dim=-1).reshape(n, -1, group_size)
    return ((q.to(scale.dtype) - 8) * scale[..., None] + zero[..., None]).reshape(n, -1)


if TRITON_AVAILABLE:
    @triton.jit
    def _dq(q, s, z, TY: tl.constexpr):
        """((q - 8) * s rounded to TY) + z rounded to TY, as PyTorch's elementwise ops round in TY (to nearest even:
        what the GPU's fp32 -> bf16 conversion does; the interpreter truncates, so the tests patch it)."""
        p = ((q - 8).to(tl.float32) * s).to(TY).to(tl.float32)
        return (p + z).to(TY)

    @triton.jit
    def _int4_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, KB, n_groups,
                             GROUP: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_b = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)  # [BN] rows
        offs_b = pid_b * BB + tl.arange(0, BB)  # [BB] packed bytes: weights 2b and 2b + 1
        mask = (offs_n < N)[:, None] & (offs_b < KB)[None, :]
        b = tl.load(w_ptr + offs_n[:, None] * KB + offs_b[None, :], mask=mask, other=0).to(tl.int32)
        sz = offs_n[:, None] * n_groups + ((offs_b * 2) // GROUP)[None, :]  # both nibbles share a group (g even)
        s = tl.load(s_ptr + sz, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + sz, mask=mask, other=0.0).to(tl.float32)
        ty = out_ptr.dtype.element_ty
        # weights 2b (high nibble) and 2b + 1 (low) side by side: one contiguous [BN, 2 BB] tile, stored whole
        w = tl.reshape(tl.join(_dq((b >> 4) & 15, s, z, ty), _dq(b & 15, s, z, ty)), [BN, 2 * BB])
        offs_k = pid_b * (2 * BB) + tl.arange(0, 2 * BB)
        tl.store(out_ptr + offs_n[:, None] * (2 * KB) + offs_k[None, :], w,
                 mask=(offs_n < N)[:, None] & (offs_k < 2 * KB)[None, :])


def int4_dequant_triton(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """`int4_dequant_reference` in one Triton kernel (through the custom op `torch.ops.workbench.int4_dequant`, so
    torch.compile keeps it as one opaque call)."""
    return torch.ops.workbench.int4_dequant(weight, scale, zero, group_size)


@torch.library.custom_op("workbench::int4_dequant", mutates_args=())
def _int4_dequant_op(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    n, kb = weight.shape
    if group_size % 2 or (2 * kb) % group_size or scale.shape != (n, 2 * kb // group_size) or zero.shape != scale.shape:
        raise ValueError(f"int4 dequant: group size {group_size} must be even and divide K = {2 * kb}, and scale / "
                         f"zero be [N, K / g] = [{n}, {2 * kb // max(group_size, 1)}] (got {tuple(scale.shape)}, "
                         f"{tuple(zero.shape)})")
    if not TRITON_AVAILABLE:
        raise RuntimeError("int4_dequant_triton needs the triton package (a CUDA build of torch ships it): install "
                           "it, or choose quant_kernel dequant (int4_dequant_reference, the same weight)")
    weight, scale, zero = weight.contiguous(), scale.contiguous(), zero.contiguous()
    out = torch.empty(n, 2 * kb, dtype=scale.dtype, device=weight.device)
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(kb, BLOCK_B))
    _int4_dequant_kernel[grid](weight, scale, zero, out, n, kb, scale.shape[1], GROUP=group_size, BN=BLOCK_N,
                               BB=BLOCK_B, num_warps=4)
    return out


@_int4_dequant_op.register_fake
def _(weight, scale, zero, group_size):
    return scale.new_empty(weight.shape[0], 2 * weight.shape[1])
