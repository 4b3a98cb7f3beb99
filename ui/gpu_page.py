"""GPU page: the device, its memory, and live telemetry when a GPU is present; a clear "no GPU" state otherwise.

Both the probe and the live sampling run in subprocesses (`python -m ui.gpu_probe`), so this page never imports torch.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import streamlit as st

from ui import charts, jobs
from ui.common import PYTHON, REPO_ROOT, job_panel

P = "gpu_"
TELEMETRY_KEYS = ["sm_util_pct", "sm_occupancy_pct", "gpu_busy_pct", "gpu_mem_used_mb", "gpu_power_w", "sm_clock_mhz"]
LABELS = {"sm_util_pct": ("SM utilization", "%"), "sm_occupancy_pct": ("SM occupancy", "%"),
          "gpu_busy_pct": ("GPU busy", "%"), "gpu_mem_used_mb": ("Memory used", " MB"),
          "gpu_power_w": ("Power", " W"), "sm_clock_mhz": ("SM clock", " MHz")}


@st.cache_data(ttl=300, show_spinner="Probing the GPU ...")
def gpu_probe() -> dict:
    """`python -m ui.gpu_probe` output (cached 5 minutes); {"cuda_available": False, "reason": ...} on any failure."""
    try:
        proc = subprocess.run([PYTHON, "-m", "ui.gpu_probe"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=120)
        info = jobs.parse_json_output(proc.stdout)
        if isinstance(info, dict):
            return info
        return {"cuda_available": False, "reason": f"probe printed no JSON: {proc.stderr.strip()[-500:]}"}
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"cuda_available": False, "reason": f"probe failed: {exc}"}


DEVICE_FILES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")  # NVIDIA, WSL2, ROCm: one exists wherever torch sees a GPU


def gpu_state() -> dict:
    """What the Run and Tune forms know of the GPU: {"cuda_available": bool, "reason": str | None}. Without a GPU
    device file the answer needs no probe process; otherwise it is the cached probe's."""
    if not any(Path(f).exists() for f in DEVICE_FILES):
        return {"cuda_available": False, "reason": f"no GPU device file ({', '.join(DEVICE_FILES)})"}
    info = gpu_probe()
    return {"cuda_available": bool(info.get("cuda_available")), "reason": info.get("reason")}


def environment_table(info: dict) -> None:
    keys = ["device_name", "driver_version", "cuda_version", "torch_version", "python_version", "platform",
            "hostname", "git_commit"]
    rows = [{"": k.replace("_", " "), "value": str(info.get(k))} for k in keys if info.get(k) not in (None, "")]
    if rows:
        st.dataframe(rows, hide_index=True, width="stretch")
    if info.get("environment_error"):
        st.warning(f"workbench.harness.telemetry.environment_info failed: {info['environment_error']}")


def live_section(info: dict) -> None:
    st.subheader("Live telemetry")
    watches = jobs.list_jobs(kind="gpu_watch")
    current = watches[0] if watches else None
    running = current is not None and current.status() == jobs.RUNNING
    if not running:
        minutes = st.selectbox("Sample for", (1, 5, 15, 60), index=1, key=f"{P}watch_minutes",
                               format_func=lambda m: f"{m} min")
        device = st.selectbox("Device", [d["index"] for d in info.get("devices", [])] or [0], key=f"{P}device")
        if st.button("Start live telemetry", key=f"{P}watch_start", icon=":material/monitoring:"):
            jobs.start_job("gpu_watch", [PYTHON, "-m", "ui.gpu_probe", "--watch", str(minutes * 60),
                                         "--device", str(device)], f"GPU telemetry {minutes} min on cuda:{device}")
            st.rerun()
    if current is None:
        return

    @st.fragment(run_every=1.5 if running else None)
    def watch() -> None:
        status = job_panel(current, P, show_log=False)
        rows = [r for r in (jobs.parse_json_output(line) for line in current.stdout().splitlines())
                if isinstance(r, dict)]
        if rows:
            last = rows[-1]
            if last.get("reason"):
                st.warning(f"telemetry: {last['reason']}")
            cols = st.columns(len(TELEMETRY_KEYS))
            for col, key in zip(cols, TELEMETRY_KEYS):
                label, unit = LABELS[key]
                value = last.get(key)
                col.metric(label, "—" if value is None else f"{value:,.0f}{unit}")
            fig = charts.telemetry_timeline(rows[-600:], [k for k in TELEMETRY_KEYS if k != "gpu_mem_used_mb"])
            if fig is not None:
                st.plotly_chart(fig, width="stretch", key=f"{P}timeline")
            st.caption("SM utilization is NVML GPM SM_UTIL (share of SMs busy); GPU busy is NVML's utilization "
                       "rate (share of time any kernel ran). They are different numbers.")
        if running and status != jobs.RUNNING:
            st.rerun()

    watch()


def render() -> None:
    st.title("GPU")
    info = gpu_probe()
    if st.button("Probe again", key=f"{P}reprobe", icon=":material/refresh:"):
        gpu_probe.clear()
        st.rerun()
    if not info.get("cuda_available"):
        st.info(f"**No GPU on this machine.** Runs use the CPU; telemetry columns of CPU runs stay empty.  \n"
                f"Reason: {info.get('reason') or 'unknown'}", icon=":material/memory:")
        environment_table(info)
        return
    for dev in info.get("devices", []):
        total, free = dev.get("memory_total_mb") or 0, dev.get("memory_free_mb") or 0
        with st.container(border=True):
            st.markdown(f"**cuda:{dev['index']} · {dev.get('name')}** · "
                        f"compute capability {dev.get('capability')} · "
                        f"{dev.get('sm_count')} SMs")
            if total:
                used = total - free
                st.progress(used / total, text=f"memory: {used / 1024:,.1f} GiB used of {total / 1024:,.1f} GiB")
    environment_table(info)
    live_section(info)


if __name__ == "__main__":
    render()
