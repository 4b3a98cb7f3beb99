"""The captured tree step (SpecEngine._verify_tree): tree verify, acceptance (greedy and sampled over deterministic
candidates), the accepted path's KV move, the state update and the drafter's device commit as one fixed-shape step.
On a CPU with cuda_graphs the padded step runs eagerly over the same buffers a GPU captures; it must give the eager
path's tokens and accepted counts exactly (fp32), for EAGLE-2 trees and ReDrafter beams, batch 1 and ragged, paged and
contiguous, greedy and sampled, and make no host read inside the step."""
import pytest
import torch

from tests.test_engine import PROMPTS, target  # noqa: F401 (fixture)
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import EagleDrafter, EagleHead, RedrafterDrafter, RedrafterHead
from workbench.engine.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=0.9, top_k=0, top_p=0.95)


def drafter(kind: str, target):
    if kind == "eagle":
        return EagleDrafter(EagleHead.for_target(target, seed=4, std=0.3), target, 3, 3, 7)
    if kind == "eagle-chain":
        return EagleDrafter(EagleHead.for_target(target, seed=4, std=0.3), target, 3, 1, 3)
    return RedrafterDrafter(RedrafterHead.for_target(target, seed=4, std=0.3), target, beam_width=3, beam_length=3)


def run(target, kind, prompts, graphs: bool, paged: bool, sampling=SamplingParams(), n=12, overlap=False):
    engine = SpecEngine(target, drafter(kind, target), EngineConfig(
        max_new_tokens=n, paged=paged, kv_block_size=4, cuda_graphs=graphs, graph_batch_sizes=(1, 2, 4),
        sampling=sampling, seed=3, overlap=overlap))
    return engine, engine.generate(prompts)


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch1", "ragged"])
@pytest.mark.parametrize("kind", ["eagle", "eagle-chain", "redrafter"])
def test_captured_tree_step_equals_the_eager_step(kind, prompts, paged, sampling, target):
    _, eager = run(target, kind, prompts, False, paged, sampling)
    engine, fixed = run(target, kind, prompts, True, paged, sampling)
    assert fixed.outputs == eager.outputs
    assert [s.accepted for s in fixed.steps] == [s.accepted for s in eager.steps]
    assert [s.path_ranks for s in fixed.steps] == [s.path_ranks for s in eager.steps]
    assert [s.beam_pairs for s in fixed.steps] == [s.beam_pairs for s in eager.steps]
    assert engine.tree_step.stats.hits == len(fixed.steps)  # every step ran the one tree step
    assert engine.target_step.stats.hits == 0


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("kind", ["eagle", "redrafter"])
def test_overlapped_tree_steps_equal_the_eager_ones(kind, paged, target):
    """Greedy: step t + 1 launched before step t is read (the drafters plan from upper bounds and read their roots
    and pending pairs on the device) gives the eager tokens and accepted counts."""
    _, eager = run(target, kind, PROMPTS, False, paged)
    engine, over = run(target, kind, PROMPTS, True, paged, overlap=True)
    assert engine.overlaps()
    assert over.outputs == eager.outputs
    assert sorted(a for s in over.steps for a in s.accepted) == sorted(a for s in eager.steps for a in s.accepted)


def test_tree_step_reads_nothing_on_the_host(target, monkeypatch):
    engine = SpecEngine(target, drafter("eagle", target), EngineConfig(
        max_new_tokens=8, cuda_graphs=True, graph_batch_sizes=(1, 2, 4), sampling=SAMPLED))
    engine.reserve(len(PROMPTS), max(len(p) for p in PROMPTS))  # builds the steps
    body = engine._verify_tree

    def guarded(**kwargs):
        def sync(*args):
            raise AssertionError("host sync inside the tree step")

        with pytest.MonkeyPatch.context() as mp:
            for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
                mp.setattr(torch.Tensor, name, sync)
            return body(**kwargs)

    monkeypatch.setattr(engine.tree_step, "_fn", guarded)
    res = engine.generate(PROMPTS)
    assert all(len(o) == 8 for o in res.outputs)
    assert engine.tree_step.stats.hits == len(res.steps)


def test_padding_rows_leave_the_drafter_scratch_row_as_set_up(target):
    """Padding rows commit into the scratch row too; it must stay at one pending pair at position 0, else its
    draft positions would walk past the scratch row's slots."""
    engine, res = run(target, "eagle", PROMPTS[:3], True, True)  # 3 rows pad to bucket 4
    d = engine.drafter
    pad = engine.cache.pad_row
    assert int(d.pend_base[pad]) == 0 and int(d.pend_count[pad]) == 1 and int(d.pend_pos[2, pad]) == 1
    assert len(res.steps) > 3


@pytest.mark.parametrize("kind", ["eagle", "redrafter"])
def test_steps_are_rebuilt_when_the_drafter_state_they_read_is_replaced(kind, target):
    """A captured step reads the tensors it was built over: when a drafter's setup replaces them (here one drafter
    serves two engines of different row counts in turn), the engine's tree step and the drafter's own step are built
    again over the new ones, and the outputs stay the engine's greedy ones."""
    d = drafter(kind, target)
    cfg = EngineConfig(max_new_tokens=6, cuda_graphs=True, graph_batch_sizes=(1, 2, 4))
    one, three = SpecEngine(target, d, cfg), SpecEngine(target, d, cfg)
    ref = SpecEngine(target, None, cfg)
    assert one.generate(PROMPTS[:1]).outputs == ref.generate(PROMPTS[:1]).outputs
    tree_step, draft_step = one.tree_step, d.step
    assert three.generate(PROMPTS).outputs == ref.generate(PROMPTS).outputs  # the drafter set up for 3 rows
    assert one.generate(PROMPTS[:1]).outputs == ref.generate(PROMPTS[:1]).outputs  # and for 1 row again
    assert one.tree_step is not tree_step and d.step is not draft_step
    assert all(a is b for a, b in zip(one._tree_state, d.device_state()))
    again = one.tree_step
    one.generate(PROMPTS[:1])  # nothing replaced: the same steps
    assert one.tree_step is again
