"""scripts/bench_trees.py on the CPU with the tiny preset: 1 prompt x 4 tokens through every row and the
per-category runs; its outputs (results.json, table.md), its docstring examples and its named errors."""
import doctest
import importlib.util
import json
from pathlib import Path

import pytest

from workbench import settings

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_trees", ROOT / "scripts" / "bench_trees.py")
bt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bt)

TINY = ["--preset", "tiny", "--device", "cpu", "--num-prompts", "1", "--max-new-tokens", "4", "--repeats", "1",
        "--warmup", "0", "--batches", "1", "--category-prompts", "1"]


def test_docstring_examples():
    assert doctest.testmod(bt).failed == 0


def test_tiny_run_writes_every_row_and_the_best_width_per_category(tmp_path, capsys):
    assert bt.main(TINY + ["--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    labels = [r["label"] for r in result["rows"]]
    eagle = "eagle" in settings.METHODS
    assert labels[:3] == ["ar", "draft k=4", "ngram k=4"]
    assert labels[-3:] == ["redrafter W=1 L=4", "redrafter W=2 L=4", "redrafter W=4 L=4"]
    assert sum(label.startswith("eagle") for label in labels) == (2 if eagle and bt.eagle_note() is None else 0)
    assert eagle or any("method 'eagle' is not registered" in n for n in result["notes"])
    rows = {r["label"]: r for r in result["rows"]}
    assert all(r["error"] is None for r in rows.values()), [r["error"] for r in rows.values()]
    assert all(r["greedy_matches_ar"] for label, r in rows.items() if label != "ar")
    w1, w4 = rows["redrafter W=1 L=4"], rows["redrafter W=4 L=4"]
    assert w1["beam_diversity_mean"] == 1.0 and w1["beam_disagreement_mean"] is None
    assert 0.25 <= w4["beam_diversity_mean"] <= 1 and 0 <= w4["beam_disagreement_mean"] <= 1
    assert sum(w4["acceptance_by_rank"]) == pytest.approx(w4["mean_accepted_tokens"] - 1)
    assert rows["draft k=4"]["draft_target_cost_ratio"] > 0 and rows["ar"]["mean_accepted_tokens"] == 1.0
    assert all(r["tokens_per_s_min"] == r["tokens_per_s_max"] == r["tokens_per_s"] for r in rows.values())  # 1 repeat
    cats = {c["category"]: c for c in result["categories"]}
    assert set(cats) == {"signature", "class", "mid_function"}  # the tiny preset's prompt categories
    for c in cats.values():
        assert [r["beam_width"] for r in c["rows"]] == [1, 2, 4] and c["prompts"] == 1
        assert c["best_w_by_tokens_per_s"] in (1, 2, 4) and c["best_w_by_mean_accepted"] in (1, 2, 4)
    assert result["meta"]["dtype"] == "float32" and result["meta"]["cuda_graphs"] is False
    assert result["meta"]["redrafter_head"].endswith("redrafter")  # the committed trained head, not a fallback
    table = (tmp_path / "table.md").read_text()
    assert "| redrafter W=4 L=4 | 1 |" in table and "Best ReDrafter beam width per prompt category" in table
    assert table in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--batches", "0"], "batch=0 is outside"),
    (["--beam-widths", "1,9"], "beam_width=9 is outside"),
    (["--max-new-tokens", "5000"], "lower max_new_tokens"),
    (["--preset", "nope"], "unknown zoo preset"),
])
def test_bad_settings_are_named_before_any_run(tmp_path, capsys, flags, message):
    assert bt.main(TINY + ["--out", str(tmp_path)] + flags) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_eagle3_rows_run_with_their_own_tree_and_name_their_head(tmp_path):
    flags = ["--category-prompts", "0", "--beam-widths", "1", "--tree-budgets", "4", "--tree-depth", "2",
             "--tree-topk", "2", "--eagle3-trees", "2:2:4,3:2:6"]
    assert bt.main(TINY + ["--out", str(tmp_path)] + flags) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {r["label"]: r for r in result["rows"]}
    e3 = [rows["eagle3 budget=4 depth=2 topk=2"], rows["eagle3 budget=6 depth=3 topk=2"]]
    assert all(r["method"] == "eagle3" and r["error"] is None and r["greedy_matches_ar"] for r in e3)
    assert result["meta"]["eagle3_head"].startswith("untrained")  # tiny ships no EAGLE-3 head
    assert result["meta"]["eagle_head"].endswith("eagle")


@pytest.mark.parametrize("flags, message", [
    (["--eagle3-trees", "5:8"], "is not depth:topk:budget"),
    (["--batches", "1,x"], "not a comma-separated list"),
    (["--cuda-graphs"], "needs --device cuda"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_flags_are_argparse_errors(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        bt.main(TINY + ["--out", str(tmp_path)] + flags)
    assert e.value.code == 2 and message in capsys.readouterr().err
