"""Adaptive speculation: how many draft tokens each live row verifies this step.

Three rules, applied in order (each a serving knob of workbench.settings):
- **by batch size** (`k_by_batch`, vLLM-style inclusive ranges '1-4:4,5-8:2,9-64:0'): the step's draft length for
  its live batch size; sizes no range covers use `k`;
- **switch-off by acceptance** (`spec_off_acceptance`, `spec_window`): a request whose acceptance rate over its last
  `spec_window` drafting steps is below the threshold drafts no more (for the rest of the request);
- **by context length** (`spec_max_context`, `long_context_k`): past that many context tokens a row drafts at most
  `long_context_k` tokens.

The step verifies max(row k) nodes; rows with less have their extra drafts marked invalid (never accepted). A step
whose rows all get 0 skips drafting (an autoregressive step). Shorter drafts save verify work; only 0 saves the
drafter's own forwards (a draft model always drafts its full k when it runs).

    >>> a = AdaptiveSpeculation(k=4, k_by_batch=[(1, 2, 4), (3, 8, 2), (9, 64, 0)])
    >>> [a.batch_k(b) for b in (1, 3, 9, 100)]
    [4, 2, 0, 4]
"""
from __future__ import annotations

from collections import deque

from workbench.serving.request import RequestState


class AdaptiveSpeculation:
    def __init__(self, k: int, k_by_batch: list[tuple[int, int, int]] | None = None, off_acceptance: float = 0.0,
                 window: int = 8, max_context: int = 0, long_context_k: int = 0):
        self.k, self.k_by_batch = k, list(k_by_batch or [])
        self.off_acceptance, self.window = off_acceptance, window
        self.max_context, self.long_context_k = max_context, long_context_k

    @property
    def is_static(self) -> bool:
        return not (self.k_by_batch or self.off_acceptance > 0 or self.max_context > 0)

    def batch_k(self, batch_size: int) -> int:
        for lo, hi, k in self.k_by_batch:
            if lo <= batch_size <= hi:
                return min(k, self.k)
        return self.k

    def row_k(self, state: RequestState, context_len: int, batch_k: int) -> int:
        if state.spec_off:
            return 0
        if self.max_context and context_len > self.max_context:
            return min(batch_k, self.long_context_k)
        return batch_k

    def record(self, state: RequestState, accepted: int, drafted: int) -> None:
        """After a step that drafted for this request: update its window; switch it off below the threshold."""
        if drafted == 0 or self.off_acceptance <= 0:
            return
        if state.window.maxlen != self.window:
            state.window = deque(state.window, maxlen=self.window)
        state.window.append((accepted, drafted))
        if len(state.window) == self.window:
            acc = sum(a for a, _ in state.window) / sum(d for _, d in state.window)
            if acc < self.off_acceptance:
                state.spec_off = True
