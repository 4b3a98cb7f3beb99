"""The one-row int4 GEMV in CUDA C++ (kernels/int4_cuda.py, kernels/int4_gemv.cu) on a machine without a GPU.

What can be checked here: the kernel's arithmetic (per-chunk power-of-two scales, fp16 pairs in the nibbles' order,
fp16 sums of WORDS_PER_SUM words, the fusions) through `int4_cuda_emulate` against the fp32 reference; that every
variant the benchmarks sweep compiles with nvcc for sm_90 without register spills (where nvcc exists); and that
calls it cannot take are named, and left to the Triton GEMV by the dispatch. The kernel itself runs on the GPU only:
scripts/gpu_gemv.py --parts cuda holds it against the same reference there."""
import itertools
import re

import pytest
import torch

from kernels import int4_cuda, quant_gemv
from kernels.int4_cuda import (Int4CudaError, compile_cubin, int4_cuda_emulate, int4_cuda_gemv, int4_cuda_takes,
                               nvcc_path)
from kernels.quant_gemv import quant_gemv_reference
from kernels.tuning import KernelTuning

RTOL = 2 ** -7  # the GPU parity bound of scripts/gpu_gemv.py


def _case(n, k, g, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).to(dtype)
    z = (torch.randn(n, k // g, generator=gen) * 0.01).to(dtype)
    return w, s, z


def _rel(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("wps", [1, 2, 4])
def test_emulation_matches_reference(dtype, g, wps):
    w, s, z = _case(40, 384, g, dtype)  # 12 chunks of 32: not a multiple of a warp's 32 lanes
    x = torch.randn(1, 384).to(dtype)
    want = quant_gemv_reference(x, "int4", w, s, z, g)
    got = int4_cuda_emulate(x, w, s, z, g, words_per_sum=wps)
    assert got.shape == (1, 40) and got.dtype == dtype
    assert _rel(got, want) <= RTOL


def test_fp16_sums_cost_little_next_to_bf16_rounding():
    """fp16 x has 3 more mantissa bits than bf16, so its output rounding hides less: the fp16 sums (4 words) must stay
    within 4 ulps of fp16 at the output's scale."""
    w, s, z = _case(64, 1024, 128, torch.float16, seed=3)
    x = torch.randn(1, 1024).to(torch.float16)
    assert _rel(int4_cuda_emulate(x, w, s, z, 128), quant_gemv_reference(x, "int4", w, s, z, 128)) <= 4 * 2 ** -11


def test_every_nibble_lands_on_its_k():
    """One weight at a time set to q = 15 (all others q = 8, i.e. 0): the output is x_k s for exactly that k, so a
    wrong pair order or nibble position cannot cancel out."""
    k, g = 64, 32
    x = (torch.arange(k, dtype=torch.float32) + 1).to(torch.bfloat16)[None, :]  # distinct x per k
    for kk in range(k):
        w = torch.full((1, k // 2), 0x88, dtype=torch.uint8)
        byte, low = kk // 2, kk % 2
        w[0, byte] = 0x8F if low else 0xF8
        s = torch.ones(1, k // g, dtype=torch.bfloat16)
        z = torch.zeros(1, k // g, dtype=torch.bfloat16)
        got = int4_cuda_emulate(x, w, s, z, g).float().item()
        assert got == pytest.approx(7 * (kk + 1), rel=2 ** -8), kk


@pytest.mark.parametrize("fusion", ["norm", "glu", "residual"])
def test_emulated_fusions_match_reference(fusion):
    n, k, g = 24, 256, 64
    w, s, z = _case(n, k, g, torch.bfloat16, seed=1)
    x = torch.randn(1, 2 * k if fusion == "glu" else k).to(torch.bfloat16)
    kw = dict(glu=fusion == "glu",
              norm_weight=(1 + 0.1 * torch.randn(k)).to(torch.bfloat16) if fusion == "norm" else None,
              residual=torch.randn(1, n).to(torch.bfloat16) if fusion == "residual" else None)
    want = quant_gemv_reference(x, "int4", w, s, z, g, **kw)
    assert _rel(int4_cuda_emulate(x, w, s, z, g, **kw), want) <= RTOL
    plain = quant_gemv_reference(x[:, :k], "int4", w, s, z, g)  # the fusion changes the result: it is not ignored
    assert _rel(plain, want) > 0.05


def test_takes_names_its_limits():
    w, s, z = _case(8, 256, 64, torch.bfloat16)
    x = torch.randn(1, 256).to(torch.bfloat16)
    assert int4_cuda_takes(x, w, s, z, 64)
    assert not int4_cuda_takes(torch.randn(2, 256).to(torch.bfloat16), w, s, z, 64)  # verify widths: int4_mma
    assert not int4_cuda_takes(x.float(), w, s, z, 64)  # fp32 x
    assert not int4_cuda_takes(x, w, s.float(), z, 64)  # scales in another dtype
    w3, s3, z3 = _case(8, 288, 96, torch.bfloat16)
    assert not int4_cuda_takes(torch.randn(1, 288).to(torch.bfloat16), w3, s3, z3, 96)  # not a power of two
    assert not int4_cuda_takes(x[:, 1:].contiguous()[:, :255], w, s, z, 64)  # K mismatch
    kb = 2 ** 17  # x's staging would need more than MAX_SHARED bytes of shared memory
    wb, sb, zb = _case(2, kb, 128, torch.bfloat16)
    assert int4_cuda.shared_bytes(kb) > int4_cuda.MAX_SHARED
    assert not int4_cuda_takes(torch.randn(1, kb).to(torch.bfloat16), wb, sb, zb, 128)


def test_cpu_call_gets_a_named_error():
    w, s, z = _case(8, 256, 64, torch.bfloat16)
    with pytest.raises(Int4CudaError, match="CUDA GPU"):
        int4_cuda_gemv(torch.randn(1, 256).to(torch.bfloat16), w, s, z, 64)


def test_dispatch_leaves_cpu_and_untaken_calls_to_triton(monkeypatch):
    """With KernelTuning.int4_cuda on (the default), a call the CUDA kernel cannot take (here: no CUDA device) must not
    reach it (the CUDA branch comes before the Triton path's own check, so that check's error marks the
    fall-through); with it off, a call it would take does not reach it either."""
    called = []
    monkeypatch.setattr(int4_cuda, "launch_taken", lambda *a, **k: called.append(1))
    monkeypatch.setattr(quant_gemv, "TRITON_AVAILABLE", False)  # the Triton path's own error marks the fall-through
    w, s, z = _case(8, 256, 64, torch.bfloat16)
    with pytest.raises(quant_gemv.GemvError):
        quant_gemv._launch(torch.randn(1, 256).to(torch.bfloat16), "int4", w, s, z, 64, None)
    assert not called
    monkeypatch.setattr(int4_cuda, "device_problem", lambda device: None)  # a device it runs on: now it is reached
    with pytest.raises(quant_gemv.GemvError):
        quant_gemv._launch(torch.randn(1, 256).to(torch.bfloat16), "int4", w, s, z, 64, None,
                           tuning=KernelTuning(int4_cuda=False))
    assert not called
    assert quant_gemv._launch(torch.randn(1, 256).to(torch.bfloat16), "int4", w, s, z, 64, None) is None
    assert called == [1]


def test_dispatch_routes_taken_calls(monkeypatch):
    """A one-row call the kernel takes goes to int4_cuda_gemv with the fusions (and the shape's own tile)."""
    monkeypatch.setattr(quant_gemv, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(int4_cuda, "device_problem", lambda device: None)
    seen = {}
    monkeypatch.setattr(int4_cuda, "launch_taken", lambda *a, **kw: seen.update(kw) or "cuda")
    w, s, z = _case(8, 256, 64, torch.bfloat16)
    r = torch.randn(1, 8).to(torch.bfloat16)
    assert quant_gemv._launch(torch.randn(1, 256).to(torch.bfloat16), "int4", w, s, z, 64, None,
                              residual=r) == "cuda"
    assert "ROWS" not in seen and seen["residual"] is r and seen["glu"] is False  # no tile forced: the shape's own


VARIANTS = [dict(ROWS=r, UNROLL=u, WARPS=wp, WORDS_PER_SUM=4, PIPE=p, MINB=0)
            for r, u, wp, p in itertools.product([2, 4], [1, 2, 4], [4, 8], [0, 1])] + \
           [dict(ROWS=4, UNROLL=4, WARPS=4, WORDS_PER_SUM=s, PIPE=0, MINB=0) for s in (1, 2)] + \
           [dict(ROWS=4, UNROLL=2, WARPS=4, WORDS_PER_SUM=4, PIPE=p, MINB=4) for p in (0, 1)] + \
           [dict(ROWS=8, UNROLL=1, WARPS=4, WORDS_PER_SUM=4, PIPE=0, MINB=b) for b in (0, 2)] + \
           [dict(ROWS=r, UNROLL=u, WARPS=wp, WORDS_PER_SUM=4, PIPE=p, MINB=0, PERSIST=3)
            for r, u, wp, p in ((8, 1, 4, 0), (2, 2, 8, 1), (4, 2, 4, 1), (4, 2, 4, 2))] + \
           [dict(ROWS=r, UNROLL=u, WARPS=wp, WORDS_PER_SUM=4, PIPE=2, MINB=0)  # PIPE 2: both steps before the wait
            for r, u, wp in itertools.product([2, 4, 8], [1, 2], [4, 8])]


@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc (the CUDA toolkit) to compile the kernel")
@pytest.mark.parametrize("x_bf16", [True, False])
@pytest.mark.parametrize("tile", VARIANTS, ids=lambda t: int4_cuda.tile_label(t).replace(" ", "_"))
def test_every_swept_variant_compiles_without_real_spills(tile, x_bf16, tmp_path, monkeypatch):
    """ptxas may park a register or two of the setup in local memory (seen: 8-24 bytes, one store before the K loop
    and one load per step in the SASS of r4u4w4s1); a tile whose weights or sums spilled would show hundreds."""
    monkeypatch.setenv("WORKBENCH_CUDA_CACHE", str(tmp_path))
    cubin, report = compile_cubin(dict(int4_cuda.DEFAULT_TILE, **tile), x_bf16, "sm_90a", verbose=True)
    assert cubin[:4] == b"\x7fELF"
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and max(spills) <= 32, report
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    assert regs <= 255


@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc (the CUDA toolkit) to compile the kernel")
def test_cubin_cache_reuses_a_build(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CUDA_CACHE", str(tmp_path))
    tile = dict(int4_cuda.DEFAULT_TILE)
    first, _ = compile_cubin(tile, True, "sm_90a")
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    again, _ = compile_cubin(tile, True, "sm_90a")
    assert again == first and files[0].stat().st_mtime_ns == mtime
    compile_cubin(dict(tile, MINB=2), True, "sm_90a")  # another variant is another build
    assert len(list(tmp_path.iterdir())) == 2


def test_measured_tiles_replace_the_rule(tmp_path):
    """A sweep's best rows (gpu_gemv --parts cuda JSON) become per-shape tiles; other shapes keep the rule."""
    import json
    rows = [dict(kernel="cuda", best=True, N=4096, K=4096, tile="r2 u2 w8 s4 pipe b2"),
            dict(kernel="cuda", N=4096, K=4096, tile="r8 u1 w4 s4"),  # not the best: ignored
            dict(kernel="triton", best=True, N=12288, K=4096, tile="-")]
    path = tmp_path / "gemv_cuda.json"
    path.write_text(json.dumps({"rows": rows}))
    table = int4_cuda.load_measured_tiles(path)
    assert table == {(4096, 4096): dict(ROWS=2, UNROLL=2, WARPS=8, WORDS_PER_SUM=4, PIPE=1, MINB=2, PERSIST=0)}
    assert int4_cuda.parse_tile("r8 u1 w4 s2 pdl") == dict(ROWS=8, UNROLL=1, WARPS=4, WORDS_PER_SUM=2, PIPE=0, MINB=0,
                                                           PERSIST=0)
    assert int4_cuda.parse_tile("r2 u2 w8 s4 pipe g3")["PERSIST"] == 3
    for tile in VARIANTS:  # the label and the parser agree
        assert int4_cuda.parse_tile(int4_cuda.tile_label(tile)) == dict(int4_cuda.DEFAULT_TILE, **tile)
    assert int4_cuda.int4_cuda_tile(4096, 4096, measured=table) == table[(4096, 4096)]  # MINB 2: not the rule's
    assert int4_cuda.int4_cuda_tile(4096, 4096)["MINB"] == 0  # the rule's own without the table
    assert int4_cuda.int4_cuda_tile(12288, 4096, measured=table) == dict(int4_cuda.DEFAULT_TILE, ROWS=8, UNROLL=1,
                                                                         WARPS=4)


@pytest.fixture
def fake_driver(monkeypatch):
    """int4_cuda's launch on CPU tensors with the driver faked: the dict it returns gets each launch's grid, block,
    shared memory, stream, PDL attribute, the four ints after the 7 pointers (N, K, log2 g, flags), eps and the first
    pointer."""
    import ctypes
    monkeypatch.setattr(int4_cuda, "device_problem", lambda device: None)
    monkeypatch.setattr(int4_cuda, "_function", lambda *a: ctypes.c_void_p(1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(int4_cuda, "_raw_stream", lambda dev: 1234)
    int4_cuda._launcher.cache_clear()  # launchers hold the (faked) driver's function
    seen = {}

    class FakeDriver:
        @staticmethod
        def cuLaunchKernelEx(conf, func, params, extra):
            c = conf._obj if hasattr(conf, "_obj") else conf
            seen.update(grid=c.gridDimX, block=c.blockDimX, smem=c.sharedMemBytes, stream=c.hStream,
                        attrs=c.numAttrs, pdl=c.attrs[0].value.programmatic if c.numAttrs else None)
            arr = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            seen["ints"] = [ctypes.cast(arr[i], ctypes.POINTER(ctypes.c_int))[0] for i in range(7, 11)]
            seen["eps"] = ctypes.cast(arr[11], ctypes.POINTER(ctypes.c_float))[0]
            seen["ptr0"] = ctypes.cast(arr[0], ctypes.POINTER(ctypes.c_void_p))[0]
            return 0

    monkeypatch.setattr(int4_cuda, "_libcuda", lambda: FakeDriver)
    yield seen
    int4_cuda._launcher.cache_clear()


def test_launch_passes_what_the_kernel_signature_takes(fake_driver, monkeypatch):
    """int4_cuda_gemv up to the driver call, on CPU tensors with the driver faked: 7 pointers then N, K, log2 g, the
    fusion flags and eps (int4_gemv.cu's parameter list), the grid of rows, the shared memory for K and PDL's
    attribute. The kernel's own arithmetic is checked on the GPU (scripts/gpu_gemv.py --parts cuda)."""
    seen = fake_driver
    n, k, g = 100, 512, 128
    w, s, z = _case(n, k, g, torch.bfloat16)
    x = torch.randn(1, 2 * k).to(torch.bfloat16)
    r = torch.randn(1, n).to(torch.bfloat16)
    out = int4_cuda_gemv(x, w, s, z, g, glu=True, residual=r, eps=1e-5, pdl=True, ROWS=2, WARPS=8)
    assert out.shape == (1, n) and out.dtype == torch.bfloat16
    assert seen["ints"] == [n, k, 7, int4_cuda.F_GLU | int4_cuda.F_RESIDUAL]
    assert seen["eps"] == pytest.approx(1e-5)
    assert seen["ptr0"] == w.data_ptr()
    assert seen["grid"] == -(-n // 16) and seen["block"] == 256  # 2 rows x 8 warps a block
    assert seen["smem"] == int4_cuda.shared_bytes(k) and seen["stream"] == 1234
    assert seen["attrs"] == 1 and seen["pdl"] == 1
    int4_cuda_gemv(x[:, :k].contiguous(), w, s, z, g, norm_weight=torch.ones(k, dtype=torch.bfloat16))
    assert seen["ints"][3] == int4_cuda.F_NORM and seen["attrs"] == 0
    # a norm folded into the weight (its weight all ones): the kernel is told not to read it
    int4_cuda_gemv(x[:, :k].contiguous(), w, s, z, g, norm_weight=torch.ones(k, dtype=torch.bfloat16),
                   norm_unit=True)
    assert seen["ints"][3] == int4_cuda.F_NORM | int4_cuda.F_NORM_UNIT
    with pytest.raises(int4_cuda.Int4CudaError, match="norm_unit"):
        int4_cuda_gemv(x[:, :k].contiguous(), w, s, z, g, norm_unit=True)
    # PERSIST: at most min(PERSIST, blocks that fit) x SMs blocks, never more than the row groups
    monkeypatch.setattr(int4_cuda, "_sm_count", lambda dev: 3)
    monkeypatch.setattr(int4_cuda, "_occupancy", lambda func, threads, smem: 2)
    n2 = 1000
    w2, s2, z2 = _case(n2, k, g, torch.bfloat16)
    xk = x[:, :k].contiguous()
    int4_cuda_gemv(xk, w2, s2, z2, g, ROWS=2, WARPS=4, PERSIST=4)  # 125 row groups; 2 fit a SM, 3 SMs
    assert seen["grid"] == 6
    int4_cuda_gemv(xk, w2, s2, z2, g, ROWS=2, WARPS=4, PERSIST=1)
    assert seen["grid"] == 3
    int4_cuda_gemv(xk, w2, s2, z2, g, ROWS=2, WARPS=4)
    assert seen["grid"] == 125
    # a second call of a cached launcher carries the new call's pointers and stream
    w3 = w2.clone()
    monkeypatch.setattr(int4_cuda, "_raw_stream", lambda dev: 99)
    int4_cuda_gemv(xk, w3, s2, z2, g, ROWS=2, WARPS=4)
    assert seen["ptr0"] == w3.data_ptr() and seen["stream"] == 99


def test_run_record_says_whether_the_cuda_gemv_served(monkeypatch):
    """The record's int4_cuda_gemv: False on CPU or with KernelTuning.int4_cuda off, True only with both."""
    assert int4_cuda.int4_cuda_gemv_applies("cpu") is False
    monkeypatch.setattr(int4_cuda, "device_problem", lambda device: None)
    assert int4_cuda.int4_cuda_gemv_applies("cuda") is True
    assert int4_cuda.int4_cuda_gemv_applies("cuda", on=False) is False


def test_a_failed_build_falls_back_to_triton_once(monkeypatch):
    """nvcc failing (or a cubin the driver refuses) must not fail the run: the call goes to the Triton GEMV, a warning
    names the cause once, and later calls on that device skip the CUDA kernel."""
    monkeypatch.setattr(int4_cuda, "_cached_problem", lambda device: None)
    monkeypatch.setattr(int4_cuda, "_BUILD_FAILED", {})
    tries = []

    def failing_build(*a, **k):
        tries.append(1)
        raise int4_cuda.Int4CudaBuildError("nvcc failed: unsupported gpu architecture")

    monkeypatch.setattr(int4_cuda, "launch_taken", failing_build)
    monkeypatch.setattr(quant_gemv, "TRITON_AVAILABLE", False)  # the Triton path's own error marks the fall-through
    w, s, z = _case(8, 256, 64, torch.bfloat16)
    x = torch.randn(1, 256).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="unsupported gpu architecture"):
        with pytest.raises(quant_gemv.GemvError):
            quant_gemv._launch(x, "int4", w, s, z, 64, None)
    with pytest.raises(quant_gemv.GemvError):  # the second call does not try again
        quant_gemv._launch(x, "int4", w, s, z, 64, None)
    assert tries == [1]
    assert "build failed" in int4_cuda.device_problem("cpu")
    assert int4_cuda.int4_cuda_gemv_applies("cpu") is False


def test_an_unwritable_cache_is_a_build_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("WORKBENCH_CUDA_CACHE", str(blocker / "sub"))  # a folder under a file cannot be made
    monkeypatch.setattr(int4_cuda, "nvcc_path", lambda: "/bin/true")
    with pytest.raises(int4_cuda.Int4CudaBuildError, match="WORKBENCH_CUDA_CACHE"):
        compile_cubin(dict(int4_cuda.DEFAULT_TILE), True, "sm_90a")


def test_outliers_in_a_chunk_stay_within_the_bound():
    """Activation outliers (LLM hidden states carry a few channels 100-1000x the rest): each chunk of 32 takes its
    own power-of-two scale, so an outlier neither overflows the fp16 sums (|x 2^-e| < 1, 16 products of |q - 8| <= 8
    per lane) nor, in other chunks, costs the small values their precision."""
    w, s, z = _case(32, 1024, 128, torch.bfloat16, seed=5)
    x = torch.randn(1, 1024)
    x[0, ::97] *= 1000.0  # one outlier in most chunks, far above its neighbours
    x[0, 512:544] *= 1e-3  # and one chunk of tiny values
    x = x.to(torch.bfloat16)
    got = int4_cuda_emulate(x, w, s, z, 128)
    assert torch.isfinite(got.float()).all()
    assert _rel(got, quant_gemv_reference(x, "int4", w, s, z, 128)) <= RTOL


def test_overhead_script_runs():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "scripts" / "int4_cuda_overhead.py"), "--calls", "20",
                           "--n", "256", "--k", "512"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"\d+\.\d us per call \(host side; driver faked\)\n", done.stdout)


# ---- SwiGLU in the epilogue (F_GLU_OUT): a gate/up projection that writes silu(gate) * up ------------------------
def _swiglu_reference(x, w, s, z, g, norm_weight=None):
    """The unfused path: the [gate | up] output in x's dtype (the reference GEMV), then down's SwiGLU prologue."""
    y = quant_gemv_reference(x, "int4", w, s, z, g, norm_weight=norm_weight).float()
    gate, up = y.chunk(2, dim=-1)
    return (gate / (1 + torch.exp(-gate)) * up).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_emulated_swiglu_epilogue_matches_the_unfused_path(dtype, norm):
    n, k, g = 48, 256, 64  # [24 gate | 24 up] rows
    w, s, z = _case(n, k, g, dtype, seed=5)
    x = torch.randn(1, k).to(dtype)
    nw = (1 + 0.1 * torch.randn(k)).to(dtype) if norm else None
    got = int4_cuda_emulate(x, w, s, z, g, norm_weight=nw, glu_out=True)
    want = _swiglu_reference(x, w, s, z, g, nw)
    assert got.shape == (1, n // 2) and got.dtype == dtype
    assert _rel(got, want) <= 2 * RTOL  # two roundings (gate / up, then the product), each within the GEMV's bound
    full = int4_cuda_emulate(x, w, s, z, g, norm_weight=nw)
    assert _rel(got, full[:, : n // 2]) > 0.05  # it is not the plain output's gate half


def test_swiglu_epilogue_launch_has_half_the_outputs_and_its_flag(fake_driver):
    """The launch with glu_out: flag F_GLU_OUT, the full N passed (the kernel reads [gate | up] rows), a grid over
    N / 2 output rows at ROWS / 2 a warp (the same blocks as the plain call), an output of N / 2; odd ROWS, an odd N
    and a residual are refused before any launch."""
    seen = fake_driver
    n, k, g = 200, 256, 64
    w, s, z = _case(n, k, g, torch.bfloat16)
    x = torch.randn(1, k).to(torch.bfloat16)
    out = int4_cuda_gemv(x, w, s, z, g, glu_out=True, norm_weight=torch.ones(k, dtype=torch.bfloat16), ROWS=4,
                         WARPS=4)
    assert out.shape == (1, n // 2)
    assert seen["ints"] == [n, k, 6, int4_cuda.F_NORM | int4_cuda.F_GLU_OUT]
    assert seen["grid"] == -(-(n // 2) // 8)  # 2 gate rows (and their 2 up rows) a warp, 4 warps
    int4_cuda_gemv(x, w, s, z, g, ROWS=4, WARPS=4)
    assert seen["grid"] == -(-n // 16)  # the plain call: the same weight rows per block
    with pytest.raises(Int4CudaError, match="even ROWS"):
        int4_cuda_gemv(x, w, s, z, g, glu_out=True, ROWS=1)
    with pytest.raises(Int4CudaError, match="no residual"):
        int4_cuda_gemv(x, w, s, z, g, glu_out=True, residual=torch.zeros(1, n, dtype=torch.bfloat16), ROWS=2)
    assert not int4_cuda.glu_out_takes(201, k, ROWS=2) and int4_cuda.glu_out_takes(200, k, ROWS=2)


def test_swiglu_dispatch_goes_to_cuda_or_falls_back_to_the_full_output(monkeypatch):
    """quant_gemv_triton(glu_out=True): to the CUDA kernel where it takes the call; otherwise (the Triton path here
    faked by the reference) the full [gate | up] output, then SwiGLU of its halves."""
    monkeypatch.setattr(int4_cuda, "device_problem", lambda device: None)
    seen = {}
    monkeypatch.setattr(int4_cuda, "launch_taken", lambda *a, **kw: seen.update(kw) or "cuda")
    n, k, g = 48, 256, 64
    w, s, z = _case(n, k, g, torch.bfloat16, seed=2)
    x = torch.randn(1, k).to(torch.bfloat16)
    assert quant_gemv._launch(x, "int4", w, s, z, g, None, glu_out=True) == "cuda" and seen["glu_out"] is True
    monkeypatch.setattr(int4_cuda, "device_problem", lambda device: "no GPU")
    calls = []
    real = quant_gemv._launch

    def triton_stand_in(x_, fmt, w_, s_, z_, g_, counters, glu=False, residual=None, norm_weight=None, eps=1e-6,
                        glu_out=False, norm_unit=False, tuning=KernelTuning(), **override):
        if glu_out:
            return real(x_, fmt, w_, s_, z_, g_, counters, glu, residual, norm_weight, eps, glu_out, norm_unit, tuning,
                        **override)
        calls.append(1)
        return quant_gemv_reference(x_, fmt, w_, s_, z_, g_, norm_weight=norm_weight, eps=eps)

    monkeypatch.setattr(quant_gemv, "_launch", triton_stand_in)
    got = quant_gemv._launch(x, "int4", w, s, z, g, None, glu_out=True)
    assert calls == [1] and got.shape == (1, n // 2)
    assert _rel(got, _swiglu_reference(x, w, s, z, g)) <= 2 ** -8  # F.silu against exp's form: bf16 rounding


def test_mlp_takes_the_swiglu_epilogue_and_matches_the_unfused_mlp(monkeypatch):
    """An int4 MLP (kernel triton, fusion norm+glu+residual) at one row: with the CUDA GEMV (KernelTuning.int4_cuda,
    the default), the gate/up call asks for glu_out (here served by the emulation) and the down projection gets h with
    no SwiGLU prologue; the layer's output matches the same MLP with int4_cuda off (the down's GLU prologue, served by
    the reference)."""
    from workbench.engine.quant import apply_kernel_tuning, linears, quantize_model, set_fusion
    from workbench.models import LlamaModel, ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=192, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaModel(cfg).to(torch.bfloat16)
    model.reset_parameters(std=0.05, generator=torch.Generator().manual_seed(0))
    q = set_fusion(quantize_model(model, "int4", group_size=64, kernel="dequant"), "norm+glu+residual")
    layer = q.model.layers[0]
    for lin in (layer.mlp.gate_up_proj, layer.mlp.down_proj):
        lin.kernel = "triton"  # the GEMV path, its launches faked below (no GPU here)
        lin.register_buffer("gemv_counters", torch.zeros(1, dtype=torch.int32), persistent=False)
    layer.mlp.gate_up_proj.cuda_gemv_ok = True
    asked, units = [], []

    def fake_gemv(x, fmt, weight, scale=None, zero=None, group_size=None, counters=None, *, glu=False,
                  residual=None, norm_weight=None, eps=1e-6, glu_out=False, norm_unit=False, tuning=None):
        asked.append((weight.shape[0], glu, glu_out))
        units.append(norm_unit)
        assert not norm_unit or torch.equal(norm_weight, torch.ones_like(norm_weight))
        if glu_out:
            return int4_cuda_emulate(x, weight, scale, zero, group_size, norm_weight=norm_weight, eps=eps,
                                     glu_out=True)
        return quant_gemv_reference(x, fmt, weight, scale, zero, group_size, glu=glu, residual=residual,
                                    norm_weight=norm_weight, eps=eps)

    monkeypatch.setattr(linears, "quant_gemv_triton", fake_gemv)
    x = torch.randn(1, 1, 128).to(torch.bfloat16)
    norm = layer.post_attention_layernorm
    apply_kernel_tuning(q, "int4_cuda=0")
    want = layer.mlp(x, residual=x, norm=norm)
    assert asked == [(384, False, False), (128, True, False)]  # gate/up with the norm, down with SwiGLU
    asked.clear()
    apply_kernel_tuning(q, None)  # the defaults
    got = layer.mlp(x, residual=x, norm=norm)
    assert asked == [(384, False, True), (128, False, False)]  # SwiGLU in gate/up's epilogue, none in down
    assert units == [True, False, True, False]  # the norm folded into gate/up (int4 quantizing): its weight unread
    assert _rel(got, want) <= 2 * RTOL
    asked.clear()
    layer.mlp(torch.randn(1, 2, 128).to(torch.bfloat16), residual=torch.randn(1, 2, 128).to(torch.bfloat16),
              norm=norm)  # two rows: not the one-row kernel, so the old route
    assert all(not glu_out for _, _, glu_out in asked)
