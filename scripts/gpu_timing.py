"""Helpers the GPU scripts share (gpu_kernels.py, gpu_kvquant.py, gpu_quant.py, gpu_gemv.py, gpu_gguf.py,
bench_step_loop.py): CUDA-event timing of a callable after a short warm-up, a callable captured `calls` times into one
CUDA graph, a device sync, the loop that runs a script's parts, each into <out>/<prefix>_<part>.json and .md, the
decode-floor row of a weight-format benchmark (`floor_row`, `equal_prefix`) and a profiler run's kernels per decode
token (`kernel_summary`).

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


HBM_BYTES_PER_S = 4.3e12  # H200 HBM3e, as in the issues' floor definition


def floor_row(model, ms: list[float], prompt_len: int, max_new_tokens: int) -> dict:
    """ms/token statistics of a batch-1 decode and the HBM floor of the bytes one token reads: every stored parameter
    and buffer (quantized weights, scales) but the embedding table (one row of it is read; a tied head is read whole),
    plus the KV cache at the mid-generation length. `floor_ms_all_params` counts the table too (gpu_fastpath's
    definition, the one issue 8's goals use)."""
    import statistics

    from workbench.engine.quant import weight_bytes

    cfg, embed = model.config, model.model.embed_tokens.weight
    stored = weight_bytes(model)
    read = stored - (embed.numel() * embed.element_size() if model.lm_head is not None else 0)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * (prompt_len + max_new_tokens / 2)
    med = statistics.median(ms)
    floor = (read + kv) / HBM_BYTES_PER_S * 1e3
    return dict(weight_gb=stored / 1e9, read_gb_per_token=(read + kv) / 1e9, ms_per_token_median=med, ms_min=min(ms),
                ms_max=max(ms), floor_ms=floor, fraction_of_floor=floor / med,
                floor_ms_all_params=(stored + kv) / HBM_BYTES_PER_S * 1e3)


def kernel_summary(prof, tokens: int, top: int) -> dict:
    """The CUDA kernels of a torch.profiler run over `tokens` decode tokens: kernels and kernel time per token, and
    the `top` kernels by time (with dependent launches kernels overlap, so the time may exceed the wall time)."""
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(ev.name[:90], []).append(ev.device_time)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"kernel_ms_per_token": sum(sum(v) for v in by_name.values()) / 1e3 / tokens,
            "kernels_per_token": sum(len(v) for v in by_name.values()) / tokens,
            "top": [{"kernel": k, "us_per_token": sum(v) / tokens, "calls_per_token": len(v) / tokens,
                     "us_per_call": sum(v) / len(v)} for k, v in ranked]}


def equal_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share (the first difference's index).

    >>> equal_prefix([1, 2, 3], [1, 2, 4]), equal_prefix([1, 2], [1, 2, 3])
    (2, 2)
    """
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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
