"""Top-k over long rows in passes over chunks: what the drafters rank their candidates with.

`torch.topk` of a few elements out of one long row (a beam search's W x V candidates, a head's scores over the
vocabulary) runs as one thread block per row on a GPU: on an H100, `redrafter W4 L4` on `tiny` spent 195 us of its
565 us step in four such calls over 16,384 candidates. `chunked_topk` takes the k best of each chunk of `chunk`
elements (many blocks at once), then the k best of those, which are the k best of the row. It pays where rows are few
and long; with many rows torch.topk's blocks already fill the GPU and the chunks' extra launches lose (H100,
`scripts/gpu_topk.py`: 1.3-2.2x faster at 1-4 rows of 16k-128k candidates, 1.04-1.84x at 16 rows of 16k-32k, but
0.6-0.7x at 16 rows of 128k or 64 rows of 4k and 0.94x at 4 rows of 4k, which therefore stay with torch.topk:
MIN_LENGTH, MAX_ROWS, MAX_CHUNKS). On a CPU torch.topk stays too (the passes measured 1.2-1.45x slower there).

    values, indices = chunked_topk(scores, k)   # as scores.topk(k, -1): largest first

Values equal `torch.topk`'s; among equal values the indices may name other (equally good) elements.
"""
from __future__ import annotations

import math

import torch

from kernels.fused_topk import TRITON_AVAILABLE, fused_topk_reference, fused_topk_triton

CHUNK = 256  # elements per chunk of the first pass
MIN_LENGTH = 8192  # shorter rows take torch.topk at once (a 4,096-token head row: no gain)
MAX_ROWS = 16  # more rows take torch.topk at once
MAX_CHUNKS = 2048  # rows x chunks of the first pass; more take torch.topk at once


def uses_chunks(shape: tuple[int, ...], k: int, chunk: int = CHUNK) -> bool:
    """Whether a CUDA tensor of this shape takes the chunked passes (where they measured faster than torch.topk)."""
    n, rows = shape[-1], math.prod(shape[:-1])
    return n >= max(MIN_LENGTH, 2 * chunk) and 4 * k <= chunk and rows <= MAX_ROWS and rows * (n // chunk) <= MAX_CHUNKS


def chunked_topk(x: torch.Tensor, k: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [..., k] of the k largest of x [..., N] along its last dimension, largest first, as
    `x.topk(k, -1)`: in passes over chunks on a GPU where `uses_chunks` says so, else torch.topk itself (on a CPU the
    passes measured 1.2-1.45x slower than torch.topk, so it keeps it)."""
    if x.device.type != "cuda" or not uses_chunks(tuple(x.shape), k, chunk):
        return x.topk(k, -1)
    return topk_in_chunks(x, k, chunk)


def topk_in_chunks(x: torch.Tensor, k: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The passes, on any device: the k best of each whole chunk (a shorter last chunk's elements join them as they
    are), then chunked_topk over those survivors."""
    n = x.shape[-1]
    m = n // chunk
    head = x if m * chunk == n else x[..., : m * chunk]
    values, idx = head.unflatten(-1, (m, chunk)).topk(k, -1)  # [..., m, k]
    idx = (idx + torch.arange(0, m * chunk, chunk, device=x.device).unsqueeze(-1)).flatten(-2)  # row positions
    values = values.flatten(-2)
    if m * chunk < n:  # the last, shorter chunk's elements join the survivors as they are
        values = torch.cat([values, x[..., m * chunk:]], -1)
        idx = torch.cat([idx, torch.arange(m * chunk, n, device=x.device).expand(*x.shape[:-1], n - m * chunk)], -1)
    best, pick = chunked_topk(values, k, chunk)  # [..., k] of the survivors
    return best, idx.gather(-1, pick)


def ranked_topk(x: torch.Tensor, k: int, log_softmax: bool = True, group: int = 1,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafters' ranking: the k best of x's rows as `kernels.fused_topk` defines them (log-probabilities clamped
    at 0 where log_softmax, + bias per input row, `group` rows side by side) -> (float32 values, long indices), best
    first. On a CUDA device with triton the fused kernel (one or two launches); elsewhere its PyTorch reference."""
    if x.device.type == "cuda" and TRITON_AVAILABLE:
        return fused_topk_triton(x, k, log_softmax, group, bias)
    return fused_topk_reference(x, k, log_softmax, group, bias)
