"""The engine of `workbench serve` in a process of its own (the default, as vLLM splits its API server from its engine
core): the HTTP event loop and the engine thread no longer share one interpreter lock, so neither waits for the
other's Python. The parent (uvicorn's event loop) and the child talk over one pipe:

    parent -> child   ("submit", id, prompt, max_tokens, ignore_eos), ("abort", id, reason), ("metrics", rid),
                      ("stop",)
    child -> parent   ("ready", ServedModel) or ("failed", message) once; then ("events", [(id, event), ...]) once
                      per engine step (EngineWorker's batched sinks: one message per pass, not one per request),
                      ("reply", rid, prometheus text)

    engine = EngineProcess(spec)          # spec: {"session": BenchSession.load kwargs, "cfg": ServeConfig, ...}
    served = engine.launch()              # the child loads the models and captures its graphs; ServeError if not
    app = create_app(engine, served)      # engine.start() runs in the app's lifespan, on its event loop

The child leaves when the parent says stop, when the pipe closes (the parent died) or when its engine thread stopped;
the parent then fails the open requests with 503 and /health answers 503. The child ignores SIGINT: Ctrl-C reaches
the parent (uvicorn), whose shutdown stops the child.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import signal
import threading

from workbench.serving.config import ServeError

log = logging.getLogger("workbench.serve")

ENDED = ("done", "error")  # the events after which a job gets no other


class PipeSink:
    """A job's events for the parent process: EngineWorker holds one pass's events and posts them in one message."""

    __slots__ = ("channel", "key")

    def __init__(self, channel, key: int):
        self.channel, self.key = channel, key

    @staticmethod
    def post(channel, items: list) -> None:
        channel.send(("events", items))


class _Channel:
    """The child's end of the pipe: sends from the engine thread and the main thread, one at a time; forgets a job
    once its last event went out."""

    def __init__(self, conn, jobs: dict):
        self.conn, self.jobs, self.lock = conn, jobs, threading.Lock()

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.conn.send(msg)
        if msg[0] == "events":
            for key, event in msg[1]:
                if event[0] in ENDED:
                    self.jobs.pop(key, None)


def engine_main(conn, spec: dict) -> None:
    """The child process: load, report ready (or failed), serve the pipe's commands until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from workbench.harness.bench import BenchError, BenchSession
    from workbench.serving.server import build_worker

    try:
        if spec.get("threads"):
            import torch

            torch.set_num_threads(spec["threads"])
        session = BenchSession.load(**spec["session"])
        worker, served = build_worker(session, spec["cfg"], max_model_len=spec.get("max_model_len", 0),
                                      name=spec.get("name"), version=spec.get("version"))
    except (BenchError, ServeError) as e:
        conn.send(("failed", str(e)))
        return
    except Exception as e:  # a bug: the parent shows it, the traceback goes to this process's stderr
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        raise
    served.info["engine_process"] = True
    jobs: dict = {}
    channel = _Channel(conn, jobs)
    channel.send(("ready", served))
    worker.start()
    try:
        while worker.alive:
            if not conn.poll(1.0):
                continue
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                return
            if msg[0] == "submit":
                _, key, prompt, max_tokens, ignore_eos = msg
                job = jobs[key] = worker.submit(prompt, max_tokens, PipeSink(channel, key), ignore_eos=ignore_eos)
                if job.ended:  # refused (400) before it was filed here: its last event may be out already
                    jobs.pop(key, None)
            elif msg[0] == "abort":
                job = jobs.pop(msg[1], None)
                if job is not None:
                    worker.abort(job, msg[2])
            elif msg[0] == "metrics":
                from prometheus_client import generate_latest

                if worker.alive:
                    worker.call(worker.metrics.set_pool)
                channel.send(("reply", msg[1], generate_latest(worker.metrics.registry)))
            elif msg[0] == "stop":
                return
    finally:
        worker.stop()


class EngineProcess:
    """The parent's side: what `create_app` calls a worker (start, stop, alive, submit, abort, prometheus_text),
    with the EngineWorker in a child process. submit's sink must be a LoopSink on the app's event loop."""

    metrics = None  # the child keeps the metrics: /metrics asks it (prometheus_text)

    def __init__(self, spec: dict, *, start_timeout_s: float = 1800.0):
        self.spec, self.start_timeout_s = spec, start_timeout_s
        self.proc = self.conn = None
        self._queues: dict = {}  # job id -> its asyncio queue (until its last event)
        self._replies: dict = {}  # request id -> future
        self._ids = itertools.count()
        self._aloop = None
        self._alive = False
        self._stopping = False

    def launch(self):
        """Starts the child and waits until its engine is ready: its ServedModel. ServeError if it failed."""
        ctx = multiprocessing.get_context("spawn")  # no fork: the child initialises CUDA itself
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(child, self.spec), name="workbench-engine", daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(self.start_timeout_s):
            self._kill()
            raise ServeError(f"the engine process was not ready within {self.start_timeout_s:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise ServeError(f"the engine process exited (status {self.proc.exitcode}) before it was ready; its "
                             "error is above") from None
        if msg[0] == "failed":
            self.proc.join(10)
            raise ServeError(msg[1])
        self._alive = True
        return msg[1]

    # -- on the app's event loop --------------------------------------------------------------------------------
    def start(self) -> None:
        if self.proc is None:
            self.launch()
        self._aloop = asyncio.get_running_loop()
        self._aloop.add_reader(self.conn.fileno(), self._readable)

    @property
    def alive(self) -> bool:
        return self._alive and self.proc is not None and self.proc.is_alive()

    def submit(self, prompt: list[int], max_tokens: int, sink, *, ignore_eos: bool = False) -> int:
        key = next(self._ids)
        if not self._alive:
            sink.queue.put_nowait(("error", 503, "the engine process is not running; restart the server"))
            return key
        self._queues[key] = sink.queue
        self._send(("submit", key, list(prompt), max_tokens, ignore_eos))
        return key

    def abort(self, key: int, reason: str = "abort") -> None:
        if self._queues.pop(key, None) is not None:
            self._send(("abort", key, reason))

    async def prometheus_text(self) -> bytes:
        if not self._alive:
            return b""
        rid = next(self._ids)
        fut = self._replies[rid] = self._aloop.create_future()
        self._send(("metrics", rid))
        return await asyncio.wait_for(fut, 60)

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):  # the child is gone
            self._gone()

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                msg = self.conn.recv()
                if msg[0] == "events":
                    for key, event in msg[1]:
                        q = self._queues.get(key)
                        if q is not None:
                            q.put_nowait(event)
                            if event[0] in ENDED:
                                del self._queues[key]
                elif msg[0] == "reply":
                    fut = self._replies.pop(msg[1], None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg[2])
        except (EOFError, OSError):
            self._gone()

    def _gone(self) -> None:
        """The child exited (or its pipe broke): open requests get a 503, /health a 503."""
        if not self._alive:
            return
        self._alive = False
        if not self._stopping:
            log.error("the engine process exited (status %s); open requests fail", self.proc.exitcode)
        if self._aloop is not None:
            self._aloop.remove_reader(self.conn.fileno())
        for q in self._queues.values():
            q.put_nowait(("error", 503, "the engine process exited; restart the server"))
        self._queues.clear()
        for fut in self._replies.values():
            if not fut.done():
                fut.set_result(b"")
        self._replies.clear()

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        self._stopping = True
        if self._alive:
            self._send(("stop",))
        self.proc.join(timeout)
        self._gone()
        self._kill()

    def _kill(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
