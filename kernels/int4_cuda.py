"""One-row int4 GEMV in CUDA C++ (kernels/int4_gemv.cu), compiled by nvcc on first use and launched through the driver.

Why it exists beside the Triton GEMV (kernels/quant_gemv.py): at batch 1 a 6.7 B int4 layer's four GEMVs took 52.6 µs
on the H200, against 31.5 µs for a kernel that only streams the same bytes. Many rounds of
tiles, splits, packed-fp16 words and loop pipelining in Triton left the Triton loop at 4.25 SASS instructions per
weight and 60 % of that read floor. Written by hand the same arithmetic is about 1.9 instructions per weight
(int4_gemv.cu's header: lop3 into fp16 mantissas, two weights per packed instruction), every load of a step is issued
before any is used, and with PDL the first step's weights are in flight before the previous kernel has finished.

    int4_cuda_gemv(x [1, K] or [K], weight uint8 [N, K/2], scale, zero [N, K/g], g) -> [1, N] in x's dtype
        (x bf16 or fp16; scale / zero in x's dtype; g a power of two >= 32; optional glu / residual / norm_weight
        fusions with the meaning kernels/quant_gemv.py gives them; glu_out: a [gate | up] weight's SwiGLU in the
        epilogue, [1, N / 2] out, each warp taking ROWS / 2 gate rows and their up rows)

Build and launch, without a torch extension: nvcc (found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin) compiles
the .cu file to a cubin for the device's architecture, once per variant (ROWS, UNROLL, WARPS, WORDS_PER_SUM, PIPE,
MINB, PERSIST on or off, x dtype; about 2 s each), cached under $WORKBENCH_CUDA_CACHE (default
~/.cache/workbench/cuda) by a hash of the source and flags. The driver (libcuda through ctypes) loads it per device
and launches it on torch's current stream with cuLaunchKernelEx (PDL's attribute when kernels/pdl.py says a launch
uses it). A captured CUDA graph records the launch like any other; torch.compile sees it inside the custom op
`workbench::quant_gemv` (quant_gemv._launch routes to it). A build that fails (`Int4CudaBuildError`) warns once and
leaves that device in the Triton GEMV.

Where it runs: `int4_cuda_takes` (one row, 16-bit x, scales and zeros in x's dtype, a power-of-two group of 32+,
16-byte aligned buffers) and `cuda_problem` (a CUDA device of compute capability 8.0+ and nvcc). On by default
(KernelTuning.int4_cuda; 0 keeps the calls in Triton). The Triton interpreter cannot run
it: on CPU, `int4_cuda_emulate` computes the same arithmetic (per-chunk power-of-two scales, fp16 pairs, fp16 sums of
WORDS_PER_SUM words) in PyTorch, which tests/test_int4_cuda.py holds against quant_gemv_reference; the tests also
compile every swept variant with nvcc (where nvcc exists; ptxas may spill at most 32 bytes) and check the launch's
parameters against the kernel's signature with the driver faked. The kernel itself is checked on the GPU
(scripts/gpu_gemv.py --parts cuda and --parts parity).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("int4_gemv.cu")
DEFAULT_TILE = dict(ROWS=4, UNROLL=4, WARPS=4, WORDS_PER_SUM=4, PIPE=0, MINB=0, PERSIST=0)
TILE_KEYS = tuple(DEFAULT_TILE)
F_GLU, F_NORM, F_RESIDUAL, F_GLU_OUT, F_NORM_UNIT = 1, 2, 4, 8, 16  # int4_gemv.cu's flags


def load_measured_tiles(path: str | Path) -> dict[tuple[int, int], dict]:
    """The fastest parity-clean tile per shape from a gpu_gemv.py --parts cuda JSON ("best" rows), {(N, K): tile}, as
    `int4_cuda_tile(measured=...)` takes them."""
    import json
    rows = json.loads(Path(path).read_text())["rows"]
    return {(r["N"], r["K"]): parse_tile(r["tile"]) for r in rows
            if r.get("kernel") == "cuda" and r.get("best") and r.get("tile")}


def tile_label(tile: dict) -> str:
    """The tile's label, as parse_tile reads it: "r4 u2 w8 s4" plus " pipe" (PIPE 1) or " pipe2" (PIPE 2), " bN"
    (MINB), " gN" (PERSIST)."""
    t = dict(DEFAULT_TILE, **tile)
    pipe = {0: "", 1: " pipe"}.get(t["PIPE"], f" pipe{t['PIPE']}")
    return (f"r{t['ROWS']} u{t['UNROLL']} w{t['WARPS']} s{t['WORDS_PER_SUM']}" + pipe
            + (f" b{t['MINB']}" if t["MINB"] else "") + (f" g{t['PERSIST']}" if t["PERSIST"] else ""))


def parse_tile(text: str) -> dict:
    """gpu_gemv's tile label ("r4 u2 w8 s4 pipe2 b2 g3 pdl": rows, unroll, warps, words per sum, PIPE ("pipe" 1,
    "pipeN" N), MINB, PERSIST) -> the tile dict int4_cuda_gemv takes."""
    words = text.split()
    parts = dict(re.fullmatch(r"([a-z])(\d+)", p).groups() for p in words if re.fullmatch(r"[ruwsbg]\d+", p))
    pipe = next((int(p[4:] or 1) for p in words if re.fullmatch(r"pipe\d*", p)), 0)
    return dict(ROWS=int(parts["r"]), UNROLL=int(parts["u"]), WARPS=int(parts["w"]), WORDS_PER_SUM=int(parts["s"]),
                PIPE=pipe, MINB=int(parts.get("b", 0)), PERSIST=int(parts.get("g", 0)))


def int4_cuda_tile(n: int, k: int, measured: dict[tuple[int, int], dict] | None = None) -> dict:
    """`measured`'s tile for the shape (a sweep's table, `load_measured_tiles`) when it has one, else the rule from a
    tile sweep of the 6.7 B shapes on one H200: the widest outputs (gate/up, N >= 16384) 4 rows a warp, 2 chunks a lane
    per row, pipelined, 4 warps; q/k/v (N >= 8192) 8 rows, 1 chunk, 4 warps; the rest (o, down) 2 rows, 2 chunks,
    pipelined, 8 warps."""
    if measured and (n, k) in measured:
        return dict(DEFAULT_TILE, **measured[(n, k)])
    if n >= 16384:
        return dict(DEFAULT_TILE, ROWS=4, UNROLL=2, WARPS=4, PIPE=1)
    if n >= 8192:
        return dict(DEFAULT_TILE, ROWS=8, UNROLL=1, WARPS=4)
    return dict(DEFAULT_TILE, ROWS=2, UNROLL=2, WARPS=8, PIPE=1)


class Int4CudaError(RuntimeError):
    """The CUDA int4 GEMV cannot build or run here (the message says what is missing and what to do)."""


class Int4CudaBuildError(Int4CudaError):
    """nvcc or the module load failed: nothing ran, so the caller may fall back to the Triton GEMV."""


def nvcc_path() -> str | None:
    """nvcc on PATH, in $CUDA_HOME/bin or in /usr/local/cuda/bin; None when there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def cuda_problem(device: torch.device | str) -> str | None:
    """Why the CUDA int4 GEMV cannot run on `device`; None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the CUDA int4 GEMV runs on a CUDA GPU; this run is on {device.type}"
    if nvcc_path() is None:
        return "the CUDA int4 GEMV is compiled on first use and needs nvcc (install the CUDA toolkit or set CUDA_HOME)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"the CUDA int4 GEMV needs compute capability 8.0+ (this GPU: {major}.x)"
    return None


@functools.lru_cache(maxsize=None)
def _cached_problem(device: torch.device) -> str | None:
    return cuda_problem(device)


_BUILD_FAILED: dict[torch.device, str] = {}  # device -> why a build failed there (the dispatch then stays in Triton)


def device_problem(device: torch.device | str) -> str | None:
    """`cuda_problem`, asked once per device (every dispatched call asks), or the build failure `mark_failed` noted."""
    device = torch.device(device)
    return _BUILD_FAILED.get(device) or _cached_problem(device)


def mark_failed(device: torch.device | str, error: Exception) -> None:
    """Remember that building or loading the kernel failed on `device` and warn once: later calls there stay in the
    Triton GEMV (the dispatch in kernels/quant_gemv.py)."""
    import warnings
    device = torch.device(device)
    if device not in _BUILD_FAILED:
        warnings.warn(f"int4 CUDA GEMV unavailable on {device}, one-row int4 calls stay in the Triton GEMV: {error}",
                      RuntimeWarning, stacklevel=3)
    _BUILD_FAILED[device] = f"its build failed: {str(error)[:500]}"


def int4_cuda_gemv_applies(device: torch.device | str, on: bool = True) -> bool:
    """Whether one-row int4 calls of the Triton quant kernel go to this kernel on `device` (`on`: the run's
    KernelTuning.int4_cuda; a CUDA GPU of 8.0+, nvcc): the run record's `int4_cuda_gemv`."""
    return bool(on) and device_problem(device) is None


def int4_cuda_takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group_size: int | None, glu: bool = False) -> bool:
    """Whether an int4 call fits the kernel: one row of bf16 / fp16 x, scales and zeros in x's dtype, contiguous,
    groups a power of two of 32+, the buffers 16-byte aligned (x is read in 16-byte pieces) and x's staging within
    MAX_SHARED bytes of shared memory (K up to 72,800)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    g = group_size or 0
    k = x.shape[1] // 2 if glu else x.shape[1]
    return (g >= 32 and g & (g - 1) == 0 and k % g == 0 and weight.dtype == torch.uint8
            and weight.shape[1] * 2 == k and scale.dtype == x.dtype and zero.dtype == x.dtype
            and weight.is_contiguous() and scale.is_contiguous() and zero.is_contiguous()
            and x.is_contiguous() and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and shared_bytes(k) <= MAX_SHARED)


# ---- build ----------------------------------------------------------------------------------------------------------
def _cache_dir() -> Path:
    return Path(os.environ.get("WORKBENCH_CUDA_CACHE", Path.home() / ".cache" / "workbench" / "cuda"))


def build_flags(tile: dict, x_bf16: bool, arch: str) -> list[str]:
    defines = [f"-D{key}={int(tile[key] if key != 'PERSIST' else bool(tile[key]))}" for key in TILE_KEYS] + \
        [f"-DX_BF16={int(x_bf16)}"]
    return ["-cubin", f"-arch={arch}", "-O3", "-std=c++17", *defines]


def compile_cubin(tile: dict, x_bf16: bool, arch: str, *, verbose: bool = False) -> tuple[bytes, str]:
    """(cubin bytes, ptxas's report when verbose) for one variant, from the cache when built before."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise Int4CudaBuildError(cuda_problem("cuda") or "nvcc not found")
    source = SOURCE.read_bytes()
    flags = build_flags(tile, x_bf16, arch) + (["-Xptxas", "-v"] if verbose else [])
    key = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:24]
    out = _cache_dir() / f"int4_gemv_{key}.cubin"
    if out.is_file() and not verbose:
        return out.read_bytes(), ""
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([nvcc, *flags, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
    except OSError as e:
        raise Int4CudaBuildError(f"cannot build {SOURCE.name} into {out.parent} ({e}): set WORKBENCH_CUDA_CACHE to "
                                 "a writable folder") from e
    if done.returncode != 0:
        raise Int4CudaBuildError(f"nvcc failed on {SOURCE.name} ({' '.join(flags)}):\n{done.stderr[-3000:]}")
    tmp.replace(out)  # atomic: concurrent builders of one variant each write a whole file
    return out.read_bytes(), done.stderr


# ---- driver (ctypes) ------------------------------------------------------------------------------------------------
class _LaunchAttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic", ctypes.c_int)]


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
MAX_SHARED = 160 * 1024  # the dynamic shared memory a launch may ask for (below Hopper's 227 KiB and Ampere's 163)


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _libcuda().cuGetErrorString(result, ctypes.byref(msg))
        raise Int4CudaError(f"{what} failed: CUDA error {result} ({(msg.value or b'?').decode()})")


@functools.lru_cache(maxsize=None)
def _function(device_index: int, tile_items: tuple, x_bf16: bool) -> ctypes.c_void_p:
    """The loaded kernel for one variant on one device (compiled first if need be)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
    cubin, _ = compile_cubin(dict(tile_items), x_bf16, arch)
    lib = _libcuda()
    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    with torch.cuda.device(device_index):  # cudaSetDevice: torch's (primary) context is current on this thread
        try:
            _check(lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)), "cuModuleLoadData")
            _check(lib.cuModuleGetFunction(ctypes.byref(func), module, b"int4_gemv"), "cuModuleGetFunction")
            _check(lib.cuFuncSetAttribute(func, _MAX_DYNAMIC_SHARED, MAX_SHARED), "cuFuncSetAttribute")
        except Int4CudaError as e:
            raise Int4CudaBuildError(str(e)) from e
    return func


def _occupancy(func: ctypes.c_void_p, threads: int, smem: int) -> int:
    """Blocks of the kernel one SM holds at once (the driver's count: registers, shared memory, threads)."""
    key = (func.value, threads, smem)
    if key not in _OCCUPANCY:
        blocks = ctypes.c_int()
        _check(_libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), func, threads,
                                                                      ctypes.c_size_t(smem)),
               "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        _OCCUPANCY[key] = max(1, blocks.value)
    return _OCCUPANCY[key]


_OCCUPANCY: dict = {}


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def shared_bytes(k: int) -> int:
    """The kernel's dynamic shared memory for K: the x pairs (16 bytes a word) and a float2 per chunk of 32."""
    return (k // 32) * (4 * 16 + 8)


def glu_out_takes(n: int, k: int, **tile) -> bool:
    """Whether the SwiGLU epilogue (glu_out) fits a [N, K] weight with this shape's tile: N even, ROWS even."""
    return n % 2 == 0 and dict(int4_cuda_tile(n, k), **tile)["ROWS"] % 2 == 0


def int4_cuda_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                   *, glu: bool = False, residual: torch.Tensor | None = None,
                   norm_weight: torch.Tensor | None = None, eps: float = 1e-6, pdl: bool = False,
                   glu_out: bool = False, norm_unit: bool = False, **tile) -> torch.Tensor:
    """x [1, K] (glu: [1, 2K]) -> [1, N] in x's dtype (see the module docstring); `tile`: entries of DEFAULT_TILE
    that replace `int4_cuda_tile`'s for this shape. glu_out: the weight's rows are [gate | up] (a SwiGLU MLP's
    gate/up projection) and the result is silu(gate) * up [1, N / 2], gate and up each rounded to x's type first
    (`glu_out_takes`; no residual). norm_unit: norm_weight is all ones (a norm folded into this weight), and the
    kernel does not read it (the caller vouches for it: the weight is not checked)."""
    problem = device_problem(x.device)
    if problem:
        raise Int4CudaError(problem)
    x2 = x.reshape(1, -1).contiguous()
    if not int4_cuda_takes(x2, weight, scale, zero, group_size, glu):
        raise Int4CudaError("int4_cuda_gemv takes one row of bf16 / fp16 x with scales and zeros in its dtype, a "
                            f"power-of-two group of 32+, 16-byte aligned buffers and K up to 72,800 (got x "
                            f"{tuple(x.shape)} {x.dtype}, scale {scale.dtype}, group {group_size})")
    if glu_out and (residual is not None or not glu_out_takes(weight.shape[0], weight.shape[1] * 2, **tile)):
        raise Int4CudaError(f"glu_out needs an even N and an even ROWS, and no residual (N {weight.shape[0]}, tile "
                            f"{dict(int4_cuda_tile(weight.shape[0], weight.shape[1] * 2), **tile)})")
    if norm_unit and norm_weight is None:
        raise Int4CudaError("norm_unit is a property of norm_weight: pass the (all-ones) norm weight with it")
    return launch_taken(x2, weight, scale, zero, group_size, glu=glu, residual=residual, norm_weight=norm_weight,
                        eps=eps, pdl=pdl, glu_out=glu_out, norm_unit=norm_unit, **tile)


def launch_taken(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 *, glu: bool = False, residual: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6, pdl: bool = False,
                 glu_out: bool = False, norm_unit: bool = False, **tile) -> torch.Tensor:
    """`int4_cuda_gemv` for a call already known to fit (`device_problem` None, `int4_cuda_takes` true, x [1, K]
    contiguous, and `glu_out_takes` for glu_out): the dispatch in kernels/quant_gemv.py has checked them, so a decode
    step does not check twice."""
    n, k = weight.shape[0], weight.shape[1] * 2
    cfg = dict(int4_cuda_tile(n, k), **tile)
    unknown = set(cfg) - set(TILE_KEYS)
    if unknown:
        raise Int4CudaError(f"unknown int4_cuda tile keys {sorted(unknown)}; known: {list(TILE_KEYS)}")
    x2 = x
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    flags = (F_GLU if glu else 0) | (F_NORM if norm_weight is not None else 0) \
        | (F_RESIDUAL if residual is not None else 0) | (F_GLU_OUT if glu_out else 0) \
        | (F_NORM_UNIT if norm_unit and norm_weight is not None else 0)
    launcher = _launcher(dev, n, k, int(group_size), x.dtype == torch.bfloat16, flags, bool(pdl),
                         tuple(sorted(cfg.items())))
    out = torch.empty(1, n // 2 if glu_out else n, dtype=x.dtype, device=x.device)
    nw = norm_weight.contiguous() if norm_weight is not None else x2
    if nw.data_ptr() % 16:  # read in 16-byte pieces: a fresh copy is aligned
        nw = nw.clone()
    res = residual.reshape(-1).contiguous() if residual is not None else out
    launcher.launch((weight.data_ptr(), x2.data_ptr(), scale.data_ptr(), zero.data_ptr(), nw.data_ptr(),
                     res.data_ptr(), out.data_ptr()), float(eps), _raw_stream(dev))
    return out


def _raw_stream(device_index: int) -> int:
    """torch's current stream on the device, as the driver's handle."""
    return torch.cuda.current_stream(device_index).cuda_stream


class _Launcher:
    """One variant's launch for one shape, built once: the loaded kernel, its grid, and the ctypes parameter block;
    a call only writes the 7 pointers, eps and the stream, then launches (a lock keeps threads from interleaving)."""

    def __init__(self, dev: int, n: int, k: int, group_size: int, x_bf16: bool, flags: int, pdl: bool,
                 tile: dict):
        import threading
        self.func = _function(dev, tuple(sorted(tile.items())), x_bf16)
        rows = tile["ROWS"] // 2 if flags & F_GLU_OUT else tile["ROWS"]  # output rows a warp writes
        row_groups = math.ceil((n // 2 if flags & F_GLU_OUT else n) / (rows * tile["WARPS"]))
        grid = row_groups  # one block per group, or PERSIST blocks per SM (at most as many as fit at once), each
        if tile["PERSIST"]:  # looping over row groups with x staged once
            fit = _occupancy(self.func, tile["WARPS"] * 32, shared_bytes(k))
            grid = min(row_groups, min(tile["PERSIST"], fit) * _sm_count(dev))
        self.ptrs = [ctypes.c_void_p() for _ in range(7)]  # w, x, s, z, nw, res, out
        self.eps = ctypes.c_float()
        scalars = [ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(int(math.log2(group_size))), ctypes.c_int(flags),
                   self.eps]
        self.holders = self.ptrs + scalars
        self.params = (ctypes.c_void_p * len(self.holders))(
            *[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in self.holders])
        self.params_ptr = ctypes.cast(self.params, ctypes.c_void_p)
        self.attr = _LaunchAttr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value.programmatic = 1
        self.conf = _LaunchConfig(grid, 1, 1, tile["WARPS"] * 32, 1, 1, shared_bytes(k), None,
                                  ctypes.pointer(self.attr) if pdl else None, 1 if pdl else 0)
        self.conf_ref = ctypes.byref(self.conf)
        self.lock = threading.Lock()

    def launch(self, pointers: tuple, eps: float, stream: int) -> None:
        with self.lock:
            for holder, value in zip(self.ptrs, pointers):
                holder.value = value
            self.eps.value = eps
            self.conf.hStream = stream
            _check(_libcuda().cuLaunchKernelEx(self.conf_ref, self.func, self.params_ptr, None),
                   "cuLaunchKernelEx (int4_gemv)")


@functools.lru_cache(maxsize=4096)
def _launcher(dev: int, n: int, k: int, group_size: int, x_bf16: bool, flags: int, pdl: bool,
              tile_items: tuple) -> _Launcher:
    return _Launcher(dev, n, k, group_size, x_bf16, flags, pdl, dict(tile_items))


# ---- CPU emulation --------------------------------------------------------------------------------------------------
def _fp16_fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a b + c rounded to fp16, inputs fp16 values held in fp32 (the product is exact in fp32; the sum rounds once
    in fp32 before the fp16 rounding, which can differ from a fused fp16 fma in the last bit at a tie)."""
    return (a * b + c).to(torch.float16).float()


def int4_cuda_emulate(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      group_size: int, *, glu: bool = False, residual: torch.Tensor | None = None,
                      norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                      words_per_sum: int = DEFAULT_TILE["WORDS_PER_SUM"], glu_out: bool = False) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch on any device, for tests: per chunk of 32 x's a power-of-two scale, x as fp16
    pairs, each word's products (q - 8) x~ in fp16 multiply-adds in the kernel's pair order, fp16 sums of
    `words_per_sum` words, then s 2^e dot + z sum(x) in fp32; returns [1, N] in x's dtype ([1, N / 2] with glu_out).
    """
    dt = x.dtype
    xf = x.reshape(-1).float()
    k = weight.shape[1] * 2
    if glu:
        gate, up = xf[:k], xf[k:]
        xf = (gate / (1 + torch.exp(-gate)) * up).to(dt).float()
    rstd = 1.0
    if norm_weight is not None:
        rstd = torch.rsqrt((xf * xf).sum() / k + eps)
        xf = (xf * norm_weight.float()).to(dt).float()
    nch = k // 32
    chunks = xf.reshape(nch, 32)
    amax = chunks.abs().amax(dim=1)
    _, e = torch.frexp(amax)
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    xs = (chunks * torch.ldexp(torch.ones_like(amax), -e)[:, None]).to(torch.float16).float()  # [nch, 32]
    n = weight.shape[0]
    w = weight.reshape(n, nch, 4, 4).to(torch.int32)  # [N, chunk, word, byte]
    q_hi, q_lo = (w >> 4) - 8, (w & 15) - 8  # byte b of a word: k = 2b (high), 2b + 1 (low)
    xw = xs.reshape(nch, 4, 8)  # [chunk, word, 8]
    # the kernel's pair order per word: (k1, k5), (k0, k4), (k3, k7), (k2, k6): lanes (low, high)
    order = [((q_lo, 0), (q_lo, 2), 1, 5), ((q_hi, 0), (q_hi, 2), 0, 4), ((q_lo, 1), (q_lo, 3), 3, 7),
             ((q_hi, 1), (q_hi, 3), 2, 6)]
    sums, dots = None, torch.zeros(n, nch)
    for word in range(4):
        if sums is None:
            sums = [torch.zeros(n, nch), torch.zeros(n, nch)]
        for (qa, ba), (qb, bb), ka, kb in order:
            sums[0] = _fp16_fma(qa[:, :, word, ba].float(), xw[None, :, word, ka], sums[0])
            sums[1] = _fp16_fma(qb[:, :, word, bb].float(), xw[None, :, word, kb], sums[1])
        if (word + 1) % words_per_sum == 0:
            dots = dots + (sums[0] + sums[1])
            sums = None
    groups = k // group_size
    cg = torch.arange(nch) * 32 // group_size  # chunk -> group
    s = scale.float().reshape(n, groups)[:, cg]
    z = zero.float().reshape(n, groups)[:, cg]
    acc = (s * torch.ldexp(torch.ones_like(amax), e)[None, :] * dots + z * chunks.sum(dim=1)[None, :]).sum(dim=1)
    acc = acc * rstd
    if glu_out:  # gate and up rounded to x's type, then silu(gate) * up rounded once
        gate, up = acc.to(dt).float().chunk(2)
        return (gate / (1 + torch.exp(-gate)) * up).to(dt).reshape(1, n // 2)
    if residual is not None:
        acc = acc + residual.float().reshape(-1)
    return acc.to(dt).reshape(1, n)
