"""workbench/serving/launcher.py: command templates, a server launched in its own process group, /health polling, and
stops that leave no process behind (checked by PID), with the log's tail in every launch error."""
import json
import os
import sys
import textwrap
import time

import pytest

from workbench.serving.launcher import (LaunchError, LaunchTemplate, ServerProcess, alive, free_port, group_pids)

# A stand-in server: answers /health once ready (after --delay s), forks a worker that sleeps (as real servers'
# workers do), or exits at once with a message (a bad flag).
SERVER = textwrap.dedent("""
    import argparse, http.server, os, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--fail", action="store_true")
    p.add_argument("--ignore-term", action="store_true")
    a = p.parse_args()
    if a.fail:
        print("error: unsupported setting k=%d" % a.k, file=sys.stderr, flush=True)
        sys.exit(3)
    if a.ignore_term:
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:  # a worker process in the same group
        time.sleep(600)
        os._exit(0)
    time.sleep(a.delay)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = ("k=%d" % a.k).encode()
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            print("request", self.path, flush=True)
    print("listening on", a.port, flush=True)
    http.server.HTTPServer(("127.0.0.1", a.port), H).serve_forever()
""")


@pytest.fixture
def server_py(tmp_path):
    path = tmp_path / "server.py"
    path.write_text(SERVER)
    return path


def template(server_py, extra=""):
    return LaunchTemplate(f"{sys.executable} {server_py} --port {{port}} --k {{k}} {extra}")


def test_template_fields_port_and_literal_braces():
    t = LaunchTemplate("vllm serve m --port {port} --speculative-config "
                       "'{{\"method\": \"ngram\", \"num_speculative_tokens\": {k}}}' --max-num-seqs {seqs}")
    assert t.fields == ("k", "seqs") and t.needs_port
    argv = t.argv({"k": 3, "seqs": 16}, port=8123)
    assert argv[:5] == ["vllm", "serve", "m", "--port", "8123"]
    assert json.loads(argv[6]) == {"method": "ngram", "num_speculative_tokens": 3}
    assert argv[-1] == "16"


@pytest.mark.parametrize("text, params, message", [
    ("", {}, "the launch template is empty"),
    ("serve --k {k", {}, "write literal braces as"),
    ("serve --k {0}", {}, "is not a plain name"),
    ("serve --k {k!r}", {}, "has a format spec or conversion"),
    ("serve --k {k}", {}, "launch template needs {k}"),
    ("serve --k {k}", {"k": 1, "w": 2}, "setting(s) w are not in the launch template"),
    ("serve --port {port}", {}, "a port must be given"),
    ("serve --name 'a {k}", {"k": 1}, "cannot be split into arguments"),
])
def test_bad_templates_are_named(text, params, message):
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{")
                       .replace("}", r"\}")):
        LaunchTemplate(text).argv(params)


def test_launch_health_and_stop_leave_no_process(server_py, tmp_path):
    port = free_port()
    server = ServerProcess.start(template(server_py, "--delay 0.3").argv({"k": 4}, port), tmp_path / "log.txt")
    with server:
        waited = server.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=20)
        assert waited >= 0.2  # it was polled until it listened
        pids = group_pids(server.pgid)
        assert server.pid in pids and len(pids) == 2  # the server and its worker
    assert not any(alive(p) for p in pids)
    assert group_pids(server.pgid) == []
    assert "listening on" in (tmp_path / "log.txt").read_text()


def test_a_server_that_exits_is_a_named_error_with_its_log(server_py, tmp_path):
    port = free_port()
    with pytest.raises(LaunchError, match=r"exited with status 3[\s\S]*unsupported setting k=9") as e:
        with ServerProcess.start(template(server_py, "--fail").argv({"k": 9}, port), tmp_path / "log.txt") as s:
            s.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=20)
    assert "unsupported setting k=9" in e.value.log_tail


def test_a_server_never_healthy_times_out_and_is_killed_even_if_it_ignores_sigterm(server_py, tmp_path):
    port = free_port()
    t0 = time.monotonic()
    server = ServerProcess.start(template(server_py, "--delay 60 --ignore-term").argv({"k": 1}, port),
                                 tmp_path / "log.txt")
    with pytest.raises(LaunchError, match="did not answer 200 within 0.5 s"):
        server.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=0.5)
    server.stop(grace_s=0.5)  # SIGTERM is ignored: SIGKILL after the grace period
    assert group_pids(server.pgid) == [] and not alive(server.pid)
    assert time.monotonic() - t0 < 10


def test_stop_grace_is_short_for_a_cooperative_server(server_py, tmp_path):
    port = free_port()
    server = ServerProcess.start(template(server_py).argv({"k": 2}, port), tmp_path / "log.txt")
    server.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=20)
    t0 = time.monotonic()
    server.stop(grace_s=10)
    assert time.monotonic() - t0 < 5  # SIGTERM ended both; nothing waited for the grace period
    assert group_pids(server.pgid) == []


def test_a_missing_program_is_a_named_error(tmp_path):
    with pytest.raises(LaunchError, match="cannot start 'no-such-server-binary'"):
        ServerProcess.start(["no-such-server-binary", "--port", "1"], tmp_path / "log.txt")


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert os.path.exists("/proc")  # group_pids reads /proc: the tests run on Linux
