"""studies/: search space, objective (constraint, failures), study scripts, schedule export, workers.

Trials run the real engine on the committed tiny models (CPU, a few tokens per trial). Fakes appear only as thin
wrappers around the real session, to force what the tiny models will not do on their own (an out-of-memory error, a
greedy mismatch). The PostgreSQL test starts a real server from the Debian package binaries on loopback; without
them it skips, unless WORKBENCH_REQUIRE_E2E=1 (set by .ci/run), where it fails.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import optuna
import pytest

from results.store import ResultStore
from studies.objective import ModelSpec, pareto_front
from studies.run import main as run_main
from studies.worker import main as worker_main
from studies.schedule import (batch_ranges, build_schedule, export_schedule, sglang_snippet, trtllm_snippet,
                              vllm_snippet)
from workbench.serving.engine_schemas import (ENGINE_VERSIONS, check_sglang, check_trtllm, check_vllm, trtllm_k_at,
                                              vllm_k_at)
from studies.scripts import get_script
from studies.space import IntRange, RunSettings, SearchSpace, SpaceError, parse_dim
from studies.storage import StorageOpenError, open_storage
from studies.study import SPEC_KEY, StudyMismatchError, StudySpec, create_or_resume, run_trials

REPO = Path(__file__).resolve().parents[1]
FAST = RunSettings(max_new_tokens=8, num_prompts=2, repeats=1, warmup=0)
FAST_FLAGS = ["--max-new-tokens", "8", "--num-prompts", "2", "--repeats", "1", "--warmup", "0"]

optuna.logging.set_verbosity(optuna.logging.WARNING)


def make_spec(script: str = "best_k", **space: object) -> StudySpec:
    s = get_script(script)
    return StudySpec(script=s.name, objective=s.objective, space=dataclasses.replace(s.space, **space),
                     settings=FAST, models=ModelSpec(preset="tiny"))


@pytest.fixture(scope="module")
def session():
    from workbench.harness.bench import BenchSession

    return BenchSession.load(preset="tiny", device="cpu", dtype="float32")


def wrap(session, edit):
    """A session whose run() passes the real result through `edit(config, result) -> result`."""
    return types.SimpleNamespace(run=lambda config, prompts=None: edit(config, session.run(config)))


# ---------------------------------------------------------------------------------------------- search space
def test_a_space_over_eagle3_suggests_its_tree_and_keeps_the_unsearched_layers_setting():
    """eagle3_layers is one of eagle3's knobs but not searched: the space sets up, suggests the tree knobs only, and
    the config keeps the run's eagle3_layers."""
    from studies.study import hardest

    spec = make_spec(methods=("eagle3",))
    spec.validate()
    params = spec.space.suggest(optuna.trial.FixedTrial({"method": "eagle3", "tree_depth": 3, "tree_topk": 2,
                                                         "tree_budget": 5}))
    assert {k: params[k] for k in ("method", "tree_depth", "tree_topk", "tree_budget")} == {
        "method": "eagle3", "tree_depth": 3, "tree_topk": 2, "tree_budget": 5}
    assert "eagle3_layers" not in params  # the run settings' value stands
    assert "eagle3_layers" not in hardest(spec, "eagle3") or hardest(spec, "eagle3")["eagle3_layers"] == "auto"


def test_space_rejects_values_outside_engine_limits():
    with pytest.raises(SpaceError, match=r"k=40 is outside what the engine supports: 1\.\.16"):
        SearchSpace(k=IntRange(1, 40)).validate()
    with pytest.raises(SpaceError, match=r"method 'medusa' is not supported.*allowed: ar, draft, ngram"):
        SearchSpace(methods=("draft", "medusa")).validate()
    with pytest.raises(SpaceError, match=r"dtype='int3' is not supported"):
        SearchSpace(dtype=("float32", "int3")).validate()
    with pytest.raises(SpaceError, match=r"batch=0 is outside"):
        SearchSpace(batch=(0, 1)).validate()
    with pytest.raises(SpaceError, match=r"compile='fast' is not supported by the engine; allowed: 'auto', 'off', 'default'"):
        SearchSpace(compile=("off", "fast")).validate()
    with pytest.raises(SpaceError, match=r"batch 8 exceeds the largest graph bucket 4: add a bucket >= 8"):
        dataclasses.replace(make_spec(batch=(1, 8), cuda_graphs=(False, True)),
                            settings=dataclasses.replace(FAST, graph_batch_sizes=(1, 2, 4))).validate()
    make_spec(batch=(1, 8), cuda_graphs=False).validate()  # graphs off: the buckets do not bound the batch
    with pytest.raises(SpaceError, match=r"graph_batch_sizes=4,2 must be strictly increasing"):
        RunSettings(graph_batch_sizes=(4, 2)).validate()
    with pytest.raises(SpaceError, match=r"max_new_tokens=0 is outside"):
        RunSettings(max_new_tokens=0).validate()
    with pytest.raises(SpaceError, match=r"cannot read --k 'x-3'"):
        parse_dim("k", "x-3")
    assert parse_dim("k", "2-6") == IntRange(2, 6) and parse_dim("batch", "1,4") == (1, 4)
    assert parse_dim("temperature", "0.7") == 0.7
    assert parse_dim("cuda_graphs", "off,on") == (False, True) and parse_dim("compile", "default") == "default"
    with pytest.raises(SpaceError, match=r"cannot read --cuda-graphs 'maybe': use on or off"):
        parse_dim("cuda_graphs", "maybe")


def test_space_suggests_only_the_knobs_of_the_method():
    space = SearchSpace(methods=("ar", "draft", "ngram"), k=IntRange(1, 8), ngram_min=IntRange(2, 3),
                        ngram_max=IntRange(1, 4), batch=(1, 4))
    assert space.suggest(optuna.trial.FixedTrial({"method": "ar", "batch": 4})) == {
        "method": "ar", "batch": 4, "temperature": 0.0, "dtype": "auto", "paged": True, "kv_block_size": 16,
        "cuda_graphs": "auto", "compile": "auto", "attention": "auto",
        "prefill_graphs": True, "compile_prefill": False, "target_kv_quant": "none", "overlap": True,
        "target_quant": "none", "pdl": True, "quant_head": False,
        "gemv_fusion": "residual"}  # fixed knobs pass through; ar reads no k (nor draft_kv_quant, draft_quant)
    got = space.suggest(optuna.trial.FixedTrial({"method": "ngram", "k": 3, "ngram_min": 3, "ngram_max": 3,
                                                 "batch": 1}))
    assert got["k"] == 3 and got["ngram_min"] == 3 and got["ngram_max"] == 3
    # ngram_max never below ngram_min: its range is narrowed to [ngram_min, high]
    study = optuna.create_study()
    for _ in range(15):
        t = study.ask()
        p = space.suggest(t)
        study.tell(t, 0.0)
        if p["method"] == "ngram":
            assert p["ngram_max"] >= p["ngram_min"]
    assert SearchSpace.from_dict(space.to_dict()) == space


# ------------------------------------------------------------------------------- storage, scripts, bad input
def test_bad_storage_urls_are_named(tmp_path):
    with pytest.raises(StorageOpenError, match=r"'redis://h/0' is not supported"):
        open_storage("redis://h/0")
    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://bench:secret@127.0.0.1:{port}/optuna"
    with pytest.raises(StorageOpenError) as e:
        open_storage(url)
    assert f"127.0.0.1:{port}/optuna" in str(e.value) and "secret" not in str(e.value)
    with pytest.raises(StorageOpenError, match="does not exist"):
        open_storage(f"journal://{tmp_path}/missing/x.log")


def test_a_study_stored_before_a_knob_existed_resumes(tmp_path):
    """Specs written before cuda_graphs, compile, graph_batch_sizes (and with the old "extra" field) read back with
    the knobs' defaults, which is what their trials ran, so resuming them is not refused as a changed space."""
    db = f"sqlite:///{tmp_path}/s.db"
    study, spec = create_or_resume(open_storage(db), "old", make_spec())
    old = spec.to_dict()
    for knob in ("paged", "kv_block_size", "cuda_graphs", "compile"):
        del old["space"][knob]
    old["space"]["extra"] = {}
    del old["settings"]["graph_batch_sizes"], old["settings"]["compare_hf"]
    study.set_user_attr(SPEC_KEY, old)
    assert create_or_resume(open_storage(db), "old", make_spec())[1] == spec
    with pytest.raises(StudyMismatchError, match="space.cuda_graphs"):
        create_or_resume(open_storage(db), "old", make_spec(cuda_graphs=(False, True)))


def test_cli_refuses_unknown_script_storage_and_changed_space(tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/s.db"
    assert run_main(["--study", "x", "--script", "best_kk", "--storage", db]) == 2
    assert "unknown study script 'best_kk'; known: best_k, batch_schedule, pareto" in capsys.readouterr().err
    assert run_main(["--study", "x", "--storage", "postgresql://u@127.0.0.1:1/none", "--workers", "0"]) == 2
    assert "cannot open Optuna storage 'postgresql://u@127.0.0.1:1/none'" in capsys.readouterr().err
    assert run_main(["--study", "x", "--storage", db, "--k", "1-40", "--workers", "0"]) == 2
    assert "k=40 is outside what the engine supports" in capsys.readouterr().err
    assert run_main(["--study", "x", "--storage", db, "--workers", "2"]) == 2
    assert "is SQLite" in capsys.readouterr().err
    assert run_main(["--study", "x", "--storage", db, "--workers", "0", *FAST_FLAGS]) == 0
    capsys.readouterr()
    assert run_main(["--study", "x", "--storage", db, "--workers", "0"]) == 0  # resume as stored: fine
    assert run_main(["--study", "x", "--storage", db, "--workers", "0", "--k", "1-4"]) == 2
    err = capsys.readouterr().err
    assert "study 'x' already exists with a different search space" in err and "space.k" in err
    assert run_main(["--study", "x", "--storage", db, "--workers", "0", "--script", "pareto"]) == 2
    assert "directions" in capsys.readouterr().err
    assert run_main(["--study", "y", "--storage", db, "--model", str(tmp_path / "no-such-model")]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert run_main(["--study", "z", "--storage", db, "--max-new-tokens", "100000"]) == 2
    assert "max_new_tokens=100000 is outside" in capsys.readouterr().err
    assert run_main(["--study", "z", "--storage", db, "--max-new-tokens", "8000", "--trials", "1"]) == 2
    assert "the engine refuses method=draft, k=8, draft_kv_quant=none, draft_quant=none, batch=1, max_new_tokens=8000" in capsys.readouterr().err
    assert worker_main(["--study", "nope", "--storage", db]) == 2
    assert "no study named 'nope'" in capsys.readouterr().err
    with pytest.raises(StudyMismatchError, match="max_new_tokens"):
        create_or_resume(open_storage(db), "x", dataclasses.replace(
            make_spec(), settings=dataclasses.replace(FAST, max_new_tokens=9)))


# ------------------------------------------------------------------------------------- trials on tiny models
def test_small_study_writes_one_row_per_trial(tmp_path, session):
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    study, spec = create_or_resume(storage, "small", make_spec(), target_trials=5)
    store = ResultStore(tmp_path / "store")
    assert run_trials(study, spec, store=store, device="cpu", session_for=lambda dtype: session) == 5
    trials = study.get_trials()
    assert len(trials) == 5 and all(t.state.name == "COMPLETE" for t in trials), [t.user_attrs for t in trials]
    df = store.load(study="small")
    assert len(df) == 5 and sorted(df["trial_id"].tolist()) == [0, 1, 2, 3, 4]
    assert (df["status"] == "ok").all() and (df["study"] == "small").all() and (df["max_new_tokens"] == 8).all()
    assert set(df["run_id"]) == {t.user_attrs["run_id"] for t in trials}
    assert all(t.values[0] == pytest.approx(t.user_attrs["tokens_per_s"]) for t in trials)
    assert all(t.constraints == {"fidelity": 0.0, "quality": 0.0} for t in trials)
    # the space leaves the speed knobs at auto: trial config and rows hold what they became on the CPU
    assert spec.space.cuda_graphs == spec.space.compile == "auto"
    assert all((t.user_attrs["config"]["cuda_graphs"], t.user_attrs["config"]["compile"]) == (False, "off")
               for t in trials)
    assert not df["cuda_graphs"].any() and (df["compile"] == "off").all()
    assert (df["auto_knobs"] == "cuda_graphs,compile").all()  # dtype was given (float32) to the session
    assert "best setting (trial" in get_script("best_k").report(study)
    # resuming with the same total runs nothing more
    assert run_trials(study, spec, store=store, device="cpu", session_for=lambda dtype: session) == 0


def test_perplexity_above_the_quality_bound_makes_a_trial_infeasible(tmp_path, session):
    """A quantized target's perplexity cost is a constraint: points above max_ppl_increase_pct (default 2 %)."""
    def lossy_draft(config, result):
        if config.method != "draft":
            return result
        return types.SimpleNamespace(record={**result.record, "quant_ppl_delta_pct": 5.0}, traces=result.traces)

    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    spec = make_spec("pareto", methods=("draft", "ngram"), k=2, ngram_min=1, ngram_max=2, batch=1)
    study, spec = create_or_resume(storage, "qual", spec, target_trials=2)
    for method in ("draft", "ngram"):
        study.enqueue_trial({"method": method})
    run_trials(study, spec, store=ResultStore(tmp_path / "store"), device="cpu",
               session_for=lambda dtype: wrap(session, lossy_draft))
    by_method = {t.params["method"]: t for t in study.get_trials()}
    assert by_method["draft"].constraints == {"fidelity": 0.0, "quality": pytest.approx(3.0)}
    assert by_method["draft"].user_attrs["feasible"] is False
    assert "held-out perplexity +5 % exceeds the bound 2 %" in by_method["draft"].user_attrs["infeasible_reason"]
    assert by_method["ngram"].constraints == {"fidelity": 0.0, "quality": 0.0}
    assert by_method["ngram"].user_attrs["feasible"] is True


def test_greedy_mismatch_makes_a_trial_infeasible(tmp_path, session):
    def flip_draft(config, result):
        if config.method != "draft":
            return result
        return types.SimpleNamespace(record={**result.record, "greedy_matches_ar": False}, traces=result.traces)

    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    spec = make_spec("pareto", methods=("draft", "ngram"), k=2, ngram_min=1, ngram_max=2, batch=1)
    study, spec = create_or_resume(storage, "fid", spec, target_trials=4)
    for method in ("draft", "ngram", "draft", "ngram"):
        study.enqueue_trial({"method": method})
    store = ResultStore(tmp_path / "store")
    run_trials(study, spec, store=store, device="cpu", session_for=lambda dtype: wrap(session, flip_draft))
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    for t in trials:
        draft = t.params["method"] == "draft"
        assert t.constraints == {"fidelity": 1.0 if draft else 0.0, "quality": 0.0}
        assert t.user_attrs["feasible"] is (not draft)
        assert (t.user_attrs.get("infeasible_reason") is not None) is draft
    front = pareto_front(study)
    assert len(front) >= 1 and set(front["method"]) == {"ngram"}
    df = store.load(study="fid")
    assert len(df) == 4 and df.loc[df["method"] == "draft", "greedy_matches_ar"].eq(False).all()


def test_failed_trials_are_recorded_and_the_study_goes_on(tmp_path, session):
    import torch

    calls = {"n": 0}

    def failing(config, prompts=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if calls["n"] == 3:
            from workbench.harness.bench import BenchError

            raise BenchError(f"k={config.k} is too long for this draft model")
        return session.run(config)

    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    study, spec = create_or_resume(storage, "fail", make_spec(), target_trials=4)
    store = ResultStore(tmp_path / "store")
    run_trials(study, spec, store=store, device="cpu",
               session_for=lambda dtype: types.SimpleNamespace(run=failing))
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "FAIL", "COMPLETE"]
    assert trials[1].user_attrs["error_type"] == "oom"
    assert trials[1].user_attrs["error"].startswith("out of memory: OutOfMemoryError: CUDA out of memory")
    assert trials[2].user_attrs["error_type"] == "BenchError" and "too long" in trials[2].user_attrs["error"]
    df = store.load(study="fail").sort_values("trial_id")
    assert df["trial_id"].tolist() == [0, 1, 2, 3]
    assert df["status"].tolist() == ["ok", "failed", "failed", "ok"]
    assert "out of memory" in df["error"].iloc[1] and "too long" in df["error"].iloc[2]
    assert df["method"].notna().all() and (df["device"] == "cpu").all()  # failed rows keep their config


def test_batch_schedule_exports_json_and_engine_snippets(tmp_path, session):
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    spec = make_spec("batch_schedule", batch=(1, 2), k=IntRange(1, 3))
    study, spec = create_or_resume(storage, "sched", spec, target_trials=4)
    run_trials(study, spec, store=ResultStore(tmp_path / "store"), device="cpu", session_for=lambda d: session)
    assert sorted(t.params["batch"] for t in study.trials) == [1, 1, 2, 2]  # trials spread over the buckets
    files = export_schedule(study, tmp_path / "out")
    assert set(files) == {"schedule", "vllm", "sglang", "trtllm"}
    data = {k: json.loads(p.read_text()) for k, p in files.items()}
    assert [b["batch_size"] for b in data["schedule"]["buckets"]] == [1, 2]
    buckets = data["schedule"]["buckets"]  # a trial flagged noisy (a busy CPU) is counted under "excluded" instead
    assert all(b["trials"] <= 2 for b in buckets)
    assert sum(b["trials"] for b in buckets) + len(data["schedule"]["excluded"]) == 4
    # every snippet written from a real study passes its engine's mirrored check, or is refused by name
    speculates = any(b["speculate"] for b in data["schedule"]["buckets"])
    assert_handed_over(data, speculates)
    assert data["schedule"]["engines_checked_against"] == ENGINE_VERSIONS
    assert "best setting per batch-size bucket" in get_script("batch_schedule").report(study)


def assert_handed_over(data: dict, speculates: bool) -> None:
    """Each engine file is a config its mirrored check accepts, or a refusal naming why (off: nothing paid;
    TensorRT-LLM: a schedule whose longest draft is not at batch size 1)."""
    checks = {"vllm": ("speculative_config", check_vllm), "trtllm": ("speculative_config", check_trtllm),
              "sglang": ("server_args", check_sglang)}
    for name, (key, check) in checks.items():
        snippet = data[name]
        assert snippet["checked_against"] == ENGINE_VERSIONS[name]
        if "refused" in snippet:
            assert not speculates and snippet["refused"].startswith("off: ") or (
                name == "trtllm" and "longest draft at batch size 1" in snippet["refused"]), snippet
        elif name == "sglang" and "refused" not in snippet.get("adaptive_config", {"refused": ""}):
            assert speculates and check(snippet[key], snippet["adaptive_config"]) == [], (name, snippet)
        else:
            assert speculates and check(snippet[key]) == [], (name, snippet)
    # the engines with a per-batch-size key run the chosen method's measured k at every batch size up to the last
    # bucket (an engine's expansion of its own file equals the study's choice)
    if speculates:
        method = next(b["method"] for b in data["schedule"]["buckets"] if b["speculate"])
        chosen = {b: k for lo, hi, k in batch_ranges(data["schedule"], method) for b in range(lo, hi + 1)}
        if "speculative_config" in data["vllm"]:
            assert {b: vllm_k_at(data["vllm"]["speculative_config"], b) for b in chosen} == chosen
        if "speculative_config" in data["trtllm"]:
            assert {b: trtllm_k_at(data["trtllm"]["speculative_config"], b) for b in chosen} == chosen


def test_schedule_snippets_from_known_trials():
    """Hand-built trials: draft k=4 wins batch 1, ngram k=2 wins batch 4, nothing beats autoregressive at 16."""
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(SPEC_KEY, make_spec("batch_schedule", batch=(1, 4, 16)).to_dict())

    def add(batch, method, k, speedup, ngram=(None, None)):
        cfg = {"method": method, "k": k, "ngram_min": ngram[0], "ngram_max": ngram[1], "batch": batch,
               "temperature": 0.0, "dtype": "float32"}
        study.add_trial(optuna.trial.create_trial(
            params={"batch": batch}, distributions={"batch": optuna.distributions.CategoricalDistribution((1, 4, 16))},
            value=speedup, user_attrs={"config": cfg, "speedup_vs_ar": speedup, "tokens_per_s": 100 * speedup,
                                       "feasible": True},
            constraints={"fidelity": 0.0}))

    add(1, "draft", 4, 2.0)
    add(1, "draft", 2, 1.5)
    add(1, "ngram", 3, 1.2, (1, 3))
    add(4, "ngram", 2, 1.3, (2, 3))
    add(4, "draft", 1, 1.1)
    add(16, "draft", 1, 0.8)
    study.add_trial(optuna.trial.create_trial(  # infeasible: fastest, but must be ignored
        params={"batch": 16}, distributions={"batch": optuna.distributions.CategoricalDistribution((1, 4, 16))},
        value=9.0, user_attrs={"config": {"method": "draft", "k": 8, "batch": 16}, "speedup_vs_ar": 9.0,
                               "feasible": False}, constraints={"fidelity": 1.0}))
    sched = build_schedule(study)
    got = [(b["batch_size"], b["speculate"], b["method"], b["draft_len"]) for b in sched["buckets"]]
    assert got == [(1, True, "draft", 4), (4, True, "ngram", 2), (16, False, "ar", 0)]
    assert sched["buckets"][0]["shape"] == {"method": "draft", "k": 4} and sched["buckets"][2]["shape"] is None
    trt = trtllm_snippet(sched)["speculative_config"]
    # draft wins (ties -> smallest batch); its best k per bucket: 4 at batch 1, 1 at 4; off (dropped) at 16
    assert trt["decoding_type"] == "Draft_Target" and trt["draft_len_schedule"] == {"1": 4, "4": 1}
    assert trt["max_draft_len"] == 4 and check_trtllm(trt) == []
    v = vllm_snippet(sched)["speculative_config"]
    assert v["num_speculative_tokens"] == 4 and v["method"] == "draft_model" and "disable_by_batch_size" not in v
    # the off bucket is an explicit k = 0 range up to the largest bucket (vLLM would otherwise keep a k there)
    assert v["num_speculative_tokens_per_batch_size"] == [[1, 1, 4], [2, 4, 1], [5, 16, 0]]
    assert check_vllm(v, max_num_seqs=16) == []
    assert vllm_snippet(sched, max_num_seqs=64)["speculative_config"]["num_speculative_tokens_per_batch_size"][-1] \
        == [5, 64, 0]
    s = sglang_snippet(sched)
    assert s["server_args"]["speculative_algorithm"] == "STANDALONE" and check_sglang(s["server_args"]) == []
    assert (s["server_args"]["speculative_num_steps"], s["server_args"]["speculative_eagle_topk"],
            s["server_args"]["speculative_num_draft_tokens"]) == (4, 1, 5)
    assert s["differs_from_schedule"] == [[2, 4, 1], [5, 16, 0]] and "--speculative-num-steps 4" in s["cli"]
    assert_handed_over({"schedule": sched, "vllm": vllm_snippet(sched), "trtllm": trtllm_snippet(sched),
                        "sglang": s}, speculates=True)


def test_cli_runs_a_study_and_prints_the_pareto_front(tmp_path, capsys):
    args = ["--preset", "tiny", "--study", "front", "--script", "pareto", "--trials", "3", "--storage",
            f"sqlite:///{tmp_path}/s.db", "--store", str(tmp_path / "store"), "--batch", "1,2", *FAST_FLAGS]
    assert run_main(args) == 0
    out = capsys.readouterr().out
    assert "Pareto front" in out and out.count("\ntrial ") + out.startswith("trial ") >= 3
    assert len(ResultStore(tmp_path / "store").load(study="front")) == 3


# ------------------------------------------------------------------------------------ several worker processes
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _workers(storage: str, study: str, store: Path, n: int, per_worker: int) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen([sys.executable, "-m", "studies.worker", "--storage", storage, "--study", study,
                               "--device", "cpu", "--store", str(store), "--trials", str(per_worker),
                               "--threads", "1"],
                              cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(n)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return out


def _assert_recorded_once(storage_url: str, study_name: str, store: Path, total: int) -> None:
    study = optuna.load_study(study_name=study_name, storage=open_storage(storage_url))
    trials = study.get_trials()
    assert len(trials) == total and all(t.state.name in ("COMPLETE", "FAIL") for t in trials)
    assert all("status" in t.user_attrs for t in trials)  # each ran its objective to the end
    assert len({t.user_attrs["worker"] for t in trials}) == 2, "both workers ran trials"
    df = ResultStore(store).load(study=study_name)
    assert len(df) == total and sorted(df["trial_id"].tolist()) == sorted(t.number for t in trials)
    assert df["run_id"].is_unique and set(df["run_id"]) == {t.user_attrs["run_id"] for t in trials}


def test_two_workers_share_a_journal_file(tmp_path):
    url = f"journal://{tmp_path}/study.log"
    assert run_main(["--preset", "tiny", "--study", "j", "--trials", "4", "--storage", url, "--workers", "0",
                     *FAST_FLAGS]) == 0
    results = _workers(url, "j", tmp_path / "store", n=2, per_worker=2)
    assert all(r.returncode == 0 for r in results), [r.stdout[-2000:] for r in results]
    _assert_recorded_once(url, "j", tmp_path / "store", total=4)


# PostgreSQL: a real server from the Debian package, on loopback, in a temp dir, as a non-root user.
def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("initdb")
    return Path(which).parent if which else None


@pytest.fixture(scope="module")
def postgres_url():
    bindir = _pg_bin()
    if bindir is None or not (bindir / "pg_ctl").exists():
        msg = "PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql"
        if os.environ.get("WORKBENCH_REQUIRE_E2E") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    root = Path(tempfile.mkdtemp(prefix="wb-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root: run it as the package's `postgres` user
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"] if shutil.which("runuser") else None
        if prefix is None:
            pytest.fail("running as root without runuser: cannot start postgres as a non-root user")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = root / "data"
    run = lambda *cmd: subprocess.run([*prefix, *map(str, cmd)], check=True, capture_output=True, text=True,
                                      timeout=120)
    run(bindir / "initdb", "-D", data, "-A", "trust", "-U", "bench", "-E", "UTF8", "--no-sync")
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off"
    run(bindir / "pg_ctl", "-D", data, "-o", opts, "-l", root / "server.log", "-w", "-t", "60", "start")
    try:
        yield f"postgresql+psycopg2://bench@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def test_two_workers_on_postgres_record_every_trial_once(tmp_path, postgres_url):
    assert run_main(["--preset", "tiny", "--study", "pg", "--trials", "6", "--storage", postgres_url,
                     "--workers", "0", *FAST_FLAGS]) == 0
    results = _workers(postgres_url, "pg", tmp_path / "store", n=2, per_worker=3)
    assert all(r.returncode == 0 for r in results), [r.stdout[-2000:] for r in results]
    _assert_recorded_once(postgres_url, "pg", tmp_path / "store", total=6)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_dead_workers_trial_is_retried_on_postgres(tmp_path, postgres_url, session):
    storage = open_storage(postgres_url, heartbeat_interval=1, grace_period=2)
    study, spec = create_or_resume(storage, "stale", make_spec(), target_trials=2)
    dead = study.ask({"method": optuna.distributions.CategoricalDistribution(("draft", "ngram"))})
    storage.record_heartbeat(dead._trial_id)  # a worker started this trial ... and died
    time.sleep(3)
    store = ResultStore(tmp_path / "store")
    run_trials(study, spec, store=store, device="cpu", session_for=lambda dtype: session)
    trials = study.get_trials()
    assert trials[dead.number].state.name == "FAIL" and "status" not in trials[dead.number].user_attrs
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert len(retried) == 1 and retried[0].state.name == "COMPLETE"
    assert retried[0].params["method"] == dead.params["method"]
    done = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(done) == 2 and len(store.load(study="stale")) == 2


def test_ngram_schedule_names_buckets_that_measured_other_sizes():
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(SPEC_KEY, make_spec("batch_schedule", batch=(1, 4)).to_dict())
    dist = {"batch": optuna.distributions.CategoricalDistribution((1, 4))}
    for batch, k, sizes, speedup in ((1, 3, (1, 3), 1.5), (4, 2, (2, 4), 1.2)):
        cfg = {"method": "ngram", "k": k, "ngram_min": sizes[0], "ngram_max": sizes[1], "batch": batch,
               "temperature": 0.0, "dtype": "float32"}
        study.add_trial(optuna.trial.create_trial(params={"batch": batch}, distributions=dist, value=speedup,
                                                  user_attrs={"config": cfg, "speedup_vs_ar": speedup,
                                                              "feasible": True}, constraints={"fidelity": 0.0}))
    sched = build_schedule(study)
    v = vllm_snippet(sched)
    assert (v["speculative_config"]["prompt_lookup_min"], v["speculative_config"]["prompt_lookup_max"]) == (1, 3)
    assert "buckets 4: 2..4 measured best with other sizes" in v["note"]
    sg = sglang_snippet(sched)["server_args"]
    assert sg["speculative_ngram_max_bfs_breadth"] == 1 and check_sglang(sg) == []  # the measured chain
    assert trtllm_snippet(sched)["speculative_config"]["decoding_type"] == "NGram"


def test_an_eagle_schedule_hands_its_hot_vocabulary_to_sglang():
    """A batch-schedule study won by EAGLE-2 with hot_vocab: SGLang's snippet names the token map, vLLM's says it
    has no such setting."""
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(SPEC_KEY, make_spec("batch_schedule", batch=(1, 4)).to_dict())
    dist = {"batch": optuna.distributions.CategoricalDistribution((1, 4))}
    for batch, speedup in ((1, 1.5), (4, 1.1)):
        cfg = {"method": "eagle", "k": 4, "tree_depth": 4, "tree_topk": 4, "tree_budget": 16, "hot_vocab": 2048,
               "batch": batch, "temperature": 0.0, "dtype": "float32"}
        study.add_trial(optuna.trial.create_trial(params={"batch": batch}, distributions=dist, value=speedup,
                                                  user_attrs={"config": cfg, "speedup_vs_ar": speedup,
                                                              "feasible": True}, constraints={"fidelity": 0.0}))
    sched = build_schedule(study)
    sg = sglang_snippet(sched, draft_head="/heads/e")
    assert sg["server_args"]["speculative_token_map"] == "/heads/e/hot_tokens_2048.pt"
    assert check_sglang(sg["server_args"]) == []
    assert "hot vocabulary of 2048 tokens" in vllm_snippet(sched, draft_head="/heads/e")["note"]
