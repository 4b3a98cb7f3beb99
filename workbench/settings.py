"""Every run setting ("knob") and every decoding method, declared once; the rest of the workbench is generated from it.

A `Knob` names a setting's type, default, bounds or choices, help text, the methods that read it, whether studies may
search it, and its CLI flag. From `KNOBS` and `METHODS` come:

    BenchConfig                      workbench.harness.bench: one frozen-dataclass field per run knob (`dataclass_of`)
    `python -m workbench bench`      workbench.harness.bench_cli: flag, default, help, choices per knob
    studies                          studies.space: LIMITS, METHODS, RunSettings (quick defaults), SearchSpace dims;
                                     studies.run: one flag per searchable knob and per run setting
    dashboard forms                  ui/run_page.py, ui/tune_page.py: widget kind, label, bounds, default, help
    result schema                    one config column per knob (below)

    >>> KNOBS["graph_batch_sizes"].parse("1,2,4")
    (1, 2, 4)
    >>> KNOBS["compile"].check("fast")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    workbench.settings.SettingError: compile='fast' is not supported by the engine; allowed: 'auto', 'off', ...
    >>> check({"batch": 16, "cuda_graphs": True, "graph_batch_sizes": (1, 2, 4, 8)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    workbench.settings.SettingError: batch 16 exceeds the largest graph bucket 8: add a bucket >= 16 to ...

Columns: `results/` is a leaf that imports nothing of the project, and it is read by processes that never import the
engine (`python -m results`, the Results page): it must type every column by itself, so `results.schema` keeps its own
name and kind for each config column. This module registers each knob's column through `results.schema.register_column`
at import (a no-op when results already declares it with the same kind, a ValueError at import when the kinds
disagree), and tests/test_settings.py checks that results declares every knob with the kind `Knob.column_kind` says:
a knob added here and forgotten there fails a test, and a row written before results knows it is still typed.

Auto: the speed knobs (`AUTO_KNOBS`: dtype, cuda_graphs, compile) default to "auto" and are resolved per device before
a run (`resolve_config`, called by `BenchSession.run` and `serve_bench`): on a GPU the model's own half dtype, CUDA
graphs and compile "default", as vLLM and SGLang default; on a CPU what is fastest there (`CPU_AUTO`). The row holds the
resolved values in the knobs' own column kinds and names the knobs that were auto (`auto_knobs`).

Bench vs studies booleans: `bench` writes a boolean as a flag pair (`--cuda-graphs` / `--no-cuda-graphs`); studies,
where every space flag is a value or a list, write it as `on` / `off` (`--cuda-graphs off,on` searches both).

This module must not import torch (directly or through `workbench/__init__.py`): the dashboard and studies import it in
processes that stay light; tests/test_settings.py checks it in a fresh interpreter.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kernels.tuning import parse_tuning
from results.schema import register_column
from workbench import choices
from workbench.choices import AUTO, tree_capacity
from workbench.serving.tuning import parse_serve_tuning

ALL = "all"  # Knob.methods: read by every method
KINDS = {"int": int, "float": float, "bool": bool, "str": str, "ints": tuple}  # "ints": a tuple of whole numbers
COLUMN_KINDS = {"int": "int", "float": "float", "bool": "bool", "str": "string", "ints": "string"}
BOOL_TEXT = {"on": True, "off": False, "true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}


class SettingError(ValueError):
    """A setting the engine does not accept; the message names the knob, the value and what is allowed.
    `knob` names the setting to blame (a form files the message under that field's key)."""

    def __init__(self, message: str, knob: str | None = None) -> None:
        super().__init__(message)
        self.knob = knob


@dataclass(frozen=True)
class Method:
    """A decoding method. The knobs it reads are declared on the knobs (`Knob.methods`); `knobs` lists its own."""

    name: str
    description: str
    speculative: bool = True
    searched_by_default: bool = True  # in a study's method list unless the user names the methods

    @property
    def knobs(self) -> tuple[str, ...]:
        """The method-specific knobs it reads (those every method reads are left out): ngram -> k, ngram_min, ..."""
        return tuple(k.name for k in KNOBS.values() if k.methods != ALL and self.name in k.methods)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", "autoregressive baseline (no drafter)", speculative=False),
    Method("draft", "independent draft model, chain of k"),
    Method("ngram", "prompt lookup (n-gram), chain of up to k"),
    Method("redrafter", "ReDrafter: a recurrent head over the target's hidden state, beam search of beam_width x "
           "beam_length merged into a tree (the head `zoo train-head` put beside the target; without one, an "
           "untrained head from a fixed seed: correct output, poor drafts)"),
    # searched by default since tiny has a trained head (CPU, 16 prompts x 64 tokens: 1.64 mean accepted tokens at
    # W=1 L=4, vs 1.00 untrained); presets without a head still get the untrained one in a default study
    Method("eagle", "EAGLE-2: a one-layer head over the target's hidden states and token embeddings grows a dynamic "
           "tree (top tree_topk children of the best frontier nodes per depth, reranked to tree_budget nodes; the "
           "head `zoo train-head --kind eagle` put beside the target; without one, an untrained head from a fixed "
           "seed: correct output, poor drafts)"),
    Method("eagle3", "EAGLE-3: EAGLE-2's dynamic tree drafted by a head over three target layers (eagle3_layers) "
           "and the token embedding, predicting over its own draft vocabulary (d2t maps it to the target's); a "
           "published checkpoint with --draft-head PATH, else the head `zoo train-head --kind eagle3` put beside "
           "the target; without one, an untrained head from a fixed seed: correct output, poor drafts)",
           searched_by_default=False),
)}
TREE_METHODS = ("eagle", "eagle3")  # dynamic-tree drafters: tree_depth / tree_topk / tree_budget
DEFAULT_SEARCH_METHODS = tuple(m.name for m in METHODS.values() if m.searched_by_default)


@dataclass(frozen=True)
class Knob:
    """One setting. `quick_default` is the default of studies and the dashboard where it differs from the engine's
    (a trial or a click should take seconds); `search_range` is the range a study searches by default (int knobs);
    scope "session" knobs pick the loaded models (`BenchSession.load`) instead of being a BenchConfig field."""

    name: str
    kind: str                               # a key of KINDS
    default: Any
    help: str
    label: str                              # the dashboard's field label
    group: str                              # "method" | "run" | "sampling" | "system": where forms place it
    low: float | None = None                # bounds; for "ints", of every element
    high: float | None = None
    choices: tuple | None = None            # allowed values (a bool knob allows (False, True))
    methods: tuple[str, ...] | str = ALL    # methods that read it
    searchable: bool = False                # studies may search it (a SearchSpace dimension)
    search_range: tuple[int, int] | None = None
    quick_default: Any = None
    scope: str = "run"                      # "run" | "session"
    auto: bool = False                      # also takes "auto", resolved per device before a run (`resolve_auto`)

    def __post_init__(self) -> None:
        assert self.kind in KINDS and self.scope in ("run", "session"), self
        assert self.methods == ALL or set(self.methods) <= set(METHODS), self
        assert not self.auto or self.kind == "bool" or AUTO in (self.choices or ()), self

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def quick(self) -> Any:
        return self.default if self.quick_default is None else self.quick_default

    @property
    def allowed(self) -> tuple | None:
        if self.kind == "bool":
            return (AUTO, False, True) if self.auto else (False, True)
        return self.choices

    @property
    def column_kind(self) -> str:
        """The result-store column kind (results.schema.KINDS); a list of ints is stored as text "1,2,4"."""
        return COLUMN_KINDS[self.kind]

    def reads(self, method: str) -> bool:
        return self.methods == ALL or method in self.methods

    # ---- text <-> value (CLI flags, form fields) -------------------------------------------------------------
    def parse(self, text: str) -> Any:
        """'4' -> 4 (int), 'on' -> True (bool), '1,2,4' -> (1, 2, 4) (ints); SettingError names the flag."""
        text = str(text).strip()
        if self.auto and text.lower() == AUTO:
            return AUTO
        try:
            if self.kind == "bool":
                if text.lower() not in BOOL_TEXT:
                    raise ValueError("use on or off")
                return BOOL_TEXT[text.lower()]
            if self.kind == "ints":
                return tuple(int(t) for t in text.split(",") if t.strip())
            return KINDS[self.kind](text)
        except ValueError as e:
            raise SettingError(f"cannot read {self.flag} {text!r}: {e}", self.name) from None

    def format(self, value: Any) -> str:
        """The inverse of `parse`: True -> 'on', (1, 2, 4) -> '1,2,4', 0.5 -> '0.5'."""
        if self.auto and value == AUTO:
            return AUTO
        if self.kind == "bool":
            return "on" if value else "off"
        if self.kind == "ints":
            return ",".join(str(v) for v in value)
        return f"{value:g}" if self.kind == "float" else str(value)

    def column(self, value: Any) -> Any:
        """The value as stored in the result row."""
        return self.format(value) if self.kind == "ints" else value

    # ---- validation --------------------------------------------------------------------------------------------
    def check(self, value: Any) -> None:
        """Raise SettingError unless the engine accepts `value` for this knob (alone; `check` adds the cross rules)."""
        if self.kind == "ints":
            return self._check_list(value)
        if self.auto and isinstance(value, str) and value == AUTO:
            return
        if self.name in TUNING_PARSERS:  # free text, checked by its own parser
            return _check_tuning(self.name, value)
        if self.allowed is not None:
            if value not in self.allowed or isinstance(value, bool) != (self.kind == "bool"):
                raise SettingError(f"{self.name}={value!r} is not supported by the engine; allowed: "
                                   f"{', '.join(map(repr, self.allowed))}", self.name)
            return
        number = numbers.Integral if self.kind == "int" else numbers.Real
        if isinstance(value, bool) or not isinstance(value, number):
            raise SettingError(f"{self.name}={value!r} must be a {'whole ' if self.kind == 'int' else ''}number "
                               f"in {self.describe()}", self.name)
        if not isinstance(value, numbers.Integral) and not math.isfinite(value):  # nan passes every bound test
            raise SettingError(f"{self.name}={value!r} must be a finite number in {self.describe()}", self.name)
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise SettingError(f"{self.name}={value!r} is outside what the engine supports: {self.describe()}",
                               self.name)

    def _check_list(self, value: Any) -> None:
        shown = self.format(value) if isinstance(value, Iterable) and not isinstance(value, str) else repr(value)
        if isinstance(value, str) or not isinstance(value, Iterable):
            raise SettingError(f"{self.name}={value!r} must be a list of whole numbers, e.g. 1,2,4,8", self.name)
        value = tuple(value)
        if not value:
            raise SettingError(f"{self.name} is empty: give at least one batch bucket, e.g. 1,2,4,8", self.name)
        if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < (self.low or 0) for v in value):
            raise SettingError(f"{self.name}={shown} must hold whole numbers >= {self.low:g}", self.name)
        if any(b <= a for a, b in zip(value, value[1:])):
            raise SettingError(f"{self.name}={shown} must be strictly increasing (sorted, no duplicates), e.g. "
                               f"{self.format(sorted(set(value)))}", self.name)

    def describe(self) -> str:
        if self.allowed is not None:
            return ", ".join(map(repr, self.allowed))
        shown = (lambda x: str(int(x))) if self.kind in ("int", "ints") else (lambda x: f"{x:g}")  # 2147483647
        lo = "-inf" if self.low is None else shown(self.low)
        hi = "inf" if self.high is None else shown(self.high)
        return f"{lo}..{hi}"


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("method", "str", "draft", "decoding method: " + "; ".join(f"{m.name} = {m.description}"
                                                                  for m in METHODS.values()),
         "Method", "method", choices=tuple(METHODS), searchable=True),
    Knob("k", "int", 4, "draft length: tokens the drafter proposes per step", "Draft length k", "method", 1, 16,
         methods=("draft", "ngram"), searchable=True, search_range=(1, 8)),
    Knob("ngram_min", "int", 1, "shortest n-gram matched against the sequence's history", "n-gram min", "method",
         1, 8, methods=("ngram",), searchable=True, search_range=(1, 3)),
    Knob("ngram_max", "int", 3, "longest n-gram matched (tried first)", "n-gram max", "method", 1, 8,
         methods=("ngram",), searchable=True, search_range=(1, 4)),
    Knob("beam_width", "int", 2, "ReDrafter beams W (1 = a chain)", "Beam width W", "method", 1, 8,
         methods=("redrafter",), searchable=True, search_range=(1, 4)),
    Knob("beam_length", "int", 4, "ReDrafter beam length L: tokens per beam (the tree's depth)", "Beam length L",
         "method", 1, 8, methods=("redrafter",), searchable=True, search_range=(1, 6)),
    Knob("diversity_penalty", "float", 0.0, "ReDrafter: a candidate's beam-search score is lowered by this much per "
         "earlier beam that chose the same token at the same depth (0 = plain beam search)", "Diversity penalty",
         "method", 0.0, 5.0, methods=("redrafter",), searchable=True),
    Knob("tree_depth", "int", 4, "EAGLE tree depth D: draft levels grown per step (one head forward each)",
         "Tree depth D", "method", 1, 12, methods=TREE_METHODS, searchable=True, search_range=(2, 6)),
    Knob("tree_topk", "int", 4, "EAGLE top-k K: children per expanded node, and frontier nodes expanded per depth",
         "Tree top-k K", "method", 1, 16, methods=TREE_METHODS, searchable=True, search_range=(1, 8)),
    Knob("tree_budget", "int", 16, "EAGLE node budget N: the candidates kept after the rerank (the verified tree "
         "size); tree_depth <= N <= K + (D-1) K^2", "Tree budget N", "method", 1,
         choices.MAX_TREE_NODES, methods=TREE_METHODS,
         searchable=True, search_range=(4, 32)),
    Knob("hot_vocab", "int", 0, "EAGLE-2 and ReDrafter: draft from the hot_vocab most frequent tokens only "
         "(FR-Spec; the head's token ranking, counted by zoo train-head): each depth reads that many rows of the LM "
         "head instead of the whole vocabulary; output unchanged, tokens outside it are never drafted. 0 = the "
         "whole vocabulary", "Hot vocabulary", "method", 0, 1 << 20, methods=("eagle", "redrafter"),
         searchable=True),
    Knob("eagle3_layers", "str", "auto", "EAGLE-3: the three target layers whose incoming hidden states the head "
         "reads, as 'i,j,k' (increasing); auto = the head's own (a checkpoint's or a trained head's), else "
         "2, N/2, N-3 of an N-layer target (1, N/2, N-1 where those are not three distinct layers)",
         "EAGLE-3 layers", "method", methods=("eagle3",)),
    Knob("batch", "int", 1, "sequences decoded together", "Batch size", "run", 1, 256, searchable=True),
    Knob("max_new_tokens", "int", 64, "tokens generated per prompt", "Max new tokens", "run", 1, 8192,
         quick_default=32),
    Knob("num_prompts", "int", 8, "prompts per run (the prompt set is cycled if smaller)", "Number of prompts",
         "run", 1, 100_000, quick_default=4),
    # 3 repeats everywhere: the least that gives a median and a speedup interval that is not absurdly wide (Student-t
    # at 2 repeats multiplies the spread by 12.7, at 3 by 4.3; workbench.harness.trust)
    Knob("repeats", "int", 3, "timed repeats, AR and candidate interleaved (ABAB...); tokens/s is their median, and "
         "2 or more give a spread (CV, speedup interval, noisy flag)", "Repeats", "run", 1, 100),
    Knob("warmup", "int", 1, "untimed warm-up passes (8 tokens) before timing", "Warmup runs", "run", 0, 100),
    Knob("temperature", "float", 0.0, "0 = greedy", "Temperature", "sampling", 0.0, 2.0, searchable=True),
    Knob("top_k", "int", 0, "0 = off", "Top-k", "sampling", 0, 1_000_000),
    Knob("top_p", "float", 1.0, "1 = off", "Top-p", "sampling", 0.0, 1.0),
    Knob("seed", "int", 0, "seed of the sampler's generator", "Seed", "sampling", 0, 2**31 - 1),
    Knob("dtype", "str", AUTO, "dtype the models are loaded in; auto = on a GPU the model's own dtype (bfloat16 / "
         "float16 from its config; a float32 model in bfloat16 where the GPU has it, else float16), on a CPU "
         "float32", "Dtype", "system", choices=(AUTO, *choices.DTYPES), searchable=True, scope="session", auto=True),
    Knob("paged", "bool", True, "paged KV cache (blocks of kv_block_size tokens) instead of one contiguous buffer",
         "Paged KV cache", "system", searchable=True),
    Knob("kv_block_size", "int", 16, "tokens per KV block of the paged cache", "KV block size", "system", 1, 4096,
         searchable=True),
    Knob("cuda_graphs", "bool", AUTO, "capture the target verify pass and the draft model's forwards in CUDA graphs "
         "per batch bucket (GPU; on CPU the same padded fixed-shape step runs eagerly); auto = on on a GPU when the "
         "batch fits the largest bucket, off on a CPU", "CUDA graphs", "system", searchable=True, auto=True),
    Knob("graph_batch_sizes", "ints", (1, 2, 4, 8, 16, 32, 64), "batch buckets captured with --cuda-graphs, "
         "comma-separated and increasing; a batch runs padded to the smallest bucket that holds it",
         "Graph batch buckets", "system", low=1),
    Knob("compile", "str", AUTO, "torch.compile mode of the step: off, default or max-autotune; auto = default on a "
         "GPU, off on a CPU", "torch.compile", "system", choices=(AUTO, *choices.COMPILE_MODES), searchable=True,
         auto=True),
    Knob("attention", "str", "auto", "attention backend: sdpa (gather the KV through the block table, then SDPA), "
         "triton (kernels/paged_attention.py: reads the paged pool in place; GPU, paged cache) or auto (triton where "
         "it can run, else sdpa)", "Attention backend", "system", choices=choices.ATTENTION_BACKENDS, searchable=True),
    Knob("prefill_graphs", "bool", True, "with --cuda-graphs, capture the prompt forwards too (target and draft model), "
         "one graph per (batch, prompt length padded up to a multiple of 32); off: prompts run eagerly",
         "Capture prefill", "system", searchable=True),
    Knob("compile_prefill", "bool", False, "with --compile and captured prefill, compile the prompt forwards too "
         "(target and draft model). Each new (batch, padded prompt length) compiles afresh: it pays with fixed prompt "
         "lengths and costs a study with ragged ones (with fixed lengths a captured prefill runs about 1.7x faster)",
         "Compile prefill", "system", searchable=True),
    Knob("overlap", "bool", True, "launch step t+1 before reading step t's tokens, so host bookkeeping overlaps the GPU "
         "(greedy chains with --cuda-graphs: AR and the draft model; other methods run one synchronous read per step)",
         "Overlap host and GPU", "system", searchable=True),
    Knob("pdl", "bool", True, "launch our Triton kernels (GEMVs, K/V write, attention) with programmatic dependent "
         "launch: each may start while the one before it finishes (Hopper GPUs and newer; elsewhere plain "
         "launches, recorded as pdl_applied)", "Dependent launches (PDL)", "system", searchable=True),
    # KV-cache formats (workbench/engine/kv_quant.py): two knobs, because they cost different things. The target's
    # format changes the target (its output is compared with the model-dtype KV: kv_token_agreement) and sets most
    # of the KV bytes; the draft's changes acceptance only (output stays exact) and is read by the draft method only.
    Knob("target_kv_quant", "str", "none", "KV-cache format of the target, and of the AR baseline it is checked "
         "against: none = the model's dtype; int8 / fp8 (e4m3) = quantized on write with a float32 scale per token "
         "and KV head, dequantized on read. Quality against none is recorded (kv_token_agreement)",
         "Target KV cache format", "system", choices=choices.KV_FORMATS, searchable=True),
    Knob("draft_kv_quant", "str", "none", "KV-cache format of the draft model's own cache (none / int8 / fp8): "
         "changes acceptance only, the output stays exact", "Draft KV cache format", "method",
         choices=choices.KV_FORMATS, methods=("draft",), searchable=True),
    # weight formats (workbench.engine.quant): a quantized model is a module swap of the loaded one, made per run
    Knob("target_quant", "str", "none", "target weight format: none (as loaded), int8 (weight-only, per channel), "
         "int4 (weight-only, groups of int4_group_size), int4-awq (int4 after activation-aware scales from "
         "calibration text), fp8 (e4m3 weights and activations, torch._scaled_mm; CUDA, compute capability >= 8.9), "
         "gguf (a .gguf model only: its own Q4_0 / Q4_1 blocks kept packed as int4 and Q8_0 as int8, group 32, "
         "exactly; other decoder linears dequantized, named in quant_note). "
         "Lossy: the run records the quality cost against the unquantized target", "Target weights", "system",
         choices=choices.WEIGHT_FORMATS, searchable=True),
    Knob("draft_quant", "str", "none", "draft model weight format (same choices as target_quant); lossless for the "
         "output, it costs acceptance", "Draft weights", "system",
         choices=choices.WEIGHT_FORMATS, methods=("draft",), searchable=True),
    Knob("quant_head", "bool", False, "also quantize the LM head in the target's / draft's weight format (int8, int4, "
         "int4-awq: plain int4 for the head, fp8), as gpt-fast does; off = the head stays in the model dtype, as AWQ "
         "and GPTQ keep it. A tied head becomes a quantized copy beside the float embedding. Lossy: its cost is in "
         "the quality columns", "Quantize the LM head", "system", searchable=True),
    Knob("int4_group_size", "int", 128, "input channels per int4 scale/zero group (int4, int4-awq); must divide every "
         "linear's input width", "int4 group size", "system", choices=choices.INT4_GROUP_SIZES),
    Knob("quant_kernel", "str", "auto", "matmul kernel of the decoder linears (target and draft): auto = chosen by "
         "measurement (GPU: our GEMVs for int8 / fp8 and for int4 in groups of 64+, tinygemm for int4 in groups of "
         "32, cuBLAS for unquantized; CPU: dequantize + matmul, fp8 through _scaled_mm); aten; dequant; triton = our "
         "GEMVs for calls of <= 16 rows (GPU: kernels/quant_gemv.py; int4 at one row in CUDA C++ where nvcc exists, "
         "recorded as int4_cuda_gemv, and at 2-16 rows on the tensor cores; fp8 then keeps bf16 activations; with an "
         "unquantized model the dense bf16 GEMV instead of cuBLAS)",
         "Linear matmul kernel", "system", choices=choices.QUANT_KERNELS),
    Knob("gemv_fusion", "str", "residual", "what our Triton GEMVs fold in at their edges (quant_kernel triton, and "
         "auto for int8 / fp8 on a GPU): residual = the MLP's residual add in the down projection's epilogue; glu "
         "also SwiGLU in its prologue (for one-row int4 on the CUDA GEMV: in gate/up's epilogue instead); ores also the attention's residual in o_proj's epilogue; norm also the "
         "RMSNorms in the q/k/v and gate/up prologues (no kernel left between a layer's GEMVs); off = none. Fastest "
         "measured: glu+residual+ores for bf16 at 6.7 B, norm+glu+residual for fp8 and at 1.45 B", "GEMV fusions",
         "system", choices=choices.GEMV_FUSIONS, searchable=True),
    Knob("max_ppl_increase_pct", "float", 2.0, "quality bound: the largest held-out perplexity increase, in percent, of "
         "the quantized target over the unquantized one that a study accepts (a constraint; runs record "
         "quant_within_bound)", "Max perplexity increase (%)", "run", 0.0, 1000.0),
    Knob("phase_profile", "bool", False, "after the timed runs, replay each captured phase (draft, verify) for "
         ">= 0.25 s under the NVML GPM sampler: SM utilization, ms and achieved bandwidth per phase (GPU, "
         "--cuda-graphs)", "Per-phase GPU profile", "system"),
    Knob("compare_hf", "bool", False, "also time Hugging Face generate() on the same prompts (slow; GPU benchmarks)",
         "Compare with HF generate()", "system"),
    Knob("tp_size", "int", 1, "tensor-parallel ranks of the target (workbench/engine/tp.py): `bench` starts one "
         "process per rank (GPU r on a GPU machine, gloo on a CPU), heads and MLP split across them, drafters "
         "replicated on every rank; must divide the target's heads, KV heads and intermediate size",
         "Tensor-parallel size", "system", choices=(1, 2, 4, 8)),
    Knob("kernel_tuning", "str", "", "kernel variants as field=value,... (kernels/tuning.py KernelTuning; empty = the "
         "measured defaults): int4_mma_rows (0-16: int4 verify widths on the tensor-core kernel, 0 off), int4_cuda "
         "(1/0: one-row int4 in the CUDA C++ GEMV), int4_half2 (auto/0/1/2: packed fp16 words in one-row int4 "
         "Triton tiles), int4_prefill_gemm_rows (int4 prefill calls up to this many rows through the GEMV, 0 never), "
         "inductor_pdl and inductor_combo (1/0: compiled steps' inductor kernels with programmatic dependent launch; "
         "independent small kernels fused into one launch). The result row records it resolved, every field",
         "Kernel tuning", "system"),
)}

# Serving (`python -m workbench serve-bench`, workbench/serving): in-flight batching under a request load. Declared
# here like every knob, in their own table: `bench`, studies and the Run form never read them (a knob in KNOBS must
# reach all of those); `ServeConfig` (workbench.serving.config) has one field per SERVE_RUN_KNOBS + SERVE_KNOBS knob,
# the serve-bench flags come from the same declarations, and results.schema declares their columns.
SERVE_RUN_KNOBS = ("method", "k", "ngram_min", "ngram_max", "beam_width", "beam_length", "diversity_penalty",
                   "tree_depth", "tree_topk", "tree_budget", "hot_vocab", "eagle3_layers", "max_new_tokens",
                   "temperature", "top_k", "top_p", "seed",
                   "kv_block_size", "cuda_graphs", "graph_batch_sizes", "compile", "attention", "prefill_graphs", "pdl",
                   "kernel_tuning")  # bench knobs serving reads
SCHED_POLICIES = ("no_evict", "max_util")
FEATURE_METHODS = ("redrafter", "eagle", "eagle3")  # heads over the target's hidden states (`Drafter.wants_hidden`)
SERVE_KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("rate", "float", 0.0, "request arrival rate in requests/s (0 = all requests arrive at once)", "Request rate",
         "load", 0.0, 1e6),
    Knob("arrival", "str", "poisson", "arrival process: poisson (exponential gaps), gamma (gaps ~ Gamma(burstiness, "
         "1 / (rate x burstiness)); burstiness < 1 is burstier), or concurrency (a new request is sent whenever fewer "
         "than max_concurrency are in the system)", "Arrivals", "load", choices=("poisson", "gamma", "concurrency")),
    Knob("burstiness", "float", 1.0, "gamma shape of the arrival gaps (1 = poisson)", "Burstiness", "load", 0.01,
         100.0),
    Knob("max_concurrency", "int", 0, "at most this many requests in the system (0 = no limit; arrival "
         "concurrency needs it)", "Max concurrency", "load", 0, 100_000),
    Knob("num_requests", "int", 32, "measured requests", "Requests", "load", 1, 1_000_000),
    Knob("warmup_requests", "int", 0, "requests served before the measured ones and left out of every metric",
         "Warm-up requests", "load", 0, 100_000),
    Knob("lengths", "str", "file", "prompt lengths: file (the prompt file's prompts, cycled; output max_new_tokens "
         "each) or random (random tokens, input_len and max_new_tokens scaled by a uniform factor in "
         "[1 - range_ratio, 1 + range_ratio])", "Lengths", "load", choices=("file", "random")),
    Knob("input_len", "int", 64, "random lengths: mean prompt tokens", "Input length", "load", 1, 1_000_000),
    Knob("range_ratio", "float", 0.0, "random lengths: spread of prompt and output lengths", "Range ratio", "load",
         0.0, 1.0),
    Knob("shared_prefix_len", "int", 0, "random lengths: tokens of one common prefix every prompt starts with "
         "(exercises prefix reuse)", "Shared prefix", "load", 0, 1_000_000),
    Knob("slo_ttft_ms", "float", 0.0, "goodput SLO: time to first token <= this (0 = no bound)", "SLO TTFT ms",
         "load", 0.0, 1e9),
    Knob("slo_tpot_ms", "float", 0.0, "goodput SLO: time per output token <= this (0 = no bound)", "SLO TPOT ms",
         "load", 0.0, 1e9),
    Knob("sched_policy", "str", "no_evict", "capacity scheduler: no_evict admits a request only when its worst-case "
         "KV blocks fit beside everyone's; max_util admits greedily and, when blocks run out, preempts the most "
         "recently admitted request and recomputes it later", "Scheduler policy", "serving", choices=SCHED_POLICIES),
    Knob("kv_blocks", "int", 0, "KV blocks in the target's pool (0 = enough for max_num_seqs worst-case requests)",
         "KV blocks", "serving", 0, 10_000_000),
    Knob("max_num_seqs", "int", 16, "most sequences in a step (rows of the KV cache)", "Max sequences", "serving", 1,
         4096),
    Knob("prefill_chunk", "int", 0, "prompt tokens prefilled per engine iteration, between decode steps (0 = whole "
         "prompts at once)", "Prefill chunk", "serving", 0, 1_000_000),
    Knob("gc_freeze", "bool", True, "collect Python's garbage and freeze the heap (gc.freeze) before the measured run, "
         "as vLLM does after its start-up: the collector then never rescans the engine's long-lived objects inside "
         "the run (off: its pauses land in TPOT at random)", "Freeze the GC heap", "serving"),
    Knob("prefix_caching", "bool", False, "share full prompt blocks between requests with the same prefix (hashed "
         "blocks, reference counts); not with eagle or redrafter (their heads read the target's hidden states of the "
         "whole prompt, which a shared block never computes)", "Prefix caching", "serving"),
    Knob("greedy_check_requests", "int", 16, "temperature 0: after the timed run (untimed), decode up to this many "
         "of the served requests alone (batch 1, autoregressive, the run's engine settings) and record whether each "
         "served output equals it (greedy_matches_solo; greedy_solo_compared counts them; 0 = no check)",
         "Solo greedy check (requests)", "serving", 0, 1_000_000),
    Knob("k_by_batch", "str", "", "adaptive draft length by live batch size, vLLM-style inclusive ranges "
         "'start-end:k,...' (e.g. '1-4:4,5-8:2,9-64:0'; sizes not covered use k; empty = always k)",
         "Draft length by batch size", "adaptive", searchable=False),
    Knob("spec_off_acceptance", "float", 0.0, "a request stops drafting when its acceptance rate over the last "
         "spec_window steps falls below this (0 = never)", "Switch-off acceptance", "adaptive", 0.0, 1.0),
    Knob("spec_window", "int", 8, "steps in a request's acceptance window", "Acceptance window", "adaptive", 1,
         100_000),
    Knob("spec_off_queue", "int", 0, "no drafts in a step while at least this many requests wait for a row (0 = "
         "never): under overload speculation's extra work per step can cost more throughput than it gains (a draft "
         "model at 1.5x saturation), and batch size alone cannot tell overload from a full "
         "batch; served with a draft model it lost (0.66-0.80 of the best: catch-ups, no full overlap)", "Switch-off queue", "adaptive", 0, 1_000_000),
    Knob("spec_max_context", "int", 0, "past this context length a request drafts at most long_context_k tokens "
         "(0 = no limit)", "Long-context limit", "adaptive", 0, 10_000_000),
    Knob("long_context_k", "int", 0, "draft length past spec_max_context (0 = no drafts)", "Long-context k",
         "adaptive", 0, 16),
    Knob("spec_catch_up_max", "int", 0, "a request whose draft model missed more than this many generated tokens "
         "(it decoded that long while its batch size was at k = 0) does not draft when the batch dips to a drafting "
         "size: no whole-context catch-up for a dip (0 = no limit: always catch up)", "Catch-up limit", "adaptive",
         0, 10_000_000),
    # where a measured k_by_batch comes from (workbench/serving/calibrate.py): isolated decode steps leave out prefill
    # interleaving and draft catch-up, so they over-rate speculation under load; short closed-loop serves do not
    Knob("calibration", "str", "off", "measure the draft length per batch size before the run and serve with it "
         "(instead of k_by_batch): off; step = time isolated decode steps per (batch bucket, k), pick the most "
         "tokens/ms; loop = a short closed-loop serve per (batch bucket as concurrency, k in 0..k) on the same "
         "engine, pick the most output tokens/s (ties within 2 % -> the smaller k)", "Calibrate schedule",
         "adaptive", choices=("off", "step", "loop")),
    Knob("calibration_shape", "str", "sticky", "calibration loop: how the measured tokens/s per (batch size, k) "
         "become a schedule: sticky = from the smallest batch size up, a size keeps the previous size's k unless a "
         "shorter draft wins by more than the tie margin (no threshold where the measurements tie); "
         "monotone = the draft length never grows with the batch size (the best such sequence over the measured "
         "sizes, ties to the shorter draft: a tie at a bucket edge becomes a threshold); free = each "
         "batch size's own best k (noisy single runs can then make bands such as 4 / 0 / 3)",
         "Schedule shape", "adaptive", choices=("sticky", "monotone", "free")),
    Knob("calibration_budget_s", "float", 60.0, "calibration loop: wall-clock budget in seconds; (batch, k) runs "
         "that would end past it are skipped and listed in calibration_table", "Calibration budget (s)", "adaptive",
         1.0, 3600.0),
    Knob("calibration_repeats", "int", 3, "calibration loop: runs per (batch size, k), in passes over every point, the "
         "median counts (a single short run can read 20 % off); runs past the budget are skipped, "
         "so a tight budget measures every batch size once before repeating any",
         "Calibration repeats", "adaptive", 1, 9),
    Knob("serve_tuning", "str", "", "how the serving loop itself runs, as field=value,... (workbench/serving/tuning.py "
         "ServeTuning; empty = the measured defaults): batch_prefill (the most prefill chunks per forward; 0 or 1: "
         "a forward per request), overlap_prefill (1/0: the prefill enqueued behind the step in flight), "
         "full_overlap (1/0: each step launched before the previous one is read, where that applies). The row "
         "records it resolved, every field", "Serving loop tuning", "serving"),
)}


def parse_k_by_batch(text: str) -> list[tuple[int, int, int]]:
    """'1-4:4,5-8:2,9-64:0' -> [(1, 4, 4), (5, 8, 2), (9, 64, 0)]: inclusive batch-size ranges, increasing and
    disjoint (vLLM's `[[start_bs, end_bs, k], ...]`). A single size may be written '3:2'.

    >>> parse_k_by_batch("1-2:3, 3:1")
    [(1, 2, 3), (3, 3, 1)]
    """
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            sizes, _, k = part.partition(":")
            lo, _, hi = sizes.partition("-")
            item = (int(lo), int(hi or lo), int(k))
        except ValueError:
            raise SettingError(f"k_by_batch part {part!r} is not 'start-end:k' (e.g. '1-4:4')", "k_by_batch") from None
        if item[0] < 1 or item[1] < item[0] or not 0 <= item[2] <= 16:
            raise SettingError(f"k_by_batch part {part!r}: need 1 <= start <= end and 0 <= k <= 16", "k_by_batch")
        if out and item[0] <= out[-1][1]:
            raise SettingError(f"k_by_batch ranges must increase without overlap: {part!r} starts at or before "
                               f"{out[-1][1]}", "k_by_batch")
        out.append(item)
    return out


def check_serve(values: Mapping[str, Any]) -> None:
    """The run knobs serving reads (through `check`) plus the serving knobs and their rules; SettingError names
    the first problem."""
    check({k: v for k, v in values.items() if k in KNOBS})
    for name, value in values.items():
        if name == "k_by_batch":  # free text, checked by its parser below
            if not isinstance(value, str):
                raise SettingError(f"k_by_batch={value!r} must be text like '1-4:4,5-8:2'", name)
        elif name in SERVE_KNOBS:
            SERVE_KNOBS[name].check(value)
    v = {name: values.get(name, knob.default) for name, knob in {**KNOBS, **SERVE_KNOBS}.items()}
    parse_k_by_batch(v["k_by_batch"])
    if v["arrival"] == "concurrency" and v["max_concurrency"] < 1:
        raise SettingError("arrival concurrency needs --max-concurrency N (N >= 1 requests in flight)",
                           "max_concurrency")
    if v["cuda_graphs"] is True and v["max_num_seqs"] > max(v["graph_batch_sizes"]):
        raise SettingError(f"max_num_seqs {v['max_num_seqs']} exceeds the largest graph bucket: add a bucket >= "
                           f"{v['max_num_seqs']} to --graph-batch-sizes or lower --max-num-seqs", "graph_batch_sizes")
    if v["calibration"] != "off" and v["k_by_batch"].strip():
        raise SettingError(f"calibration {v['calibration']!r} measures k_by_batch itself: drop --k-by-batch "
                           f"{v['k_by_batch']!r} or set --calibration off", "calibration")
    if v["calibration"] != "off" and v["method"] == "ar":
        raise SettingError("calibration measures draft lengths: method 'ar' has none; choose a speculative method "
                           "or set --calibration off", "calibration")
    if v["prefix_caching"] is True and v["method"] in FEATURE_METHODS:
        raise SettingError(f"prefix caching with method {v['method']!r} is not supported: its head reads the target's "
                           "hidden states of the whole prompt, which shared prefix blocks never compute; turn "
                           "--prefix-caching off", "prefix_caching")
    if v["arrival"] == "gamma" and v["rate"] == 0:
        raise SettingError("arrival gamma needs --rate > 0 (requests/s)", "rate")


AUTO_KNOBS = tuple(k.name for k in KNOBS.values() if k.auto)  # dtype, cuda_graphs, compile
# what "auto" becomes on a CPU: float32, and the eager step (tiny on a CPU ran fastest with graphs and compile off)
CPU_AUTO = {"dtype": "float32", "cuda_graphs": False, "compile": "off"}


def auto_value(name: str, device_type: str, values: Mapping[str, Any], *, model_dtype: str | None = None,
               bf16_supported: bool = True) -> Any:
    """What knob `name`'s "auto" means on `device_type` ("cuda" or "cpu"), as vLLM and SGLang default on a GPU:
    the model's own half dtype (`model_dtype`, from its config; a float32 or unknown one becomes bfloat16, or float16
    where the GPU lacks bfloat16), CUDA graphs on when the batch (or max_num_seqs) fits the largest graph bucket, and
    compile "default". `values` gives the other knobs (missing ones take their defaults).

    >>> auto_value("dtype", "cuda", {}, model_dtype="float16"), auto_value("dtype", "cuda", {}, model_dtype="float32")
    ('float16', 'bfloat16')
    >>> auto_value("cuda_graphs", "cuda", {"batch": 128}), auto_value("compile", "cpu", {})
    (False, 'off')
    """
    if name not in AUTO_KNOBS:
        raise SettingError(f"{name} has no auto value; knobs that take auto: {', '.join(AUTO_KNOBS)}", name)
    if device_type != "cuda":
        return CPU_AUTO[name]
    if name in ("cuda_graphs", "compile") and (values.get("tp_size") or 1) > 1:
        return CPU_AUTO[name]  # the tensor-parallel step runs its collectives eagerly (not captured or compiled yet)
    if name == "dtype":
        if model_dtype in choices.HALF_DTYPES:
            return model_dtype
        return "bfloat16" if bf16_supported else "float16"
    if name == "cuda_graphs":
        buckets = values.get("graph_batch_sizes", KNOBS["graph_batch_sizes"].default)
        rows = max(values.get("batch", 1) or 1, values.get("max_num_seqs", 1) or 1)
        return rows <= max(buckets)
    return "default"  # compile


def engine_default(name: str) -> Any:
    """Knob `name`'s default as a concrete engine value: the registry default, or for an "auto" one its CPU value
    (the engine is handed resolved configs; this is what a bare EngineConfig() runs).

    >>> engine_default("overlap"), engine_default("cuda_graphs"), engine_default("compile")
    (True, False, 'off')
    """
    default = KNOBS[name].default
    return CPU_AUTO[name] if KNOBS[name].auto and default == AUTO else default


def resolve_auto(values: Mapping[str, Any], device_type: str, *, model_dtype: str | None = None,
                 bf16_supported: bool = True) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(values with every "auto" replaced by `auto_value`, the names that were "auto"). Explicit values are kept.

    >>> resolve_auto({"cuda_graphs": "auto", "compile": "off"}, "cuda")
    ({'cuda_graphs': True, 'compile': 'off'}, ('cuda_graphs',))
    """
    out, resolved = dict(values), []
    for name in AUTO_KNOBS:
        if isinstance(out.get(name), str) and out[name] == AUTO:
            out[name] = auto_value(name, device_type, out, model_dtype=model_dtype, bf16_supported=bf16_supported)
            resolved.append(name)
    return out, tuple(resolved)


def resolve_config(cfg: Any, device_type: str, *, dtype_auto: bool = False, **kw: Any) -> tuple[Any, tuple[str, ...]]:
    """A run config (BenchConfig, ServeConfig) with its "auto" fields resolved (`resolve_auto`), and the names of the
    knobs that were auto; `dtype_auto`: the session's dtype (not a config field) was asked as auto, named first."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    resolved, names = resolve_auto(values, device_type, **kw)
    return (dataclasses.replace(cfg, **{n: resolved[n] for n in names}),
            ("dtype",) * dtype_auto + names)
def parse_aux_layers(text: str) -> tuple[int, ...] | None:
    """The `eagle3_layers` setting: "auto" -> None (the head's own, else the default rule), "2,6,9" -> (2, 6, 9).

    >>> parse_aux_layers("auto"), parse_aux_layers("1, 3,5")
    (None, (1, 3, 5))
    """
    text = str(text).strip()
    if text.lower() == AUTO:
        return None
    try:
        layers = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise ValueError(f"eagle3_layers={text!r} is not 'auto' or three layer indices like '2,6,9'") from None
    if len(layers) != 3 or any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0:
        raise ValueError(f"eagle3_layers={text!r} must be three increasing layer indices >= 0, like '2,6,9'")
    return layers


TUNING_PARSERS = {"kernel_tuning": parse_tuning, "serve_tuning": parse_serve_tuning,  # text knobs of records
                  "eagle3_layers": parse_aux_layers}


def _check_tuning(name: str, value: Any) -> None:
    """A tuning knob's text parses (its parser's error, a ValueError naming the field, as a SettingError)."""
    if not isinstance(value, str):
        raise SettingError(f"{name}={value!r} must be text like 'field=value,field=value'", name)
    try:
        TUNING_PARSERS[name](value)
    except ValueError as e:
        raise SettingError(f"{name}: {e}", name) from None


RUN_KNOBS = tuple(k for k in KNOBS.values() if k.scope == "run")          # the fields of BenchConfig
SESSION_KNOBS = tuple(k for k in KNOBS.values() if k.scope == "session")  # arguments of BenchSession.load


def check(values: Mapping[str, Any]) -> None:
    """Check a run's settings: each knob the method reads, then the rules between knobs (a missing knob takes its
    default). Raise SettingError for the first problem.

    >>> check({"method": "ngram", "ngram_min": 3, "ngram_max": 2})
    Traceback (most recent call last):
    workbench.settings.SettingError: n-gram sizes need 1 <= ngram_min <= ngram_max, got 3, 2
    """
    method = values.get("method", KNOBS["method"].default)
    KNOBS["method"].check(method)
    for name, value in values.items():
        if name in KNOBS and KNOBS[name].reads(method):
            KNOBS[name].check(value)
    v = {name: values.get(name, knob.default) for name, knob in KNOBS.items()}
    if KNOBS["ngram_min"].reads(method) and v["ngram_min"] > v["ngram_max"]:
        raise SettingError(f"n-gram sizes need 1 <= ngram_min <= ngram_max, got {v['ngram_min']}, {v['ngram_max']}",
                           "ngram_max")
    if KNOBS["tree_budget"].reads(method):
        depth, topk, budget = v["tree_depth"], v["tree_topk"], v["tree_budget"]
        if budget < depth:
            raise SettingError(f"tree_budget={budget} is below tree_depth={depth}: the budget must hold at least one "
                               f"full-depth path; raise tree_budget to >= {depth} or lower tree_depth", "tree_budget")
        if budget > tree_capacity(depth, topk):
            raise SettingError(f"tree_budget={budget} exceeds the {tree_capacity(depth, topk)} candidates that "
                               f"tree_depth={depth}, tree_topk={topk} offer (K + (D-1) K^2): lower tree_budget or "
                               f"raise tree_topk / tree_depth", "tree_budget")
    if v["cuda_graphs"] is True and v["batch"] > max(v["graph_batch_sizes"]):
        raise SettingError(f"batch {v['batch']} exceeds the largest graph bucket {max(v['graph_batch_sizes'])}: add "
                           f"a bucket >= {v['batch']} to --graph-batch-sizes or turn --cuda-graphs off",
                           "graph_batch_sizes")


def dataclass_of(name: str, knobs: Iterable[Knob], *, quick: bool = False, module: str, doc: str,
                 bases: tuple[type, ...] = ()) -> type:
    """A frozen, keyword-only dataclass with one field per knob, defaulting to the knob's default (or its quick
    default). A list given for an "ints" knob is stored as a tuple, so configs stay hashable and compare equal.

    >>> Cfg = dataclass_of("Cfg", [KNOBS["k"], KNOBS["graph_batch_sizes"]], module=__name__, doc="")
    >>> Cfg(graph_batch_sizes=[1, 2])
    Cfg(k=4, graph_batch_sizes=(1, 2))
    """
    knobs = tuple(knobs)
    lists = tuple(k.name for k in knobs if k.kind == "ints")

    def __post_init__(self) -> None:
        for field_name in lists:
            value = getattr(self, field_name)
            if isinstance(value, list):
                object.__setattr__(self, field_name, tuple(value))

    fields = [(k.name, KINDS[k.kind], dataclasses.field(default=k.quick if quick else k.default)) for k in knobs]
    cls = dataclasses.make_dataclass(name, fields, bases=bases, frozen=True, kw_only=True,
                                     namespace={"__doc__": doc, "__post_init__": __post_init__})
    cls.__module__ = module  # where it is defined, so pickling finds it (make_dataclass takes module= from 3.12)
    return cls


for _knob in KNOBS.values():
    register_column(_knob.name, _knob.column_kind, "config", _knob.help)
for _knob in SERVE_KNOBS.values():
    register_column(_knob.name, _knob.column_kind, "config", _knob.help)

# Form layout (ui/run_page.py, ui/tune_page.py): knobs that only change anything on a CUDA GPU, hidden where no GPU is
# visible so they keep their defaults; and the few knobs a user sets first (model shape of the draft, batch, tokens,
# sampling), shown above the "Advanced" expander that holds every other knob.
GPU_ONLY_KNOBS = ("cuda_graphs", "graph_batch_sizes", "prefill_graphs", "compile", "compile_prefill", "overlap",
                  "attention", "pdl", "quant_kernel", "gemv_fusion", "kernel_tuning", "phase_profile")
BASIC_KNOBS = ("method", "k", "ngram_min", "ngram_max", "beam_width", "beam_length", "tree_depth", "tree_topk",
               "tree_budget", "batch", "max_new_tokens", "num_prompts", "temperature", "top_k", "top_p")
