"""Quantized replacements for `nn.Linear`, each beside the reference math its kernel must match.

Every format stores the weight `[N, K]` (out x in features) in fewer bytes and dequantizes it by a rule stated here;
the tests compare each module's output with `x @ dequantize(...).T` (error bounds in tests/test_quant.py):

    format  stored weight                                   dequantized weight                     matmul kernel
    int8    q int8 [N, K], scale [N] (model dtype)          q * scale[n]            (per channel)  aten._weight_int8pack_mm
    int4    q in 0..15 packed, scale/zero [K/g, N]          (q - 8) * scale + zero  (per group g)  aten._weight_int4pack_mm
                                                                                                   (_for_cpu on a CPU)
    (int8 and int4 also have kernel "dequant": dequantize with PyTorch ops, then one matmul; the default on a CPU)
    fp8     q float8_e4m3fn [N, K], scale [N] fp32          q * scale[n]            (per channel)  torch._scaled_mm

Unquantized ("none") with kernel "triton": `DenseGemvLinear` keeps the model-dtype weight (shared, not copied) and sends
one-row calls to the same GEMV kernel (format "dense"): one launch per call with its split-K reduction inside, where
cuBLAS at M = 1 may add a separate reduction kernel; larger calls take F.linear (cuBLAS).

Kernel "triton" (every format; CUDA): kernels/quant_gemv.py, a weight-only GEMV that widens the stored weight in
registers, for calls of at most GEMV_MAX_ROWS rows (decode and verify); larger calls (prefill) take the "dequant"
form from the same buffers. int4 then keeps the "dequant" packing ([N, K/2], two nibbles per byte), not tinygemm's.
fp8 with "triton" or "dequant" is weight-only too: activations stay in the model dtype (x @ dequantize(q).T), a
different (more accurate) model than the `_scaled_mm` path, which quantizes activations per token.

int8 and int4 are weight-only: activations stay in the model dtype. fp8 also quantizes the activations, per token
(row) and on the fly (`_scaled_mm` multiplies two fp8 operands): amax / 448 as each row's scale, computed on the
device. Scales are rounded to the dtype they are stored in *before* the weight is rounded against them, so the stored
(q, scale) pair is exactly what `dequantize` reads. (AWQ's per-input-channel factors need no module of their own:
`workbench.engine.quant.awq` folds them into the preceding RMSNorm or projection rows before quantizing.)

No forward reads a tensor value on the host or branches on one: every module runs inside the engine's captured
fixed-shape steps and under torch.compile. The packed int4 layout depends on the device (CUDA tinygemm vs the CPU
kernel), so a quantized module stays on the device it was built on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import int4_cuda, quant_gemv
from kernels.int4_dequant import int4_dequant_reference, int4_dequant_triton
from kernels.quant_gemv import counters_for, quant_gemv_triton
from kernels.tuning import KernelTuning

FP8_DTYPE = torch.float8_e4m3fn
GEMV_MAX_ROWS = 16  # kernel "triton": calls with more rows than this (prefill) take the "dequant" form
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
from workbench.choices import INT4_GROUP_SIZES  # noqa: E402 - what the int4pack kernels accept, declared once


# ---- reference math (pure PyTorch, any device) -----------------------------------------------------------------
def quantize_int8(w: Tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (q [N, K] int8 in -127..127, scale [N] in scale_dtype) with w ~ q * scale (symmetric, per row).

    >>> q, s = quantize_int8(torch.tensor([[0.5, -1.0], [2.0, 0.0]]), torch.float32)
    >>> q.tolist(), [round(v, 5) for v in s.tolist()]
    ([[64, -127], [127, 0]], [0.00787, 0.01575])
    """
    w = w.float()
    scale = (w.abs().amax(dim=1).clamp(min=1e-8) / 127).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale.float()[:, None]  # [N, K] fp32


def quantize_int4(w: Tensor, group_size: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """w [N, K] -> (q [N, K] int32 in 0..15, scale [N, K/g], zero [N, K/g]) with, per group of g input channels,
    w ~ (q - 8) * scale + zero (asymmetric min-max: the group's min and max are representable up to rounding).

    >>> q, s, z = quantize_int4(torch.tensor([[0.0, 1.0, 2.0, 3.0] * 8]), 32, torch.float32)
    >>> q[0, :4].tolist(), round(float(s[0, 0]), 4), round(float(z[0, 0]), 4)
    ([0, 5, 10, 15], 0.2, 1.6)
    """
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo).clamp(min=1e-6) / 15).to(scale_dtype).float()
    zero = (lo + 8 * scale).to(scale_dtype).float()
    q = torch.round((wg - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scale.to(scale_dtype), zero.to(scale_dtype)


def dequantize_int4(q: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    n, k = q.shape
    groups = scale.shape[1]
    qg = q.float().reshape(n, groups, k // groups)
    return ((qg - 8) * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)  # [N, K] fp32


def quantize_fp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (q [N, K] float8_e4m3fn, scale [N] fp32), w ~ q * scale; each row's amax maps to 448."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale.float()[:, None]


def quantize_fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32): the activation side of the fp8 matmul (per token)."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear_reference(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """What `Fp8Linear` computes, in fp32 from dequantized operands: x [..., K] -> [..., N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8_rows(x2)
    out = (xq.float() * xs) @ dequantize_fp8(q, scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


def int4_inner_k_tiles(k: int) -> int:
    """tinygemm's K tiling: the largest of 8, 4, 2 with K % (tiles * 16) == 0 (K is a multiple of the group, >= 32)."""
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)


def pack_int4(q: Tensor, inner_k_tiles: int) -> Tensor:
    """q [N, K] int32 in 0..15 -> the kernel's packed layout on q's device (CUDA: from two nibbles per byte)."""
    if q.is_cuda:
        return torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), inner_k_tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), inner_k_tiles)


# ---- modules ---------------------------------------------------------------------------------------------------
class QuantLinear(nn.Module):
    """Base of the quantized linears: `forward(x [..., K]) -> [..., N]` in x's dtype; buffers hold the weight."""

    fmt = "?"
    # Whether the RMSNorm before this linear has an all-ones weight because quantize_model folded it into this weight
    # (quant.fold_norms, int4): the fused norm prologue of the one-row CUDA GEMV then skips reading it
    norm_unit = False
    tuning: KernelTuning = KernelTuning()  # the run's kernel variants (set per engine: quant.apply_kernel_tuning)

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)  # [N]

    def _flat(self, x: Tensor) -> Tensor:
        return x.reshape(-1, self.in_features)  # [M, K]

    def _use_gemv(self, x2: Tensor) -> bool:
        """Kernel "triton" and a decode-sized call (a shape test: the same answer on every replay of a graph)."""
        return self.kernel == "triton" and x2.shape[0] <= GEMV_MAX_ROWS

    def _add_counters(self, kernel: str, device: torch.device) -> None:
        if kernel == "triton":  # the split-K kernel's per-tile counters: persistent and zero between calls
            self.register_buffer("gemv_counters", counters_for(self.out_features, device), persistent=False)

    def _gemv_args(self) -> tuple[str, dict]:
        """(kernel format, buffers) for kernels/quant_gemv.py."""
        return self.fmt, dict(weight=self.weight, scale=self.scale)

    # What a Triton-GEMV linear fuses at its edges, a "+"-joined set (or "off"):
    #   "residual": a SwiGLU down projection's residual add in its epilogue (`glu_residual`; SiLU-mul left to
    #               PyTorch / torch.compile);
    #   "glu":      also the SiLU-mul in the down projection's prologue;
    #   "norm":     the layer's RMSNorms in the q/k/v and gate/up projections' prologue (`norm_linear`) and the
    #               attention's residual add in o_proj's epilogue (`residual_linear`), so no norm or add kernel is
    #               left between a layer's GEMVs.
    #   "ores":     only the attention's residual add in o_proj's epilogue (`residual_linear`), the norms left to
    #               PyTorch / torch.compile (at 6.7 B the norm prologue slowed the dense GEMVs more than it saved).
    # Measured on the H200 (6.7 B, batch 1, one process): "residual" made fp8 decode 1.3 %
    # (compile) / 3.1 % (max-autotune) faster and the dense GEMV 1.0 % (compile); "glu+residual" was neutral for fp8
    # and 2 % faster for the dense GEMV; "norm+glu+residual" 3.8-5.4 % faster for fp8 at 6.7 B but 2-5 %
    # slower for the dense GEMV and at 1.45 B. Benchmarks set it per module (gpu_quant.py "+res", "+glu", "+norm",
    # "+all").
    fusion = "residual"

    def _fuses(self, part: str, x2: Tensor) -> bool:
        return part in self.fusion.split("+") and self.bias is None and self._use_gemv(x2)

    def _fuses_prologue(self, part: str, x2: Tensor) -> bool:
        """_fuses for the prologues ("norm", "glu"), which calls on the tensor-core int4 kernel leave to PyTorch /
        torch.compile (`_mma_call`)."""
        return self._fuses(part, x2) and not self._mma_call(x2)

    def _mma_call(self, x2: Tensor) -> bool:
        """Whether this call goes to kernels/int4_mma.py (int4 verify widths, KernelTuning.int4_mma_rows). Its RMSNorm
        and SwiGLU prologues run on all 16 padded rows in every program (measured slower than leaving the norms and
        SiLU-mul to torch.compile), so there they are not fused."""
        return False

    def glu_residual(self, h: Tensor, residual: Tensor, swiglu_done: bool = False) -> Tensor | None:
        """As a SwiGLU down projection: residual + self(silu(gate) * up), h = [gate | up] [..., 2K], fused into the
        GEMV as `fusion` says; None when fusion has no "residual" or this call does not take the kernel (the caller
        then runs the unfused ops). swiglu_done: h is silu(gate) * up already [..., K] (`swiglu_linear`)."""
        h2 = h.reshape(-1, h.shape[-1])
        if not self._fuses("residual", h2):
            return None
        fmt, buffers = self._gemv_args()
        glu = not swiglu_done and self._fuses_prologue("glu", h2)
        if not glu and not swiglu_done:
            gate, up = h2.chunk(2, dim=-1)
            h2 = F.silu(gate) * up
        y = quant_gemv_triton(h2, fmt, **buffers, counters=self.gemv_counters, glu=glu,
                              residual=residual.reshape(-1, self.out_features), tuning=self.tuning)
        return y.reshape(residual.shape)

    def norm_linear(self, x: Tensor, norm_weight: Tensor, eps: float) -> Tensor | None:
        """self(rms_norm(x) * norm_weight) [..., N] with the RMSNorm in the GEMV's prologue (1 / rms applied to the
        product in fp32: rounds differently from the separate norm, within bf16's near-ties); None when fusion has no
        "norm" or this call does not take the kernel."""
        x2 = self._flat(x)
        if not self._fuses_prologue("norm", x2):
            return None
        fmt, buffers = self._gemv_args()
        y = quant_gemv_triton(x2, fmt, **buffers, counters=self.gemv_counters, norm_weight=norm_weight, eps=eps,
                              norm_unit=self.norm_unit, tuning=self.tuning)
        return y.reshape(*x.shape[:-1], self.out_features)

    def swiglu_linear(self, x: Tensor, norm_weight: Tensor | None = None, eps: float = 1e-6) -> Tensor | None:
        """silu(gate) * up [..., N / 2] of this gate/up projection (rows [gate | up]) in one launch, the SwiGLU in the
        GEMV's epilogue (and with norm_weight the RMSNorm in its prologue); None where that does not apply (the
        caller then runs `norm_linear` / the module and the down projection's SwiGLU). Int4Linear only."""
        return None

    def residual_linear(self, x: Tensor, residual: Tensor) -> Tensor | None:
        """residual + self(x) with the add in the GEMV's epilogue (an attention's o_proj, when fusion has "norm" or
        "ores"); None otherwise."""
        x2 = self._flat(x)
        if not (self._fuses("norm", x2) or self._fuses("ores", x2)):
            return None
        fmt, buffers = self._gemv_args()
        y = quant_gemv_triton(x2, fmt, **buffers, counters=self.gemv_counters,
                              residual=residual.reshape(-1, self.out_features), tuning=self.tuning)
        return y.reshape(residual.shape)

    def _out(self, y: Tensor, x: Tensor) -> Tensor:
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> Tensor:
        """[N, K] fp32: the weight this module multiplies by."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"


class Int8Linear(QuantLinear):
    """Weight-only int8, one scale per output channel. `kernel` "triton": kernels/quant_gemv.py up to GEMV_MAX_ROWS
    rows, else "dequant"; "aten" uses aten._weight_int8pack_mm; "dequant"
    computes linear(x, q.to(dtype)) * scale, which torch.compile can fuse into one kernel (gpt-fast's form; the CPU
    default: this torch's CPU int8pack kernel is 3-80x slower than it here, see README)."""

    fmt = "int8"

    def __init__(self, linear: nn.Linear, kernel: str = "aten") -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        q, scale = quantize_int8(linear.weight, linear.weight.dtype)
        self.register_buffer("weight", q)  # [N, K] int8
        self.register_buffer("scale", scale)  # [N] model dtype
        self.kernel = kernel
        self._add_counters(kernel, q.device)

    def forward(self, x: Tensor) -> Tensor:
        x2 = self._flat(x)
        if self._use_gemv(x2):
            y = quant_gemv_triton(x2, "int8", self.weight, self.scale, counters=self.gemv_counters, tuning=self.tuning)
        elif self.kernel in ("dequant", "triton"):
            y = F.linear(x2, self.weight.to(x2.dtype)) * self.scale
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scale)
        return self._out(y, x)

    def dequantized_weight(self) -> Tensor:
        return dequantize_int8(self.weight, self.scale)


class Int4Linear(QuantLinear):
    """Weight-only int4 in groups of `group_size` input channels (asymmetric: a scale and a zero per group).
    `kernel` "triton": kernels/quant_gemv.py on the "dequant" packing (up to GEMV_MAX_ROWS rows, else "dequant");
    "aten": the weight packed for aten._weight_int4pack_mm (CUDA tinygemm) / _for_cpu; "dequant": two
    nibbles per byte [N, K/2] unpacked and dequantized by PyTorch ops each call, then one matmul (the CPU default:
    this torch's CPU int4pack kernel is 13x slower than an fp32 matmul at one row and 100x at 256, see README)."""

    fmt = "int4"

    def __init__(self, linear: nn.Linear, group_size: int, kernel: str = "aten") -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        dtype = linear.weight.dtype
        q, scale, zero = quantize_int4(linear.weight, group_size, dtype)
        self.group_size, self.kernel = group_size, kernel
        self._add_counters(kernel, q.device)
        # the one-row CUDA GEMV can run this module's calls (decided here, on the host: `swiglu_linear` reads it
        # under torch.compile, where the device checks would break the graph)
        self.cuda_gemv_ok = kernel == "triton" and q.device.type == "cuda" \
            and int4_cuda.device_problem(q.device) is None
        if kernel in ("dequant", "triton"):
            self.register_buffer("weight", (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8))  # [N, K/2]
            self.register_buffer("scale", scale)  # [N, K/g]
            self.register_buffer("zero", zero)  # [N, K/g]
        else:
            self.register_buffer("weight", pack_int4(q, int4_inner_k_tiles(linear.in_features)))  # kernel layout
            # [K/g, N, 2]: the kernels' layout of (scale, zero)
            self.register_buffer("scales_and_zeros", torch.stack([scale.t(), zero.t()], dim=-1).contiguous())

    def forward(self, x: Tensor) -> Tensor:
        x2 = self._flat(x)
        if self._use_gemv(x2) or (self.kernel == "triton" and x2.shape[0] <= self.tuning.int4_prefill_gemm_rows):
            y = quant_gemv_triton(x2, "int4", self.weight, self.scale, self.zero, self.group_size,
                                  counters=self.gemv_counters, tuning=self.tuning)
        elif self.kernel in ("dequant", "triton"):
            dequant = int4_dequant_triton if self.kernel == "triton" else int4_dequant_reference
            y = F.linear(x2, dequant(self.weight, self.scale, self.zero, self.group_size).to(x2.dtype))
        elif self.weight.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.weight, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, self.group_size, self.scales_and_zeros)
        return self._out(y, x)

    def _gemv_args(self) -> tuple[str, dict]:
        return "int4", dict(weight=self.weight, scale=self.scale, zero=self.zero, group_size=self.group_size)

    def _mma_call(self, x2: Tensor) -> bool:
        return self.kernel == "triton" and quant_gemv.int4_mma_takes(x2, self.scale, self.zero, self.group_size,
                                                                     self.tuning.int4_mma_rows)

    def swiglu_linear(self, x: Tensor, norm_weight: Tensor | None = None, eps: float = 1e-6) -> Tensor | None:
        x2 = self._flat(x)
        if not (self.tuning.int4_cuda and getattr(self, "cuda_gemv_ok", False)
                and x2.shape[0] == 1 and x2.dtype in (torch.bfloat16, torch.float16) and self._fuses("glu", x2)
                and (norm_weight is None or self._fuses("norm", x2))
                and int4_cuda.glu_out_takes(self.out_features, self.in_features)):
            return None
        y = quant_gemv_triton(x2, "int4", self.weight, self.scale, self.zero, self.group_size,
                              counters=self.gemv_counters, norm_weight=norm_weight, eps=eps, glu_out=True,
                              tuning=self.tuning,
                              norm_unit=self.norm_unit and norm_weight is not None)
        return y.reshape(*x.shape[:-1], self.out_features // 2)

    def dequantized_weight(self) -> Tensor:
        """Recovered through the module itself by multiplying the identity (the kernel's own unpacking)."""
        dtype = self.scale.dtype if self.kernel in ("dequant", "triton") else self.scales_and_zeros.dtype
        eye = torch.eye(self.in_features, dtype=dtype, device=self.weight.device)
        saved_bias, self.bias = self.bias, None
        try:
            return self.forward(eye).float().T.contiguous()  # [N, K]
        finally:
            self.bias = saved_bias


class Fp8Linear(QuantLinear):
    """fp8 e4m3 weights (per output channel). `kernel` "aten" (the default): x fp8 activations (per token, quantized
    on the fly), torch._scaled_mm with row-wise scales; the product comes out in the input's dtype (bfloat16 on a
    GPU). "triton" / "dequant": weight-only (activations stay in their dtype): kernels/quant_gemv.py up to
    GEMV_MAX_ROWS rows, else linear(x, q.to(dtype)) * scale."""

    fmt = "fp8"

    def __init__(self, linear: nn.Linear, kernel: str = "aten") -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        q, scale = quantize_fp8(linear.weight)
        self.register_buffer("weight", q)  # [N, K] float8_e4m3fn
        self.register_buffer("scale", scale[None, :].contiguous())  # [1, N] fp32 (row-wise scale_b)
        self.kernel = kernel
        self._add_counters(kernel, q.device)

    def forward(self, x: Tensor) -> Tensor:
        x2 = self._flat(x)
        if self._use_gemv(x2):
            return self._out(quant_gemv_triton(x2, "fp8", self.weight, self.scale, counters=self.gemv_counters,
                                               tuning=self.tuning), x)
        if self.kernel in ("dequant", "triton"):
            return self._out((F.linear(x2, self.weight.to(x2.dtype)) * self.scale).to(x2.dtype), x)
        xq, xs = quantize_fp8_rows(x2)  # [M, K] fp8, [M, 1] fp32
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.scale, out_dtype=x.dtype)
        return self._out(y, x)

    def dequantized_weight(self) -> Tensor:
        return dequantize_fp8(self.weight, self.scale[0])


class DenseGemvLinear(QuantLinear):
    """An unquantized linear (bf16 / fp16) whose one-row calls (batch-1 decode) run kernels/quant_gemv.py's "dense"
    GEMV and larger ones F.linear (cuBLAS); the weight is the original linear's parameter (shared, not copied)."""

    fmt = "none"

    def __init__(self, linear: nn.Linear, kernel: str = "triton") -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        self.weight = linear.weight  # [N, K] model dtype, the same Parameter
        self.kernel = kernel
        self._add_counters(kernel, linear.weight.device)

    def _use_gemv(self, x2: Tensor) -> bool:
        """One row only: at verify widths the dense kernel's tile forms measured slower than cuBLAS on the H200 (at
        M = 1 the swept tiles are 1.04-1.11x faster), so verify widths keep cuBLAS."""
        return self.kernel == "triton" and x2.shape[0] == 1

    def forward(self, x: Tensor) -> Tensor:
        x2 = self._flat(x)
        if self._use_gemv(x2):
            return self._out(quant_gemv_triton(x2, "dense", self.weight, counters=self.gemv_counters,
                                               tuning=self.tuning), x)
        return self._out(F.linear(x2, self.weight), x)

    def _gemv_args(self) -> tuple[str, dict]:
        return "dense", dict(weight=self.weight)

    def dequantized_weight(self) -> Tensor:
        return self.weight.float()
