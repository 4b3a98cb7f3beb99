"""Shared test setup. Tests use the committed tiny preset and never download or train anything large."""
import os
import re
import subprocess
import sys

# Two CPU cores: OpenMP threads spin against each other (and against subprocesses the tests start); one thread per
# process keeps the suite fast and its timings stable. Subprocesses inherit it through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Without a CUDA GPU the Triton kernels run under Triton's interpreter, so their tests run on any machine; set before
# a kernel module is imported (triton.jit reads it then). A GPU machine runs the compiled kernels; an explicit setting
# (TRITON_INTERPRET=0) is kept.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A triton_compiler test in an interpreter session runs in a fresh process (the kernels' modules were decorated
    for the interpreter here); it passes only if the child ran it and it passed."""
    if pyfuncitem.get_closest_marker("triton_compiler") is None or os.environ.get("TRITON_INTERPRET") != "1":
        return None
    root = pyfuncitem.config.rootpath
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", pyfuncitem.nodeid]
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    tail = (done.stdout + done.stderr)[-4000:]
    if done.returncode != 0 or not re.search(r"(?m)^1 passed\b", done.stdout):
        pytest.fail(f"the child run without the interpreter did not pass (exit {done.returncode}):\n{tail}",
                    pytrace=False)
    return True


@pytest.fixture
def interpreter_bf16_dot(monkeypatch):
    """The Triton interpreter's tl.dot (triton 3.9) multiplies bf16 operands' bit patterns as integers; widen them to
    fp32 first (exact, as the tensor cores' bf16 products are). For the kernel tests under TRITON_INTERPRET=1
    (test_kernels, test_quant_gemv, test_int4_mma)."""
    import triton.language as tl
    from triton.runtime.interpreter import interpreter_builder as builder

    def widen(handle):
        return builder.cast_impl(handle, tl.float32) if handle.dtype == tl.bfloat16 else handle

    dot = builder.create_dot
    monkeypatch.setattr(builder, "create_dot", lambda a, b, acc, *rest: dot(widen(a), widen(b), acc, *rest))
