"""scripts/gpu_verify_width.py on the CPU: the width tables and, with --profile, each width's own kernels."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import gpu_verify_width  # noqa: E402


def test_profile_compares_the_narrow_step_with_the_wide_one(tmp_path):
    assert gpu_verify_width.main(["--device", "cpu", "--target-config", "tiny-random", "--widths", "1,9", "--iters",
                                  "2", "--rounds", "1", "--profile", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    verify = {(r["name"], r["rows"]): r for r in rows if r["part"] == "verify"}
    assert set(verify) == {("causal", 1), ("causal", 9), ("tree", 1), ("tree", 9)}
    kernels = [r for r in rows if r["part"] == "kernel"]
    total = kernels[0]
    assert total["name"] == "(all kernels)" and total["width"] == 9
    assert total["us_t1"] > 0 and total["us_wide"] > 0
    # each width profiled its own call: a 9-token tree step runs ops a 1-token causal one does not (the mask's)
    assert any(r["calls_t1"] != r["calls_wide"] for r in kernels[1:])
    assert "Kernels of one verify step" in (tmp_path / "table.md").read_text()
