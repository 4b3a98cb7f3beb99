"""kernels/quant_gemv: the reference against the quant modules' own dequantization (always, on CPU), and the Triton
kernel against the reference under the Triton interpreter (TRITON_INTERPRET=1; skipped where triton is missing)."""
import doctest
import os

import pytest
import torch
from torch import nn

import kernels.quant_gemv as qg
from kernels.tuning import KernelTuning
from kernels.quant_gemv import (GemvError, check_gemv, counters_for, dequantize_weight, gemv_config,
                                quant_gemv_reference, quant_gemv_triton)
from workbench.engine.quant import QuantError, check_quant, quantize_model, set_fusion
from workbench.engine.quant.gguf import GgufInt8Linear
from workbench.engine.quant.linears import DenseGemvLinear, Fp8Linear, Int4Linear, Int8Linear
from workbench.models import LlamaModel, ModelConfig


def int8g_linear(lin: nn.Linear, group_size: int, kernel: str) -> GgufInt8Linear:
    """A Q8_0-style module of `lin`: per group of g input channels, scale = absmax / 127 rounded to float16 (as
    ggml's d), q = round(w / scale) in int8."""
    w = lin.weight.detach().float()
    n, k = w.shape
    wg = w.reshape(n, k // group_size, group_size)
    scale = (wg.abs().amax(-1).clamp(min=1e-8) / 127).half().float()  # [N, K/g]
    q = torch.round(wg / scale[..., None]).clamp(-128, 127).to(torch.int8).reshape(n, k)
    return GgufInt8Linear(q, scale, kernel, group_size=group_size)


def stored(fmt: str, n: int, k: int, group_size: int = 32, dtype=torch.float32, seed: int = 0):
    """(module, buffers for quant_gemv) of a random linear [N, K] quantized by the modules' own rules (int8g: the
    GGUF Q8_0 module, float16 scales (rounded so, as ggml's d) whatever `dtype`)."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
    if fmt == "int8":
        mod = Int8Linear(lin, "dequant")
        return mod, dict(weight=mod.weight, scale=mod.scale)
    if fmt == "int4":
        mod = Int4Linear(lin, group_size, "dequant")
        return mod, dict(weight=mod.weight, scale=mod.scale, zero=mod.zero, group_size=group_size)
    if fmt == "dense":
        mod = DenseGemvLinear(lin, "dequant")  # "dequant": F.linear at every size (the reference path)
        return mod, dict(weight=mod.weight)
    if fmt == "int8g":
        mod = int8g_linear(lin, group_size, "dequant")
        return mod, dict(weight=mod.weight, scale=mod.scale, group_size=group_size)
    mod = Fp8Linear(lin, "dequant")
    return mod, dict(weight=mod.weight, scale=mod.scale)


def test_doctests():
    assert doctest.testmod(qg).failed == 0


@pytest.mark.parametrize("fmt", qg.GEMV_FORMATS)
def test_reference_reads_the_modules_buffers(fmt):
    """dequantize_weight of the stored buffers is the weight the module multiplies by (its own dequantization)."""
    mod, buffers = stored(fmt, 24, 64)
    torch.testing.assert_close(dequantize_weight(fmt, **buffers), mod.dequantized_weight(), atol=0, rtol=0)
    x = torch.randn(3, 64)
    torch.testing.assert_close(quant_gemv_reference(x, fmt, **buffers), mod(x), atol=1e-4, rtol=1e-5)


def test_config_depends_on_shapes_only_and_splits_only_when_n_tiles_cannot_fill_the_gpu():
    wide = gemv_config("int8", 1, 4096, 4096)
    assert wide == gemv_config("int8", 1, 4096, 4096)
    assert wide["SPLIT_K"] == 1 and wide["BLOCK_M"] == 1  # 256 N tiles: every one of 132 SMs has a program
    narrow = gemv_config("int8", 1, 1024, 4096)
    assert narrow["SPLIT_K"] > 1 and narrow["SPLIT_K"] * narrow["tiles_per_split"] >= 4096 // narrow["BLOCK_K"]
    assert gemv_config("fp8", 1, 1024, 4096, sm_count=8)["SPLIT_K"] == 1  # a small GPU: 64 tiles fill it
    assert gemv_config("int4", 1, 4096, 4096, 128, int4_wide=False)["SPLIT_K"] > 1  # 64 N tiles of 64 rows: split
    assert gemv_config("int8", 9, 4096, 4096)["BLOCK_M"] == 16
    assert gemv_config("int8", 64, 4096, 4096)["SPLIT_K"] == 1  # prefill-sized: no split
    tiny_group = gemv_config("int4", 1, 64, 4096, 32, int4_wide=False)
    assert tiny_group["BLOCK_K"] == 32 and tiny_group["SPLIT_K"] * tiny_group["tiles_per_split"] >= 4096 // 32
    for m in (1, 9):  # int8g: K tiles inside one group (GGUF Q8_0's 32), as int4's
        q8 = gemv_config("int8g", m, 4096, 4096, 32)
        assert q8["BLOCK_K"] == 32 and q8["SPLIT_K"] * q8["tiles_per_split"] >= 4096 // 32
    assert gemv_config("int8g", 1, 4096, 4096, 256)["BLOCK_K"] == 128
    assert gemv_config("int8", 1, 64, 48)["BLOCK_K"] == 64  # no K tile past the next power of two of K


def test_narrow_outputs_take_eight_row_tiles_only_where_sixteen_rows_leave_sms_idle():
    """dense / fp8 one-row calls: 8-row tiles where 16-row ones give < 1.5 programs per SM (1.45 B's q/k/v, o, down:
    measured faster), 16 rows where they give more (6.7 B's N = 4096: measured slower with 8); int8, wide N and M > 1
    keep their tiles; the module switches are part of the launch cache's key."""
    for fmt in ("dense", "fp8"):
        for n, k in ((2560, 2048), (2048, 2048), (2048, 8192)):
            assert gemv_config(fmt, 1, n, k)["BLOCK_N"] == 8
            assert gemv_config(fmt, 1, n, k, narrow=False)["BLOCK_N"] == 16
        assert gemv_config(fmt, 1, 4096, 4096)["BLOCK_N"] == 16  # 256 programs on 132 SMs
        assert gemv_config(fmt, 1, 4096, 4096, sm_count=264)["BLOCK_N"] == 8  # the same shape on a wider GPU
        assert gemv_config(fmt, 1, 16384, 2048)["BLOCK_N"] == 32
        assert gemv_config(fmt, 4, 2048, 2048)["BLOCK_M"] == 16
    assert gemv_config("int8", 1, 2048, 2048)["BLOCK_N"] == 16
    assert gemv_config("dense", 1, 2048, 8192)["BLOCK_K"] == 1024 and gemv_config("fp8", 1, 2048, 8192)["BLOCK_K"] == 2048
    assert gemv_config("fp8", 1, 2048, 2048)["BLOCK_K"] == 1024  # at most half of K
    assert qg._cached_config("fp8", 1, 16384, 2048, None, 132, ())["num_warps"] == 8  # wide fp8 tiles: 8 warps


def test_measured_one_row_tiles_replace_the_table_for_their_shape_only():
    """set_m1_tiles (a tile sweep's winners, keyed by format and shape) changes the launch of one-row calls of that
    shape and nothing else; unknown entries are refused before anything changes."""
    before = qg._cached_config("fp8", 1, 4096, 4096, None, 132, ())
    try:
        qg.set_m1_tiles({("fp8", 4096, 4096): dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4)})
        tc = qg._cached_config("fp8", 1, 4096, 4096, None, 132, ())
        assert (tc["BLOCK_M"], tc["BLOCK_N"], tc["BLOCK_K"], tc["num_warps"]) == (16, 64, 128, 4)
        assert qg._cached_config("fp8", 1, 2048, 4096, None, 132, ()) == gemv_config("fp8", 1, 2048, 4096)
        assert qg._cached_config("fp8", 4, 4096, 4096, None, 132, ()) == gemv_config("fp8", 4, 4096, 4096)
        assert qg._cached_config("fp8", 1, 4096, 4096, None, 132, (("BLOCK_N", 32),))["BLOCK_N"] == 32  # a sweep wins
        with pytest.raises(GemvError, match="unknown entries"):
            qg.set_m1_tiles({("fp8", 4096, 4096): dict(BLOCK_Q=16)})
        assert qg.M1_TILES  # the refused table changed nothing
    finally:
        qg.set_m1_tiles({})
    assert qg._cached_config("fp8", 1, 4096, 4096, None, 132, ()) == before


def test_bad_inputs_are_named():
    _, buffers = stored("int4", 16, 64)
    with pytest.raises(GemvError, match="group size"):
        check_gemv("int4", torch.randn(1, 64), buffers["weight"], buffers["scale"], buffers["zero"], 48)
    with pytest.raises(GemvError, match="K = 32"):
        check_gemv("int4", torch.randn(1, 32), buffers["weight"], buffers["scale"], buffers["zero"], 32)
    with pytest.raises(GemvError, match="int5"):
        check_gemv("int5", torch.randn(1, 64), buffers["weight"], buffers["scale"], None, None)
    with pytest.raises(GemvError, match="must be torch.int8"):
        check_gemv("int8", torch.randn(1, 64), buffers["weight"], buffers["scale"], None, None)
    _, b8 = stored("int8g", 16, 64)
    with pytest.raises(GemvError, match="int8g needs a group size that divides K = 64 and is a power of two"):
        check_gemv("int8g", torch.randn(1, 64), b8["weight"], b8["scale"], None, 48)
    with pytest.raises(GemvError, match="int8g needs a group size"):
        check_gemv("int8g", torch.randn(1, 64), b8["weight"], b8["scale"], None, None)
    with pytest.raises(GemvError, match=r"int8g scale must be \[N, K/g\] = \[16, 4\].*got \[16, 2\]"):
        check_gemv("int8g", torch.randn(1, 64), b8["weight"], b8["scale"], None, 16)
    with pytest.raises(GemvError, match="int8g weights must be torch.int8"):
        check_gemv("int8g", torch.randn(1, 64), b8["weight"].float(), b8["scale"], None, 32)
    with pytest.raises(ValueError, match=r"need scales \[N, K/g\] = \[16, 4\]"):
        GgufInt8Linear(b8["weight"], b8["scale"], "dequant", group_size=16)


def test_triton_kernel_choice_on_cpu_is_refused_before_work():
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with pytest.raises(QuantError, match="quant_kernel=triton"):
        check_quant("int8", cfg, "cpu", torch.float32, kernel="triton")
    with pytest.raises(QuantError, match="quant_kernel='fast'"):
        check_quant("int8", cfg, "cpu", torch.float32, kernel="fast")
    with pytest.raises(QuantError, match=r"quant_kernel=triton \(target_quant=none: the dense Triton GEMV\)"):
        check_quant("none", cfg, "cpu", torch.bfloat16, kernel="triton")  # the dense GEMV is a GPU kernel too
    check_quant("none", cfg, "cpu", torch.float32, kernel="auto")  # nothing quantized, no kernel asked for


def test_dense_refuses_fp32_and_a_wrong_weight_dtype():
    w = torch.randn(16, 64, dtype=torch.bfloat16)
    with pytest.raises(GemvError, match="bf16 / fp16"):
        check_gemv("dense", torch.randn(1, 64), w.float(), None, None, None)
    with pytest.raises(GemvError, match="dense weights must be torch.float16"):
        check_gemv("dense", torch.randn(1, 64, dtype=torch.float16), w, None, None, None)


def test_dense_model_shares_its_weights_and_computes_the_same_function():
    """quantize_model(model, "none", kernel="triton") swaps in DenseGemvLinear over the *same* Parameters (no second
    copy of the weights) and leaves the original model as it was; off the GEMV path it is F.linear exactly."""
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = LlamaModel(cfg).eval()
    dense = quantize_model(base, "none", kernel="triton")
    assert dense is not base and isinstance(dense.model.layers[1].mlp.down_proj, DenseGemvLinear)
    assert isinstance(base.model.layers[1].mlp.down_proj, nn.Linear)  # the original is untouched
    assert dense.model.layers[1].mlp.down_proj.weight is base.model.layers[1].mlp.down_proj.weight
    assert dense.model.embed_tokens.weight is base.model.embed_tokens.weight
    ids, pos = torch.randint(0, 96, (1, 20)), torch.arange(20)[None]
    with torch.no_grad():  # 20 rows: past GEMV_MAX_ROWS, F.linear on the same weights
        assert torch.equal(dense(ids, pos), base(ids, pos))


# ---- the Triton kernel, under the interpreter ----------------------------------------------------------------------
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CUDA GPU is here: these run the Triton kernel under the interpreter, on a machine without one (on a GPU: "
           "scripts/gpu_gemv.py)")


# The kernel accumulates exact products in fp32, so against the fp32 reference it differs by summation order
# (fp32 inputs) or by the final rounding to the output dtype: half an ulp (2^-12 relative for fp16) on a GPU; the
# interpreter's fp32 -> bf16 cast truncates (1.0078 -> 1.0), so one bf16 ulp (2^-8) here.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
SHAPES = {  # (N, K, int4 group): N not a multiple of any N tile, K of the int8 / fp8 K tiles
    "ragged": (72, 320, 32),
    "square": (128, 512, 64),
    "group128": (40, 1024, 128),
}


@interpreter
@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize("m", [1, 2, 9, 17])  # decode, the verify widths 2..9, two row tiles
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt, dtype", [  # the dense GEMV takes bf16 / fp16 only (test_dense_refuses_fp32)
    (f, d) for f in qg.GEMV_FORMATS for d in (torch.float32, torch.bfloat16, torch.float16)
    if not (f == "dense" and d == torch.float32)], ids=str)
def test_triton_matches_reference(fmt, shape, dtype, m, split, interpreter_bf16_dot):
    n, k, group = SHAPES[shape]
    _, buffers = stored(fmt, n, k, group, dtype=dtype if fmt != "fp8" else torch.float32, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    override = {} if split is None else dict(SPLIT_K=split, BLOCK_K=32)  # BLOCK_K 32: enough tiles to split
    counters = counters_for(n, "cpu")
    got = quant_gemv_triton(x, fmt, **buffers, counters=counters, **override)
    assert got.dtype == dtype and got.shape == (m, n)
    want = x.float() @ dequantize_weight(fmt, **buffers).T
    # one-row int4 in 16-bit x may take packed fp16 words (the rule's HALF2 for K >= 2 N: "ragged"): products rounded
    # to fp16 before the fp32 sums, so an absolute bound relative to the output's size, as on the GPU (gpu_gemv.py)
    half2 = fmt == "int4" and dtype != torch.float32 and m == 1 and split is None
    atol = 2 ** -8 * want.abs().max().item() if half2 else 1e-3
    # int4 above one row takes K tiles of whole groups (INT4_WIDE_ROWS_TILE): each weight rounded once to x's
    # 16-bit dtype before the tensor-core dot, as tinygemm does; the bound of test_int4_wide_rows_match_reference
    if fmt == "int4" and dtype != torch.float32 and m > 1:
        atol = (2 ** -6 if dtype == torch.bfloat16 else 2 ** -8) * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=RTOL[dtype], atol=atol)
    assert not counters.any()  # the last split of each tile reset its counter


@interpreter
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("fmt", ["dense", "fp8", "int8"])
def test_eight_row_tiles(fmt, split, interpreter_bf16_dot):
    """BLOCK_N = 8, the smallest tile a measured tile (M1_TILES, scripts/gpu_gemv.py --parts tune) may take: exact
    against the reference, split or not, on the counters `counters_for` sizes (one per 8 rows)."""
    n, k = 72, 512
    dtype = torch.bfloat16
    _, buffers = stored(fmt, n, k, dtype=dtype if fmt != "fp8" else torch.float32)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    counters = counters_for(n, "cpu")
    assert counters.numel() == n // 8
    got = quant_gemv_triton(x, fmt, **buffers, counters=counters, BLOCK_N=8, BLOCK_K=64, SPLIT_K=split)
    want = x.float() @ dequantize_weight(fmt, **buffers).T
    torch.testing.assert_close(got.float(), want, rtol=RTOL[dtype], atol=1e-3)
    assert not counters.any()


# ---- grouped formats, one row: K tiles of whole groups (the ELEMENTWISE form) -------------------------------------
@interpreter
def test_dense_linear_keeps_verify_widths_on_f_linear(monkeypatch, interpreter_bf16_dot):
    """A dense linear's one-row call takes the GEMV; its 5-row call stays on F.linear (no GEMV launch: the GEMV's
    multi-row forms measured slower than cuBLAS)."""
    torch.manual_seed(0)
    lin = DenseGemvLinear(nn.Linear(64, 40, bias=False).to(torch.bfloat16))
    x = torch.randn(5, 64).to(torch.bfloat16)
    launched = []
    kernel = qg._gemv_kernel
    monkeypatch.setattr(qg, "_gemv_kernel", type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **kw: (
        launched.append(kw["BLOCK_M"]), kernel[grid](*a, **kw))[1]})())
    want = (x.float() @ lin.weight.float().T)
    torch.testing.assert_close(lin(x).float(), want, atol=0.05, rtol=0.02)
    assert launched == []
    torch.testing.assert_close(lin(x[:1]).float(), want[:1], atol=0.05, rtol=0.02)
    assert launched == [1]


def test_grouped_k_tiles_lie_in_one_group_or_hold_whole_groups():
    """BLOCK_K divides g, or (one row) is a multiple of it; anything else, and the forms the kernel lacks (several
    groups a tile without ELEMENTWISE, ELEMENTWISE on tensor-core row tiles), is a GemvError before any launch."""
    for fmt in ("int4", "int8g"):
        assert gemv_config(fmt, 1, 64, 1024, 32, BLOCK_K=128)["BLOCK_K"] == 128  # four groups a tile
        assert gemv_config(fmt, 1, 64, 1024, 32, BLOCK_K=16)["BLOCK_K"] == 16  # half a group
        with pytest.raises(GemvError, match="BLOCK_K=48 must divide the .* group size 32 or, one row at a time"):
            gemv_config(fmt, 1, 64, 1024, 32, BLOCK_K=48)
        with pytest.raises(GemvError, match="BLOCK_K=64 must divide"):  # M > 1 without int4's wide rows:
            gemv_config(fmt, 4, 64, 1024, 32, BLOCK_K=64, int4_rows={})  # tensor-core tiles take one group a tile
        with pytest.raises(GemvError, match="only the ELEMENTWISE form"):
            gemv_config(fmt, 1, 64, 1024, 32, BLOCK_K=64, ELEMENTWISE=False)
        with pytest.raises(GemvError, match="one-row form"):
            gemv_config(fmt, 4, 64, 1024, 32, ELEMENTWISE=True, int4_rows={})
    # int4 with INT4_WIDE_ROWS_TILE (the default): M > 1 tiles of whole groups are its form
    assert gemv_config("int4", 4, 64, 1024, 32, BLOCK_K=64, int4_rows=qg.INT4_WIDE_ROWS_TILE)["BLOCK_K"] == 64
    # the default: the measured rule (_int4_wide_tile): 16 x 1024 fp32 words unsplit while half the SMs get a tile,
    # 32 x 1024 (K >= 4096) or 32 x 512 packed fp16 words with 4 warps from N = 8192, down projections (K >= 2 N)
    # 32 x 512 packed with 4 warps and split; a group that no such tile holds whole, or int4_wide False / {}: one
    # group a tile
    tile = lambda c: (c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_warps"], c.get("HALF2"))  # noqa: E731
    assert tile(gemv_config("int4", 1, 4096, 4096, 128)) == (16, 1024, 1, 8, 0)
    assert tile(gemv_config("int4", 1, 22016, 4096, 128)) == (32, 1024, 1, 4, 1)
    assert tile(gemv_config("int4", 1, 16384, 2048, 128)) == (32, 512, 1, 4, 1)  # 1.45 B's gate / up: K < 4096
    assert tile(gemv_config("int4", 1, 4096, 11008, 128)) == (32, 512, 5, 4, 1)  # split; a partial last K tile
    assert tile(gemv_config("int4", 1, 2048, 8192, 128)) == (32, 512, 8, 4, 1)  # 1.45 B's down projection
    assert tile(gemv_config("int4", 1, 512, 4096, 128)) == (32, 512, 8, 4, 1)  # K >= 2 N: split, a K tile each
    assert tile(gemv_config("int4", 1, 2560, 2048, 128)) == (16, 1024, 1, 8, 0)
    assert gemv_config("int4", 1, 22016, 4096, 128, BLOCK_K=256)["HALF2"] == 0  # a tile of its own: fp32 words
    assert gemv_config("int4", 4, 22016, 4096, 128).get("HALF2") is None  # M > 1: tensor-core tiles
    odd = gemv_config("int4", 1, 4096, 3072, 96)  # 1024 holds no whole number of groups of 96
    assert (odd["BLOCK_N"], odd["BLOCK_K"], odd["num_warps"]) == (64, 96, 4)
    old = gemv_config("int4", 1, 4096, 4096, 128, int4_wide=False)
    assert tile(old) == (64, 128, 8, 4, None) and gemv_config("int4", 1, 4096, 4096, 128, int4_wide={}) == old
    wide = dict(BLOCK_N=32, BLOCK_K=512, num_warps=8, num_stages=3)
    c = gemv_config("int4", 1, 4096, 4096, 128, int4_wide=wide)
    assert {key: c[key] for key in wide} == wide and c["BLOCK_M"] == 1
    assert gemv_config("int4", 4, 4096, 4096, 128, int4_wide=wide, int4_rows={})["BLOCK_K"] == 128  # M > 1 keeps
    assert gemv_config("int4", 4, 4096, 4096, 128, int4_wide=wide)["BLOCK_K"] == 256  # its tiles (INT4_WIDE_ROWS_TILE)
    assert gemv_config("int4", 1, 64, 256, 32, int4_wide=wide)["BLOCK_K"] == 256  # no K tile past K
    qg.set_m1_tiles({("int4", 4096, 4096): dict(BLOCK_N=16, BLOCK_K=1024, ELEMENTWISE=True, CVT_BITS=True)})
    try:  # a tune's int4 winners load as measured tiles (scripts/gpu_quant.py --m1-tiles)
        c = qg._cached_config("int4", 1, 4096, 4096, 128, 132, ())
        assert (c["BLOCK_N"], c["BLOCK_K"], c["CVT_BITS"]) == (16, 1024, True)
    finally:
        qg.set_m1_tiles({})


GROUP_TILE_SHAPES = {  # (N, K, g): K / g groups, a partial last K tile for 4 groups a tile (and 2 at K = 352)
    "k320": (72, 320, 32),
    "k352": (40, 352, 32),
}


@interpreter
@pytest.mark.parametrize("cvt_bits", [None, True, False])
@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize("groups_per_tile", [2, 4])
@pytest.mark.parametrize("shape", GROUP_TILE_SHAPES)
@pytest.mark.parametrize("fmt", ["int4", "int8g"])
def test_k_tiles_of_whole_groups_match_reference(fmt, shape, groups_per_tile, split, cvt_bits):
    """One row, BLOCK_K = 2 or 4 groups (the last tile partial where K is not a multiple of it), split or not, each
    weight widened by cvt or by integer ops: the reference within the group-tiled form's tolerance."""
    n, k, group = GROUP_TILE_SHAPES[shape]
    dtype = torch.bfloat16
    _, buffers = stored(fmt, n, k, group, dtype=dtype, seed=groups_per_tile)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    over = dict(BLOCK_N=16, BLOCK_K=groups_per_tile * group, **({} if split is None else dict(SPLIT_K=split)),
                **({} if cvt_bits is None else dict(CVT_BITS=cvt_bits)))
    counters = counters_for(n, "cpu")
    got = quant_gemv_triton(x, fmt, **buffers, counters=counters, **over)
    want = x.float() @ dequantize_weight(fmt, **buffers).T
    torch.testing.assert_close(got.float(), want, rtol=RTOL[dtype], atol=1e-3)
    assert not counters.any()


@interpreter
@pytest.mark.parametrize("block_k", [16, 32, 128])
def test_elementwise_form_also_reads_tiles_inside_one_group(block_k):
    """ELEMENTWISE=True with BLOCK_K <= g (half a group, one group) and > g: the same function (fp32, tight)."""
    _, buffers = stored("int4", 40, 256, 32, seed=1)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2))
    got = quant_gemv_triton(x, "int4", **buffers, BLOCK_K=block_k, ELEMENTWISE=True, SPLIT_K=2)
    torch.testing.assert_close(got, quant_gemv_reference(x, "int4", **buffers), rtol=1e-5, atol=1e-4)


@interpreter
@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("fusion", ["glu+residual", "norm", "norm+residual"])
@pytest.mark.parametrize("fmt", ["int4", "int8g"])
def test_k_tiles_of_whole_groups_keep_the_fusions(fmt, fusion, split, interpreter_bf16_dot):
    """SwiGLU / RMSNorm prologues and the residual epilogue around a K tile of four groups (K = 320: the last tile
    half full), split or not: the fused reference within the fusion tests' tolerance."""
    n, k, group = GROUP_TILE_SHAPES["k320"]
    dtype = torch.bfloat16
    _, buffers = stored(fmt, n, k, group, dtype=dtype, seed=4)
    g = torch.Generator().manual_seed(17)
    glu, norm = "glu" in fusion, "norm" in fusion
    x = torch.randn(1, 2 * k if glu else k, generator=g).to(dtype) * (4 if norm else 1)
    fused = dict(glu=glu, residual=torch.randn(1, n, generator=g).to(dtype) if "residual" in fusion else None,
                 norm_weight=(torch.rand(k, generator=g) + 0.5).to(dtype) if norm else None)
    over = dict(BLOCK_N=16, BLOCK_K=4 * group, **({} if split is None else dict(SPLIT_K=split)))
    counters = counters_for(n, "cpu")
    got = quant_gemv_triton(x, fmt, **buffers, counters=counters, **fused, **over).float()
    want = quant_gemv_reference(x, fmt, **buffers, **fused).float()
    assert (got - want).abs().max() <= 2 ** -6 * want.abs().max()  # as test_triton_norm_prologue_matches_reference
    assert not counters.any()


@interpreter
def test_k_tiles_of_whole_groups_use_each_groups_own_scale_and_zero():
    """The tolerance above would catch a tile that took a neighbouring group's scale or zero (or the tile's first
    group's for all): scales 1, 2, 4, ... and zeros that differ per group, and the kernel is exact on small integers."""
    n, k, group = 24, 320, 32
    _, buffers = stored("int4", n, k, group, seed=3)
    gs = k // group
    scale = (2.0 ** (torch.arange(gs) % 5)).expand(n, gs).contiguous()  # [N, K/g]
    zero = (torch.arange(gs, dtype=torch.float32) - 3).expand(n, gs).contiguous()
    buffers.update(scale=scale, zero=zero)
    x = torch.randint(-3, 4, (1, k), generator=torch.Generator().manual_seed(1)).float()
    want = quant_gemv_reference(x, "int4", **buffers)
    for cvt_bits in (True, False):
        got = quant_gemv_triton(x, "int4", **buffers, BLOCK_N=16, BLOCK_K=4 * group, CVT_BITS=cvt_bits)
        assert torch.equal(got, want)  # integers below 2^24 throughout: no rounding anywhere
    for wrong in (dict(scale=scale.roll(1, 1), zero=zero), dict(scale=scale, zero=zero.roll(1, 1)),
                  dict(scale=scale[:, ::4].repeat_interleave(4, 1)[:, :gs], zero=zero)):  # the tile's first group
        mutated = quant_gemv_reference(x, "int4", buffers["weight"], group_size=group, **wrong)
        assert not torch.allclose(mutated, want, rtol=RTOL[torch.bfloat16], atol=1e-3)


@interpreter
def test_int4_integer_op_widening_is_exact_for_every_nibble():
    """CVT_BITS in the ELEMENTWISE form reads 32-bit words: every value 0..15 at each of a word's 8 nibble positions
    (the top three taken from the word shifted by 12) comes out as q - 8 exactly, as through cvt."""
    n, k = 16, 32
    q = torch.arange(16, dtype=torch.uint8)
    weight = torch.zeros(n, k // 2, dtype=torch.uint8)
    weight[:, :4] = ((q << 4) | (15 - q))[:, None]  # row n, bytes 0..3: k = 2j holds n, 2j + 1: 15 - n
    buffers = dict(scale=torch.ones(n, 1), zero=torch.zeros(n, 1), group_size=k)
    for col in range(8):
        x = torch.zeros(1, k)
        x[0, col] = 1.0
        want = q.float() - 8 if col % 2 == 0 else 7 - q.float()
        for cvt_bits in (True, False):
            got = quant_gemv_triton(x, "int4", weight, **buffers, BLOCK_K=32, ELEMENTWISE=True, CVT_BITS=cvt_bits)
            assert torch.equal(got[0], want), (col, cvt_bits)


@interpreter
@pytest.mark.parametrize("half2", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("fusion", ["none", "glu+residual", "norm"])
@pytest.mark.parametrize("shape", ["k320", "k352", "k1024"])
def test_int4_half2_words_match_the_reference(shape, fusion, split, dtype, half2):
    """HALF2 (a word's 8 products in packed fp16, x scaled per K tile into fp16's range; here its emulation in
    Triton ops, the PTX itself runs on a GPU only: scripts/gpu_gemv.py --int4-half2): the reference within the
    fusion tests' tolerance, partial last tiles, split or not, each fusion."""
    n, k, group = dict(GROUP_TILE_SHAPES, k1024=(24, 1024, 128))[shape]
    _, buffers = stored("int4", n, k, group, dtype=dtype, seed=5)
    g = torch.Generator().manual_seed(23)
    glu, norm = "glu" in fusion, "norm" in fusion
    x = torch.randn(1, 2 * k if glu else k, generator=g).to(dtype) * (4 if norm else 1)
    fused = dict(glu=glu, residual=torch.randn(1, n, generator=g).to(dtype) if "residual" in fusion else None,
                 norm_weight=(torch.rand(k, generator=g) + 0.5).to(dtype) if norm else None)
    over = dict(BLOCK_N=16, BLOCK_K=4 * group, CVT_BITS=True, HALF2=half2,
                **({} if split is None else dict(SPLIT_K=split)))
    counters = counters_for(n, "cpu")
    got = quant_gemv_triton(x, "int4", **buffers, counters=counters, **fused, **over).float()
    want = quant_gemv_reference(x, "int4", **buffers, **fused).float()
    assert (got - want).abs().max() <= 2 ** -6 * want.abs().max()
    assert not counters.any()


@interpreter
@pytest.mark.parametrize("half2", [1, 2])
@pytest.mark.parametrize("magnitude", [2.0 ** -20, 1.0, 2.0 ** 14])
def test_int4_half2_scales_activations_into_fp16s_range(magnitude, half2):
    """x far below and far above fp16's range (bf16 holds both): the per-tile power-of-two scale keeps the packed
    fp16 products finite and precise; without it 2^14 x 8 overflows fp16 (65504) and 2^-20 is below its smallest
    normal. Error against the reference relative to its own size, as at magnitude 1."""
    n, k, group = 24, 1024, 128
    _, buffers = stored("int4", n, k, group, dtype=torch.bfloat16, seed=8)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(2)) * magnitude).to(torch.bfloat16)
    want = quant_gemv_reference(x, "int4", **buffers).float()
    got = quant_gemv_triton(x, "int4", **buffers, BLOCK_N=16, BLOCK_K=512, HALF2=half2).float()
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 2 ** -7 * want.abs().max()


@interpreter
@pytest.mark.parametrize("half2", [1, 2])
def test_int4_half2_is_exact_for_every_nibble_and_group(half2):
    """Small integers stay exact through the packed fp16 path: every value 0..15 at each of a word's 8 nibble
    positions comes out as q - 8 (a wrong lane pairing or nibble order would put another weight there), and per-group
    scales and zeros that differ per group give the exact integer sums the fp32 words give (bf16 activations; the
    outputs then rounded to bf16 alike)."""
    n, k = 16, 32
    q = torch.arange(16, dtype=torch.uint8)
    weight = torch.zeros(n, k // 2, dtype=torch.uint8)
    weight[:, :4] = ((q << 4) | (15 - q))[:, None]
    ones = dict(scale=torch.ones(n, 1, dtype=torch.bfloat16), zero=torch.zeros(n, 1, dtype=torch.bfloat16),
                group_size=k)
    for col in range(8):
        x = torch.zeros(1, k, dtype=torch.bfloat16)
        x[0, col] = 1.0
        want = q.float() - 8 if col % 2 == 0 else 7 - q.float()
        got = quant_gemv_triton(x, "int4", weight, **ones, BLOCK_K=32, ELEMENTWISE=True, HALF2=half2)
        assert torch.equal(got[0].float(), want), col
    n, k, group = 24, 320, 32
    _, buffers = stored("int4", n, k, group, dtype=torch.bfloat16, seed=3)
    gs = k // group
    buffers.update(scale=(2.0 ** (torch.arange(gs) % 3)).expand(n, gs).to(torch.bfloat16).contiguous(),
                   zero=(torch.arange(gs) - 3.0).expand(n, gs).to(torch.bfloat16).contiguous())
    x = torch.randint(-3, 4, (1, k), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    exact = x.double() @ dequantize_weight("int4", **buffers).double().T  # integers: what the fp32 sums hold
    got = quant_gemv_triton(x, "int4", **buffers, BLOCK_N=16, BLOCK_K=4 * group, HALF2=half2)
    fp32_words = quant_gemv_triton(x, "int4", **buffers, BLOCK_N=16, BLOCK_K=4 * group, HALF2=False)
    assert torch.equal(got, fp32_words)  # the same exact sum, the same rounding to bf16 (the interpreter's)
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8).all()  # within the rounding to bf16


@interpreter
def test_int4_half2_tuning_reaches_bf16_launches_only(monkeypatch):
    """KernelTuning.int4_half2 turns the packed fp16 words on for one-row bf16 / fp16 int4 calls in K tiles of whole
    groups through the custom op; fp32 activations and the group-tiled form keep the fp32 words."""
    _, buffers = stored("int4", 40, 320, 32, seed=6)
    launched = []
    kernel = qg._gemv_kernel
    monkeypatch.setattr(qg, "_gemv_kernel", type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **kw: (
        launched.append((kw["TILE_GROUPS"], kw["HALF2"])), kernel[grid](*a, **kw))[1]})())
    forced = KernelTuning(int4_half2=2)
    x = torch.randn(1, 320, generator=torch.Generator().manual_seed(6))
    bf16 = {key: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
            for key, v in buffers.items()}
    quant_gemv_triton(x.to(torch.bfloat16), "int4", **bf16, tuning=forced)
    quant_gemv_triton(x, "int4", **buffers, tuning=forced)
    quant_gemv_triton(x.to(torch.bfloat16), "int4", **bf16, tuning=forced, int4_wide=False)
    quant_gemv_triton(x.to(torch.bfloat16), "int4", **bf16, tuning="int4_half2=0")
    assert launched == [(16, 2), (16, 0), (0, 0), (16, 0)]


@interpreter
def test_int4_wide_tiles_reach_the_launch(monkeypatch):
    """The measured rule gives one-row int4 calls K tiles of whole groups through the custom op; a sweep's int4_wide
    (False: one group a tile; a dict: that tile) reaches the launch, and the launch cache keys on it."""
    _, buffers = stored("int4", 40, 320, 32, seed=6)
    x = torch.randn(1, 320, generator=torch.Generator().manual_seed(6))
    want = quant_gemv_reference(x, "int4", **buffers)
    launched = []
    kernel = qg._gemv_kernel
    monkeypatch.setattr(qg, "_gemv_kernel", type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **kw: (
        launched.append((kw["BLOCK_K"], kw["TILE_GROUPS"])), kernel[grid](*a, **kw))[1]})())
    torch.testing.assert_close(quant_gemv_triton(x, "int4", **buffers), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(quant_gemv_triton(x, "int4", **buffers, int4_wide=False), want, rtol=1e-5, atol=1e-4)
    wide = dict(BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=2)
    torch.testing.assert_close(quant_gemv_triton(x, "int4", **buffers, int4_wide=wide), want, rtol=1e-5, atol=1e-4)
    assert launched == [(512, 16), (32, 0), (128, 4)]  # the rule's 1024 capped at K's next power of two


def test_int4_wide_rows_config_is_on_by_default_and_takes_whole_groups():
    """M > 1 int4 in K tiles of whole groups on the tensor cores is the default, with the fastest measured tile
    (32 x 256, 4 warps): M > 1 calls take its tile where the K tile holds whole groups, else keep one group a tile; a
    sweep's int4_rows {} (or False) gives one group a K tile; one-row calls are untouched."""
    assert qg.INT4_WIDE_ROWS_TILE == dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)
    default = gemv_config("int4", 5, 4096, 4096, 128)
    assert (default["BLOCK_N"], default["BLOCK_K"], default["num_warps"], default.get("WIDE_ROWS")) == (
        32, 256, 4, True)
    tile = dict(BLOCK_N=64, BLOCK_K=256, num_warps=8, num_stages=3)
    off = gemv_config("int4", 5, 4096, 4096, 128, int4_rows={})
    assert (off["BLOCK_M"], off["BLOCK_N"], off["BLOCK_K"], off.get("ELEMENTWISE")) == (16, 64, 128, None)
    on = gemv_config("int4", 5, 4096, 4096, 128, int4_rows=tile)
    assert (on["BLOCK_M"], on["BLOCK_N"], on["BLOCK_K"], on["num_warps"], on["ELEMENTWISE"], on["WIDE_ROWS"]) == (
        16, 64, 256, 8, True, True)
    assert gemv_config("int4", 64, 4096, 4096, 128, int4_rows=tile)["BLOCK_K"] == 256  # prefill widths too
    odd = gemv_config("int4", 5, 4096, 3072, 96, int4_rows=tile)  # 256 holds no whole number of groups of 96
    assert (odd["BLOCK_K"], odd.get("ELEMENTWISE")) == (96, None)
    assert gemv_config("int4", 1, 4096, 4096, 128, int4_rows=tile) == gemv_config("int4", 1, 4096, 4096, 128)
    assert gemv_config("int8g", 5, 4096, 4096, 32, int4_rows=tile).get("ELEMENTWISE") is None  # int4 only
    with pytest.raises(GemvError, match="one-row form"):  # the multi-row ELEMENTWISE form is int4's switch only
        gemv_config("int4", 5, 4096, 4096, 128, int4_rows={}, ELEMENTWISE=True)


@interpreter
@pytest.mark.parametrize("fusion", ["none", "glu+residual", "norm"])
@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("m", [2, 5, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", GROUP_TILE_SHAPES)
def test_int4_wide_rows_match_reference(shape, dtype, m, split, fusion, monkeypatch, interpreter_bf16_dot):
    """Multi-row int4 tiles of whole groups (a sweep's int4_rows tile): verify widths (2, 5) and two row tiles (17), K
    tiles of 4 groups (the last one partial at K = 320 and 352), split or not, with the fusions: the reference within
    the multi-row tolerance; the launch takes the tensor-core tile of whole groups, never the one-row words."""
    n, k, group = GROUP_TILE_SHAPES[shape]
    _, buffers = stored("int4", n, k, group, dtype=dtype, seed=m)
    g = torch.Generator().manual_seed(11)
    glu, norm = "glu" in fusion, "norm" in fusion
    x = torch.randn(m, 2 * k if glu else k, generator=g).to(dtype) * (4 if norm else 1)
    fused = dict(glu=glu, residual=torch.randn(m, n, generator=g).to(dtype) if "residual" in fusion else None,
                 norm_weight=(torch.rand(k, generator=g) + 0.5).to(dtype) if norm else None)
    rows = dict(BLOCK_N=16, BLOCK_K=4 * group, num_warps=4, num_stages=2)  # (an override: never kernels/int4_mma.py)
    launched = []
    kernel = qg._gemv_kernel
    monkeypatch.setattr(qg, "_gemv_kernel", type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **kw: (
        launched.append((kw["BLOCK_M"], kw["BLOCK_K"], kw["TILE_GROUPS"], kw["CVT_BITS"], kw["HALF2"])),
        kernel[grid](*a, **kw))[1]})())
    counters = counters_for(n, "cpu")
    got = quant_gemv_triton(x, "int4", **buffers, counters=counters, **fused, int4_rows=rows,
                            **({} if split is None else dict(SPLIT_K=split))).float()
    want = quant_gemv_reference(x, "int4", **buffers, **fused).float()
    assert launched == [(16, 4 * group, 4, False, 0)]
    # the dequantized weights are rounded to x's dtype before the dot (as tinygemm's are): in bf16 a relative error
    # of about 2^-8 per weight, so a bound relative to the output's size, as the fusion tests use
    tol = 1e-4 if dtype == torch.float32 else 2 ** -6
    assert (got - want).abs().max() <= tol * want.abs().max()
    assert not counters.any()


@interpreter
def test_gpu_gemv_rows_part_times_wide_row_tiles_against_tinygemm(tmp_path, monkeypatch):
    """scripts/gpu_gemv.py --parts rows on the mini config (interpreter): per linear and M, tinygemm, the one-group
    tiles and each multi-row tile of the grid, each parity-checked (every tile passed per call); one best Triton tile
    each."""
    import json
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_gemv

    monkeypatch.setattr(sys, "argv", ["gpu_gemv.py", "--device", "cpu", "--out", str(tmp_path), "--parts", "rows",
                                      "--sweep-configs", "mini", "--rows-ms", "3,5", "--rows-block-n", "32",
                                      "--rows-block-k", "64,128", "--rows-warps", "4", "--replays", "1",
                                      "--int4-group-size", "32"])
    gpu_gemv.main()
    rows = json.loads((tmp_path / "gemv_rows.json").read_text())["rows"]
    assert all("error" not in r for r in rows)
    groups = {(r["linear"], r["M"]) for r in rows}
    assert len(groups) == 4 * 2
    for key in groups:
        at = [r for r in rows if (r["linear"], r["M"]) == key]
        assert [r["tile"] for r in at] == ["-", "one group", "32x64 w4", "32x128 w4"]
        assert all(r["rel_err"] <= 2 ** -7 for r in at) and sum(bool(r.get("best")) for r in at) == 1


@interpreter
def test_split_k_reuses_its_counters_across_calls(interpreter_bf16_dot):
    _, buffers = stored("int8", 72, 512)
    counters = counters_for(72, "cpu")
    x = torch.randn(2, 512)
    first = quant_gemv_triton(x, "int8", **buffers, counters=counters, SPLIT_K=4, BLOCK_K=32)
    second = quant_gemv_triton(x, "int8", **buffers, counters=counters, SPLIT_K=4, BLOCK_K=32)
    assert torch.equal(first, second) and not counters.any()


@interpreter
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_modules_with_the_triton_kernel_match_dequant(fmt, interpreter_bf16_dot):
    """Kernel "triton" computes the "dequant" form's function from the same buffers: decode-sized calls through the
    kernel, larger ones (prefill) through dequantize + matmul."""
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = LlamaModel(cfg).eval()
    ref = quantize_model(base, fmt, group_size=32, kernel="dequant")
    tri = quantize_model(base, fmt, group_size=32, kernel="triton")
    assert tri.model.layers[0].mlp.down_proj.kernel == "triton"
    for t in (1, 5, 20):  # 20 rows: past GEMV_MAX_ROWS, the dequant path
        ids = torch.randint(0, 96, (1, t), generator=torch.Generator().manual_seed(t))
        pos = torch.arange(t)[None]
        with torch.no_grad():
            want, got = ref(ids, pos), tri(ids, pos)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@interpreter
def test_dense_gemv_model_matches_the_unquantized_model(interpreter_bf16_dot):
    """A bf16 model with the dense GEMV computes what F.linear does, up to summation order and the final rounding."""
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    base = LlamaModel(cfg).eval().to(torch.bfloat16)
    dense = quantize_model(base, "none", kernel="triton")
    assert dense.model.layers[0].self_attn.qkv_proj.kernel == "triton"
    for t in (1, 5):
        ids = torch.randint(0, 96, (1, t), generator=torch.Generator().manual_seed(t))
        pos = torch.arange(t)[None]
        with torch.no_grad():
            want, got = base(ids, pos).float(), dense(ids, pos).float()
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


@interpreter
def test_engine_decodes_the_same_tokens_with_the_triton_kernel(interpreter_bf16_dot):
    """AR decode through the engine (paged cache, fixed-shape steps) with kernel "triton" emits the tokens of the
    "dequant" kernel: same function, fp32 model (no near-ties at this size)."""
    from workbench.engine import EngineConfig, SpecEngine

    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    base = LlamaModel(cfg).eval()

    outputs = {}
    for kernel in ("dequant", "triton", "triton+all"):
        model = quantize_model(base, "int4", group_size=32, kernel=kernel.split("+")[0])
        if kernel.endswith("+all"):  # every fusion: norms in the prologues, residuals in the epilogues, SwiGLU
            set_fusion(model, "norm+glu+residual")
        engine = SpecEngine(model, None, EngineConfig(max_new_tokens=6), torch.device("cpu"))
        outputs[kernel] = engine.generate([[5, 9, 11, 2], [7, 3]]).outputs
    assert outputs["triton"] == outputs["dequant"] == outputs["triton+all"]


def test_the_custom_op_has_a_fake_that_gives_the_output_shape():
    """torch.compile sees `workbench::quant_gemv` as one opaque call: its fake implementation must give [M, N] in
    x's dtype without running anything (no triton needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, buffers = stored("int4", 40, 128, 32)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, 128, dtype=torch.bfloat16)
        out = torch.ops.workbench.quant_gemv(x, "int4", buffers["weight"], buffers["scale"].bfloat16(),
                                             buffers["zero"].bfloat16(), 32, counters_for(40, "cpu"))
    assert out.shape == (3, 40) and out.dtype == torch.bfloat16


@interpreter
@pytest.mark.parametrize("fmt", qg.GEMV_FORMATS)
def test_a_compiled_caller_traces_through_the_op_without_a_graph_break(fmt, interpreter_bf16_dot):
    """fullgraph=True fails on any graph break: the Triton launch must sit behind the custom op (the KernelTuning
    record passed as the linears pass theirs), and the compiled function must compute what the eager one does (norm +
    linear + residual around the op, as in a decoder layer)."""
    import torch._dynamo

    dtype = torch.bfloat16 if fmt == "dense" else torch.float32  # dense takes bf16 / fp16 only
    mod, buffers = stored(fmt, 72, 320, 32, dtype=dtype, seed=3)
    counters = counters_for(72, "cpu")
    proj = torch.randn(72, 320, generator=torch.Generator().manual_seed(5)).to(dtype)

    def layer(x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return quant_gemv_triton(h, fmt, **buffers, counters=counters, tuning=tuning) @ proj + x

    tuning = KernelTuning(int4_half2=0)
    x = torch.randn(2, 320, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch._dynamo.reset()
    with torch.no_grad():  # inference, as the engine runs it
        want = layer(x)
        got = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not counters.any()


def test_reference_glu_and_residual_are_the_unfused_ops():
    """The fused reference is silu(gate) * up (rounded to x's dtype), the product, then + residual."""
    _, buffers = stored("int8", 24, 64)
    h = torch.randn(3, 128)
    r = torch.randn(3, 24)
    gate, up = h.chunk(2, dim=-1)
    want = quant_gemv_reference(torch.nn.functional.silu(gate) * up, "int8", **buffers) + r
    torch.testing.assert_close(quant_gemv_reference(h, "int8", **buffers, glu=True, residual=r), want)
    with pytest.raises(GemvError, match=r"glu takes x = \[gate \| up\]"):
        check_gemv("int8", torch.randn(1, 63), buffers["weight"], buffers["scale"], None, None, glu=True)
    with pytest.raises(GemvError, match="residual must be"):
        check_gemv("int8", torch.randn(2, 64), buffers["weight"], buffers["scale"], None, None,
                   residual=torch.randn(2, 23))


@interpreter
@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("fmt", qg.GEMV_FORMATS)
def test_triton_glu_prologue_and_residual_epilogue_match_reference(fmt, m, split, interpreter_bf16_dot):
    n, k, group = SHAPES["ragged"]
    dtype = torch.bfloat16
    _, buffers = stored(fmt, n, k, group, dtype=dtype if fmt != "fp8" else torch.float32, seed=m)
    g = torch.Generator().manual_seed(11)
    h = torch.randn(m, 2 * k, generator=g).to(dtype)
    r = torch.randn(m, n, generator=g).to(dtype)
    override = {} if split is None else dict(SPLIT_K=split, BLOCK_K=32)
    counters = counters_for(n, "cpu")
    got = quant_gemv_triton(h, fmt, **buffers, counters=counters, glu=True, residual=r, **override)
    want = quant_gemv_reference(h, fmt, **buffers, glu=True, residual=r).float()
    # both rounded to bf16 once (outputs ~30: an ulp is 0.125-0.25), summed in another order: within 2^-7 of the max
    assert (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max()
    assert not counters.any()


@interpreter
@pytest.mark.parametrize("fusion", ["residual", "glu+residual"])
@pytest.mark.parametrize("fmt", ["dense", "int8", "int4", "fp8", "int8g"])
def test_fused_mlp_down_projection_matches_the_unfused_layer(fmt, fusion, interpreter_bf16_dot):
    """A decoder layer whose down projection takes the kernel runs SwiGLU + down + residual as one launch
    (`glu_residual`); its output is the unfused layer's (same module, kernel "dequant" for the reference)."""
    from workbench.models.llama import MLP

    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(1)
    dtype = torch.bfloat16
    mlp = MLP(cfg)
    with torch.no_grad():
        for p in mlp.parameters():  # the model initializes its linears; a lone MLP's are empty
            p.normal_(0, 0.1)
    mlp = mlp.to(dtype)
    make = {"dense": DenseGemvLinear, "int8": Int8Linear, "fp8": Fp8Linear,
            "int4": lambda lin, kern: Int4Linear(lin, 32, kern),
            "int8g": lambda lin, kern: int8g_linear(lin, 32, kern)}[fmt]
    ref_down, tri_down = make(mlp.down_proj, "dequant"), make(mlp.down_proj, "triton")
    x, res = torch.randn(1, 1, 64).to(dtype), torch.randn(1, 1, 64).to(dtype)
    assert tri_down.fusion == "residual"  # the default (measured; linears.QuantLinear.fusion)
    tri_down.fusion = "off"
    assert tri_down.glu_residual(torch.randn(1, 1, 256).to(dtype), res) is None  # off: the caller runs the ops
    tri_down.fusion = fusion
    calls = []
    orig = tri_down.glu_residual
    tri_down.glu_residual = lambda h, r: calls.append(h.shape) or orig(h, r)
    with torch.no_grad():
        mlp.down_proj = ref_down
        want = mlp(x, residual=res).float()
        mlp.down_proj = tri_down
        got = mlp(x, residual=res).float()
    assert calls == [(1, 1, 256)]  # the fused launch ran (h = [gate | up])
    torch.testing.assert_close(got, want, rtol=2 ** -6, atol=0.03)


def test_reference_norm_prologue_is_the_rmsnorm_then_the_product():
    """The RMSNorm reference is the model's RMSNorm up to where it rounds: x * w rounded to x's dtype, the product,
    then 1 / rms(x) in fp32 (the model's RMSNorm rounds rms_norm(x) before multiplying by w)."""
    from workbench.models.llama import RMSNorm

    _, buffers = stored("int8", 24, 64)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(3, 64) * 3
    want = quant_gemv_reference(norm(x), "int8", **buffers)
    got = quant_gemv_reference(x, "int8", **buffers, norm_weight=norm.weight, eps=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32: the two orders agree
    with pytest.raises(GemvError, match="do not combine"):
        check_gemv("int8", torch.randn(1, 128), buffers["weight"], buffers["scale"], None, None, glu=True,
                   norm_weight=torch.ones(64))
    with pytest.raises(GemvError, match=r"norm_weight must be \[K\] = \[64\]"):
        check_gemv("int8", torch.randn(1, 64), buffers["weight"], buffers["scale"], None, None,
                   norm_weight=torch.ones(32))


@interpreter
@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("fmt", qg.GEMV_FORMATS)
def test_triton_norm_prologue_matches_reference(fmt, m, split, interpreter_bf16_dot):
    """RMSNorm in the prologue, alone and with the residual epilogue, split (the sums of squares of every split
    reach the program that finishes the tile) and unsplit; rows of very different scale (1 / rms differs per row)."""
    n, k, group = SHAPES["ragged"]
    dtype = torch.bfloat16
    _, buffers = stored(fmt, n, k, group, dtype=dtype if fmt != "fp8" else torch.float32, seed=m)
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 2, m)[:, None]).to(dtype)
    nw = (torch.rand(k, generator=g) + 0.5).to(dtype)
    r = torch.randn(m, n, generator=g).to(dtype)
    override = {} if split is None else dict(SPLIT_K=split, BLOCK_K=32)
    counters = counters_for(n, "cpu")
    for residual in (None, r):
        got = quant_gemv_triton(x, fmt, **buffers, counters=counters, norm_weight=nw, eps=1e-5, residual=residual,
                                **override)
        want = quant_gemv_reference(x, fmt, **buffers, norm_weight=nw, eps=1e-5, residual=residual).float()
        # 2^-6, not 2^-7 as above: the interpreter casts fp32 -> bf16 by truncation (torch and the GPU round to
        # nearest), so its rounded x * w is up to an ulp off the reference's in every element (outputs ~50: ulp 0.25)
        assert (got.float() - want).abs().max() <= 2 ** -6 * want.abs().max()
        if residual is None:  # and it is not the un-normalized product (which is up to 100x larger here)
            plain = quant_gemv_reference(x, fmt, **buffers).float()
            assert (got.float() - plain).abs().max() > 0.5 * plain.abs().max()
    assert not counters.any()


@interpreter
@pytest.mark.parametrize("fmt", ["dense", "int8", "int4", "fp8", "int8g"])
def test_norm_fusion_decoder_layer_matches_the_unfused_layer(fmt, interpreter_bf16_dot):
    """fusion "norm+glu+residual": a decoder layer's four linears take the kernel with the two RMSNorms in the q/k/v
    and gate/up prologues and both residual adds in the epilogues (four launches, no norm or add ops); its output is
    the unfused layer's (the same modules with fusion "off")."""
    from workbench.models.attention import CausalAttention
    from workbench.models.llama import DecoderLayer

    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(2)
    dtype = torch.bfloat16
    layer = DecoderLayer(cfg, 0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5) if "layernorm" in name else p.normal_(0, 0.1)
    layer = layer.to(dtype)
    make = {"dense": DenseGemvLinear, "int8": Int8Linear, "fp8": Fp8Linear,
            "int4": lambda lin, kern: Int4Linear(lin, 32, kern),
            "int8g": lambda lin, kern: int8g_linear(lin, 32, kern)}[fmt]
    mods = [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj")]
    calls = []
    for owner, name in mods:
        lin = make(getattr(owner, name), "triton")
        for method in ("norm_linear", "residual_linear", "glu_residual"):
            orig = getattr(lin, method)
            setattr(lin, method, lambda *a, _o=orig, _n=f"{name}.{method}": (calls.append(_n), _o(*a))[1])
        setattr(owner, name, lin)
    cos, sin = torch.ones(1, 1, 1, 16, dtype=dtype), torch.zeros(1, 1, 1, 16, dtype=dtype)
    x = torch.randn(1, 1, 64).to(dtype) * 4
    with torch.no_grad():
        for _, name in mods:
            getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name).fusion = "off"
        want = layer(x, cos, sin, CausalAttention()).float()
        for _, name in mods:
            getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name).fusion = \
                "norm+glu+residual"
        calls.clear()
        got = layer(x, cos, sin, CausalAttention()).float()
    assert {"qkv_proj.norm_linear", "o_proj.residual_linear", "gate_up_proj.norm_linear",
            "down_proj.glu_residual"} <= set(calls)
    torch.testing.assert_close(got, want, rtol=2 ** -6, atol=0.05)


@interpreter
@pytest.mark.parametrize("cvt_bits", [True, False])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int8g"])
def test_one_row_widening_is_exact_for_every_byte_value(fmt, cvt_bits):
    """The integer-op widening (CVT_BITS: int8 through 2^23 + 128 + q, fp8 e4m3 bits moved into an fp32 times 2^-120)
    and the conversion instructions give every stored value exactly: all 256 bytes, signs, zeros, fp8 subnormals."""
    w, want = qg.all_byte_values("int8" if fmt == "int8g" else fmt)
    x = torch.zeros(1, 16)
    x[0, 0] = 1.0
    if fmt == "int8g":
        buffers = dict(scale=torch.ones(256, 1), group_size=16)
    else:
        buffers = dict(scale=torch.ones(256) if fmt == "int8" else torch.ones(1, 256))
    got = quant_gemv_triton(x, fmt, w, **buffers, CVT_BITS=cvt_bits)[0]
    assert torch.equal(got, want)


@interpreter
def test_gpu_gemv_speed_part_compares_int4_rows_with_the_other_form(tmp_path, monkeypatch):
    """scripts/gpu_gemv.py --parts speed --int4-wide-rows-compare (interpreter, mini config): each int4 Triton call of
    M > 1 is timed in the default form (whole groups per K tile, suffix "+i4r") and once more in the other (one group
    per K tile, passed per call); one-row calls once."""
    import json
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_gemv

    monkeypatch.setattr(sys, "argv", ["gpu_gemv.py", "--device", "cpu", "--out", str(tmp_path), "--parts", "speed",
                                      "--configs", "mini", "--formats", "int4", "--ms", "1,2",
                                      "--int4-wide-rows-compare", "--replays", "1", "--int4-group-size", "32"])
    gpu_gemv.main()
    rows = [r for r in json.loads((tmp_path / "gemv_speed.json").read_text())["rows"]
            if r["format"] == "int4" and r["kernel"].startswith("triton")]
    assert rows and all("error" not in r for r in rows)
    for name in {r["linear"] for r in rows}:
        kinds = {(r["M"], r["kernel"]): r["config_used"] for r in rows if r["linear"] == name}
        assert set(kinds) == {(1, "triton"), (2, "triton+i4r"), (2, "triton")}
        assert kinds[(2, "triton+i4r")] != kinds[(2, "triton")]  # two forms, two tiles


# ---- int4 prefill dequantization in one kernel (kernels/int4_dequant.py) ------------------------------------------
def test_int4_dequant_reference_is_the_stored_weights_function():
    """The PyTorch ops the prefill path runs give dequantize_weight's weight (the GEMV's reference) in fp32."""
    from kernels.int4_dequant import int4_dequant_reference

    _, buffers = stored("int4", 40, 256, group_size=64)
    got = int4_dequant_reference(buffers["weight"], buffers["scale"], buffers["zero"], 64)
    torch.testing.assert_close(got, dequantize_weight("int4", **buffers), atol=0, rtol=0)


def test_int4_dequant_rejects_a_group_that_does_not_fit_before_any_work():
    from kernels.int4_dequant import int4_dequant_triton

    _, buffers = stored("int4", 8, 128, group_size=32)
    with pytest.raises(ValueError, match="group size 48 must be even and divide K = 128"):
        int4_dequant_triton(buffers["weight"], buffers["scale"], buffers["zero"], 48)
    with pytest.raises(ValueError, match="scale / zero be"):  # scales of another group size
        int4_dequant_triton(buffers["weight"], buffers["scale"], buffers["zero"], 64)


@pytest.fixture
def interpreter_bf16_rtne(monkeypatch):
    """The interpreter (triton 3.9) truncates fp32 -> bf16 casts (and its "rtne" mode rounds half up without a carry);
    the GPU rounds them to nearest even (cvt.rn), as PyTorch does. Round them through PyTorch."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    cast = interp.InterpreterBuilder.cast_impl

    def rtne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(src.data.astype("float32")).to(torch.bfloat16).view(torch.int16).numpy()
            return interp.TensorHandle(bits.view(interp._get_np_dtype(dst_type)), dst_type.scalar)
        return cast(self, src, dst_type)

    monkeypatch.setattr(interp.InterpreterBuilder, "cast_impl", rtne)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", [(40, 320, 32), (32, 256, 128), (7, 512, 64)])
def test_int4_dequant_kernel_equals_the_torch_ops_bit_for_bit(dtype, n, k, group, interpreter_bf16_rtne):
    """One kernel, the same weight as the six PyTorch ops: every rounding of the model dtype where they round (partial
    row and byte tiles: 40 rows and 160 bytes against 32 x 128 tiles)."""
    from kernels.int4_dequant import int4_dequant_reference, int4_dequant_triton

    _, buffers = stored("int4", n, k, group_size=group, dtype=dtype, seed=n + k)
    args = (buffers["weight"], buffers["scale"], buffers["zero"], group)
    want, got = int4_dequant_reference(*args), int4_dequant_triton(*args)
    assert got.dtype == want.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got, want)


@interpreter
def test_int4_prefill_through_the_dequant_kernel_matches_the_torch_ops(monkeypatch, interpreter_bf16_rtne):
    """Int4Linear with kernel "triton": a call past GEMV_MAX_ROWS (prefill) gives the same output, bit for bit,
    as the six PyTorch ops' dequantized weight times x (the "dequant" form); decode-sized calls do not reach it."""
    import workbench.engine.quant.linears as linears

    torch.manual_seed(0)
    lin = nn.Linear(256, 48, bias=False).to(torch.bfloat16)
    mod = Int4Linear(lin, 64, "triton")
    x = torch.randn(linears.GEMV_MAX_ROWS + 4, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        want = torch.nn.functional.linear(x, linears.int4_dequant_reference(mod.weight, mod.scale, mod.zero,
                                                                             64).to(x.dtype))
        calls = []
        real = linears.int4_dequant_triton
        monkeypatch.setattr(linears, "int4_dequant_triton", lambda *a: calls.append(1) or real(*a))
        got = mod(x)
        assert calls and torch.equal(got, want)
        mod(x[:1])  # one row: the GEMV, not the dequant
        assert len(calls) == 1


@interpreter
@pytest.mark.parametrize("m", [17, 40])
def test_int4_prefill_through_the_gemv_kernel_is_within_the_wide_rows_bound(m, monkeypatch, interpreter_bf16_dot):
    """KernelTuning.int4_prefill_gemm_rows (0, off, by default): an int4 "triton" call of GEMV_MAX_ROWS < M <= that many
    rows goes through the GEMV kernel's tensor-core form (16-row tiles, a partial last one) instead of a dequantized
    weight: the output stays within the bound of the M > 1 form (weights rounded once to bf16 before the dot) of the
    dequant path's, and no weight is dequantized; past the limit the dequant path runs again."""
    import workbench.engine.quant.linears as linears

    torch.manual_seed(1)
    lin = nn.Linear(256, 48, bias=False).to(torch.bfloat16)
    mod = Int4Linear(lin, 64, "triton")
    x = torch.randn(m, 256, dtype=torch.bfloat16)
    calls = []
    real = linears.int4_dequant_triton
    monkeypatch.setattr(linears, "int4_dequant_triton", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        want = torch.nn.functional.linear(x, linears.int4_dequant_reference(mod.weight, mod.scale, mod.zero,
                                                                             64).to(x.dtype)).float()
        mod.tuning = KernelTuning(int4_prefill_gemm_rows=64)
        got = mod(x).float()
        assert not calls and got.shape == (m, 48)
        torch.testing.assert_close(got, want, rtol=0, atol=2 ** -6 * want.abs().max().item())
        mod.tuning = KernelTuning(int4_prefill_gemm_rows=m - 1)
        mod(x)
        assert calls  # past the limit: the dequant kernel


@interpreter
def test_gpu_gemv_prefill_part_times_both_dequants_with_parity(tmp_path, monkeypatch, interpreter_bf16_rtne,
                                                              interpreter_bf16_dot):
    """scripts/gpu_gemv.py --parts prefill on the mini config (interpreter): per linear and M, bf16, tinygemm and
    kernel "triton" dequantized by one kernel and through the GEMV kernel (int4_prefill_gemm_rows set on the modules
    for that row only); the dequant row within the parity bound, the GEMV row within the tensor-core form's."""
    import json
    import sys

    import workbench.engine.quant.linears as linears

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_gemv

    monkeypatch.setattr(sys, "argv", ["gpu_gemv.py", "--device", "cpu", "--out", str(tmp_path), "--parts", "prefill",
                                      "--sweep-configs", "mini", "--prefill-ms", "20", "--replays", "1",
                                      "--int4-group-size", "32"])
    gpu_gemv.main()
    rows = json.loads((tmp_path / "gemv_prefill.json").read_text())["rows"]
    assert all("error" not in r for r in rows) and len(rows) == 4 * 4
    for name in {r["linear"] for r in rows}:
        at = {r["kernel"]: r for r in rows if r["linear"] == name}
        assert list(at) == ["bf16", "aten", "triton+dq", "triton+gemv"]
        assert at["triton+dq"]["rel_err"] <= 2 ** -7
        assert at["triton+gemv"]["rel_err"] <= 2 ** -6  # weights rounded to bf16 once, then the tensor-core dot
        assert at["triton+gemv"]["rel_err"] != at["triton+dq"]["rel_err"]  # two paths, not one twice


@interpreter
def test_a_compiled_prefill_traces_through_the_dequant_op_without_a_graph_break(monkeypatch, interpreter_bf16_rtne):
    """The compiled prefill (compile_prefill) of an int4 "triton" linear with the one-kernel dequant: fullgraph=True
    traces through `torch.ops.workbench.int4_dequant` (its fake gives the weight's shape) and computes the eager
    output, bit for bit."""
    import torch._dynamo

    import workbench.engine.quant.linears as linears

    torch.manual_seed(2)
    mod = Int4Linear(nn.Linear(256, 40, bias=False).to(torch.bfloat16), 64, "triton")
    x = torch.randn(linears.GEMV_MAX_ROWS + 8, 256, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        want = mod(x) + 1
        got = torch.compile(lambda t: mod(t) + 1, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(got, want)
