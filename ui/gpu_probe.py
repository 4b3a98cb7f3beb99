"""`python -m ui.gpu_probe [--watch SECONDS]`: what GPU this machine has, as JSON on stdout.

Runs in its own process so the Streamlit server never imports torch. Without --watch it prints one object:
environment_info() plus cuda_available, device count and per-device memory. With --watch it prints one JSON line
per second of telemetry (workbench.harness.telemetry.GpuTelemetry means over that second, plus t_s) until the time is up or
it is cancelled; the GPU page starts it as a background job and plots the lines.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def probe() -> dict:
    info: dict = {"cuda_available": False, "devices": [], "reason": None}
    try:
        from workbench.harness.telemetry import environment_info

        info.update(environment_info())
    except Exception as exc:  # noqa: BLE001 - report, do not crash: the page shows the reason
        info["environment_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import torch

        info["torch_version"] = info.get("torch_version") or torch.__version__
        info["cuda_available"] = bool(torch.cuda.is_available())
        if not info["cuda_available"]:
            info["reason"] = "torch.cuda.is_available() is False"
        for i in range(torch.cuda.device_count() if info["cuda_available"] else 0):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            info["devices"].append({"index": i, "name": props.name, "sm_count": props.multi_processor_count,
                                    "capability": f"{props.major}.{props.minor}",
                                    "memory_total_mb": total / 2**20, "memory_free_mb": free / 2**20})
    except Exception as exc:  # noqa: BLE001
        info["reason"] = f"{type(exc).__name__}: {exc}"
    return info


def watch(seconds: float, interval: float, device: int) -> None:
    from workbench.harness.telemetry import GpuTelemetry

    start = time.time()
    while time.time() - start < seconds:
        tel = GpuTelemetry(device_index=device, interval_s=0.2)
        tel.start()
        time.sleep(interval)
        summary = tel.stop()
        row = {"t_s": round(time.time() - start, 2), **(summary.means or {}), "reason": summary.reason}
        print(json.dumps(row), flush=True)
        print(f"{time.time() - start:.0f}/{seconds:.0f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ui.gpu_probe", description=__doc__)
    parser.add_argument("--watch", type=float, default=0.0, help="sample telemetry for this many seconds")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    if args.watch > 0:
        watch(args.watch, args.interval, args.device)
    else:
        print(json.dumps(probe(), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
