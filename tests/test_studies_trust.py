"""Flagged (noisy or implausible) trials are kept out of best settings, Pareto tables and schedules, visibly; the
trust flags reach trial user attrs; importances carry a caveat below IMPORTANCE_MIN_TRIALS."""
from __future__ import annotations

import dataclasses

import optuna
import pytest

from results.store import ResultStore
from studies.objective import (IMPORTANCE_MIN_TRIALS, ModelSpec, exclusion_notes, importance_caveat, pareto_front,
                               reliable_complete)
from studies.schedule import build_schedule
from studies.scripts import best_trial, get_script
from studies.space import RunSettings
from studies.study import SPEC_KEY, StudySpec, create_or_resume, run_trials

optuna.logging.set_verbosity(optuna.logging.WARNING)
BATCH = optuna.distributions.CategoricalDistribution((1, 4))


def _spec(script: str, **space) -> StudySpec:
    s = get_script(script)
    return StudySpec(script=s.name, objective=s.objective, space=dataclasses.replace(s.space, **space),
                     settings=RunSettings(max_new_tokens=8, num_prompts=2, repeats=2, warmup=0),
                     models=ModelSpec(preset="tiny"))


def _trial(value, method="ngram", k=1, batch=1, **attrs):
    cfg = {"method": method, "k": k, "ngram_min": 1, "ngram_max": 3, "batch": batch, "temperature": 0.0,
           "dtype": "float32"}
    return optuna.trial.create_trial(
        params={"batch": batch}, distributions={"batch": BATCH}, value=value,
        user_attrs={"config": cfg, "speedup_vs_ar": value, "tokens_per_s": 100 * value, "feasible": True, **attrs},
        constraints={"fidelity": 0.0})


IMPLAUSIBLE = {"plausible": False, "implausible_reason": "speedup 3.19x > bound 2.2x (mean accepted tokens 2, "
                                                         "+10% slack)", "noisy": False}
NOISY = {"plausible": True, "noisy": True, "noisy_reason": "AR tokens/s CV 0.31 > 0.15"}


def test_best_k_report_skips_a_flagged_trial_and_says_why():
    study = optuna.create_study(direction="maximize", study_name="hand")
    study.set_metric_names(["tokens_per_s"])
    study.add_trial(_trial(1.4, method="draft", k=4, plausible=True, noisy=False))
    study.add_trial(_trial(1.2, k=2))  # recorded before the flags existed: reliable
    study.add_trial(_trial(3.19, **IMPLAUSIBLE))
    study.add_trial(_trial(2.5, **NOISY))
    assert study.best_trial.number == 2  # Optuna alone would pick the implausible one
    assert best_trial(study).number == 0
    assert [t.number for t in reliable_complete(study)] == [0, 1]
    report = get_script("best_k").report(study)
    assert "best setting (trial 0)" in report
    assert "excluded: trial 2 (implausible: speedup 3.19x > bound 2.2x" in report
    assert "excluded: trial 3 (noisy: AR tokens/s CV 0.31 > 0.15)" in report


def test_only_flagged_trials_means_nothing_to_recommend():
    study = optuna.create_study(direction="maximize")
    study.set_metric_names(["tokens_per_s"])
    study.add_trial(_trial(3.19, **IMPLAUSIBLE))
    report = get_script("best_k").report(study)
    assert "nothing to recommend" in report and "excluded: trial 0" in report


def test_schedule_skips_flagged_trials():
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(SPEC_KEY, _spec("batch_schedule", batch=(1, 4)).to_dict())
    study.add_trial(_trial(1.3, method="draft", k=3, batch=1, plausible=True, noisy=False))
    study.add_trial(_trial(3.19, batch=1, **IMPLAUSIBLE))
    study.add_trial(_trial(2.0, batch=4, **NOISY))
    sched = build_schedule(study)
    assert [(b["batch_size"], b.get("trial")) for b in sched["buckets"]] == [(1, 0), (4, None)]
    assert sched["excluded"] == exclusion_notes(study) and len(sched["excluded"]) == 2
    assert "excluded: trial 1" in get_script("batch_schedule").report(study)


def test_pareto_front_is_computed_over_reliable_trials():
    study = optuna.create_study(directions=["maximize", "minimize"])
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for vals, attrs in (([10.0, 5.0], {}), ([8.0, 4.0], {}), ([20.0, 1.0], IMPLAUSIBLE), ([7.0, 6.0], {})):
        study.add_trial(optuna.trial.create_trial(params={"x": 0.5}, distributions=dist, values=vals,
                                                  user_attrs={"config": {"method": "ngram"}, "feasible": True,
                                                              **attrs}))
    # trial 2 dominates everything; without it, 0 and 1 form the front (3 is dominated by 0)
    assert sorted(pareto_front(study)["trial"]) == [0, 1]


def test_importance_caveat_below_the_threshold():
    study = optuna.create_study(direction="maximize")
    for i in range(3):
        study.add_trial(_trial(1.0 + i / 10))
    assert "3 completed trial(s)" in importance_caveat(study)
    for i in range(IMPORTANCE_MIN_TRIALS):
        study.add_trial(_trial(1.0))
    assert importance_caveat(study) is None


@pytest.fixture(scope="module")
def session():
    from workbench.harness.bench import BenchSession

    return BenchSession.load(preset="tiny", device="cpu", dtype="float32")


def test_trust_flags_reach_trial_user_attrs(tmp_path, session):
    storage = optuna.storages.InMemoryStorage()
    study, spec = create_or_resume(storage, "flags", _spec("best_k"), target_trials=2)
    assert run_trials(study, spec, store=ResultStore(tmp_path), device="cpu", session_for=lambda dtype: session) == 2
    for t in study.get_trials():
        assert isinstance(t.user_attrs["noisy"], bool) and isinstance(t.user_attrs["plausible"], bool)
        assert t.user_attrs["speedup_ci_low"] <= t.user_attrs["speedup_ci_high"]
    report = get_script("best_k").report(study)
    flagged = [t.number for t in study.get_trials() if t.user_attrs["noisy"] or not t.user_attrs["plausible"]]
    assert all(f"excluded: trial {n} (" in report for n in flagged)
