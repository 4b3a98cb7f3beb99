"""Shared test setup. Tests use the committed tiny preset and never download or train anything large."""
import os

# Two CPU cores: OpenMP threads spin against each other (and against subprocesses the tests start); one thread per
# process keeps the suite fast and its timings stable. Subprocesses inherit it through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


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
