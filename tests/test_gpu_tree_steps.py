"""scripts/gpu_tree_steps.py on the CPU: a tiny random target and the tiny preset, batches 1 and 2, a few steps
through every method (the smoke run of the GPU benchmark); its outputs, its docstring examples and its named errors."""
import doctest
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_tree_steps", ROOT / "scripts" / "gpu_tree_steps.py")
ts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ts)

SMOKE = ["--device", "cpu", "--target-config", "tiny-random", "--preset", "tiny", "--batches", "1,2",
         "--context", "24", "--steps", "6", "--rounds", "2"]


def test_docstring_examples():
    assert doctest.testmod(ts).failed == 0


def test_smoke_run_measures_every_method_at_every_batch(tmp_path, capsys):
    assert ts.main(SMOKE + ["--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["rows"]
    want = {("tiny-random", m) for m in ("ar", "ngram", "eagle", "eagle-hot", "redrafter", "redrafter-hot", "tree")} \
        | {("tiny", m) for m in ts.METHODS if m != "redrafter-hot"}  # draft needs a draft model: the preset has one
    assert {(r["target"], r["method"]) for r in rows} == want
    assert sorted({r["batch"] for r in rows}) == [1, 2] and len(rows) == 2 * len(want)
    assert any("draft k=4 skipped" in n for n in result["notes"])
    # the committed tiny ReDrafter head was trained before heads kept a token ranking
    assert any("redrafter-hot skipped (its redrafter head has no token ranking" in n for n in result["notes"])
    for r in rows:
        assert r["error"] is None, (r["label"], r["error"])
        assert r["ms_per_step"] > 0 and r["ms_per_step_min"] <= r["ms_per_step"] <= r["ms_per_step_max"]
        assert r["ratio_vs_ar"] > 0 and r["rounds"] == 2 and len(r["ms_per_step_rounds"]) == 2
        assert r["tokens_per_s"] > 0 and r["steps"] >= 1
        assert set(r["phase_ms_per_step"]) == set(ts.PHASES) and r["phase_ms_per_step"]["verify"] > 0
        # float32 greedy: every drafter (the fixed tree included) emits exactly AR's tokens
        assert r["outputs_equal_ar"] == r["batch"], r["label"]
    # batch 1 (the default --busy-batches) ran one profiled generate per method: no device events on a CPU
    assert all(("kernels_per_step" in r) == (r["batch"] == 1) and "profile_error" not in r for r in rows)
    assert all(r.get("gpu_busy") is None and r["kernels_per_step"] is None for r in rows if r["batch"] == 1)
    ar = [r for r in rows if r["method"] == "ar"]
    assert all(r["ratio_vs_ar"] == 1.0 for r in ar)
    tree = next(r for r in rows if r["method"] == "tree" and r["target"] == "tiny")
    assert tree["label"] == "tree verify 17 nodes" and tree["phase_ms_per_step"]["kv"] > 0  # the tree's KV move ran
    # the goals: presets at batch 1, eagle and redrafter <= 2.0x; none on the tiny random target
    goals = {(r["target"], r["batch"], r["method"]): r["goal_max_ratio"] for r in rows if r["goal_max_ratio"]}
    assert goals == {("tiny", 1, "eagle"): 2.0, ("tiny", 1, "redrafter"): 2.0}
    assert all(isinstance(r["goal_met"], bool) for r in rows if r["goal_max_ratio"])
    assert result["meta"]["heads"]["tiny"]["eagle"].endswith("eagle")  # the committed trained head
    assert result["meta"]["heads"]["tiny-random"]["eagle"].startswith("untrained")
    assert set(result["stops_paying"]) == {"tiny-random", "tiny"}
    assert [b for b, _ in result["stops_paying"]["tiny"]["speedup_by_batch"]] == [1, 2]
    table = (tmp_path / "table.md").read_text()
    assert "| tiny | 1 | eagle D4 K4 N16 |" in table and "<= 2.00x: " in table
    assert "Where the tree stops paying" in table
    assert table in capsys.readouterr().out


def test_a_spent_budget_stops_cleanly_and_lists_what_is_left(tmp_path):
    argv = ["--device", "cpu", "--target-config", "tiny-random", "--batches", "1,2", "--context", "16",
            "--steps", "3", "--rounds", "1", "--methods", "ar,ngram", "--budget-s", "1e-9", "--out", str(tmp_path)]
    assert ts.main(argv) == 2  # nothing measured: the budget was spent before the first target
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["rows"] == []
    assert result["notes"] == ["skipped (time budget spent): target tiny-random, batches [1, 2]"]


@pytest.mark.parametrize("flags, message", [
    ([], "no target"),
    (["--target-config", "tiny-random", "--methods", "eagle"], "must include ar"),
    (["--target-config", "tiny-random", "--methods", "ar,beams"], "unknown beams"),
    (["--target-config", "tiny-random", "--tree-budget", "10"], "multiple of --beam-width"),
    (["--target-config", "tiny-random", "--batches", "0"], "numbers >= 1"),
])
def test_bad_settings_are_named(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        ts.main(["--device", "cpu", "--out", str(tmp_path)] + flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_context_past_the_model_is_named(tmp_path):
    argv = ["--device", "cpu", "--target-config", "tiny-random", "--context", "1020", "--out", str(tmp_path)]
    assert ts.main(argv) == 2
    notes = json.loads((tmp_path / "results.json").read_text())["notes"]
    assert any("lower --context or --steps" in n for n in notes)


def test_bench_trees_refuses_a_batch_above_its_prompt_count(capsys):
    """The batch sweep on presets runs through scripts/bench_trees.py too: a batch larger than --num-prompts would
    silently run the prompts as one smaller batch, so it is refused before any model loads."""
    spec = importlib.util.spec_from_file_location("bench_trees", ROOT / "scripts" / "bench_trees.py")
    bt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bt)
    assert bt.main(["--preset", "tiny", "--device", "cpu", "--batches", "1,4,16", "--num-prompts", "8",
                    "--out", "unused"]) == 2
    assert "batch 16 needs at least 16 prompts: give --num-prompts >= 16 (now 8)" in capsys.readouterr().err
