"""GPU telemetry sampled by NVML in a background thread, and the environment a run was measured in.

Two different "utilizations", never to be reported as each other:
  - sm_util_pct: NVML GPM metric SM_UTIL, the % of SMs that were busy (Hopper and later; needs two GPM samples
    >= 100 ms apart). sm_occupancy_pct: GPM SM_OCCUPANCY, % of resident warps vs the theoretical maximum.
  - gpu_busy_pct: `nvmlDeviceGetUtilizationRates().gpu`, the % of time *any* kernel was running. One tiny kernel
    at a time keeps it near 100 while most SMs idle, which is exactly the launch-bound regime of small decode steps.
Also per sample: gpu_mem_used_mb (MiB, device-wide, all processes), gpu_power_w, sm_clock_mhz.

    tel = GpuTelemetry("cuda:0", interval_s=0.2); tel.start(); ...; summary = tel.stop()
    summary.means["sm_util_pct"]     # float, or None with summary.reasons["sm_util_pct"] saying why

Nothing measured is never reported as zero: a metric that could not be read is None and its reason is kept.
Self-check on a GPU box: `python -m workbench.harness.telemetry --seconds 2` (runs matmuls, prints the summary as JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRIC_KEYS = ("sm_util_pct", "sm_occupancy_pct", "gpu_busy_pct", "gpu_mem_used_mb", "gpu_power_w", "sm_clock_mhz")
GPM_KEYS = ("sm_util_pct", "sm_occupancy_pct")
GPM_MIN_GAP_S = 0.1   # NVML needs GPM samples at least 100 ms apart for meaningful rates
_MIB = 1 << 20
_REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TelemetrySummary:
    means: dict[str, float | None]           # METRIC_KEYS -> mean over samples, None if never read
    timeline: list[dict[str, Any]]           # one dict per sample: t_s (since start) + METRIC_KEYS
    reason: str | None                       # None when every metric was sampled, else why not (all reasons)
    reasons: dict[str, str] = field(default_factory=dict)   # metric -> why it is None (or partly missing)
    device: str | None = None                # what was sampled, e.g. "nvml:0 NVIDIA H200"

    def to_record(self) -> dict[str, Any]:
        """The telemetry columns of a result-store run record."""
        return {**self.means, "telemetry_reason": self.reason, "telemetry_timeline": json.dumps(self.timeline)}


def _unavailable(reason: str) -> TelemetrySummary:
    return TelemetrySummary({k: None for k in METRIC_KEYS}, [], reason, {k: reason for k in METRIC_KEYS})


def _parse_device(device: int | str | None) -> tuple[int | None, str | None]:
    """CUDA ordinal from 0, 1, "cuda", "cuda:1" (or a torch.device); (None, reason) for non-CUDA devices."""
    if device is None:
        return 0, None
    if isinstance(device, int):
        return device, None
    text = str(device).strip()
    if text.isdigit():
        return int(text), None
    kind, _, idx = text.partition(":")
    if kind != "cuda":
        return None, f"no NVIDIA GPU: device is {text!r}"
    if not idx:
        return _torch_current_device(), None
    if not idx.isdigit():
        raise ValueError(f"bad CUDA device {text!r}: expected cuda or cuda:<index>")
    return int(idx), None


def _torch_current_device() -> int:
    torch = sys.modules.get("torch")   # only ask torch when the caller already uses it
    try:
        if torch is not None and torch.cuda.is_available():
            return int(torch.cuda.current_device())
    except Exception:  # noqa: BLE001
        pass
    return 0


def _nvml_handle(pynvml: Any, ordinal: int) -> tuple[Any, str]:
    """NVML handle of the CUDA device `ordinal` as this process sees it; returns (handle, how it was mapped).

    CUDA ordinals count visible devices (CUDA_VISIBLE_DEVICES) in CUDA's order; NVML indexes every device in PCI
    order. So: ask torch (if loaded and CUDA is up) for the device's UUID, then PCI bus id; else read
    CUDA_VISIBLE_DEVICES (indices or GPU-/MIG- UUIDs); else assume the orders agree.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and ordinal < torch.cuda.device_count():
                props = torch.cuda.get_device_properties(ordinal)
                uuid = getattr(props, "uuid", None)
                if uuid is not None:
                    text = str(uuid)
                    text = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
                    try:
                        return pynvml.nvmlDeviceGetHandleByUUID(text), f"torch uuid {text}"
                    except pynvml.NVMLError:
                        pass
                if getattr(props, "pci_bus_id", None) is not None:
                    bus = (f"{getattr(props, 'pci_domain_id', 0):08x}:{props.pci_bus_id:02x}:"
                           f"{getattr(props, 'pci_device_id', 0):02x}.0")
                    try:
                        return pynvml.nvmlDeviceGetHandleByPciBusId(bus), f"torch pci bus {bus}"
                    except pynvml.NVMLError:
                        pass
        except Exception:  # noqa: BLE001 - fall through to the environment
            pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if ordinal >= len(entries):
            raise LookupError(f"cuda:{ordinal} is not visible (CUDA_VISIBLE_DEVICES={visible!r})")
        entry = entries[ordinal]
        if entry.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(entry)), f"CUDA_VISIBLE_DEVICES index {entry}"
        return pynvml.nvmlDeviceGetHandleByUUID(entry), f"CUDA_VISIBLE_DEVICES uuid {entry}"
    return pynvml.nvmlDeviceGetHandleByIndex(ordinal), f"nvml index {ordinal}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuTelemetry:
    """Samples one GPU every `interval_s` in a daemon thread between start() and stop().

    device_index: CUDA ordinal (int) or torch device string ("cuda", "cuda:1", "cpu"); CUDA_VISIBLE_DEVICES is
    respected. stop() takes one last sample (so even a short window has one) and returns a TelemetrySummary.
    """

    def __init__(self, device_index: int | str = 0, interval_s: float = 0.2):
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.device = device_index
        self.interval_s = float(interval_s)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._timeline: list[dict[str, Any]] = []
        self._reasons: dict[str, str] = {}
        self._summary: TelemetrySummary | None = None
        self._fatal: str | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self._device_label: str | None = None
        self._gpm: dict[str, Any] | None = None   # prev sample, its time, a spare sample, the metrics struct
        self._t0 = 0.0

    # ------------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> GpuTelemetry:
        if self._thread is not None:
            raise RuntimeError("GpuTelemetry.start() called twice")
        self._t0 = time.perf_counter()
        self._open()
        self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
        if self._fatal is None:
            self._thread.start()
        return self

    def stop(self) -> TelemetrySummary:
        if self._summary is not None:
            return self._summary
        if self._thread is None:
            raise RuntimeError("GpuTelemetry.stop() before start()")
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(5.0, 5 * self.interval_s))
        if self._fatal is None:
            self._sample_once()   # the tail of the window since the last periodic sample
        self._close()
        self._summary = self._summarize()
        return self._summary

    def __enter__(self) -> GpuTelemetry:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def summary(self) -> TelemetrySummary | None:
        return self._summary

    # ---------------------------------------------------------------------------------------------- NVML access

    def _open(self) -> None:
        ordinal, reason = _parse_device(self.device)
        if reason is not None:
            self._fatal = reason
            return
        try:
            import pynvml
        except ImportError as exc:
            self._fatal = f"no NVIDIA GPU: pynvml not importable: {exc}"
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError or a missing library
            self._fatal = f"no NVIDIA GPU: NVML init failed: {exc}"
            return
        self._nvml = pynvml
        try:
            self._handle, how = _nvml_handle(pynvml, ordinal)
            name = _text(pynvml.nvmlDeviceGetName(self._handle))
            self._device_label = f"cuda:{ordinal} = {name} ({how})"
        except Exception as exc:  # noqa: BLE001
            self._fatal = f"no NVIDIA GPU: cuda:{ordinal} not found by NVML: {exc}"
            self._close()
            return
        self._open_gpm()

    def _open_gpm(self) -> None:
        nv = self._nvml
        try:
            support = nv.nvmlGpmQueryDeviceSupport(self._handle)
            supported = bool(support.isSupportedDevice)
            why = "" if supported else "nvmlGpmQueryDeviceSupport: isSupportedDevice=0"
        except Exception as exc:  # noqa: BLE001 - old driver, NVMLError_NotSupported, missing symbol
            supported, why = False, f"nvmlGpmQueryDeviceSupport failed: {exc}"
        if not supported:
            for key in GPM_KEYS:
                self._reasons[key] = f"GPM unsupported ({why})"
            return
        try:
            first = nv.nvmlGpmSampleAlloc()
            spare = nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmSampleGet(self._handle, first)
            metrics = nv.c_nvmlGpmMetricsGet_t()
            self._gpm = {"prev": first, "prev_t": time.perf_counter(), "spare": spare, "metrics": metrics}
        except Exception as exc:  # noqa: BLE001
            for key in GPM_KEYS:
                self._reasons[key] = f"GPM sampling failed: {exc}"
            self._free_gpm()

    def _free_gpm(self) -> None:
        if self._gpm is None:
            return
        for name in ("prev", "spare"):
            try:
                self._nvml.nvmlGpmSampleFree(self._gpm[name])
            except Exception:  # noqa: BLE001
                pass
        self._gpm = None

    def _close(self) -> None:
        if self._nvml is None:
            return
        self._free_gpm()
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        self._nvml = None

    def _read(self, key: str, fn: Any) -> float | None:
        try:
            return float(fn())
        except Exception as exc:  # noqa: BLE001 - one metric failing must not stop the others
            self._reasons.setdefault(key, f"{key} read failed: {exc}")
            return None

    def _read_gpm(self, now: float) -> dict[str, float | None]:
        out: dict[str, float | None] = {k: None for k in GPM_KEYS}
        gpm = self._gpm
        if gpm is None or now - gpm["prev_t"] < GPM_MIN_GAP_S:
            return out
        nv = self._nvml
        try:
            nv.nvmlGpmSampleGet(self._handle, gpm["spare"])
            mg = gpm["metrics"]
            mg.version = nv.NVML_GPM_METRICS_GET_VERSION
            mg.numMetrics = 2
            mg.sample1 = gpm["prev"]
            mg.sample2 = gpm["spare"]
            mg.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
            mg.metrics[1].metricId = nv.NVML_GPM_METRIC_SM_OCCUPANCY
            nv.nvmlGpmMetricsGet(mg)
            for i, key in enumerate(GPM_KEYS):
                ret = mg.metrics[i].nvmlReturn
                if ret == nv.NVML_SUCCESS:
                    out[key] = float(mg.metrics[i].value)
                else:
                    self._reasons.setdefault(key, f"nvmlGpmMetricsGet returned {ret} for {key}")
        except Exception as exc:  # noqa: BLE001
            for key in GPM_KEYS:
                self._reasons.setdefault(key, f"GPM read failed: {exc}")
        gpm["prev"], gpm["spare"], gpm["prev_t"] = gpm["spare"], gpm["prev"], now
        return out

    # ------------------------------------------------------------------------------------------------ sampling

    def _sample_once(self) -> None:
        nv, h = self._nvml, self._handle
        now = time.perf_counter()
        row: dict[str, Any] = {"t_s": round(now - self._t0, 4)}
        row.update(self._read_gpm(now))
        row["gpu_busy_pct"] = self._read("gpu_busy_pct", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu)
        row["gpu_mem_used_mb"] = self._read("gpu_mem_used_mb", lambda: nv.nvmlDeviceGetMemoryInfo(h).used / _MIB)
        row["gpu_power_w"] = self._read("gpu_power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
        row["sm_clock_mhz"] = self._read("sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        with self._lock:
            self._timeline.append({"t_s": row["t_s"], **{k: row.get(k) for k in METRIC_KEYS}})

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample_once()
            except Exception as exc:  # noqa: BLE001 - never kill the host process from a sampler thread
                self._reasons.setdefault("sampler", f"sampler stopped: {exc}")
                return

    def _summarize(self) -> TelemetrySummary:
        if self._fatal is not None:
            return _unavailable(self._fatal)
        with self._lock:
            timeline = list(self._timeline)
        means: dict[str, float | None] = {}
        reasons = dict(self._reasons)
        for key in METRIC_KEYS:
            values = [row[key] for row in timeline if row.get(key) is not None]
            means[key] = sum(values) / len(values) if values else None
            if not values and key not in reasons:
                reasons[key] = ("no GPM sample pair >= 100 ms apart (window too short)" if key in GPM_KEYS
                                else "no samples")
        missing = [k for k in METRIC_KEYS if means[k] is None]
        reason = None
        if missing or "sampler" in reasons:
            by_reason: dict[str, list[str]] = {}
            for key in missing:
                by_reason.setdefault(reasons[key], []).append(key)
            parts = [f"{why}: {', '.join(keys)} = None" for why, keys in by_reason.items()]
            if "sampler" in reasons:
                parts.append(reasons["sampler"])
            reason = "; ".join(parts)
        return TelemetrySummary(means, timeline, reason, reasons, self._device_label)


# ---------------------------------------------------------------------------------------------- environment

def _git_commit(repo: Path = _REPO) -> str:
    """HEAD of the repo, "+dirty" when tracked files have uncommitted changes (untracked files don't count,
    as in `git describe --dirty`); "unknown" outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown"
        commit = head.stdout.strip()
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30)
        if status.returncode == 0 and status.stdout.strip():
            commit += "+dirty"
        return commit
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _nvml_driver_version() -> str | None:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return None
    try:
        return _text(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # noqa: BLE001
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def environment_info(device: int | str | None = None) -> dict[str, str | None]:
    """Where a run was measured: the environment columns of a run record.

    device_name is the CUDA device's name (device: ordinal or "cuda:N"; default the current one) when CUDA is
    available, else "cpu (<machine>)". cuda_version is torch's CUDA build (None on a CPU build); driver_version
    comes from NVML (None without a driver).
    """
    try:
        import torch
        torch_version: str | None = torch.__version__
        cuda_version = torch.version.cuda
        cuda_ok = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        torch, torch_version, cuda_version, cuda_ok = None, None, None, False
    device_name = f"cpu ({platform.machine() or 'unknown'})"
    ordinal, not_cuda = _parse_device(device)
    if cuda_ok and not_cuda is None:
        try:
            device_name = torch.cuda.get_device_name(ordinal)
        except Exception:  # noqa: BLE001
            device_name = "cuda (name unavailable)"
    return {
        "device_name": device_name,
        "torch_version": torch_version,
        "cuda_version": cuda_version,
        "driver_version": _nvml_driver_version(),
        "git_commit": _git_commit(),
        "hostname": socket.gethostname(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
    }


# ---------------------------------------------------------------------------------------------- self-check

def _busy_work(device: str, seconds: float) -> dict[str, Any]:
    import torch
    if not torch.cuda.is_available():
        time.sleep(seconds)
        return {"workload": "none (no CUDA): slept"}
    dev = torch.device(device if device.startswith("cuda") else "cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize(dev)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            a = (a @ b) * 8192**-0.5   # keeps the entries ~N(0, 1), so nothing overflows or flushes to 0
        torch.cuda.synchronize(dev)
        n += 8
    dt = time.perf_counter() - t0
    return {"workload": f"{n} bf16 8192^3 matmuls", "tflops": round(2 * 8192**3 * n / dt / 1e12, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.harness.telemetry", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="length of the busy workload")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--interval", type=float, default=0.2, help="sampling interval, seconds")
    parser.add_argument("--timeline", action="store_true", help="print every sample too")
    args = parser.parse_args(argv)
    import torch  # noqa: F401 - loaded first so the NVML handle is mapped through torch's device UUID
    tel = GpuTelemetry(args.device, interval_s=args.interval).start()
    work = _busy_work(args.device, args.seconds)
    summary = tel.stop()
    out = {"device": summary.device, "means": summary.means, "reason": summary.reason, "reasons": summary.reasons,
           "samples": len(summary.timeline), **work, "environment": environment_info(args.device)}
    if args.timeline:
        out["timeline"] = summary.timeline
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
