"""Where the GPU time goes, per phase: replay each captured phase's CUDA graph under the NVML GPM sampler.

A step's phases are microseconds long, far below NVML's 100 ms GPM window, so sampling a normal run mixes them with
host gaps. Here each phase's captured graph (the drafter's, then the verify step's, for the run's batch bucket) is
replayed back to back for at least `min_seconds`, and we record per phase:

    phase_ms_<p>       GPU time of one replay (wall time of the loop / replays, after a synchronize)
    phase_sm_util_<p>  NVML GPM SM utilization (% of SMs busy) over the loop
    phase_bw_gbps_<p>  achieved bandwidth: the bytes one replay must read (weights of the model(s) it runs, plus the
                       KV it reads: the whole static span with the sdpa backend, the live length with the kernel)
                       / phase_ms. Compare with ~4,300 GB/s measured copy bandwidth on an H200.
Each replay is preceded by one tiny copy that pins every row's kv_len at the typical length (the fused verify graph
advances it), which is included in phase_ms.

With greedy chains, acceptance runs inside the verify graph: `accept` then has no graph of its own (its columns stay
None and `phase_profile_note` says so). Needs a GPU, `cuda_graphs` on and a run that captured its graphs.
"""
from __future__ import annotations

import time

import torch

from workbench.engine.graphs import PAD_LEN
from workbench.harness.telemetry import GpuTelemetry


def _weight_bytes(model) -> int:
    from workbench.engine.quant import weight_bytes

    return weight_bytes(model)  # parameters and buffers: a quantized model keeps its weights in buffers


def _kv_bytes(cache, batch: int, live_len: int) -> int:
    """KV bytes one forward reads for `batch` rows: all layers, K and V (in the cache's format, scales included)."""
    per_token = cache.bytes_per_token
    span = live_len if cache.kernel is not None else cache.static_span
    return per_token * span * batch


def _replay(fn, min_seconds: float, device) -> tuple[float, dict]:
    """Replay fn for >= min_seconds under GPM sampling -> (ms per replay, telemetry means)."""
    fn()
    torch.cuda.synchronize(device)
    telemetry = GpuTelemetry(str(device), interval_s=0.1).start()
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(20):
            fn()
        n += 20
        torch.cuda.synchronize(device)
        if time.perf_counter() - t0 >= min_seconds:
            break
    ms = (time.perf_counter() - t0) * 1e3 / n
    return ms, telemetry.stop().means


def profile_phases(engine, batch: int, live_len: int, min_seconds: float = 0.25) -> dict:
    """engine: a SpecEngine that ran with cuda_graphs on a GPU; batch: the run's batch; live_len: a typical committed
    length (for the KV bytes). Returns the phase_* columns of a run record."""
    cols: dict = {f"phase_{m}_{p}": None for m in ("ms", "sm_util", "bw_gbps") for p in ("draft", "verify", "accept")}
    size = engine.config.graphs.bucket(batch)
    if engine.device.type != "cuda" or not engine.config.cuda_graphs or size is None or engine.cache is None:
        cols["phase_profile_note"] = "not measured: needs a GPU, cuda_graphs on and a batch within the buckets"
        return cols
    verify_step, verify_key = engine.verify_step()
    fused = verify_step is engine.accept_step
    phases = {"verify": (verify_step.replay_callables().get(f"{verify_step.name}:{size}x{verify_key}"),
                         _weight_bytes(engine.target) + _kv_bytes(engine.cache, size, live_len))}
    drafter = engine.drafter
    if drafter is not None and getattr(drafter, "model", None) is not None:
        replays = [fn for step in drafter.model_steps() if step is not drafter.prefill_step  # decode forwards only
                   for name, fn in step.replay_callables().items() if name.split(":")[1].startswith(f"{size}x")]
        forwards = drafter.model_forwards_per_step
        if len(replays) == 1:  # the fused greedy chain: k forwards in one graph
            phases["draft"] = (replays[0], forwards * (_weight_bytes(drafter.model)
                                                       + _kv_bytes(drafter.cache, size, live_len)))
    # the fused verify graph advances kv_len (and writes tokens after it) on every replay: pin every row at live_len
    # and restore that before each replay, so that each replay does the work of one step at a typical context
    kv_len = engine.kv_len
    live_len = min(live_len, engine.cache.max_len - engine.num_nodes - 2)
    pinned = torch.full_like(kv_len, live_len)
    pinned[engine.cache.pad_row:] = PAD_LEN
    notes = []
    for phase, (fn, nbytes) in phases.items():
        if fn is None:
            notes.append(f"{phase}: no captured graph for bucket {size}")
            continue
        ms, means = _replay(lambda fn=fn: (kv_len.copy_(pinned), fn()), min_seconds, engine.device)
        cols[f"phase_ms_{phase}"] = ms
        cols[f"phase_sm_util_{phase}"] = means.get("sm_util_pct")
        cols[f"phase_bw_gbps_{phase}"] = nbytes / (ms * 1e-3) / 1e9
    if fused:
        notes.append("accept runs inside the verify graph (greedy chain): counted in verify")
    if drafter is not None and "draft" not in phases:
        notes.append("draft: no single captured draft graph (model-free drafter or sampled drafting)")
    cols["phase_profile_note"] = "; ".join(notes) or None
    return cols
