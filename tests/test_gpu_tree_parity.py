"""scripts/gpu_tree_parity.py on the CPU: each (dtype, method, variant) runs twice and lands as one JSON line with the
parity fields; an unknown variant is named."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_tree_parity  # noqa: E402


def test_rows_hold_parity_and_run_to_run_equality(tmp_path):
    assert gpu_tree_parity.main(["--device", "cpu", "--methods", "redrafter", "--dtypes", "float32", "--variants",
                                 "default,no_overlap", "--num-prompts", "2", "--max-new-tokens", "8",
                                 "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "parity.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["default", "no_overlap"]
    for r in rows:
        assert r["greedy_matches_ar"] == [True, True] and r["runs_identical"] and r["ar_runs_identical"]
        assert r["first_divergence"] == [[None, None], [None, None]] and len(r["mean_accepted"]) == 2


def test_unknown_variant_is_named(capsys):
    with pytest.raises(SystemExit):
        gpu_tree_parity.main(["--variants", "default,fast", "--out", "/tmp/unused"])
    assert "unknown variant(s) fast" in capsys.readouterr().err
