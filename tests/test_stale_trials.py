"""No lost trials: a study process killed mid-trial (SIGKILL) or cancelled (SIGTERM, the dashboard's Cancel) must not
leave a RUNNING trial that counts toward --trials forever.

Real `python -m studies.run` processes on the tiny preset (CPU, one thread), killed while a trial runs; the storage is
read with Optuna as any other process would.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from studies.storage import open_storage
from studies.study import (REASON_KEY, REQUEUED_KEY, _process_start, counted_trials, owner_alive,
                           sweep_stale_trials)

REPO = Path(__file__).resolve().parents[1]
STUDY = "k2"


def _args(storage: str, store: Path, trials: int) -> list[str]:
    return [sys.executable, "-m", "studies.run", "--preset", "tiny", "--study", STUDY, "--trials", str(trials),
            "--storage", storage, "--store", str(store), "--max-new-tokens", "16", "--num-prompts", "2",
            "--threads", "1", "--repeats", "3"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


_STORAGES: dict[str, optuna.storages.BaseStorage] = {}


def _trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    if storage not in _STORAGES:  # one per URL: a journal is replayed incrementally, not from the start per poll
        _STORAGES[storage] = open_storage(storage)
    try:
        return optuna.load_study(study_name=STUDY, storage=_STORAGES[storage]).get_trials(deepcopy=False)
    except KeyError:  # not created yet
        return []


def _start_and_stop_mid_trial(storage: str, store: Path, trials: int, sig: int) -> tuple[subprocess.Popen, int, str]:
    """Start a study, send `sig` once a trial is COMPLETE and the next one RUNNING (with its owner recorded).
    Returns the process (exited), the number of the trial that was running, and the process's output."""
    proc = subprocess.Popen(_args(storage, store, trials), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    running = None
    while running is None and time.time() < deadline and proc.poll() is None:
        ts = _trials(storage)
        busy = [t for t in ts if t.state == TrialState.RUNNING and "worker_pid" in t.user_attrs]
        if busy and any(t.state == TrialState.COMPLETE for t in ts):
            running = busy[0].number
            proc.send_signal(sig)
        else:
            time.sleep(0.1)
    out, _ = proc.communicate(timeout=60)
    assert running is not None, f"no trial was seen running after a complete one:\n{out}"
    return proc, running, out


def _by_number(storage: str) -> dict[int, optuna.trial.FrozenTrial]:
    return {t.number: t for t in _trials(storage)}


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_killed_study_fails_its_stale_trial_and_still_reaches_its_total(tmp_path, kind):
    storage = f"sqlite:///{tmp_path}/st.db" if kind == "sqlite" else f"journal:///{tmp_path}/st.log"
    store = tmp_path / "store"
    proc, stale, out = _start_and_stop_mid_trial(storage, store, 2, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert _by_number(storage)[stale].state == TrialState.RUNNING, out  # what a SIGKILL leaves behind

    swept = ""
    if kind == "journal":  # the sweep alone, as the dashboard runs it after a Cancel (studies.run does it too)
        sweep = subprocess.run([sys.executable, "-m", "studies.worker", "--storage", storage, "--study", STUDY,
                                "--sweep"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
        assert sweep.returncode == 0 and "1 stale trial(s) failed and re-queued" in sweep.stdout, sweep.stderr
        swept = sweep.stdout
    again = subprocess.run(_args(storage, store, 2), cwd=REPO, env=_env(), capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (f"trial {stale} was RUNNING in worker {socket.gethostname()}:{proc.pid}, which is gone"
            in swept + again.stdout)

    trials = _by_number(storage)
    dead = trials[stale]
    assert dead.state == TrialState.FAIL
    assert dead.user_attrs[REASON_KEY] == f"stale: worker {socket.gethostname()}:{proc.pid} is gone"
    requeued = [t for t in trials.values() if t.user_attrs.get(REQUEUED_KEY) == stale]
    assert len(requeued) == 1 and requeued[0].state == TrialState.COMPLETE
    assert dead.params.items() <= requeued[0].params.items()  # empty when killed before its first suggest
    assert sum(t.state == TrialState.COMPLETE for t in trials.values()) == 2
    assert not [t for t in trials.values() if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def test_sigterm_fails_and_requeues_the_running_trial(tmp_path):
    """The dashboard's Cancel sends SIGTERM to the job's process group: the running trial is failed with a reason and
    re-queued before the process exits, and resuming the study runs it."""
    storage = f"journal:///{tmp_path}/st.log"
    store = tmp_path / "store"
    proc, running, out = _start_and_stop_mid_trial(storage, store, 2, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "cancelled (SIGTERM)" in out

    trials = _by_number(storage)
    assert trials[running].state == TrialState.FAIL
    assert trials[running].user_attrs[REASON_KEY] == (f"cancelled: worker {socket.gethostname()}:{proc.pid} got "
                                                      f"SIGTERM")
    waiting = [t for t in trials.values() if t.state == TrialState.WAITING]
    assert len(waiting) == 1 and waiting[0].user_attrs[REQUEUED_KEY] == running
    study = optuna.load_study(study_name=STUDY, storage=_STORAGES[storage])
    assert counted_trials(study) == (1, 1)  # the cancelled trial does not count; its copy waits

    again = subprocess.run(_args(storage, store, 2), cwd=REPO, env=_env(), capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    trials = _by_number(storage)
    assert sum(t.state == TrialState.COMPLETE for t in trials.values()) == 2
    assert trials[waiting[0].number].state == TrialState.COMPLETE


# ---------------------------------------------------------------------------------------- owner checks, no study run
def test_owner_alive_tells_a_reused_pid_and_another_host_apart():
    me = {"worker_host": socket.gethostname(), "worker_pid": os.getpid(), "worker_pid_start": _process_start(os.getpid())}
    assert owner_alive(me) is True
    assert owner_alive({**me, "worker_pid_start": me["worker_pid_start"] + 1}) is False  # same pid, another process
    assert owner_alive({**me, "worker_host": "elsewhere"}) is None
    assert owner_alive({}) is None  # a trial from before trials recorded their owner
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert owner_alive({**me, "worker_pid": child.pid, "worker_pid_start": None}) is False


def test_sweep_leaves_live_and_unknown_trials_and_logs_the_unknown(tmp_path):
    study = optuna.create_study(storage=open_storage(f"journal:///{tmp_path}/st.log"), study_name="s")
    ours, theirs = study.ask(), study.ask()
    ours.suggest_int("k", 1, 8)
    ours.set_user_attr("worker_host", socket.gethostname())
    ours.set_user_attr("worker_pid", os.getpid())
    ours.set_user_attr("worker_pid_start", _process_start(os.getpid()))
    theirs.set_user_attr("worker_host", "node-7")
    theirs.set_user_attr("worker_pid", 4242)
    lines: list[str] = []
    assert sweep_stale_trials(study, log=lines.append) == []
    assert [t.state for t in study.get_trials()] == [TrialState.RUNNING, TrialState.RUNNING]
    assert len(lines) == 1 and "trial 1 is RUNNING on host node-7 (pid 4242): cannot check it" in lines[0]

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    study._storage.set_trial_user_attr(ours._trial_id, "worker_pid", dead.pid)
    study._storage.set_trial_user_attr(ours._trial_id, "worker_pid_start", None)
    assert sweep_stale_trials(study, log=lines.append) == [0]
    assert sweep_stale_trials(study, log=lines.append) == []  # failed once, re-queued once
    trials = study.get_trials()
    assert trials[0].state == TrialState.FAIL and trials[0].user_attrs[REASON_KEY].startswith("stale: worker")
    assert trials[2].state == TrialState.WAITING and trials[2].user_attrs[REQUEUED_KEY] == 0
    assert counted_trials(study) == (1, 1)


def test_dashboard_cancel_leaves_no_running_trial(tmp_path, monkeypatch):
    """ui.jobs Cancel (SIGTERM to the job's process group), then the runner's sweep (`studies.worker --sweep`)."""
    from ui import jobs

    monkeypatch.setenv("WORKBENCH_JOBS", str(tmp_path / "jobs"))
    storage = f"journal:///{tmp_path}/st.log"
    job = jobs.start_job("study", _args(storage, tmp_path / "store", 2), "k2", env={"OMP_NUM_THREADS": "1"},
                         params={"study": STUDY, "storage": storage})
    deadline = time.time() + 60
    while time.time() < deadline and job.status() == jobs.RUNNING:
        ts = _trials(storage)
        if any(t.state == TrialState.COMPLETE for t in ts) and any(
                t.state == TrialState.RUNNING and "worker_pid" in t.user_attrs for t in ts):
            job.cancel(wait_s=30)
            break
        time.sleep(0.1)
    assert job.status() == jobs.CANCELLED, job.log_tail()
    trials = _trials(storage)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    cancelled = [t for t in trials if t.state == TrialState.FAIL]
    assert len(cancelled) == 1 and cancelled[0].user_attrs[REASON_KEY].startswith("cancelled: worker")
    assert [t.user_attrs[REQUEUED_KEY] for t in trials if t.state == TrialState.WAITING] == [cancelled[0].number]
    assert "0 stale trial(s) failed and re-queued" in (tmp_path / "jobs" / job.id / "log.txt").read_text()
