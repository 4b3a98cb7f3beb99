"""scripts/server_soak.py on the CPU with tiny: a small burst of every request kind against a real `workbench serve`
process; every check holds and the server is gone afterwards."""
import doctest
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("server_soak", ROOT / "scripts" / "server_soak.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


def test_docstrings():
    assert doctest.testmod(soak).failed == 0


def test_a_small_burst_of_every_kind_leaves_the_server_whole(tmp_path):
    rc = soak.main(["--requests", "40", "--max-tokens", "8", "--max-num-seqs", "4", "--seed", "3",
                    "--out", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, {k: v for k, v in result["checks"].items() if not v}
    assert all(result["checks"].values()) and result["passed"]
    assert min(result["requests_by_kind"].values()) > 0 and result["ended_by_reason"].get("abort", 0) >= 1
    assert result["kv_free_blocks_after"] == result["kv_blocks"] > 0
    assert "| KV pool whole, nothing running, within 60 s | yes |" in (tmp_path / "table.md").read_text()
