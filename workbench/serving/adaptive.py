"""Adaptive speculation: how many draft tokens each live row verifies this step.

Four rules, applied in order (each a serving knob of workbench.settings):
- **by batch size** (`k_by_batch`, vLLM-style inclusive ranges '1-4:4,5-8:2,9-64:0'): the step's draft length for
  its live batch size; sizes no range covers use `k`;
- **by queue** (`spec_off_queue`): no drafts in a step while at least that many requests wait for a row (overload;
  no engine we export to has this rule);
- **switch-off by acceptance** (`spec_off_acceptance`, `spec_window`): a request whose acceptance rate over its last
  `spec_window` drafting steps is below the threshold drafts no more (for the rest of the request);
- **by context length** (`spec_max_context`, `long_context_k`): past that many context tokens a row drafts at most
  `long_context_k` tokens.

The step verifies max(row k) nodes; rows with less have their extra drafts marked invalid (never accepted). A step
whose rows all get 0 skips drafting (an autoregressive step). Shorter drafts save verify work; only 0 saves the
drafter's own forwards (a draft model always drafts its full k when it runs).

Trees and beams (`tree=True`: EAGLE, ReDrafter; the engine verifies a tree whole or not at all, only chains can be
verified shorter): every rule chooses between 0 and the full tree, k = its N nodes; a rule's nonzero length means
"the tree on". The serve-bench row names which (`adaptive_granularity`: "draft_length" or "tree_on_off").

    >>> t = AdaptiveSpeculation(k=16, k_by_batch=[(1, 2, 4), (3, 64, 0)], tree=True)
    >>> [t.batch_k(b) for b in (1, 3)], t.node_counts(8), t.granularity
    ([16, 0], (0, 16), 'tree_on_off')

    >>> a = AdaptiveSpeculation(k=4, k_by_batch=[(1, 2, 4), (3, 8, 2), (9, 64, 0)])
    >>> [a.batch_k(b) for b in (1, 3, 9, 100)]
    [4, 2, 0, 4]
    >>> a.node_counts(16)          # the draft lengths a step of up to 16 rows can verify: capture them all first
    (0, 2, 4)
    >>> q = AdaptiveSpeculation(k=4, off_queue=3)
    >>> [q.batch_k(8, queued) for queued in (0, 2, 3)], q.node_counts(8), q.drafts_always(8)
    ([4, 4, 0], (0, 4), False)

Where the schedule comes from: `schedule_from_costs` picks, per batch size, the draft length with the most tokens per
millisecond from measured step costs (by batch size and draft length, 0 = autoregressive) and the mean tokens a row
emits per step at each length (workbench/serving/calibrate.py measures both on the engine that will serve).
"""
from __future__ import annotations

from collections import deque

from workbench.serving.request import RequestState


class AdaptiveSpeculation:
    def __init__(self, k: int, k_by_batch: list[tuple[int, int, int]] | None = None, off_acceptance: float = 0.0,
                 window: int = 8, max_context: int = 0, long_context_k: int = 0, off_queue: int = 0,
                 tree: bool = False):
        self.k, self.k_by_batch, self.off_queue = k, list(k_by_batch or []), off_queue
        self.off_acceptance, self.window = off_acceptance, window
        self.max_context, self.long_context_k = max_context, long_context_k
        self.tree = tree  # trees and beams: 0 or all k nodes (the engine cannot verify a tree shorter)

    @property
    def granularity(self) -> str:
        """What the rules choose: "draft_length" (chains: any 0..k) or "tree_on_off" (trees: 0 or the full tree)."""
        return "tree_on_off" if self.tree else "draft_length"

    def _whole(self, k: int) -> int:
        return (self.k if k else 0) if self.tree else k

    @property
    def is_static(self) -> bool:
        return not (self.k_by_batch or self.off_acceptance > 0 or self.max_context > 0 or self.off_queue > 0)

    def batch_k(self, batch_size: int, queued: int = 0) -> int:
        """The step's draft length for its live batch size, 0 while `queued` >= off_queue requests wait."""
        if self.off_queue > 0 and queued >= self.off_queue:
            return 0
        for lo, hi, k in self.k_by_batch:
            if lo <= batch_size <= hi:
                return self._whole(min(k, self.k))
        return self.k

    def drafts_always(self, max_batch: int) -> bool:
        """Whether every row drafts at every step of up to max_batch rows (no batch size at k = 0, no switch-off,
        no long-context cut to 0): only then is a draft model's prefill at a request's join sure to be used.

        >>> AdaptiveSpeculation(k=4).drafts_always(16)
        True
        >>> AdaptiveSpeculation(4, [(1, 1, 1), (2, 16, 0)]).drafts_always(16)
        False
        """
        if self.off_acceptance > 0 or self.off_queue > 0 or (self.max_context and self.long_context_k == 0):
            return False
        return all(self.batch_k(b) > 0 for b in range(1, max_batch + 1))

    def never_drafts(self, max_batch: int) -> bool:
        """Whether no step of up to max_batch rows drafts (k = 0 at every batch size, whatever waits): a draft model
        is then never run, so nothing of it is prefilled, caught up or read between steps.

        >>> AdaptiveSpeculation(4, [(1, 16, 0)]).never_drafts(16), AdaptiveSpeculation(4, [(1, 8, 0)]).never_drafts(16)
        (True, False)
        """
        return all(self.batch_k(b) == 0 for b in range(1, max_batch + 1))

    def node_counts(self, max_batch: int) -> tuple[int, ...]:
        """Every draft length (`decode_step(num_nodes=)`) a step of up to max_batch rows can ask for: the schedule's,
        their long-context limits, and 0 once rows can switch off. Trees (`tree`) verify all k nodes or none."""
        counts = {self.batch_k(b) for b in range(1, max_batch + 1)}
        if self.max_context:
            counts |= {min(k, self.long_context_k) for k in counts}
        if self.off_acceptance > 0 or self.off_queue > 0:
            counts.add(0)
        if self.tree:
            counts = {self.k if c else 0 for c in counts}
        return tuple(sorted(counts))

    def row_k(self, state: RequestState, context_len: int, batch_k: int) -> int:
        if state.spec_off:
            return 0
        if self.max_context and context_len > self.max_context:
            return self._whole(min(batch_k, self.long_context_k))
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


def schedule_from_costs(step_ms: dict[tuple[int, int], float], mean_tokens: dict[int, float], max_batch: int, *,
                        padded: bool = True, min_gain: float = 0.02) -> list[tuple[int, int, int]]:
    """The draft length per live batch size 1..max_batch with the most output tokens per millisecond,
    b x mean_tokens[k] / step_ms(b, k), as vLLM-style inclusive ranges [(start, end, k), ...].

    step_ms[(b, k)]: measured ms per decode step of b rows at draft length k (k = 0: autoregressive); mean_tokens[k]:
    tokens a row emits per step at k (1 + mean accepted; mean_tokens[0] = 1). A batch size not measured costs what
    the next measured size up costs when steps are `padded` to graph buckets, else the linear interpolation of its
    neighbours (sizes past the largest cost what it costs). A longer draft must beat the best shorter one by more than
    `min_gain` (relative), so that noise in the costs does not flip the schedule between near-equal lengths.

    >>> costs = {(1, 0): 1.0, (1, 2): 1.5, (2, 0): 1.0, (2, 2): 1.6, (4, 0): 1.2, (4, 2): 2.6}
    >>> schedule_from_costs(costs, {0: 1.0, 2: 1.8}, 4)   # 1.2 and 2.25 tok/ms beat 1 and 2; at 4 rows 3.3 > 2.8
    [(1, 2, 2), (3, 4, 0)]
    """
    sizes = sorted({b for b, _ in step_ms})
    ks = sorted({k for _, k in step_ms if k in mean_tokens})
    if not sizes or 0 not in ks:
        raise ValueError("schedule_from_costs needs measured costs at k = 0 (autoregressive) for some batch size")

    def cost(b: int, k: int) -> float | None:
        known = sorted(s for s in sizes if (s, k) in step_ms)
        if not known:
            return None
        if b in known:
            return step_ms[(b, k)]
        up = next((s for s in known if s > b), known[-1])
        down = next((s for s in reversed(known) if s < b), None)
        if padded or down is None or up <= b:
            return step_ms[(up, k)]
        w = (b - down) / (up - down)
        return step_ms[(down, k)] * (1 - w) + step_ms[(up, k)] * w

    ranges: list[list[int]] = []
    for b in range(1, max_batch + 1):
        best_k, best = 0, None
        for k in ks:
            c = cost(b, k)
            if c is None or c <= 0:
                continue
            rate = b * mean_tokens[k] / c
            if best is None or rate > best * (1 + min_gain):
                best_k, best = k, rate
        if ranges and ranges[-1][2] == best_k:
            ranges[-1][1] = b
        else:
            ranges.append([b, b, best_k])
    return [tuple(r) for r in ranges]


def format_k_by_batch(ranges: list[tuple[int, int, int]]) -> str:
    """The `k_by_batch` knob's text for ranges (the inverse of `settings.parse_k_by_batch`).

    >>> format_k_by_batch([(1, 2, 2), (3, 4, 0)])
    '1-2:2,3-4:0'
    """
    return ",".join(f"{lo}-{hi}:{k}" if hi != lo else f"{lo}:{k}" for lo, hi, k in ranges)
