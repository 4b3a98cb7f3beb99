"""Programmatic dependent launch (PDL) for our Triton kernels: the next kernel starts while this one finishes.

Inside a captured decode step a layer is a chain of small launches (four GEMVs, the K/V write, attention and its
combine). Without PDL each one starts only after the previous one has fully drained: its programs are scheduled, then
its first weight loads wait a full DRAM latency, while the tail of the previous kernel leaves most SMs idle. With PDL
(Hopper, compute capability 9.0+; CUDA's `cudaLaunchAttributeProgrammaticStreamSerialization`, Triton's
`launch_pdl=True`) a kernel may be scheduled as soon as every program of the previous one has started, and then:

    before `gdc_wait()`: only work that reads nothing the previous kernels write and writes nothing at all (a
                         prefetch of the GEMVs' first weight tiles into L2 here measured slower, so they only wait).
    `gdc_wait()`       : returns once the previous kernel has completed and its writes are visible. Every program
                         calls it, also programs with nothing to do: a kernel completes only after its own wait, so
                         completion stays transitive along the chain (kernel C may rely on A, two launches back).
    `gdc_launch_dependents()`: lets the next kernel be scheduled once every program of this one has called it. Our
                         kernels call it once their weights / KV are read (after the GEMVs' K loop: a trigger
                         first thing let waiting dependents take the SM slots of int4's later waves, 1.25x slower).

A kernel launched this way after a kernel that never calls `gdc_launch_dependents` (cuBLAS, inductor's kernels)
starts when that kernel's programs have all exited, which costs nothing; a kernel compiled with the calls but launched
without the attribute treats them as no-ops. Whether a launch uses PDL is this module's one switch (`set_pdl`), read
at launch time (so at graph capture for a captured step); `pdl_problem` says why a device cannot.
"""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch

try:
    import triton
    import triton.language as tl
    TRITON_AVAILABLE = True
except ImportError:
    TRITON_AVAILABLE = False

_ENABLED = True  # the engine sets it per call (EngineConfig.pdl, the `pdl` knob)


def set_pdl(on: bool) -> None:
    """Launch our Triton kernels with PDL from now on (where `pdl_problem` allows); graphs captured before keep
    the launches they captured."""
    global _ENABLED
    _ENABLED = bool(on)


def pdl_requested() -> bool:
    return _ENABLED


@contextmanager
def pdl_scope(on: bool):
    """`set_pdl(on)` for the body, the previous setting restored after (an engine's calls: engines of one process
    may differ)."""
    before = _ENABLED
    set_pdl(on)
    try:
        yield
    finally:
        set_pdl(before)


def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # noqa: BLE001 - an old or partial triton
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_problem(device: torch.device | str) -> str | None:
    """Why our kernels cannot be launched with PDL on `device`; None when they can (read once per device: every
    eager launch asks)."""
    return _device_problem(torch.device(device))


@functools.lru_cache(maxsize=None)
def _device_problem(device: torch.device) -> str | None:
    if not TRITON_AVAILABLE:
        return "triton is not installed"
    if device.type != "cuda":
        return f"programmatic dependent launch needs a CUDA GPU; this run is on {device.type}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter has no dependent launches"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "programmatic dependent launch needs compute capability 9.0+ (Hopper)"
    if not _triton_has_pdl():
        return f"triton {triton.__version__} has no launch_pdl option"
    return None


# PDL only for launches recorded into a CUDA graph (captured steps, where it measured faster); eager launches of the
# same kernels measured 15-27 % slower with it, so they launch plainly.
# Set while a step is warmed up for capture (`warming_for_capture`): its eager launches take PDL as the captured ones
# will, so the kernels' PDL variants are compiled and loaded there, not inside the capture (a module loaded while a
# stream captures can invalidate the capture).
_WARMING = False


@contextmanager
def warming_for_capture():
    """Launches inside take PDL where a captured launch would (see _WARMING)."""
    global _WARMING
    before, _WARMING = _WARMING, True
    try:
        yield
    finally:
        _WARMING = before


def use_pdl(device: torch.device | str) -> bool:
    """Whether a launch on `device` now uses PDL: asked for (`set_pdl`), possible there, and being recorded into a
    CUDA graph or warmed up for that (`warming_for_capture`)."""
    if not (_ENABLED and pdl_problem(device) is None):
        return False
    return _WARMING or torch.cuda.is_current_stream_capturing()


def pdl_applies(requested: bool, device: torch.device | str, captured: bool) -> bool:
    """Whether a run's Triton launches use PDL: asked for, possible on `device`, and in captured steps (`captured`:
    the run uses CUDA graphs); the run record's `pdl_applied`."""
    return bool(requested) and pdl_problem(device) is None and bool(captured)


if TRITON_AVAILABLE:
    @triton.jit
    def gdc_wait():
        """Wait until the previous kernel in the stream has completed and its memory is visible (no-op without PDL)."""
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def gdc_launch_dependents():
        """Let the next kernel (launched with PDL) be scheduled once every program of this one has called this."""
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)

