"""Weight-only quantized GEMV / skinny GEMM for the decode regime: a Triton kernel family beside its PyTorch reference.

    y [M, N] = x [M, K] @ dequantize(weight).T      x in the model dtype (bf16 on a GPU), M small (1..16: decode,
                                                    and the verify widths 2..9 of a draft); fp32 accumulation

One kernel, specialized by format (`FMT`, a constexpr), reading the buffers the quant modules already store
(workbench/engine/quant/linears.py), so a module switches kernels without repacking:

    format  weight                               scales                          dequantized weight
    int8    int8 [N, K]                          scale [N] (model dtype)         q * scale[n]
    int4    uint8 [N, K/2]: byte j of row n       scale, zero [N, K/g]            (q - 8) * scale[n, k/g] + zero[n, k/g]
            holds k = 2j (high nibble) and          (model dtype)
            k = 2j + 1 (low nibble): the modules' "dequant" packing
    fp8     float8_e4m3fn [N, K]                 scale [N] fp32 (a [1, N] view)  q * scale[n]
    int8g   int8 [N, K]                          scale [N, K/g] fp32             q * scale[n, k/g] (GGUF Q8_0: g = 32,
                                                                                 scale = the block's f16 d)
    dense   model dtype [N, K] (bf16 / fp16)     none (pass None)                w (an unquantized linear: the GEMV
                                                                                 with in-kernel split-K, one launch)

Activations stay in their dtype: unlike `Fp8Linear`'s `_scaled_mm` path, fp8 here quantizes nothing on the fly (a
weight-only fp8 model, more accurate than the per-token fp8 x fp8 product). The weight is widened in registers and
never written back: each weight byte is read once per call, which is what bounds a batch-1 decode.

Fusions at the edges (any format): `glu=True` reads x as [gate | up] ([M, 2K]) and multiplies silu(gate) * up (a
SwiGLU MLP's down projection: no SiLU-mul kernel before it); `residual` [M, N] is added in the epilogue (no add kernel
after it); `norm_weight` [K] applies an RMSNorm in the prologue: x * w is multiplied in, the sum of x^2 is gathered on
the way (per split, added by the split that finishes the tile) and 1 / rms scales the product at the end, so the
norm costs no pass of its own. A decoder layer then costs four GEMV launches and its attention, nothing between.

How the math is arranged (each per-channel or per-group factor applied where it costs least):
- int8 / fp8: the raw integers (exact in fp32 and bf16) are multiplied with x and the channel's scale is applied once
  to the accumulated sum.
- int4: a K tile lies inside one group (BLOCK_K divides g), so per tile t = sum_k x_k q_k (q in 0..15, exact) and
  acc += scale * t + (zero - 8 scale) * sum_k x_k: two multiply-adds per (row, tile) instead of a dequantization per
  weight element.
- int8g: the same grouped tiles without a zero: per tile t = sum_k x_k q_k (q in -128..127, exact) and
  acc += scale * t.
- int4 / int8g one row, K tiles of whole groups (BLOCK_K a multiple of g, the ELEMENTWISE form; int4's default,
  `_int4_wide_tile`): each weight dequantized with its group's scale (loaded [BN, groups of
  the tile], broadcast over the group's weights by a reshape that moves no data) and summed per lane, one reduction
  after the loop as dense / fp8 do, instead of a reduction per tile. int4 with CVT_BITS reads 32-bit words and widens
  each nibble by an and-or into 2^23's mantissa and one subtraction (`_int4_words_dot`), accumulating per word.
- M = 1 (BLOCK_M = 1): broadcast multiply and reduce over K on the CUDA cores (a GEMV); M > 1: `tl.dot` with
  BLOCK_M = 16 row tiles (the tensor cores' smallest M; rows past M are masked). A measured tile may put M = 1 on
  the tensor cores too (BLOCK_M = 16 in M1_TILES; measured slower in decode). fp8 tiles
  there multiply fp16 operands (F16_DOT_FORMATS): the weight converts to fp16 in one step (exact).
- Split-K: the grid is (N tiles, M tiles, SPLIT_K); when the N tiles alone cannot fill the GPU, K is cut into
  SPLIT_K ranges. Each split writes an fp32 partial, then bumps a per-tile counter; the split that arrives last adds
  the partials, writes the output and resets the counter to 0 (so one launch per call and no zeroing kernel). The
  counters are a persistent int32 buffer (`gemv_counters`), zero between calls.

Capture-safe: the grid, tile sizes and SPLIT_K depend on shapes and the SM count only (`gemv_config`), nothing is
read on the host, no Python scalar is written into a CUDA tensor, and the partials are a `torch.empty`.

Verified under the Triton interpreter on CPU (TRITON_INTERPRET=1, triton 3.9.0): tests/test_quant_gemv.py against
`quant_gemv_reference` (dequantize in fp32, then matmul), and on one H200 (triton 3.6.0): scripts/gpu_gemv.py, every
decoder shape of the random 1.45 B / 6.7 B within 2^-7 of the reference; speed on the results page.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from . import int4_cuda, int4_mma
from .common import sm_count as _sm_count
from .pdl import use_pdl
from .tuning import KernelTuning, as_tuning

try:
    import triton
    import triton.language as tl
    TRITON_AVAILABLE = True
    from .common import sum_splits
    from .pdl import gdc_launch_dependents, gdc_wait
except ImportError:
    TRITON_AVAILABLE = False

GEMV_FORMATS = ("int8", "int4", "fp8", "dense", "int8g")
_FMT_CODE = {"int8": 0, "int4": 1, "fp8": 2, "dense": 3, "int8g": 4}
GROUPED = ("int4", "int8g")  # a scale per group of g input channels: BLOCK_K divides g
MAX_SPLIT_K = 32
MIN_BLOCK_N = 8  # the smallest N tile a measured tile may take (M1_TILES): split-K counters are sized for it
# int8 / fp8 tensor-core tiles multiply fp16 operands; bf16 activations are scaled by this power of two first (and the
# sum by its inverse after), so |x| up to 65504 / X_SCALE_BF16 (~4e6) fits fp16; below ~2^-8 x keeps fewer bits.
X_SCALE_BF16 = 2.0 ** -6
# One-row (CUDA-core) GEMVs widen each weight to fp32 by integer ops instead of conversion instructions
# (`_int8_to_f32`, `_fp8_to_f32_scaled`; exact for every byte): faster for the int8 formats, slower for fp8, so on for
# int8 only; a sweep may set it per call (override CVT_BITS=...). int4 reads it only in K tiles of whole groups
# (ELEMENTWISE): 32-bit words widened in place (`_int4_words_dot`), faster than the cvt form on every swept shape.
CVT_BITS_FORMATS = ("int8", "int8g", "int4")
FP8_UNBIAS = 2.0 ** 120  # what _fp8_to_f32_scaled's values are multiplied by
# Tensor-core tiles (M > 1) with fp16 operands: fp8 as fast as the fp32-widened form, int8 slower: fp8 only by default
# (override F16_DOT=...).
F16_DOT_FORMATS = ("fp8",)


class GemvError(ValueError):
    """Inputs the kernel does not take (shapes, dtypes, a group size); the message says what to change."""


# ---- reference (pure PyTorch, any device) ------------------------------------------------------------------------
def all_byte_values(fmt: str, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [256, 16], expected [256]) for an exactness check of a one-byte format's widening: row n holds byte n in
    column 0 (fp8: the two NaN codes replaced by 0), zeros elsewhere; with scale 1 and x = e_0 the GEMV must return
    `expected` bit for bit (every value of the format, signs, zeros and fp8 subnormals included)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w = torch.zeros(256, 16, dtype=torch.uint8)
    w[:, 0] = codes
    if fmt == "fp8":
        w[(codes & 0x7F) == 0x7F, 0] = 0  # e4m3fn NaN
        w = w.view(torch.float8_e4m3fn)
    else:
        w = w.view(torch.int8)
    return w.to(device), w[:, 0].float().to(device)


def dequantize_weight(fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
                      zero: torch.Tensor | None = None,
                      group_size: int | None = None) -> torch.Tensor:
    """The [N, K] fp32 weight the kernel multiplies by, from the stored buffers (layouts in the module docstring).

    >>> w = torch.tensor([[0x8F, 0x0A]], dtype=torch.uint8)  # int4 row: q = 8, 15, 0, 10
    >>> dequantize_weight("int4", w, torch.tensor([[0.5]]), torch.tensor([[1.0]]), 4).tolist()
    [[1.0, 4.5, -3.0, 2.0]]
    >>> q = torch.tensor([[1, -2, 127, -128]], dtype=torch.int8)  # int8g, two groups of 2
    >>> dequantize_weight("int8g", q, torch.tensor([[0.5, 0.25]]), group_size=2).tolist()
    [[0.5, -1.0, 31.75, -32.0]]
    """
    if fmt == "int4":
        n = weight.shape[0]
        q = torch.stack((weight >> 4, weight & 15), dim=-1).reshape(n, -1).float()  # [N, K] in 0..15
        s = scale.float().repeat_interleave(group_size, dim=1)  # [N, K]
        z = zero.float().repeat_interleave(group_size, dim=1)
        return (q - 8) * s + z
    if fmt == "int8g":
        return weight.float() * scale.float().repeat_interleave(group_size, dim=1)  # [N, K]
    if fmt == "dense":
        return weight.float()
    return weight.float() * scale.float().reshape(-1)[:, None]


def quant_gemv_reference(x: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
                         zero: torch.Tensor | None = None, group_size: int | None = None, *, glu: bool = False,
                         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                         eps: float = 1e-6) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: dequantize in fp32, one fp32 matmul (the kernel's reference). glu: x is
    [M, 2K] = [gate | up] and the product takes silu(gate) * up (rounded to x's dtype, as the kernel does);
    norm_weight [K]: x is RMS-normalized first, x * norm_weight rounded to x's dtype and 1 / rms(x) (fp32, eps
    inside the root) applied to the product, as the kernel does; residual [M, N]: added before the final rounding."""
    xf = x.float()
    if glu:
        gate, up = xf.chunk(2, dim=-1)
        xf = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()
    rstd = None
    if norm_weight is not None:
        rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # [M, 1]
        xf = (xf * norm_weight.float()).to(x.dtype).float()
    y = xf @ dequantize_weight(fmt, weight, scale, zero, group_size).T
    if rstd is not None:
        y = y * rstd
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


# ---- launch configuration ----------------------------------------------------------------------------------------
# One-row dense / fp8 calls whose 16-row tiles would give fewer than 1.5 programs per SM take 8-row tiles with 2 KB
# of weight per row per K tile (at most half of K), 8 warps, 3 stages: more loads in flight where programs are few.
NARROW_BELOW_PROGRAMS_PER_SM = 1.5
# Multi-row int4 calls (verify widths, prefill) in K tiles of whole groups on the tensor cores: each [BN, BK] weight
# tile dequantized with its groups' scales and zeros, then one tl.dot per tile (faster than one group per K tile at
# every measured width). `gemv_config(int4_rows=...)` takes another tile (a sweep) or False (one group per K tile).
INT4_WIDE_ROWS_TILE = dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)


def _int4_wide_tile(n: int, k: int, group_size: int, sm_count: int) -> dict | None:
    """The one-row int4 tile of whole groups for one shape (from per-linear sweeps at 1.45 B and 6.7 B, g = 128): 32-row
    tiles with 4 warps in packed fp16 (HALF2 1) for N >= 8192 (K tiles of 1024, 512 for K < 4096) and for down
    projections (K >= 2 N; 32 x 512, split to about 4 programs per SM); 16 x 1024 fp32 words with 8 warps elsewhere;
    unsplit unless fewer than half the SMs get a tile. None where its K tile holds no whole number of groups."""
    half2, min_tiles, warps = 0, sm_count // 2, 8
    if n >= 8192:
        block_n, block_k, half2, warps = 32, 1024 if k >= 4096 else 512, 1, 4
    elif k >= 2 * n:  # a down projection: few N tiles, a long K; split
        block_n, block_k, half2, warps, min_tiles = 32, 512, 1, 4, 0
    else:
        block_n, block_k = 16, 1024
    block_k = min(block_k, max(16, 1 << (k - 1).bit_length()))
    if block_k % group_size:
        return None
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3, min_tiles=min_tiles, HALF2=half2)


def gemv_config(fmt: str, m: int, n: int, k: int, group_size: int | None = None, sm_count: int = 132,
                narrow: bool = True, int4_wide: dict | bool = True, int4_rows: dict | bool | None = None,
                half2: int | None = None, **override) -> dict:
    """Tile sizes, split count and warps for one call, from shapes only (so a captured graph replays the same launch).
    `override` replaces any entry (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, and the kernel switches CVT_BITS,
    F16_DOT, ELEMENTWISE; the benchmark sweeps them).

    Grouped formats (int4, int8g): BLOCK_K divides g (a K tile inside one group: a sum per tile, scaled once), or, one
    row at a time (BLOCK_M = 1), is a multiple of g (a K tile of whole groups: each weight times its group's scale,
    summed per lane and reduced after the loop, the `ELEMENTWISE` form; override ELEMENTWISE=True takes it for
    BLOCK_K <= g too); anything else is a GemvError. `int4_wide`: one-row int4 tiles of that form (True:
    the measured rule, `_int4_wide_tile`; a dict: that tile; False or {}: the group-tiled ones). One-row int4
    configurations of that form carry HALF2 (packed fp16 words): `half2` when given (KernelTuning.int4_half2), else the
    rule's or the dict's entry (0 for a tile in `override` without one). `int4_rows`: the multi-row int4 tile of whole
    groups (None: INT4_WIDE_ROWS_TILE; False: one group per K tile).

    M = 1 (decode) tiles come from sweeps on the H200 (scripts/gpu_gemv.py --parts tune): int8 / fp8 / dense read 32
    rows per program for N >= 8192 with 8 warps and long K tiles, unsplit when the N tiles alone give every SM a
    program; below that int8 takes 16 rows, and so do dense and fp8 unless 16-row tiles would give fewer than 1.5
    programs per SM, where they take 8 (`narrow`; measured at 1.45 B and 6.7 B); int4 K tiles of whole groups by
    `_int4_wide_tile` (32 x 1024 or 512 in packed fp16 with 4 warps for N >= 8192, down projections 32 x 512 in packed
    fp16 and split, else 16 x 1024), where its K tile holds whole groups, else 64 rows x one group per tile, split to ~4
    programs per SM (so are M > 1 int4 calls, and every call with int4_wide False). int8g takes int4's group-tiled shape
    (BLOCK_K = min(128, g): 32 for GGUF Q8_0), untuned: not yet swept on a GPU.

    >>> c = gemv_config("int4", 1, 4096, 4096, 128, int4_wide=dict(BLOCK_N=32, BLOCK_K=512))  # four groups a tile
    >>> c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["tiles_per_split"]
    (32, 512, 4, 2)

    >>> c = gemv_config("int4", 1, 4096, 4096, 128)  # the measured rule: 16 x 1024, unsplit (256 tiles)
    >>> c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_warps"], c["HALF2"]
    (1, 16, 1024, 1, 8, 0)
    >>> c = gemv_config("int4", 1, 4096, 11008, 128)  # 6.7 B's down projection: packed fp16 words, split
    >>> c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_warps"], c["HALF2"]
    (32, 512, 5, 4, 1)
    >>> c = gemv_config("int4", 1, 22016, 4096, 128)  # 6.7 B's gate / up: 32 x 1024 with 4 warps, unsplit
    >>> c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_warps"], c["HALF2"]
    (32, 1024, 1, 4, 1)
    >>> c = gemv_config("int4", 1, 4096, 4096, 128, int4_wide=False)  # the group-tiled form
    >>> c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]
    (1, 64, 128, 8)
    >>> c = gemv_config("fp8", 1, 22016, 4096)
    >>> c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_warps"]
    (32, 256, 1, 8)
    >>> c = gemv_config("int8g", 1, 4096, 4096, 32)
    >>> c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]
    (64, 32, 9)
    >>> c = gemv_config("dense", 1, 2048, 8192)  # 1.45 B's down projection
    >>> c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"], c["SPLIT_K"]
    (8, 1024, 8, 3, 1)
    >>> c = gemv_config("fp8", 1, 2560, 2048), gemv_config("fp8", 1, 2560, 2048, narrow=False)
    >>> (c[0]["BLOCK_N"], c[0]["BLOCK_K"]), (c[1]["BLOCK_N"], c[1]["BLOCK_K"])
    ((8, 1024), (16, 1024))
    """
    block_m = 1 if m == 1 else 16
    warps, stages, min_tiles = 4, 3, 0
    wide = int4_wide
    if wide is True:
        wide = _int4_wide_tile(n, k, group_size, sm_count) if fmt == "int4" and group_size else None
    if block_m == 1:
        if fmt == "int4" and wide:
            block_n, block_k = wide.get("BLOCK_N", 32), wide.get("BLOCK_K", 512)
            warps, stages = wide.get("num_warps", 8), wide.get("num_stages", 3)
            min_tiles = wide.get("min_tiles", 0)
        elif fmt in GROUPED:
            block_n, block_k = 64, 128
        elif fmt == "dense":  # swept on the H200: 3.7-4.0 TB/s on the wide 6.7 B shapes
            block_n, block_k = (32, 256) if n >= 8192 else (16, 512)
            warps, stages, min_tiles = 8, 4, sm_count // 2  # 128 tiles unsplit: a split cost 1.45 B's o_proj 18 %
        else:
            block_n, block_k = (32, 256) if n >= 8192 else (16, 1024)
            warps, stages, min_tiles = 8, 4, sm_count
        if narrow and fmt in ("dense", "fp8") and n < 8192 \
                and n / 16 < NARROW_BELOW_PROGRAMS_PER_SM * sm_count:
            block_n, warps, stages = 8, 8, 3
            row_bytes = 2048 // (1 if fmt == "fp8" else 2)  # 2 KB of weight per row per K tile
            block_k = min(row_bytes, 1 << max(4, (max(k // 2, 1)).bit_length() - 1))  # and at most half of K
    else:
        block_n, block_k = 64, 128
    rows_wide = INT4_WIDE_ROWS_TILE if int4_rows is None else int4_rows
    wide_rows = False  # int4, M > 1: K tiles of whole groups on the tensor cores (INT4_WIDE_ROWS_TILE)
    if block_m > 1 and fmt == "int4" and rows_wide and group_size:
        rk = min(rows_wide.get("BLOCK_K", 256), max(16, 1 << (k - 1).bit_length()))
        if rk % group_size == 0:
            wide_rows = True
            block_n, block_k = rows_wide.get("BLOCK_N", 64), rk
            warps, stages = rows_wide.get("num_warps", 4), rows_wide.get("num_stages", 3)
    if fmt in GROUPED and not (fmt == "int4" and wide and block_m == 1) and not wide_rows:
        block_k = min(block_k, group_size)
    block_k = min(block_k, max(16, 1 << (k - 1).bit_length()))  # no K tile past the next power of two of K
    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    if fmt == "int4" and block_m == 1 and wide:  # packed fp16 words: `half2` when given, else the tile's own (a
        # tile given in `override` without a HALF2 entry: fp32 words)
        own = 0 if "BLOCK_N" in override or "BLOCK_K" in override else wide.get("HALF2", 0)
        cfg["HALF2"] = half2 if half2 is not None else own
    if wide_rows:  # the ELEMENTWISE weights, multiplied on the tensor cores
        cfg.update(ELEMENTWISE=True, WIDE_ROWS=True)
    cfg.update({key: v for key, v in override.items() if key != "SPLIT_K"})
    if fmt in GROUPED:
        _check_group_tile(fmt, cfg, group_size)
    tiles = math.ceil(n / cfg["BLOCK_N"]) * math.ceil(m / cfg["BLOCK_M"])
    k_tiles = math.ceil(k / cfg["BLOCK_K"])
    split = 1 if m > 16 or (min_tiles and tiles >= min_tiles) else \
        max(1, min(math.ceil(4 * sm_count / tiles), k_tiles, MAX_SPLIT_K))  # ~4 programs / SM
    split = override.get("SPLIT_K", split)
    tiles_per_split = math.ceil(k_tiles / split)
    cfg["SPLIT_K"] = math.ceil(k_tiles / tiles_per_split)  # no empty splits
    cfg["tiles_per_split"] = tiles_per_split
    return cfg


def _check_group_tile(fmt: str, cfg: dict, group_size: int) -> None:
    """GemvError unless the K tile of a grouped format lies inside one group or (one-row, or int4 with
    int4 in multi-row tiles of whole groups) holds whole groups."""
    block_k, one_row, elementwise = cfg["BLOCK_K"], cfg["BLOCK_M"] == 1, cfg.get("ELEMENTWISE")
    wide_rows = cfg.get("WIDE_ROWS") and fmt == "int4"  # int4's tiles of whole groups above one row
    if group_size % block_k and (block_k % group_size or not (one_row or wide_rows)):
        raise GemvError(f"BLOCK_K={block_k} must divide the {fmt} group size {group_size} or, one row at a time "
                        f"(BLOCK_M = 1), be a multiple of it")
    if elementwise and not one_row and not wide_rows:
        raise GemvError("ELEMENTWISE (grouped weights dequantized per weight) is a one-row form (int4 takes it above "
                        "one row only in its multi-row tiles of whole groups): BLOCK_M must be 1")
    if elementwise is False and block_k > group_size:
        raise GemvError(f"BLOCK_K={block_k} spans several {fmt} groups of {group_size}: only the ELEMENTWISE form "
                        "reads such tiles")


# One-row tiles measured for particular shapes, {(fmt, N, K): gemv_config overrides}, consulted before the table in
# `gemv_config`: set by `set_m1_tiles` from a tile sweep's results (scripts/gpu_gemv.py --parts tc writes them,
# scripts/gpu_quant.py --m1-tiles reads them), empty by default.
M1_TILES: dict[tuple[str, int, int], dict] = {}
M1_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K", "CVT_BITS", "ELEMENTWISE",
                "HALF2")


def set_m1_tiles(table: dict[tuple[str, int, int], dict]) -> None:
    """Replace M1_TILES (keys (fmt, N, K), values gemv_config overrides named in M1_TILE_KEYS); cached launch
    configurations are dropped so the next call uses them."""
    bad = [key for key, over in table.items() if set(over) - set(M1_TILE_KEYS)]
    if bad:
        raise GemvError(f"m1 tiles for {bad[0]} name unknown entries; allowed: {', '.join(M1_TILE_KEYS)}")
    M1_TILES.clear()
    M1_TILES.update(table)
    _cached_config.cache_clear()


@functools.lru_cache(maxsize=4096)
def _cached_config(fmt, m, n, k, group_size, sm_count, override: tuple, half2: int | None = None) -> dict:
    """gemv_config with M1_TILES applied, cached (`half2`: KernelTuning.int4_half2; `override` as `_frozen` gives
    it)."""
    tiles = M1_TILES.get((fmt, n, k), {}) if m == 1 else {}
    over = {key: dict(v) if key in _TILE_ARGS and isinstance(v, tuple) else v for key, v in override}
    return gemv_config(fmt, m, n, k, group_size, sm_count, half2=half2, **{**tiles, **over})


_TILE_ARGS = ("int4_wide", "int4_rows")  # gemv_config arguments a sweep may give as a dict (a tile)


def _frozen(override: dict) -> tuple:
    """`override` as a cache key: its items sorted, a tile dict as its sorted items."""
    return tuple(sorted((key, tuple(sorted(v.items())) if isinstance(v, dict) else v) for key, v in override.items()))


def counters_for(n: int, device: torch.device | str) -> torch.Tensor:
    """The split-K counters a weight of N outputs needs (one per N tile of the smallest tile size), zeroed."""
    return torch.zeros(math.ceil(n / MIN_BLOCK_N), dtype=torch.int32, device=device)


def check_gemv(fmt: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               group_size: int | None, glu: bool = False, residual: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, glu_out: bool = False) -> None:
    """GemvError for inputs the kernel does not take (before any launch)."""
    if glu_out and (residual is not None or weight.shape[0] % 2):
        raise GemvError(f"glu_out needs an even N ([gate | up] rows; got {weight.shape[0]}) and no residual")
    if norm_weight is not None:
        if glu:
            raise GemvError("an RMSNorm prologue and the SwiGLU prologue do not combine: a layer's norm feeds q/k/v "
                            "and gate/up, the SwiGLU the down projection")
        if norm_weight.shape != (x.shape[-1],):
            raise GemvError(f"norm_weight must be [K] = [{x.shape[-1]}]; got {list(norm_weight.shape)}")
    if glu:
        if x.dim() != 2 or x.shape[1] % 2:
            raise GemvError(f"glu takes x = [gate | up] of shape [M, 2K]; got {tuple(x.shape)}")
        x = x[:, : x.shape[1] // 2]  # the K the weight multiplies
    if residual is not None and (residual.shape != (x.shape[0], weight.shape[0]) or residual.dtype != x.dtype):
        raise GemvError(f"residual must be [M, N] = {[x.shape[0], weight.shape[0]]} in {x.dtype}; got "
                        f"{list(residual.shape)} {residual.dtype}")
    if fmt not in GEMV_FORMATS:
        raise GemvError(f"quant_gemv format {fmt!r}: choose one of {', '.join(GEMV_FORMATS)}")
    if x.dim() != 2:
        raise GemvError(f"x must be [M, K]; got shape {tuple(x.shape)}: flatten the leading dimensions first")
    want = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn, "dense": x.dtype,
            "int8g": torch.int8}[fmt]
    if weight.dtype != want:
        raise GemvError(f"{fmt} weights must be {want}; got {weight.dtype}")
    k = x.shape[1] // 2 if fmt == "int4" else x.shape[1]
    if weight.shape[1] != k:
        raise GemvError(f"x has K = {x.shape[1]} but the {fmt} weight is {tuple(weight.shape)} "
                        f"(expected [N, {k}]{' : two int4 values per byte' if fmt == 'int4' else ''})")
    if fmt == "int4":
        if zero is None or group_size is None or x.shape[1] % group_size or group_size % 16:
            raise GemvError(f"int4 needs zero points and a group size that divides K = {x.shape[1]} and is a "
                            f"multiple of 16; got group_size={group_size}")
        if scale.shape != (weight.shape[0], x.shape[1] // group_size) or zero.shape != scale.shape:
            raise GemvError(f"int4 scale and zero must be [N, K/g] = {[weight.shape[0], x.shape[1] // group_size]}; "
                            f"got {list(scale.shape)} and {list(zero.shape)}")
    elif fmt == "int8g":
        if group_size is None or group_size < 16 or group_size & (group_size - 1) or x.shape[1] % group_size:
            raise GemvError(f"int8g needs a group size that divides K = {x.shape[1]} and is a power of two >= 16 "
                            f"(GGUF Q8_0: 32); got group_size={group_size}")
        if scale is None or scale.shape != (weight.shape[0], x.shape[1] // group_size):
            raise GemvError(f"int8g scale must be [N, K/g] = {[weight.shape[0], x.shape[1] // group_size]} (one per "
                            f"group of {group_size} input channels); got "
                            f"{None if scale is None else list(scale.shape)}")
    elif fmt == "dense":
        if x.dtype == torch.float32:
            raise GemvError("the dense GEMV takes bf16 / fp16 (fp32 models keep cuBLAS): load the model in bfloat16")
    elif scale is None or scale.numel() != weight.shape[0]:
        raise GemvError(f"{fmt} needs one scale per output channel ({weight.shape[0]}); got {scale.numel()}")


# ---- kernel ------------------------------------------------------------------------------------------------------
if TRITON_AVAILABLE:
    @triton.jit
    def _int8_to_f32(q):
        """int8 -> fp32 exactly by integer ops: the bits of 2^23 + (q + 128), minus 2^23 + 128 (no cvt instruction)."""
        u = (q.to(tl.int32) & 255) ^ 128
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0

    @triton.jit
    def _nibble_term(word, BIT: tl.constexpr, s, z, x, magic):
        """((q - 8) s + z) x for the int4 value q at bits BIT..BIT+3 of `word` (BIT <= 16), without a cvt instruction:
        q 2^BIT or-ed into the mantissa of 2^23 (`magic`: its bits; exactly 2^23 + q 2^BIT), minus 2^23 + 8 2^BIT
        (exactly (q - 8) 2^BIT), times s 2^-BIT (exact: a power of two)."""
        v = ((word & (15 << BIT)) | magic).to(tl.float32, bitcast=True) - (8388608.0 + 8.0 * (1 << BIT))
        return (v * (s * (1.0 / (1 << BIT))) + z) * x

    @triton.jit
    def _word_lanes(x):
        """x [..., 2, 2, 2] (weight i = 4a + 2b + d of a word, the "dequant" packing's order) -> its 8 lanes x0..x7,
        each [...]."""
        x_d0, x_d1 = tl.split(x)  # [..., 2, 2]
        x0, x4 = tl.split(tl.split(x_d0)[0])  # b = 0, d = 0
        x2, x6 = tl.split(tl.split(x_d0)[1])
        x1, x5 = tl.split(tl.split(x_d1)[0])
        x3, x7 = tl.split(tl.split(x_d1)[1])
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def _pow2_scale(amax):
        """(inv, undo) for a max |x| `amax`: inv = 2^(126 - E) with E its biased exponent (capped at 252), so that
        amax * inv < 1, and undo = 1 / inv exactly (both powers of two)."""
        e = tl.minimum((amax.to(tl.int32, bitcast=True) >> 23) & 255, 252)
        return ((253 - e) << 23).to(tl.float32, bitcast=True), ((e + 1) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _int4_words_dot(wd, s, z, x, magic):
        """sum over the 8 weights of each word of ((q - 8) s + z) x: wd [R, G, C] int32 words of the "dequant" packing
        (byte j: k = 2j high nibble, 2j + 1 low), s / z [R, G, 1] (their group's), x [1, G, C, 2, 2, 2] (weight
        i = 4a + 2b + d of word c) -> [R, G, C] fp32. Per weight an and-or, a subtraction and two multiply-adds."""
        hi = wd >> 12  # the top three nibbles (bits 20..31) at bits 8..19
        x0, x1, x2, x3, x4, x5, x6, x7 = _word_lanes(x)  # each [1, G, C]
        acc = _nibble_term(wd, 4, s, z, x0, magic)  # k = 8c + i: bit 4 of byte i // 2 for even i, bit 0 for odd
        acc += _nibble_term(wd, 0, s, z, x1, magic)
        acc += _nibble_term(wd, 12, s, z, x2, magic)
        acc += _nibble_term(wd, 8, s, z, x3, magic)
        acc += _nibble_term(hi, 8, s, z, x4, magic)  # bit 20
        acc += _nibble_term(wd, 16, s, z, x5, magic)
        acc += _nibble_term(hi, 16, s, z, x6, magic)  # bit 28
        acc += _nibble_term(hi, 12, s, z, x7, magic)  # bit 24
        return acc

    # One int4 word (8 weights of the "dequant" packing) times its 8 activations, two weights per instruction:
    # each nibble pair is or-ed into two fp16 lanes' mantissas under 1024's exponent (lop3: 1024 + q, or 1024 + 16 q
    # for the high nibbles of a byte), made q - 8 exactly by one packed subtraction or multiply-add, multiplied with
    # the paired activations (fp16, packed by the caller) in packed fp16 arithmetic, and the two lanes added in fp32.
    # x pairs: $2 = (k1, k5), $3 = (k0, k4), $4 = (k3, k7), $5 = (k2, k6) of word k = 8c .. 8c + 7 (low lane first).
    @triton.jit
    def _half2_lane(v, HIGH: tl.constexpr):
        """The fp16 in the low (HIGH False) or high 16 bits of int32 `v`, as fp32 (the emulation's unpacking)."""
        bits = (v >> 16) & 0xFFFF if HIGH else v & 0xFFFF
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _half2_pair_term(q_lo, q_hi, xp, h_lo, h_hi):
        """One packed multiply-add of the emulation: each lane (q - 8) x + h rounded to fp16, as the fma.f16x2 does."""
        h_lo = ((q_lo - 8).to(tl.float32) * _half2_lane(xp, False) + h_lo).to(tl.float16).to(tl.float32)
        h_hi = ((q_hi - 8).to(tl.float32) * _half2_lane(xp, True) + h_hi).to(tl.float16).to(tl.float32)
        return h_lo, h_hi

    @triton.jit
    def _int4_half2_word_dot(wd, xa, xb, xc, xd, EMULATE: tl.constexpr):
        """sum_i (q_i - 8) x_i over the 8 weights of each int32 word `wd` (x in fp16 pairs packed as int32: xa =
        (k1, k5), xb = (k0, k4), xc = (k3, k7), xd = (k2, k6)) -> fp32, in packed fp16 arithmetic (the PTX below).
        EMULATE (the Triton interpreter, which runs no PTX): the same lanes, pairs and roundings in Triton ops, one
        lane at a time (each fp16 multiply-add computed in fp32 and rounded to fp16: a fused one may differ in the
        last bit at a tie)."""
        if EMULATE:
            z = tl.zeros(wd.shape, dtype=tl.float32)
            lo, hi = _half2_pair_term(wd & 15, (wd >> 16) & 15, xa, z, z)
            lo, hi = _half2_pair_term((wd >> 4) & 15, (wd >> 20) & 15, xb, lo, hi)
            lo, hi = _half2_pair_term((wd >> 8) & 15, (wd >> 24) & 15, xc, lo, hi)
            lo, hi = _half2_pair_term((wd >> 12) & 15, (wd >> 28) & 15, xd, lo, hi)
            return lo + hi
        else:
            xa, xb = tl.broadcast_to(xa, wd.shape), tl.broadcast_to(xb, wd.shape)
            xc, xd = tl.broadcast_to(xc, wd.shape), tl.broadcast_to(xd, wd.shape)
            bits = tl.inline_asm_elementwise("""{
                .reg .b32 a, b, c, d, sh, h, rs, rm, ra;
                .reg .f16 h0, h1;
                .reg .f32 f0, f1;
                mov.b32 rs, 0x64086408;
                mov.b32 rm, 0x2C002C00;
                mov.b32 ra, 0xD480D480;
                lop3.b32 a, $1, 0x000F000F, 0x64006400, 0xEA;
                lop3.b32 b, $1, 0x00F000F0, 0x64006400, 0xEA;
                shr.u32 sh, $1, 8;
                lop3.b32 c, sh, 0x000F000F, 0x64006400, 0xEA;
                lop3.b32 d, sh, 0x00F000F0, 0x64006400, 0xEA;
                sub.f16x2 a, a, rs;
                fma.rn.f16x2 b, b, rm, ra;
                sub.f16x2 c, c, rs;
                fma.rn.f16x2 d, d, rm, ra;
                mul.f16x2 h, a, $2;
                fma.rn.f16x2 h, b, $3, h;
                fma.rn.f16x2 h, c, $4, h;
                fma.rn.f16x2 h, d, $5, h;
                mov.b32 {h0, h1}, h;
                cvt.f32.f16 f0, h0;
                cvt.f32.f16 f1, h1;
                add.f32 f0, f0, f1;
                mov.b32 $0, f0;
                }""", "=r,r,r,r,r,r", [wd, xa, xb, xc, xd], dtype=tl.int32, is_pure=True, pack=1)
            return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _f16_pair(lo, hi, EMULATE: tl.constexpr):
        """Two fp32 tensors rounded to fp16 and packed into int32 (lo in bits 0..15), the operand layout of a .f16x2
        instruction: one cvt.rn.f16x2.f32 per pair on the GPU, integer ops in the interpreter (the same rounding)."""
        if EMULATE:
            return ((lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
                    | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16))
        else:
            return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r",
                                             [lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True)],
                                             dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _fp8_to_f32_scaled(w):
        """float8 e4m3 -> fp32 by integer ops: the 7 exponent and mantissa bits moved into an fp32's low exponent bits,
        the sign to bit 31: the value times 2^-120, exactly (e4m3 subnormals become fp32 denormals). The caller
        multiplies the sum by 2^120 (FP8_UNBIAS)."""
        wi = w.to(tl.int8, bitcast=True).to(tl.int32)  # sign-extended: bit 31 is the sign
        return ((wi << 20) & -2014314496).to(tl.float32, bitcast=True)  # mask 0x87F00000

    @triton.jit(do_not_specialize=["M", "tiles_per_split", "SPLIT_K"])  # one compile per format and tile shape
    def _gemv_kernel(
            x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, r_ptr, nw_ptr, sq_ptr,
            M, N, K, tiles_per_split, eps,
            sx_m, sw_n, ss_n, ss_g, so_m, sr_m,  # x [M, K] (GLU: [M, 2K]), weight [N, K or K/2], scale/zero
            # [N, K/g] (last strides 1), residual [M, N]; nw: the RMSNorm weight [K]; sq: [SPLIT_K, M] fp32
            SPLIT_K,  # K ranges (1 = no split): a runtime value, so split counts share one compiled kernel
            FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, GLU: tl.constexpr, RESIDUAL: tl.constexpr,
            NORM: tl.constexpr, F16_DOT: tl.constexpr, X_SCALE: tl.constexpr, CVT_BITS: tl.constexpr,
            PDL: tl.constexpr = False,
            TILE_GROUPS: tl.constexpr = 0,  # int4 / int8g one-row: 0 = the group-tiled form; n >= 1 = dequantized
            # per weight, the K tile as n groups (or one group's slice) of BLOCK_K // n weights, reduced after the loop
            HALF2: tl.constexpr = 0,  # int4 one-row words (TILE_GROUPS, CVT_BITS): two weights per instruction in
            # packed fp16 (_int4_half2_word_dot); x scaled by a power of two into fp16's range, 1: per K tile (a
            # max across the program) and zeros per group, 2: per word (the 8 x's of each word, in its threads)
            HALF2_EMULATE: tl.constexpr = False):  # HALF2 in Triton ops instead of PTX (the interpreter runs no PTX)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        mask_n = offs_n < N
        mask_m = offs_m < M
        k_tiles = tl.cdiv(K, BLOCK_K)
        kt_start = pid_k * tiles_per_split
        kt_end = tl.minimum(kt_start + tiles_per_split, k_tiles)
        if PDL:  # dependent launch (kernels/pdl.py): wait for the previous kernel before any load
            gdc_wait()  # nothing above reads what an earlier kernel writes, nothing above writes

        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sq2 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)  # NORM: x^2 per row and lane, summed after the loop
        if FMT != 1 and FMT != 4 and BLOCK_M == 1:
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # GEMV: reduce over K once, after the loop
        if TILE_GROUPS > 0 and FMT == 1 and CVT_BITS:  # [BN, groups of the tile, 32-bit words of a group in the tile]
            acc3 = tl.zeros([BLOCK_N, TILE_GROUPS, BLOCK_K // TILE_GROUPS // 8], dtype=tl.float32)
            if HALF2 == 1:
                accz = tl.zeros([BLOCK_N, TILE_GROUPS], dtype=tl.float32)  # zero x sum(x) per group
        elif TILE_GROUPS > 0 and BLOCK_M == 1:  # [BN, groups of the tile, weights of a group in the tile]: reduced
            # after the loop (M > 1: the dequantized tile goes to tl.dot, into acc)
            acc3 = tl.zeros([BLOCK_N, TILE_GROUPS, BLOCK_K // TILE_GROUPS], dtype=tl.float32)
        for kt in range(kt_start, kt_end):
            offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
            x_mask = mask_m[:, None] & (offs_k < K)[None, :]
            if GLU:  # SwiGLU prologue: x = silu(gate) * up from [gate | up], in fp32, rounded once to x's dtype
                gate = tl.load(x_ptr + offs_m[:, None] * sx_m + offs_k[None, :], mask=x_mask, other=0.0)
                up = tl.load(x_ptr + offs_m[:, None] * sx_m + K + offs_k[None, :], mask=x_mask, other=0.0)
                gate = gate.to(tl.float32)
                x = (gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)  # [BM, BK]
            else:
                x = tl.load(x_ptr + offs_m[:, None] * sx_m + offs_k[None, :], mask=x_mask, other=0.0)  # [BM, BK]
            if NORM:  # RMSNorm prologue: x * norm weight here, x^2 summed for 1 / rms, applied after the sum over K
                xn = x.to(tl.float32)
                sq2 += xn * xn  # reduced once after the loop: a reduction here would put a barrier in every step
                nw = tl.load(nw_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)  # [BK]
                x = (xn * nw[None, :]).to(x_ptr.dtype.element_ty)
            if TILE_GROUPS > 0:  # int4 / int8g one-row, K tiles of whole groups: each weight times its group's scale
                # (the last tile may be partial: its groups past K are masked, scale and zero 0, and so is x)
                offs_g = (kt * BLOCK_K) // GROUP + tl.arange(0, TILE_GROUPS)  # [G]: the tile's groups
                sz_offs = offs_n[:, None] * ss_n + offs_g[None, :] * ss_g  # [BN, G]
                sz_mask = mask_n[:, None] & (offs_g < K // GROUP)[None, :]
                s = tl.load(s_ptr + sz_offs, mask=sz_mask, other=0.0).to(tl.float32)  # [BN, G]
                if FMT == 1:
                    z = tl.load(z_ptr + sz_offs, mask=sz_mask, other=0.0).to(tl.float32)
                if FMT == 1 and CVT_BITS:  # 32-bit words of 8 weights widened by integer ops, x split to match
                    offs_w = kt * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
                    wd = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None] * (sw_n // 4) + offs_w[None, :],
                                 mask=mask_n[:, None] & (offs_w < K // 8)[None, :], other=0)  # [BN, BK / 8]
                    # 2^23's bits as a value the compiler cannot fold (K >> 31 is 0): held in a register, so each
                    # nibble's and-or is one instruction with its mask inline (folded, ptxas re-made a mask per weight)
                    magic = 0x4B000000 + (K >> 31)
                    if HALF2 == 2:  # per word, in the threads that hold it: its 8 x's own power-of-two scale and
                        # their sum (no reduction across threads in the loop), the rest as below
                        f0, f1, f2, f3, f4, f5, f6, f7 = _word_lanes(tl.reshape(
                            x.to(tl.float32), [1, TILE_GROUPS, BLOCK_K // TILE_GROUPS // 8, 2, 2, 2]))
                        amax = tl.maximum(tl.maximum(tl.maximum(tl.abs(f0), tl.abs(f1)),
                                                     tl.maximum(tl.abs(f2), tl.abs(f3))),
                                          tl.maximum(tl.maximum(tl.abs(f4), tl.abs(f5)),
                                                     tl.maximum(tl.abs(f6), tl.abs(f7))))
                        inv, undo = _pow2_scale(amax)  # [1, G, C]
                        dots = _int4_half2_word_dot(
                            tl.reshape(wd, [BLOCK_N, TILE_GROUPS, BLOCK_K // TILE_GROUPS // 8]),
                            _f16_pair(f1 * inv, f5 * inv, HALF2_EMULATE), _f16_pair(f0 * inv, f4 * inv, HALF2_EMULATE),
                            _f16_pair(f3 * inv, f7 * inv, HALF2_EMULATE), _f16_pair(f2 * inv, f6 * inv, HALF2_EMULATE),
                            HALF2_EMULATE)  # [BN, G, C]
                        xsum = ((f0 + f1) + (f2 + f3)) + ((f4 + f5) + (f6 + f7))  # [1, G, C]
                        acc3 += dots * undo * s[:, :, None] + z[:, :, None] * xsum
                    elif HALF2:  # sum (q - 8) x per word in packed fp16, x / 2^e in fp16 (|x| / 2^e < 1: no
                        # overflow in a word's sums of 8 products); then scale 2^e per group and zero sum(x)
                        xf = x.to(tl.float32)  # [1, BK]
                        inv, undo = _pow2_scale(tl.max(tl.abs(xf)))  # one scale for the tile
                        h0, h1, h2, h3, h4, h5, h6, h7 = _word_lanes(tl.reshape(
                            xf * inv, [1, TILE_GROUPS, BLOCK_K // TILE_GROUPS // 8, 2, 2, 2]))
                        dots = _int4_half2_word_dot(
                            tl.reshape(wd, [BLOCK_N, TILE_GROUPS, BLOCK_K // TILE_GROUPS // 8]),
                            _f16_pair(h1, h5, HALF2_EMULATE), _f16_pair(h0, h4, HALF2_EMULATE),
                            _f16_pair(h3, h7, HALF2_EMULATE), _f16_pair(h2, h6, HALF2_EMULATE),
                            HALF2_EMULATE)  # [BN, G, C]
                        acc3 += dots * (s * undo)[:, :, None]
                        accz += z * tl.sum(tl.reshape(xf, [TILE_GROUPS, BLOCK_K // TILE_GROUPS]), axis=1)[None, :]
                    else:
                        acc3 += _int4_words_dot(tl.reshape(wd, [BLOCK_N, TILE_GROUPS, BLOCK_K // TILE_GROUPS // 8]),
                                                s[:, :, None], z[:, :, None],
                                                tl.reshape(x.to(tl.float32), [1, TILE_GROUPS,
                                                                              BLOCK_K // TILE_GROUPS // 8, 2, 2, 2]),
                                                magic)
                else:
                    if FMT == 1:
                        offs_b = kt * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
                        b = tl.load(w_ptr + offs_n[:, None] * sw_n + offs_b[None, :],
                                    mask=mask_n[:, None] & (offs_b < K // 2)[None, :], other=0)
                        qf = tl.interleave(b >> 4, b & 15).to(tl.float32)  # [BN, BK] in 0..15
                    else:
                        q = tl.load(w_ptr + offs_n[:, None] * sw_n + offs_k[None, :],
                                    mask=mask_n[:, None] & (offs_k < K)[None, :], other=0)  # [BN, BK] int8
                        qf = _int8_to_f32(q) if CVT_BITS else q.to(tl.float32)
                    w = tl.reshape(qf, [BLOCK_N, TILE_GROUPS, BLOCK_K // TILE_GROUPS]) * s[:, :, None]  # [BN, G, BK/G]
                    if FMT == 1:  # + zero - 8 scale: one multiply-add per weight
                        w += (z - 8.0 * s)[:, :, None]
                    if BLOCK_M == 1:
                        acc3 += w * tl.reshape(x.to(tl.float32), [1, TILE_GROUPS, BLOCK_K // TILE_GROUPS])
                    else:  # int4 rows of whole groups: the weights rounded once to x's dtype, on the tensor cores
                        acc += tl.dot(x, tl.trans(tl.reshape(w, [BLOCK_N, BLOCK_K]).to(x.dtype)),
                                      input_precision=DOT_PRECISION)
            elif FMT == 1 or FMT == 4:  # int4 / int8g: a tile lies in one group (BLOCK_K divides GROUP; K % GROUP == 0)
                if FMT == 1:
                    offs_b = kt * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
                    b = tl.load(w_ptr + offs_n[:, None] * sw_n + offs_b[None, :], mask=mask_n[:, None], other=0)
                    q = tl.interleave(b >> 4, b & 15)  # [BN, BK] in 0..15: k = 2j high nibble, 2j + 1 low
                else:
                    q = tl.load(w_ptr + offs_n[:, None] * sw_n + offs_k[None, :], mask=mask_n[:, None],
                                other=0)  # [BN, BK] int8
                g = (kt * BLOCK_K) // GROUP
                s = tl.load(s_ptr + offs_n * ss_n + g * ss_g, mask=mask_n, other=0.0).to(tl.float32)  # [BN]
                if FMT == 1:
                    z = tl.load(z_ptr + offs_n * ss_n + g * ss_g, mask=mask_n, other=0.0).to(tl.float32)
                if BLOCK_M == 1:
                    xf = x.to(tl.float32)  # [1, BK]
                    qf = _int8_to_f32(q) if CVT_BITS and FMT == 4 else q.to(tl.float32)
                    t = tl.sum(qf * xf, axis=1)[None, :]  # [1, BN]
                else:
                    xf = x.to(tl.float32)
                    t = tl.dot(x, tl.trans(q.to(tl.float32).to(x.dtype)), input_precision=DOT_PRECISION)  # [BM, BN]
                if FMT == 1:
                    x_sum = tl.sum(xf, axis=1)  # [BM]
                    acc += t * s[None, :] + x_sum[:, None] * (z - 8.0 * s)[None, :]
                else:
                    acc += t * s[None, :]
            else:  # int8 / fp8 / dense: raw values, the channel scale (not dense) after the loop
                w = tl.load(w_ptr + offs_n[:, None] * sw_n + offs_k[None, :],
                            mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)  # [BN, BK]
                if BLOCK_M == 1:
                    if CVT_BITS and FMT == 2:
                        wf = _fp8_to_f32_scaled(w)
                    elif CVT_BITS and FMT == 0:
                        wf = _int8_to_f32(w)
                    else:
                        wf = w.to(tl.float32)
                    acc2 += wf * x.to(tl.float32)
                elif F16_DOT:  # int8 / fp8 with 16-bit x: both operands fp16 (one conversion per weight, exact),
                    # x scaled by X_SCALE (a power of two, undone after the loop) so bf16 activations fit fp16's range
                    xh = (x.to(tl.float32) * X_SCALE).to(tl.float16)
                    acc += tl.dot(xh, tl.trans(w.to(tl.float16)), out_dtype=tl.float32)
                elif FMT == 3:  # dense: the weight is already in x's dtype
                    acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
                else:
                    # widened through fp32: exact, and the interpreter's direct int8 -> bf16 cast reinterprets bits
                    acc += tl.dot(x, tl.trans(w.to(tl.float32).to(x.dtype)), input_precision=DOT_PRECISION)
        if PDL:  # this program's weights are read: the next kernel may take the SM slots we free
            gdc_launch_dependents()
        sq = tl.sum(sq2, axis=1)  # [BM]: this split's sum of x^2 per row (NORM)
        if TILE_GROUPS > 0 and BLOCK_M == 1:
            acc = tl.sum(tl.sum(acc3, axis=2), axis=1)[None, :]
            if FMT == 1 and CVT_BITS and HALF2 == 1:
                acc += tl.sum(accz, axis=1)[None, :]
        if FMT != 1 and FMT != 4:
            if BLOCK_M == 1:
                acc = tl.sum(acc2, axis=1)[None, :]
                if CVT_BITS and FMT == 2:
                    acc = acc * 1.329227995784916e+36  # 2^120 (FP8_UNBIAS), exact
            if F16_DOT and BLOCK_M > 1:
                acc = acc * (1.0 / X_SCALE)
            if FMT != 3:
                acc = acc * tl.load(s_ptr + offs_n * ss_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]

        out_ptrs = out_ptr + offs_m[:, None] * so_m + offs_n[None, :]
        out_mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            if NORM:
                acc = acc * (1.0 / tl.sqrt_rn(sq / K + eps))[:, None]
            if RESIDUAL:  # epilogue: out = x W^T + residual, one rounding
                acc += tl.load(r_ptr + offs_m[:, None] * sr_m + offs_n[None, :], mask=out_mask, other=0.0).to(
                    tl.float32)
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            part = part_ptr + offs_m[:, None] * N + offs_n[None, :]  # partials [SPLIT_K, M, N] fp32
            tl.store(part + pid_k * M * N, acc, mask=out_mask)
            if NORM:  # every N tile of this split stores the same sums (the same x range): a benign race
                tl.store(sq_ptr + pid_k * M + offs_m, sq, mask=mask_m)
            tl.debug_barrier()  # every thread's partial is written before the counter says so
            tile = pid_m * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last split of this tile: add them all up
                total, sq_all = sum_splits(part, sq_ptr, offs_m, mask_m, out_mask, M, N, SPLIT_K,
                                           tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                                           tl.zeros([BLOCK_M], dtype=tl.float32), NORM)
                if NORM:
                    total = total * (1.0 / tl.sqrt_rn(sq_all / K + eps))[:, None]
                if RESIDUAL:
                    total += tl.load(r_ptr + offs_m[:, None] * sr_m + offs_n[None, :], mask=out_mask,
                                     other=0.0).to(tl.float32)
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call


def quant_gemv_triton(x: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
                      zero: torch.Tensor | None = None, group_size: int | None = None,
                      counters: torch.Tensor | None = None, *, glu: bool = False,
                      residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                      eps: float = 1e-6, glu_out: bool = False, norm_unit: bool = False,
                      tuning: KernelTuning | str | None = None, **override) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) -> [M, N] in x's dtype, through the Triton kernel. `counters`: a persistent
    `counters_for(N, device)` buffer (zero between calls; allocated here when None, which a captured graph would
    re-zero on every replay: pass one). `override`: entries of `gemv_config` (a benchmark's sweep).
    glu: x is [M, 2K] = [gate | up] and the kernel multiplies silu(gate) * up (a SwiGLU MLP's down projection, with
    no separate SiLU-mul kernel before it); residual [M, N]: added to the output in the epilogue (no add kernel after);
    norm_weight [K]: an RMSNorm (HF LlamaRMSNorm, `eps`) of x in the prologue (no norm kernel before it).
    glu_out: the weight's rows are [gate | up] (a SwiGLU MLP's gate/up projection) and the result is silu(gate) * up
    [M, N / 2], gate and up rounded to x's type first: in the epilogue of the one-row CUDA GEMV where it takes the
    call (int4, `int4_cuda.glu_out_takes`), else by PyTorch ops after the full output (no residual with it).
    norm_unit: norm_weight is all ones (the norm's weight folded into this weight at quantization), so the one-row
    CUDA GEMV skips reading it; every other path multiplies by the ones as given.
    tuning: the run's KernelTuning (kernels/tuning.py; None: the defaults), which picks among the int4 paths.

    Without `override` the launch goes through the custom op `torch.ops.workbench.quant_gemv`, which torch.compile
    treats as one opaque call (its output shape from a fake implementation): the model around a quantized linear
    still compiles and fuses (norms, RoPE, residual adds) instead of breaking the graph at each Triton launch."""
    check_gemv(fmt, x, weight, scale, zero, group_size, glu, residual, norm_weight, glu_out)
    if counters is None:
        counters = counters_for(weight.shape[0], x.device)
    if override:
        return _launch(x, fmt, weight, scale, zero, group_size, counters, glu, residual, norm_weight, eps, glu_out,
                       norm_unit, as_tuning(tuning), **override)
    text = tuning.text if isinstance(tuning, KernelTuning) else tuning or ""  # (traceable: no parsing here)
    return torch.ops.workbench.quant_gemv(x, fmt, weight, scale, zero, group_size or 0, counters, glu, residual,
                                          norm_weight, eps, glu_out, norm_unit, text)


# `counters` is not declared mutated: the split-K programs bump it and the last one resets it, so it holds zeros
# before and after every call (no value the graph can observe changes); declaring it would make torch.compile clone
# the buffer around each call (one more kernel per linear, the very cost this op exists to avoid).
@torch.library.custom_op("workbench::quant_gemv", mutates_args=())
def _quant_gemv_op(x: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None,
                   zero: torch.Tensor | None, group_size: int, counters: torch.Tensor, glu: bool = False,
                   residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                   eps: float = 1e-6, glu_out: bool = False, norm_unit: bool = False,
                   tuning: str = "") -> torch.Tensor:
    # counters: bumped by the split-K programs and reset to zero by the last one (zero again after every call);
    # tuning: the KernelTuning as text (a custom op takes no records; parsed once per text)
    return _launch(x, fmt, weight, scale, zero, group_size or None, counters, glu, residual, norm_weight, eps, glu_out,
                   norm_unit, as_tuning(tuning))


@_quant_gemv_op.register_fake
def _(x, fmt, weight, scale, zero, group_size, counters, glu=False, residual=None, norm_weight=None, eps=1e-6,
      glu_out=False, norm_unit=False, tuning=""):
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if glu_out else weight.shape[0])


def int4_mma_takes(x, scale, zero, group_size, mma_rows: int = KernelTuning.int4_mma_rows) -> bool:
    """Whether kernels/int4_mma.py takes this int4 call: 2..mma_rows (KernelTuning.int4_mma_rows) rows of 16-bit x,
    scales and zeros in its dtype, groups of 64+ in multiples of 16 (the rest stay here). The one rule for the dispatch
    below and for the linears that leave their prologues to PyTorch there (linears.Int4Linear._mma_call)."""
    return 1 < x.shape[0] <= mma_rows and x.dtype in (torch.bfloat16, torch.float16) \
        and scale.dtype == x.dtype and zero.dtype == x.dtype and group_size % 16 == 0 and group_size >= 64


def _launch(x, fmt, weight, scale, zero, group_size, counters, glu=False, residual=None, norm_weight=None, eps=1e-6,
            glu_out=False, norm_unit=False, tuning: KernelTuning = KernelTuning(), **override) -> torch.Tensor:
    x = x.contiguous()
    m, k = x.shape
    k = k // 2 if glu else k
    n = weight.shape[0]
    if fmt == "int4" and not override and m == 1 and tuning.int4_cuda:  # needs no triton
        if int4_cuda.device_problem(x.device) is None and int4_cuda.int4_cuda_takes(x, weight, scale, zero,
                                                                                      group_size, glu) \
                and (not glu_out or int4_cuda.glu_out_takes(n, k)):
            try:
                return int4_cuda.launch_taken(x, weight, scale, zero, group_size, glu=glu, residual=residual,
                                              norm_weight=norm_weight, eps=eps, pdl=use_pdl(x.device),
                                              glu_out=glu_out, norm_unit=norm_unit)
            except int4_cuda.Int4CudaBuildError as e:  # nothing ran: this device stays in the Triton GEMV below
                int4_cuda.mark_failed(x.device, e)
    if glu_out:  # not in the CUDA epilogue: the full [gate | up] output, then SwiGLU of its rounded halves
        gate, up = _launch(x, fmt, weight, scale, zero, group_size, counters, glu, residual, norm_weight, eps,
                           tuning=tuning, **override).float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)
    if not TRITON_AVAILABLE:
        raise GemvError("quant_kernel 'triton' needs the triton package (a CUDA build of torch ships it): "
                        "choose quant_kernel 'dequant' or 'aten'")
    if fmt == "int4" and not override and int4_mma_takes(x, scale, zero, group_size, tuning.int4_mma_rows):
        return int4_mma.int4_mma_gemv(x, weight, scale, zero, group_size, counters, glu=glu, residual=residual,
                             norm_weight=norm_weight, eps=eps, pdl=use_pdl(x.device))
    sm = _sm_count(x.device.index if x.device.index is not None else 0) if x.is_cuda else 132
    cfg = _cached_config(fmt, m, n, k, group_size, sm, _frozen(override), tuning.int4_half2)
    tile_groups = 0  # grouped formats: the group-tiled form, or the ELEMENTWISE one with this many groups per K tile
    if fmt in GROUPED and cfg.get("ELEMENTWISE", cfg["BLOCK_K"] > group_size):
        tile_groups = max(1, cfg["BLOCK_K"] // group_size)
    cvt_bits = cfg.get("CVT_BITS", fmt in CVT_BITS_FORMATS) and not (tile_groups and cfg["BLOCK_M"] > 1)  # the
    # widened words are a one-row form: multi-row tiles of whole groups dequantize per weight for tl.dot
    half2 = int(cfg.get("HALF2") or 0) if fmt == "int4" and tile_groups > 0 and cvt_bits \
        and x.dtype in (torch.bfloat16, torch.float16) else 0
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (math.ceil(n / cfg["BLOCK_N"]), math.ceil(m / cfg["BLOCK_M"]), cfg["SPLIT_K"])
    # the same pointer types whatever the split (one compiled kernel); with one split neither buffer is touched
    partials = torch.empty(cfg["SPLIT_K"] if cfg["SPLIT_K"] > 1 else 1, m if cfg["SPLIT_K"] > 1 else 1,
                           n if cfg["SPLIT_K"] > 1 else 1, dtype=torch.float32, device=x.device)
    if cfg["SPLIT_K"] > 1 and counters.numel() < grid[0] * grid[1]:
        counters = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    scale2 = scale.reshape(n, -1) if scale is not None else weight[:, :1]  # dense: never read
    zero2 = zero if zero is not None else scale2
    res = residual.contiguous() if residual is not None else out  # never read without RESIDUAL
    norm = norm_weight is not None
    nw = norm_weight.contiguous() if norm else out  # never read without NORM
    sq = torch.empty(cfg["SPLIT_K"], m, dtype=torch.float32, device=x.device) if norm and cfg["SPLIT_K"] > 1 \
        else partials
    f16_dot = cfg.get("F16_DOT", fmt in F16_DOT_FORMATS) and x.dtype != torch.float32 and fmt in ("int8", "fp8")
    pdl = {}
    if use_pdl(x.device):  # kernels/pdl.py
        pdl = dict(PDL=True, launch_pdl=True)
    _gemv_kernel[grid](
        x, weight, scale2, zero2, out, partials, counters, res, nw, sq,
        m, n, k, cfg["tiles_per_split"], float(eps),
        x.stride(0), weight.stride(0), scale2.stride(0), scale2.stride(1) if scale2.shape[1] > 1 else 0, out.stride(0),
        res.stride(0),
        cfg["SPLIT_K"], FMT=_FMT_CODE[fmt], GROUP=group_size or 1, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GLU=glu, RESIDUAL=residual is not None,
        NORM=norm, F16_DOT=f16_dot, X_SCALE=X_SCALE_BF16 if x.dtype == torch.bfloat16 else 1.0,
        CVT_BITS=cvt_bits, TILE_GROUPS=tile_groups, HALF2=half2,
        HALF2_EMULATE=bool(half2) and os.environ.get("TRITON_INTERPRET", "0") == "1",  # interpreter: emulated
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl)
    return out


def triton_problem(device: torch.device | str) -> str | None:
    """Why the Triton GEMV cannot run on `device`; None when it can."""
    device = torch.device(device)
    if not TRITON_AVAILABLE:
        return "triton is not installed (pip install triton; it comes with CUDA builds of torch)"
    if device.type != "cuda":
        return f"the Triton kernels run on a CUDA GPU; this run is on {device.type}: use quant_kernel auto or dequant"
    return None
