"""scripts/eager_step_ops.py: every fixed-shape step's tensor work runs inside torch.compile's graphs (on a GPU: fused
kernels in the captured step) except the steps' input copies. A drafter that loops over model forwards inline runs
its glue eagerly (dynamo skips a frame with a graph break inside a loop); this catches that coming back."""
import pytest
import torch

from scripts.count_step_ops import prompts_of
from scripts.eager_step_ops import eager_ops
from workbench.engine import graphs

KNOBS = {"k": 3, "tree_depth": 3, "tree_topk": 2, "tree_budget": 5, "beam_width": 2, "beam_length": 3,
         "diversity_penalty": 0.0}


@pytest.fixture(scope="module")
def session():
    from workbench.harness.bench import BenchSession
    torch.manual_seed(0)
    return BenchSession.load(preset="tiny", device="cpu", dtype="float32")


@pytest.mark.parametrize("method,draft_step", [("eagle", "eagle"), ("draft", "draft-chain"),
                                               ("redrafter", "redrafter"), ("ar", None)])
def test_steps_run_in_compiled_graphs(session, method, draft_step, monkeypatch):
    monkeypatch.setattr(graphs, "STATIC_CPU_OUTPUTS", False)
    steps = eager_ops(session, method, prompts_of(session, 1, 24), KNOBS)
    verify = "target+accept" if method in ("ar", "draft") else "target+tree"
    assert set(steps) == {verify} | ({draft_step} if draft_step else set())
    for name, r in steps.items():
        assert r["calls"] >= 1 and r["in_graph"] > 20, (name, r)
        assert set(r["eager"]) <= {"copy_"}, (name, r["eager"])  # the input copies into the step's buffers only
    if draft_step:
        assert not steps[draft_step]["eager"]
