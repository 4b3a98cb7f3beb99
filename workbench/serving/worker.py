"""The engine thread of `workbench serve`: one thread owns the open-ended serving loop; HTTP handlers talk to it
through a thread-safe inbox and get their tokens back through a sink per request: a callable (run on the engine
thread), or a LoopSink (an asyncio queue and its event loop: the events of one pass over the jobs reach each event
loop in one call_soon_threadsafe, so the HTTP thread wakes once per engine step, not once per request and step).

    worker = EngineWorker(lambda: ServingLoop(engine, [], max_len=2048, ...), metrics, eos_token_ids=(0,))
    worker.start()
    job = worker.submit(prompt_ids, max_tokens=16, sink=LoopSink(asyncio.get_running_loop(), queue))
    worker.abort(job)                                                # the client left: its row and blocks go back
    worker.stop()

Events a job's sink receives, in order: ("accepted",) once the loop queued it, ("tokens", [ids]) any number of
times, then one ("done", finish_reason); or one ("error", status, message, code) instead, at any point. finish_reason is
"length" (max_tokens reached) or "stop" (the model's end-of-sequence token, left out of the tokens, unless
ignore_eos). A job aborted by its client gets no further event.

Between two iterations the thread admits what arrived (`ServingLoop.submit`, a request that can never fit gets a
400 error event), applies aborts (`ServingLoop.abort`), runs one iteration (`ServingLoop.step`) and hands each live
job the tokens it emitted; a first token goes out the moment the loop reads it (`ServingLoop.first_token_hook`). A
failure inside an iteration fails the jobs in flight (500) and starts a fresh loop over the same engine, so the
server keeps serving.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable

from workbench.serving.config import RequestTooLargeError, ServeError
from workbench.serving.request import Request, RequestState

log = logging.getLogger("workbench.serve")


class LoopSink:
    """A job's events for an asyncio.Queue owned by the event loop `aloop` (the HTTP handler's). The engine thread
    holds the events of one pass over its jobs and posts them to each event loop in one `call_soon_threadsafe`: one
    wake-up of the HTTP thread per engine step, not one per job and step."""

    __slots__ = ("aloop", "queue")

    def __init__(self, aloop, queue):
        self.aloop, self.queue = aloop, queue

    @property
    def channel(self):  # the sinks of one event loop share one post per pass
        return self.aloop

    @property
    def key(self):
        return self.queue

    @staticmethod
    def post(aloop, items: list) -> None:
        aloop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list) -> None:  # on the event loop's thread
    for q, event in items:
        q.put_nowait(event)


@dataclass
class Job:
    """One HTTP request's generation: what the engine thread knows of it."""
    id: int
    prompt: list[int]
    max_tokens: int
    sink: "Callable[[tuple], None] | LoopSink"  # a callable runs on the engine thread and must not block; a batched
    # sink (not callable) has .channel, .key and .post(channel, [(key, event)]): its events go out once per pass
    ignore_eos: bool = False
    state: RequestState | None = None  # set once the loop accepted it
    sent: int = 0  # tokens handed to the sink so far
    emits: int = 0  # emission events seen so far (ITL is measured between them)
    ended: bool = False
    finish_reason: str | None = None


@dataclass
class SpecCounters:
    """The engine's own counts over finished and aborted requests (drafted / accepted summed from their
    RequestStates once they left the loop)."""
    requests: int = 0
    drafted: int = 0
    accepted: int = 0
    output_tokens: int = 0
    by_reason: dict = field(default_factory=dict)


class EngineWorker:
    """See the module docstring. loop_factory() -> a ServingLoop; it is `open`ed here (and again after a failure)."""

    def __init__(self, loop_factory: Callable, metrics=None, *, eos_token_ids: tuple[int, ...] = ()):
        self.loop_factory, self.metrics, self.eos_token_ids = loop_factory, metrics, frozenset(eos_token_ids)
        self.loop = self._open_loop()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: dict[int, Job] = {}  # live jobs, engine thread only
        self._leaving: list[RequestState] = []  # ended jobs' requests not yet out of the loop (a step in flight)
        self.counters = SpecCounters()
        self.failures = 0  # iterations that raised (each one restarted the loop)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._outbox: dict = {}  # channel -> (post, [(key, event)]) held for one post per pass (batched sinks)

    def _open_loop(self):
        loop = self.loop_factory()
        loop.open()
        loop.first_token_hook = self._first_token
        return loop

    # -- called from any thread -------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread (once; a second call does nothing)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self.run, name="workbench-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.inbox.put(("stop",))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    def submit(self, prompt: list[int], max_tokens: int, sink: Callable[[tuple], None], *,
               ignore_eos: bool = False) -> Job:
        job = Job(next(self._ids), list(prompt), max_tokens, sink, ignore_eos)
        self.inbox.put(("submit", job))
        return job

    def abort(self, job: Job, reason: str = "abort") -> None:
        """The client left (or a stop string ended it): the job's request is dropped, its blocks freed."""
        self.inbox.put(("abort", job, reason))

    async def prometheus_text(self) -> bytes | None:
        """The metrics as Prometheus text, the pool's gauges read on the engine thread (on the caller's event loop);
        None when this worker keeps no metrics."""
        if self.metrics is None:
            return None
        if not self.alive:  # the pool's gauges as last read
            from prometheus_client import generate_latest

            return generate_latest(self.metrics.registry)
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self.call(self.metrics_text))

    def metrics_text(self, loop) -> bytes:
        """On the engine thread, between iterations: the pool's gauges read from `loop`, then the Prometheus text."""
        from prometheus_client import generate_latest

        self.metrics.set_pool(loop)
        return generate_latest(self.metrics.registry)

    def call(self, fn: Callable, timeout: float = 30.0):
        """fn(loop) run on the engine thread between iterations (a consistent read of the loop); its result."""
        box: queue.SimpleQueue = queue.SimpleQueue()
        self.inbox.put(("call", fn, box))
        ok, value = box.get(timeout=timeout)
        if not ok:
            raise value
        return value

    # -- the engine thread ------------------------------------------------------------------------------------
    def _receive(self, block: bool) -> list[tuple]:
        """The commands that arrived; block: wait for the first (the loop is idle)."""
        cmds = [self.inbox.get()] if block else []
        while True:
            try:
                cmds.append(self.inbox.get_nowait())
            except queue.Empty:
                return cmds

    def run(self) -> None:
        """The engine's loop, until a stop command (on the thread `start` made, or on the caller's)."""
        try:
            while True:
                cmds = self._receive(block=not self.loop.busy)  # idle: sleep until something arrives
                if not self._apply(cmds):
                    return
                self._flush()  # "accepted" and 400s go out before the step
                if not self.loop.busy:
                    continue
                try:
                    traces = self.loop.step()
                except Exception as e:  # a bug or a device error: fail what is in flight, keep serving
                    self._fail_all(e)
                    self._flush()
                    continue
                self._publish(traces)
                self._flush()
        finally:
            self._stopped.set()
            for job in list(self.jobs.values()):
                self._end(job, ("error", 503, "the server is shutting down"), None)
            self._flush()

    def _apply(self, cmds: list[tuple]) -> bool:
        for cmd in cmds:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "submit":
                job = cmd[1]
                try:
                    job.state = self.loop.submit(Request(job.id, job.prompt, job.max_tokens))
                except ServeError as e:  # too long for a row or the pool, empty, ...: the client's to fix
                    job.ended = True
                    code = "context_length_exceeded" if isinstance(e, RequestTooLargeError) else None
                    self._send(job, ("error", 400, f"a prompt of {len(job.prompt)} tokens with max_tokens "
                                     f"{job.max_tokens} cannot be served: {e}", code))
                    continue
                self.jobs[job.id] = job
                self._send(job, ("accepted",))
            elif cmd[0] == "abort":
                job, reason = cmd[1], cmd[2]
                if job.id in self.jobs and not job.ended:
                    self.loop.abort(job.state)
                    self._end(job, None, reason)
            elif cmd[0] == "call":
                try:
                    cmd[2].put((True, cmd[1](self.loop)))
                except Exception as e:  # handed back to the caller's thread
                    cmd[2].put((False, e))
        return True

    def _publish(self, traces) -> None:
        if self.metrics is not None:
            self.metrics.observe_steps(traces)
        self._count_left()
        for job in list(self.jobs.values()):
            s = job.state
            new = s.output[job.sent:]
            if self.metrics is not None:
                if job.emits == 0 and s.t_first_token is not None:
                    self.metrics.ttft.observe(s.t_first_token - s.t_arrival)
                for a, b in zip(s.emit_times[max(0, job.emits - 1):], s.emit_times[max(1, job.emits):]):
                    self.metrics.itl.observe(b - a)
            job.emits = len(s.emit_times)
            reason = "length" if s.phase == "done" else None
            eos = [i for i, t in enumerate(new) if t in self.eos_token_ids] if not job.ignore_eos else []
            if eos:
                new = new[:eos[0]]
                reason = "stop"
                if s.phase != "done":
                    self.loop.abort(s)
            if new:
                job.sent += len(new)
                self._send(job, ("tokens", new))
            if reason is not None:
                self._end(job, ("done", reason), reason)

    def _first_token(self, s: RequestState) -> None:
        """The loop read `s`'s first token: it goes out now, not after the rest of the iteration (the drafter's
        prefill of the row, the other rows' bookkeeping), so a client's TTFT is the loop's. An end-of-sequence first
        token is left to `_publish`, which ends the job."""
        job = self.jobs.get(s.req.id)
        if job is None or job.ended or job.sent or not s.output:
            return
        if not job.ignore_eos and s.output[0] in self.eos_token_ids:
            return
        job.sent = 1
        self._send(job, ("tokens", s.output[:1]))
        self._flush()

    def _end(self, job: Job, event: tuple | None, reason: str | None) -> None:
        """The job leaves: its last event sent (None: its client is gone), its counts and latencies recorded."""
        job.ended, job.finish_reason = True, reason
        self.jobs.pop(job.id, None)
        s = job.state
        if reason is not None and s is not None:
            c = self.counters
            c.requests += 1
            c.output_tokens += job.sent
            c.by_reason[reason] = c.by_reason.get(reason, 0) + 1
            self._leaving.append(s)
            self._count_left()
            if self.metrics is not None:
                self.metrics.finished(s, job.sent, reason, self.loop.clock.now())
        if event is not None:
            self._send(job, event)

    def _count_left(self) -> None:
        """Drafted / accepted of requests that left the loop; one aborted under a step in flight leaves after that
        step is read (its tokens count: the engine verified them)."""
        still = []
        for s in self._leaving:
            if s.phase in ("done", "aborted"):
                self.counters.drafted += s.drafted
                self.counters.accepted += s.accepted
            else:
                still.append(s)
        self._leaving = still

    def _fail_all(self, e: Exception) -> None:
        self.failures += 1
        log.error("serving iteration failed; the jobs in flight fail and the loop restarts:\n%s",
                  "".join(traceback.format_exception(e)))
        for job in list(self.jobs.values()):
            self._end(job, ("error", 500, f"the engine failed while serving this request: {type(e).__name__}: {e}"),
                      None)
        self._leaving = []
        self.loop = self._open_loop()  # a fresh loop resets the engine's rows and the pool

    def _send(self, job: Job, event: tuple) -> None:
        if not callable(job.sink):  # a batched sink (LoopSink, engine_proc's PipeSink): held for one post per pass
            self._outbox.setdefault(job.sink.channel, (job.sink.post, []))[1].append((job.sink.key, event))
            return
        try:
            job.sink(event)
        except Exception as e:  # the client's event loop is gone (server shutting down): nobody to tell
            log.debug("dropped an event for job %d: %s", job.id, e)

    def _flush(self) -> None:
        """Posts the held events of batched sinks: one post per channel (an event loop, a pipe), in the order they
        were sent."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for channel, (post, items) in outbox.items():
            try:
                post(channel, items)
            except (RuntimeError, OSError) as e:  # that event loop or pipe is closed (shutting down): nobody to tell
                log.debug("dropped %d events for a closed channel: %s", len(items), e)
