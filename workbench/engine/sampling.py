"""Turning logits into distributions and tokens; one function serves target and draft alike.

Temperature, top-k and top-p are applied by `probs_from_logits` only, so the draft distribution q and the target
distribution p of the verification rule are always shaped by exactly the same settings.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax); > 0 = sample
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) after temperature, top-k and top-p.

    Greedy settings give the one-hot distribution of the argmax, so the same verification code is exact for both.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [..., V] -> token ids [...]; inverse-CDF sampling with torch ops only (no host sync)."""
    flat = probs.reshape(-1, probs.shape[-1])
    u = torch.rand(flat.shape[0], 1, device=flat.device, generator=generator)
    cdf = flat.cumsum(-1)
    ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=flat.shape[-1] - 1)
    return ids.view(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [..., V] -> token ids [...] (argmax when greedy)."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, params), generator)
