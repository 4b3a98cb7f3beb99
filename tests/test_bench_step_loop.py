"""scripts/bench_step_loop.py on the CPU: an A/B against a step.py loaded from a file (here today's own, so the two
engines must agree token for token), its outputs, and named argument errors."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_step_loop", ROOT / "scripts" / "bench_step_loop.py")
sl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sl)


def test_ab_run_against_a_loaded_step_module(tmp_path, capsys):
    rc = sl.main(["--device", "cpu", "--out", str(tmp_path), "--ref-step", str(ROOT / "workbench/engine/step.py"),
                  "--methods", "ar,draft", "--modes", "eager,graphs+overlap", "--batches", "2",
                  "--max-new-tokens", "5", "--repeats", "1", "--prompt-len", "8"])
    assert rc == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["method"], r["mode"]) for r in rows] == [("ar", "eager"), ("ar", "graphs+overlap"),
                                                        ("draft", "eager"), ("draft", "graphs+overlap")]
    assert all(r["outputs_equal"] and r["steps"] == r["ref_steps"] and r["ratio"] > 0 for r in rows)
    assert "| ar | eager | 2 |" in (tmp_path / "table.md").read_text()


def test_bad_arguments_are_named(tmp_path, capsys):
    assert sl.main(["--device", "cpu", "--out", str(tmp_path), "--ref-step", str(tmp_path / "none.py")]) == 2
    assert "git show REV:workbench/engine/step.py" in capsys.readouterr().err
    assert sl.main(["--device", "cpu", "--out", str(tmp_path), "--modes", "turbo"]) == 2
    assert "--modes: unknown ['turbo']" in capsys.readouterr().err
    assert sl.main(["--device", "cpu", "--out", str(tmp_path), "--batches", "1,x"]) == 2
    assert "--batches '1,x'" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
