"""GGUF files keep their own blocks: Q4_0 / Q4_1 decoder linears become `Int4Linear`s (group 32) and Q8_0 ones
`GgufInt8Linear`s (int8, a scale per group of 32), exactly.

    qmodel = quantize_model(model, "gguf", kernel="auto")   # `model` as load_model read it from a .gguf (float)
    qmodel.gguf_packing.note()    # which GGUF tensors were kept packed and which dequantized, by type

ggml's blocks (ggml-quants.c), 32 weights each, d and m stored as float16; in Q4_x byte j of the 16 quant bytes holds
q_j in its low nibble and q_(j+16) in its high nibble:

    type   block bytes                     weight                 ours
    Q4_0   d [2], q [16]                   w = d (q - 8)          int4 (linears.py: w = (q - 8) s + z): s = d, z = 0
    Q4_1   d [2], m [2], q [16]            w = d q + m            int4: s = d, z = m + 8 d
    Q8_0   d [2], q [32] int8              w = d q                int8g (kernels/quant_gemv.py: w = q s): s = d

Exactness: s and z are kept in float32, not the model dtype. d and m (float16) are exact in float32, so is (q - 8) d
(an 11-bit times a 4-bit integer), and so is m + 8 d whenever its bits fit float32's 24 (checked per tensor; a tensor
where one does not is dequantized instead). Then the one float32 rounding of (q - 8) s + z gives d q + m rounded
once, which is what the gguf package's own dequantize computes: the "dequant" kernel multiplies by the file's
weights bit for bit. Q8_0's d q (11 bits times 8) is exact in float32 outright. In bf16 / fp16 that weight is then
rounded to the activation dtype, the same value the dequantized model (loaded in float32, then cast) holds.

Kernels: "dequant" (any device: unpack, dequantize in float32, cast to x's dtype, one matmul) and "triton" (CUDA:
kernels/quant_gemv.py formats "int4" / "int8g", which load scales as float32 and tile K by min(128, group) = 32, for
calls of <= 16 rows; "dequant" above). Not "aten": tinygemm takes bf16 scales_and_zeros, and rounding d and m + 8 d
to bf16 changes the weights (that is weight format int4 with group 32, a re-quantization, not the file's model);
aten's int8 op has one scale per channel.

What is kept: a decoder linear (qkv_proj, o_proj, gate_up_proj, down_proj; q/k/v and gate/up are fused along rows)
whose GGUF tensors are all Q4_0 / Q4_1 (-> int4) or all Q8_0 (-> int8g). Every other decoder linear (K-quants, IQ*,
Q5_*, F16/F32, or a fused linear whose parts mix a kept type with another, Q4_x beside Q8_0 included) keeps the
float weights load_model dequantized; `GgufPacking` records which tensors went which way and why. Embeddings, the
LM head and the norms stay float as for every format. llama.cpp permutes q and k rows for its RoPE layout;
un-permuting moves whole rows, so it is applied to the packed rows and their scales as the loader applies it to the
float rows.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.quant_gemv import quant_gemv_triton

from .linears import Int4Linear, QuantLinear

GGUF_GROUP = 32  # ggml's block: one (d, m) per 32 weights along a row
PACKED_TYPES = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8g"}  # GGUF type -> the kernel format that keeps it
GGUF_KERNELS = ("dequant", "triton")
# our fused linear -> its parts (HF names under the same parent), in row order
FUSED_PARTS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
               "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


class GgufPackError(ValueError):
    """The GGUF file does not hold what the loaded model says it should (changed on disk, or another file)."""


# ---- block math (numpy) ----------------------------------------------------------------------------------------
def q4_blocks(raw: np.ndarray, kind: str, rows: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """A Q4_0 / Q4_1 tensor's bytes (rows x K/32 blocks) -> (q [N, K] uint8 in 0..15, scale [N, K/32] float32,
    zero [N, K/32] float32, exact) with w = (q - 8) scale + zero; `exact` is False when some m + 8 d is not a
    float32 (then the zeros are rounded and the tensor should be dequantized instead).

    One Q4_1 block with d = 0.5, m = -1, bytes 0x9F then 0x00 x 15: q_0 = 15 (low nibble), q_16 = 9 (high).
    >>> block = np.concatenate([np.array([0.5, -1.0], np.float16).view(np.uint8), [0x9F] + [0] * 15]).astype(np.uint8)
    >>> q, s, z, exact = q4_blocks(block, "Q4_1", 1, 32)
    >>> q[0, [0, 1, 16]].tolist(), float(s[0, 0]), float(z[0, 0]), exact
    ([15, 0, 9], 0.5, 3.0, True)
    >>> ((q[0, [0, 16]].astype(np.float32) - 8) * s[0, 0] + z[0, 0]).tolist()  # d q + m
    [6.5, 3.5]
    """
    head = {"Q4_0": 2, "Q4_1": 4}[kind]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, k // GGUF_GROUP, head + GGUF_GROUP // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, G]
    nibbles = blocks[..., head:]  # [N, G, 16]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, k)  # element j low, j + 16 high
    if kind == "Q4_0":
        zero = np.zeros_like(d)
    else:
        zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) + 8 * d  # exact in float64
    zero32 = zero.astype(np.float32)
    return q, d.astype(np.float32), zero32, bool(np.array_equal(zero32.astype(np.float64), zero))


def q8_blocks(raw: np.ndarray, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's bytes (rows x K/32 blocks of f16 d + 32 int8) -> (q [N, K] int8, scale [N, K/32] float32)
    with w = q scale, exactly (d q: an 11-bit times an 8-bit integer).

    >>> d, q = np.array([0.25], np.float16).view(np.uint8), np.arange(-16, 16).astype(np.int8).view(np.uint8)
    >>> q, s = q8_blocks(np.concatenate([d, q]), 1, 32)
    >>> q[0, [0, 16, 31]].tolist(), float(s[0, 0]), (q[0, [0, 31]] * s[0, 0]).tolist()
    ([-16, 0, 15], 0.25, [-4.0, 3.75])
    """
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, k // GGUF_GROUP, 2 + GGUF_GROUP)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, k)
    return q, d


# ---- the modules ------------------------------------------------------------------------------------------------
class GgufInt4Linear(Int4Linear):
    """An `Int4Linear` (group 32, the "dequant" packing [N, K/2] with high nibble = even k) whose q, scale and zero
    come from a GGUF file's blocks rather than `quantize_int4`, with float32 scale and zero whatever the activation
    dtype: the dequantized weight is the file's, and it is cast to x's dtype only after the float32 math."""

    def __init__(self, q: Tensor, scale: Tensor, zero: Tensor, kernel: str, bias: Tensor | None = None) -> None:
        QuantLinear.__init__(self, q.shape[1], q.shape[0], bias)
        if kernel not in GGUF_KERNELS:
            raise ValueError(f"GGUF blocks run with kernel {' or '.join(GGUF_KERNELS)}, not {kernel!r}")
        self.group_size, self.kernel = GGUF_GROUP, kernel
        self._add_counters(kernel, q.device)
        q = q.to(torch.uint8)  # 0..15: q << 4 fits a byte
        self.register_buffer("weight", q[:, ::2] << 4 | q[:, 1::2])  # [N, K/2] uint8
        self.register_buffer("scale", scale.float().contiguous())  # [N, K/32] fp32
        self.register_buffer("zero", zero.float().contiguous())  # [N, K/32] fp32

    def forward(self, x: Tensor) -> Tensor:
        x2 = self._flat(x)
        if self._use_gemv(x2):
            y = quant_gemv_triton(x2, "int4", self.weight, self.scale, self.zero, self.group_size,
                                  counters=self.gemv_counters)
            return self._out(y, x)
        # the bias inside the matmul, as nn.Linear adds it (in bf16 a separate add would round the product first)
        y = F.linear(x2, self._weight_fp32().to(x2.dtype), self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _weight_fp32(self) -> Tensor:
        n, k = self.out_features, self.in_features
        q = torch.stack((self.weight >> 4, self.weight & 15), dim=-1).reshape(n, -1, self.group_size).float()
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).reshape(n, k)  # [N, K] fp32

    def dequantized_weight(self) -> Tensor:
        return self._weight_fp32()

    def extra_repr(self) -> str:
        return f"gguf int4 (group 32, fp32 scales), in_features={self.in_features}, out_features={self.out_features}"


class GgufInt8Linear(QuantLinear):
    """A GGUF Q8_0 linear: int8 weights [N, K] with a scale per group of 32 input channels (the blocks' float16 d,
    stored as float16: 1/16 byte per weight on top of the int8, as in the file),
    w = q * scale (kernels/quant_gemv.py format "int8g"). Kernel "dequant" dequantizes in float32 (exact), casts to
    x's dtype and runs one matmul; "triton" takes the int8g GEMV for calls of <= 16 rows, "dequant" above.
    `group_size` is GGUF's 32 (the kernel tests build other sizes from the same module)."""

    fmt = "int8g"

    def __init__(self, q: Tensor, scale: Tensor, kernel: str, bias: Tensor | None = None,
                 group_size: int = GGUF_GROUP) -> None:
        super().__init__(q.shape[1], q.shape[0], bias)
        if kernel not in GGUF_KERNELS:
            raise ValueError(f"GGUF blocks run with kernel {' or '.join(GGUF_KERNELS)}, not {kernel!r}")
        if tuple(scale.shape) != (q.shape[0], q.shape[1] // group_size) or q.shape[1] % group_size:
            raise ValueError(f"int8 weights {tuple(q.shape)} in groups of {group_size} need scales "
                             f"[N, K/g] = {[q.shape[0], q.shape[1] // group_size]}; got {list(scale.shape)}")
        self.group_size, self.kernel = group_size, kernel
        self._add_counters(kernel, q.device)
        self.register_buffer("weight", q.to(torch.int8).contiguous())  # [N, K] int8
        # [N, K/g]: float16 where that holds every scale exactly (GGUF's d is float16: always), else float32; the
        # kernel and the dequantization widen it to float32 either way
        half = scale.half()
        exact = bool(torch.isfinite(half).all()) and torch.equal(half.float(), scale.float())
        self.register_buffer("scale", (half if exact else scale.float()).contiguous())

    def forward(self, x: Tensor) -> Tensor:
        x2 = self._flat(x)
        if self._use_gemv(x2):
            y = quant_gemv_triton(x2, "int8g", self.weight, self.scale, group_size=self.group_size,
                                  counters=self.gemv_counters)
            return self._out(y, x)
        y = F.linear(x2, self._weight_fp32().to(x2.dtype), self.bias)  # bias inside, as nn.Linear adds it
        return y.reshape(*x.shape[:-1], self.out_features)

    def _gemv_args(self) -> tuple[str, dict]:
        return "int8g", dict(weight=self.weight, scale=self.scale, group_size=self.group_size)

    def _weight_fp32(self) -> Tensor:
        n, k = self.out_features, self.in_features
        return (self.weight.reshape(n, -1, self.group_size).float() * self.scale.float()[..., None]).reshape(n, k)

    def dequantized_weight(self) -> Tensor:
        return self._weight_fp32()

    def extra_repr(self) -> str:
        return (f"gguf int8 (group {self.group_size}, {str(self.scale.dtype).removeprefix('torch.')} scales), "
                f"in_features={self.in_features}, "
                f"out_features={self.out_features}")


# ---- what was kept -------------------------------------------------------------------------------------------------
@dataclass
class GgufPacking:
    """What `pack_gguf_model` did with each GGUF tensor, counted by GGUF type."""

    kept: Counter = field(default_factory=Counter)  # decoder-linear tensors kept packed (int4 / int8, group 32)
    dequantized: Counter = field(default_factory=Counter)  # decoder-linear tensors left as float
    other: Counter = field(default_factory=Counter)  # embeddings, head, norms, biases: float as for every format
    linears_kept: int = 0
    linears_total: int = 0
    reasons: list[str] = field(default_factory=list)  # why a Q4_x / Q8_0 tensor was not kept (first few)

    def note(self) -> str:
        def show(c: Counter) -> str:
            return ", ".join(f"{t} x{n}" for t, n in sorted(c.items())) or "none"

        text = (f"GGUF weight format 'gguf': {self.linears_kept} of {self.linears_total} decoder linears kept the "
                f"file's blocks packed (Q4_0 / Q4_1 as int4, float32 scales; Q8_0 as int8, float16 d; group 32; exact): "
                f"{show(self.kept)}; dequantized to "
                f"float: {show(self.dequantized)}")
        if self.reasons:
            text += f" ({'; '.join(self.reasons[:3])}{'; ...' if len(self.reasons) > 3 else ''})"
        return text + f"; other tensors (embeddings, head, norms) float as loaded: {show(self.other)}"


def _kind(t) -> str:
    return getattr(t.tensor_type, "name", str(t.tensor_type))


def _short(gguf_name: str) -> str:
    """blk.3.attn_q.weight -> attn_q"""
    return gguf_name.split(".")[2] if gguf_name.startswith("blk.") else gguf_name


def pack_gguf_model(model: nn.Module, kernel: str, *, inplace: bool = False) -> nn.Module:
    """The model (a copy unless `inplace`) with every decoder linear whose GGUF tensors are all Q4_0 / Q4_1 replaced by
    a `GgufInt4Linear`, and every one whose tensors are all Q8_0 by a `GgufInt8Linear`, read from the file the model
    was loaded from (`model.source_path`); `.gguf_packing` says what was kept. `kernel`: "dequant" or "triton".
    Raises GgufPackError when the file does not match the model."""
    from workbench.models.loader import open_gguf, rope_permuted_heads, unpermute_rope_rows

    source = getattr(model, "source_path", None)
    if source is None or not str(source).lower().endswith(".gguf"):
        raise GgufPackError(f"the model was not loaded from a .gguf file (source: {source}); weight format 'gguf' "
                            "keeps a GGUF file's own blocks")
    path, config = Path(source), model.config
    reader, gguf_arch, to_hf = open_gguf(path, config)
    by_hf = {to_hf.get(t.name, t.name): t for t in reader.tensors}
    packing = GgufPacking()
    linear_names = set()
    device = next(model.parameters()).device
    swaps: list[tuple[nn.Module, str, nn.Module, QuantLinear]] = []  # (parent, name, float linear, packed)
    for i, layer in enumerate(model.model.layers):
        for fused, parts in FUSED_PARTS.items():
            parent_name, name = fused.split(".")
            parent = getattr(layer, parent_name)
            linear = getattr(parent, name)
            hf_names = [f"model.layers.{i}.{parent_name}.{p}.weight" for p in parts]
            missing = [n for n in hf_names if n not in by_hf]
            if missing:
                raise GgufPackError(f"{path}: no GGUF tensor for {', '.join(missing)}; the file changed since the "
                                    "model was loaded, reload it")
            tensors = [by_hf[n] for n in hf_names]
            linear_names.update(t.name for t in tensors)
            kinds = [_kind(t) for t in tensors]
            packing.linears_total += 1
            reason = None
            families = {PACKED_TYPES.get(kd) for kd in kinds}  # "int4", "int8g", None (not kept)
            if len(families) > 1 and families != {None}:
                mix = ", ".join(f"{_short(t.name)} {kd}" for t, kd in zip(tensors, kinds))
                reason = f"layer {i} {name} fuses {mix}: one packed format per linear, so it stays float"
            family = next(iter(families)) if len(families) == 1 else None
            pieces = []
            if reason is None and family is not None:
                k = linear.in_features
                for t, kd in zip(tensors, kinds):
                    rows = int(t.data.shape[0]) if t.data.ndim == 2 else 0
                    if int(t.n_elements) != rows * k:
                        raise GgufPackError(f"{path}: {t.name} holds {int(t.n_elements)} weights, the loaded model's "
                                            f"{fused} expects rows x {k}; reload the model from this file")
                    if family == "int8g":
                        arrays = q8_blocks(t.data, rows, k)  # (q, scale)
                    else:
                        *arrays, exact = q4_blocks(t.data, kd, rows, k)  # (q, scale, zero)
                        if not exact:
                            reason = f"{t.name}: a Q4_1 zero m + 8 d is not a float32"
                            break
                    n_head = rope_permuted_heads(t.name, gguf_arch, config)
                    if n_head is not None:
                        arrays = [unpermute_rope_rows(a, n_head) for a in arrays]
                    pieces.append(arrays)
            if reason is not None:
                packing.reasons.append(reason)
            if reason is not None or not pieces:
                packing.dequantized.update(kinds)
                continue
            arrays = [torch.from_numpy(np.ascontiguousarray(np.concatenate(a, axis=0))).to(device)
                      for a in zip(*pieces)]
            q = arrays[0]
            if tuple(q.shape) != (linear.out_features, linear.in_features):
                raise GgufPackError(f"{path}: layer {i} {fused} packs to {tuple(q.shape)}, the loaded model has "
                                    f"{(linear.out_features, linear.in_features)}; reload the model from this file")
            packed = (GgufInt8Linear(*arrays, kernel, linear.bias) if family == "int8g" else
                      GgufInt4Linear(*arrays, kernel, linear.bias))
            swaps.append((parent, name, linear, packed))
            packing.kept.update(kinds)
            packing.linears_kept += 1
    packing.other.update(_kind(t) for t in reader.tensors if t.name not in linear_names)
    if inplace:
        for parent, name, _, packed in swaps:
            setattr(parent, name, packed)
        out = model
    else:  # the copy takes the packed modules in place of the float linears, which are never copied
        out = copy.deepcopy(model, memo={id(linear): packed for _, _, linear, packed in swaps})
    out.weight_format = "gguf"
    out.gguf_packing = packing
    return out
