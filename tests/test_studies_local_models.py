"""A study over local model paths (not a preset) with its own prompt file."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "workbench" / "zoo" / "weights" / "tiny"


def test_study_on_local_paths_with_prompt_file(tmp_path):
    from results.store import ResultStore

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):\\n    return"}\n{"prompt": "class Stack:\\n    def push(self, x):"}\n')
    cmd = [sys.executable, "-m", "studies.run", "--model", str(TINY / "target"), "--draft", str(TINY / "draft"),
           "--prompts", str(prompts), "--study", "local", "--trials", "2", "--storage",
           f"sqlite:///{tmp_path / 's.db'}", "--store", str(tmp_path / "store"), "--threads", "1",
           "--max-new-tokens", "6", "--num-prompts", "2", "--methods", "draft", "--k", "2-3"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    df = ResultStore(tmp_path / "store").load(study="local")
    assert len(df) == 2 and set(df["status"]) == {"ok"}
    assert set(df["prompts_source"]) == {str(prompts)}
    assert set(df["draft_path"]) == {str(TINY / "draft")}
