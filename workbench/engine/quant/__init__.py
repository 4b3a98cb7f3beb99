"""Quantized weights: a module swap of a loaded model's decoder linears, chosen per model (target and draft apart).

    check_quant("int4", model.config, device, dtype, group_size=128, role="target")   # QuantError before any work
    qmodel = quantize_model(model, "int4", group_size=128)        # a quantized copy; `model` is left as it was
    qmodel = quantize_model(model, "int4-awq", group_size=128, calibration=ids)   # ids [S, L]: calibration tokens
    qmodel = quantize_model(load_model("m.Q4_1.gguf"), "gguf")    # the file's own Q4 / Q8_0 blocks, kept packed

Formats (`FORMATS`), each a weight rule in `linears.py`:
    none      the model as loaded (bf16 / fp16 / fp32 reference); with kernel "triton" its decoder linears' one-row
              calls run the Triton GEMV ("dense": the same weights, shared; bf16 / fp16 on a CUDA GPU)
    int8      weight-only int8, one scale per output channel                  aten._weight_int8pack_mm (CPU, CUDA)
    int4      weight-only int4, asymmetric, a scale + zero per group of g     aten._weight_int4pack_mm (CUDA, bf16),
              input channels (g = `int4_group_size`: 32, 64, 128, 256)        _weight_int4pack_mm_for_cpu (CPU)
              of q/k/v and gate/up with the RMSNorm weight before them folded in (`fold_norms`)
    int4-awq  int4 after AWQ's activation-aware per-input-channel scales (awq.py), folded into the preceding norm or
              projection rows: the same kernels as int4, scales searched on calibration tokens
    fp8       e4m3 weights, one scale per output channel, x fp8 activations   torch._scaled_mm, row-wise scales
              scaled per token on the fly                                      (CUDA, compute capability >= 8.9)
    gguf      a GGUF model's own Q4_0 / Q4_1 / Q8_0 blocks kept packed        "dequant" (CPU, CUDA) or "triton"
              (gguf.py): Q4_x as int4, group 32, float32 scale d and zero     (CUDA); not aten (bf16 scales would
              0 / m + 8 d; Q8_0 as int8 with its float16 scale d per group of round the file's weights)
              32: exact; other decoder linears stay float (dequantized, with a note)

Kernels (`quantize_model(kernel=...)`, the knob `quant_kernel`): "auto" (`auto_kernel`: on a GPU Triton GEMVs for int8 /
fp8 and for int4 in groups of 64+, tinygemm for int4 in groups of 32, measured; dequant on a CPU, fp8 there through
`_scaled_mm`), "aten", "dequant", or "triton": kernels/quant_gemv.py, Triton weight-only GEMVs for decode-sized calls
(<= 16 rows; int4 at 2-16 rows on the tensor cores, kernels/int4_mma.py; larger ones dequantize, then one matmul) on a
CUDA GPU; with it fp8 keeps activations in bf16 (weight-only fp8).

What is swapped: the four linears of every decoder layer (qkv_proj, o_proj, gate_up_proj, down_proj). Embeddings, the
LM head (tied or not) and the norms stay in the model dtype by default: the head is what logits and acceptance are
computed from (AWQ and GPTQ keep it float too). `head=True` (the knob `quant_head`) quantizes the head as well, as
gpt-fast's int8 / int4 do: a tied head becomes a quantized copy beside the float embedding. At 6.7 B the bf16 head
is 2 % of a bf16 token's bytes but 7 % of an int4 token's, so at batch 1 it is a real part of an int4 token
(measured faster with it quantized); its quality cost is measured like the format's (the harness's quality
columns). A quantized model is a different model: the engine's greedy parity
(the fidelity guard) is checked against the autoregressive output of the *same* quantized model, and its cost
against the unquantized one is measured separately (the harness's quality columns).

GGUF: `load_model` dequantizes every GGUF tensor to float; the format chosen here then either re-quantizes those floats
(none / int8 / int4 / ...: for a 4-bit file that is a second, lossy rounding) or, for "gguf", keeps the file's own
blocks. Which GGUF types our formats hold exactly: F32 / F16 / BF16 -> none (the model as loaded); Q4_0
(w = d (q - 8)) and Q4_1 (w = d q + m) in blocks of 32 -> int4 with group 32, scale d and zero 0 or m + 8 d in
float32; Q8_0 (w = d q, q int8, blocks of 32) -> int8 with the float16 scale d per group of 32 (`GgufInt8Linear`,
kernel format "int8g"; the per-channel int8 format cannot hold it): kept packed, bit-exact, with format "gguf"
(gguf.py says why it is exact and which kernels keep it so). Not kept, dequantized to float with format "gguf" and
named in the note: K-quants (Q2_K..Q6_K: super-blocks with 6-bit sub-scales), IQ*, Q5_*, and a fused linear (q/k/v,
gate/up) whose parts mix a kept type with another (Q4_x beside Q8_0 too: one packed format per linear). Embeddings
and the head stay float for every format (the SmolLM2-135M Q4_1 file: 210 Q4_1 linear tensors kept, its Q8_0 token
embedding dequantized). `gguf_note` words this for a run record.
"""
from __future__ import annotations

import copy
from collections import Counter

import torch
from torch import Tensor, nn

from kernels.tuning import KernelTuning, as_tuning

from .linears import (FP8_DTYPE, INT4_GROUP_SIZES, DenseGemvLinear, Fp8Linear, Int4Linear, Int8Linear, QuantLinear,
                      dequantize_fp8, dequantize_int4, dequantize_int8, fp8_linear_reference, quantize_fp8,
                      quantize_fp8_rows, quantize_int4, quantize_int8)

from workbench.choices import QUANT_KERNELS as KERNELS, WEIGHT_FORMATS as FORMATS  # noqa: E402 - declared once
HEAD_FORMATS = ("int8", "int4", "int4-awq", "fp8")  # the formats quant_head applies to (no-op with "none")
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
GGUF_EXACT = {"F32": "none", "F16": "none", "BF16": "none"}
GGUF_REPRESENTABLE = {"Q4_0": "int4 (group 32)", "Q4_1": "int4 (group 32)",  # kept packed by format "gguf"
                      "Q8_0": "int8 (a scale per group of 32)"}

__all__ = ["FORMATS", "QuantError", "QuantLinear", "DenseGemvLinear", "Int8Linear", "Int4Linear", "Fp8Linear",
           "check_quant", "quantize_model", "weight_bytes", "linear_shapes", "gguf_note", "INT4_GROUP_SIZES",
           "FP8_DTYPE", "quantize_int8", "dequantize_int8", "quantize_int4", "dequantize_int4", "quantize_fp8",
           "dequantize_fp8", "quantize_fp8_rows", "fp8_linear_reference", "format_of", "gguf_kernel", "set_fusion",
           "HEAD_FORMATS", "head_quantized", "fold_norms", "norms_folded", "apply_kernel_tuning"]


class QuantError(ValueError):
    """A weight format the model or the device cannot run; the message names the setting and what to do."""


def linear_shapes(config, head: bool = False) -> dict[str, tuple[int, int]]:
    """(in K, out N) of each decoder linear of a ModelConfig, and of the LM head ("lm_head") with `head`."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    shapes = {"self_attn.qkv_proj": (h, q + 2 * kv), "self_attn.o_proj": (q, h), "mlp.gate_up_proj": (h, 2 * i),
              "mlp.down_proj": (i, h)}
    return {**shapes, "lm_head": (h, config.vocab_size)} if head else shapes


def check_quant(fmt: str, config, device: torch.device | str, dtype: torch.dtype, group_size: int = 128,
                role: str = "target", kernel: str = "auto", source: str | None = None, head: bool = False) -> None:
    """Raise QuantError unless `fmt` can run for a model of `config` in `dtype` on `device` with `kernel`; `source`
    (the model's `source_path`) matters for "gguf", which needs a model loaded from a .gguf file; `head`: the LM head
    is quantized too (its widths are checked with the decoder linears')."""
    device = torch.device(device)
    knob = f"{role}_quant"
    if fmt not in FORMATS:
        raise QuantError(f"{knob}={fmt!r} is not a weight format the engine has; choose one of {', '.join(FORMATS)}")
    if kernel not in KERNELS:
        raise QuantError(f"quant_kernel={kernel!r} is not a kernel choice; choose one of {', '.join(KERNELS)}")
    if head and fmt not in HEAD_FORMATS and fmt != "none":
        raise QuantError(f"quant_head=True quantizes the LM head in the {role}'s weight format, but {knob}={fmt} "
                         f"keeps a file's own blocks (its head stays float): set quant_head False, or use one of "
                         f"{', '.join(HEAD_FORMATS)}")
    if fmt == "none" and kernel != "triton":  # the model as loaded: no kernel of ours to check
        return
    if fmt == "gguf":
        if source is None or not str(source).lower().endswith(".gguf"):
            raise QuantError(f"{knob}=gguf keeps a GGUF file's own quantized blocks, but the {role} model was "
                             f"loaded from {source or 'no file'} (not a .gguf): load a .gguf file, or use int4 with "
                             "--int4-group-size 32 (or int8) to quantize this model")
        if kernel == "aten":
            raise QuantError(f"quant_kernel=aten cannot run {knob}=gguf exactly: the aten int4 kernels take bf16 "
                             "scales and zeros, which round the file's weights; use quant_kernel auto, dequant or "
                             "triton (or target_quant int4 for the re-quantized bf16 model)")
    if kernel == "triton":
        from kernels.quant_gemv import triton_problem

        problem = triton_problem(device)
        if problem:
            what = f"{knob}={fmt}: the dense Triton GEMV" if fmt == "none" else f"{knob}={fmt}"
            raise QuantError(f"quant_kernel=triton ({what}): {problem}")
    if fmt == "none":  # kernel triton: the dense GEMV
        if dtype not in (torch.bfloat16, torch.float16):
            raise QuantError(f"quant_kernel=triton with {knob}=none runs the dense GEMV in bfloat16 / float16; the "
                             f"models are loaded as {str(dtype).removeprefix('torch.')}: use --dtype bfloat16 or "
                             "quant_kernel auto")
        return
    shapes = linear_shapes(config, head)
    if fmt == "fp8":
        if device.type != "cuda":
            raise QuantError(f"{knob}=fp8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: "
                             f"Ada, Hopper); this run is on {device.type}: use int8 or int4 there")
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise QuantError(f"{knob}=fp8 needs compute capability 8.9 or newer; {torch.cuda.get_device_name(device)} "
                             f"has {cap[0]}.{cap[1]}: use int8 or int4")
        bad = [f"{n} {k}x{o}" for n, (k, o) in shapes.items() if k % 16 or o % 16]
        if bad:
            raise QuantError(f"{knob}=fp8: torch._scaled_mm needs widths divisible by 16; the {role} model has "
                             f"{', '.join(bad)}: use int8")
    if fmt in ("fp8", "int4", "int4-awq") and device.type == "cuda" and dtype != torch.bfloat16:
        raise QuantError(f"{knob}={fmt} on a GPU computes in bfloat16 (the kernel's only input type); the models are "
                         f"loaded as {str(dtype).removeprefix('torch.')}: use --dtype bfloat16")
    if fmt in ("int4", "int4-awq"):
        if group_size not in INT4_GROUP_SIZES:
            raise QuantError(f"int4_group_size={group_size} is not one the int4 kernels take; choose one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))}")
        widths = sorted({k for k, _ in shapes.values()})
        bad = [f"{n} (input width {k})" for n, (k, _) in shapes.items() if k % group_size]
        if bad:
            fits = [g for g in INT4_GROUP_SIZES if all(w % g == 0 for w in widths)]
            advice = (f"use --int4-group-size {max(fits)} (divides every input width: {', '.join(map(str, widths))})"
                      if fits else f"no int4 group size divides its input widths {widths}: use int8")
            raise QuantError(f"{knob}={fmt}: int4 group size {group_size} does not divide the {role} model's "
                             f"{', '.join(bad)}; {advice}")
        if device.type == "cuda":
            bad = [f"{n} ({o} outputs)" for n, (_, o) in shapes.items() if o % 8]
            if bad:
                raise QuantError(f"{knob}={fmt}: the CUDA int4 kernel needs output widths divisible by 8; the {role} "
                                 f"model has {', '.join(bad)}: use int8")


def quantize_model(model: nn.Module, fmt: str, *, group_size: int = 128, calibration: Tensor | None = None,
                   kernel: str = "auto", inplace: bool = False, head: bool = False) -> nn.Module:
    """The model with its decoder linears replaced by `fmt`'s modules (a copy unless `inplace`). "int4-awq" needs
    `calibration` token ids [S, L]. `kernel`: "aten" (the packed aten ops; fp8: _scaled_mm), "dequant" (PyTorch
    ops, then one matmul), "triton" (kernels/quant_gemv.py for decode-sized calls, weight-only for fp8 too) or
    "auto": `auto_kernel`. "gguf" keeps the Q4_0 / Q4_1 / Q8_0 blocks of the .gguf the
    model was loaded from (gguf.py; kernel auto = triton on a GPU, else dequant). `head`: the LM head too (a tied
    head as a quantized copy; the embedding stays float), formats HEAD_FORMATS. Call `check_quant` first."""
    if fmt not in FORMATS:
        raise QuantError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "none":
        return _dense_gemv(model, inplace) if kernel == "triton" else model
    if fmt == "gguf":
        return _pack_gguf(model, kernel, inplace)
    if fmt == "int4-awq" and calibration is None:
        raise QuantError("int4-awq needs calibration token ids [S, L] (the harness takes them from the zoo corpus)")
    if kernel == "auto":
        device = next(model.parameters()).device
        triton_ok = device.type == "cuda" and _triton_problem(device) is None
        kernel = auto_kernel(fmt, device.type == "cuda", triton_ok, group_size)
    if kernel not in KERNELS:
        raise QuantError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    out = model if inplace else copy.deepcopy(model)
    if fmt == "int4-awq":
        from .awq import apply_awq

        out.awq_alphas = apply_awq(out, calibration, group_size)
    folded = fmt == "int4"
    if folded:
        fold_norms(out)
    make = {"int8": lambda lin: Int8Linear(lin, kernel), "int4": lambda lin: Int4Linear(lin, group_size, kernel),
            "int4-awq": lambda lin: Int4Linear(lin, group_size, kernel), "fp8": lambda lin: Fp8Linear(lin, kernel)}[fmt]
    out = _swap_linears(out, make, fmt)
    if folded:
        for layer in out.model.layers:
            for _, linear in _normed_linears(layer):
                linear.norm_unit = True
    if head:
        _quantize_head(out, make)
    return out


# int4 ("int4", not "int4-awq", whose scales live in those norms) quantizes each layer's q/k/v and gate/up weights with
# the RMSNorm weight before them folded in (`fold_norms`): the same function up to rounding, a different int4 error.
# The norms are then all ones, which the one-row CUDA GEMV's norm prologue does not read (QuantLinear.norm_unit);
# measured faster than the weights quantized as loaded, so always.


def apply_kernel_tuning(model: nn.Module, tuning: KernelTuning | str | None) -> KernelTuning:
    """Set the run's KernelTuning (kernels/tuning.py; text or None: parsed / the defaults) on every quantized linear
    of `model`, which hand it to each kernel call; returns the record. The engine calls it per build."""
    record = as_tuning(tuning)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.tuning = record
    return record


def _normed_linears(layer: nn.Module) -> tuple[tuple[nn.Module, nn.Module], ...]:
    """A decoder layer's (RMSNorm, the linear that reads its output) pairs."""
    return ((layer.input_layernorm, layer.self_attn.qkv_proj), (layer.post_attention_layernorm, layer.mlp.gate_up_proj))


def fold_norms(model: nn.Module) -> nn.Module:
    """In place: every decoder layer's input_layernorm weight multiplied into qkv_proj's input columns and its
    post_attention_layernorm weight into gate_up_proj's, each norm's weight then set to ones (W (w * x^) = (W diag(w))
    x^; the products rounded to the weights' dtype). Returns the model."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm, linear in _normed_linears(layer):
                w = norm.weight.float()
                linear.weight.copy_((linear.weight.float() * w[None, :]).to(linear.weight.dtype))
                norm.weight.fill_(1)
    return model


def _quantize_head(out: nn.Module, make) -> None:
    """out.lm_head = make(the head as a bias-free linear); a tied head's weight is the embedding's, which stays as it
    is (make only reads it). With AWQ the head's input (the final norm's output) keeps no scale: apply_awq folds none
    into the final norm."""
    with torch.no_grad():
        weight = out.lm_head_weight  # [V, H]
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(weight.detach(), requires_grad=False)  # shares the storage: read, not copied
        out.lm_head = make(lin)


def _swap_linears(out: nn.Module, make, fmt: str) -> nn.Module:
    """Every decoder layer's LINEARS replaced, in place, by make(linear); `out.weight_format` = fmt."""
    with torch.no_grad():
        for layer in out.model.layers:
            for path in LINEARS:
                parent_name, name = path.split(".")
                parent = getattr(layer, parent_name)
                setattr(parent, name, make(getattr(parent, name)))
    out.weight_format = fmt
    return out


def _dense_gemv(model: nn.Module, inplace: bool) -> nn.Module:
    """The model with its decoder linears as `DenseGemvLinear` (kernel "triton" on format "none"): a copy of the
    modules that shares every parameter with `model` (no second set of weights) unless `inplace`."""
    out = model if inplace else copy.deepcopy(model, memo={id(t): t for t in (*model.parameters(),
                                                                               *model.buffers())})
    return _swap_linears(out, DenseGemvLinear, "none")


def _triton_problem(device: torch.device) -> str | None:
    from kernels.quant_gemv import triton_problem

    return triton_problem(device)


def auto_kernel(fmt: str, cuda: bool, triton_ok: bool, group_size: int = 128) -> str:
    """What quant_kernel "auto" runs, by measurement on the H200 (6.7 B decode, batch 1): int8 and
    fp8 take the Triton GEMVs on a GPU where Triton runs (1.24x / 1.41x bf16, where PyTorch's int8 op gave 0.10x and
    `_scaled_mm` 0.74x). int4 takes ours too, for groups of 64 or more, where its verify
    widths (2-16 rows) run on the tensor cores (kernels/int4_mma.py). At 6.7 B we timed
    ours at 2.056 ms a token against tinygemm's 2.731 (AR), and at 3.270 against 3.984 ms for an n-gram verify step
    of 5 rows. On the small preset (50 MB of int4 weights, launch-bound) tinygemm was 2-5 % ahead end to end with the
    draft model. Groups of 32 keep tinygemm: ours would verify them in the older form, 2.2x slower than
    tinygemm per 6.7 B step. Ours runs one-row int4 calls in CUDA C++ where
    nvcc exists (kernels/int4_cuda.py: 1.869 ms a token at 6.7 B against 2.054 with the
    Triton GEMV and 2.718 with tinygemm). On a CPU fp8 uses `_scaled_mm` and int8 / int4 dequantize then multiply.

    >>> auto_kernel("fp8", True, True), auto_kernel("int4", True, True), auto_kernel("int8", True, False)
    ('triton', 'triton', 'aten')
    >>> auto_kernel("int4", True, True, group_size=32), auto_kernel("int4", True, False)
    ('aten', 'aten')
    >>> auto_kernel("fp8", False, False), auto_kernel("int8", False, False)
    ('aten', 'dequant')
    """
    if cuda:
        if triton_ok and (fmt in ("int8", "fp8") or (fmt in ("int4", "int4-awq") and group_size >= 64)):
            return "triton"
        return "aten"
    return "aten" if fmt == "fp8" else "dequant"


def gguf_kernel(kernel: str, device: torch.device) -> str:
    """The kernel format "gguf" runs with: "auto" is "triton" on a CUDA GPU where Triton runs, else "dequant"."""
    if kernel != "auto":
        return kernel
    from kernels.quant_gemv import triton_problem

    return "triton" if device.type == "cuda" and triton_problem(device) is None else "dequant"


def _pack_gguf(model: nn.Module, kernel: str, inplace: bool) -> nn.Module:
    from .gguf import GGUF_KERNELS, GgufPackError, pack_gguf_model

    kernel = gguf_kernel(kernel, next(model.parameters()).device)
    if kernel not in GGUF_KERNELS:
        raise QuantError(f"weight format gguf runs with quant_kernel {', '.join(GGUF_KERNELS)} or auto, not {kernel!r}"
                         " (aten's bf16 scales would round the file's weights)")
    try:
        return pack_gguf_model(model, kernel, inplace=inplace)
    except GgufPackError as e:
        raise QuantError(str(e)) from None


def set_fusion(model: nn.Module, fusion: str) -> nn.Module:
    """Set what every GEMV linear of `model` folds in at its edges (`QuantLinear.fusion`, the knob gemv_fusion: "off",
    "residual", "glu+residual", "glu+residual+ores", "norm+glu+residual"); acts on the Triton GEMV path only."""
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.fusion = fusion
    return model


def head_quantized(model: nn.Module) -> bool:
    """Whether `quantize_model(head=True)` quantized the model's LM head."""
    return isinstance(getattr(model, "lm_head", None), QuantLinear)


def norms_folded(model: nn.Module | None) -> bool:
    """Whether `quantize_model` folded the model's RMSNorm weights into its linears (`fold_norms`, int4)."""
    return model is not None and any(isinstance(m, QuantLinear) and m.norm_unit for m in model.modules())


def format_of(model: nn.Module) -> str:
    """The format `quantize_model` gave the model ("none" for a model as loaded)."""
    return getattr(model, "weight_format", "none")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as stored (quantized weights, scales and zeros included)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}  # a tied head counted once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def gguf_note(tensor_types: Counter | dict | None, fmt: str, model: nn.Module | None = None) -> str | None:
    """A sentence for the run record about a GGUF's stored types and what became of them, None for other files.
    For format "gguf", `model` (the packed model) says which tensors were kept packed and which dequantized."""
    if not tensor_types:
        return None
    packing = getattr(model, "gguf_packing", None)
    if fmt == "gguf" and packing is not None:
        return packing.note()
    shown = ", ".join(f"{t} x{n}" for t, n in sorted(tensor_types.items()))
    quantized = sorted(t for t in tensor_types if t not in GGUF_EXACT)
    if not quantized:
        return f"GGUF tensors {shown}: float, loaded as they are"
    representable = [f"{t} -> {GGUF_REPRESENTABLE[t]}" for t in quantized if t in GGUF_REPRESENTABLE]
    return (f"GGUF tensors {shown}: dequantized to float on load, then weight format {fmt!r} applied"
            + (f"; {', '.join(representable)} would be exact: weight format 'gguf' keeps them packed"
               if representable else "; none of these types has an exact counterpart here"))
