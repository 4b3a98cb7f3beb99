"""Background jobs: benchmarks, studies and training run as subprocesses, tracked by a registry on disk.

Each job is one directory `<jobs root>/<job_id>/` (default `results/jobs/`, git-ignored; `$WORKBENCH_JOBS` overrides):

    meta.json      what was started: kind, title, argv, params, runner pid, created_at (+ cancel_requested_at)
    log.txt        the command's stdout and stderr, interleaved as they arrive
    out.txt        its stdout alone (a `--json` CLI prints its result there)
    progress.json  {"fraction": 0.0-1.0 | None, "text": str, "updated_at": float}, parsed from the output
    exit.json      {"returncode": int, "cancelled": bool, "ended_at": float}, written when the command ends

The page never waits on a job: `start_job` launches `python -m ui.job_runner <job dir>` in its own session (its own
process group) and returns at once. The runner starts the command, streams its output into the files above and writes
exit.json. So a browser refresh, or a restart of the Streamlit server, loses nothing; cancel is one `killpg`.
Pages poll `list_jobs` / `Job.status` from an `st.fragment(run_every=...)`. This module never imports streamlit.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

RUNNING, DONE, FAILED, CANCELLED, LOST = "running", "done", "failed", "cancelled", "lost"
FINISHED = (DONE, FAILED, CANCELLED, LOST)

# runner processes started by this server process: polled so finished ones do not linger as zombies
_RUNNERS: dict[str, subprocess.Popen] = {}


def jobs_root() -> Path:
    root = Path(os.environ.get("WORKBENCH_JOBS") or REPO_ROOT / "results" / "jobs")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _pid_alive(pid: int, job_id: str, young: bool = False) -> bool:
    """True when `pid` is a live (not zombie) runner of this job.

    A runner younger than a few seconds may not have exec'd yet (its cmdline is still its parent's), so for a
    young job any live process with that pid counts.
    """
    proc = Path(f"/proc/{pid}")
    if proc.exists():
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False
        state = stat.rsplit(")", 1)[-1].split()[0]
        # pid reuse: the cmdline must name this job
        return state not in ("Z", "X") and (young or job_id in cmdline)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Job:
    id: str
    dir: Path

    @property
    def meta(self) -> dict:
        return _read_json(self.dir / "meta.json") or {}

    @property
    def kind(self) -> str:
        return self.meta.get("kind", "?")

    @property
    def title(self) -> str:
        return self.meta.get("title", self.id)

    @property
    def params(self) -> dict:
        return self.meta.get("params", {})

    def exit_info(self) -> dict | None:
        return _read_json(self.dir / "exit.json")

    def status(self) -> str:
        popen = _RUNNERS.get(self.id)
        if popen is not None and popen.poll() is not None:
            _RUNNERS.pop(self.id, None)
            popen = None
        info = self.exit_info()
        if info is not None:
            if info.get("cancelled"):
                return CANCELLED
            return DONE if info.get("returncode") == 0 else FAILED
        if popen is not None:  # started by this process and not exited (it may not have exec'd yet)
            return RUNNING
        meta = self.meta
        pid = meta.get("pid")
        if pid is None:  # meta written, runner not yet recorded: it is starting
            return RUNNING
        if _pid_alive(int(pid), self.id, young=time.time() - meta.get("created_at", 0) < 10):
            return RUNNING
        # the runner may have written exit.json between our two reads
        info = self.exit_info()
        if info is not None:
            return self.status()
        if meta.get("cancel_requested_at"):  # killed while starting, before it could record its exit
            return CANCELLED
        return LOST

    def progress(self) -> dict:
        """{"fraction": float | None, "text": str}; fraction is 1.0 once the job succeeded."""
        prog = _read_json(self.dir / "progress.json") or {"fraction": None, "text": ""}
        if self.status() == DONE:
            prog["fraction"] = 1.0
        return prog

    def log_tail(self, max_chars: int = 4000) -> str:
        path = self.dir / "log.txt"
        try:
            size = path.stat().st_size
            with path.open("rb") as f:
                f.seek(max(0, size - max_chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stdout(self) -> str:
        try:
            return (self.dir / "out.txt").read_text(errors="replace")
        except OSError:
            return ""

    def result(self) -> dict | list | None:
        """The JSON the command printed on stdout (the whole stdout, or else its last JSON line), if any."""
        return parse_json_output(self.stdout())

    def error_text(self) -> str | None:
        """A short reason for a failed/lost job: the last lines of its log."""
        status = self.status()
        if status == LOST:
            return "The job's process is gone without an exit record (killed, or the machine restarted)."
        if status != FAILED:
            return None
        lines = [ln for ln in self.log_tail(6000).splitlines() if ln.strip()]
        return "\n".join(lines[-12:]) or f"exit code {self.exit_info().get('returncode')}"

    def elapsed_s(self) -> float:
        start = self.meta.get("created_at", time.time())
        info = self.exit_info()
        end = info.get("ended_at", time.time()) if info else time.time()
        return max(0.0, end - start)

    def cancel(self, wait_s: float = 0.0) -> None:
        """Terminate the job's whole process group (the runner escalates to SIGKILL if the command lingers)."""
        if self.status() != RUNNING:
            return
        meta = self.meta
        meta["cancel_requested_at"] = time.time()
        write_json_atomic(self.dir / "meta.json", meta)
        pid = meta.get("pid")
        if pid is None:
            return
        try:
            os.killpg(int(pid), signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.time() + wait_s
        while time.time() < deadline and self.status() == RUNNING:
            time.sleep(0.1)


def parse_json_output(text: str) -> dict | list | None:
    text = text.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def new_job_id(kind: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}-{secrets.token_hex(3)}"


# CPU threads of a job's torch (OMP_NUM_THREADS, unless the caller's environment sets it): half the cores, so the
# dashboard and a second job do not oversubscribe the CPU and turn timings into noise (like `--threads` of studies).
JOB_THREADS = max(1, (os.cpu_count() or 2) // 2)


def start_job(kind: str, argv: list[str], title: str, params: dict | None = None,
              env: dict[str, str] | None = None) -> Job:
    """Launch `argv` (run from the repository root) in the background, with a CPU thread limit (JOB_THREADS);
    returns at once."""
    job_id = new_job_id(kind)
    job_dir = jobs_root() / job_id
    job_dir.mkdir(parents=True)
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # torch reads these when it starts
        child_env.setdefault(var, str(JOB_THREADS))
    meta = {"id": job_id, "kind": kind, "title": title, "argv": [str(a) for a in argv], "params": params or {},
            "cwd": str(REPO_ROOT), "created_at": time.time(), "pid": None}
    write_json_atomic(job_dir / "meta.json", meta)
    with open(job_dir / "runner.log", "ab") as runner_log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "ui.job_runner", str(job_dir)],
            cwd=REPO_ROOT, env=child_env, stdin=subprocess.DEVNULL, stdout=runner_log, stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: cancel = killpg, and it outlives the server
        )
    _RUNNERS[job_id] = popen
    meta["pid"] = popen.pid  # the runner never writes meta.json, so this write cannot race with it
    write_json_atomic(job_dir / "meta.json", meta)
    return Job(job_id, job_dir)


def get_job(job_id: str | None) -> Job | None:
    if not job_id or not re.fullmatch(r"[\w.-]+", job_id):
        return None
    job_dir = jobs_root() / job_id
    return Job(job_id, job_dir) if (job_dir / "meta.json").exists() else None


def list_jobs(kind: str | None = None, status: str | tuple[str, ...] | None = None) -> list[Job]:
    """Jobs newest first, optionally of one kind and/or in the given status(es)."""
    wanted = (status,) if isinstance(status, str) else status
    found = []
    for job_dir in jobs_root().iterdir():
        meta = _read_json(job_dir / "meta.json") if job_dir.is_dir() else None
        if meta is None or (kind is not None and meta.get("kind") != kind):
            continue
        found.append((meta.get("created_at", 0.0), job_dir.name, Job(job_dir.name, job_dir)))
    found.sort(key=lambda item: item[:2], reverse=True)
    return [job for _, _, job in found if wanted is None or job.status() in wanted]


# ---- progress parsing (used by the runner on every output line) ----

_FRACTION_RE = re.compile(r"(\d+)\s*/\s*(\d+)")
_PERCENT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*%")


def parse_progress(line: str) -> float | None:
    """A fraction in [0, 1] read from one line of output, or None.

    >>> parse_progress('{"progress": 0.25}'), parse_progress('{"done": 3, "total": 4}')
    (0.25, 0.75)
    >>> parse_progress("trial 2/10 finished"), parse_progress(" 40%|####      | 4/10"), parse_progress("loss 2.3")
    (0.2, 0.4, None)
    """
    line = line.strip()
    if line.startswith("{"):
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            if isinstance(obj.get("progress"), (int, float)):
                return min(1.0, max(0.0, float(obj["progress"])))
            for num, den in (("done", "total"), ("step", "steps"), ("step", "total_steps"), ("trial", "n_trials"),
                             ("completed", "total")):
                if isinstance(obj.get(num), (int, float)) and isinstance(obj.get(den), (int, float)) and obj[den] > 0:
                    return min(1.0, max(0.0, obj[num] / obj[den]))
            return None
    matches = _FRACTION_RE.findall(line)
    for num, den in reversed(matches):
        if int(den) > 0 and int(num) <= int(den):
            return int(num) / int(den)
    pct = _PERCENT_RE.findall(line)
    if pct and float(pct[-1]) <= 100:
        return float(pct[-1]) / 100.0
    return None


def progress_message(line: str) -> str | None:
    """The human part of an output line: a JSON line's "message" (or "msg"); None for other JSON (results)."""
    line = line.strip()
    if line.startswith("{"):
        try:
            obj = json.loads(line)
        except ValueError:
            return line
        if isinstance(obj, dict):
            for key in ("message", "msg", "text"):
                if isinstance(obj.get(key), str):
                    return obj[key]
            return None
    return line
