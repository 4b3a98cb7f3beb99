"""KernelTuning: the kernel variants a run may choose, as one frozen record (no module switches, no environment).

Each field is a variant that stays because it is a real choice (a fallback, a device-dependent path, or a form a GPU
script compares); its default is the measured fastest. The record travels with the engine configuration (knob
`kernel_tuning`, text "field=value,field=value"), is set on the quantized linears and reaches each kernel call as an
argument; the result row records it resolved (`format_tuning`), every field included.

Torch-free, so settings and the UI can parse and check it without loading a kernel.

>>> t = parse_tuning("int4_mma_rows=0, int4_half2=2")
>>> t.int4_mma_rows, t.int4_half2, t.int4_cuda
(0, 2, True)
>>> format_tuning(t)
'int4_mma_rows=0,int4_cuda=1,int4_half2=2,int4_prefill_gemm_rows=0,inductor_pdl=1,inductor_combo=1'
>>> parse_tuning(format_tuning(t)) == t, parse_tuning("") == KernelTuning()
(True, True)
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass


class KernelTuningError(ValueError):
    """A bad kernel tuning text or value; the message names the field and what it takes."""


HALF2_CHOICES = (None, 0, 1, 2)


@dataclass(frozen=True)
class KernelTuning:
    # int4 calls of 2..int4_mma_rows rows (verify widths) on the tensor-core kernel (kernels/int4_mma.py) with the
    # weights dequantized into the MMA's operand; 0 keeps them in the Triton GEMV (int4_mma needs 16-bit x, groups 64+).
    int4_mma_rows: int = 16
    # one-row int4 calls in the nvcc-built CUDA GEMV (kernels/int4_cuda.py) where it takes them; off (or no nvcc on
    # the machine) keeps them in the Triton GEMV.
    int4_cuda: bool = True
    # one-row int4 Triton tiles in packed fp16 words: None ("auto") = each tile's own choice; 0 / 1 / 2 force fp32 words,
    # one scale per K tile, or a scale per word for every call.
    int4_half2: int | None = None
    # int4 prefill calls of 17..int4_prefill_gemm_rows rows through the GEMV's tensor-core form (no bf16 weight written)
    # instead of dequantize + matmul; 0 = never (not yet timed on a GPU).
    int4_prefill_gemm_rows: int = 0
    # torch.compile'd steps (compile default / max-autotune): inductor's own Triton kernels launched with programmatic
    # dependent launch (Hopper and later: each kernel starts while the one before it ends; no effect elsewhere), and
    # independent small kernels of a graph fused into one launch ("combo kernels", an experimental inductor option).
    # Measured on tiny, H100, batch 1, compile default: AR step -5 % / -3 % / -7 % (PDL / combo / both), EAGLE
    # -5 % / -7 % / -10 %, ReDrafter -4 % / -5 % / -8 % (docs/gpu_runs/2026-12-07/s5/). Off: inductor's defaults.
    inductor_pdl: bool = True
    inductor_combo: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.int4_mma_rows, bool) or not isinstance(self.int4_mma_rows, int) \
                or not 0 <= self.int4_mma_rows <= 16:
            raise KernelTuningError(f"int4_mma_rows={self.int4_mma_rows!r}: give a whole number of rows from 0 (off) "
                                    "to 16 (the MMA kernel's most)")
        if not isinstance(self.int4_cuda, bool):
            raise KernelTuningError(f"int4_cuda={self.int4_cuda!r}: give 1 (on) or 0 (off)")
        if self.int4_half2 not in HALF2_CHOICES or isinstance(self.int4_half2, bool):
            raise KernelTuningError(f"int4_half2={self.int4_half2!r}: give auto (each tile's own), 0, 1 or 2")
        if isinstance(self.int4_prefill_gemm_rows, bool) or not isinstance(self.int4_prefill_gemm_rows, int) \
                or self.int4_prefill_gemm_rows < 0:
            raise KernelTuningError(f"int4_prefill_gemm_rows={self.int4_prefill_gemm_rows!r}: give a whole number "
                                    "of rows >= 0 (0 = never)")
        for name in ("inductor_pdl", "inductor_combo"):
            if not isinstance(getattr(self, name), bool):
                raise KernelTuningError(f"{name}={getattr(self, name)!r}: give 1 (on) or 0 (off)")
        # the text form, kept: a compiled caller hands it to the custom op without running Python's dataclass machinery
        object.__setattr__(self, "text", record_text(self))


FIELDS = tuple(f.name for f in dataclasses.fields(KernelTuning))


# ---- text <-> record (any frozen record of bool / int / "auto" (None) fields: serving's ServeTuning uses them too) --
def _value_text(value) -> str:
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def record_text(record) -> str:
    """Every field of a tuning record as "field=value", comma-separated in field order (what a result row records)."""
    return ",".join(f"{f.name}={_value_text(getattr(record, f.name))}" for f in dataclasses.fields(record))


def record_from_text(cls, text: str | None, error: type[ValueError], what: str):
    """"field=value,field=value" (empty: the defaults; unnamed fields keep theirs) -> cls(...). Values are read by the
    field's default: a bool takes 1/0 (true/false, on/off), an int a whole number, a None default "auto" or a whole
    number. An unknown field, a repeated one or a bad value is `error`, naming it and what it takes; the record's own
    checks (__post_init__) run last."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip().lower()
        if not eq or not value:
            raise error(f"{what} entry {part!r}: write field=value (fields: {', '.join(fields)})")
        if name not in fields:
            raise error(f"unknown {what} field {name!r}; the fields are {', '.join(fields)}")
        if name in values:
            raise error(f"{what} field {name!r} given twice")
        default = fields[name].default
        if isinstance(default, bool):
            if value not in ("1", "0", "true", "false", "on", "off"):
                raise error(f"{name}={value!r}: give 1 (on) or 0 (off)")
            values[name] = value in ("1", "true", "on")
        elif default is None and value == "auto":
            values[name] = None
        elif value.lstrip("-").isdigit():
            values[name] = int(value)
        else:
            raise error(f"{name}={value!r}: give a whole number" + (" or auto" if default is None else ""))
    return cls(**values)


def inductor_options(tuning: KernelTuning) -> tuple[tuple[str, bool], ...]:
    """The torch._inductor options of a tuning record, as torch.compile(options=...) takes them (as pairs: hashable).

    >>> inductor_options(parse_tuning("inductor_combo=0"))
    (('triton.enable_pdl', True), ('combo_kernels', False))
    """
    return (("triton.enable_pdl", tuning.inductor_pdl), ("combo_kernels", tuning.inductor_combo))


def format_tuning(tuning: KernelTuning) -> str:
    """Every field as "field=value", comma-separated in field order (what the result row records)."""
    return record_text(tuning)


@functools.lru_cache(maxsize=64)
def parse_tuning(text: str | None) -> KernelTuning:
    """"field=value,field=value" (empty: the defaults; unnamed fields keep theirs) -> KernelTuning; an unknown field,
    a repeated one or a bad value is a KernelTuningError naming it."""
    return record_from_text(KernelTuning, text, KernelTuningError, "kernel tuning")


def as_tuning(tuning: KernelTuning | str | None) -> KernelTuning:
    """A record as given, or parsed from its text (None / "": the defaults)."""
    return tuning if isinstance(tuning, KernelTuning) else parse_tuning(tuning or "")


DEFAULT = KernelTuning()
