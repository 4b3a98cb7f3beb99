"""Helpers the GPU scripts share (gpu_kernels.py, gpu_kvquant.py, gpu_quant.py, gpu_gemv.py, bench_step_loop.py):
CUDA-event timing of a callable after a short warm-up, a callable captured `calls` times into one CUDA graph, a
device sync, and the loop that runs a script's parts, each into <out>/<prefix>_<part>.json and .md.

    graph, out = capture(fn, calls=8)         # warmed up on a side stream first
    us_per_call = eager_us(graph.replay) / 8  # what graph_us(fn, calls=8) returns
"""
from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Callable

import torch


def sync(device: torch.device | str) -> None:
    """Wait for the device (a no-op off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_parts(parts: dict[str, Callable], names: str, args, device: torch.device, env: dict, out: Path,
              prefix: str, table: Callable[[list[dict]], str]) -> None:
    """Run the comma-separated `names` of `parts` (part(args, device) -> rows) in turn; each writes
    <out>/<prefix>_<part>.json (rows, env, seconds, args) and .md (a table). One failing part is recorded, not fatal."""
    for part in names.split(","):
        t0 = time.perf_counter()
        try:
            data = {"rows": parts[part](args, device)}
        except Exception as e:  # noqa: BLE001 - one failing part must not lose the others
            traceback.print_exc()
            data = {"rows": [], "error": f"{type(e).__name__}: {e}"}
        data.update(env, part=part, seconds=time.perf_counter() - t0,
                    args={k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
                          for k, v in vars(args).items()})
        (out / f"{prefix}_{part}.json").write_text(json.dumps(data, indent=1))
        versions = "".join(f", {k} {env[k]}" for k in ("torch", "triton") if k in env)
        (out / f"{prefix}_{part}.md").write_text(f"# {part} ({env['device']}{versions}, {data['seconds']:.0f} s)\n\n"
                                                 + table(data["rows"])
                                                 + (f"\nerror: {data['error']}\n" if "error" in data else ""))
        print(f"== {part}: {data['seconds']:.1f} s", flush=True)
        print(table(data["rows"]), flush=True)


def eager_us(fn, reps: int = 20) -> float:
    """Microseconds per call of fn (3 warm-up calls, then `reps` calls between two CUDA events)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def capture(fn, calls: int):
    """`calls` calls of fn in one CUDA graph (warmed up on a side stream first); returns (graph, last output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph, out


def graph_us(fn, calls: int, reps: int = 20) -> float:
    """Microseconds per call of fn, replayed from one graph of `calls` calls."""
    graph, _ = capture(fn, calls)
    return eager_us(graph.replay, reps) / calls
