"""Pieces the GEMV kernels share (kernels/quant_gemv.py and kernels/int4_mma.py): the SM count their launch rules read
and the split-K sum the last split of a tile adds up. Kept here so neither GEMV module imports the other's internals."""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - CPU machines without triton
    TRITON_AVAILABLE = False


@functools.lru_cache(maxsize=None)
def sm_count(index: int | None) -> int:
    """The device's streaming multiprocessors (None: 132, an H200's, for shape rules computed without a device)."""
    return torch.cuda.get_device_properties(index).multi_processor_count if index is not None else 132


if TRITON_AVAILABLE:
    @triton.jit
    def sum_splits(part, sq_ptr, offs_m, mask_m, out_mask, M, N, SPLIT_K, total, sq_all, NORM: tl.constexpr):
        """What the last split of a tile adds up, in split order (the same sum whatever the arrival order): the fp32
        partials at `part` (this tile's pointers into split 0 of [SPLIT_K, M, N]) into `total`, and (NORM) the sums
        of x^2 per row at sq_ptr [SPLIT_K, M] into `sq_all`; both passed in as zeros of the shapes wanted (the
        Triton GEMV's tiles are [BM, BN], kernels/int4_mma.py's [BN, BM])."""
        for sk in range(0, SPLIT_K):
            total += tl.load(part + sk * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if NORM:
                sq_all += tl.load(sq_ptr + sk * M + offs_m, mask=mask_m, other=0.0, cache_modifier=".cg")
        return total, sq_all
