"""A study = an Optuna study + the spec that says what its trials run (script, search space, run settings, models).

The spec is stored in the study's user attrs, so any worker (`python -m studies.worker`) that joins the study by name
runs exactly the same trials as the process that created it; and re-running `studies.run` with another search
space or objective under an existing name is refused (`StudyMismatchError` names the study and what differs).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from studies.objective import OBJECTIVES, BenchObjective, ModelSpec, ObjectiveSpec, TrialFailed
from studies.scripts import get_script
from studies.space import (GLOBAL_KNOBS, METHODS, RunSettings, SearchSpace, SpaceError, dim_values, make_config,
                           searched_knobs)
from studies.storage import SPEC_KEY
from workbench.settings import SettingError, check as check_settings

TARGET_KEY = "target_trials"
SPEC_VERSION = 1


class StudyMismatchError(ValueError):
    """An existing study was created with another search space, objective or models than the one asked for."""


class StudyNotFoundError(KeyError):
    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


@dataclass(frozen=True)
class StudySpec:
    script: str
    objective: ObjectiveSpec
    space: SearchSpace
    settings: RunSettings
    models: ModelSpec
    sampler: str = "tpe"

    def to_dict(self) -> dict[str, Any]:
        return {"spec_version": SPEC_VERSION, "script": self.script, "objective": self.objective.name,
                "metrics": list(self.objective.metrics), "directions": list(self.objective.directions),
                "space": self.space.to_dict(), "settings": self.settings.to_dict(), "models": self.models.to_dict(),
                "sampler": self.sampler}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StudySpec":
        return cls(script=d["script"], objective=OBJECTIVES[d["objective"]], space=SearchSpace.from_dict(d["space"]),
                   settings=RunSettings.from_dict(d["settings"]), models=ModelSpec(**d["models"]),
                   sampler=d.get("sampler", "tpe"))

    def validate(self) -> None:
        """Each knob's values, then the rules between knobs (e.g. a batch above the largest CUDA-graph bucket) on
        each method's hardest setting (`hardest`): a study that could only fail is refused before it is created."""
        self.space.validate()
        self.settings.validate()
        for method in self.space.methods:
            try:
                check_settings(hardest(self, method))
            except SettingError as e:
                raise SpaceError(str(e)) from None


def hardest(spec: StudySpec, method: str) -> dict[str, Any]:
    """The run settings plus the most demanding value of every dimension for `method`: the largest of each number
    (smallest ngram_min) and True for a boolean that can be on; a text knob (dtype, compile) keeps its first choice."""
    dims = spec.space.dims()
    params: dict[str, Any] = {**spec.settings.to_dict(), "method": method}
    for knob in (*searched_knobs(method), *GLOBAL_KNOBS):
        values = dim_values(knob, dims[knob])
        numeric = all(isinstance(v, (int, float)) for v in values)
        params[knob] = (min if knob == "ngram_min" else max)(values) if numeric else values[0]
    return params


def make_sampler(spec: StudySpec, seed: int | None = None) -> optuna.samplers.BaseSampler:
    """TPE (default) or NSGA-II; both honour the trials' "fidelity" constraint. Seed None: workers must not share
    a seed (they would sample the same startup trials)."""
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    if spec.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=8, seed=seed)
    if spec.sampler == "tpe":
        # multivariate + group: TPE models the method-conditional knobs (k only for draft/ngram) jointly
        return optuna.samplers.TPESampler(multivariate=True, group=True, n_startup_trials=6, seed=seed)
    raise ValueError(f"unknown sampler {spec.sampler!r}: use tpe or nsga2")


def _diff(stored: Any, given: Any, path: str = "") -> list[str]:
    if isinstance(stored, dict) and isinstance(given, dict):
        out: list[str] = []
        for key in sorted(set(stored) | set(given)):
            out += _diff(stored.get(key), given.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if stored == given else [f"{path}: study has {json.dumps(stored)}, asked for {json.dumps(given)}"]


def create_or_resume(storage: optuna.storages.BaseStorage, name: str, spec: StudySpec | None, *,
                     target_trials: int | None = None, seed: int | None = None) -> tuple[optuna.Study, StudySpec]:
    """Create study `name` with `spec`, or resume it. With spec None the study must exist (its spec is used).

    Raises StudyMismatchError when the study exists with another spec, StudyNotFoundError when spec is None and
    there is no such study.
    """
    try:
        storage.get_study_id_from_name(name)
        exists = True
    except KeyError:
        exists = False
    if not exists:
        if spec is None:
            raise StudyNotFoundError(f"no study named {name!r} in this storage; create it with "
                                     f"`python -m studies.run --study {name} --workers 0 ...`")
        spec.validate()
        try:
            study = optuna.create_study(study_name=name, storage=storage, directions=list(spec.objective.directions),
                                        sampler=make_sampler(spec, seed))
            study.set_user_attr(SPEC_KEY, spec.to_dict())
            study.set_metric_names(list(spec.objective.metrics))
            if target_trials is not None:
                study.set_user_attr(TARGET_KEY, int(target_trials))
            return study, spec
        except optuna.exceptions.DuplicatedStudyError:
            pass  # another process created it a moment ago: resume it like any existing study
    study = load_study(storage, name)
    stored = StudySpec.from_dict(study.user_attrs[SPEC_KEY])
    if spec is not None:
        given = spec.to_dict()
        stored_d = stored.to_dict()  # read back: knobs the study predates show their defaults, which its trials ran
        dirs = [d.name.lower() for d in study.directions]
        problems = _diff(stored_d, given)
        if dirs != list(spec.objective.directions):
            problems.insert(0, f"directions: study has {dirs}, asked for {list(spec.objective.directions)}")
        if problems:
            raise StudyMismatchError(f"study {name!r} already exists with a different search space or objective:\n  "
                                     + "\n  ".join(problems)
                                     + "\nuse another --study name, or the same settings to resume it")
    if target_trials is not None:
        study.set_user_attr(TARGET_KEY, int(target_trials))
    return optuna.load_study(study_name=name, storage=storage, sampler=make_sampler(stored, seed)), stored


def load_study(storage: optuna.storages.BaseStorage, name: str) -> optuna.Study:
    try:
        study = optuna.load_study(study_name=name, storage=storage, sampler=optuna.samplers.RandomSampler())
    except KeyError:
        raise StudyNotFoundError(f"no study named {name!r} in this storage; create it with "
                                 f"`python -m studies.run --study {name} --workers 0 ...`") from None
    if SPEC_KEY not in study.user_attrs:
        raise StudyMismatchError(f"study {name!r} exists but was not created by studies.run (it has no "
                                 f"{SPEC_KEY!r} user attr): pick another --study name")
    return study


def preflight(spec: StudySpec, session: Any) -> None:
    """Ask a loaded engine session whether the space's extreme settings can run at all (longest draft, largest
    batch, prompt + max_new_tokens within the models' context, a draft model present for method draft), so that a
    study that could only fail stops before its first trial. SpaceError names the method and the engine's reason."""
    check, encode = getattr(session, "check", None), getattr(session, "encode", None)
    if check is None or encode is None:
        return
    prompt_ids = encode(spec.settings.num_prompts)
    for method in spec.space.methods:
        params = hardest(spec, method)
        try:
            check(make_config(params), prompt_ids)
        except Exception as e:  # noqa: BLE001 - BenchError, or the engine's ValueError for a bad config
            shown = ", ".join(f"{k}={params[k]}" for k in ("method", *METHODS[method].knobs, "batch",
                                                          "max_new_tokens"))
            raise SpaceError(f"the engine refuses {shown}: {e}") from None


# ---- trials whose worker is gone ---------------------------------------------------------------------------
# A trial records who runs it (user attrs worker_host, worker_pid, worker_pid_start, started_at). A RUNNING trial of
# this host whose process is gone is "stale": a killed worker never tells the storage, and SQLite / journal
# storages have no heartbeat, so it would stay RUNNING and count toward the study's total forever.
REQUEUED_KEY = "requeued_from"
REASON_KEY = "failed_reason"


def _process_start(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (/proc/<pid>/stat field 22), None when unknown or the
    process is gone or a zombie. Told apart from a later process that got the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # fields[0] is field 3 (state): the name may hold spaces and ")"
    return None if fields[0] in ("Z", "X") else int(fields[19])


def mark_owner(trial: optuna.Trial) -> None:
    trial.set_user_attr("worker_host", socket.gethostname())
    trial.set_user_attr("worker_pid", os.getpid())
    trial.set_user_attr("worker_pid_start", _process_start(os.getpid()))
    trial.set_user_attr("started_at", time.time())


def owner_alive(attrs: dict[str, Any]) -> bool | None:
    """Whether the process that runs a trial (its owner attrs) still runs; None when this host cannot tell (another
    host, or a trial started before trials recorded their owner)."""
    host, pid = attrs.get("worker_host"), attrs.get("worker_pid")
    if host != socket.gethostname() or not isinstance(pid, int):
        return None
    if os.path.isdir("/proc/self"):
        start = _process_start(pid)
        recorded = attrs.get("worker_pid_start")
        return start is not None and (recorded is None or start == recorded)  # same pid, other start: pid reused
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's live process
    return True


def fail_and_requeue(study: optuna.Study, trial: optuna.trial.FrozenTrial, reason: str) -> bool:
    """Mark a RUNNING trial FAIL with user attr failed_reason, and enqueue its parameters again (user attr
    requeued_from = its number). False when another process finished it first: then only that one re-queues it
    (the storage refuses the second FAIL), so two sweeping workers never re-queue a trial twice."""
    storage = study._storage
    try:
        storage.set_trial_user_attr(trial._trial_id, REASON_KEY, reason)
        storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    requeue(study, trial)
    return True


def requeue(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Enqueue the parameters `trial` was given (a script's fixed ones too, even if it died before asking for them)."""
    params = {**trial.system_attrs.get("fixed_params", {}), **trial.params}
    study.enqueue_trial(params, user_attrs={REQUEUED_KEY: trial.number})


def sweep_stale_trials(study: optuna.Study, log: Callable[[str], None] = print) -> list[int]:
    """Fail and re-queue every RUNNING trial of this host whose worker process is gone; log the RUNNING trials this
    host cannot check. Returns the numbers of the trials failed here."""
    failed, unknown = [], []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        alive = owner_alive(t.user_attrs)
        if alive is None:
            unknown.append(t)
            continue
        if alive:
            continue
        owner = f"{t.user_attrs['worker_host']}:{t.user_attrs['worker_pid']}"
        if fail_and_requeue(study, t, f"stale: worker {owner} is gone"):
            failed.append(t.number)
            log(f"trial {t.number} was RUNNING in worker {owner}, which is gone: marked FAIL, its parameters "
                f"re-queued")
    for t in unknown:
        where = t.user_attrs.get("worker_host")
        who = f"on host {where} (pid {t.user_attrs.get('worker_pid')})" if where else "by an unknown worker"
        log(f"trial {t.number} is RUNNING {who}: cannot check it from {socket.gethostname()}; it counts toward the "
            f"total until it ends (a PostgreSQL storage's heartbeat fails it if its worker died)")
    return failed


class Cancelled(KeyboardInterrupt):
    """SIGTERM (a dashboard Cancel, `kill`) while trials run: raised in the main thread so the running trial is
    failed and re-queued the way Optuna handles Ctrl-C, instead of the process dying with the trial RUNNING."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)


# ---- the worker loop (shared by studies.run and studies.worker) ----------------------------------------------
def counted_trials(study: optuna.Study) -> tuple[int, int]:
    """(trials that count toward the target, trials waiting to run).

    A FAIL trial without our `status` user attr died with its worker (heartbeat-stale, interrupted), and one with
    `failed_reason` was failed by `sweep_stale_trials` or a cancel: its re-queued copy counts instead, so it is not
    counted twice. RUNNING trials count (they are being run).
    """
    n, waiting = 0, 0
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING:
            waiting += 1
        elif t.state != TrialState.FAIL or ("status" in t.user_attrs and REASON_KEY not in t.user_attrs):
            n += 1
    return n, waiting


def run_trials(study: optuna.Study, spec: StudySpec, *, store: Any, device: str, n_trials: int | None = None,
               session_for: Callable[[str], Any] | None = None,
               on_trial: Callable[[optuna.Study, optuna.trial.FrozenTrial], None] | None = None,
               sweep: bool = True) -> int:
    """Run trials of `study` in this process until this worker did `n_trials`, or the study's target is reached
    (user attr target_trials; waiting re-queued trials are still run). Returns how many trials this call ran.

    First (unless `sweep` is False: the caller did it) fails and re-queues the stale trials of dead workers on
    this host (`sweep_stale_trials`). SIGTERM (handled when called in the main thread) or Ctrl-C fails the running
    trial with a `failed_reason`, re-queues it and raises KeyboardInterrupt (`Cancelled` for SIGTERM)."""
    script = get_script(spec.script)
    objective = BenchObjective(space=spec.space, settings=spec.settings, objective=spec.objective, store=store,
                               study_name=study.study_name, device=device, models=spec.models,
                               session_for=session_for)
    target = study.user_attrs.get(TARGET_KEY)
    if target is None and n_trials is None:
        raise ValueError("give n_trials or set the study's target_trials")
    if sweep:
        sweep_stale_trials(study)
    current: list[int] = []  # trial id of the running trial
    terminated: list[int] = []  # the signal, once SIGTERM arrived

    def on_sigterm(signum: int, frame: Any) -> None:
        signal.signal(signum, signal.SIG_IGN)  # a second SIGTERM must not interrupt the clean-up
        terminated.append(signum)
        raise Cancelled(signum)

    def owned_objective(trial: optuna.Trial) -> float | tuple[float, ...]:
        current[:] = [trial._trial_id]
        try:
            mark_owner(trial)
            return objective(trial)
        except (KeyboardInterrupt, TrialFailed) as e:
            # an exception raised inside torch's C++ calls comes back as a RuntimeError: the flag tells
            if isinstance(e, KeyboardInterrupt) or terminated:
                signame = "SIGTERM" if isinstance(e, Cancelled) or terminated else "SIGINT"
                trial.set_user_attr(REASON_KEY, f"cancelled: worker {socket.gethostname()}:{os.getpid()} got "
                                                f"{signame}")
                if not isinstance(e, KeyboardInterrupt):
                    raise Cancelled() from e
            raise

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    done = 0
    try:
        while n_trials is None or done < n_trials:
            counted, waiting = counted_trials(study)
            if target is not None and counted >= target and waiting == 0:
                break
            if waiting == 0 and script.next_params is not None:
                fixed = script.next_params(study, spec)
                if fixed:
                    study.enqueue_trial(fixed)
            study.optimize(owned_objective, n_trials=1, catch=(TrialFailed,),
                           callbacks=[on_trial] if on_trial is not None else None)
            done += 1
            if terminated:  # the exception was swallowed (raised in a __del__, say) and the trial ran to its end
                raise Cancelled()
    except KeyboardInterrupt:
        if in_main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _requeue_interrupted(study, current)
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    return done


def _requeue_interrupted(study: optuna.Study, current: list[int]) -> None:
    """After an interrupt: re-queue the trial Optuna failed with our failed_reason; fail and re-queue it when the
    interrupt came between Optuna's steps and left it RUNNING."""
    if not current:
        return
    t = study._storage.get_trial(current[0])
    if t.state == TrialState.RUNNING:
        fail_and_requeue(study, t, f"cancelled: worker {socket.gethostname()}:{os.getpid()} was interrupted")
    elif t.state == TrialState.FAIL and REASON_KEY in t.user_attrs:
        requeue(study, t)
