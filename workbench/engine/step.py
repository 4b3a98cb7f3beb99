"""The speculative decoding engine: one step loop for plain autoregressive decoding and for every drafter.

Vocabulary (used the same way in every module):
- **committed tokens**: a sequence's tokens whose target KV is final; `kv_len` counts them.
- **root**: the token at index kv_len, the last one emitted; its KV is written in the next verify pass and its target
  logits predict draft depth 1.
- **draft tree**: N nodes per sequence (token, parent, depth); a chain is the degenerate tree (engine/tree.py).
- **accepted tokens** / **recovered token** / **bonus token**: see engine/verify.py. A step emits accepted + 1.
- **target step**: one verify pass of the target model; autoregressive decoding is the same loop with N = 0.

One step, as named phases (each timed when `timing` is on):
    draft  : drafter.propose(state) -> DraftTree
    verify : target over [root, nodes] at positions kv_len + [0, depths], tree mask -> logits [B, 1+N, V]
    accept : verifier.accept(tree, logits) -> Acceptance;  then the step's one host read (accepted counts + tokens)
    kv     : move the accepted path's KV (trees only), advance kv_len, drafter.commit, retire finished sequences

State that lives across `generate` calls (and across benchmark repeats and study trials that reuse the engine): the
target's KV cache, sized for a maximum batch and length and grown only when a call needs more, the `tokens` and
`kv_len` buffers, and the fixed-shape steps with their captured CUDA graphs (engine/graphs.py). Each step splits into
host planning (block allocation, row bookkeeping, retiring finished rows) and device steps that read only persistent
buffers, so with `cuda_graphs` the verify pass (per batch bucket and node count) and the draft model's forwards replay
captured graphs. Greedy chains go further: verify, accept and the state update are one captured step (so `accept`
above then only unpacks its result). So do trees and feature drafters (EAGLE, ReDrafter; `Drafter.splits_commit`),
greedy or sampled: `_verify_tree` is verify under the tree mask, acceptance (sampled: one draw per verify row over
deterministic candidates, drawn before the step), the accepted path's KV moved down, tokens and kv_len written, and
the drafter's `commit_device` with the committed tokens' hidden states, all in one step; with the drafter's own one
step for the draft, a tree step is two graph replays, a host read and host bookkeeping (`commit_host`, truncation).

Feature-based drafters (`Drafter.wants_hidden`, e.g. ReDrafter) get the target's final hidden states: the prompts' at
prefill, and after each step those of the tokens it committed (verify rows 0 and 1 + path nodes): inside the tree
step with fixed shapes, else on the unfused path, whose verify step then returns (logits, hidden).

Overlapped steps (`overlap`, with fixed shapes: AR, greedy chains with the fused accept, and the tree step): step
t + 1 is launched before step t's tokens are read, so the host's bookkeeping runs while the GPU computes (the idea of
SGLang's overlap scheduler). Everything step t + 1 reads on the device (roots, lengths) step t wrote there; the host
only plans storage, from upper bounds (a step emits at most 1 + D tokens, D = N for chains, the depth bound for
trees). Costs: blocks of rejected drafts are kept until the sequence finishes (no per-step truncation), and a sequence
that finishes in step t may have step t + 1 launched for it anyway (its tokens dropped). That wasted step is avoided
where it is foreseeable: when every row of step t + 1 could reach max_new_tokens in step t (it emits at most 1 + D
tokens), step t is read first and step t + 1 launched after (one host gap instead of one whole step; an EOS cannot be
foreseen).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from workbench import settings

from workbench.engine.drafters.base import BatchState, DraftContext, Drafter
from workbench.engine.graphs import (PAD_LEN, PREFILL_LEN_MULTIPLE, FixedShapeStep, GraphSettings,
                                     GraphStats, ModelStep, PrefillStep, prefill_len, upload)
from workbench.engine.kv_cache import ATTENTION_BACKENDS, make_cache
from workbench.engine.kv_quant import kv_format
from workbench.engine.quant import apply_kernel_tuning
from workbench.engine.sampling import SamplingParams, next_token
from workbench.engine.tree import DraftTree, earlier_siblings, pack_tree, tree_input, unpack_tree, verify_mask
from workbench.engine.verify import Acceptance, Verifier, accept_greedy
from kernels.pdl import pdl_scope
from kernels.tuning import KernelTuning, inductor_options, parse_tuning

PHASES = ("prefill", "draft", "verify", "accept", "kv")


def _with_pdl(method):
    """A SpecEngine entry point that launches kernels: our Triton kernels use dependent launches as the engine's
    `pdl` says for the call, and the quantized linears the engine's `kernel_tuning` (graphs keep what they captured
    with)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.use_kernel_tuning()
        with pdl_scope(self.config.pdl):
            return method(self, *args, **kwargs)
    return wrapper


# EngineConfig fields that take a registry knob of another name (every other knob field has the knob's own name)
KNOB_OF_FIELD = {"kv_quant": "target_kv_quant"}


def _knob(name: str):
    """A field whose default is the registry's (workbench.settings.KNOBS; an "auto" knob's default is what auto
    means on a CPU, since an engine config is concrete: `engine_config` maps a resolved run config)."""
    return field(default=settings.engine_default(KNOB_OF_FIELD.get(name, name)))


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings. A field named like a registry knob (or in KNOB_OF_FIELD) is that knob: its default
    comes from the registry, and `engine_config` copies it from a run config; the rest are the engine's own."""

    max_new_tokens: int = _knob("max_new_tokens")
    sampling: SamplingParams = SamplingParams()
    paged: bool = _knob("paged")
    kv_block_size: int = _knob("kv_block_size")
    seed: int = _knob("seed")
    stop_on_eos: bool = False  # benchmarks decode a fixed length, like vLLM's bench with ignore_eos
    eos_token_id: int | None = None
    timing: bool = False  # per-phase timers (CUDA events on GPU, no extra host syncs)
    cuda_graphs: bool = _knob("cuda_graphs")  # fixed-shape bucketed steps, captured in CUDA graphs on a GPU
    graph_batch_sizes: tuple[int, ...] = _knob("graph_batch_sizes")  # the buckets a live batch pads up to
    compile: str = _knob("compile")  # torch.compile of the fixed-shape steps
    attention: str = _knob("attention")  # "sdpa" (gather + SDPA) | "triton" (kernels/paged_attention.py) | "auto"
    overlap: bool = _knob("overlap")  # launch step t + 1 before reading step t (greedy chains with fixed shapes)
    kv_quant: str = _knob("kv_quant")  # the target's KV-cache format (engine/kv_quant.py)
    prefill_graphs: bool = _knob("prefill_graphs")  # with cuda_graphs: prompt forwards captured (PrefillStep)
    compile_prefill: bool = _knob("compile_prefill")  # with compile: those captured prompt forwards compiled too
    pdl: bool = _knob("pdl")  # our Triton kernels launched with programmatic dependent launch (kernels/pdl.py)
    kernel_tuning: str = _knob("kernel_tuning")  # kernel variants, "field=value,..." (kernels/tuning.py)

    @functools.cached_property
    def graphs(self) -> GraphSettings:  # read every step: built (and validated) once
        return GraphSettings(self.cuda_graphs, tuple(self.graph_batch_sizes), self.compile, self.prefill_graphs,
                             self.compile_prefill, inductor_options(parse_tuning(self.kernel_tuning)))

    def __post_init__(self) -> None:
        unresolved = [f.name for f in fields(self) if isinstance(getattr(self, f.name), str)
                      and getattr(self, f.name) == settings.AUTO and f.name in settings.AUTO_KNOBS]
        if unresolved:
            raise ValueError(f"{', '.join(unresolved)}='auto' reached the engine: resolve a run config for its "
                             "device first (workbench.settings.resolve_config)")
        self.graphs  # noqa: B018 - validates the graph settings (GraphSettingsError names the bad one)
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention!r}; choose one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        kv_format(self.kv_quant)  # KVFormatError names the formats
        parse_tuning(self.kernel_tuning)  # KernelTuningError names the field
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size}")


def engine_config(cfg: Any, **overrides: Any) -> EngineConfig:
    """The one settings -> engine mapping: an EngineConfig from a run config (BenchConfig, ServeConfig) by copying
    every field EngineConfig has under the same name (or its KNOB_OF_FIELD knob), `sampling` from temperature /
    top_k / top_p, then `overrides` (engine-only fields such as timing). A field the run config lacks keeps the
    registry default. Resolve "auto" knobs for the device first (workbench.settings.resolve_config)."""
    values = {}
    for f in fields(EngineConfig):
        knob = KNOB_OF_FIELD.get(f.name, f.name)
        if hasattr(cfg, knob):
            values[f.name] = getattr(cfg, knob)
    if all(hasattr(cfg, n) for n in ("temperature", "top_k", "top_p")):
        values["sampling"] = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    if "graph_batch_sizes" in values:
        values["graph_batch_sizes"] = tuple(values["graph_batch_sizes"])
    return EngineConfig(**{**values, **overrides})


class PhaseTimer:
    """Accumulates wall time per phase. On CUDA it records events and resolves them once, at the end.

    spare: CUDA events to record into before creating new ones; `resolve` puts every event it read back on it, so a
    list kept across timers (SpecEngine keeps one for `generate`) spares each step's event creation and each call's
    event destruction. Only one timer at a time may draw on a list.
    """

    def __init__(self, device: torch.device, enabled: bool, spare: list | None = None):
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self.totals_ms = {p: 0.0 for p in PHASES}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._spare = spare if spare is not None else []

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        if self.cuda:
            start, end = self._event(), self._event()
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.totals_ms[name] += (time.perf_counter() - t0) * 1e3

    def _event(self) -> torch.cuda.Event:
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def resolve(self) -> dict[str, float]:
        if self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                self.totals_ms[name] += start.elapsed_time(end)
                self._spare += (start, end)  # read and complete: free to record again
            self._events.clear()
        return dict(self.totals_ms)


@dataclass
class StepRecord:
    step: int
    t_emit: float  # host perf_counter when the step's tokens were known
    rows: list[int]
    drafted: list[int]
    accepted: list[int]
    emitted: list[int]  # tokens counted towards the output (capped by max_new_tokens)
    # per row, the sibling rank (engine/tree.py `sibling_rank`) of the accepted node at each depth 1..accepted; chains
    # (and records built without it) are all rank 0
    path_ranks: list[list[int]] = field(default_factory=list)
    # per row, (differing, compared) beam-pair token positions of trees merged from beams (`DraftTree.beam_pairs`);
    # empty when the step's tree was not made from beams
    beam_pairs: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class GenerationResult:
    outputs: list[list[int]]  # per prompt, the generated tokens (max_new_tokens of them unless stopped by EOS)
    t_start: float
    t_first_token: float  # all sequences of the batch get their first token from the one prefill
    t_done: list[float]  # per prompt
    steps: list[StepRecord] = field(default_factory=list)
    phase_ms: dict[str, float] = field(default_factory=dict)
    draft_forwards_per_step: int = 0
    num_nodes: int = 0
    beams: bool = False  # merged beams (Drafter.proposes_beams): drafted / num_nodes = diversity
    graph_stats: GraphStats | None = None  # fixed-shape steps of this call (target + drafter), None when eager
    wasted_steps: int = 0  # overlapped steps launched after every row in them had finished (their tokens dropped)


class SpecEngine:
    """Runs a batch of prompts to completion with one target model and an optional drafter (None = autoregressive).

    Persistent state (kept across `generate` calls while it fits; grown, and its graphs dropped, when not):
        cache   the target's KV cache, `max_rows` sequence rows + one scratch `pad_row`
        tokens  [R + 1, S] long: every row's tokens (prompt + emitted); the root of row r is tokens[r, kv_len[r]]
        kv_len  [R + 1] long: committed tokens per row (padding and unused rows hold PAD_LEN)
    With greedy settings, chains and fixed shapes, one captured step reads the roots from `tokens`, verifies, accepts,
    writes the emitted tokens and the new lengths back, and returns the packed host read: a step is then host
    planning + one graph (+ the drafter's) + one device->host copy.
    """

    def __init__(self, target, drafter: Drafter | None, config: EngineConfig, device: torch.device | str = "cpu"):
        self.target, self.drafter, self.config = target, drafter, config
        self.device = torch.device(device)
        self.dtype = next(target.parameters()).dtype
        self.cache = None
        self.tokens: torch.Tensor | None = None  # [R + 1, S] long
        self.kv_len: torch.Tensor | None = None  # [R + 1] long
        self.target_step: ModelStep | None = None  # verify pass -> logits
        self.prefill_step: PrefillStep | None = None  # the prompts' forward -> hidden
        self.accept_step: FixedShapeStep | None = None  # verify + greedy chain acceptance + state update -> packed
        self.tree_step: FixedShapeStep | None = None  # tree verify + acceptance + KV compaction + drafter commit
        self._tree_state: list = []  # the drafter's device-state tensors the tree step was built over
        self._live: tuple | None = None  # (rows, rows [B] on the device, their kv_len [B] then): see _live_rows
        self._timer_events: list = []  # CUDA timing events generate's PhaseTimer records into, reused across calls

    def max_context(self) -> int:
        return int(self.target.config.max_position_embeddings)

    def use_kernel_tuning(self) -> KernelTuning:
        """The config's KernelTuning set on every quantized linear of the target and of a draft model (models may be
        shared by engines of other tunings: set again only where another engine changed it); returns it."""
        tuning = parse_tuning(self.config.kernel_tuning)
        for model in (self.target, getattr(self.drafter, "model", None)):
            if isinstance(model, torch.nn.Module) and getattr(model, "kernel_tuning", None) is not tuning:
                apply_kernel_tuning(model, tuning)
                model.kernel_tuning = tuning
        return tuning

    @property
    def num_nodes(self) -> int:
        return self.drafter.num_nodes if self.drafter else 0

    def required_len(self, prompt_len: int) -> int:
        ahead = 1 + self.num_nodes if self.config.overlap else 0  # the step launched before the last one is read
        return prompt_len + self.config.max_new_tokens + self.num_nodes + 2 + ahead

    def graph_stats(self) -> GraphStats:
        """Cumulative fixed-shape statistics of the target's steps and the drafter's (since construction)."""
        stats = GraphStats()  # a fresh sum, never one step's own counters
        steps = [self.prefill_step, self.target_step, self.accept_step, self.tree_step]
        for step in steps + (self.drafter.model_steps() if self.drafter else []):
            if step is not None:
                stats = stats.add(step.stats)
        return stats

    @_with_pdl
    def capture_graphs(self, max_batch: int, node_counts: tuple[int, ...] | None = None,
                       prompt_batches: list[list[int]] | None = None, max_prefill_tokens: int = 0,
                       prefill_rows: int = 1) -> None:
        """Capture every bucket a batch of up to max_batch can shrink through (target verify and drafter forwards),
        so that timed generations replay graphs only. Needs a first `generate` or `setup_rows` (it sizes the caches).
        node_counts: every `decode_step(num_nodes=n)` the run will ask for (adaptive speculation; 0 = autoregressive
        steps); None = only the drafter's N. prompt_batches: the prompt lengths of each `generate` call to come, whose
        prefills (target and draft model) are captured too (`prefill_graphs`); max_prefill_tokens: serving's
        rows join one at a time (`prefill_row`, `sync_drafter`): every padded chunk / prompt length up to this many
        tokens is captured for one row (target chunks for 1..prefill_rows rows: a batched prefill, `prefill_rows`)."""
        if self.target_step is None or not self.config.cuda_graphs:
            return
        self.capture_prefill(prompt_batches or [])
        self.capture_row_prefill(max_prefill_tokens, prefill_rows)
        top = self.config.graphs.bucket(max_batch)
        sizes = [s for s in self.config.graph_batch_sizes if top is not None and s <= top]
        counts = sorted(set(node_counts)) if node_counts is not None else [self.num_nodes]
        verify, key = self.verify_step()
        with torch.inference_mode():
            for size in sizes:
                for n in counts:
                    verify.capture(size, key - self.num_nodes + n)  # the key is N or 1 + N
            if self.drafter is not None:
                self.drafter.capture_graphs(sizes, node_counts=tuple(counts))

    @_with_pdl
    def capture_prefill(self, prompt_batches: list[list[int]]) -> None:
        """Capture the prefill of each batch (a list of prompt lengths) ahead of `generate` (GPU, cuda_graphs and
        prefill_graphs on; a no-op otherwise). Leaves the caches reset."""
        if self.prefill_step is None or not self.prefill_step.fixed_shape:
            return
        drafter = getattr(self.drafter, "prefill_step", None)
        with torch.inference_mode():
            for plen in prompt_batches:
                rows = list(range(len(plen)))
                self.prefill_step.capture(rows, max(plen))
                if drafter is not None:
                    drafter.capture(rows, max(plen))
        self.cache.reset()
        if drafter is not None:
            drafter.cache.reset()

    @_with_pdl
    def capture_row_prefill(self, max_tokens: int, rows: int = 1) -> None:
        """Capture one row's prefill chunks (target; and those of 2..rows rows at once) and prompt prefills (draft
        model) of up to max_tokens tokens, in rows 0.. (left empty after; call it while no row is live)."""
        if max_tokens < 1 or self.prefill_step is None or not self.prefill_step.fixed_shape:
            return
        drafter = getattr(self.drafter, "prefill_step", None)
        with torch.inference_mode():
            self.prefill_step.capture_chunks(0, max_tokens, min(rows, self.cache.max_rows))
            if drafter is not None:
                for length in range(PREFILL_LEN_MULTIPLE, max_tokens + PREFILL_LEN_MULTIPLE, PREFILL_LEN_MULTIPLE):
                    if drafter.padded_len(min(length, max_tokens)) > drafter.cache.max_len:
                        break
                    drafter.capture([0], min(length, max_tokens))
                    drafter.cache.truncate(0, 0)

    def verify_step(self) -> tuple[FixedShapeStep | ModelStep | None, int]:
        """The step the verify pass runs under the current settings, and its shape key: the fused greedy step and
        the node count N, or the target's model step and T = 1 + N."""
        if self._fused_accept(self._chains()):
            return self.accept_step, self.num_nodes
        if self._fused_tree():
            return self.tree_step, self.num_nodes
        return self.target_step, 1 + self.num_nodes

    def reserve(self, rows: int, max_prompt_len: int) -> None:
        """Size the caches now for batches of up to `rows` prompts of up to `max_prompt_len` tokens at the configured
        max_new_tokens (e.g. before a short warm-up, so that graphs captured then stay valid for the timed runs)."""
        self._reserve([max_prompt_len] * rows)

    def _wants_hidden(self) -> bool:
        return self.drafter is not None and self.drafter.wants_hidden

    def _chains(self) -> bool:
        """Every step's tree is a chain whose verify needs no hidden states (what the fused step can serve)."""
        return self.drafter is None or (self.drafter.proposes_chains and not self.drafter.wants_hidden)

    def can_launch_ahead(self) -> bool:
        """Whether a step can be launched before the previous one is read (`launch_step(lengths=)`): one captured
        step (greedy chains with the fused accept, or the tree step) and a drafter whose propose reads the device;
        `overlaps` without generate's knob."""
        fused = self._fused_accept(self._chains()) or self._fused_tree()
        return fused and (self.drafter is None or self.drafter.overlaps)

    def _max_accept(self, n: int) -> int:
        """The most draft tokens a step of n nodes can accept: n for chains, the tree's depth bound for trees."""
        return min(n, self.drafter.depth_bound) if n and self.drafter is not None else n

    def overlaps(self) -> bool:
        """Whether `generate` runs overlapped steps under the current settings (see the module docstring)."""
        return self.config.overlap and self.can_launch_ahead()

    def _fused_tree(self) -> bool:
        """Trees and feature drafters' steps run as one captured step (`_verify_tree`): fixed shapes and a drafter
        whose commit splits into a device half (`Drafter.splits_commit`)."""
        return (self.drafter is not None and not self._chains() and self.drafter.splits_commit
                and self.config.graphs.fixed_shape)

    def _fused_accept(self, chain: bool) -> bool:
        """Greedy acceptance of a chain runs inside the fixed-shape verify step (one graph, no extra launches)."""
        return chain and self.config.sampling.greedy and self.config.graphs.fixed_shape

    def _reserve(self, plen: list[int]) -> None:
        """The target's cache, state buffers and steps for these prompts; those held are kept if they fit."""
        cfg, tcfg = self.config, self.target.config
        rows, max_len = len(plen), self.required_len(max(plen))
        # paged: a pool sized to what these prompts can reach (their own lengths), not max_len for every row; the
        # right-padded prefill briefly needs the longest prompt's blocks in every row (freed right after it)
        blocks = lambda n: -(-n // cfg.kv_block_size)  # noqa: E731
        # a captured prefill pads the prompts' length (PrefillStep): room for the padded length, whatever the cap
        longest = prefill_len(max(plen), 1 << 62) if cfg.graphs.cuda_graphs and cfg.graphs.prefill else max(plen)
        num_blocks = max(sum(blocks(self.required_len(n)) for n in plen), rows * blocks(longest))
        if self.cache is not None and self.cache.fits(rows, max_len, num_blocks) and \
                self.cache.kv_quant == cfg.kv_quant:
            self.cache.reset()
            return
        if self.cache is not None:  # grow: never below what it held, so alternating sizes settle on one cache
            rows, max_len = max(rows, self.cache.max_rows), max(max_len, self.cache.max_len)
            num_blocks = max(num_blocks, getattr(self.cache, "num_blocks", 0))
        # free the old pool, state and the graphs that read them before allocating the new ones
        self.cache = self.tokens = self.kv_len = self.target_step = self.accept_step = self.prefill_step = None
        self.tree_step = None
        self._adopt(make_cache(cfg.paged, num_layers=tcfg.num_hidden_layers, num_kv_heads=tcfg.num_key_value_heads,
                               head_dim=tcfg.head_dim, max_rows=rows, max_len=max_len, dtype=self.dtype,
                               device=self.device, block_size=cfg.kv_block_size, num_blocks=num_blocks,
                               attention=cfg.attention, kv_quant=cfg.kv_quant), max_len)

    def _adopt(self, cache, max_len: int) -> None:
        """`cache` becomes the target's; the persistent tokens [R + 1, S] / kv_len [R + 1] buffers and the verify
        steps that read them are allocated around it (the caller dropped the old ones and their graphs)."""
        cfg, rows = self.config, cache.max_rows
        self.cache, self._live = cache, None
        self.tokens = torch.zeros(rows + 1, max_len + self.num_nodes + 2, dtype=torch.long, device=self.device)
        self.kv_len = torch.full((rows + 1,), PAD_LEN, dtype=torch.long, device=self.device)
        self.target_step = ModelStep(self.target, cache, cfg.graphs, self.device, "target",
                                     with_hidden=self._wants_hidden())
        self.prefill_step = PrefillStep(self.target, cache, cfg.graphs, self.device, "target")
        self.accept_step = FixedShapeStep("target+accept", self._verify_accept, self._verify_pads, cfg.graphs,
                                          self.device, state=lambda: [self.tokens, self.kv_len])
        self.tree_step = self._tree_step()

    def _tree_step(self) -> FixedShapeStep:
        """The captured tree step over the current buffers and the drafter's device state (`_setup_drafter` builds
        it again when the drafter's setup replaced those tensors: its graphs would read the old ones)."""
        self._tree_state = list(self.drafter.device_state()) if self.drafter is not None else []
        return FixedShapeStep("target+tree", self._verify_tree, self._tree_pads, self.config.graphs, self.device,
                              state=lambda: [self.tokens, self.kv_len] + (
                                  self.drafter.device_state() if self.drafter is not None else []))

    def _setup_drafter(self, generator: torch.Generator) -> None:
        """The drafter's setup for the cache's rows; `generator` also seeds the engine's verifier."""
        cfg, cache = self.config, self.cache
        self.generator = generator
        self.verifier = Verifier(cfg.sampling, generator)
        if self.drafter is not None:
            self.drafter.setup(DraftContext(max_rows=cache.max_rows, max_len=cache.max_len, device=self.device,
                                            sampling=cfg.sampling, generator=generator, paged=cfg.paged,
                                            kv_block_size=cfg.kv_block_size, graphs=cfg.graphs,
                                            attention=cfg.attention, tokens=self.tokens, kv_len_all=self.kv_len))
            state = self.drafter.device_state()
            if self.tree_step is not None and (len(state) != len(self._tree_state) or any(
                    a is not b for a, b in zip(state, self._tree_state))):
                stats = self.tree_step.stats
                self.tree_step = self._tree_step()
                self.tree_step.stats = stats

    def _verify_pads(self, n: int) -> dict[str, torch.Tensor]:
        dev = self.device
        return {"draft": torch.zeros(n, dtype=torch.long, device=dev),
                "rows": torch.tensor(self.cache.pad_row, device=dev),
                "valid": torch.zeros(n, dtype=torch.bool, device=dev)}

    def _verify_accept(self, draft: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The fused greedy step for chains, reading only persistent state: draft [B, N] tokens, rows [B], valid [B, N]
        -> packed [B, 3 + N] (accepted, drafted, emitted tokens); writes tokens and kv_len of `rows`."""
        n = draft.shape[1]
        base = self.kv_len[rows]  # [B]
        ids = torch.cat([self.tokens[rows, base].unsqueeze(1), draft], 1)  # [B, 1+N]: root, then the chain
        offsets = torch.arange(n + 1, device=draft.device)
        self.cache.prepare(rows, base, n + 1, None, self.cache.static_span)
        logits = self.target.compute_logits(self.target(ids, base.unsqueeze(1) + offsets, self.cache))
        tree = DraftTree.chain(draft, valid)
        acc = accept_greedy(tree, logits)
        self.tokens[rows.unsqueeze(1), base.unsqueeze(1) + 1 + offsets] = acc.emitted
        self.kv_len[rows] = base + 1 + acc.num_accepted
        self.kv_len[self.cache.pad_row:].fill_(PAD_LEN)  # padding rows wrote theirs too: back to PAD_LEN
        return _pack(acc, tree)

    def _tree_pads(self, n: int) -> dict[str, torch.Tensor]:
        dev = self.device
        z = torch.zeros(1, n, dtype=torch.long, device=dev)
        return {"tree": pack_tree(z, z - 1, z + 1, z.bool())[0],  # padding nodes: token 0, parent -1, depth 1
                "rows": torch.tensor(self.cache.pad_row, device=dev), "uniforms": torch.zeros(1 + n, device=dev)}

    def _verify_tree(self, tree: torch.Tensor, rows: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """The captured step of trees and feature drafters, reading only persistent state: tree [B, 4N + 2] (the
        drafter's tree, `pack_tree`: draft tokens / parents / depths / valid [B, N] and merged beams' counts [B, 2]),
        rows [B], uniforms [B, 1+N] (sampled settings' draws, `Verifier.uniforms`) -> packed [B, 3 + D (+ D) (+ 2)]
        (`_pack`). In one step: the target
        over [root, nodes] under the tree mask, acceptance (greedy, or sampled over deterministic candidates), the
        accepted path's KV moved down to its final slots, tokens and kv_len of `rows` written, and the drafter's
        `commit_device` with the committed tokens' hidden states (root, then the path)."""
        drafter, cache = self.drafter, self.cache
        draft, parents, depths, valid, beam_pairs = unpack_tree(tree)
        b, n = draft.shape
        dev = draft.device
        d = drafter.depth_bound if n else 0
        tree = DraftTree(draft, parents, depths, valid, None, is_chain=n == 0 or drafter.proposes_chains,
                         depth_bound=d, beam_pairs=beam_pairs if n and drafter.proposes_beams else None,
                         distinct_siblings=drafter.distinct_siblings)
        base = self.kv_len[rows]  # [B]
        ids = torch.cat([self.tokens[rows, base].unsqueeze(1), draft], 1)  # [B, 1+N]: root, then the nodes
        positions = base.unsqueeze(1) + torch.nn.functional.pad(depths, (1, 0))  # the root at depth 0
        cache.prepare(rows, base, 1 + n, verify_mask(tree), cache.static_span)
        hidden = self.target(ids, positions, cache)  # [B, 1+N, H]
        acc = self.verifier.accept(tree, self.target.compute_logits(hidden), None if self.verifier.params.greedy
                                   else uniforms)
        after = base.unsqueeze(1) + torch.arange(1, d + 2, device=dev)  # [B, 1+D]: slots base + 1 ..
        if d and not tree.is_chain:  # the accepted path's KV down to slots base + 1 ..; the rest stays put
            # node i sits in slot base + 1 + i, and a path node at depth j + 1 has i >= j (its ancestors come before
            # it): the larger of the two is the path node's slot on the path and the slot itself past it (-1)
            dst = after[:, :d]
            cache.move_path(rows, torch.maximum(after[:, :1] + acc.path_nodes, dst), dst)
        self.tokens[rows.unsqueeze(1), after] = acc.emitted
        self.kv_len[rows] = after.gather(1, acc.num_accepted.unsqueeze(1)).squeeze(1)  # base + 1 + accepted
        padded = b > 1  # a step of one row has no padding rows: one live row at least
        if padded:
            self.kv_len[cache.pad_row:].fill_(PAD_LEN)  # padding rows wrote theirs too: back to PAD_LEN
        src = torch.nn.functional.pad(acc.path_nodes.clamp(min=0) + 1, (1, 0))  # [B, 1+D]: row 0 (root), the path
        committed = hidden.gather(1, src.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # root, then the path
        drafter.commit_device(rows, acc, committed, cache.pad_row if padded else None)
        return _pack(acc, tree)

    @torch.inference_mode()
    @_with_pdl
    def generate(self, prompts: list[list[int]]) -> GenerationResult:
        cfg, dev = self.config, self.device
        b = len(prompts)
        if b < 1:
            raise ValueError("generate needs at least one prompt")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every prompt needs at least one token")
        plen = [len(p) for p in prompts]
        gen = torch.Generator(device=dev).manual_seed(cfg.seed)
        self._reserve(plen)
        cache, tokens, kv_len_all = self.cache, self.tokens, self.kv_len
        stats_before = self.graph_stats()
        timer = PhaseTimer(dev, cfg.timing, self._timer_events)

        padded = torch.zeros(b, max(plen), dtype=torch.long)
        for i, p in enumerate(prompts):
            padded[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        padded = padded.to(dev)
        tokens[:b].zero_()
        tokens[:b, :padded.shape[1]] = padded
        kv_len_all.fill_(PAD_LEN)
        kv_len_all[:b] = torch.tensor(plen, dtype=torch.long)
        rows = torch.arange(b, device=dev)
        kv_len = kv_len_all[:b].clone()
        positions = torch.arange(padded.shape[1], device=dev).expand(b, -1)
        state = BatchState(rows=rows, rows_host=list(range(b)), tokens=tokens,
                           tokens_host=[list(p) for p in prompts], kv_len=kv_len, kv_len_host=list(plen),
                           kv_len_all=kv_len_all)

        t_start = time.perf_counter()
        with timer.phase("prefill"):
            hidden = self.prefill_step(rows, list(range(b)), padded, positions)  # [B, L, H]
            last = hidden[rows, kv_len - 1]  # [B, H] each prompt's last real position
            first = next_token(self.target.compute_logits(last), cfg.sampling, gen)  # [B]
            tokens[rows, kv_len] = first
            self._setup_drafter(gen)
            if self.drafter is not None:
                if self._wants_hidden():
                    self.drafter.prefill(state, padded, positions, hidden=hidden)
                else:
                    self.drafter.prefill(state, padded, positions)
        for i, n in enumerate(plen):
            cache.truncate(i, n)  # drop the padding's KV (and, paged, its blocks)
        first_host = first.tolist()
        t_first = time.perf_counter()
        outputs = [[t] for t in first_host]
        for i, t in enumerate(first_host):
            state.tokens_host[i].append(t)
        live = [i for i in range(b) if not self._finished(outputs[i])]
        done_at = [0.0 if i in live else t_first for i in range(b)]
        result = GenerationResult(outputs, t_start, t_first, done_at, num_nodes=self.num_nodes,
                                  beams=self.drafter is not None and self.drafter.proposes_beams)
        if self.overlaps():
            self._decode_overlapped(state, live, outputs, done_at, result, timer)
            live = []
        self._live = (list(range(b)), rows, kv_len)  # the prefill's rows: nothing to upload until a sequence leaves
        retire = functools.partial(self._record_step, result, outputs, done_at)
        while live:
            out = self.decode_step(live, state.tokens_host, timer, retire=retire)
            live = [row for row in live if row not in out.retired]
        result.phase_ms = timer.resolve()
        result.draft_forwards_per_step = self.drafter.model_forwards_per_step if self.drafter else 0
        if cfg.graphs.fixed_shape:
            result.graph_stats = self.graph_stats().since(stats_before)
        return result

    def decode_step(self, live: list[int], tokens_host: list[list[int] | None], timer: PhaseTimer,
                    num_nodes: int | None = None, row_nodes: list[int] | None = None,
                    retire: Callable[[DecodeStep], list[int]] | None = None) -> DecodeStep:
        """`launch_step` then `finish_step` (see both): one step (draft -> verify -> accept -> kv) over the live rows:
        afterwards the device state (tokens, kv_len, cache) holds the accepted tokens, `tokens_host[row]` is extended
        by the emitted tokens, rejected drafts' blocks are truncated and the drafter has committed. `generate`'s synchronous loop is this step until no row is live;
        serving (workbench/serving) runs it once per iteration over whatever rows are live then.

        tokens_host: per cache row, the row's committed tokens up to and including the root (None = not live).
        num_nodes: draft nodes verified this step (chains: the first `num_nodes` drafted tokens; 0 = no drafting,
        an autoregressive step; None = the drafter's N). row_nodes: per live row, a smaller count for that row
        (its drafts past it are marked invalid, so they are never accepted).
        retire: called in the kv phase once the step's host read is parsed and before the drafter commits (generate:
        cap the outputs, record the step, free the rows that finished); returns the rows it released, which are then
        not truncated (they are `retired` in the result)."""
        return self.finish_step(self.launch_step(live, tokens_host, timer, num_nodes, row_nodes), timer, retire)

    @_with_pdl
    def launch_step(self, live: list[int], tokens_host: list[list[int] | None], timer: PhaseTimer,
                    num_nodes: int | None = None, row_nodes: list[int] | None = None,
                    lengths: list[int] | None = None) -> LaunchedStep:
        """The part of `decode_step` that enqueues work: draft, verify and accept, and the packed result's copy to
        the host, which is not waited for (on a GPU: a non-blocking copy and an event). Between this and
        `finish_step` the caller may enqueue other work that does not touch these rows (serving: the prefill of
        rows that join) and plan on the host while the GPU runs the step.

        lengths: per live row an upper bound of its committed tokens, for a step launched while an earlier step over
        the row is still unread (serving's full overlap; as `generate`'s overlapped loop): greedy chains with the
        fused accept only, whose device step reads roots and lengths itself; the bounds size storage only, and the
        step's `finish_step` then keeps its rows' blocks and does not commit the drafter (a later step may be
        writing them)."""
        dev, cache = self.device, self.cache
        full = self.num_nodes
        n_nodes = full if num_nodes is None else num_nodes
        if n_nodes not in (0, full) and not (self.drafter is not None and self.drafter.proposes_chains):
            raise ValueError(f"num_nodes={n_nodes}: only chains can be verified shorter than their N={full}")
        fused = self._fused_accept(self._chains())
        fused_tree = not fused and self._fused_tree()
        if lengths is not None and not self.can_launch_ahead():
            raise ValueError("launch_step(lengths=...) needs one captured step (greedy chains with the fused accept, "
                             "or the tree step) and a drafter whose propose reads the device (Drafter.overlaps)")
        live_t, kv_len_then = self._live_rows(live)
        base_host = [len(tokens_host[r]) - 1 for r in live] if lengths is None else list(lengths)
        reads_kv_len = not (fused or fused_tree) or (self.drafter is not None and self.drafter.reads_kv_len)
        state = BatchState(rows=live_t, rows_host=list(live), tokens=self.tokens, tokens_host=tokens_host,
                           kv_len=self.kv_len[live_t] if reads_kv_len else kv_len_then, kv_len_host=base_host,
                           kv_len_all=self.kv_len, num_nodes=n_nodes if n_nodes != full else None)
        base = state.kv_len
        with timer.phase("draft"):
            if n_nodes and self.drafter is not None:
                tree = self.drafter.propose(state)
                if n_nodes < full or row_nodes is not None:
                    tree = shorten(tree, n_nodes, row_nodes)
            else:
                tree = DraftTree.empty(len(live), dev)
        n = tree.num_nodes
        with timer.phase("verify"):
            if fused:
                cache.plan(live, base_host, 1 + n)
                packed_dev = self.accept_step(n, len(live), {
                    "draft": tree.token_ids if n else None, "rows": live_t,
                    "valid": tree.valid if n else None}, live)  # [B, 3 + N], state already updated
            elif fused_tree:
                cache.plan(live, base_host, 1 + n)
                packed_dev = self.tree_step(n, len(live), {
                    "tree": tree_input(tree) if n else None, "rows": live_t,
                    "uniforms": self.verifier.uniforms(len(live), n, dev)}, live)  # state, cache and drafter updated
            else:
                ids = torch.cat([state.root.unsqueeze(1), tree.token_ids], 1)  # [B, 1+N]
                offsets = torch.cat([torch.zeros_like(base).unsqueeze(1), tree.depths], 1)
                logits = self.target_step(live_t, live, ids, base.unsqueeze(1) + offsets, base, base_host,
                                          verify_mask(tree))  # [B, 1+N, V]
                if self._wants_hidden():
                    logits, verify_hidden = logits  # verify_hidden [B, 1+N, H]
        with timer.phase("accept"):
            if fused:  # a chain's accepted path is its first num_accepted nodes: no path needed (no KV move)
                acc = Acceptance(packed_dev[:, 0], tree.parents[:, :0], packed_dev[:, 2:])
            elif fused_tree:  # everything but the host read happened in the step: its width is all finish needs
                d = self.drafter.depth_bound if n else 0
                acc = Acceptance(packed_dev[:, 0], tree.parents[:, :d], packed_dev[:, 2:3 + d])
            else:
                acc = self.verifier.accept(tree, logits)
                packed_dev = _pack(acc, tree)
            # the step's one device->host read (accepted, drafted, emitted tokens), waited for in finish_step
            packed = HostCopy(packed_dev)
        return LaunchedStep(live, base_host, n, fused, tree, acc, state, packed,
                            verify_hidden if not (fused or fused_tree) and self._wants_hidden() else None,
                            lengths is not None, fused_tree)

    @_with_pdl
    def finish_step(self, step: LaunchedStep, timer: PhaseTimer,
                    retire: Callable[[DecodeStep], list[int]] | None = None, keep: bool = False) -> DecodeStep:
        """Waits for a launched step's host read, then its kv phase (see `decode_step`): rows' tokens on the host,
        rejected drafts' blocks truncated, the drafter committed. keep (and any step launched with `lengths`):
        neither truncate nor commit, because a later step over these rows may already be in flight; the rows'
        blocks are then freed when they are released. Steps must be finished in the order they were launched."""
        dev, cache = self.device, self.cache
        live, base_host, n, fused, tree, acc, state = (step.live, step.base_host, step.n, step.fused, step.tree,
                                                       step.acc, step.state)
        tokens_host, base, live_t = state.tokens_host, state.kv_len, state.rows
        with timer.phase("accept"):
            packed = step.packed.get()
        t_emit = time.perf_counter()
        with timer.phase("kv"):
            d = acc.emitted.shape[1] - 1  # deepest path the step could accept
            if not (fused or step.fused_tree):
                if not tree.is_chain and d:
                    dst = base.unsqueeze(1) + 1 + torch.arange(d, device=dev)
                    cache.move_path(live_t, torch.where(acc.path_nodes >= 0, base.unsqueeze(1) + 1 + acc.path_nodes,
                                                        dst), dst)
                self.kv_len[live_t] = base + 1 + acc.num_accepted
                write = base.unsqueeze(1) + 1 + torch.arange(d + 1, device=dev)
                self.tokens[live_t.unsqueeze(1), write] = acc.emitted
            out = DecodeStep.unpack(packed, t_emit, list(live), base_host, n, width=d, ranks=not fused and
                                    not tree.is_chain, beams=not fused and tree.beam_pairs is not None)
            for row, emitted in zip(live, out.emitted):
                tokens_host[row].extend(emitted)
            out.retired = retire(out) if retire is not None else []
            if keep or step.bounded:
                return out
            state.kv_len_host = [len(tokens_host[r]) - 1 for r in live]
            if self.drafter is not None:
                if step.fused_tree:
                    self.drafter.commit_host(state, base_host)
                elif self._wants_hidden():  # the committed tokens' hidden: root (row 0), accepted nodes (1 + node)
                    verify_hidden = step.verify_hidden
                    root = torch.zeros(acc.path_nodes.shape[0], 1, dtype=torch.long, device=dev)  # verify row 0
                    src = torch.cat([root, 1 + acc.path_nodes], 1)  # -1 -> 0; a step without drafts: the root only
                    committed = verify_hidden.gather(1, src.unsqueeze(-1).expand(-1, -1, verify_hidden.shape[-1]))
                    self.drafter.commit(state, acc, base_host, hidden=committed)  # [B, 1 + D, H]
                else:
                    self.drafter.commit(state, acc, base_host)
            for row, new_len in zip(live, state.kv_len_host):
                if row not in out.retired:
                    cache.truncate(row, new_len)
        return out

    def _live_rows(self, live: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`live` as a device tensor [B], and those rows' kv_len [B] as of then (what a drafter without `reads_kv_len`
        is given: not refreshed); both made again only when the live rows change (uploaded in stream order, without
        waiting for the GPU: `upload`)."""
        if self._live is None or self._live[0] != live:
            live_t = upload(live, self.device)
            self._live = (list(live), live_t, self.kv_len[live_t])
        return self._live[1], self._live[2]

    def _record_step(self, result: GenerationResult, outputs: list[list[int]], done_at: list[float],
                     out: DecodeStep, skip: set[int] = frozenset()) -> list[int]:
        """generate's bookkeeping of one read step (synchronous and overlapped): each row's emitted tokens, capped by
        max_new_tokens (and EOS), join its output; the step's StepRecord joins `result`; rows that finished are retired
        (done time, storage freed, drafter released). Rows in `skip` (finished already: an overlapped step launched
        before their last one was read) are left out. Returns the rows it retired."""
        cfg = self.config
        eos = cfg.eos_token_id if cfg.stop_on_eos else None
        rec = StepRecord(len(result.steps), out.t_emit, [], [], [], [])
        retired = []
        for j, row in enumerate(out.rows):
            if row in skip:
                continue
            kept = cap_emitted(out.emitted[j], cfg.max_new_tokens - len(outputs[row]), eos)
            outputs[row].extend(kept)
            rec.rows.append(row)
            rec.drafted.append(out.drafted[j])
            rec.accepted.append(out.accepted[j])
            rec.emitted.append(len(kept))
            rec.path_ranks.append(out.path_ranks[j])
            if out.beam_pairs:
                rec.beam_pairs.append(out.beam_pairs[j])
            if self._finished(outputs[row]):
                done_at[row] = out.t_emit
                retired.append(row)
                self.cache.free(row)  # overlapped: a launched step may still write these blocks; stream order
                if self.drafter is not None:  # keeps them ahead of any later step that reuses them
                    self.drafter.release(row)
        if rec.rows:
            result.steps.append(rec)
        return retired

    def _decode_overlapped(self, state: BatchState, live: list[int], outputs: list[list[int]], done_at: list[float],
                           result: GenerationResult, timer: PhaseTimer) -> None:
        """The decode loop with step t + 1 launched before step t is read (greedy chains with the fused verify +
        accept, and the captured tree step).

        Host lengths are upper bounds while a step is in flight (known root index + 1 + D, D = the most a step can
        accept); they size storage only.
        The drafter's propose reads its roots and lengths from the device (Drafter.overlaps); commit is not called
        (it would only free blocks, which the next step may still write): storage is freed when a sequence finishes.
        Phases: "draft" and "verify" time what they enqueue (CUDA events: GPU time), "accept" the wait for a result.
        """
        dev, cache, drafter = self.device, self.cache, self.drafter
        n = self.num_nodes
        d = self._max_accept(n)
        tree_step = self._fused_tree()
        cuda = dev.type == "cuda"
        known = {r: len(state.tokens_host[r]) - 1 for r in live}  # root index after the last step read
        finished: set[int] = set()
        bufs: list[torch.Tensor | None] = [None, None]  # pinned host buffers of the packed reads, made on first use
        inflight = None  # (rows, packed host buffer, event)
        launch, launch_t = list(live), state.rows
        step = 0
        limit = self.config.max_new_tokens

        def read(inflight) -> None:  # step t's tokens into the outputs; rows that finished join `finished`
            rows, packed, event = inflight
            with timer.phase("accept"):
                if event is not None:
                    event.synchronize()  # step t's tokens; step t + 1 keeps the GPU busy meanwhile
            out = DecodeStep.unpack(packed, time.perf_counter(), rows, [known[r] for r in rows], n, width=d,
                                    ranks=tree_step and not drafter.proposes_chains,
                                    beams=tree_step and drafter.proposes_beams)
            if all(r in finished for r in rows):
                result.wasted_steps += 1
            for row, emitted in zip(rows, out.emitted):
                if row not in finished:  # else the wasted step after it finished
                    known[row] += len(emitted)
                    state.tokens_host[row].extend(emitted)
            finished.update(self._record_step(result, outputs, done_at, out, skip=finished))

        while launch or inflight is not None:
            if inflight is not None and launch and all(len(outputs[r]) + 1 + d >= limit for r in launch):
                read(inflight)  # each row may finish in the step in flight: a launch now would likely be wasted
                inflight = None
                launch = [r for r in launch if r not in finished]
                continue
            launched = None
            if launch:
                if len(launch_t) != len(launch):
                    launch_t = upload(launch, dev)  # in stream order: the step in flight is not drained
                ahead = 1 + d if inflight is not None else 0  # every launched row is in the step in flight
                hi = [known[r] + ahead for r in launch]
                state.rows, state.rows_host, state.kv_len_host = launch_t, launch, hi
                with timer.phase("draft"):
                    tree = drafter.propose(state) if drafter else None
                with timer.phase("verify"):
                    cache.plan(launch, hi, 1 + n)
                    if tree_step:
                        packed_dev = self.tree_step(n, len(launch), {
                            "tree": tree_input(tree), "rows": launch_t,
                            "uniforms": self.verifier.uniforms(len(launch), n, dev)}, launch)
                    else:
                        packed_dev = self.accept_step(n, len(launch), {
                            "draft": tree.token_ids if n else None, "rows": launch_t,
                            "valid": tree.valid if n else None}, launch)  # [B, 3 + N]; overwritten by the next replay
                if bufs[step % 2] is None:
                    bufs[step % 2] = torch.empty(cache.max_rows, packed_dev.shape[1], dtype=torch.long,
                                                 pin_memory=cuda)
                buf = bufs[step % 2][:len(launch)]
                buf.copy_(packed_dev, non_blocking=cuda)
                event = None
                if cuda:
                    event = torch.cuda.Event()
                    event.record()
                launched = (launch, buf, event)
            if inflight is not None:
                read(inflight)
            inflight = launched
            launch = [r for r in launched[0] if r not in finished] if launched is not None else []
            step += 1

    def _finished(self, out: list[int]) -> bool:
        cfg = self.config
        if len(out) >= cfg.max_new_tokens:
            return True
        return cfg.stop_on_eos and cfg.eos_token_id is not None and bool(out) and out[-1] == cfg.eos_token_id

    # -- in-flight batching: rows join (prefill_row) and leave (release_row) between steps (workbench/serving) ------
    # each iteration then runs `decode_step` over whatever rows are live
    def setup_rows(self, cache, max_len: int) -> None:
        """Adopt `cache` (its `max_rows` rows + pad_row, its own block pool; e.g. a prefix-caching pool) and allocate
        the persistent tokens [R + 1, S] / kv_len [R + 1] buffers and the steps around it; set the drafter up for
        the same rows. Drops whatever `generate` had reserved (and its graphs)."""
        self.cache = self.tokens = self.kv_len = self.target_step = self.accept_step = self.prefill_step = None
        self.tree_step = None
        self._adopt(cache, max_len)
        self._setup_drafter(torch.Generator(device=self.device).manual_seed(self.config.seed))

    @_with_pdl
    def prefill_row(self, row: int, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill one chunk of one row: tokens `ids` at positions start.. (the row's KV before `start` is already
        in the cache: earlier chunks, or prefix blocks shared with other requests). Writes the tokens into the
        row's `tokens` buffer. Returns (logits [V] at the chunk's last position, hidden [T, H] of the chunk)."""
        dev, t = self.device, len(ids)
        chunk = upload([ids], dev)  # [1, T]
        self.tokens[row, start:start + t] = chunk[0]
        hidden = self.prefill_step.chunk(row, chunk, start)  # [1, T, H]; captured with prefill_graphs
        return self.target.compute_logits(hidden[0, -1]), hidden[0]

    def prefill_rows(self, rows: list[int], chunks: list[list[int]], starts: list[int]
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`prefill_row` for several rows in one forward (PrefillStep.chunks): row i's tokens chunks[i] at positions
        starts[i]... Returns (logits [B, V] at each chunk's last position, per row its chunk's hidden [T_i, H])."""
        lengths = [len(c) for c in chunks]
        t = max(lengths)
        ids = upload([c + [0] * (t - len(c)) for c in chunks], self.device)  # [B, T], right-padded
        for i, (row, n, start) in enumerate(zip(rows, lengths, starts)):
            self.tokens[row, start:start + n] = ids[i, :n]
        hidden = self.prefill_step.chunks(rows, ids, lengths, starts)  # [B, T, H]
        last = hidden[torch.arange(len(rows), device=self.device), upload([n - 1 for n in lengths], self.device)]
        return self.target.compute_logits(last), [hidden[i, :n] for i, n in enumerate(lengths)]

    @_with_pdl
    def start_row(self, row: int, context: list[int], root: int, hidden: torch.Tensor | None = None,
                  prefill_drafter: bool = True) -> None:
        """The row's prefill is complete: `context` (its committed tokens, KV written) and `root` (the next token,
        sampled from the prefill or known from before a preemption) become its state, and the drafter prefills it
        (hidden [len(context), H]: the target's final hidden states of the context, for `wants_hidden` drafters).
        prefill_drafter False leaves a draft model's own KV empty, for `catch_up_drafter` before the row's first draft
        (serving: a row that never drafts never pays for it)."""
        dev, n = self.device, len(context)
        self.tokens[row, :n + 1] = upload(list(context) + [root], dev)
        self.kv_len[row].fill_(n)  # a kernel with n as its argument: `kv_len[row] = n` copies a host scalar and
        # synchronizes (one of the few syncs per request that gpu_serving --sync-sites counts)
        if prefill_drafter:
            self.sync_drafter(row, n, hidden)

    @_with_pdl
    def sync_drafter(self, row: int, n: int, hidden: torch.Tensor | None = None) -> None:
        """(Re)prefill the drafter with the row's first n committed tokens (after the target's prefill, or after
        steps that skipped drafting left a draft model's own KV behind)."""
        if self.drafter is None:
            return
        dev = self.device
        rows = upload([row], dev)
        state = BatchState(rows=rows, rows_host=[row], tokens=self.tokens, tokens_host=[],
                           kv_len=upload([n], dev), kv_len_host=[n], kv_len_all=self.kv_len)
        ids = self.tokens[row, :n].unsqueeze(0)  # [1, n]
        positions = torch.arange(n, device=dev).unsqueeze(0)
        if self._wants_hidden():
            self.drafter.prefill(state, ids, positions, hidden=hidden.unsqueeze(0))
        else:
            self.drafter.prefill(state, ids, positions)

    @_with_pdl
    def catch_up_drafter(self, rows: list[int], starts: list[int], ends: list[int]) -> None:
        """The drafter's own KV of rows[i] is valid below starts[i]: write it for the committed tokens at positions
        starts[i] .. ends[i] - 1, all rows in one forward of T = the largest gap. A row with a smaller gap starts
        earlier (rewriting valid KV with the same tokens at the same positions changes nothing), so no row writes past
        its end, except one shorter than T, whose padding lands at positions < T (the next draft writes them first)."""
        dev = self.device
        t = max(e - s for s, e in zip(starts, ends))
        first = [max(0, e - t) for e in ends]
        rows_t = upload(rows, dev)
        positions = upload(first, dev).unsqueeze(1) + torch.arange(t, device=dev)
        ids = self.tokens[rows_t.unsqueeze(1), positions]  # [B, T]
        state = BatchState(rows=rows_t, rows_host=list(rows), tokens=self.tokens, tokens_host=[],
                           kv_len=upload(ends, dev), kv_len_host=list(ends), kv_len_all=self.kv_len)
        self.drafter.catch_up(state, ids, positions, first)

    @torch.inference_mode()  # its buffers may have been made under inference mode (e.g. by a calibration)
    def reset_rows(self) -> None:
        """Every row released, the cache and the drafter's emptied; steps and their graphs kept (serving runs that
        reuse the engine with the same cache shape)."""
        self.cache.reset()
        self.kv_len.fill_(PAD_LEN)
        self._live = None
        self._setup_drafter(torch.Generator(device=self.device).manual_seed(self.config.seed))

    def release_row(self, row: int) -> None:
        """The row's sequence finished or was preempted: its cache blocks and the drafter's state are released."""
        self.cache.free(row)
        self.kv_len[row].fill_(PAD_LEN)  # no host scalar copied (that synchronizes): see start_row
        if self.drafter is not None:
            self.drafter.release(row)


class HostCopy:
    """A device tensor's copy on its way to the host: on a GPU a non-blocking copy into pinned memory (the caching
    host allocator's) and an event recorded after it; on a CPU a plain copy (a fixed-shape step's output buffer is
    overwritten by its next call). `get` waits for it (the caller's one wait for the GPU) and returns it."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.is_cuda:
            self.tensor = t.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.tensor = t.clone()

    def get(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.tensor


@dataclass
class LaunchedStep:
    """A decode step enqueued by `SpecEngine.launch_step`, its packed result on its way to the host."""
    live: list[int]
    base_host: list[int]
    n: int  # draft nodes verified per row
    fused: bool
    tree: DraftTree
    acc: Acceptance
    state: BatchState
    packed: HostCopy  # the packed read [B, 3 + D (+ D) (+ 2)] (`_pack`)
    verify_hidden: torch.Tensor | None  # the unfused verify's hidden states, for drafters that want them
    bounded: bool = False  # launched with upper-bound lengths (`launch_step(lengths=)`): finish keeps blocks
    fused_tree: bool = False  # the captured tree step ran (`_verify_tree`): the drafter's device commit is done


@dataclass
class DecodeStep:
    """What one `SpecEngine.decode_step` did, per live row (in `rows` order): its host read, unpacked."""
    t_emit: float  # host perf_counter when the step's tokens were known
    rows: list[int]
    context_len: list[int]  # committed tokens before the step (kv_len)
    num_nodes: int  # draft nodes verified per row this step (0: an autoregressive step)
    drafted: list[int]  # valid draft nodes per row
    accepted: list[int]
    emitted: list[list[int]]  # accepted + 1 tokens per row (not capped by any output length)
    path_ranks: list[list[int]]  # sibling ranks of the accepted nodes, depth 1 first (chains: all 0)
    beam_pairs: list[tuple[int, int]]  # (differing, compared) beam-pair positions; empty unless merged beams
    retired: list[int] = field(default_factory=list)  # rows the step's `retire` released

    @classmethod
    def unpack(cls, packed: torch.Tensor, t_emit: float, rows: list[int], context_len: list[int], num_nodes: int,
               width: int, ranks: bool = False, beams: bool = False) -> DecodeStep:
        """The host side of `_pack`: packed [B, 3 + D (+ D) (+ 2)] on the host, D = width; ranks / beams: whether
        the tree extras are there (else every accepted node has rank 0 and there are no beam pairs)."""
        drafted, accepted, emitted, path_ranks, beam_pairs = [], [], [], [], []
        for read in packed.tolist():
            n_acc = read[0]
            accepted.append(n_acc)
            drafted.append(read[1])
            emitted.append(read[2:3 + n_acc])
            path_ranks.append(read[3 + width:3 + width + n_acc] if ranks else [0] * n_acc)
            if beams:
                beam_pairs.append((read[-2], read[-1]))
        return cls(t_emit, rows, context_len, num_nodes, drafted, accepted, emitted, path_ranks, beam_pairs)


def cap_emitted(emitted: list[int], room: int, eos_token_id: int | None = None) -> list[int]:
    """The part of a step's emitted tokens a sequence keeps: at most `room` (what max_new_tokens leaves), and nothing
    after the first `eos_token_id` (None: no EOS stop).

    >>> cap_emitted([5, 7, 2, 9], 3)
    [5, 7, 2]
    >>> cap_emitted([5, 7, 2, 9], 3, eos_token_id=7)
    [5, 7]
    """
    kept = emitted[:room]
    if eos_token_id is not None and eos_token_id in kept:
        kept = kept[:kept.index(eos_token_id) + 1]
    return kept


def _pack(acc: Acceptance, tree: DraftTree) -> torch.Tensor:
    """[B, 3 + D (+ D) (+ 2)] long: accepted count, drafted count, the emitted tokens [D + 1] (what the host reads per
    step); then, for trees that are not chains, the accepted path's sibling ranks [D] (-1 past the path), and for
    trees merged from beams their (differing, compared) beam-pair counts [2]: the tree metrics ride on the one read."""
    drafted = tree.valid.sum(-1, keepdim=True) if tree.num_nodes else torch.zeros_like(acc.num_accepted).unsqueeze(1)
    parts = [acc.num_accepted.unsqueeze(1), drafted, acc.emitted]
    if not tree.is_chain:  # path nodes are valid: their sibling rank is their count of earlier siblings
        n = tree.num_nodes
        ranks = torch.nn.functional.pad(earlier_siblings(tree).sum(-1), (0, 1), value=-1)  # [B, N + 1]: -1 last
        parts.append(ranks.gather(1, acc.path_nodes % (n + 1)))  # [B, D]; off the path (-1) -> -1
    if tree.beam_pairs is not None:
        parts.append(tree.beam_pairs)
    return torch.cat(parts, 1)


def shorten(tree: DraftTree, n: int, row_nodes: list[int] | None = None) -> DraftTree:
    """A step's drafts cut to their first n nodes (chains; `decode_step(num_nodes=n)`), and with `row_nodes` each row
    to its own count (drafts past it marked invalid, never accepted). A uniform cut only slices (no new mask: nothing
    to upload); per-row counts go up through `upload`."""
    valid = tree.valid[:, :n]
    if row_nodes is not None:
        dev = tree.valid.device
        valid = valid & (torch.arange(n, device=dev) < upload(row_nodes, dev).unsqueeze(1))
    probs = tree.draft_probs[:, :n] if tree.draft_probs is not None else None
    if tree.is_chain:
        return DraftTree.chain(tree.token_ids[:, :n], valid, probs)
    return DraftTree(tree.token_ids, tree.parents, tree.depths, valid, probs, depth_bound=tree.depth_bound,
                     distinct_siblings=tree.distinct_siblings)
