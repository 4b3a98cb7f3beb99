"""A study = an Optuna study + the spec that says what its trials run (script, search space, run settings, models).

The spec is stored in the study's user attrs, so any worker (`python -m studies.worker`) that joins the study by name
runs exactly the same trials as the process that created it; and re-running `studies.run` with another search
space or objective under an existing name is refused (`StudyMismatchError` names the study and what differs).
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from studies.objective import OBJECTIVES, BenchObjective, ModelSpec, ObjectiveSpec, TrialFailed
from studies.space import GLOBAL_KNOBS, METHODS, RunSettings, SearchSpace, SpaceError, dim_values, make_config
from workbench.settings import SettingError, check as check_settings

SPEC_KEY = "workbench_spec"
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
    for knob in (*METHODS[method].knobs, *GLOBAL_KNOBS):
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


# ---- the worker loop (shared by studies.run and studies.worker) ----------------------------------------------
def counted_trials(study: optuna.Study) -> tuple[int, int]:
    """(trials that count toward the target, trials waiting to run).

    A FAIL trial without our `status` user attr died with its worker (heartbeat-stale): its re-queued copy counts
    instead, so it is not counted twice.
    """
    n, waiting = 0, 0
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING:
            waiting += 1
        elif t.state != TrialState.FAIL or "status" in t.user_attrs:
            n += 1
    return n, waiting


def run_trials(study: optuna.Study, spec: StudySpec, *, store: Any, device: str, n_trials: int | None = None,
               session_for: Callable[[str], Any] | None = None,
               on_trial: Callable[[optuna.Study, optuna.trial.FrozenTrial], None] | None = None) -> int:
    """Run trials of `study` in this process until this worker did `n_trials`, or the study's target is reached
    (user attr target_trials; waiting re-queued trials are still run). Returns how many trials this call ran."""
    from studies.scripts import get_script

    script = get_script(spec.script)
    objective = BenchObjective(space=spec.space, settings=spec.settings, objective=spec.objective, store=store,
                               study_name=study.study_name, device=device, models=spec.models,
                               session_for=session_for)
    target = study.user_attrs.get(TARGET_KEY)
    done = 0
    while n_trials is None or done < n_trials:
        counted, waiting = counted_trials(study)
        if target is not None and counted >= target and waiting == 0:
            break
        if target is None and n_trials is None:
            raise ValueError("give n_trials or set the study's target_trials")
        if waiting == 0 and script.next_params is not None:
            fixed = script.next_params(study, spec)
            if fixed:
                study.enqueue_trial(fixed)
        study.optimize(objective, n_trials=1, catch=(TrialFailed,),
                       callbacks=[on_trial] if on_trial is not None else None)
        done += 1
    return done


