"""scripts/launch_rank_check.py on a CPU (its smoke run): both sides measured at every k, the rank agreement written,
no server left running."""
import doctest
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import launch_rank_check  # noqa: E402


def test_docstrings():
    assert doctest.testmod(launch_rank_check).failed == 0


def test_smoke_run_measures_both_sides_and_stops_every_server(tmp_path):
    rc = launch_rank_check.main(["--ks", "1,2", "--rounds", "1", "--num-requests", "3", "--max-new-tokens", "6", "--warmup-requests",
                                 "1", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["k"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        assert r["http_output_tok_s"] > 0 and r["inproc_output_tok_s"] > 0 and r["http_error"] is None
    assert result["spearman_rho"] in (-1.0, 1.0) and result["servers_started"] == 2 and result["servers_left"] == []
    assert "Rank agreement by output tok/s" in (tmp_path / "table.md").read_text()
