"""The engine of `workbench serve` in a process of its own (the default, as vLLM splits its API server from its engine
core): the HTTP event loop and the engine thread no longer share one interpreter lock, so neither waits for the
other's Python. The parent (uvicorn's event loop) and the child talk over one pipe:

    parent -> child   ("spec", spec) once; then ("submit", id, prompt, max_tokens, ignore_eos), ("abort", id,
                      reason), ("metrics", rid), ("stop",)
    child -> parent   ("ready", ServedModel) or ("failed", message) once; then ("events", [(id, event), ...]) once
                      per engine step (EngineWorker's batched sinks: one message per pass, not one per request),
                      ("reply", rid, prometheus text)

    engine = EngineProcess(spec)          # spec: {"session": BenchSession.load kwargs, "cfg": ServeConfig, ...}
    served = engine.launch()              # the child loads the models and captures its graphs; ServeError if not
    app = create_app(engine, served)      # engine.start() runs in the app's lifespan, on its event loop

The child runs the worker's loop on its one thread, reading the pipe between iterations (PipeWorker). It leaves when
the parent says stop or the pipe closes (the parent died); when it is gone the parent fails the open requests with
503 and /health answers 503. The child ignores SIGINT and SIGTERM: Ctrl-C or a SIGTERM to the process group reaches
the parent (uvicorn) too, whose graceful shutdown lets open streams finish, then stops the child; SIGKILL ends both.
"""
from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from workbench.serving.config import ServeError
from workbench.serving.worker import EngineWorker, Job

log = logging.getLogger("workbench.serve")

ENDED = ("done", "error")  # the events after which a job gets no other


class PipeSink:
    """A job's events for the parent process: the worker holds one pass's events and posts them in one message."""

    __slots__ = ("channel", "key")

    def __init__(self, channel: "PipeWorker", key: int):
        self.channel, self.key = channel, key

    @staticmethod
    def post(worker: "PipeWorker", items: list) -> None:
        worker.conn.send(("events", items))
        for key, event in items:
            if event[0] in ENDED:
                worker.keys.pop(key, None)


class _Reply:
    """The box an engine-thread call ("call", fn, box) puts its result in: sent to the parent as a reply."""

    def __init__(self, conn, rid: int):
        self.conn, self.rid = conn, rid

    def put(self, result: tuple) -> None:
        ok, value = result
        if not ok:
            log.error("a /metrics read failed in the engine process: %s", value)
        self.conn.send(("reply", self.rid, value if ok else b""))


class PipeWorker(EngineWorker):
    """The EngineWorker of the child process: its loop runs on the process's one thread and reads the pipe between
    iterations (no second thread, so nothing waits for an interpreter lock)."""

    def __init__(self, loop_factory, metrics=None, *, eos_token_ids=(), conn=None):
        super().__init__(loop_factory, metrics, eos_token_ids=eos_token_ids)
        self.conn = conn
        self.keys: dict = {}  # the parent's job id -> Job, until the job's last event went out

    def _receive(self, block: bool) -> list[tuple]:
        cmds = []
        try:
            if block:
                self.conn.poll(None)
            while self.conn.poll():
                cmd = self._command(self.conn.recv())
                if cmd is not None:
                    cmds.append(cmd)
        except (EOFError, OSError):  # the parent is gone
            cmds.append(("stop",))
        return cmds

    def _command(self, msg: tuple) -> tuple | None:
        if msg[0] == "submit":
            _, key, prompt, max_tokens, ignore_eos = msg
            job = self.keys[key] = Job(next(self._ids), prompt, max_tokens, PipeSink(self, key), ignore_eos)
            return ("submit", job)
        if msg[0] == "abort":
            job = self.keys.pop(msg[1], None)
            return ("abort", job, msg[2]) if job is not None else None
        if msg[0] == "metrics":
            return ("call", self.metrics_text, _Reply(self.conn, msg[1]))
        return ("stop",)


def engine_main(conn) -> None:
    """The child process: its spec from the pipe, load, report ready (or failed), serve the pipe's commands until
    told to stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the parent's shutdown stops this process, after open streams end
        signal.signal(sig, signal.SIG_IGN)
    try:
        _, spec = conn.recv()
    except (EOFError, OSError):  # the parent is gone already
        return
    from workbench.harness.bench import BenchError, BenchSession
    from workbench.serving.server import build_worker

    try:
        if spec.get("threads"):
            import torch

            torch.set_num_threads(spec["threads"])
        session = BenchSession.load(**spec["session"])
        worker, served = build_worker(session, spec["cfg"], max_model_len=spec.get("max_model_len", 0),
                                      name=spec.get("name"), version=spec.get("version"),
                                      worker=functools.partial(PipeWorker, conn=conn))
    except (BenchError, ServeError) as e:
        conn.send(("failed", str(e)))
        return
    except Exception as e:  # a bug: the parent shows it, the traceback goes to this process's stderr
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        raise
    served.info["engine_process"] = True
    conn.send(("ready", served))
    worker.run()  # until the parent says stop or the pipe closes
    gc.unfreeze()  # gc_freeze's heap back to the collector: the interpreter's exit frees it (no leak reports)


class EngineProcess:
    """The parent's side: what `create_app` calls a worker (start, stop, alive, submit, abort, prometheus_text),
    with the EngineWorker in a child process. submit's sink must be a LoopSink on the app's event loop."""

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
        # a fresh interpreter (no fork: the child initialises CUDA itself), started as a module, not through
        # multiprocessing's spawn, which would rerun this process's __main__ in it
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the workbench package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *(p for p in sys.path if p)])}  # this one's imports
        self.proc = subprocess.Popen([sys.executable, "-m", "workbench.serving.engine_proc", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self._send(("spec", self.spec))
        if not self.conn.poll(self.start_timeout_s):
            self._kill()
            raise ServeError(f"the engine process was not ready within {self.start_timeout_s:.0f} s")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            self._wait(5)
            raise ServeError(f"the engine process exited (status {self.proc.returncode}) before it was ready; its "
                             "error is above") from None
        if msg[0] == "failed":
            self._wait(10)
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
        return self._alive and self.proc is not None and self.proc.poll() is None

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
            log.error("the engine process exited (status %s); open requests fail", self.proc.poll())
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
        self._wait(timeout)
        self._gone()
        self._kill()
        self.conn.close()

    def _wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def _kill(self) -> None:
        if self.proc.poll() is None:  # it ignores SIGTERM (its parent's shutdown stops it): SIGKILL, the last resort
            self.proc.kill()
            self._wait(5)


if __name__ == "__main__":  # the child: python -m workbench.serving.engine_proc FD (EngineProcess.launch)
    engine_main(Connection(int(sys.argv[1])))
