"""Programmatic dependent launch (kernels/pdl.py) on CPU: the switch, its scope per engine call, the knob's way into the
engine and the run record, and (where triton is installed) that the kernels compiled for sm_90 carry the wait and the
trigger. Whether PDL pays, and that it changes no token, is measured on a GPU (scripts/gpu_quant.py)."""
import inspect

import pytest
import torch

from kernels import pdl
from tests.test_engine import PROMPTS, draft, reference_greedy, target  # noqa: F401 (fixtures)
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DraftModelDrafter


@pytest.fixture(autouse=True)
def restore_switch():
    before = pdl.pdl_requested()
    yield
    pdl.set_pdl(before)


def test_no_dependent_launches_on_a_cpu_even_when_asked():
    pdl.set_pdl(True)
    assert pdl.pdl_requested()
    assert "CUDA GPU" in pdl.pdl_problem("cpu") or "triton" in pdl.pdl_problem("cpu")
    assert pdl.use_pdl("cpu") is False


def test_dependent_launches_only_while_a_graph_is_captured(monkeypatch):
    """On a device that can, a launch uses PDL only while a CUDA graph is being captured (eager launches measured slower
    with it); pdl_applied follows."""
    pdl.set_pdl(True)
    monkeypatch.setattr(pdl, "pdl_problem", lambda device: None)  # a device that can (none here)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert pdl.use_pdl("cuda") is False
    capturing[0] = True
    assert pdl.use_pdl("cuda") is True
    with pdl.pdl_scope(False):
        assert pdl.use_pdl("cuda") is False  # not asked for
    assert pdl.pdl_applies(True, "cuda", captured=True) and not pdl.pdl_applies(True, "cuda", captured=False)
    assert not pdl.pdl_applies(False, "cuda", captured=True)


def test_a_warm_up_for_capture_launches_as_the_capture_will(monkeypatch):
    """Inside `warming_for_capture` (the graph warm-up before a capture) launches take PDL as captured ones will, so
    the PDL kernel variants are compiled and loaded before the capture, not in it; outside, eager launches do not."""
    pdl.set_pdl(True)
    monkeypatch.setattr(pdl, "pdl_problem", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert pdl.use_pdl("cuda") is False
    with pdl.warming_for_capture():
        assert pdl.use_pdl("cuda") is True
        with pdl.pdl_scope(False):
            assert pdl.use_pdl("cuda") is False  # not asked for
    assert pdl.use_pdl("cuda") is False
    with pytest.raises(RuntimeError), pdl.warming_for_capture():
        raise RuntimeError("a failed warm-up")
    assert pdl.use_pdl("cuda") is False  # reset after an error


def test_graph_warm_up_runs_inside_warming_for_capture(monkeypatch):
    """FixedShapeStep._record warms its body up under warming_for_capture and captures outside it (CUDA calls
    stubbed: no GPU here)."""
    import contextlib
    import types

    from workbench.engine import graphs
    for name in ("synchronize", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)
    stub_stream = types.SimpleNamespace(wait_stream=lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: stub_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: stub_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    seen = []
    step = types.SimpleNamespace(device="cuda", _pool=None, name="s", stats=graphs.GraphStats(),
                                 warm_up=lambda bufs: seen.append(("warm", pdl._WARMING)),
                                 _fn=lambda **kw: seen.append(("capture", pdl._WARMING)))
    bufs = types.SimpleNamespace(buf={}, size=1, graph=None, out=None)
    graphs.FixedShapeStep._record(step, bufs, 0)
    assert seen == [("warm", True), ("capture", False)] and bufs.graph == "graph"


def test_scope_sets_the_switch_and_restores_it_after_an_error():
    pdl.set_pdl(True)
    with pdl.pdl_scope(False):
        assert not pdl.pdl_requested()
    assert pdl.pdl_requested()
    with pytest.raises(RuntimeError):
        with pdl.pdl_scope(False):
            raise RuntimeError("boom")
    assert pdl.pdl_requested()


@pytest.mark.parametrize("on", [True, False])
def test_engine_calls_run_under_the_engines_pdl_setting(on, target, draft):
    """Kernels launched inside generate (target and draft forwards, graph captures) see the engine's `pdl`; the
    process-wide switch is what it was before the call, and the output is greedy either way."""
    seen = []
    hooks = [m.register_forward_hook(lambda *_: seen.append(pdl.pdl_requested())) for m in (target, draft)]
    pdl.set_pdl(not on)
    try:
        engine = SpecEngine(target, DraftModelDrafter(draft, k=3),
                            EngineConfig(max_new_tokens=8, cuda_graphs=True, graph_batch_sizes=(1, 2, 4), pdl=on))
        out = engine.generate(PROMPTS[:2]).outputs
    finally:
        for h in hooks:
            h.remove()
    assert seen and set(seen) == {on}
    assert pdl.pdl_requested() is (not on)
    assert out == [reference_greedy(target, p, 8) for p in PROMPTS[:2]]


def test_bench_records_pdl_and_whether_it_applied(tmp_path):
    from workbench.harness.bench import BenchConfig, BenchSession

    session = BenchSession.load(preset="tiny", device="cpu", dtype="float32")
    rec = session.run(BenchConfig(method="ar", batch=1, num_prompts=1, max_new_tokens=4, repeats=1, warmup=0,
                                  pdl=True)).record
    assert rec["pdl"] is True and rec["pdl_applied"] is False  # asked for, but no GPU here


@pytest.mark.triton_compiler  # compiles for sm_90 without a GPU
def test_kernels_compiled_for_hopper_carry_the_wait_and_the_trigger():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton

    from kernels import paged_attention as pa, quant_gemv as qg

    def ptx(fn, types, consts):
        # constexprs left out take their defaults (as a launch does; ASTSource would type them as runtime ints)
        consts = {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty
                  } | consts
        sig = {n: types.get(n, "constexpr" if n in consts else "i32") for n in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(launch_pdl=True, num_warps=8)).asm["ptx"]

    gemv = ptx(qg._gemv_kernel, {**{n: "*bf16" for n in ("x_ptr", "out_ptr", "r_ptr", "nw_ptr")},
                                 "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "z_ptr": "*fp32", "part_ptr": "*fp32",
                                 "count_ptr": "*i32", "sq_ptr": "*fp32", "eps": "fp32"},
               dict(FMT=2, GROUP=1, BLOCK_M=1, BLOCK_N=32, BLOCK_K=256, DOT_PRECISION="tf32", GLU=False,
                    RESIDUAL=True, NORM=False, F16_DOT=True, X_SCALE=2.0 ** -6, CVT_BITS=False, PDL=True))
    assert "griddepcontrol.wait" in gemv and "griddepcontrol.launch_dependents" in gemv
    write_types = {n: "*bf16" for n in ("k_ptr", "v_ptr", "kp_ptr", "vp_ptr", "cos_ptr", "sin_ptr")} | {
        "slot_ptr": "*i64"}
    write = ptx(pa._kv_write_kernel, write_types, dict(BLOCK_H=32, D=128, PDL=True))
    assert "griddepcontrol.wait" in write and "griddepcontrol.launch_dependents" in write
    plain = ptx(pa._kv_write_kernel, write_types, dict(BLOCK_H=32, D=128, PDL=False))
    assert "griddepcontrol" not in plain
    # RoPE folded in (the fused path's default): the write and the attention kernel compile for sm_90 with it
    ptx(pa._kv_write_kernel, write_types, dict(BLOCK_H=32, D=128, PDL=True, ROPE=True))
    attn_types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "cos_ptr", "sin_ptr")} | dict(
        table_ptr="*i32", rows_ptr="*i64", base_ptr="*i64", intra_bits_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32",
        ks_ptr="*fp32", vs_ptr="*fp32", qk_scale_log2="fp32")
    attn = ptx(pa._partial_kernel, attn_types, dict(T=1, GROUP=8, HKV=4, D=64, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_N=64,
                                                    CAUSAL=True, DOT_PRECISION="tf32", QUANT=False, PDL=True,
                                                    ROPE=True))
    assert "griddepcontrol.wait" in attn
