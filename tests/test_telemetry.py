"""GPU telemetry on a CPU machine: the no-GPU summary, and the sampler against a faked NVML."""
from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
import time
from types import SimpleNamespace

import pynvml
import pytest

from workbench.harness import telemetry as T
from workbench.harness.telemetry import METRIC_KEYS, GpuTelemetry, environment_info


class FakeNvml:
    """Stands in for the NVML library behind pynvml's functions (monkeypatched onto the real module)."""

    def __init__(self, gpm: bool | Exception = True, power_error: bool = False, count: int = 4):
        self.gpm, self.power_error, self.count = gpm, power_error, count
        self.calls: list[tuple] = []
        self.busy = [30.0, 70.0]   # alternating, so the mean is checked against the timeline
        self.n_util = 0
        self.allocated: list[int] = []
        self.freed: list[int] = []
        self.metric_calls = 0

    def install(self, monkeypatch) -> FakeNvml:
        def err(code):
            return pynvml.NVMLError(code)

        def handle_by_index(i):
            if i >= self.count:
                raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            self.calls.append(("index", i))
            return f"h{i}"

        def handle_by_uuid(u):
            self.calls.append(("uuid", u))
            return f"h-{u}"

        def util(h):
            self.n_util += 1
            return SimpleNamespace(gpu=self.busy[self.n_util % 2], memory=5)

        def power(h):
            if self.power_error:
                raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return 300_500   # mW

        def gpm_support(h):
            if isinstance(self.gpm, Exception):
                raise self.gpm
            return SimpleNamespace(version=1, isSupportedDevice=int(self.gpm))

        def sample_alloc():
            addr = 0x1000 * (len(self.allocated) + 1)
            self.allocated.append(addr)
            return ctypes.cast(ctypes.c_void_p(addr), pynvml.c_nvmlGpmSample_t)

        def addr(sample):
            return ctypes.cast(sample, ctypes.c_void_p).value

        def sample_free(sample):
            self.freed.append(addr(sample))

        def metrics_get(mg):
            assert mg.version == pynvml.NVML_GPM_METRICS_GET_VERSION and mg.numMetrics == 2
            assert addr(mg.sample1) != addr(mg.sample2) and {addr(mg.sample1), addr(mg.sample2)} <= set(self.allocated)
            values = {pynvml.NVML_GPM_METRIC_SM_UTIL: 42.0, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 17.5}
            for i in range(mg.numMetrics):
                mg.metrics[i].value = values[mg.metrics[i].metricId]
                mg.metrics[i].nvmlReturn = pynvml.NVML_SUCCESS
            self.metric_calls += 1
            return mg

        patches = {
            "nvmlInit": lambda: None, "nvmlShutdown": lambda: None,
            "nvmlDeviceGetHandleByIndex": handle_by_index, "nvmlDeviceGetHandleByUUID": handle_by_uuid,
            "nvmlDeviceGetName": lambda h: "Fake H200",
            "nvmlDeviceGetUtilizationRates": util,
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=2048 * (1 << 20), total=0, free=0),
            "nvmlDeviceGetPowerUsage": power,
            "nvmlDeviceGetClockInfo": lambda h, kind: 1980 if kind == pynvml.NVML_CLOCK_SM else 0,
            "nvmlGpmQueryDeviceSupport": gpm_support, "nvmlGpmSampleAlloc": sample_alloc,
            "nvmlGpmSampleGet": lambda h, s: s, "nvmlGpmSampleFree": sample_free, "nvmlGpmMetricsGet": metrics_get,
            "nvmlSystemGetDriverVersion": lambda: "999.1",
        }
        for name, fn in patches.items():
            monkeypatch.setattr(pynvml, name, fn)
        return self


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def run_window(device=0, interval=0.05, seconds=0.35):
    tel = GpuTelemetry(device, interval_s=interval).start()
    time.sleep(seconds)
    return tel.stop()


def test_no_gpu_gives_none_and_a_reason(monkeypatch):
    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    s = run_window(seconds=0.05)
    assert set(s.means) == set(METRIC_KEYS) and all(v is None for v in s.means.values())
    assert s.reason.startswith("no NVIDIA GPU: NVML init failed:") and s.timeline == []
    assert set(s.reasons) == set(METRIC_KEYS)
    rec = s.to_record()
    assert rec["telemetry_reason"] == s.reason and json.loads(rec["telemetry_timeline"]) == []


def test_this_machine_without_nvml():
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA GPU answers NVML here: this checks a machine without one")
    except pynvml.NVMLError:
        pass
    s = run_window(seconds=0.05)
    assert all(v is None for v in s.means.values()) and "NVML init failed" in s.reason


def test_cpu_device_is_not_sampled():
    s = GpuTelemetry("cpu").start().stop()
    assert all(v is None for v in s.means.values()) and s.reason == "no NVIDIA GPU: device is 'cpu'"


def test_sampler_means_with_gpm(monkeypatch):
    fake = FakeNvml().install(monkeypatch)
    s = run_window("cuda:1")
    assert s.reason is None and s.reasons == {}, s.reasons
    assert ("index", 1) in fake.calls and s.device.startswith("cuda:1 = Fake H200")
    assert len(s.timeline) >= 3 and all(set(row) == {"t_s", *METRIC_KEYS} for row in s.timeline)
    busy = [row["gpu_busy_pct"] for row in s.timeline]
    assert s.means["gpu_busy_pct"] == pytest.approx(sum(busy) / len(busy)) and set(busy) <= {30.0, 70.0}
    assert s.means["gpu_mem_used_mb"] == 2048.0 and s.means["gpu_power_w"] == 300.5
    assert s.means["sm_clock_mhz"] == 1980.0
    assert s.means["sm_util_pct"] == 42.0 and s.means["sm_occupancy_pct"] == 17.5
    # GPM pairs need >= 100 ms: with 50 ms sampling, about every other sample carries GPM values
    gpm_rows = [row for row in s.timeline if row["sm_util_pct"] is not None]
    assert 1 <= len(gpm_rows) < len(s.timeline) and fake.metric_calls == len(gpm_rows)
    times = [row["t_s"] for row in gpm_rows]
    assert all(b - a >= 0.099 for a, b in zip(times, times[1:]))
    assert sorted(fake.freed) == sorted(fake.allocated) and len(fake.allocated) == 2


@pytest.mark.parametrize("gpm", [False, pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)])
def test_gpm_unsupported_keeps_the_rest(monkeypatch, gpm):
    fake = FakeNvml(gpm=gpm).install(monkeypatch)
    s = run_window()
    assert s.means["sm_util_pct"] is None and s.means["sm_occupancy_pct"] is None
    assert all(s.means[k] is not None for k in ("gpu_busy_pct", "gpu_mem_used_mb", "gpu_power_w", "sm_clock_mhz"))
    assert "GPM unsupported" in s.reason and "sm_util_pct" in s.reason and "gpu_busy_pct" not in s.reason
    assert s.reasons["sm_util_pct"].startswith("GPM unsupported") and "gpu_busy_pct" not in s.reasons
    assert fake.allocated == [] and fake.metric_calls == 0


def test_one_failing_metric_is_none_not_zero(monkeypatch):
    FakeNvml(power_error=True).install(monkeypatch)
    s = run_window()
    assert s.means["gpu_power_w"] is None and all(row["gpu_power_w"] is None for row in s.timeline)
    assert "gpu_power_w" in s.reason and "Not Supported" in s.reasons["gpu_power_w"]
    assert s.means["gpu_busy_pct"] is not None and s.means["sm_util_pct"] == 42.0


def test_short_window_has_one_sample_and_explains_missing_gpm(monkeypatch):
    FakeNvml().install(monkeypatch)
    s = GpuTelemetry(0, interval_s=5.0).start().stop()   # stopped at once: only the final sample
    assert len(s.timeline) == 1 and s.means["gpu_mem_used_mb"] == 2048.0
    assert s.means["sm_util_pct"] is None and "too short" in s.reasons["sm_util_pct"]


def test_device_mapping_respects_cuda_visible_devices(monkeypatch):
    fake = FakeNvml().install(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    s = run_window("cuda:0", seconds=0.0)
    assert s.means["gpu_busy_pct"] is not None and fake.calls[-1] == ("index", 3)
    assert "CUDA_VISIBLE_DEVICES index 3" in s.device
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    run_window("cuda:1", seconds=0.0)
    assert fake.calls[-1] == ("uuid", "GPU-bbbb")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    s = run_window("cuda:2", seconds=0.0)
    assert all(v is None for v in s.means.values()) and "not visible" in s.reason
    with pytest.raises(ValueError):
        GpuTelemetry("cuda:x").start()


def test_record_columns_match_the_result_schema():
    from results.schema import RUN_COLUMNS
    assert set(T.TelemetrySummary({}, [], None).to_record()) <= set(RUN_COLUMNS)
    assert set(METRIC_KEYS) <= set(RUN_COLUMNS)


def test_environment_info(tmp_path):
    env = environment_info()
    assert list(env) == ["device_name", "torch_version", "cuda_version", "driver_version", "git_commit",
                         "hostname", "python_version", "platform"]
    assert env["torch_version"] and env["hostname"] and env["python_version"].count(".") == 2
    in_checkout = shutil.which("git") and (T._REPO / ".git").exists()
    if in_checkout:
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", env["git_commit"]), env["git_commit"]
    else:
        assert env["git_commit"] == "unknown"
    assert T._git_commit(tmp_path) == "unknown"
    from results.schema import RUN_COLUMNS
    assert set(env) <= set(RUN_COLUMNS)


def test_git_commit_and_dirty_flag(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("1")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert T._git_commit(tmp_path) == head
    (tmp_path / "new.txt").write_text("untracked files do not count")
    assert T._git_commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("2")
    assert T._git_commit(tmp_path) == head + "+dirty"


def test_self_check_cli_prints_json(capsys):
    assert T.main(["--seconds", "0.1", "--interval", "0.05"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["means"]) == set(METRIC_KEYS) and "environment" in out and "workload" in out
