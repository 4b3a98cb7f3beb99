"""Benchmark runner: the baseline and the candidate on the same prompts, seeds and process; one result-store row.

    session = BenchSession.load(preset="tiny", device="cpu")          # models loaded once, reused across runs
    result = session.run(BenchConfig(method="draft", k=4, batch=2, max_new_tokens=64))
    result.record   # flat dict, one row of the result store (columns: docs/INTERFACES.md)
    result.traces   # DataFrame, one row per (sequence, target step)

Per repeat, our autoregressive baseline (the same engine with no drafter) and the candidate run over the same
prompts in the same batches, interleaved: AR, candidate, AR, candidate, ... (ABAB), so a machine that slows down or
speeds up during the run moves both sides of each pair alike. tokens/s are medians over repeats and speedup is their
ratio; every record also carries the spread (per-repeat tokens/s, their CVs, a Student-t interval of the
speedup, `noisy`) and plausibility checks (`plausible`), from `workbench.harness.trust`. Settings are checked
before any work starts; running out of GPU memory becomes a BenchError that names the settings.
"""
from __future__ import annotations

import json
import resource
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from workbench import settings
from workbench.engine.drafters import (UNTRAINED_HEAD_SEED, Drafter, DrafterError, Eagle3Head, EagleHead, RedrafterHead,
                                       engine_target, make_drafter)
from workbench.engine import GenerationResult, SpecEngine
from workbench.engine.step import engine_config
from workbench.harness.metrics import greedy_agreement, median, percentile, summarize, traces_frame
from workbench.harness.quality import check_weight_formats, quality_columns, quant_key, quantized_model
from workbench.harness.trust import trust_columns
from workbench.engine.graphs import compile_fallback_columns, recompile_limit_hits
from workbench.engine.kv_cache import resolve_attention
from workbench.engine.sampling import SamplingParams
from workbench.models import DTYPES, stored_dtype
from kernels.int4_cuda import int4_cuda_gemv_applies
from kernels.tuning import format_tuning, parse_tuning
from kernels.pdl import pdl_applies

# Greedy parity in bf16/fp16 is not exact: a 1-token decode and a (k+1)-token verify reduce in different orders, so
# two nearly tied logits can swap. Where outputs diverge we re-score the divergence point in float32 and call it a
# numerical near-tie when the two competing tokens' fp32 logits differ by at most this much. float32 runs get no
# such allowance (they must match exactly; measured on the H200: they do).
NEAR_TIE_LOGITS = 0.25
REDRAFTER_HEAD_SEED = EAGLE_HEAD_SEED = UNTRAINED_HEAD_SEED  # an untrained head's initialisation
# Engines a session keeps between runs (each holds KV caches and captured graphs), so a study's trials that come back
# to a setting reuse its captures: 17 holds AR plus every k of two chain drafters (1 + 2 x 8, the best_k space; 16
# dropped one, rebuilt and recaptured whenever it came back). On a GPU the oldest are also dropped while the kept ones
# hold more than ENGINE_CACHE_MEMORY_FRACTION of the device's memory.
ENGINE_CACHE_SIZE = 17
ENGINE_CACHE_MEMORY_FRACTION = 0.25
# Method knobs that shape no KV cache or engine buffer, so runs that differ only in them share one engine, which gets a
# fresh drafter object (NgramDrafter keeps only its device lookup step, whose graphs the new object captures again in
# the run's warm-up: a few kernels over the token buffer).
HOST_ONLY_KNOBS = {"ngram": ("ngram_min", "ngram_max")}
# EngineConfig fields swapped into a kept engine per run (`engine.config = ...`); the others key the kept engines
PER_RUN_ENGINE_FIELDS = ("max_new_tokens", "sampling", "seed", "timing", "stop_on_eos", "eos_token_id", "overlap")


class BenchError(Exception):
    """A setting the engine cannot run, a bad model/prompt input, or a run that failed (e.g. out of memory)."""


BenchConfig = settings.dataclass_of("BenchConfig", settings.RUN_KNOBS, module=__name__, doc="""One benchmark's
settings: one frozen, keyword-only field per run knob of `workbench.settings.KNOBS` (type, default, bounds and help live
there; the CLI, studies, the dashboard and the result schema are generated from the same declarations).

    >>> BenchConfig(method="ngram", k=3).k, BenchConfig().graph_batch_sizes
    (3, (1, 2, 4, 8, 16, 32, 64))
""")


METHODS = settings.METHODS  # name -> Method (description, knobs it reads)


@dataclass
class BenchResult:
    record: dict
    traces: pd.DataFrame
    outputs: list[list[int]] = field(default_factory=list)
    ar_outputs: list[list[int]] = field(default_factory=list)


class BenchSession:
    """Target (+ draft) model, tokenizer and default prompts, loaded once."""

    def __init__(self, target, draft, tokenizer, prompts, *, device: torch.device, dtype: str, preset: str | None,
                 target_path: str, draft_path: str | None, prompts_source: str, dtype_auto: bool = False,
                 draft_head: str | None = None):
        self.target, self.draft, self.tokenizer, self.prompts = target, draft, tokenizer, prompts
        self.device, self.dtype, self.preset = device, dtype, preset
        self.dtype_auto = dtype_auto  # dtype was asked as "auto" (self.dtype is what it resolved to)
        self.target_path, self.draft_path, self.prompts_source = target_path, draft_path, prompts_source
        self._engines: dict[tuple, SpecEngine] = {}  # engines (caches, graphs) reused across runs and trials
        self._redrafter: tuple[RedrafterHead, str] | None = None  # (head, where it came from), loaded once
        self._eagle: tuple[EagleHead, str] | None = None
        self._eagle3: tuple[Eagle3Head | None, str] | None = None
        self.draft_head_path = draft_head  # --draft-head: a published EAGLE-1/2 or EAGLE-3 checkpoint folder
        self._published = None  # its LoadedHead, loaded on first use
        self._head_info: dict[str, dict] = {}  # method -> the draft_head* columns of the head it runs
        self._quantized: dict[tuple, torch.nn.Module] = {}  # (role, format, group, kernel, fusion) -> copy (quality.py)
        self._quality_cache: dict[tuple, object] = {}  # perplexities, reference outputs, calibration ids
        self._encoded: list[list[int]] = []  # the prompts tokenized so far, in order (encode once per session)
        self._environment: dict | None = None  # environment_info() of the device, read once (see environment())
        self._idle_bytes = 0  # GPU bytes held by kept engines that the current run does not use

    @classmethod
    def load(cls, preset: str | None = None, model: str | None = None, draft: str | None = None, device: str = "auto",
             dtype: str = settings.KNOBS["dtype"].default, prompts: str | None = None,
             draft_head: str | None = None) -> "BenchSession":
        from workbench.models import ModelLoadError, load_model, load_tokenizer, tokenizer_fingerprint
        from workbench.harness.prompts import PromptFileError, load_prompts
        from workbench.zoo import ZooError, resolve_preset

        if dtype != settings.AUTO and dtype not in DTYPES:
            raise BenchError(f"unknown dtype {dtype!r}; choose one of {settings.AUTO}, {', '.join(DTYPES)}")
        kind, _, index = str(device).partition(":")  # the devices the engine runs on: auto, cpu, cuda, cuda:N
        if not (device in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit())):
            raise BenchError(f"device={device!r} is not a device the engine runs on; use --device auto, cpu, cuda "
                             "or cuda:N (N a GPU index)")
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                           "cpu" if device == "auto" else device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise BenchError(f"device {device!r} asked for, but no CUDA GPU is visible; use --device cpu")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise BenchError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                             f"numbered from 0; use --device cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        prompts_path = prompts
        if preset is not None:
            if model is not None:
                raise BenchError("give either --preset or --model/--draft, not both")
            try:
                paths = resolve_preset(preset)
            except ZooError as e:
                raise BenchError(str(e)) from None
            model, draft = str(paths.target_dir), str(paths.draft_dir)
            prompts_path = prompts_path or str(paths.prompts_path)
        if model is None:
            raise BenchError("no model: give --preset NAME or --model PATH (a Hugging Face folder or a .gguf file)")
        dtype_auto = dtype == settings.AUTO
        dtype = auto_dtype(dtype, dev, model)
        try:
            target = load_model(model, dtype=DTYPES[dtype], device=dev).eval()
            tokenizer = load_tokenizer(model)
            draft_model = None
            if draft is not None:
                draft_model = load_model(draft, dtype=DTYPES[dtype], device=dev).eval()
                if draft_model.config.vocab_size != target.config.vocab_size:
                    raise BenchError(f"draft {draft} has vocabulary size {draft_model.config.vocab_size}, target "
                                     f"{model} has {target.config.vocab_size}: they must share one tokenizer")
                if tokenizer_fingerprint(draft) != tokenizer_fingerprint(model):
                    raise BenchError(f"draft {draft} and target {model} use different tokenizers "
                                     "(tokenizer.json vocabularies differ); speculation needs one shared tokenizer")
        except ModelLoadError as e:
            raise BenchError(str(e)) from None
        if prompts_path is None:
            raise BenchError("no prompts: give --prompts FILE (JSONL {\"prompt\": ...} or question.jsonl)")
        try:
            prompt_list = load_prompts(prompts_path)
        except PromptFileError as e:
            raise BenchError(str(e)) from None
        if dev.type == "cuda":
            _hold_nvml()
        return cls(target, draft_model, tokenizer, prompt_list, device=dev, dtype=dtype, preset=preset,
                   target_path=str(model), draft_path=str(draft) if draft else None, prompts_source=str(prompts_path),
                   dtype_auto=dtype_auto, draft_head=str(draft_head) if draft_head else None)

    def resolve(self, cfg: BenchConfig) -> tuple[BenchConfig, tuple[str, ...]]:
        """cfg with its "auto" knobs resolved for this session's device (settings.resolve_config), and the names of
        every knob that was auto, dtype included when the session's was."""
        return settings.resolve_config(cfg, self.device.type, dtype_auto=self.dtype_auto)

    def _load_head(self, kind: str, head_cls, seed: int):
        """(head, source): the trained `kind` head beside the target folder (`<preset>/<kind>`, written by `zoo
        train-head`) after checking it was trained for this target and tokenizer; else an untrained head from a
        fixed seed (source "untrained (seed N)")."""
        from workbench.models import tokenizer_fingerprint
        from workbench.zoo.heads import check_head, has_head, head_dir_for_target
        from workbench.zoo.presets import ZooError

        folder = head_dir_for_target(self.target_path, kind) if Path(self.target_path).is_dir() else None
        if folder is not None and has_head(folder):
            try:
                check_head(folder, self.target_path, tokenizer_fingerprint(self.tokenizer))
            except ZooError as e:
                raise BenchError(str(e)) from None
            p = next(self.target.parameters())
            head_cls = head_cls or Eagle3Head
            return head_cls.load(folder, device=p.device, dtype=p.dtype), str(folder)
        if head_cls is None:  # the registry makes it (its shape depends on the run's settings)
            return None, f"untrained (seed {seed})"
        return head_cls.for_target(self.target, seed=seed), f"untrained (seed {seed})"

    def published_head(self, method: str):
        """The --draft-head checkpoint (`drafters.published.load_published_head`, loaded once, checked against the
        target) if it is `method`'s layout; None without --draft-head; BenchError for the other method's layout."""
        if self.draft_head_path is None:
            return None
        if self._published is None:
            from workbench.engine.drafters.published import load_published_head

            try:
                self._published = load_published_head(self.draft_head_path, self.target, tokenizer=self.tokenizer)
            except ValueError as e:
                raise BenchError(str(e)) from None
        if self._published.method != method:
            raise BenchError(f"--draft-head {self.draft_head_path} is an {self._published.layout} head: run it with "
                             f"--method {self._published.method}, not {method}")
        return self._published

    def _note_head(self, method: str, head, source: str, layout: str, stored_dtype: str | None = None) -> None:
        self._head_info[method] = {
            "draft_head": source, "draft_head_layout": layout,
            "draft_head_dtype": stored_dtype or str(next(head.parameters()).dtype).removeprefix("torch."),
            "draft_head_params": sum(p.numel() for p in head.parameters()),
            "draft_vocab_size": head.config.draft_vocab_size if isinstance(head, Eagle3Head) else None}

    def redrafter_head(self) -> RedrafterHead:
        """The ReDrafter head (`_load_head`), loaded once."""
        if self._redrafter is None:
            self._redrafter = self._load_head("redrafter", RedrafterHead, REDRAFTER_HEAD_SEED)
            self._note_head("redrafter", self._redrafter[0], self._redrafter[1], "workbench")
        return self._redrafter[0]

    def eagle_head(self) -> EagleHead:
        """The EAGLE head: the --draft-head checkpoint (EAGLE-1/2 layout), else `_load_head`; loaded once; a head
        for another target shape is refused by name."""
        if self._eagle is None:
            published = self.published_head("eagle")
            if published is not None:
                head, source = published.head, published.source
                self._note_head("eagle", head, source, "eagle", published.stored_dtype)
            else:
                head, source = self._load_head("eagle", EagleHead, EAGLE_HEAD_SEED)
                self._note_head("eagle", head, source, "workbench" if head.config.style == "workbench" else "eagle")
            try:
                head.check_target(self.target)
            except ValueError as e:
                raise BenchError(f"{source}: {e}") from None
            self._eagle = (head, source)
        return self._eagle[0]

    def eagle3_head(self) -> Eagle3Head | None:
        """The EAGLE-3 head: the --draft-head checkpoint (EAGLE-3 layout), else the zoo head beside the target
        (`<preset>/eagle3`, checked like the others), else None: the drafter registry then makes an untrained one
        over the run's eagle3_layers (recorded as "untrained (seed N)")."""
        if self._eagle3 is None:
            published = self.published_head("eagle3")
            if published is not None:
                self._eagle3 = (published.head, published.source)
                self._note_head("eagle3", published.head, published.source, "eagle3", published.stored_dtype)
            else:
                head, source = self._load_head("eagle3", None, EAGLE_HEAD_SEED)
                self._eagle3 = (head, source)
                if head is not None:
                    self._note_head("eagle3", head, source, "eagle3")
        return self._eagle3[0]

    @property
    def eagle_head_source(self) -> str | None:
        """The loaded EAGLE head's folder, "untrained (seed N)", or None before any eagle run."""
        return self._eagle[1] if self._eagle is not None else None

    @property
    def eagle3_head_source(self) -> str | None:
        """The EAGLE-3 head's folder, "untrained (seed N)", or None before any eagle3 run."""
        return self._eagle3[1] if self._eagle3 is not None else None

    @property
    def redrafter_head_source(self) -> str | None:
        """The loaded ReDrafter head's folder, "untrained (seed N)", or None before any redrafter run."""
        return self._redrafter[1] if self._redrafter is not None else None

    def drafter(self, cfg) -> Drafter | None:
        """cfg.method's drafter (workbench.engine.drafters.make_drafter) over this session's models in the run's
        weight formats and its heads; models and heads are made only if the method reads them."""
        if cfg.method == "draft" and self.draft is None:
            raise BenchError("method 'draft' needs a draft model: give --draft PATH or use a --preset")
        try:
            return make_drafter(cfg.method, cfg, draft=lambda: self.model_for("draft", cfg),
                                target=lambda: self.model_for("target", cfg),
                                heads={"redrafter": self.redrafter_head, "eagle": self.eagle_head,
                                       "eagle3": self.eagle3_head})
        except DrafterError as e:
            raise BenchError(str(e)) from None

    def model_for(self, role: str, cfg: BenchConfig) -> torch.nn.Module:
        """The target or draft model in the run's weight format: the loaded model for "none", else a quantized copy
        made on first use and kept (workbench.harness.quality)."""
        return quantized_model(self, role, cfg)

    # -- validation ---------------------------------------------------------------------------------------------
    def check(self, cfg: BenchConfig, prompt_ids: list[list[int]]) -> None:
        """Every setting checked before work starts; BenchError names the bad value and the allowed range."""
        if cfg.method == "redrafter" and self.draft_head_path is not None:
            raise BenchError(f"--draft-head {self.draft_head_path}: method redrafter loads no published head (no "
                             "engine publishes a ReDrafter layout); its head is the zoo's (zoo train-head --kind "
                             "redrafter): drop --draft-head or run eagle / eagle3")
        try:
            settings.check({f.name: getattr(cfg, f.name) for f in fields(cfg)})  # bounds, choices, cross rules
            SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)  # the sampler's own rule (top_p > 0)
            resolve_attention(cfg.attention, cfg.paged, self.device, cfg.target_kv_quant)  # "triton": paged, GPU
            if cfg.method == "draft":
                resolve_attention(cfg.attention, cfg.paged, self.device, cfg.draft_kv_quant)  # and the format
        except ValueError as e:
            raise BenchError(str(e)) from None
        if cfg.method == "draft" and self.draft is None:
            raise BenchError("method 'draft' needs a draft model: give --draft PATH or use a --preset")
        self._check_tp(cfg)
        try:
            check_weight_formats(self, cfg)  # fp8 on a CPU, an int4 group that does not divide a width, ...
        except ValueError as e:
            raise BenchError(str(e)) from None
        k = cfg.tree_budget if cfg.method in settings.TREE_METHODS else cfg.k if cfg.method != "ar" else 0  # nodes
        models = [("target", self.target)] + ([("draft", self.draft)] if cfg.method == "draft" else [])
        longest = max(len(p) for p in prompt_ids)
        for role, model in models:
            ctx = int(model.config.max_position_embeddings)
            if longest >= ctx:
                raise BenchError(f"a prompt has {longest} tokens; the {role} model's context is {ctx}: use shorter "
                                 "prompts (--prompts FILE)")
            need = longest + cfg.max_new_tokens + k + 2
            if need > ctx and ctx - longest - k - 2 < 1:  # no max_new_tokens fits: advise the prompt or k instead
                raise BenchError(f"a {longest}-token prompt with k={k} leaves no room for new tokens in the {role} "
                                 f"model's {ctx}-position context: use shorter prompts (--prompts FILE) or a "
                                 f"smaller k")
            if need > ctx:
                raise BenchError(f"max_new_tokens={cfg.max_new_tokens} with a {longest}-token prompt and k={k} needs "
                                 f"{need} positions; the {role} model's context is {ctx}: lower max_new_tokens to "
                                 f"<= {ctx - longest - k - 2}")

    def _check_tp(self, cfg: BenchConfig) -> None:
        """tp_size must be the world this session's target is sharded for (workbench.engine.tp), and the parts the
        tensor-parallel step does not run yet are refused by name."""
        world = getattr(self.target, "tp_world", 1)
        if cfg.tp_size != world:
            raise BenchError(f"tp_size={cfg.tp_size}, but this session's target runs in {world} process(es): "
                             "tensor parallelism needs one process per rank, which `python -m workbench bench "
                             "--tp-size N` starts (studies run tp_size 1 for now)")
        if world == 1:
            return
        unsupported = [(cfg.target_quant != "none", f"target_quant={cfg.target_quant} (quantized weights are not "
                        "sharded yet: use target_quant none)"),
                       (cfg.quant_kernel == "triton", "quant_kernel triton (its GEMVs are not sharded yet: "
                        "--quant-kernel auto)"),
                       (cfg.cuda_graphs, "cuda_graphs on (the step with its all-reduces is not captured yet: "
                        "--no-cuda-graphs)"),
                       (cfg.compile != "off", f"compile={cfg.compile} (not compiled with collectives yet: "
                        "--compile off)"),
                       (cfg.compare_hf, "compare_hf (Hugging Face generate runs on one device: --no-compare-hf)"),
                       (cfg.method in ("eagle", "redrafter") and cfg.hot_vocab > 0, f"hot_vocab={cfg.hot_vocab} (each "
                        "rank holds a vocabulary slice of the LM head, not the hot rows: --hot-vocab 0)"),
                       (cfg.phase_profile, "phase_profile (--no-phase-profile)")]
        named = [why for bad, why in unsupported if bad]
        if named:
            raise BenchError(f"tp_size={world} does not run with {'; '.join(named)}")

    def encode(self, n: int) -> list[list[int]]:
        """The first n prompts (cycled if the set is smaller), tokenized."""
        if not self.prompts:
            raise BenchError(f"prompt set {self.prompts_source} is empty")
        for i in range(len(self._encoded), min(n, len(self.prompts))):  # each prompt tokenized once per session
            ids = self.tokenizer.encode(self.prompts[i].text).ids
            if not ids:
                raise BenchError(f"prompt {self.prompts[i].id!r} encodes to no tokens")
            self._encoded.append(ids)
        return [list(self._encoded[i % len(self.prompts)]) for i in range(n)]

    def environment(self) -> dict:
        """`environment_info` for this session's device, read on the first run and kept: torch, the driver and the
        code a process runs do not change under it (git_commit is the checkout's state at the first run), and reading
        it costs two git calls and an NVML init per run."""
        if self._environment is None:
            from workbench.harness.telemetry import environment_info

            self._environment = environment_info(str(self.device) if self.device.type == "cuda" else None)
        return dict(self._environment)

    # -- running ------------------------------------------------------------------------------------------------
    def _engine(self, cfg: BenchConfig, drafter: bool) -> SpecEngine:
        """The engine for these settings: kept across runs (its KV caches and captured graphs with it) as long as
        the settings that shape them are the same; per-run settings (tokens, sampling, seed) are swapped in."""
        ecfg = engine_config(cfg, timing=True)
        # every engine field but the per-run ones shapes the engine (a field added to EngineConfig joins the key)
        shape = (*((f.name, getattr(ecfg, f.name)) for f in fields(ecfg) if f.name not in PER_RUN_ENGINE_FIELDS),
                 quant_key(cfg, "target"), cfg.quant_kernel, cfg.gemv_fusion)
        host_only = HOST_ONLY_KNOBS.get(cfg.method, ())
        method_knobs = tuple(getattr(cfg, k) for k in METHODS[cfg.method].knobs if k not in host_only) \
            if cfg.method in METHODS else ()
        # the draft's format with its int4 group size (the group is not a draft-method knob, so method_knobs lack it)
        key = (cfg.method, *method_knobs, quant_key(cfg, "draft"), *shape) if drafter else ("ar", *shape)
        engine = self._engines.pop(key, None)
        if engine is None:
            while self._engines and (len(self._engines) >= ENGINE_CACHE_SIZE or self._engines_over_memory()):
                self._engines.pop(next(iter(self._engines)))  # oldest first: its caches and graphs are freed
            made = self.drafter(cfg) if drafter else None
            engine = SpecEngine(engine_target(self.model_for("target", cfg), made), made, ecfg, self.device)
        elif drafter and host_only and any(engine.drafter.settings.get(k) != getattr(cfg, k) for k in host_only):
            engine.drafter = self.drafter(cfg)
        engine.config = ecfg
        self._engines[key] = engine  # most recent last
        return engine

    def _engines_over_memory(self) -> bool:
        """Whether the kept engines' KV caches and graph pools exceed ENGINE_CACHE_MEMORY_FRACTION of the GPU."""
        if self.device.type != "cuda":
            return False
        held = sum(_engine_bytes(e) for e in self._engines.values())
        return held > ENGINE_CACHE_MEMORY_FRACTION * torch.cuda.get_device_properties(self.device).total_memory

    def _pass(self, engine: SpecEngine, prompt_ids: list[list[int]], batch: int,
              split: PassSplit | None = None) -> list[GenerationResult]:
        """One pass over the prompts in batches of `batch`; `split` (timed passes) adds where each call's time went."""
        out = []
        for i in range(0, len(prompt_ids), batch):
            t_call = time.perf_counter()
            out.append(engine.generate(prompt_ids[i:i + batch]))
            if split is not None:
                split.add(t_call, out[-1], time.perf_counter())
        self._sync()
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, cfg: BenchConfig, prompts: list[list[int]] | None = None, *, study: str | None = None,
            trial_id: int | None = None, progress: Callable[[float, str], None] | None = None) -> BenchResult:
        """One benchmark; "auto" knobs are resolved for the device first, and the record holds what they became."""
        from workbench.harness.telemetry import GpuTelemetry

        cfg, auto_knobs = self.resolve(cfg)
        prompt_ids = prompts if prompts is not None else self.encode(cfg.num_prompts)
        self.check(cfg, prompt_ids)
        progress = progress or (lambda frac, msg: None)
        try:
            t_build = time.perf_counter()
            ar_engine = self._engine(cfg, drafter=False)
            cand_engine = self._engine(cfg, drafter=True) if cfg.method != "ar" else ar_engine
            engines = list({id(ar_engine): ar_engine, id(cand_engine): cand_engine}.values())
            build_s = time.perf_counter() - t_build
            stats_before = [e.graph_stats() for e in engines]
            fallbacks_before = recompile_limit_hits()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
                # kept engines this run does not use hold their memory throughout: not part of this run's peak
                self._idle_bytes = sum(_engine_bytes(e) for e in self._engines.values()
                                       if not any(e is used for used in engines))
            else:
                _reset_peak_rss()
            t_warm, warmup_s = time.perf_counter(), 0.0  # warm-up passes, less the graph captures made inside them
            for w in range(cfg.warmup):
                progress(0.0, "warm-up")
                for eng in engines:  # caches sized for the timed runs, a short pass, then every bucket captured
                    if w == 0:
                        eng.reserve(cfg.batch, max(len(p) for p in prompt_ids))
                    full = eng.config
                    eng.config = replace(full, max_new_tokens=min(cfg.max_new_tokens, 8))
                    t_pass, captured_before = time.perf_counter(), eng.graph_stats().capture_s
                    try:
                        self._pass(eng, prompt_ids[:cfg.batch], cfg.batch)
                    finally:
                        eng.config = full
                    warmup_s += time.perf_counter() - t_pass - (eng.graph_stats().capture_s - captured_before)
                    if w == 0:  # every bucket, and the prefill of every batch of the timed passes
                        eng.capture_graphs(cfg.batch, prompt_batches=[
                            [len(p) for p in prompt_ids[i:i + cfg.batch]] for i in range(0, len(prompt_ids), cfg.batch)])
            # engine build, cache sizing and every graph capture (explicit, or on first use in a warm-up pass)
            engine_s = build_s + (time.perf_counter() - t_warm - warmup_s)
            telemetry = GpuTelemetry(str(self.device) if self.device.type == "cuda" else 0).start()
            split = PassSplit()
            t0 = time.perf_counter()
            ar_runs, cand_runs = [], []
            for r in range(cfg.repeats):  # interleaved (ABAB...): each repeat is an AR pass, then a candidate pass
                progress(r / cfg.repeats, f"repeat {r + 1}/{cfg.repeats}: autoregressive baseline")
                ar_runs.append(self._pass(ar_engine, prompt_ids, cfg.batch, split))
                if cfg.method == "ar":
                    cand_runs.append(ar_runs[-1])
                else:
                    progress((r + 0.5) / cfg.repeats, f"repeat {r + 1}/{cfg.repeats}: {cfg.method}")
                    cand_runs.append(self._pass(cand_engine, prompt_ids, cfg.batch, split))
            wall = time.perf_counter() - t0
            tel = telemetry.stop()
            hf = {}
            if cfg.compare_hf:
                progress(0.95, "Hugging Face transformers baseline")
                from workbench.harness.hf_baseline import hf_generate_tokens_per_s
                hf = hf_generate_tokens_per_s(self, cfg, prompt_ids)
            graphs = {"overlap_applied": cand_engine.overlaps()} if cfg.overlap else {}
            graphs["pdl_applied"] = pdl_applies(cfg.pdl, self.device, cfg.cuda_graphs)
            graphs["int4_cuda_gemv"] = int4_cuda_gemv_applies(self.device, parse_tuning(cfg.kernel_tuning).int4_cuda)
            if cfg.compile != "off":  # frames past dynamo's recompile limit run eagerly
                graphs |= compile_fallback_columns(fallbacks_before)
            graphs |= _graph_columns([e.graph_stats() for e in engines], stats_before,
                                    cfg.cuda_graphs or cfg.compile != "off")
            if cfg.phase_profile:
                progress(0.97, "per-phase GPU profile")
                from workbench.harness.phase_profile import profile_phases

                live = sum(len(p) for p in prompt_ids) // len(prompt_ids) + cfg.max_new_tokens // 2
                graphs.update(profile_phases(cand_engine, cfg.batch, live))
            peak = self._peak_mem_mb()  # before the KV quality pass, whose reference engine is not the run's
            progress(0.98, "KV format: bytes and quality against model-dtype KV")
            t_kv = time.perf_counter()
            kv = self._kv_columns(cfg, cand_engine, prompt_ids, [o for res in ar_runs[0] for o in res.outputs])
            kv_s = time.perf_counter() - t_kv
        except torch.cuda.OutOfMemoryError as e:
            raise BenchError(f"GPU out of memory with method={cfg.method} k={cfg.k} batch={cfg.batch} "
                             f"max_new_tokens={cfg.max_new_tokens} dtype={self.dtype}: lower batch or max_new_tokens "
                             f"({str(e).splitlines()[0]})") from None
        progress(1.0, "done")
        self._run_drafter = cand_engine.drafter  # its head's columns (head_columns)
        result = self._result(cfg, ar_runs, cand_runs, wall, tel, hf, study, trial_id, self.environment())
        rec = result.record
        rec.update(graphs)
        rec.update(kv, peak_mem_mb=peak, auto_knobs=",".join(auto_knobs))
        progress(1.0, "quality against the unquantized models")
        t_quality = time.perf_counter()
        rec.update(quality_columns(self, cfg, prompt_ids, result))
        if rec["greedy_matches_ar"] is False:
            margins = self.divergence_margins(prompt_ids, result.outputs, result.ar_outputs, cfg)
            rec["greedy_divergent_sequences"] = len(margins)
            rec["greedy_divergence_margin"] = max(margins)
            rec["greedy_near_tie"] = self.dtype != "float32" and max(margins) <= NEAR_TIE_LOGITS
        rec.update(trial_engine_s=engine_s, trial_warmup_s=warmup_s,
                   trial_quality_s=kv_s + time.perf_counter() - t_quality, **split.columns(wall))
        return result

    def _peak_mem_mb(self) -> float:
        if self.device.type == "cuda":  # less the kept engines the run did not use (their caches and graph pools)
            return (torch.cuda.max_memory_allocated(self.device) - self._idle_bytes) / 2**20
        return _peak_rss_mb()  # CPU: this run's peak resident set (reset at its start where Linux allows)

    def _kv_columns(self, cfg: BenchConfig, engine: SpecEngine, prompt_ids: list[list[int]],
                    ar_outputs: list[list[int]]) -> dict:
        """KV bytes per token and cache sizes (target, draft), and the target KV format's quality cost: greedy AR
        with this format against greedy AR with model-dtype KV ("none") on the same prompts (one untimed pass each;
        the run's own AR outputs stand in for the first when it is greedy)."""
        drafter_caches = engine.drafter.kv_caches() if engine.drafter is not None else []
        cols = {"kv_bytes_per_token": engine.cache.bytes_per_token, "kv_cache_mb": engine.cache.nbytes / 2**20,
                "draft_kv_bytes_per_token": sum(c.bytes_per_token for c in drafter_caches) or None,
                "draft_kv_cache_mb": sum(c.nbytes for c in drafter_caches) / 2**20 if drafter_caches else None,
                "kv_token_agreement": 1.0, "kv_divergent_sequences": 0}
        if cfg.target_kv_quant == "none":
            return cols  # the reference itself
        greedy = replace(cfg, method="ar", temperature=0.0, top_k=0, top_p=1.0)
        ours = ar_outputs if cfg.temperature == 0.0 else self._outputs(greedy, prompt_ids)
        reference = self._outputs(replace(greedy, target_kv_quant="none"), prompt_ids)
        cols["kv_token_agreement"], cols["kv_divergent_sequences"] = greedy_agreement(ours, reference)
        return cols

    def _outputs(self, cfg: BenchConfig, prompt_ids: list[list[int]]) -> list[list[int]]:
        """One untimed AR pass with these settings (its engine kept like the timed ones)."""
        return [o for res in self._pass(self._engine(cfg, drafter=False), prompt_ids, cfg.batch) for o in res.outputs]

    @torch.inference_mode()
    def divergence_margins(self, prompt_ids: list[list[int]], outputs: list[list[int]],
                           ar_outputs: list[list[int]], cfg: BenchConfig | None = None) -> list[float]:
        """For each sequence whose output differs from the AR output: |fp32 logit(ours) - fp32 logit(AR's)| at the
        first differing token, scored cache-free on the shared prefix (an fp32 copy of the target for models up to
        2 B parameters, else the model itself; a quantized target is scored as it runs: its kernels are the model)."""
        import copy

        target = self.target if cfg is None else self.model_for("target", cfg)
        big = sum(p.numel() for p in target.parameters()) > 2e9
        quantized = target is not self.target
        ref = target if self.dtype == "float32" or big or quantized else copy.deepcopy(target).float()
        margins = []
        for prompt, ours, theirs in zip(prompt_ids, outputs, ar_outputs):
            i = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if i is None:
                continue
            ids = torch.tensor([prompt + theirs[:i]], device=self.device)
            hidden = ref(ids, torch.arange(ids.shape[1], device=self.device).unsqueeze(0))
            logits = ref.compute_logits(hidden[0, -1]).float()
            margins.append(abs(float(logits[ours[i]] - logits[theirs[i]])))
        return margins

    def head_columns(self, cfg, drafter: Drafter | None = None) -> dict:
        """The draft_head* columns of the run's head (feature methods; None elsewhere): where it came from, its
        layout, stored dtype, parameter count and (EAGLE-3) draft vocabulary."""
        cols = dict.fromkeys(("draft_head", "draft_head_layout", "draft_head_dtype", "draft_head_params",
                              "draft_vocab_size"))
        if cfg.method not in settings.FEATURE_METHODS:
            return cols
        info = self._head_info.get(cfg.method)
        head = getattr(drafter or getattr(self, "_run_drafter", None), "head", None)
        if info is None and head is not None:  # the registry's untrained head
            self._note_head(cfg.method, head, f"untrained (seed {UNTRAINED_HEAD_SEED})",
                            "workbench" if cfg.method != "eagle3" else "eagle3")
            info = self._head_info.pop(cfg.method)
        return {**cols, **(info or {})}

    def _result(self, cfg, ar_runs, cand_runs, wall, tel, hf, study, trial_id, env) -> BenchResult:
        ar = [summarize(r) for r in ar_runs]
        cand = [summarize(r) for r in cand_runs]
        c0 = cand[0]
        ar_tps = median([s.tokens_per_s for s in ar])
        tps = median([s.tokens_per_s for s in cand])
        outputs = [o for res in cand_runs[0] for o in res.outputs]
        ar_outputs = [o for res in ar_runs[0] for o in res.outputs]
        greedy_match = None  # sampling, or method "ar" (the candidate is the baseline itself: nothing to compare)
        if cfg.temperature == 0.0 and cfg.method != "ar":
            greedy_match = all([o for res in run for o in res.outputs] == ar_outputs for run in cand_runs)
        # cost ratio c (Leviathan et al.): one drafter model pass / one target decode step (the AR step time)
        ar_step_ms = median([s.phase_ms.get("verify", 0.0) / s.target_steps for s in ar if s.target_steps])
        cost_ratio = None
        if c0.draft_forwards and ar_step_ms:
            cost_ratio = (c0.phase_ms.get("draft", 0.0) / c0.draft_forwards) / ar_step_ms
        peak = self._peak_mem_mb()
        # latency samples pooled over all repeats; acceptance, phase times and traces from the first repeat
        ttft = [x for c in cand for x in c.ttft_ms]
        tpot = [x for c in cand for x in c.tpot_ms]
        itl = [x for c in cand for x in c.itl_ms]
        run_id = uuid.uuid4().hex
        n_seq = len(outputs)
        speedup = tps / ar_tps if ar_tps else None
        # the decode window alone (per sequence: first token -> done, so prefill and call setup left out)
        ar_tpot, cand_tpot = median([x for s in ar for x in s.tpot_ms]), median(tpot)
        decode_speedup = ar_tpot / cand_tpot if ar_tpot and cand_tpot else None
        trust = trust_columns([s.tokens_per_s for s in ar], [s.tokens_per_s for s in cand], speedup,
                              c0.mean_accepted_tokens, c0.acceptance_rate if cfg.method != "ar" else None,
                              cost_ratio=cost_ratio,
                              draft_forwards_per_step=c0.draft_forwards / c0.target_steps if c0.target_steps else None)
        record = {
            "run_id": run_id, "study": study, "trial_id": trial_id, "status": "ok", "error": None,
            **_config_columns(cfg),
            "kernel_tuning": format_tuning(parse_tuning(cfg.kernel_tuning)),  # resolved: every field
            "k": cfg.k if cfg.method != "ar" else 0,
            "dtype": self.dtype, "device": str(self.device), "preset": self.preset,
            "target_path": self.target_path, "draft_path": self.draft_path if cfg.method == "draft"
            else self.redrafter_head_source if cfg.method == "redrafter"
            else self.eagle_head_source if cfg.method == "eagle"
            else self.eagle3_head_source if cfg.method == "eagle3" else None,  # the head's folder or "untrained"
            **self.head_columns(cfg),
            "prompts_source": self.prompts_source,
            "acceptance_rate": c0.acceptance_rate if cfg.method != "ar" else None,
            "mean_accepted_tokens": c0.mean_accepted_tokens,
            "acceptance_by_position": c0.acceptance_by_position,
            **_tree_columns(c0, cfg.method != "ar"),
            "tokens_per_s": tps, "ar_tokens_per_s": ar_tps,
            "speedup_vs_ar": speedup,
            # the AR step's time over the speculative step's: 1 = every token a step emits turns into speedup
            "speedup_per_token_per_step": speedup / c0.mean_accepted_tokens
            if speedup and cfg.method != "ar" and c0.mean_accepted_tokens else None,
            "decode_speedup_vs_ar": decode_speedup,
            "decode_speedup_per_token_per_step": decode_speedup / c0.mean_accepted_tokens
            if decode_speedup and cfg.method != "ar" and c0.mean_accepted_tokens else None,
            "ttft_ms": median(ttft),
            "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p90": percentile(tpot, 90),
            "tpot_ms_p99": percentile(tpot, 99),
            "itl_ms_p50": percentile(itl, 50), "itl_ms_p90": percentile(itl, 90),
            "itl_ms_p99": percentile(itl, 99),
            "time_draft_ms": c0.phase_ms.get("draft"), "time_verify_ms": c0.phase_ms.get("verify"),
            "time_accept_ms": c0.phase_ms.get("accept"), "time_kv_ms": c0.phase_ms.get("kv"),
            "time_prefill_ms": c0.phase_ms.get("prefill"),
            "peak_mem_mb": peak, "draft_target_cost_ratio": cost_ratio,
            "total_new_tokens": c0.total_new_tokens, "target_steps": c0.target_steps,
            "ar_target_steps": ar[0].target_steps, "wall_s": wall,
            "greedy_matches_ar": greedy_match, "sequences": n_seq, **trust,
            **tel.to_record(), **env, **hf,
        }
        return BenchResult(record, traces_frame(cand_runs[0], run_id), outputs, ar_outputs)


@dataclass
class PassSplit:
    """Where the timed passes' wall time (`wall_s`) went, summed over their `generate` calls (seconds; results.schema
    group "trial_time"). Per call, from its host times: setup = entry -> t_start, prefill = t_start -> t_first_token,
    decode = t_first_token -> last t_done, finish = last t_done -> return. tokens/s's window is prefill + decode.

    >>> s = PassSplit()
    >>> s.add(0.0, GenerationResult([[1], [2]], t_start=0.5, t_first_token=1.0, t_done=[3.0, 4.0]), 4.5)
    >>> s.columns(wall_s=6.0)
    {'wall_setup_s': 0.5, 'wall_prefill_s': 0.5, 'wall_decode_s': 3.0, 'wall_finish_s': 0.5, 'wall_other_s': 1.5}
    """
    setup_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_s: float = 0.0

    def add(self, t_call: float, result: GenerationResult, t_return: float) -> None:
        """One call: entered at t_call, returned `result` at t_return (host perf_counter seconds)."""
        t_last = max(result.t_done)
        self.setup_s += result.t_start - t_call
        self.prefill_s += result.t_first_token - result.t_start
        self.decode_s += t_last - result.t_first_token
        self.finish_s += t_return - t_last

    def columns(self, wall_s: float) -> dict[str, float]:
        """The record's `wall_*_s` columns; `wall_other_s` = wall_s less the calls' parts (between the calls)."""
        parts = {"wall_setup_s": self.setup_s, "wall_prefill_s": self.prefill_s, "wall_decode_s": self.decode_s,
                 "wall_finish_s": self.finish_s}
        return {**parts, "wall_other_s": wall_s - sum(parts.values())}


_NVML_HELD: list[bool] = []  # set once this process holds an NVML initialization


def _hold_nvml() -> None:
    """Initialize NVML once for the process and never shut it down: NVML counts initializations, so the telemetry
    sampler's per-run nvmlInit / nvmlShutdown pair then only moves the count instead of loading and unloading the
    driver's state every run. Best effort: without pynvml or a driver the runs' telemetry says why, as before."""
    if _NVML_HELD:
        return
    try:
        import pynvml

        pynvml.nvmlInit()
        _NVML_HELD.append(True)
    except Exception:  # noqa: BLE001 - telemetry reports its own reason per run
        pass


def _engine_bytes(engine: SpecEngine) -> int:
    """Device bytes an engine holds between runs: its KV caches (target and drafter) and its graphs' pools (the
    small token / length / step buffers are not counted)."""
    caches = [engine.cache] + (engine.drafter.kv_caches() if engine.drafter is not None else [])
    return sum(c.nbytes for c in caches if c is not None) + engine.graph_stats().memory_bytes


def _tree_columns(summary, drafts: bool) -> dict:
    """Draft-tree / beam figures of the first repeat (metrics.py defines them); None for AR (nothing drafted)."""
    keys = ("tree_size_mean", "wasted_node_fraction", "accepted_path_length_mean", "beam_diversity_mean",
            "beam_disagreement_mean", "acceptance_by_rank")
    cols = {k: getattr(summary, k) if drafts else None for k in keys}
    cols["acceptance_by_depth_rank"] = json.dumps(summary.acceptance_by_depth_rank) if drafts else None
    return cols


def _graph_columns(now, before, fixed_shape: bool) -> dict:
    """Fixed-shape / CUDA-graph statistics of one run (both engines, warm-up included: captures happen there)."""
    if not fixed_shape:
        return {}
    total = None
    for n, b in zip(now, before):
        d = n.since(b)
        total = d if total is None else total.add(d)
    return {"graph_capture_s": total.capture_s, "graph_memory_mb": total.memory_bytes / 2**20,
            "graph_bucket_hits": total.hits, "graph_bucket_misses": total.misses,
            "graph_padding_waste": total.padding_waste, "graph_buckets_captured": ",".join(total.captured)}


def _config_columns(cfg: BenchConfig) -> dict:
    """A run's settings as record columns (one per run knob), plus the whole config as JSON (`config_json`)."""
    cols = {k.name: k.column(getattr(cfg, k.name)) for k in settings.RUN_KNOBS}
    cols["config_json"] = json.dumps(asdict(cfg), sort_keys=True)
    return cols


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the process's VmHWM, so each run reports its own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_mb() -> float:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # lifetime peak (KiB on Linux)


def auto_dtype(dtype: str, device: torch.device, model: str) -> str:
    """The dtype a session loads in: `dtype` itself, or for "auto" the device's choice (settings.auto_value) from
    the dtype the model's config names and whether the GPU has bfloat16."""
    if dtype != settings.AUTO:
        return dtype
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return settings.auto_value("dtype", device.type, {}, model_dtype=stored_dtype(model), bf16_supported=bf16)


def _failed_config_columns(cfg: BenchConfig, storable: dict) -> dict:
    """The config columns of a failed row: a value its column cannot hold (seed=10**20, k="x", an unresolved
    "auto" in a bool column) stays in config_json only."""
    rec = {}
    for knob in settings.RUN_KNOBS:
        value = getattr(cfg, knob.name)
        rec[knob.name] = knob.column(value) if storable[knob.kind](value) else None
    rec["config_json"] = json.dumps(asdict(cfg), sort_keys=True, default=repr)
    return rec


def failed_record(cfg: BenchConfig, error: str, *, study: str | None = None, trial_id: int | None = None,
                  session: BenchSession | None = None, asked: dict | None = None) -> dict:
    """A result-store row for a run that could not complete: its settings and the reason. Without a loaded
    `session` (loading failed), `asked` fills the model columns with what was asked for (keys preset,
    target_path, draft_path, dtype, device, prompts_source), so the row says which models failed."""
    from workbench.harness.telemetry import environment_info

    storable = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63,
                "float": lambda v: isinstance(v, float) or storable["int"](v),
                "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
                "ints": lambda v: isinstance(v, tuple) and all(storable["int"](x) for x in v)}
    auto_knobs = None
    if session is not None:  # the values the run would have used, as a successful row holds them
        cfg, resolved = session.resolve(cfg)
        auto_knobs = ",".join(resolved)
    rec = _failed_config_columns(cfg, storable)
    rec.update(run_id=uuid.uuid4().hex, study=study, trial_id=trial_id, status="failed", error=error,
               auto_knobs=auto_knobs, **environment_info())
    if session is not None:
        rec.update(dtype=session.dtype, device=str(session.device), preset=session.preset,
                   target_path=session.target_path, draft_path=session.draft_path,
                   prompts_source=session.prompts_source, draft_head=session.draft_head_path)
    else:
        columns = ("preset", "target_path", "draft_path", "draft_head", "dtype", "device", "prompts_source")
        rec.update({key: None if value is None else str(value) for key, value in (asked or {}).items()
                    if key in columns})
    return rec
