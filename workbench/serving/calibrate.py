"""Measure what an adaptive schedule needs, on the engine that will serve. Two ways (the `calibration` knob):

- **step** (`calibrate`): ms per isolated decode step by batch size and draft length, and the tokens a row emits per
  step at each length; the schedule maximizes tokens per ms. Cheap, but a lone step has no prefill beside it and no
  draft catch-up, so under load it over-rates speculation (k = 4 can win every batch size here and lose to "off" in
  the loop).
- **loop** (`calibrate_loop`): per batch size b and draft length k, a short closed-loop serve (max_concurrency = b,
  a few x b requests from the run's prompts, the first b left out as warm-up) on the same engine, graphs reused;
  the schedule takes per b the k with the most output tokens/s (`pick_k`), kept from growing with b by default
  (`calibration_shape`, workbench/serving/schedules.py). What it measures is what serving pays.

    cal = calibrate(engine, prompt_ids, batch_sizes=(1, 2, 4, 8, 16), steps=8)
    cal.step_ms[(4, 2)]      # median ms of a decode step over 4 rows verifying 2 draft tokens (0 = autoregressive)
    cal.mean_tokens[2]       # tokens a row emits per step at k = 2 (1 + mean accepted)
    cal.schedule(16)         # adaptive.schedule_from_costs over both: [(start, end, k), ...]

Steps run as the serving loop runs them (`SpecEngine.decode_step` over rows prefilled with the prompts, graphs
captured first for every length), timed on the host around the step, whose one device->host read makes it
synchronous. For each batch size the rows start afresh from their prompts and the full draft length runs first:
its accepted counts give every shorter length's, since a greedy chain's first k' drafts are the shorter chain
(mean_tokens[k'] = 1 + mean(min(accepted, k'))); exact for greedy chains, an estimate for sampled drafts and trees.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workbench.engine.sampling import next_token
from workbench.engine.step import PhaseTimer, SpecEngine
from workbench.serving.adaptive import AdaptiveSpeculation, schedule_from_costs
from workbench.serving.config import ServeError
from workbench.serving.loop import verifies_shorter
from workbench.serving.schedules import (DEFAULT_SHAPE, MIN_GAIN, SCHEDULE_SHAPES, choose, loop_schedule,  # noqa: F401
                                         monotone_choice, pick_k, sticky_choice)
from workbench.serving.tuning import ServeTuning


@dataclass
class Calibration:
    step_ms: dict[tuple[int, int], float]  # (batch size, draft length) -> median ms per decode step
    mean_tokens: dict[int, float]  # draft length -> tokens a row emits per step
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per (row, step) at the full length
    padded: bool = True  # steps pad to graph buckets (costs of sizes between buckets are the bucket's)

    def schedule(self, max_batch: int, min_gain: float = 0.02) -> list[tuple[int, int, int]]:
        return schedule_from_costs(self.step_ms, self.mean_tokens, max_batch, padded=self.padded, min_gain=min_gain)

    def table(self) -> list[dict]:
        """One row per (batch size, k): ms per step, tokens per row per step, tokens per ms (all rows)."""
        return [{"batch_size": b, "k": k, "step_ms": ms, "mean_tokens": self.mean_tokens.get(k),
                 "tokens_per_ms": b * self.mean_tokens[k] / ms if k in self.mean_tokens and ms > 0 else None}
                for (b, k), ms in sorted(self.step_ms.items())]


@torch.inference_mode()
def _draft_lengths(engine: SpecEngine, node_counts, prompts: list[list[int]]) -> tuple[int, bool, tuple[int, ...]]:
    """(the engine's full draft length, whether it drafts chains, the lengths to calibrate: `node_counts` or every
    0..n for chains, 0 and n for trees); ServeError for empty prompts or a length the engine cannot run."""
    n_full = engine.num_nodes
    chains = verifies_shorter(engine.drafter)
    counts = tuple(sorted(set(node_counts if node_counts is not None else
                              (range(n_full + 1) if chains else {0, n_full}))))
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ServeError("calibration needs non-empty prompts")
    if any(k < 0 or k > n_full or (not chains and k not in (0, n_full)) for k in counts):
        raise ServeError(f"draft lengths {counts} must lie in 0..{n_full} (trees: 0 or {n_full})")
    return n_full, chains, counts


@torch.inference_mode()  # capture_graphs makes the step buffers under inference mode; the steps must write them so
def calibrate(engine: SpecEngine, prompts: list[list[int]], batch_sizes: tuple[int, ...],
              node_counts: tuple[int, ...] | None = None, *, steps: int = 8, warmup: int = 2,
              max_prompt_len: int = 128, max_len: int | None = None) -> Calibration:
    """Time `steps` decode steps (after `warmup` untimed ones) for every batch size and draft length; ServeError for
    bad arguments (before any work). node_counts: the draft lengths to time (default every 0..N for chains, {0, N}
    for trees). Prompts are cut to their last max_prompt_len tokens and cycled over the rows. max_len: KV slots per
    row (give the serving runs' own, so that steps attend over the same span and a serving loop with max(batch_sizes)
    rows reuses the cache and its graphs; default: what one length's steps need); a row that would outgrow it
    restarts from its prompt between lengths."""
    from workbench.serving.loop import make_cache

    n_full, chains, counts = _draft_lengths(engine, node_counts, prompts)
    if not batch_sizes or min(batch_sizes) < 1 or steps < 1 or warmup < 0:
        raise ServeError(f"calibration needs batch sizes >= 1 and steps >= 1 (got {batch_sizes}, steps={steps})")
    prompts = [p[-max_prompt_len:] for p in prompts]
    rows = max(batch_sizes)
    bs = engine.config.kv_block_size
    grow = (warmup + steps) * (n_full + 1)  # positions one length's steps can add to a row
    need = max(len(p) for p in prompts) + grow + n_full + 2
    max_len = max_len or need
    if need > max_len or max_len > engine.max_context():
        raise ServeError(f"calibration needs {need} KV slots per row (max_len {max_len}, the target's context "
                         f"{engine.max_context()}): fewer steps or shorter prompts")
    max_len = -(-max_len // bs) * bs
    cache = make_cache(engine, rows, max_len, rows * (max_len // bs))
    engine.setup_rows(cache, max_len)
    engine.capture_graphs(rows, node_counts=counts, max_prefill_tokens=max(len(p) for p in prompts))
    timer = PhaseTimer(engine.device, False)
    tokens_host: list[list[int] | None] = [None] * (rows + 1)
    gen = torch.Generator(device=engine.device).manual_seed(engine.config.seed)
    wants_hidden = engine.drafter is not None and engine.drafter.wants_hidden

    def start(row: int) -> None:
        if tokens_host[row] is not None:
            engine.release_row(row)
        prompt = prompts[row % len(prompts)]
        logits, hidden = engine.prefill_row(row, prompt, 0)
        first = int(next_token(logits.unsqueeze(0), engine.config.sampling, gen)[0])
        engine.start_row(row, prompt, first, hidden if wants_hidden else None)
        tokens_host[row] = prompt + [first]

    step_ms: dict[tuple[int, int], float] = {}
    accepted: list[int] = []
    for b in sorted(set(batch_sizes)):
        live = list(range(b))
        for row in live:  # afresh: a draft model's KV is behind after autoregressive steps
            start(row)
        for k in sorted(counts, reverse=True):  # the full length first, on fresh rows: its acceptance counts
            for row in live:
                if len(tokens_host[row]) + grow + n_full + 2 > max_len:
                    start(row)
            times = []
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                out = engine.decode_step(live, tokens_host, timer, num_nodes=k)
                times.append((time.perf_counter() - t0) * 1e3)
                if k == n_full and i >= warmup:
                    accepted.extend(out.accepted)
            step_ms[(b, k)] = statistics.median(times[warmup:])
    for row in range(rows):
        if tokens_host[row] is not None:
            engine.release_row(row)
    mean_tokens = {k: 1 + (sum(min(a, k) for a in accepted) / len(accepted) if accepted and k else 0.0)
                   for k in counts}
    return Calibration(step_ms, mean_tokens, accepted, padded=engine.config.graphs.fixed_shape)


# ---- loop calibration -------------------------------------------------------------------------------------------
@dataclass
class LoopCalibration:
    tokens_per_s: dict[tuple[int, int], float]  # (concurrency b, draft length k) -> output tokens/s, measured
    skipped: list[tuple[int, int]]  # (b, k) left out for the budget
    wall_s: float  # the whole calibration, graph captures included
    min_gain: float = MIN_GAIN
    iterations: list = field(default_factory=list)  # the runs' IterationLogs: every k, for the replay's cost fit
    shape: str = DEFAULT_SHAPE  # loop_schedule's: "sticky", "monotone" (k never grows with the batch size) or "free"
    runs: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # every run's tokens/s; the median counts
    # one k for every batch size (schedules.uniform_choice): the engine's drafter keeps its own KV and full overlap
    # applies, so a schedule mixing drafting and non-drafting sizes would lose it (`uniform_schedules`)
    uniform: bool = False

    def schedule(self, max_batch: int, shape: str | None = None) -> list[tuple[int, int, int]]:
        return loop_schedule(self.tokens_per_s, max_batch, self.min_gain, shape or self.shape, self.uniform)

    def table(self) -> list[dict]:
        """One row per (batch size, k): output tokens/s (None: skipped for the budget) and whether it was chosen."""
        chosen = choose(self.tokens_per_s, self.min_gain, self.shape, self.uniform)
        rows = [{"batch_size": b, "k": k, "tokens_per_s": rate, "chosen": chosen.get(b) == k,
                 **({"runs": len(self.runs[(b, k)]), "tokens_per_s_min": min(self.runs[(b, k)]),
                     "tokens_per_s_max": max(self.runs[(b, k)])} if len(self.runs.get((b, k), ())) > 1 else {})}
                for (b, k), rate in self.tokens_per_s.items()]
        rows += [{"batch_size": b, "k": k, "tokens_per_s": None, "skipped": True} for b, k in self.skipped]
        return sorted(rows, key=lambda r: (r["batch_size"], r["k"]))


def uniform_schedules(engine: SpecEngine, policy: str = "no_evict", tuning: ServeTuning = ServeTuning()) -> bool:
    """Whether the loop calibration gives this engine one draft length for every batch size: its drafter keeps its
    own KV (a draft model) and the serving loop would launch steps ahead (tuning.full_overlap, no_evict, an engine
    that can), which it does only when every step drafts or none does. Each calibration point runs one k for all
    sizes, so it has full overlap; a mixed schedule built from those points would not. (A draft model's chain reads
    the device exactly where the engine's greedy fused accept runs, so the engine's settings decide, before the
    drafter is set up: `SpecEngine.can_launch_ahead` once it is.)"""
    from workbench.serving import loop

    return (loop.keeps_draft_kv(engine.drafter) and tuning.full_overlap and policy == "no_evict"
            and engine._fused_accept(engine._chains()))


def calibrate_loop(engine: SpecEngine, prompts: list[list[int]], batch_sizes: tuple[int, ...],
                   node_counts: tuple[int, ...] | None = None, *, max_new_tokens: int, max_num_seqs: int,
                   requests_per_size: int = 3, budget_s: float = 60.0, min_gain: float = MIN_GAIN,
                   measure: Callable[[int, int], float] | None = None, gc_freeze: bool = True,
                   shape: str = DEFAULT_SHAPE, repeats: int = 1, tuning: ServeTuning = ServeTuning(),
                   **serve_kwargs) -> LoopCalibration:
    """Output tokens/s of a short closed-loop serve per (batch size b, draft length k): max_concurrency = b,
    requests_per_size x b requests cycling `prompts` (max_new_tokens each), the first b warm-up (left out of the
    rate). Every run uses max_num_seqs rows, so it shares the serving run's cache and graphs (captured once, before
    the first run, for every k). Runs go in passes over every (b, k), b by b and k by k; `repeats` > 1 makes that
    many passes and the median of each point's runs counts (one short run can be 20 % off). A
    run that would end past `budget_s` (judged by the longest run so far) is skipped, so a tight budget still measures
    every batch size once before any is repeated (measured b by b, it would leave the largest sizes out);
    a (b, k) none of whose runs fit is listed. `measure(b, k) -> tokens/s` replaces the serve (tests); gc_freeze: each
    run with the heap frozen (loop.frozen_gc), like serve-bench's measured run. tuning: how the loop runs (give the
    served run's, so that each point is measured, and the schedule shaped, as that run will serve). serve_kwargs go
    to `ServingLoop` (policy, num_blocks, prefill_chunk, prefix_caching). ServeError for bad arguments, before any
    work."""
    from workbench.serving import metrics
    from workbench.serving.loop import RealClock, ServingLoop, frozen_gc
    from workbench.serving.request import Request

    n_full, chains, counts = _draft_lengths(engine, node_counts, prompts)
    if not batch_sizes or min(batch_sizes) < 1 or max(batch_sizes) > max_num_seqs:
        raise ServeError(f"calibration batch sizes must lie in 1..max_num_seqs={max_num_seqs}, got {batch_sizes}")
    if requests_per_size < 2:
        raise ServeError(f"requests_per_size must be >= 2 (one round of warm-up requests, then measured ones), "
                         f"got {requests_per_size}")
    if not budget_s > 0:
        raise ServeError(f"calibration budget must be > 0 s, got {budget_s}")
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ServeError(f"calibration repeats must be a whole number >= 1, got {repeats!r}")
    t_begin = time.perf_counter()
    captured, iterations = [], []

    def serve(b: int, k: int) -> float:
        reqs = [Request(i, list(prompts[i % len(prompts)]), max_new_tokens, 0.0, measured=i >= b)
                for i in range(requests_per_size * b)]
        loop = ServingLoop(engine, reqs, max_num_seqs=max_num_seqs, max_concurrency=b, clock=RealClock(),
                           adaptive=AdaptiveSpeculation(n_full, [(1, max_num_seqs, k)]), tuning=tuning,
                           **serve_kwargs)
        if engine.config.graphs.fixed_shape and not captured:  # every length, before the first timed run
            engine.capture_graphs(max_num_seqs, node_counts=counts, max_prefill_tokens=max(len(p) for p in prompts))
            captured.append(True)
        with frozen_gc(gc_freeze):
            res = loop.run()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        iterations.extend(res.iterations)
        return metrics.summarize(res)["output_throughput"]

    measure = measure or serve
    runs: dict[tuple[int, int], list[float]] = {}
    longest = 0.0
    for _ in range(repeats):
        for b in sorted(set(batch_sizes)):
            for k in counts:
                if time.perf_counter() - t_begin + longest > budget_s:
                    continue
                t0 = time.perf_counter()
                runs.setdefault((b, k), []).append(measure(b, k))
                longest = max(longest, time.perf_counter() - t0)
    tokens_per_s = {key: statistics.median(rates) for key, rates in runs.items()}
    skipped = [(b, k) for b in sorted(set(batch_sizes)) for k in counts if (b, k) not in runs]
    return LoopCalibration(tokens_per_s, skipped, time.perf_counter() - t_begin, min_gain, iterations, shape, runs,
                           uniform=uniform_schedules(engine, serve_kwargs.get("policy", "no_evict"), tuning))
