"""The serving loop: requests arrive and leave between steps; one engine iteration at a time.

One iteration, as named phases:
    arrive   requests whose arrival time has come (and, with max_concurrency, for which there is room) join the queue
    admit    the scheduler gives queued requests a cache row (preempted ones first, then by arrival); with prefix
             caching their leading prompt blocks are looked up and shared
    reserve  (max_util) blocks for every decoding row's next step; when short, preempt the most recently admitted
    plan     up to `prefill_chunk` prompt tokens (0 = all), oldest admitted first, counting the blocks of the step
             about to run (max_util: preempting younger requests when short, before any step is in flight)
    decode   one step over every decoding row (draft -> verify -> accept -> kv; `SpecEngine.launch_step`, read by
             `finish_step`), the draft length per row from the adaptive rules; rows that reach max_new_tokens leave
             (row and blocks released)
    prefill  the planned chunks, in forwards of up to `batch_prefill` rows; a request whose prefill completes gets its
             first token (or keeps its root, after a preemption) and decodes from the next iteration

How the loop itself runs is the run's ServeTuning (workbench/serving/tuning.py; knob `serve_tuning`, recorded in the
serve-bench row): by default (`overlap_prefill`) the prefill is enqueued behind the step in flight and read after it,
so the host plans and launches it while the GPU runs the step; off, the step is read before the prefill is planned.
`full_overlap` (on by default where it applies) launches each step before the previous one is read (see
`ServingLoop.__init__`).

Adaptive speculation changes the draft length between steps at no extra cost when the engine's graphs for every
length it can ask for were captured first (`AdaptiveSpeculation.node_counts`, `SpecEngine.capture_graphs`). A draft
model keeps its own KV. When a request's prefill completes and every step drafts (a fixed k:
`AdaptiveSpeculation.drafts_always`), the draft model is prefilled there too (in the prefill phase); otherwise it is
left empty (the batch a request joins says little about the batch it decodes at: a wave of joins sees itself alone),
and a step that does not draft leaves it behind. Before a row's next draft the loop writes only the positions it
misses (`SpecEngine.catch_up_drafter`; counted in `ServeResult.draft_catch_up_tokens`), grouped by gap
(`catch_up_groups`) so that one long gap never pads the short ones of every other behind row; only rows that draft
are caught up, so a request served only by autoregressive steps never runs the draft model, and a batch size whose k
is 0 costs what speculation off costs there. `catch_up_max` (knob `spec_catch_up_max`) keeps a row that decoded more
than that many tokens at k = 0 autoregressive when the batch dips into a drafting size (no whole-context catch-up
for a dip). A loop over an engine whose cache has this run's shape reuses it
(and the graphs captured for it): `SpecEngine.reset_rows`.

Time comes from a clock: `RealClock` (perf_counter, sleeps until the next arrival when idle) for benchmarks,
`StepClock` (one unit per iteration) for tests, so arrival orders are exact and nothing sleeps.
"""
from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from workbench.engine.sampling import next_token
from workbench.engine.step import HostCopy, LaunchedStep, PhaseTimer, SpecEngine, cap_emitted
from workbench.serving.adaptive import AdaptiveSpeculation
from workbench.serving.config import RequestTooLargeError, ServeError
from workbench.serving.prefix_cache import PrefixCachingKVCache
from workbench.serving.request import Request, RequestState
from workbench.serving.scheduler import CapacityScheduler
from workbench.serving.tuning import ServeTuning


class RealClock:
    def __init__(self):
        self.start()

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def sleep_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def tick(self) -> None:
        pass


class StepClock:
    """Deterministic time: `dt` per iteration; idle waits jump to the next arrival."""

    def __init__(self, dt: float = 1.0):
        self.t, self.dt = 0.0, dt

    def start(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def tick(self) -> None:
        self.t += self.dt


@contextmanager
def frozen_gc(enabled: bool = True):
    """Collect, then freeze the heap (gc.freeze) for the block and unfreeze after: the collector's gen-2 passes never
    rescan the engine's and the caller's long-lived objects inside a timed run (new garbage is still collected)."""
    if not enabled:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass
class IterationLog:
    t_start: float
    t_end: float
    batch_size: int  # decoding rows in this iteration's step (0: no step)
    num_nodes: int  # draft nodes verified per row (0: autoregressive or no step)
    prefill_tokens: int
    used_blocks: int
    preempted: int
    # the work besides the step, as the replay's cost model reads it (workbench/serving/replay.py)
    prefill_forwards: int = 0  # target prefill forwards (one per request chunk)
    draft_prefill_tokens: int = 0  # draft-model positions prefilled at join (prefill phase)
    draft_prefills: int = 0  # those prefills' forwards (one per joining request)
    catch_up_tokens: int = 0  # draft-model positions written by catch-up forwards before this iteration's step
    catch_up_slots: int = 0  # rows x T of those forwards (padding included): >= catch_up_tokens
    catch_up_forwards: int = 0


@dataclass
class StepTrace:
    """Per (request, decode step): what the replay and the acceptance breakdowns read."""
    request: int
    step: int  # the iteration that read the step (its tokens reached the host at that iteration's end)
    batch_size: int
    k: int  # draft tokens this row was allowed
    num_nodes: int
    context_len: int
    drafted: int
    accepted: int
    emitted: int  # tokens kept (capped by max_new_tokens)
    step_ms: float


@dataclass
class ServeResult:
    states: list[RequestState]
    iterations: list[IterationLog] = field(default_factory=list)
    traces: list[StepTrace] = field(default_factory=list)
    phase_ms: dict[str, float] = field(default_factory=dict)
    num_blocks: int = 0
    preemptions: int = 0
    prefix_hit_rate: float | None = None
    max_used_blocks: int = 0
    draft_catch_up_tokens: int = 0  # draft-model KV positions written after steps that did not draft
    draft_catch_up_forwards: int = 0  # draft-model forwards those took
    draft_catch_up_slots: int = 0  # rows x T of those forwards (padding included): >= draft_catch_up_tokens
    draft_prefill_tokens: int = 0  # draft-model KV positions prefilled when a request joined (prefill phase)
    draft_catch_up_skips: int = 0  # row-steps that would have drafted but were further behind than catch_up_max
    draft_prefills: int = 0  # draft-model prefill forwards at join (one per request whose draft was prefilled)
    prefill_forwards: int = 0  # target prefill forwards (one per request chunk)
    draft_kv: bool = False  # the drafter keeps its own KV (a draft model): prefill at join and catch-up apply
    batch_prefill: int = 1  # the most prefill chunks per forward in this run (tuning.batch_prefill, at least 1)
    full_overlap: bool = False  # steps launched before the previous one was read (tuning.full_overlap, where it can)
    overlap: str = "none"  # what ran beside a step in flight: "full", "prefill" (tuning.overlap_prefill) or "none"
    tuning: ServeTuning = ServeTuning()  # how the loop ran, resolved (the serve-bench row's serve_tuning)
    steps_ahead: int = 0  # steps launched while another was in flight

    @property
    def outputs(self) -> dict[int, list[int]]:
        return {s.req.id: s.output for s in self.states}


CATCH_UP_SHORT = 8  # catch-up gaps up to this many tokens share one forward (a few skipped steps' worth)


def verifies_shorter(drafter) -> bool:
    """Whether a step may verify fewer than the drafter's N nodes (adaptive lengths 0..N), else 0 or N only: chains
    can (EAGLE's K = 1 and ReDrafter's W = 1 included), trees and beams cannot."""
    return drafter is None or drafter.proposes_chains


def keeps_draft_kv(drafter) -> bool:
    """Whether the drafter keeps a KV cache of its own that a step without drafts leaves behind (a draft model; not
    EAGLE-style heads, which read the target's hidden states, nor lookups)."""
    return drafter is not None and drafter.model_forwards_per_step > 0 and not drafter.wants_hidden


@dataclass
class _Decoding:
    """An iteration's step between its launch and its read."""
    decoding: list[RequestState]
    live: list[int]
    ks: list[int]
    n: int
    current: list[bool]
    step: LaunchedStep
    it: int = 0  # the iteration that launched it


def catch_up_groups(gaps: list[int], short: int = CATCH_UP_SHORT) -> list[list[int]]:
    """Indices of behind rows grouped into catch-up forwards (each forward runs T = its largest gap for every row
    in it): gaps <= short together, longer ones by power-of-two class (short x 2^(j-1), short x 2^j], so a row is
    padded by at most `short` tokens or less than its own gap, never to another row's prompt.

    >>> catch_up_groups([200, 2, 1, 2, 150, 40])
    [[1, 2, 3], [5], [0, 4]]
    """
    classes: dict[int, list[int]] = {}
    for i, g in enumerate(gaps):
        classes.setdefault(0 if g <= short else math.ceil(math.log2(g / short)), []).append(i)
    return [classes[j] for j in sorted(classes)]


def _work(result: ServeResult) -> tuple[int, ...]:
    """The run's work counters in IterationLog's order (prefill_forwards .. catch_up_forwards): an iteration's
    are the difference across it."""
    return (result.prefill_forwards, result.draft_prefill_tokens, result.draft_prefills,
            result.draft_catch_up_tokens, result.draft_catch_up_slots, result.draft_catch_up_forwards)


def make_cache(engine: SpecEngine, max_rows: int, max_len: int, num_blocks: int) -> PrefixCachingKVCache:
    """The target's paged pool for serving (prefix-caching capable), with the engine's attention backend."""
    from workbench.engine.kv_cache import resolve_attention, set_kernels

    cfg, tcfg = engine.config, engine.target.config
    if not cfg.paged:
        raise ServeError("serving needs the paged KV cache (its block pool is what the scheduler manages)")
    cache = PrefixCachingKVCache(tcfg.num_hidden_layers, tcfg.num_key_value_heads, tcfg.head_dim, max_rows, max_len,
                                 engine.dtype, engine.device, block_size=cfg.kv_block_size, num_blocks=num_blocks)
    if resolve_attention(cfg.attention, True, engine.device) == "triton":
        set_kernels(cache)
    return cache


class ServingLoop:
    """Serves `requests` (their arrival times set) on `engine` until every one is done. See the module docstring."""

    def __init__(self, engine: SpecEngine, requests: list[Request], *, policy: str = "no_evict",
                 num_blocks: int = 0, max_num_seqs: int = 16, prefill_chunk: int = 0, prefix_caching: bool = False,
                 adaptive: AdaptiveSpeculation | None = None, max_concurrency: int = 0, clock=None,
                 timing: bool = False, max_len: int = 0, catch_up_max: int = 0, tuning: ServeTuning = ServeTuning()):
        if not requests and not max_len:
            raise ServeError("no requests to serve (an open-ended loop, `open`, needs max_len: its rows' length)")
        if any(len(r.prompt) == 0 for r in requests):
            raise ServeError("empty prompt: every request needs at least one prompt token")
        drafter = engine.drafter
        if prefix_caching and drafter is not None and drafter.wants_hidden:
            raise ServeError(f"prefix caching with method {drafter.name!r} is not supported: the drafter needs the "
                             "target's hidden states of the whole prompt, which shared blocks skip; turn "
                             "--prefix-caching off")
        self.engine, self.requests = engine, sorted(requests, key=lambda r: (r.arrival_s, r.id))
        if not isinstance(tuning, ServeTuning):
            raise ServeError(f"tuning must be a ServeTuning (workbench/serving/tuning.py), got "
                             f"{type(tuning).__name__}: parse the serve_tuning text with parse_serve_tuning")
        self.tuning = tuning
        self.n_nodes = engine.num_nodes
        self.chains = verifies_shorter(drafter)  # else whole or not at all
        bs = engine.config.kv_block_size
        # KV slots per row: what the longest request needs, or more (max_len: share the cache of a longer run)
        longest = max((len(r.prompt) + r.max_new_tokens for r in requests), default=0)
        max_len = max(max_len, longest + self.n_nodes + 2)
        max_len = math.ceil(max_len / bs) * bs
        held = engine.cache  # reused when it has this run's shape, or (automatic pool) at least its length
        if not num_blocks and isinstance(held, PrefixCachingKVCache) and held.max_rows == max_num_seqs and \
                held.block_size == bs and held.max_len >= max_len and \
                held.num_blocks == held.max_len // bs * max_num_seqs:
            max_len = held.max_len
        worst = math.ceil(max_len / bs)
        self.num_blocks = num_blocks or worst * max_num_seqs
        self.scheduler = CapacityScheduler(policy, self.num_blocks, bs, self.n_nodes, max_len)
        for r in self.requests:  # before any work: a request that can never fit is a named error
            self.check_request(r)
        self.max_num_seqs, self.prefill_chunk, self.prefix_caching = max_num_seqs, prefill_chunk, prefix_caching
        self.adaptive = adaptive or AdaptiveSpeculation(k=self.n_nodes, tree=not self.chains)
        self.max_concurrency = max_concurrency
        self.clock = clock or RealClock()
        self.timer = PhaseTimer(engine.device, timing)
        cache = engine.cache
        if isinstance(cache, PrefixCachingKVCache) and (cache.max_rows, cache.max_len, cache.num_blocks,
                                                        cache.block_size) == (max_num_seqs, max_len, self.num_blocks, bs):
            self.cache = cache  # the same shape as the last run's: keep it and the graphs captured over it
            cache.queried_tokens = cache.hit_tokens = 0
            engine.reset_rows()
        else:
            self.cache = make_cache(engine, max_num_seqs, max_len, self.num_blocks)
            engine.setup_rows(self.cache, max_len)
        self.tokens_host: list[list[int] | None] = [None] * (max_num_seqs + 1)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        # a draft model keeps its own KV: steps that skip drafting leave it behind (caught up before the next draft)
        self._own_draft_kv = keeps_draft_kv(drafter)
        self._draft_valid: dict[int, int] = {}  # row -> positions below which the draft model's KV is valid
        # prefill a draft model at join only where every step drafts; else its first draft catches it up (a request
        # that joins while its batch is at k = 0 then never runs the draft model, as with speculation off)
        self._prefill_draft_at_join = not self._own_draft_kv or self.adaptive.drafts_always(max_num_seqs)
        if catch_up_max < 0:
            raise ServeError(f"catch_up_max must be >= 0 (0 = no limit), got {catch_up_max}")
        self.catch_up_max = catch_up_max
        # full overlap (tuning.full_overlap): step t + 1 launched before step t is read, as `generate`'s overlapped
        # loop does, so the host's bookkeeping, the joins and the next plan run while the GPU computes. Only where the
        # device step needs nothing from the host read: greedy chains with the fused accept and a drafter that reads
        # the device (`SpecEngine.can_launch_ahead`), and no_evict (no preemption under a step in flight). A row that
        # could reach max_new_tokens in the step in flight skips the next one (never released under a step).
        # A draft model with its own KV launches ahead only where no catch-up can come (catch-up reads exact lengths):
        # every step drafts, or none does (a schedule at k = 0 everywhere serves as speculation off, at its speed)
        self.full_overlap = (self.tuning.full_overlap and engine.can_launch_ahead() and policy == "no_evict"
                             and (not self._own_draft_kv or self.adaptive.drafts_always(max_num_seqs)
                                  or self.adaptive.never_drafts(max_num_seqs)))
        self._inflight: _Decoding | None = None  # full overlap: the step launched and not yet read
        self._queued = 0  # requests waiting for a row after this iteration's admissions (spec_off_queue)
        # called (on the loop's thread) with a request's state as soon as its first token is read, before the rest of
        # the iteration (the drafter's prefill of the row, the step's bookkeeping): a server sends it at once
        self.first_token_hook: Callable[[RequestState], None] | None = None

    def check_request(self, r: Request) -> None:
        """ServeError (RequestTooLargeError when it is too long) for a request this loop could never serve."""
        if not r.prompt:
            raise ServeError(f"request {r.id}: empty prompt: every request needs at least one prompt token")
        if r.max_new_tokens < 1:
            raise ServeError(f"request {r.id}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
        self.scheduler.check(r)
        if len(r.prompt) + r.max_new_tokens + self.n_nodes + 2 > self.engine.max_context():
            raise RequestTooLargeError(
                f"request {r.id} needs {len(r.prompt) + r.max_new_tokens + self.n_nodes + 2} positions, more than "
                f"the target's context {self.engine.max_context()}: lower --max-new-tokens or the prompt length")

    # -- the loop -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self) -> ServeResult:
        states = [RequestState(r) for r in self.requests]
        pending = list(states)
        waiting: list[RequestState] = []
        self.running: list[RequestState] = []
        result = self._new_result(states)
        self._inflight, self._queued = None, 0
        it = 0
        self.clock.start()  # arrival times count from here (after any graph capture)
        while pending or waiting or self.running:
            now = self.clock.now()
            in_system = len(waiting) + len(self.running)
            while pending and pending[0].req.arrival_s <= now and (
                    not self.max_concurrency or in_system < self.max_concurrency):
                s = pending.pop(0)
                s.phase, s.t_arrival = "waiting", max(now, s.req.arrival_s) if self.max_concurrency else \
                    s.req.arrival_s
                waiting.append(s)
                in_system += 1
            if not waiting and not self.running:
                self.clock.sleep_until(pending[0].req.arrival_s)
                continue
            self._iteration(waiting, it, result)
            it += 1
        result.phase_ms = self.timer.resolve()
        result.preemptions = self.scheduler.preemptions
        result.prefix_hit_rate = self.cache.hit_rate if self.prefix_caching else None
        return result

    def _new_result(self, states: list[RequestState]) -> ServeResult:
        return ServeResult(states, num_blocks=self.num_blocks, draft_kv=self._own_draft_kv,
                           batch_prefill=max(1, self.tuning.batch_prefill), full_overlap=self.full_overlap,
                           overlap="full" if self.full_overlap else "prefill" if self.tuning.overlap_prefill
                           else "none", tuning=self.tuning)

    # -- open-ended serving: requests come from outside (a server), between iterations ---------------------------
    def open(self) -> ServeResult:
        """Starts an open-ended run: no closed list of arrivals (the loop's `requests` are ignored); `submit` queues a
        request, `step` runs one iteration, `abort` drops a request. The run keeps no history (a server runs for
        days): `step` returns the traces it read and the result's traces and iterations stay empty."""
        self.running: list[RequestState] = []
        self._waiting: list[RequestState] = []
        self._aborting: list[RequestState] = []
        self._it = 0
        self._inflight, self._queued = None, 0
        self._open = self._new_result([])
        self.clock.start()
        return self._open

    def submit(self, req: Request) -> RequestState:
        """Queues `req` (arriving now); ServeError (RequestTooLargeError) for one this loop could never serve."""
        self.check_request(req)
        s = RequestState(req, phase="waiting", t_arrival=self.clock.now())
        self._waiting.append(s)
        return s

    def abort(self, s: RequestState) -> None:
        """Drops `s`: off the queue, or its row and blocks released, now or (a step in flight over its row, full
        overlap) at the next iteration boundary; it decodes no further step either way. A finished one stays done."""
        if s.phase in ("done", "aborted") or s.aborted:
            return
        s.aborted = True
        self._aborting.append(s)
        self._drop_aborted()

    def _drop_aborted(self) -> None:
        in_flight = set(self._inflight.live) if self._inflight is not None else set()
        keep = []
        for s in self._aborting:
            if s.phase == "done":
                continue
            if s.phase == "waiting":
                self._waiting.remove(s)
            elif s.row in in_flight:
                keep.append(s)
                continue
            else:
                self._release(s)
            s.phase = "aborted"
        self._aborting = keep

    @property
    def busy(self) -> bool:
        """Whether the open-ended run has work: a queued or running request (or one whose abort waits for a step)."""
        return bool(self._waiting or self.running or self._aborting)

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    @torch.inference_mode()
    def step(self) -> list[StepTrace]:
        """One iteration of the open-ended run (nothing when idle); the traces of the steps it read."""
        self._drop_aborted()
        if not self._waiting and not self.running:
            return []
        result = self._open
        self._iteration(self._waiting, self._it, result)
        self._it += 1
        traces = list(result.traces)
        result.traces.clear()
        result.iterations.clear()
        self._drop_aborted()
        return traces

    def _iteration(self, waiting: list[RequestState], it: int, result: ServeResult) -> None:
        """One iteration over the queue and the running rows: admit, (reserve), plan, decode, prefill; logged."""
        t_start = self.clock.now()
        preempted_before = self.scheduler.preemptions
        work_before = _work(result)
        self._admit(waiting)
        self._queued = len(waiting)  # requests still waiting for a row: the adaptive rules' queue (spec_off_queue)
        decoding = [s for s in self.running if s.phase == "decode" and not s.aborted]
        if decoding and self.scheduler.policy == "max_util":
            decoding = self._reserve(decoding, waiting)
        step_nodes = 0
        traces_before = len(result.traces)
        if self.full_overlap:  # step t + 1 launched before step t is read
            decoding, step_nodes, ran = self._iterate_ahead(waiting, it, result)
        elif self.tuning.overlap_prefill:  # the prefill enqueued behind the step in flight; one wait for both
            planned, decoding = self._plan_prefill(waiting, decoding)
            launched = self._decode_launch(decoding, it, result) if decoding else None
            ran = self._run_prefill(planned, result)
            if launched is not None:
                step_nodes = self._decode_finish(launched, result)
        else:  # the step read before the prefill is planned (it plans with the blocks the step gave back)
            if decoding:
                step_nodes = self._decode_finish(self._decode_launch(decoding, it, result), result)
            planned, _ = self._plan_prefill(waiting, [])
            ran = self._run_prefill(planned, result)
        prefilled = self._finish_prefill(ran, result)
        self.clock.tick()
        t_end = self.clock.now()
        for tr in result.traces[traces_before:]:  # the step read in this iteration (full overlap: the last one's)
            tr.step_ms = (t_end - t_start) * 1e3
        used = self.cache.used_blocks
        result.max_used_blocks = max(result.max_used_blocks, used)
        work = [a - b for a, b in zip(_work(result), work_before)]
        result.iterations.append(IterationLog(t_start, t_end, len(decoding), step_nodes, prefilled, used,
                                              self.scheduler.preemptions - preempted_before, *work))

    # -- phases -------------------------------------------------------------------------------------------------
    def _admit(self, waiting: list[RequestState]) -> None:
        while waiting and self.free_rows:
            s = waiting[0]
            tokens = s.prefill_tokens
            hits: list[int] = []
            if self.prefix_caching:
                # a fresh request recomputes at least its last prompt token (its logits give the first token)
                max_hit = (len(tokens) - 1) // self.cache.block_size if not s.output else \
                    len(tokens) // self.cache.block_size
                hits = self.cache.match(tokens, max_hit)
            if not self.scheduler.can_admit(s, self.cache.free_blocks, len(hits)):
                if self.prefix_caching:  # not admitted: this lookup does not count
                    self.cache.queried_tokens -= len(tokens)
                    self.cache.hit_tokens -= len(hits) * self.cache.block_size
                break
            waiting.pop(0)
            row = self.free_rows.pop()
            self.cache.attach(row, hits)
            s.row, s.phase, s.prefilled = row, "prefill", len(hits) * self.cache.block_size
            s.prefix_hit_tokens += s.prefilled
            s.hidden = []
            if s.t_admitted is None:
                s.t_admitted = self.clock.now()
            self.scheduler.admitted(s)
            self.running.append(s)

    def _preempt(self, s: RequestState, waiting: list[RequestState]) -> None:
        self.engine.release_row(s.row)
        self.free_rows.append(s.row)
        self.tokens_host[s.row] = None
        self._draft_valid.pop(s.row, None)
        self.scheduler.released(s)
        self.scheduler.preemptions += 1
        self.running.remove(s)
        s.row, s.phase, s.prefilled, s.preemptions = None, "waiting", 0, s.preemptions + 1
        s.hidden = []
        waiting.insert(0, s)  # recomputed first when blocks free up

    def _blocks_for(self, s: RequestState, upto: int) -> int:
        have = len(self.cache._host_table[s.row])
        return max(0, math.ceil(upto / self.cache.block_size) - have)

    def _reserve(self, decoding: list[RequestState], waiting: list[RequestState]) -> list[RequestState]:
        """max_util: free blocks for every decoding row's step (root + N nodes), preempting the newest."""
        while True:
            need = sum(self._blocks_for(s, len(self.tokens_host[s.row]) + self.n_nodes) for s in decoding)
            if need <= self.cache.free_blocks:
                return decoding
            victim = self.scheduler.victim(self.running)
            self._preempt(victim, waiting)
            decoding = [s for s in decoding if s is not victim]

    def _iterate_ahead(self, waiting: list[RequestState], it: int, result: ServeResult
                       ) -> tuple[list[RequestState], int, tuple]:
        """One iteration with full overlap: plan and run the prefill (behind the step in flight), launch the next
        step over the decoding rows (their lengths bounded by what the step in flight can emit), then read the step
        in flight. Returns (the rows of the step launched, its draft nodes, the prefill's run for `_finish_prefill`,
        which starts the rows whose prefill completed): the iteration's log describes the step it launched."""
        inflight = self._inflight
        ahead = {row: 1 + inflight.n for row in inflight.live} if inflight is not None else {}
        # a row that could reach max_new_tokens in the step in flight skips this one: it is never released (nor its
        # blocks reused) while a step over it runs, and no step is spent on a finished request
        decoding = [s for s in self.running if s.phase == "decode" and not s.aborted
                    and len(s.output) + ahead.get(s.row, 0) < s.req.max_new_tokens]
        planned, decoding = self._plan_prefill(waiting, decoding, ahead)
        ran = self._run_prefill(planned, result)
        launched = self._decode_launch(decoding, it, result, ahead) if decoding else None
        if launched is not None and inflight is not None:
            result.steps_ahead += 1
        if inflight is not None:
            self._decode_finish(inflight, result, launched, it)
        self._inflight = launched
        return decoding, launched.n if launched is not None else 0, ran

    def _decode_launch(self, decoding: list[RequestState], it: int, result: ServeResult,
                       ahead: dict[int, int] | None = None) -> _Decoding:
        """The iteration's step over the decoding rows, enqueued (`SpecEngine.launch_step`): per-row draft lengths
        from the adaptive rules, behind draft models caught up first. ahead (full overlap): per row in the step in
        flight, the most tokens that step can add; the step is then launched on those upper bounds."""
        eng = self.engine
        live = [s.row for s in decoding]
        exact = [len(self.tokens_host[r]) - 1 for r in live]
        contexts = exact if ahead is None else [c + ahead.get(r, 0) for r, c in zip(live, exact)]
        batch_k = self.adaptive.batch_k(len(live), self._queued)
        ks = [self.adaptive.row_k(s, c, batch_k) for s, c in zip(decoding, contexts)]
        if not self.chains:  # trees are verified whole or not at all (also under rules built without tree=True)
            ks = [self.n_nodes if k else 0 for k in ks]
        if self._own_draft_kv and self.catch_up_max and any(ks):
            # a row whose draft model missed more than catch_up_max generated tokens (it decoded that long at k = 0)
            # stays autoregressive: its whole-context catch-up for a dip of the batch into a drafting size rarely
            # pays; missing only the prompt, it catches up as a fixed k would have prefilled it at its join
            for j, (s, row, c) in enumerate(zip(decoding, live, exact)):
                if ks[j] and c - 1 - max(self._draft_valid[row], len(s.req.prompt)) > self.catch_up_max:
                    ks[j] = 0
                    result.draft_catch_up_skips += 1
        n = max(ks) if self.n_nodes else 0
        if n and self._own_draft_kv:  # only the rows that draft: the others' drafts are masked out anyway
            self._catch_up([row for row, k in zip(live, ks) if k], result)
        row_nodes = None if all(k == n for k in ks) else ks
        current = [self._draft_valid.get(row, 0) >= c - 1 for row, c in zip(live, exact)]
        step = eng.launch_step(live, self.tokens_host, self.timer, num_nodes=n, row_nodes=row_nodes,
                               lengths=contexts if ahead is not None else None)
        return _Decoding(decoding, live, ks, n, current, step, it)

    def _decode_finish(self, d: _Decoding, result: ServeResult, launched: _Decoding | None = None,
                       it: int | None = None) -> int:
        """Waits for the launched step's read; the rows' tokens and counters; rows that reach max_new_tokens
        leave. Returns the step's draft nodes. launched (full overlap): the step launched since, whose rows must
        not leave here; it: the iteration reading it (its traces' `step`: when the tokens reached the host), else
        the one that launched it."""
        decoding, live, ks, n, current = d.decoding, d.live, d.ks, d.n, d.current
        it = d.it if it is None else it
        contexts = [len(self.tokens_host[r]) - 1 for r in live]  # exact now (steps are read in launch order)
        out = self.engine.finish_step(d.step, self.timer, keep=self.full_overlap)
        if n and self._own_draft_kv:  # the chain wrote [t_(L-1), root] and its drafts: valid up to the new root,
            for row, a, cur in zip(live, out.accepted, current):  # unless all n were accepted (the last draft was
                if not cur:  # never fed); a row still behind keeps its hole below t_(L-1) for a later catch-up
                    continue
                new_root = len(self.tokens_host[row]) - 1
                self._draft_valid[row] = new_root if a < n else new_root - 1
        t = self.clock.now()
        for j, s in enumerate(decoding):
            room = s.req.max_new_tokens - len(s.output)
            kept = cap_emitted(out.emitted[j], room)
            s.output.extend(kept)
            s.emit_times.append(t)
            s.steps += 1
            s.drafted += out.drafted[j]
            s.accepted += out.accepted[j]
            self.adaptive.record(s, out.accepted[j], out.drafted[j])
            result.traces.append(StepTrace(s.req.id, it, len(live), ks[j], n, contexts[j], out.drafted[j],
                                           out.accepted[j], len(kept), 0.0))
            if s.finished:
                if launched is not None and s.row in launched.live:
                    raise AssertionError(f"request {s.req.id} finished while a later step over row {s.row} is in "
                                         "flight (the loop's max_new_tokens bound failed)")
                self._finish(s, t)
        return n

    def _catch_up(self, live: list[int], result: ServeResult) -> None:
        """Rows whose draft KV is behind what the next chain needs (valid below L - 1, L the root's index; the chain
        itself feeds L - 1 and L): write the missing positions, one forward per group of similar gaps."""
        behind = [(row, self._draft_valid[row], len(self.tokens_host[row]) - 2) for row in live
                  if self._draft_valid[row] < len(self.tokens_host[row]) - 2]
        if not behind:
            return
        for group in catch_up_groups([e - s for _, s, e in behind]):
            rows, starts, ends = (list(x) for x in zip(*(behind[i] for i in group)))
            with self.timer.phase("draft"):
                self.engine.catch_up_drafter(rows, starts, ends)
            result.draft_catch_up_tokens += sum(e - s for s, e in zip(starts, ends))
            result.draft_catch_up_forwards += 1
            result.draft_catch_up_slots += len(rows) * max(e - s for s, e in zip(starts, ends))
            for row, end in zip(rows, ends):
                self._draft_valid[row] = end

    def _finish(self, s: RequestState, t: float) -> None:
        s.phase, s.t_done = "done", t
        self._release(s)

    def _release(self, s: RequestState) -> None:
        """The request leaves its row: its blocks, its row and its reservation given back."""
        self.engine.release_row(s.row)
        self.free_rows.append(s.row)
        self.tokens_host[s.row] = None
        self._draft_valid.pop(s.row, None)
        self.scheduler.released(s)
        self.running.remove(s)
        s.row = None

    def _plan_prefill(self, waiting: list[RequestState], decoding: list[RequestState],
                      ahead: dict[int, int] | None = None
                      ) -> tuple[list[tuple[RequestState, list[int], int]], list[RequestState]]:
        """Each prefilling request's chunk this iteration, oldest first: (request, what it prefills, chunk length),
        and `decoding` less the requests preempted here. Blocks a planned chunk will take count as taken for the next
        one's check, and so do those of the step about to run over `decoding` (planned before it is launched, so a
        preemption never frees a row while a step over it is in flight). max_util preempts younger requests for
        blocks; no_evict reserved every admitted request's worst case, so its chunks always fit."""
        budget = self.prefill_chunk or math.inf
        planned: list[tuple[RequestState, list[int], int]] = []
        promised = 0

        ahead = ahead or {}

        def step_blocks() -> int:  # what the step over `decoding` may take (root + N nodes per row, past what a step
            # in flight may add: full overlap)
            return sum(self._blocks_for(d, len(self.tokens_host[d.row]) + ahead.get(d.row, 0) + self.n_nodes)
                       for d in decoding)
        for s in sorted((s for s in self.running if s.phase == "prefill"), key=lambda s: s.admit_seq):
            if budget <= 0:
                break
            if s.phase != "prefill":  # preempted below by an older request's chunk
                continue
            tokens = s.prefill_tokens
            t = int(min(len(tokens) - s.prefilled, budget))
            if t > 0:
                need = self._blocks_for(s, s.prefilled + t)
                while need > self.cache.free_blocks - promised - step_blocks():
                    victim = self.scheduler.victim(self.running, older_than=s.admit_seq)
                    if victim is None:
                        break
                    self._preempt(victim, waiting)
                    decoding = [d for d in decoding if d is not victim]
                if need > self.cache.free_blocks - promised - step_blocks():
                    if self.scheduler.policy == "no_evict":  # its worst case was reserved: cannot happen
                        raise AssertionError("no_evict: a reserved request found no free blocks")
                    continue
                promised += need
                budget -= t
            planned.append((s, tokens, t))
        return planned, decoding

    def _run_prefill(self, planned: list[tuple[RequestState, list[int], int]], result: ServeResult
                     ) -> tuple[int, list[tuple], HostCopy | None]:
        """The planned chunks in forwards of up to tuning.batch_prefill rows (one row each when it is 0 or 1); the first
        tokens of requests whose prompt is now all in the cache sampled, and their copy to the host enqueued.
        Returns (tokens prefilled, completed: (request, what it prefilled, sampled or None: it keeps its root),
        the sampled first tokens on their way to the host (a HostCopy, or None))."""
        eng, cfg = self.engine, self.engine.config
        outs: dict[int, torch.Tensor] = {}  # id(request) -> logits [V] at its chunk's last position
        done_tokens = 0
        group = max(1, self.tuning.batch_prefill)
        work = [(s, tokens, t) for s, tokens, t in planned if t > 0]
        for i in range(0, len(work), group):
            batch = work[i:i + group]
            with self.timer.phase("prefill"):
                if len(batch) == 1:
                    s, tokens, t = batch[0]
                    logits, hidden = eng.prefill_row(s.row, tokens[s.prefilled:s.prefilled + t], s.prefilled)
                    logits, hiddens = logits.unsqueeze(0), [hidden]
                else:
                    logits, hiddens = eng.prefill_rows([s.row for s, _, _ in batch],
                                                       [tokens[s.prefilled:s.prefilled + t] for s, tokens, t in batch],
                                                       [s.prefilled for s, _, _ in batch])
            result.prefill_forwards += 1
            for j, (s, tokens, t) in enumerate(batch):
                outs[id(s)] = logits[j]
                if eng.drafter is not None and eng.drafter.wants_hidden:  # a copy: with captured prefill this is a
                    # view of the graph's output, which the next replay (another row, the next chunk) overwrites
                    s.hidden.append(hiddens[j].clone())
                s.prefilled += t
                done_tokens += t
                if self.prefix_caching:
                    self.cache.register(s.row, tokens, s.prefilled)
        completed: list[tuple] = []
        for s, tokens, _ in planned:
            if s.prefilled < len(tokens):
                continue
            # prefill complete: the root is the sampled first token, or (recompute) the token it already had
            completed.append((s, tokens, None if s.output else next_token(outs[id(s)].unsqueeze(0), cfg.sampling,
                                                                          eng.generator)[0]))
        sampled = [first for _, _, first in completed if first is not None]
        # one device->host read for every first token of this iteration: a read per request waited for the GPU once
        # per joining request (0.8-1.8 such syncs per serving iteration on tiny at 1.5x saturation)
        return done_tokens, completed, HostCopy(torch.stack(sampled)) if sampled else None

    def _finish_prefill(self, ran: tuple, result: ServeResult) -> int:
        """Requests whose prompt is now all in the cache get their first token (read here) and start decoding
        (`SpecEngine.start_row`). Returns the tokens prefilled this iteration."""
        eng = self.engine
        done_tokens, completed, firsts = ran
        if not completed:
            return done_tokens
        firsts = iter(firsts.get().tolist() if firsts is not None else [])
        now = self.clock.now()
        for s, tokens, first in completed:
            if first is not None:
                s.output.append(next(firsts))
                s.t_first_token = now
                s.emit_times.append(now)
                if self.first_token_hook is not None:
                    self.first_token_hook(s)
            hidden = torch.cat(s.hidden, 0) if s.hidden else None
            # a draft model is prefilled here when every step drafts (a fixed k); else lazily, by catch-up before
            # the row's first draft (never, if it never drafts)
            draft_now = self._prefill_draft_at_join
            with self.timer.phase("prefill"):
                eng.start_row(s.row, tokens, s.context[-1], hidden, prefill_drafter=draft_now)
            if draft_now and self._own_draft_kv:
                result.draft_prefill_tokens += len(tokens)
                result.draft_prefills += 1
            s.hidden = []
            self.tokens_host[s.row] = list(s.context)
            self._draft_valid[s.row] = len(tokens) if draft_now else 0
            s.phase = "decode"
            if s.finished:
                self._finish(s, now)
        return done_tokens
