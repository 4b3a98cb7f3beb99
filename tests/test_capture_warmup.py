"""A step captured on first use (a new batch bucket mid-generation, serving's first batch of a size, a step rebuilt over
new buffers) runs its body twice as warm-ups before the capture, on the live rows' real inputs. A step that advances
its own state (kv_len) must see the same state in each warm-up: else the second one verifies the *next* step, writes
K/V past the blocks planned for this one (through block-table entries that name another row's block) and corrupts a
prompt. The CPU runs fixed-shape steps eagerly, so the capture's warm-ups are stood in for here: before a bucket's
first use, `FixedShapeStep.warm_up` (the method the GPU capture calls) runs on the loaded inputs."""
import pytest
import torch

from tests.test_engine import DRAFTERS, PROMPTS, draft, make_drafter, reference_greedy, target  # noqa: F401 (fixtures)
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.graphs import FixedShapeStep


@pytest.fixture
def warm_ups_on_first_use(monkeypatch):
    """Every bucket's first use runs the capture's warm-ups on the real inputs first, as `_record` does on a GPU."""
    used = []
    call = FixedShapeStep.__call__

    def first_use_warms_up(self, key, b, inputs, rows_host=None):
        size = self.settings.bucket(b)
        if size is not None and (id(self), size, key) not in used:
            used.append((id(self), size, key))
            bufs = self._get(size, key)
            bufs.load(b, inputs, rows_host)
            self.warm_up(bufs)
        return call(self, key, b, inputs, rows_host)

    monkeypatch.setattr(FixedShapeStep, "__call__", first_use_warms_up)
    return used


@pytest.mark.parametrize("kind", [k for k in DRAFTERS if k not in ("self-draft", "noisy-self-draft")])
def test_warm_ups_before_a_capture_leave_the_output_unchanged(kind, target, draft, warm_ups_on_first_use):
    n = 24
    drafter = None if kind == "ar" else make_drafter(kind, draft, target)
    engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=n, paged=True, kv_block_size=4, cuda_graphs=True,
                                                      graph_batch_sizes=(1, 2, 4)))
    for prompt in PROMPTS:  # one at a time: each generate's steps are first used on a live row
        out = engine.generate([prompt]).outputs[0]
        assert out == reference_greedy(target, prompt, n), f"{kind}: warm-ups on the live row changed its output"
    assert warm_ups_on_first_use  # the stand-in ran


def test_warm_up_puts_the_state_back_before_each_run():
    """The body sees the same state in every warm-up run (and after them), not the state its last run left."""
    from workbench.engine.graphs import GraphSettings

    length = torch.zeros(1, dtype=torch.long)
    seen = []

    def body(x):
        seen.append(int(length))
        length.add_(x.sum())
        return length.clone()

    pads = lambda key: {"x": torch.ones(1, dtype=torch.long)}  # noqa: E731
    step = FixedShapeStep("toy", body, pads, GraphSettings(cuda_graphs=True, batch_sizes=(1,)), "cpu",
                          state=lambda: [length])
    bufs = step._get(1, 0)
    bufs.load(1, {"x": torch.tensor([[2]])}, [0])
    step.warm_up(bufs, times=3)
    assert seen == [0, 0, 0] and int(length) == 0


def test_graphs_docstring_examples():
    """workbench/engine/graphs.py's worked examples (buckets, compile options, padded prefill lengths) and
    kernels/tuning.py's (the tuning record's text and its inductor options)."""
    import doctest

    import kernels.tuning
    import workbench.engine.graphs

    assert doctest.testmod(workbench.engine.graphs).failed == 0
    assert doctest.testmod(kernels.tuning).failed == 0


def test_compiled_steps_take_the_kernel_tunings_inductor_options():
    """The engine's kernel_tuning reaches every compiled step's torch.compile options (PDL and combo kernels by
    default; 0 turns either off), over the compile mode's own options."""
    from workbench.engine import EngineConfig
    from workbench.engine.graphs import compile_options

    on = EngineConfig(compile="default").graphs
    assert compile_options(on) == {"triton.enable_pdl": True, "combo_kernels": True}
    off = EngineConfig(compile="max-autotune", kernel_tuning="inductor_pdl=0,inductor_combo=0").graphs
    assert compile_options(off) == {"max_autotune": True, "coordinate_descent_tuning": True,
                                    "triton.enable_pdl": False, "combo_kernels": False}
