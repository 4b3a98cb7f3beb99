"""Load generator: when requests arrive and how long they are; seeded, so a run can be repeated exactly.

Arrivals (`arrival`):
- poisson: gaps ~ Exponential(rate) (rate 0 = every request at t = 0);
- gamma: gaps ~ Gamma(shape = burstiness, scale = 1 / (rate x burstiness)) - the mean gap stays 1 / rate, burstiness
  < 1 clusters arrivals (`vllm bench serve --burstiness` uses the same parametrisation);
- concurrency: every request is ready at t = 0 and the loop lets at most `max_concurrency` into the system (each
  request's clock starts when it is let in, like a client with that many connections).
Lengths (`lengths`): "file" cycles the prompt file's prompts with max_new_tokens each; "random" draws random token
ids, prompt length input_len and output length max_new_tokens each scaled by U[1 - range_ratio, 1 + range_ratio]
(vLLM's random dataset), optionally all starting with one shared prefix of shared_prefix_len tokens.
The first `warmup_requests` requests (measured = False) run first and are left out of the metrics.
"""
from __future__ import annotations

import numpy as np

from workbench.serving.request import Request


def arrival_times(n: int, rate: float, arrival: str = "poisson", burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """n arrival times (seconds, increasing, the first gap included).

    >>> arrival_times(3, 0.0)
    [0.0, 0.0, 0.0]
    """
    if rate <= 0 or arrival == "concurrency":
        return [0.0] * n
    rng = np.random.default_rng(seed)
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    elif arrival == "gamma":
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    else:
        raise ValueError(f"unknown arrival process {arrival!r}; choose poisson, gamma or concurrency")
    return np.cumsum(gaps).tolist()


def make_requests(cfg, prompt_ids: list[list[int]], vocab_size: int) -> list[Request]:
    """cfg: a ServeConfig; prompt_ids: the prompt file, tokenized (lengths "file"). warmup + measured requests."""
    n = cfg.warmup_requests + cfg.num_requests
    rng = np.random.default_rng(cfg.seed + 1)  # lengths and tokens independent of the arrival draws
    times = arrival_times(n, cfg.rate, cfg.arrival, cfg.burstiness, cfg.seed)
    prefix = rng.integers(0, vocab_size, cfg.shared_prefix_len).tolist() if cfg.lengths == "random" else []
    out = []
    for i in range(n):
        if cfg.lengths == "file":
            if not prompt_ids:
                raise ValueError("lengths 'file' needs a non-empty prompt file")
            prompt, new = list(prompt_ids[i % len(prompt_ids)]), cfg.max_new_tokens
        else:
            lo, hi = 1 - cfg.range_ratio, 1 + cfg.range_ratio
            plen = max(1, round(cfg.input_len * rng.uniform(lo, hi)))
            new = max(1, round(cfg.max_new_tokens * rng.uniform(lo, hi)))
            prompt = prefix + rng.integers(0, vocab_size, plen).tolist()
        out.append(Request(i, prompt, new, times[i], measured=i >= cfg.warmup_requests))
    return out
