"""Draft-length schedules from measured output tokens/s per (batch size, k): the loop calibration's choice rules,
torch-free (the dashboard recomputes a run's schedule under the other shape from its stored calibration table).

    pick_k          one batch size: the most tokens/s, a longer draft only when it wins by more than min_gain
    free_choice     every size its own pick_k
    sticky_choice   from the smallest size up: keep the last k unless a shorter draft wins by more than min_gain
    monotone_choice every size at once: k never grows with the batch size
    choose          batch size -> k under a shape ("sticky", "monotone" or "free"), or one k for every size (uniform)
    loop_schedule   vLLM-style inclusive ranges [(start, end, k), ...] over 1..max_batch, by shape
"""
from __future__ import annotations

from workbench import settings
from workbench.serving.config import ServeError

MIN_GAIN = 0.02  # the default tie margin: a longer draft must win by more than 2 % (serve-bench's calibration)

def pick_k(tokens_per_s: dict[int, float], min_gain: float = MIN_GAIN) -> int:
    """The draft length with the most tokens/s; a longer one must beat the best shorter one by more than min_gain
    (relative), so ties and noise go to the smaller k (0 = speculation off).

    >>> pick_k({0: 100.0, 2: 101.0, 4: 130.0})
    4
    >>> pick_k({0: 100.0, 2: 101.5, 4: 99.0})   # 1.5 % is within the noise: off
    0
    """
    best_k, best = None, None
    for k in sorted(tokens_per_s):
        rate = tokens_per_s[k]
        if rate is not None and (best is None or rate > best * (1 + min_gain)):
            best_k, best = k, rate
    if best_k is None:
        raise ServeError("no measured draft length to choose from")
    return best_k


def free_choice(by_size: dict[int, dict[int, float]], min_gain: float = MIN_GAIN) -> dict[int, int]:
    """Per measured batch size, its own `pick_k` (no order between sizes)."""
    return {b: pick_k(row, min_gain) for b, row in by_size.items()}


SCHEDULE_SHAPES = settings.SERVE_KNOBS["calibration_shape"].choices  # ("sticky", "monotone", "free"): declared there
DEFAULT_SHAPE = settings.SERVE_KNOBS["calibration_shape"].default


def sticky_choice(by_size: dict[int, dict[int, float]], min_gain: float = MIN_GAIN) -> dict[int, int]:
    """Per measured batch size, a draft length that never grows with the batch size and changes only on a clear
    win: the smallest size takes `pick_k`; each larger size keeps the previous size's k while that k is within
    min_gain of the best length not longer than it, else the longest length that is (one step down, not to off
    when a middle length ties with the best). Why: a tie between k and off at a bucket edge is noise, but turning
    speculation off there is not neutral in a serving loop. Running off makes requests take more steps, so the live
    batch stays past the threshold that turned it off: a 1.9 % tie at 64 rows, made a threshold at 33 by `monotone`,
    ran 18 % below fixed k = 4 on the H200.

    >>> rates = {8: {0: 4946, 2: 6791, 4: 7804}, 16: {0: 9739, 2: 10330, 4: 9080}, 32: {0: 12782, 2: 13534, 4: 14334}}
    >>> sticky_choice(rates, 0.10)   # 16: k = 4 loses 12 % to k = 2; 32: k = 2 ties with the best length <= 2
    {8: 4, 16: 2, 32: 2}
    >>> sticky_choice({32: {0: 0.72, 4: 1.0}, 64: {0: 0.981, 4: 1.0}})   # a tie at 64 keeps k = 4 (monotone: 0)
    {32: 4, 64: 4}
    """
    choice: dict[int, int] = {}
    prev = None
    for b in sorted(by_size):
        row = by_size[b]
        allowed = {k: r for k, r in row.items() if prev is None or k <= prev}
        if not allowed:  # nothing this short was measured here (skipped for the budget): the shortest that was
            allowed = {min(row): row[min(row)]}
        if prev is None:
            choice[b] = pick_k(allowed, min_gain)
        else:  # the longest length within min_gain of the best: prev itself unless it clearly lost
            best = max(allowed.values())
            choice[b] = max(k for k, r in allowed.items() if r * (1 + min_gain) >= best)
        prev = choice[b]
    return choice


def monotone_choice(by_size: dict[int, dict[int, float]], min_gain: float = MIN_GAIN) -> dict[int, int]:
    """Per measured batch size, a draft length that never grows with the batch size. Where each size's own
    `pick_k` already keeps that order it is the answer; else the non-increasing sequence with the largest sum of
    each size's tokens/s relative to its own best (a small dynamic program over sizes x k), then, from the largest
    size down, each size's k re-picked by `pick_k` among the lengths between the next size's and its own (ties to
    the shorter draft without breaking the order). Why: one short run per (batch, k) varies by 10-20 %,
    and free per-size picks then make schedules such as 4 / 0 / 3 whose bands cost 11-18 % at
    their thresholds; a draft's extra verify work grows with the batch while its gain per row does not, so the order
    is the prior and the measurements choose within it.

    >>> rates = {8: {0: 4946, 2: 6791, 4: 7804}, 16: {0: 9739, 2: 10330, 4: 9080}, 32: {0: 12782, 2: 13534, 4: 14334}}
    >>> {b: pick_k(r, 0.10) for b, r in rates.items()}   # free: k = 2's 6 % at 16 is a tie with off
    {8: 4, 16: 0, 32: 4}
    >>> monotone_choice(rates, 0.10)
    {8: 4, 16: 0, 32: 0}
    """
    sizes = sorted(by_size)
    free = free_choice(by_size, min_gain)
    if all(free[a] >= free[b] for a, b in zip(sizes, sizes[1:])):
        return free
    ks = sorted({k for row in by_size.values() for k in row})
    rel = {b: {k: by_size[b][k] / max(by_size[b].values()) if k in by_size[b] else -1.0 for k in ks} for b in sizes}
    best = {k: rel[sizes[0]][k] for k in ks}  # best[k]: the largest sum over the sizes so far, k at the last one
    back: list[dict[int, int]] = []
    for b in sizes[1:]:
        prev = {k: max((j for j in ks if j >= k), key=lambda j: best[j]) for k in ks}  # k's best predecessor
        back.append(prev)
        best = {k: best[prev[k]] + rel[b][k] for k in ks}
    k = max(ks, key=lambda j: (best[j], -j))
    path = [k]
    for prev in reversed(back):
        k = prev[k]
        path.append(k)
    choice = dict(zip(sizes, reversed(path)))
    floor = 0
    for b in reversed(sizes):
        allowed = {k: r for k, r in by_size[b].items() if floor <= k <= choice[b]}
        if allowed:
            choice[b] = pick_k(allowed, min_gain)
        floor = choice[b]
    return choice


SHAPE_RULES = {"sticky": sticky_choice, "monotone": monotone_choice, "free": free_choice}  # calibration_shape -> rule
assert set(SHAPE_RULES) == set(SCHEDULE_SHAPES), "every calibration_shape choice needs its rule here"


def uniform_choice(choice: dict[int, int]) -> dict[int, int]:
    """One draft length for every measured size: the largest size's. For an engine where a schedule that drafts at
    some batch sizes and not at others costs more than its measured points say: a draft model keeps its own KV, so
    such a schedule needs catch-ups and loses full overlap (ServeTuning.full_overlap), worth 1.07x to small's draft
    model at k = 4 and 1.15-1.29x to off on the H200. The largest size decides because under load, where tokens/s is
    scarce, the batch fills up (mean batch 53-62 of 64 at 1.0x and 1.5x saturation).

    >>> uniform_choice({1: 4, 16: 4, 64: 0})
    {1: 0, 16: 0, 64: 0}
    """
    k = choice[max(choice)]
    return {b: k for b in choice}


def choose(tokens_per_s: dict[tuple[int, int], float | None], min_gain: float = MIN_GAIN,
           shape: str = DEFAULT_SHAPE, uniform: bool = False) -> dict[int, int]:
    """Batch size -> chosen k over the measured (batch size, k) -> tokens/s (None = skipped for the budget);
    shape "free": each size's `pick_k`, "monotone": `monotone_choice`, "sticky": `sticky_choice`; uniform: then one
    k for every size (`uniform_choice`). {} when nothing was measured."""
    if shape not in SCHEDULE_SHAPES:
        raise ServeError(f"unknown calibration_shape {shape!r}; choose one of {', '.join(SCHEDULE_SHAPES)}")
    by_size: dict[int, dict[int, float]] = {}
    for (b, k), rate in tokens_per_s.items():
        if rate is not None:
            by_size.setdefault(b, {})[k] = rate
    if not by_size:
        return {}
    choice = SHAPE_RULES[shape](by_size, min_gain)
    return uniform_choice(choice) if uniform else choice


def loop_schedule(tokens_per_s: dict[tuple[int, int], float], max_batch: int, min_gain: float = MIN_GAIN,
                  shape: str = DEFAULT_SHAPE, uniform: bool = False) -> list[tuple[int, int, int]]:
    """vLLM-style inclusive ranges [(start, end, k), ...] over 1..max_batch from tokens/s measured per (batch size,
    k): shape "free": each measured size gets `pick_k` of its row; "monotone": `monotone_choice` (k never grows with
    the batch size); "sticky": `sticky_choice` (that, changing k only on a clear win). A size not measured takes the
    choice of the next measured size up (a step pads to that bucket), sizes past the largest its choice; uniform: one
    k everywhere (`uniform_choice`).

    >>> loop_schedule({(1, 0): 50, (1, 4): 80, (4, 0): 190, (4, 4): 200, (8, 0): 380, (8, 4): 300}, 8)
    [(1, 4, 4), (5, 8, 0)]
    """
    choice = choose(tokens_per_s, min_gain, shape, uniform)
    if not choice:
        raise ServeError("the loop calibration measured nothing (every run skipped): raise --calibration-budget-s")
    sizes = sorted(choice)
    ranges: list[list[int]] = []
    for b in range(1, max_batch + 1):
        k = choice[next((s for s in sizes if s >= b), sizes[-1])]
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = b
        else:
            ranges.append([b, b, k])
    return [tuple(r) for r in ranges]
