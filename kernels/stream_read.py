"""A read-only floor for one launch: stream a buffer's 32-bit words and fold them to one word per program.

    stream_read(words [n] int32, block=1024, iters=4, num_warps=8) -> [programs] int32, the xor of each program's words

A measurement kernel, not part of the engine. A GEMV that reads the same bytes in one launch cannot be faster than
the fastest tile of this kernel (same bytes, no arithmetic on them, nothing written but one word per program), so
scripts/gpu_gemv.py --parts read times it beside our int4 GEMV and tinygemm on each decoder linear's packed weight:
what the GEMV loses to its arithmetic and tiling, and what is left to win per linear at all.

Each program reads `iters` consecutive blocks of `block` words, the loads unrolled so all of them are in flight
before the first is used; the grid covers the buffer (the last program masked). The xor keeps every load live
(the compiler cannot drop a load whose value is folded into the output) and is exact, so the test checks the
result word for word against torch.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    TRITON_AVAILABLE = True
except ImportError:
    TRITON_AVAILABLE = False


if TRITON_AVAILABLE:
    @triton.jit
    def _xor_fold(a, b):
        return a ^ b

    @triton.jit
    def _stream_read_kernel(src, out, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in tl.static_range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            acc = acc ^ tl.load(src + offs, mask=offs < n_words, other=0)
        tl.store(out + tl.program_id(0), tl.reduce(acc, 0, _xor_fold))


def stream_read(words: torch.Tensor, block: int = 1024, iters: int = 4, num_warps: int = 8,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The xor of each program's `block * iters` words of the contiguous int32 buffer `words` ([programs] int32).
    `out` (optional, at least that long) is written in place, so a CUDA graph can replay the call."""
    if words.dtype != torch.int32 or not words.is_contiguous():
        raise ValueError(f"stream_read reads a contiguous int32 buffer, got {words.dtype} "
                         f"(contiguous={words.is_contiguous()}): view the bytes as int32 first")
    if block & (block - 1) or block < 32 or iters < 1:
        raise ValueError(f"block must be a power of two >= 32 and iters >= 1, got block={block}, iters={iters}")
    if not TRITON_AVAILABLE:
        raise RuntimeError("stream_read needs triton (pip install triton; on a CPU also set TRITON_INTERPRET=1)")
    n = words.numel()
    programs = triton.cdiv(n, block * iters)
    if out is None:
        out = torch.empty(programs, dtype=torch.int32, device=words.device)
    _stream_read_kernel[(programs,)](words, out, n, BLOCK=block, ITERS=iters, num_warps=num_warps)
    return out[:programs]


def stream_read_reference(words: torch.Tensor, block: int, iters: int) -> torch.Tensor:
    """What `stream_read` returns, by torch: each program's words (zero-padded) xor-folded."""
    import numpy as np

    span = block * iters
    flat = words.cpu().numpy().astype(np.int32)
    padded = np.zeros(-(-flat.size // span) * span, dtype=np.int32)
    padded[:flat.size] = flat
    return torch.from_numpy(np.bitwise_xor.reduce(padded.reshape(-1, span), axis=1))
