"""Timing helpers the GPU scripts share (scripts/gpu_kernels.py, scripts/gpu_kvquant.py): CUDA-event timing of a
callable after a short warm-up, and a callable captured `calls` times into one CUDA graph.

    graph, out = capture(fn, calls=8)         # warmed up on a side stream first
    us_per_call = eager_us(graph.replay) / 8  # what graph_us(fn, calls=8) returns
"""
from __future__ import annotations

import torch


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
