"""Objectives: one engine run per Optuna trial, its row in the result store, its numbers back to Optuna.

`BenchObjective(trial)`:
  1. `space.to_config(trial, settings)` -> BenchConfig (the only trial -> config mapping, in studies/space.py);
  2. `session.run(config)` on a session loaded once per worker process (`SessionPool`) and reused across trials;
  3. the run record, with `study` and `trial_id` (= Optuna trial number) set, is appended to the result store;
  4. returns the objective values (`ObjectiveSpec.metrics`, e.g. tokens/s, or tokens/s + peak memory + p99 TPOT).

Quality is a second constraint: a quantized target is lossy, and the user bounds its cost. Constraint "quality" =
percentage points by which the run's `quant_ppl_delta_pct` (held-out perplexity increase over the unquantized target,
workbench.harness.quality) exceeds the knob `max_ppl_increase_pct` (default +2 %); > 0 makes the trial infeasible
the same way, with the reason in `infeasible_reason`.

Fidelity is a constraint, not a penalty: at temperature 0 a run whose `greedy_matches_ar` is False gets constraint
"fidelity" = 1.0 (`trial.set_constraint`, which Optuna 5 asks for instead of the deprecated sampler
`constraints_func`; TPE and NSGA-II both read it) and user attrs `feasible` = False, `infeasible_reason`; the trial
stays COMPLETE with its measurements but never counts as best (`study.best_trial`) or on the Pareto front
(`study.best_trials`). Every complete trial gets the constraint (0.0 when feasible).

Trust is a filter on the reports, not a constraint: the run record's `noisy` / `noisy_reason` / `plausible` /
`implausible_reason` (workbench.harness.trust) are copied into user attrs; the objective values and the sampler are
untouched, but a flagged trial is *unreliable*: best settings, the Pareto front table and schedules skip it and say so
(`reliable_complete`, `exclusion_notes`).

A failing run (out of memory, a BenchError for a bad setting, any other exception) is a FAILED trial with its reason
in user attrs `error` / `error_type` and a row with status "failed" in the store; the objective raises `TrialFailed`,
which the study loop catches (`optimize(catch=(TrialFailed,))`) so the study goes on.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
import pandas as pd

from studies.space import METHOD_KNOBS, METHODS, SEARCH_KNOBS, RunSettings, SearchSpace, make_config, split_params
from workbench.settings import AUTO, AUTO_KNOBS, KNOBS


class TrialFailed(Exception):
    """The engine run of a trial failed; the reason is recorded in the trial's user attrs and in the store."""


@dataclass(frozen=True)
class ObjectiveSpec:
    """Which run-record metrics are returned to Optuna, and in which direction each is optimized."""

    name: str
    metrics: tuple[str, ...]
    directions: tuple[str, ...]

    def __post_init__(self) -> None:
        assert len(self.metrics) == len(self.directions) and self.metrics


THROUGHPUT = ObjectiveSpec("throughput", ("tokens_per_s",), ("maximize",))
SPEEDUP = ObjectiveSpec("speedup", ("speedup_vs_ar",), ("maximize",))
PARETO = ObjectiveSpec("pareto", ("tokens_per_s", "peak_mem_mb", "tpot_ms_p99"), ("maximize", "minimize", "minimize"))
# weight formats: speed against the quantized target's held-out perplexity cost (0 for an unquantized target)
QUALITY_FRONT = ObjectiveSpec("quality", ("tokens_per_s", "quant_ppl_delta_pct"), ("maximize", "minimize"))
OBJECTIVES = {o.name: o for o in (THROUGHPUT, SPEEDUP, PARETO, QUALITY_FRONT)}

# run-record fields copied into every trial's user attrs (what reports and the UI show without the store)
SUMMARY_FIELDS = ("tokens_per_s", "ar_tokens_per_s", "speedup_vs_ar", "peak_mem_mb", "tpot_ms_p99", "acceptance_rate",
                  "mean_accepted_tokens", "greedy_matches_ar", "speedup_ci_low", "speedup_ci_high", "noisy",
                  "noisy_reason", "plausible", "implausible_reason", "quant_ppl_delta_pct", "quant_token_agreement",
                  "quant_acceptance_delta", "draft_path")

# Optuna's fANOVA importances from fewer completed trials than this rank noise as often as knobs: say so beside them.
IMPORTANCE_MIN_TRIALS = 20


FIDELITY = "fidelity"  # constraint name: > 0 when temperature-0 output differs from autoregressive decoding
QUALITY = "quality"  # constraint name: percentage points of perplexity increase above max_ppl_increase_pct
DEFAULT_PPL_BOUND = 2.0  # workbench.settings KNOBS["max_ppl_increase_pct"].default (kept torch-free here too)
REPORT_KNOBS = ("method", *SEARCH_KNOBS)  # the searchable knobs, shown per trial in reports


@dataclass(frozen=True)
class ModelSpec:
    """Which models a study runs: a zoo preset, or explicit target / draft paths (both may be given), and the prompt
    file (default: the preset's held-out prompts; required with explicit paths)."""

    preset: str | None = "tiny"
    model: str | None = None
    draft: str | None = None
    prompts: str | None = None
    draft_head: str | None = None  # a published EAGLE-1/2 or EAGLE-3 checkpoint folder (--draft-head)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SessionPool:
    """Loaded BenchSessions of this process, keyed by (models, device, dtype): a worker loads each model once."""

    def __init__(self) -> None:
        self._sessions: dict[tuple, Any] = {}

    def get(self, models: ModelSpec, device: str, dtype: str) -> Any:
        key = (models.preset, models.model, models.draft, models.prompts, models.draft_head, device, dtype)
        if key not in self._sessions:
            from workbench.harness.bench import BenchSession

            self._sessions[key] = BenchSession.load(preset=models.preset, model=models.model, draft=models.draft,
                                                    device=device, dtype=dtype, prompts=models.prompts,
                                                    draft_head=models.draft_head)
        return self._sessions[key]


POOL = SessionPool()


def is_out_of_memory(exc: BaseException) -> bool:
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except ImportError:
        pass
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


def _release_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # best effort only: never turn a recorded failure into a crash
        pass


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _plain(value: Any) -> Any:
    """A JSON-friendly copy of a record value (numpy scalars -> Python) for Optuna user attrs."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            return value.item()
        except (ValueError, AttributeError):
            pass
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


class BenchObjective:
    """Callable objective for `study.optimize`. `session_for(dtype)` returns the (cached) engine session to use."""

    def __init__(self, *, space: SearchSpace, settings: RunSettings, objective: ObjectiveSpec, store: Any,
                 study_name: str, device: str, models: ModelSpec,
                 session_for: Callable[[str], Any] | None = None) -> None:
        self.space, self.settings, self.objective, self.store = space, settings, objective, store
        self.study_name, self.device, self.models = study_name, device, models
        self.session_for = session_for or (lambda dtype: POOL.get(models, device, dtype))
        # trial time (results.schema group "trial_time"): a trial runs from the end of the previous store write
        self._trial_start = time.perf_counter()
        self._prev_store_s: float | None = None

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, ...]:
        trial.set_user_attr("worker", worker_name())
        trial.set_user_attr("device", self.device)
        params: dict[str, Any] = {}
        config = session = None
        try:
            params = {**self.settings.to_dict(), **self.space.suggest(trial)}
            config = make_config(params)
            params = {**_config_dict(config), **split_params(params)[1]}  # engine defaults filled in, + dtype
            trial.set_user_attr("config", params)
            session = self.session_for(params.get("dtype", KNOBS["dtype"].default))
            result = session.run(config)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded FAILED trial
            self._fail(trial, params, exc, config, session)
        record = dict(result.record)
        record.update(study=self.study_name, trial_id=trial.number)
        resolved = {k: _plain(record[k]) for k in AUTO_KNOBS if params.get(k) == AUTO and k in record}
        if resolved:  # what "auto" became on this device, as the row holds it
            params = {**params, **resolved}
            trial.set_user_attr("config", params)
        run_id = self._append(record, getattr(result, "traces", None))
        trial.set_user_attr("run_id", run_id)
        trial.set_user_attr("status", "ok")
        for name in SUMMARY_FIELDS:
            if name in record:
                trial.set_user_attr(name, _plain(record[name]))
        self._check_fidelity(trial, params, record)
        values = []
        for metric in self.objective.metrics:
            value = _plain(record.get(metric))
            if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
                reason = f"the engine reported no usable {metric} ({record.get(metric)!r}) on {self.device}"
                trial.set_user_attr("status", "failed")
                trial.set_user_attr("error", reason)
                raise TrialFailed(reason)
            values.append(float(value))
        return values[0] if len(values) == 1 else tuple(values)

    def _check_fidelity(self, trial: optuna.Trial, params: dict[str, Any], record: dict[str, Any]) -> None:
        greedy = float(params.get("temperature", record.get("temperature", 0.0)) or 0.0) == 0.0
        matches = _plain(record.get("greedy_matches_ar"))
        # bf16/fp16: a divergence only at numerical near-ties (workbench.harness.bench.NEAR_TIE_LOGITS) is not a fidelity loss
        near_tie = bool(_plain(record.get("greedy_near_tie")) or False)
        violated = greedy and matches is not None and not bool(matches) and not near_tie
        if greedy and matches is False and near_tie:
            trial.set_user_attr("fidelity", "low-precision near-tie divergence only (greedy_near_tie)")
        trial.set_constraint(FIDELITY, 1.0 if violated else 0.0)  # > 0: infeasible, for sampler and best_trial(s)
        over = self._quality_excess(params, record)
        trial.set_constraint(QUALITY, over)
        trial.set_user_attr("feasible", not violated and over == 0.0)
        reasons = []
        if violated:
            reasons.append("temperature 0 output differs from autoregressive decoding")
        elif greedy and matches is None and record.get("method") != "ar":  # "ar" is the reference itself
            trial.set_user_attr("fidelity", "unchecked: the engine did not report greedy_matches_ar")
        if over > 0.0:
            reasons.append(f"quantized target's held-out perplexity +{_plain(record['quant_ppl_delta_pct']):.3g} % "
                           f"exceeds the bound {self._ppl_bound(params, record):.3g} % (max_ppl_increase_pct)")
        if reasons:
            trial.set_user_attr("infeasible_reason", "; ".join(reasons))

    @staticmethod
    def _ppl_bound(params: dict[str, Any], record: dict[str, Any]) -> float:
        return float(params.get("max_ppl_increase_pct", record.get("max_ppl_increase_pct", DEFAULT_PPL_BOUND)))

    def _quality_excess(self, params: dict[str, Any], record: dict[str, Any]) -> float:
        """Percentage points of held-out perplexity increase above the user's bound (0 when within it, or when the
        engine measured none: an unquantized target has delta 0 by definition)."""
        delta = _plain(record.get("quant_ppl_delta_pct"))
        if delta is None or not isinstance(delta, (int, float)) or not math.isfinite(delta):
            return 0.0
        return max(0.0, float(delta) - self._ppl_bound(params, record))

    def _fail(self, trial: optuna.Trial, params: dict[str, Any], exc: Exception, config: Any, session: Any) -> None:
        oom = is_out_of_memory(exc)
        if oom:
            _release_memory()
        reason = f"{'out of memory: ' if oom else ''}{type(exc).__name__}: {exc}".strip()
        trial.set_user_attr("status", "failed")
        trial.set_user_attr("error", reason)
        trial.set_user_attr("error_type", "oom" if oom else type(exc).__name__)
        record = failed_record(params, reason, study=self.study_name, trial_id=trial.number, device=self.device,
                               models=self.models, config=config, session=session)
        trial.set_user_attr("run_id", self._append(record, None))
        raise TrialFailed(reason) from exc

    def _append(self, record: dict[str, Any], traces: Any) -> str:
        """The store write of a trial's row, with the trial-time columns that only the worker loop knows: trial_s,
        trial_other_s (trial_s less what the engine timed; None when it timed nothing, e.g. a failed run) and the
        previous write's seconds (a row cannot carry its own)."""
        start = time.perf_counter()
        trial_s = start - self._trial_start
        parts = [record.get(k) for k in ("trial_engine_s", "trial_warmup_s", "wall_s", "trial_quality_s")]
        timed = all(isinstance(v, (int, float)) and math.isfinite(v) for v in parts)
        record.update(trial_s=trial_s, trial_other_s=trial_s - sum(parts) if timed else None,
                      trial_prev_store_s=self._prev_store_s)
        run_id = self.store.append(record, traces)
        self._trial_start = time.perf_counter()
        self._prev_store_s = self._trial_start - start
        return run_id


def _config_dict(config: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(config):
        return {k: _plain(v) for k, v in dataclasses.asdict(config).items()}
    return dict(vars(config))


def failed_record(params: dict[str, Any], error: str, *, study: str, trial_id: int, device: str,
                  models: ModelSpec, config: Any = None, session: Any = None) -> dict[str, Any]:
    """A result-store row for a run that produced no measurements: its settings, the reason, the environment.

    Built by the engine's `workbench.harness.bench.failed_record` when the config was built (so the row matches the
    engine's own failure rows); what it cannot know (no session loaded yet) is filled from this worker's settings.
    """
    record: dict[str, Any] = {}
    if config is not None:
        try:
            from workbench.harness.bench import BenchSession, failed_record as engine_failed_record

            real_session = session if isinstance(session, BenchSession) else None
            record = engine_failed_record(config, error, study=study, trial_id=trial_id, session=real_session)
        except ImportError:
            record = {}
    if not record:
        try:
            from workbench.harness.telemetry import environment_info

            record.update(environment_info())
        except Exception:  # noqa: BLE001 - the environment is nice to have on a failure row, never required
            pass
        record.update(params)
        record.update(config_json=json.dumps(params, sort_keys=True, default=str))
    record.update(study=study, trial_id=trial_id, status="failed", error=error)
    for key, value in (("device", device), ("dtype", params.get("dtype")), ("preset", models.preset),
                       ("target_path", models.model), ("draft_path", models.draft),
                       ("draft_head", models.draft_head)):
        if record.get(key) is None and value is not None:
            record[key] = value
    return record


# ---- reports --------------------------------------------------------------------------------------------------
def trials_frame(study: optuna.Study) -> pd.DataFrame:
    """One row per trial: number, state, params, objective values (named by metric), key user attrs."""
    metrics = study.metric_names or [f"value{i}" for i in range(len(study.directions))]
    rows = []
    for t in study.get_trials(deepcopy=False):
        row: dict[str, Any] = {"trial": t.number, "state": t.state.name}
        config = t.user_attrs.get("config") or t.params
        row.update({k: config[k] for k in REPORT_KNOBS if k in config})
        used = METHODS[config["method"]].knobs if config.get("method") in METHODS else ()
        for k in METHOD_KNOBS:
            if k in row and k not in used:
                row[k] = None  # e.g. k of an autoregressive run: set in BenchConfig but meaningless
        for i, m in enumerate(metrics):
            row[m] = t.values[i] if t.values is not None else None
        for k in ("speedup_vs_ar", "acceptance_rate", "feasible", "noisy", "plausible", "error"):
            if k in t.user_attrs and k not in row:
                row[k] = t.user_attrs[k]
        rows.append(row)
    return pd.DataFrame(rows)


def feasible_complete(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if t.user_attrs.get("feasible", True)]


def unreliable_reason(t: optuna.trial.FrozenTrial) -> str | None:
    """Why a trial's numbers cannot be trusted (its run was implausible and/or noisy), or None.

    A trial recorded before these flags existed (no user attrs) counts as reliable.
    """
    reasons = []
    if t.user_attrs.get("plausible") is False:
        reasons.append(f"implausible: {t.user_attrs.get('implausible_reason') or 'no reason recorded'}")
    if t.user_attrs.get("noisy") is True:
        reasons.append(f"noisy: {t.user_attrs.get('noisy_reason') or 'no reason recorded'}")
    return "; ".join(reasons) or None


def reliable_complete(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Feasible completed trials whose run was neither implausible nor noisy: what best settings may come from."""
    return [t for t in feasible_complete(study) if unreliable_reason(t) is None]


def exclusion_notes(study: optuna.Study) -> list[str]:
    """One line per feasible completed trial left out of best settings, e.g.
    "excluded: trial 7 (implausible: speedup 3.19x > bound 2.2x (...))"."""
    return [f"excluded: trial {t.number} ({why})" for t in feasible_complete(study)
            if (why := unreliable_reason(t)) is not None]


def importance_caveat(study: optuna.Study) -> str | None:
    """A warning to show beside parameter importances computed from too few completed trials, else None."""
    n = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
    if n >= IMPORTANCE_MIN_TRIALS:
        return None
    return (f"importances from {n} completed trial(s) (fewer than {IMPORTANCE_MIN_TRIALS}): a rough hint, not a "
            "ranking; they change as trials are added")


def _dominates(a: list[float], b: list[float], signs: list[int]) -> bool:
    return all(s * x >= s * y for s, x, y in zip(signs, a, b)) and any(s * x > s * y for s, x, y in zip(signs, a, b))


def pareto_front(study: optuna.Study) -> pd.DataFrame:
    """The Pareto-optimal trials among the reliable feasible ones (`reliable_complete`), as a table.

    Computed here rather than taken from Optuna's best_trials so a flagged trial on Optuna's front does not hide the
    reliable trials it dominates."""
    signs = [1 if d == optuna.study.StudyDirection.MAXIMIZE else -1 for d in study.directions]
    ok = [t for t in reliable_complete(study) if t.values is not None]
    numbers = {t.number for t in ok if not any(_dominates(o.values, t.values, signs) for o in ok)}
    df = trials_frame(study)
    return df[df["trial"].isin(numbers)].reset_index(drop=True) if len(df) else df
