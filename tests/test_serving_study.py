"""The `serving` study (studies/serving.py) on the tiny preset, CPU: replay trials first, the best few run for real with
the same params, each trial's fidelity recorded, real rows in the store under the study name; named errors before
any work; replay's new options (adaptive rules, chunked prefill) against the plain schedule."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from results.store import ResultStore
from studies import serving as ss
from workbench.serving.config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
BASE = ServeConfig(method="ngram", k=3, rate=20.0, num_requests=4, max_new_tokens=8, max_num_seqs=4)


@pytest.fixture(scope="module")
def session():
    from workbench.harness.bench import BenchSession

    return BenchSession.load(preset="tiny", device="cpu")


def test_buckets_and_schedule_text():
    assert ss.buckets(1) == [(1, 1)] and ss.buckets(16) == [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16)]
    params = {"k_bs1": 3, "k_bs2": 2, "k_bs3": 1, "k_bs5": 0, "spec_off_acceptance": 0.1, "spec_window": 4,
              "spec_max_context": 64, "long_context_k": 1, "spec_off_queue": 4, "prefill_chunk": 16,
              "sched_policy": "max_util"}
    cfg = ss.config_of(ServeConfig(k=3, max_num_seqs=6), params)
    assert cfg.k_by_batch == "1-1:3,2-2:2,3-4:1,5-6:0" and cfg.k == 3
    assert (cfg.spec_window, cfg.spec_off_queue, cfg.prefill_chunk, cfg.sched_policy) == (4, 4, 16, "max_util")
    assert set(ss.distributions(6, 3)) == set(params)
    older = {k: v for k, v in params.items() if k != "spec_off_queue"}  # a trial from before it was searched
    assert ss.config_of(ServeConfig(k=3, max_num_seqs=6), older).spec_off_queue == 0


def test_study_replays_then_runs_the_best_for_real(session, tmp_path):
    store = ResultStore(tmp_path / "store")
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    study = ss.run_study(session, BASE, study_name="srv", storage=storage, replay_trials=6, real_trials=2,
                         store=store, log=lambda *_: None)
    trials = study.get_trials(deepcopy=False)
    replayed = [t for t in trials if t.user_attrs.get("fidelity") == "replay"]
    real = [t for t in trials if t.user_attrs.get("fidelity") == "real"]
    assert len(replayed) == 6 and len(real) == 2 and len(trials) == 8
    assert all(t.user_attrs["replay_ignores"] for t in replayed)
    by_number = {t.number: t for t in replayed}
    for t in real:  # the same params as the replay trial it came from, and the prediction kept beside it
        src = by_number[t.user_attrs["replay_trial"]]
        assert t.params == src.params and t.user_attrs["replay_goodput"] == src.values[0]
        for key in ("replay_goodput_per_step", "replay_tpot_ms_p99_per_step"):  # the per-step fit's, kept too
            assert t.user_attrs[key] == src.user_attrs[key] is not None
        assert t.state == optuna.trial.TrialState.COMPLETE and t.values[0] > 0 and t.values[1] > 0
    picked = {t.user_attrs["replay_trial"] for t in real}
    assert picked == {t.number for t in ss.pick_for_real(replayed, 2)}
    rows = store.load(study="srv")
    assert len(rows) == 4  # the two record runs (off, fixed k) and the two real trials
    assert set(rows["run_id"]) >= {t.user_attrs["run_id"] for t in real}
    assert sorted(rows["method"]) == ["ar", "ngram", "ngram", "ngram"]
    assert "real trial" in ss.report(study, BASE.max_num_seqs) and "per-step" in ss.report(study, BASE.max_num_seqs)
    # resuming runs no new replay trial and no real trial twice
    again = ss.run_study(session, BASE, study_name="srv", storage=storage, replay_trials=6, real_trials=2,
                         store=None, log=lambda *_: None)
    assert len(again.get_trials(deepcopy=False)) == 8
    with pytest.raises(ss.ServingStudyError, match="already exists with other base settings \\(rate\\)"):
        ss.run_study(session, ServeConfig(**{**BASE.__dict__, "rate": 5.0}), study_name="srv", storage=storage,
                     replay_trials=6, real_trials=2, log=lambda *_: None)


def test_replay_trials_carry_the_per_step_fit_which_agrees_at_the_recorded_length(session, tmp_path, monkeypatch):
    """Each replay trial also carries the per-step cost fit's prediction. The two fits price every step at the
    recorded k and at 0 alike, so a trial that drafts only k = 3 gets the same prediction from both; a trial at k = 1
    gets a slower one from the per-step fit. (The record runs are timed, so the fits are replaced here by known
    costs, one per feature order: 1 ms a step plus 6 ms a drafting step, or 2 ms a draft node.)"""
    from workbench.serving import replay

    def known(iterations, features=replay.FEATURES, nonnegative=True):
        draft = {"n>0": 6.0} if features == replay.PER_STEP_FEATURES else {"n": 2.0}
        return replay.CostModel([{"1": 1.0, **draft}.get(f, 0.0) for f in features], tuple(features))

    monkeypatch.setattr(replay, "fit_costs", known)
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    pre = optuna.create_study(study_name="srv2", storage=storage, directions=list(ss.DIRECTIONS))
    common = dict(spec_off_acceptance=0.0, spec_window=4, spec_max_context=0, long_context_k=0, spec_off_queue=0,
                  prefill_chunk=0, sched_policy="no_evict")
    recorded = {f"k_bs{lo}": BASE.k for lo, _ in ss.buckets(BASE.max_num_seqs)} | common
    shorter = {f"k_bs{lo}": 1 for lo, _ in ss.buckets(BASE.max_num_seqs)} | common
    pre.enqueue_trial(recorded)
    pre.enqueue_trial(shorter)
    study = ss.run_study(session, BASE, study_name="srv2", storage=storage, replay_trials=2, real_trials=0,
                         log=lambda *_: None)
    a, b = study.get_trials(deepcopy=False)
    assert a.params == recorded and b.params == shorter
    for t in (a, b):
        assert t.user_attrs["replay_goodput_per_step"] is not None
        assert t.user_attrs["replay_tpot_ms_p99_per_step"] is not None
    assert (a.user_attrs["replay_goodput_per_step"], a.user_attrs["replay_tpot_ms_p99_per_step"]) == \
        pytest.approx((a.values[0], a.values[1]), rel=1e-9)
    assert b.user_attrs["replay_tpot_ms_p99_per_step"] > 1.5 * b.values[1]  # 7 ms against 3 ms a step


def test_pick_for_real_front_first_and_distinct():
    from types import SimpleNamespace as T

    a = T(number=0, values=[2.0, 5.0], params={"x": 1})
    b = T(number=1, values=[1.0, 1.0], params={"x": 2})  # on the front: lowest TPOT
    c = T(number=2, values=[1.5, 6.0], params={"x": 3})  # dominated by a
    d = T(number=3, values=[2.0, 5.0], params={"x": 1})  # same params as a
    assert [t.number for t in ss.pick_for_real([c, b, a, d], 3)] == [0, 1, 2]


@pytest.mark.parametrize("change, message", [
    ({"rate": 0.0}, "--rate must be > 0"),
    ({"method": "ar"}, "use a speculative method"),
    ({"k_by_batch": "4-1:2"}, "k_by_batch part"),
])
def test_bad_settings_are_named_errors_before_work(change, message):
    with pytest.raises(ss.ServingStudyError, match=message):
        ss.check(ServeConfig(**{**BASE.__dict__, **change}), 4, 2)
    with pytest.raises(ss.ServingStudyError, match="--real-trials"):
        ss.check(BASE, 2, 3)


def test_cli_refuses_bad_input_without_loading_models(tmp_path):
    out = subprocess.run([sys.executable, "-m", "studies.serving", "--study", "x", "--rate", "0", "--storage",
                          f"sqlite:///{tmp_path / 's.db'}", "--no-store"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--rate must be > 0" in out.stderr
    assert not (tmp_path / "s.db").exists()


def test_replay_options_default_to_the_plain_schedule_and_change_predictions(session):
    from workbench.serving import replay
    from workbench.serving.adaptive import AdaptiveSpeculation
    from workbench.serving.bench import serve_bench

    res = serve_bench(session, BASE).result
    costs = replay.fit_costs(res.iterations)
    plain = replay.replay(res.states, res.traces, 3, costs, lambda b: 3, max_num_seqs=4)
    same = replay.replay(res.states, res.traces, 3, costs, max_num_seqs=4, adaptive=AdaptiveSpeculation(3))
    assert plain == same
    chunked = replay.replay(res.states, res.traces, 3, costs, lambda b: 3, max_num_seqs=4, prefill_chunk=8)
    assert chunked["ttft_ms_p50"] != plain["ttft_ms_p50"]  # prompts of the tiny set are longer than one chunk
    off = replay.replay(res.states, res.traces, 3, costs, max_num_seqs=4,
                        adaptive=AdaptiveSpeculation(3, off_acceptance=1.0, window=1))  # off after the first step
    assert off != plain
    assert json.dumps(plain)  # plain numbers, storable as trial attrs


def test_study_searches_a_tree_whole_or_off_per_bucket(session, tmp_path):
    """eagle: each bucket's param is 0 (off) or 1 (the whole tree on), and so is the long-context k; replay predicts
    every trial and the real trial serves the tree at the node count the record run verified."""
    base = ServeConfig(method="eagle", tree_depth=3, tree_topk=2, tree_budget=6, rate=20.0, num_requests=4,
                       max_new_tokens=8, max_num_seqs=4, greedy_check_requests=0)
    assert ss.is_tree_method(base) and ss.is_tree_method(replace(base, tree_topk=1))  # (loop.verifies_shorter)
    assert not ss.is_tree_method(replace(base, method="redrafter", beam_width=1))
    store = ResultStore(tmp_path / "store")
    study = ss.run_study(session, base, study_name="tree", storage=f"sqlite:///{tmp_path / 'studies.db'}",
                         replay_trials=4, real_trials=1, store=store, log=lambda *_: None)
    trials = study.get_trials(deepcopy=False)
    replayed = [t for t in trials if t.user_attrs.get("fidelity") == "replay"]
    assert len(replayed) == 4 and all(t.state == optuna.trial.TrialState.COMPLETE for t in replayed)
    for t in replayed:
        ks = [v for name, v in t.params.items() if name.startswith("k_bs")] + [t.params["long_context_k"]]
        assert set(ks) <= {0, 1}
    [real] = [t for t in trials if t.user_attrs.get("fidelity") == "real"]
    assert real.state == optuna.trial.TrialState.COMPLETE
    rows = store.load(study="tree")
    assert sorted(rows["method"]) == ["ar", "eagle", "eagle"]
    traces = store.load_traces(rows.loc[rows["method"].eq("eagle"), "run_id"].tolist())
    assert set(traces["num_nodes"]) <= {0, 6} and 6 in set(traces["num_nodes"])
