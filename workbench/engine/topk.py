"""The drafters' ranking: the k best candidates of each row, as log-probabilities or plain scores.

EAGLE's levels, EAGLE-3's levels and ReDrafter's beam depths rank through `ranked_topk` (EAGLE's next frontier, K x K
scores, is a stable sort inside its compiled graph, with the same rule for ties). On a CUDA device it is
`kernels.fused_topk`'s kernel (log-softmax and top-k in one or two launches, 5-15x faster than log_softmax +
torch.topk on an H100, scripts/gpu_topk.py); elsewhere that kernel's PyTorch reference, the same values (among exactly
equal values the kernel takes the lower index; torch.topk's choice is unspecified).

    values, indices = ranked_topk(logits, k)                                  # log-probabilities, clamped at 0
    values, indices = ranked_topk(scores, k, log_softmax=False)               # scores.topk(k, -1)
    values, indices = ranked_topk(logits, w, group=w, bias=beam_scores)       # a beam search's W x V candidates
"""
from __future__ import annotations

import torch

from kernels.fused_topk import TRITON_AVAILABLE, fused_topk_reference, fused_topk_triton


def ranked_topk(x: torch.Tensor, k: int, log_softmax: bool = True, group: int = 1,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of x's rows as `kernels.fused_topk` defines them (log-probabilities clamped at 0 where log_softmax,
    + bias per input row, `group` rows side by side) -> (float32 values, long indices) [..., k], best first."""
    if x.device.type == "cuda" and TRITON_AVAILABLE:
        return fused_topk_triton(x, k, log_softmax, group, bias)
    return fused_topk_reference(x, k, log_softmax, group, bias)
