"""Greedy fidelity under load: at temperature 0 every served output must equal that request's solo greedy output.

The reference of a request is its prompt decoded alone: batch 1, autoregressive (no drafter), `SpecEngine.generate`
with the serving engine's settings (dtype, attention, KV format, graphs, compile) and the request's max_new_tokens.
So the check covers both what load does (batching, joins, chunked prefill, preemption and recompute) and what
speculation does (a drafter never changes greedy output). It runs after the timed run, untimed, on at most
`greedy_check_requests` requests (the first by id; each distinct prompt and length decoded once).

Columns of the serve-bench row (`solo_columns`):
    greedy_matches_solo         True / False; None at temperature > 0 or with greedy_check_requests 0
    greedy_solo_compared        requests compared
    greedy_solo_s               seconds the solo decodes took (untimed)
and where outputs differ, the bench's near-tie rule (workbench/harness/bench.py, NEAR_TIE_LOGITS): the
fp32 logit margin at the first differing token of each differing request (`BenchSession.divergence_margins`):
    greedy_divergent_sequences, greedy_divergence_margin (the largest), greedy_near_tie (low precision and every
    margin <= NEAR_TIE_LOGITS: a tie the dtype cannot order, not a bug)
"""
from __future__ import annotations

import time
from dataclasses import replace

from workbench.engine import SpecEngine


def checked_requests(requests, limit: int) -> list:
    """The requests the check compares: the first `limit` by id (0: none)."""
    return sorted(requests, key=lambda r: r.id)[:max(0, limit)]


def solo_outputs(engine: SpecEngine, requests, memo: dict | None = None) -> dict[int, list[int]]:
    """Each request's prompt decoded alone (batch 1) on `engine` to its own max_new_tokens: request id -> tokens.
    memo: (prompt, max_new_tokens) -> tokens already decoded on this engine (greedy and deterministic: a study's
    trials serve the same prompts again), filled here; None = a fresh one."""
    memo = {} if memo is None else memo
    full = engine.config
    out = {}
    try:
        for r in requests:
            key = (tuple(r.prompt), r.max_new_tokens)
            if key not in memo:
                engine.config = replace(full, max_new_tokens=r.max_new_tokens)
                memo[key] = engine.generate([list(r.prompt)]).outputs[0]
            out[r.id] = memo[key]
    finally:
        engine.config = full
    return out


def differing(served: dict[int, list[int]], reference: dict[int, list[int]]) -> list[int]:
    """Ids of the reference's requests whose served output is not exactly the reference (missing counts as not).

    >>> differing({1: [5, 6], 2: [7]}, {1: [5, 6], 2: [8]})
    [2]
    """
    return [i for i in reference if served.get(i) != reference[i]]


def compare_columns(served: dict[int, list[int]], reference: dict[int, list[int]], prompts: dict[int, list[int]],
                    margins=None, dtype: str = "float32") -> dict:
    """The row's columns for served outputs against their solo references. margins(prompts, ours, theirs) -> per
    differing sequence the fp32 logit margin at its first differing token (None: no margins, no near-tie flag)."""
    from workbench.harness.bench import NEAR_TIE_LOGITS

    bad = differing(served, reference)
    cols = {"greedy_matches_solo": not bad, "greedy_solo_compared": len(reference)}
    if bad:
        cols["greedy_divergent_sequences"] = len(bad)
        if margins is not None:
            m = margins([prompts[i] for i in bad], [served.get(i) or [] for i in bad], [reference[i] for i in bad])
            if m:
                cols["greedy_divergence_margin"] = max(m)
                cols["greedy_near_tie"] = dtype != "float32" and max(m) <= NEAR_TIE_LOGITS
    return cols


_kept: list = []  # the solo engine made last (at most one)
_kept_memo: dict = {}  # its solo outputs so far, (prompt, max_new_tokens) -> tokens (dropped with it)


def solo_engine(engine: SpecEngine) -> SpecEngine:
    """An engine without a drafter over `engine`'s target with `engine`'s settings (untimed). The one made last is
    kept for the next run over the same target with the same settings, so a study's or a sweep's runs do not build,
    capture and compile it again each time, nor decode again a prompt it already decoded (`_kept_memo`); one at a
    time (its cache and graphs hold device memory, and it holds
    its target until another replaces it)."""
    config = replace(engine.config, timing=False)
    if _kept:
        kept = _kept[0]
        if kept.target is engine.target and kept.config == config and kept.device == engine.device:
            return kept
        _kept.clear()  # freed before the next one is made
        _kept_memo.clear()
    _kept.append(SpecEngine(engine.target, None, config, engine.device))
    return _kept[0]


def solo_columns(engine: SpecEngine, cfg, requests, served: dict[int, list[int]], margins=None,
                 dtype: str = "float32") -> dict:
    """`greedy_matches_solo` and its companions for a finished serving run on `engine` (cfg resolved: no "auto"
    left); the solo decodes run on an engine of their own (`solo_engine`): the same target and settings, no drafter.
    margins(prompts, ours, theirs, cfg): `BenchSession.divergence_margins` (None: no near-tie columns). All None
    where nothing is checked (sampling, or greedy_check_requests 0)."""
    none = {"greedy_matches_solo": None, "greedy_solo_compared": None, "greedy_solo_s": None}
    picked = checked_requests(requests, cfg.greedy_check_requests)
    if cfg.temperature != 0.0 or not picked:
        return none
    t0 = time.perf_counter()
    solo = solo_engine(engine)
    reference = solo_outputs(solo, picked, _kept_memo if _kept and _kept[0] is solo else None)
    cols = compare_columns(served, reference, {r.id: list(r.prompt) for r in picked},
                           None if margins is None else lambda p, ours, theirs: margins(p, ours, theirs, cfg), dtype)
    cols["greedy_solo_s"] = time.perf_counter() - t0
    return cols


__all__ = ["checked_requests", "compare_columns", "differing", "solo_columns", "solo_outputs"]
