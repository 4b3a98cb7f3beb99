"""kernels/int4_mma.py: the tensor-core int4 GEMV (1-16 rows) against the fp32 reference under the Triton interpreter
(its weights computed by Triton ops, the same values the PTX computes on a GPU: scripts/gpu_gemv.py --parts mma and
--parts parity check the PTX there), its configuration and its refusals (on any machine)."""
import doctest
import os

import pytest
import torch
from torch import nn

from kernels import int4_mma as im
from kernels.quant_gemv import counters_for, dequantize_weight
from kernels.tuning import KernelTuning
from workbench.engine.quant.linears import Int4Linear


def stored(n: int, k: int, group: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
    mod = Int4Linear(lin, group, "dequant")
    return dict(weight=mod.weight, scale=mod.scale, zero=mod.zero, group_size=group)


def test_doctests():
    assert doctest.testmod(im).failed == 0


def test_refusals_name_the_problem():
    b = stored(64, 256, 64, torch.bfloat16)
    with pytest.raises(im.Int4MmaError, match="1..16 rows"):
        im.check(torch.zeros(17, 256, dtype=torch.bfloat16), b["weight"], b["scale"], b["zero"], 64)
    with pytest.raises(im.Int4MmaError, match="bf16 or fp16"):
        im.check(torch.zeros(1, 256), b["weight"], b["scale"], b["zero"], 64)
    with pytest.raises(im.Int4MmaError, match="group size 32"):
        im.check(torch.zeros(1, 256, dtype=torch.bfloat16), b["weight"], b["scale"], b["zero"], 32)
    with pytest.raises(im.Int4MmaError, match="scale and zero must be in x's dtype"):
        im.check(torch.zeros(1, 256, dtype=torch.float16), b["weight"], b["scale"], b["zero"], 64)


def test_config_splits_to_fill_the_gpu():
    c = im.int4_mma_config(1, 4096, 11008, 128, BLOCK_N=128)  # 6.7 B's down projection: 32 tiles of 128 rows
    assert c["BLOCK_N"] == 128 and c["SPLIT_K"] * c["groups_per_split"] >= 86 > (c["SPLIT_K"] - 1) * c[
        "groups_per_split"]
    assert 32 * c["SPLIT_K"] >= 2 * 132 or c["SPLIT_K"] == im.MAX_SPLIT_K
    assert im.int4_mma_config(1, 64, 256, 128, SPLIT_K=5)["SPLIT_K"] == 2  # no empty splits (2 groups)


interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CUDA GPU is here: these run the kernel under the Triton interpreter, on a machine without one (on a "
           "GPU: scripts/gpu_gemv.py --parts mma)")


@interpreter
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_matches_reference(dtype, m, split, block_n, interpreter_bf16_dot):
    n, k, group = 200, 768, 128  # N not a multiple of the tile, six groups (split 3: two each)
    b = stored(n, k, group, dtype, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(6)).to(dtype) if split == 3 else None
    counters = counters_for(n, "cpu")
    got = im.int4_mma_gemv(x, **b, counters=counters, residual=residual, SPLIT_K=split, BLOCK_N=block_n)
    assert got.dtype == dtype and got.shape == (m, n)
    want = x.float() @ dequantize_weight("int4", **b).T + (residual.float() if residual is not None else 0)
    # each weight rounded once to x's dtype before exact products and fp32 sums: the GEMV's multi-row bound
    # (tests/test_quant_gemv.py), relative to the output's size
    atol = (2 ** -6 if dtype == torch.bfloat16 else 2 ** -8) * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=atol)
    assert not counters.any()  # the last split of each tile reset its counter
    if m > 1:  # rows are independent: row 0 alone (15 masked rows) gives the same bits
        one = im.int4_mma_gemv(x[:1], **b, counters=counters, residual=None if residual is None else residual[:1],
                               SPLIT_K=split, BLOCK_N=block_n)
        torch.testing.assert_close(one.float(), got[:1].float(), rtol=0, atol=0)


@interpreter
def test_every_nibble_position_and_value_lands_on_its_k(interpreter_bf16_dot):
    """x = e_k for every k of two groups: column k of the dequantized weight, exactly (scale 1, zero 0: the weight
    q - 8 is exact in bf16), so a nibble read from the wrong position or paired with the wrong x fails."""
    n, k, group = 64, 256, 128
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    weight = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    scale = torch.ones(n, k // group, dtype=torch.bfloat16)
    zero = torch.zeros(n, k // group, dtype=torch.bfloat16)
    x = torch.eye(k, dtype=torch.bfloat16)
    got = torch.cat([im.int4_mma_gemv(x[i:i + 16], weight, scale, zero, group, SPLIT_K=1) for i in range(0, k, 16)])
    assert torch.equal(got.float(), (q - 8).float().T)


@interpreter
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("fusion", ["glu", "norm", "norm+residual"])
def test_fusions_match_quant_gemv_reference(fusion, split, interpreter_bf16_dot):
    """The prologues and the epilogue of kernels/quant_gemv.py, with its reference's meaning (quant_gemv_reference)."""
    from kernels.quant_gemv import quant_gemv_reference

    n, k, group, m, dtype = 72, 768, 128, 5, torch.bfloat16
    b = stored(n, k, group, dtype, seed=3)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(m, 2 * k if fusion == "glu" else k, generator=gen).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype) if "norm" in fusion else None
    residual = torch.randn(m, n, generator=gen).to(dtype) if "residual" in fusion else None
    got = im.int4_mma_gemv(x, **b, glu=fusion == "glu", norm_weight=nw, residual=residual, SPLIT_K=split)
    want = quant_gemv_reference(x, "int4", **b, glu=fusion == "glu", norm_weight=nw, residual=residual).float()
    atol = 2 ** -6 * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=atol)


@interpreter
def test_quant_gemv_hands_verify_widths_to_it(monkeypatch, interpreter_bf16_dot):
    """KernelTuning.int4_mma_rows: int4 calls of 2..16 rows through quant_gemv_triton are this kernel's (bit for bit),
    one-row calls and calls it does not take (fp32 x, groups of 32) stay in kernels/quant_gemv.py, and 0 turns it
    off."""
    from kernels import quant_gemv as qg

    n, k = 72, 512
    b = stored(n, k, 128, torch.bfloat16, seed=4)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    counters = qg.counters_for(n, "cpu")
    mma = im.int4_mma_gemv(x, **b)
    assert torch.equal(qg.quant_gemv_triton(x, "int4", **b, counters=counters), mma)  # the default: 16
    calls = []
    monkeypatch.setattr(im, "int4_mma_gemv", lambda *a, **kw: calls.append(1))
    qg.quant_gemv_triton(x[:1], "int4", **b, counters=counters)  # one row: the CUDA-core GEMV
    b32 = stored(n, k, 32, torch.bfloat16, seed=4)
    qg.quant_gemv_triton(x, "int4", **b32, counters=counters)  # groups of 32
    qg.quant_gemv_triton(x, "int4", **b, counters=counters, tuning="int4_mma_rows=0")
    assert calls == []
    qg.quant_gemv_triton(x, "int4", **b, counters=counters, tuning=KernelTuning(int4_mma_rows=4))  # 5 rows past it
    assert calls == []
    qg.quant_gemv_triton(x, "int4", **b, counters=counters, tuning=KernelTuning(int4_mma_rows=16))
    assert calls == [1]


def test_verify_width_calls_leave_the_prologues_to_pytorch(monkeypatch):
    """With the norm / SwiGLU fusions set, an int4 "triton" linear fuses them at one row but not where its call goes
    to the tensor-core kernel (2..int4_mma_rows rows: its prologues measured slower than torch.compile's), and keeps
    the residual epilogue there; its KernelTuning with int4_mma_rows 0 brings the fused prologues back at every
    width."""
    from workbench.engine.quant import apply_kernel_tuning, linears

    lin = nn.Linear(256, 64, bias=False).to(torch.bfloat16)
    mod = Int4Linear(lin, 128, "triton")
    mod.fusion = "norm+glu+residual"
    one, five = (torch.zeros(m, 256, dtype=torch.bfloat16) for m in (1, 5))
    assert mod.tuning.int4_mma_rows == 16  # the default
    assert mod._fuses_prologue("norm", one) and mod._fuses_prologue("glu", one)
    assert not mod._fuses_prologue("norm", five) and not mod._fuses_prologue("glu", five)
    assert mod._fuses("residual", five)
    assert mod.norm_linear(five, torch.ones(256, dtype=torch.bfloat16), 1e-6) is None  # the caller norms, then calls
    seen = []
    monkeypatch.setattr(linears, "quant_gemv_triton", lambda h, *a, glu=False, residual=None, **kw: (
        seen.append((tuple(h.shape), glu)), residual)[1])
    mod.glu_residual(torch.zeros(5, 512, dtype=torch.bfloat16), torch.zeros(5, 64, dtype=torch.bfloat16))
    assert seen == [((5, 256), False)]  # SiLU-mul done before the call, the residual still fused
    assert apply_kernel_tuning(mod, "int4_mma_rows=0") == mod.tuning == KernelTuning(int4_mma_rows=0)
    assert mod._fuses_prologue("norm", five) and mod._fuses_prologue("glu", five)
    fp32 = Int4Linear(nn.Linear(256, 64, bias=False), 128, "triton")  # fp32 x: not the kernel's, prologues fused
    fp32.fusion = "norm+glu+residual"
    assert fp32._fuses_prologue("norm", five.float())


@interpreter
def test_gpu_gemv_mma_part_times_its_tiles_beside_the_others(tmp_path, monkeypatch):
    """scripts/gpu_gemv.py --parts mma on the mini config (interpreter): per linear and M, bf16, tinygemm, our
    GEMV and each int4_mma tile of the grid with its parity, one best int4_mma tile each, then the layer sums."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_gemv

    monkeypatch.setattr(sys, "argv", ["gpu_gemv.py", "--device", "cpu", "--out", str(tmp_path), "--parts", "mma",
                                      "--sweep-configs", "mini", "--mma-ms", "2", "--mma-block-n", "64",
                                      "--mma-warps", "4", "--mma-stages", "2,3", "--mma-per-sm", "2",
                                      "--replays", "1", "--int4-group-size", "64"])
    gpu_gemv.main()
    rows = json.loads((tmp_path / "gemv_mma.json").read_text())["rows"]
    assert all("error" not in r for r in rows)
    per_linear = [r for r in rows if r["linear"] != "layer"]
    linears = {r["linear"] for r in per_linear}
    assert len(linears) == 4
    for lin in linears:
        at = [r for r in per_linear if r["linear"] == lin]
        assert [r["kernel"] for r in at] == ["bf16", "aten", "triton", "mma", "mma"]
        assert [r["tile"] for r in at][3:] == ["64 w4 s2 ps2", "64 w4 s3 ps2"]
        assert sum(bool(r.get("best")) for r in at) == 1 and all(r["rel_err"] <= 2 ** -7 for r in at[1:])
    layer = {r["kernel"]: r for r in rows if r["linear"] == "layer"}
    assert set(layer) == {"bf16", "aten", "triton", "mma"} and layer["mma"]["linears"] == 4
