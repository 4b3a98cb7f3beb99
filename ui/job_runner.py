"""`python -m ui.job_runner <job dir>`: runs one job's command and records its output, progress and exit.

Started by `ui.jobs.start_job` as the leader of a new process group. It reads `meta.json`, runs `argv`, copies the
command's stdout and stderr into log.txt (stdout also into out.txt), keeps progress.json current, and writes exit.json
when the command ends. SIGTERM (a cancel: `killpg` reaches the command too) is recorded as a cancellation; a command
that ignores it is killed after a grace period; after a cancelled study job it runs the study's stale-trial sweep, so
no trial of the killed worker stays RUNNING. Never imports streamlit: it starts in milliseconds.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ui.jobs import _read_json, parse_progress, progress_message, write_json_atomic

GRACE_S = 5.0


def _pump(stream, sinks: list, lock: threading.Lock, on_line) -> None:
    """Copy a pipe into files; split on \\n and \\r so tqdm-style redraws count as lines."""
    pending = b""
    while True:
        chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
        if not chunk:
            break
        with lock:
            for sink in sinks:
                sink.write(chunk)
                sink.flush()
        pending += chunk
        parts = pending.replace(b"\r", b"\n").split(b"\n")
        pending = parts.pop()
        for part in parts:
            if part.strip():
                on_line(part.decode(errors="replace"))
    if pending.strip():
        on_line(pending.decode(errors="replace"))


def _sweep_study(meta: dict, log) -> None:
    """After a cancelled study job: fail and re-queue the trial a worker could not clean up itself (it ignored
    SIGTERM past the grace period and was killed). `studies.worker --sweep` leaves live workers' trials alone."""
    params = meta.get("params") or {}
    if meta.get("kind") != "study" or not params.get("study") or not params.get("storage"):
        return
    argv = [sys.executable, "-m", "studies.worker", "--storage", params["storage"], "--study", params["study"],
            "--sweep"]
    log.flush()
    try:
        subprocess.run(argv, cwd=meta.get("cwd"), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                       timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.write(f"stale-trial sweep failed: {exc}\n".encode())


def main(job_dir: str) -> int:
    job_dir = Path(job_dir)
    meta = _read_json(job_dir / "meta.json")
    cancelled = threading.Event()

    def on_term(signum, frame):
        cancelled.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    progress = {"fraction": None, "text": "starting", "updated_at": time.time()}
    write_json_atomic(job_dir / "progress.json", progress)
    last_write = [0.0]

    def on_line(line: str) -> None:
        fraction = parse_progress(line)
        if fraction is not None:
            progress["fraction"] = fraction
        message = progress_message(line)
        if message is None and fraction is None:
            return  # a result object on stdout, not progress
        if message is not None:
            progress["text"] = message[-300:]
        progress["updated_at"] = time.time()
        if time.time() - last_write[0] > 0.2 or fraction is not None:
            write_json_atomic(job_dir / "progress.json", progress)
            last_write[0] = time.time()

    returncode = -1
    with open(job_dir / "log.txt", "ab") as log, open(job_dir / "out.txt", "ab") as out:
        try:
            child = subprocess.Popen(meta["argv"], cwd=meta.get("cwd"), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            log.write(f"could not start {meta['argv'][0]}: {exc}\n".encode())
            write_json_atomic(job_dir / "exit.json", {"returncode": 127, "cancelled": False,
                                                     "ended_at": time.time()})
            return 1
        lock = threading.Lock()
        pumps = [threading.Thread(target=_pump, args=(child.stdout, [log, out], lock, on_line), daemon=True),
                 threading.Thread(target=_pump, args=(child.stderr, [log], lock, on_line), daemon=True)]
        for t in pumps:
            t.start()
        term_sent_at = None
        while True:
            try:
                returncode = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if cancelled.is_set():
                if term_sent_at is None:
                    term_sent_at = time.time()
                    child.terminate()  # usually already sent by killpg; harmless twice
                elif time.time() - term_sent_at > GRACE_S:
                    child.kill()
        for t in pumps:
            t.join(timeout=2.0)
        if cancelled.is_set():
            log.write(b"\n[cancelled]\n")
            _sweep_study(meta, log)
    write_json_atomic(job_dir / "progress.json", progress)
    write_json_atomic(job_dir / "exit.json", {"returncode": returncode, "cancelled": cancelled.is_set(),
                                             "ended_at": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
