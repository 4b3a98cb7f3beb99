"""scripts/gpu_serving_trees.py on a CPU (its smoke run): every method served, rows with spreads and paired ratios,
the greedy check run, and a bad setting named before any model loads."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import gpu_serving_trees  # noqa: E402


def test_smoke_run_serves_every_method_and_checks_greedy(tmp_path):
    rc = gpu_serving_trees.main(["--device", "cpu", "--preset", "tiny", "--num-requests", "4", "--max-new-tokens",
                                 "6", "--repeats", "1", "--max-num-seqs", "2", "--rates", "1",
                                 "--greedy-check-requests", "2", "--compile", "off", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"ar", "draft", "eagle", "redrafter"}
    for method, row in rows.items():
        assert row["rounds"] == 1 and not row["errors"]
        assert row["output_throughput"][0] > 0 and row["output_x_ar"][0] > 0
        assert row["greedy_matches_solo"] is True  # float32 on a CPU: exact
    assert rows["ar"]["output_x_ar"][0] == 1.0
    assert rows["eagle"]["mean_accepted_tokens"][0] >= 1.0
    table = (tmp_path / "table.md").read_text()
    assert "eagle D4 K4 N16" in table and "torch.compile off" in table


def test_bad_tree_setting_is_named_before_loading(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded for a bad setting")

    monkeypatch.setattr(gpu_serving_trees.BenchSession, "load", refuse)
    with pytest.raises(Exception, match="tree_budget"):
        gpu_serving_trees.main(["--device", "cpu", "--preset", "tiny", "--tree-budget", "99", "--out", str(tmp_path)])


def test_calibrated_method_serves_with_the_schedule_measured_in_its_warm_up(tmp_path):
    rc = gpu_serving_trees.main(["--device", "cpu", "--preset", "tiny", "--num-requests", "4", "--max-new-tokens",
                                 "6", "--repeats", "1", "--max-num-seqs", "2", "--rates", "1", "--methods",
                                 "ar,eagle+cal", "--greedy-check-requests", "2", "--compile", "off", "--out",
                                 str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())
    schedule = result["meta"]["schedules"]["eagle+cal"]
    assert schedule["error"] is None and json.loads(schedule["calibration_table"])["measured"]
    k_by_batch = schedule["k_by_batch"]  # a tree: every range turns the whole 16-node tree on or off
    assert k_by_batch and all(part.split(":")[1] in ("0", "16") for part in k_by_batch.split(","))
    run = next(r for r in result["runs"] if r["method"] == "eagle+cal")
    assert run["k_by_batch"] == k_by_batch and run["greedy_matches_solo"] is True
    row = next(r for r in result["rows"] if r["method"] == "eagle+cal")
    assert row["label"] == f"eagle D4 K4 N16, adaptive ({k_by_batch})"
    assert f"adaptive ({k_by_batch})" in (tmp_path / "table.md").read_text()


def test_docstring_examples():
    import doctest

    assert doctest.testmod(gpu_serving_trees).failed == 0
