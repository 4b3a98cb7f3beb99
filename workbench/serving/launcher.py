"""Start and stop a real inference server from a command template, one launch per trial (issue 43's "tune a real
server by relaunch", as SGLang's bench_speculative.py and `vllm bench sweep` relaunch theirs).

    template = LaunchTemplate("vllm serve /models/llama --port {port} "
                              "--speculative-config '{{\"method\": \"ngram\", \"num_speculative_tokens\": {k}}}'")
    with ServerProcess.start(template.argv({"k": 4}, port=8000), log_path) as server:
        server.wait_healthy("http://127.0.0.1:8000/health", timeout_s=600)
        ...                                 # measure it (serve-bench --endpoint)
    # leaving the block stops the server: SIGTERM to its whole process group, SIGKILL after a grace period

The template is a Python format string: `{name}` is a searched setting, `{port}` the port the launcher picked, `{{`
and `}}` literal braces. It is split into arguments like a POSIX shell would (shlex) and run without a shell, in a
session of its own (its own process group), so stopping it also stops every worker it forked. Its output goes to a
log file per launch; a launch that exits, or is not healthy within the timeout, raises `LaunchError` carrying the
log's tail, and the server is stopped before the error leaves the block.
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import string
import subprocess
import time
from pathlib import Path

import httpx

RESERVED = ("port",)  # placeholders the launcher fills itself


class LaunchError(RuntimeError):
    """A server that could not be launched or did not become healthy; `log_tail` holds the end of its log."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message + (f"\n--- end of the server's log ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


class LaunchTemplate:
    def __init__(self, template: str):
        if not isinstance(template, str) or not template.strip():
            raise LaunchError("the launch template is empty: give the server's command line, e.g. "
                              "\"python -m workbench serve --port {port} --k {k}\"")
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as e:  # a lone brace
            raise LaunchError(f"launch template {template!r}: {e}; write literal braces as {{{{ and }}}}") from None
        names = []
        for _, name, spec, conv in parsed:
            if name is None:
                continue
            if not name.isidentifier():
                raise LaunchError(f"launch template placeholder {{{name}}} is not a plain name: use {{k}}, "
                                  "{num_speculative_tokens}, ... (literal braces as {{ and }})")
            if spec or conv:
                raise LaunchError(f"launch template placeholder {{{name}}} has a format spec or conversion; "
                                  "write the plain {name}")
            if name not in names:
                names.append(name)
        self.template = template
        self.fields = tuple(n for n in names if n not in RESERVED)  # the settings a trial must give
        self.needs_port = "port" in names

    def render(self, params: dict, port: int | None = None) -> str:
        """The command line with `params` (every field, nothing else) and the port filled in."""
        missing = [f for f in self.fields if f not in params]
        if missing:
            raise LaunchError(f"launch template needs {', '.join('{' + m + '}' for m in missing)}: give a value or "
                              "a search range for each")
        extra = [k for k in params if k not in self.fields]
        if extra:
            raise LaunchError(f"setting(s) {', '.join(extra)} are not in the launch template (its placeholders: "
                              f"{', '.join(self.fields) or 'none'}): add {{{extra[0]}}} to the template or drop it")
        if self.needs_port and port is None:
            raise LaunchError("the launch template has {port}: a port must be given")
        return self.template.format(**params, **({"port": port} if self.needs_port else {}))

    def argv(self, params: dict, port: int | None = None) -> list[str]:
        line = self.render(params, port)
        try:
            argv = shlex.split(line)
        except ValueError as e:
            raise LaunchError(f"launch command {line!r} cannot be split into arguments: {e}") from None
        if not argv:
            raise LaunchError(f"launch command {line!r} is empty")
        return argv


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS's pick; another process could still take it before the server binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def group_pids(pgid: int) -> list[int]:
    """Live processes in process group `pgid` (Linux /proc; empty elsewhere)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().split(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


class ServerProcess:
    """One launched server: its process (the leader of its own process group) and its log file."""

    def __init__(self, proc: subprocess.Popen, argv: list[str], log_path: Path):
        self.proc, self.argv, self.log_path = proc, argv, Path(log_path)
        self.pgid = proc.pid  # start_new_session: the server leads its own group

    @classmethod
    def start(cls, argv: list[str], log_path: Path, cwd: str | None = None,
              env: dict[str, str] | None = None) -> "ServerProcess":
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        cwd=cwd, env=env, start_new_session=True)
            except OSError as e:  # no such program, not executable
                raise LaunchError(f"cannot start {argv[0]!r}: {e.strerror or e}") from None
        return cls(proc, argv, log_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_healthy(self, url: str, timeout_s: float, poll_s: float = 0.2) -> float:
        """Poll GET url until it answers 200; seconds waited. LaunchError (with the log's tail) when the server exits
        or the timeout passes first."""
        t0 = time.monotonic()
        with httpx.Client(timeout=max(poll_s, 1.0)) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise LaunchError(f"the server exited with status {code} before {url} answered "
                                      f"(command: {shlex.join(self.argv)})", tail(self.log_path))
                try:
                    if client.get(url).status_code == 200:
                        return time.monotonic() - t0
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() - t0 > timeout_s:
                    raise LaunchError(f"{url} did not answer 200 within {timeout_s:g} s (command: "
                                      f"{shlex.join(self.argv)}); raise --launch-timeout if the model loads slowly",
                                      tail(self.log_path))
                time.sleep(poll_s)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM to the server's process group, SIGKILL to what is left after grace_s; the leader's exit status.
        Every process of the group is gone when this returns (checked), or RuntimeError names the survivors."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()
                if not group_pids(self.pgid) and self.proc.returncode is not None:
                    return self.proc.returncode
                time.sleep(0.05)
        left = group_pids(self.pgid)
        if left:
            raise RuntimeError(f"server process group {self.pgid} survived SIGKILL: pids {left}")
        return self.proc.wait(timeout=5)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
