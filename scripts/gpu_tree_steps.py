"""Cost of one target step per method and batch: trees and beams against AR and chains (issue 40's goals).

    python scripts/gpu_tree_steps.py --device cuda --target-config llama8b --out $OUT/steps8b
    python scripts/gpu_tree_steps.py --device cuda --preset small --out $OUT/steps_small
    OUT=/tmp/out PART=treesteps bash scripts/gpu_session.sh   # the 8B shape then tiny (PART=treesmall: small)
    # CPU smoke run (what tests/test_gpu_tree_steps.py runs):
    python scripts/gpu_tree_steps.py --device cpu --target-config tiny-random --preset tiny --batches 1,2 \
        --context 24 --steps 6 --rounds 2 --out out/treesteps

Targets: a random-weight config (--target-config: `llama8b`, Llama-3.1-8B's shapes in bf16, built on the device; or
`tiny-random` for a CPU smoke run) and/or a zoo preset (--preset, loaded by BenchSession with its draft model and its
trained EAGLE / ReDrafter heads where it has them). Random weights accept next to nothing: on them this measures what a
step costs, not what it saves.

Per target and batch (--batches), every method through the engine itself (SpecEngine + make_drafter, CUDA graphs on,
--compile, phase timers on), all engines of one batch in one process, interleaved over --rounds:
  ar          no drafter
  ngram k     the n-gram chain (k = --k)
  draft k     the draft-model chain (presets only)
  eagle       EAGLE-2 tree, depth / top-k / budget = --tree-depth / --tree-topk / --tree-budget (untrained head on a
              random target)
  eagle-hot   EAGLE-2 with a hot vocabulary (hot_vocab = --draft-vocab, FR-Spec): the same tree drafted from the head's
              --draft-vocab most frequent tokens (a random target's untrained head: the lowest ids)
  eagle3      EAGLE-3, the same tree (presets: their trained eagle3 head; random targets: an untrained head over a
              --draft-vocab draft vocabulary, whose smaller LM head is EAGLE-3's saving)
  redrafter   ReDrafter beams, width / length = --beam-width / --beam-length
  redrafter-hot  ReDrafter with a hot vocabulary (hot_vocab = --draft-vocab): the same beams searched over the head's
              --draft-vocab most frequent tokens (a random target's untrained head: the lowest ids)
  tree        a fixed tree of --tree-budget nodes (--beam-width branches of equal depth) with no drafting cost: the
              engine's tree verify step (the target over 1 + N tokens with a tree mask, acceptance, KV compaction);
              its verify phase is the bare tree verify ("verify x AR step" in the table), its ms/step the whole step
Each engine first runs one warm-up generate (it captures the graphs the timed calls replay: greedy decoding repeats
the same steps), whose outputs are compared with AR's (greedy: equal in float32; bf16 may flip near-ties). A timed
generate is B prompts of --context tokens for --steps new tokens; ms per target step = the decode loop's wall time
(first token -> last row done) / the target steps it ran; per-phase GPU ms per step from the result's phase_ms
(draft / verify / accept / kv); tokens/s = decode tokens / decode wall time. At --busy-batches, one more generate per
method under torch.profiler gives GPU busy and device kernels per step (GPU only).

Rows: median [min, max] over rounds, ratio to the AR step of the same target and batch, the issue's goal where it
names one (8B batch 1: tree <= 1.10x, eagle <= 1.35x, redrafter <= 1.35x; presets batch 1: eagle and redrafter
<= 2.0x), and per target the batch where eagle's tokens/s falls below AR's ("stops paying"; meaningful only with
trained heads). Output in --out: results.json and table.md, rewritten after every batch; --budget-s stops cleanly
(what was not measured is listed).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.tuning import KernelTuningError, parse_tuning  # noqa: E402
from workbench.engine import EngineConfig, SpecEngine  # noqa: E402
from workbench.engine.drafters import (Drafter, Eagle3Head, EagleHead, RedrafterHead, engine_target,  # noqa: E402
                                       make_drafter)
from workbench.engine.tree import DraftTree  # noqa: E402
from workbench.models import LlamaModel, ModelConfig  # noqa: E402
from workbench.serving.loop import frozen_gc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fastpath import random_llama  # noqa: E402
from bench_trees import fmt  # noqa: E402

RANDOM_CONFIGS = {
    # Llama-3.1-8B's shapes (its llama3 RoPE scaling changes no cost and is left out)
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                    rms_norm_eps=1e-5, max_position_embeddings=8192),
    "tiny-random": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
}
METHODS = ("ar", "ngram", "draft", "eagle", "eagle-hot", "eagle3", "redrafter", "redrafter-hot", "tree")
HEADS = ("eagle", "eagle3", "redrafter")
PHASES = ("draft", "verify", "accept", "kv")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HEAD_SEED = 0


def ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers (e.g. 1,4)") \
            from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more numbers >= 1 (e.g. 1,4,16,32)")
    return values


def tuning_text(text: str) -> str:
    """A kernel_tuning text, checked (its error names the field)."""
    try:
        parse_tuning(text)
    except KernelTuningError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for results.json and table.md")
    ap.add_argument("--target-config", choices=sorted(RANDOM_CONFIGS), default=None,
                    help="random-weight target (llama8b: Llama-3.1-8B shapes; tiny-random: CPU smoke)")
    ap.add_argument("--preset", default=None, help="zoo preset target (tiny, small), measured after --target-config")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="model dtype (default bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--batches", type=ints, default=(1, 4, 16, 32), help="batch sizes (default 1,4,16,32)")
    ap.add_argument("--context", type=int, default=512, help="prompt length in tokens (default 512)")
    ap.add_argument("--steps", type=int, default=64, help="new tokens per prompt (max_new_tokens; default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, every method once per round (default 3)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma list of {', '.join(METHODS)} (default all; draft on presets only)")
    ap.add_argument("--k", type=int, default=4, help="chain length of ngram and draft (default 4)")
    ap.add_argument("--tree-depth", type=int, default=4, help="eagle tree depth D (default 4)")
    ap.add_argument("--tree-topk", type=int, default=4, help="eagle children per node K (default 4)")
    ap.add_argument("--tree-budget", type=int, default=16, help="eagle nodes N, and the fixed tree's (default 16)")
    ap.add_argument("--draft-vocab", type=int, default=32000,
                    help="eagle3 on a random target: its draft vocabulary; eagle-hot, redrafter-hot: their hot_vocab "
                         "(default 32000, the published Llama-3 EAGLE-3 heads' and FR-Spec's 32k)")
    ap.add_argument("--beam-width", type=int, default=4,
                    help="redrafter beams W, and the fixed tree's branches (default 4)")
    ap.add_argument("--beam-length", type=int, default=4, help="redrafter beam length L (default 4)")
    ap.add_argument("--busy-batches", type=lambda t: ints(t) if t.strip() else (), default=(1,),
                    help="batches whose methods get one extra generate under torch.profiler for GPU busy and "
                         "kernels per step (default 1; '' = none)")
    ap.add_argument("--compile", choices=("off", "default", "max-autotune"), default="off",
                    help="torch.compile of the fixed-shape steps (default off: at 8B each shape compiles for minutes)")
    ap.add_argument("--kernel-tuning", type=tuning_text, default="",
                    help="every engine's kernel_tuning record (kernels/tuning.py), e.g. "
                         "inductor_pdl=0,inductor_combo=0 for inductor's defaults (default: the record's defaults)")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="launch-ahead steps where the engine can (default on, the engine's default)")
    ap.add_argument("--budget-s", type=float, default=500.0,
                    help="stop starting work after this many seconds (default 500); what is left is listed")
    args = ap.parse_args(argv)
    if args.target_config is None and args.preset is None:
        ap.error("no target: give --target-config llama8b and/or --preset small")
    args.dtype = args.dtype or ("bfloat16" if str(args.device).startswith("cuda") else "float32")
    args.methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        ap.error(f"--methods: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(METHODS)}")
    if "ar" not in args.methods:
        ap.error("--methods must include ar (every ratio is to the AR step of the same batch)")
    for name in ("context", "steps", "rounds", "k", "tree_depth", "tree_topk", "tree_budget", "beam_width",
                 "beam_length"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.tree_budget % args.beam_width:
        ap.error(f"--tree-budget {args.tree_budget} must be a multiple of --beam-width {args.beam_width} (the fixed "
                 "tree is that many equal branches)")
    if args.budget_s <= 0:
        ap.error("--budget-s must be > 0")
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA GPU is visible; use --device cpu")
    return args


class StaticTreeDrafter(Drafter):
    """A fixed tree of `branches` chains of `depth` nodes below the root, costing no drafting: tokens root + 1 + i
    (mod vocab), so a step is the engine's captured tree step (verify, acceptance and KV compaction) alone."""

    name = "static-tree"
    proposes_chains = False
    splits_commit = True  # nothing to commit: the engine's captured tree step runs it (verify + accept + KV move)

    def commit_device(self, rows, acc, hidden, pad_row) -> None:
        pass

    @property
    def depth_bound(self) -> int:
        return self.depth

    def __init__(self, branches: int, depth: int, vocab_size: int):
        self.branches, self.depth, self.vocab_size = branches, depth, vocab_size
        self.num_nodes = branches * depth

    def setup(self, ctx) -> None:
        super().setup(ctx)
        i = torch.arange(self.num_nodes, device=ctx.device)
        self.parents = torch.where(i % self.depth == 0, -1, i - 1)  # each branch a chain from the root
        self.depths = i % self.depth + 1
        self.offsets = i + 1

    def propose(self, state) -> DraftTree:
        b, n = state.rows.shape[0], self.num_nodes
        tokens = (state.root.unsqueeze(1) + self.offsets) % self.vocab_size  # [B, N], on the device
        return DraftTree(tokens, self.parents.expand(b, n), self.depths.expand(b, n),
                         torch.ones(b, n, dtype=torch.bool, device=tokens.device), depth_bound=self.depth)

    @property
    def settings(self) -> dict:
        return {"branches": self.branches, "depth": self.depth}


def random_target(name: str, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    """A random-weight Llama of RANDOM_CONFIGS[name], built directly in `dtype` on `device` (no float32 copy)."""
    return random_llama(ModelConfig(**RANDOM_CONFIGS[name]), dtype, device, seed=0)


class Target:
    """One target model with what its methods need: draft model (or None), heads and where they came from, and
    B prompts of the context length."""

    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        self.draft = None
        self.tokenizer_ids: list[int] | None = None  # presets: the prompt file's tokens, concatenated

    @classmethod
    def random(cls, args, device: torch.device) -> "Target":
        t = cls(args, device)
        t.name, t.kind = args.target_config, "random"
        t.model = random_target(args.target_config, DTYPES[args.dtype], device)
        vd = min(args.draft_vocab, t.model.config.vocab_size)
        t.heads = {"eagle": lambda: EagleHead.for_target(t.model, seed=HEAD_SEED),
                   "eagle3": lambda: Eagle3Head.for_target(t.model, seed=HEAD_SEED, draft_tokens=torch.arange(vd)),
                   "redrafter": lambda: RedrafterHead.for_target(t.model, seed=HEAD_SEED)}
        t.head_sources = {k: f"untrained (seed {HEAD_SEED})" for k in HEADS}
        t.head_sources["eagle3"] += f", draft vocabulary {vd}"
        return t

    @classmethod
    def preset(cls, args, device: torch.device) -> "Target":
        from workbench.harness.bench import BenchSession

        session = BenchSession.load(preset=args.preset, device=str(device), dtype=args.dtype)
        t = cls(args, device)
        t.name, t.kind = args.preset, "preset"
        t.model, t.draft = session.target, session.draft
        t.heads = {"eagle": session.eagle_head, "eagle3": session.eagle3_head, "redrafter": session.redrafter_head}
        t.head_sources = {}
        t.session = session
        ids = [i for p in session.prompts for i in session.tokenizer.encode(p.text).ids]
        if not ids:
            raise ValueError(f"preset {args.preset}: its prompts encode to no tokens")
        t.tokenizer_ids = ids
        return t

    def head(self, kind: str):
        """The method's head, made (or loaded) once and kept for every batch."""
        if callable(self.heads[kind]) and not isinstance(self.heads[kind], torch.nn.Module):
            self.heads[kind] = self.heads[kind]()  # a preset without an EAGLE-3 head gives None: make_drafter's own
            if self.kind == "preset":
                self.head_sources[kind] = getattr(self.session, f"{kind}_head_source")
        return self.heads[kind]

    def prompts(self, batch: int) -> list[list[int]]:
        """`batch` prompts of exactly --context tokens: random ids for a random target, else windows of the preset's
        prompt text at different offsets (cycled where the text is shorter)."""
        n = self.args.context
        if self.tokenizer_ids is None:
            g = torch.Generator().manual_seed(1234)
            vocab = self.model.config.vocab_size
            return [torch.randint(1, vocab, (n,), generator=g).tolist() for _ in range(batch)]
        ids, stride = self.tokenizer_ids, 97
        return [[ids[(r * stride + j) % len(ids)] for j in range(n)] for r in range(batch)]

    def check_fits(self) -> None:
        a = self.args
        nodes = max(a.k, a.tree_budget, a.beam_width * a.beam_length)
        need = a.context + a.steps + 2 * (nodes + 1) + 2
        ctx = int(self.model.config.max_position_embeddings)
        if need > ctx:
            raise ValueError(f"target {self.name}: --context {a.context} + --steps {a.steps} + {nodes} draft nodes "
                             f"needs {need} positions, the model has {ctx}: lower --context or --steps")

    def methods(self) -> tuple[list[tuple[str, str]], list[str]]:
        """(method, label) to run on this target, and notes on those left out."""
        a, out, notes = self.args, [], []
        for m in a.methods:
            if m == "draft" and self.draft is None:
                notes.append(f"{self.name}: draft k={a.k} skipped (a random target has no draft model)")
                continue
            if m == "eagle3" and self.model.config.num_hidden_layers < 3:
                notes.append(f"{self.name}: eagle3 skipped (an EAGLE-3 head reads three distinct target layers; this "
                             f"target has {self.model.config.num_hidden_layers})")
                continue
            base = m.removesuffix("-hot")
            if m != base and getattr(self.head(base), "hot_tokens", None) is None:
                notes.append(f"{self.name}: {m} skipped (its {base} head has no token ranking: retrain it)")
                continue
            out.append((m, label_of(m, a)))
        return out, notes

    def drafter(self, method: str):
        a = self.args
        if method == "tree":
            return StaticTreeDrafter(a.beam_width, a.tree_budget // a.beam_width, self.model.config.vocab_size)
        knobs = {"k": a.k, "ngram_min": 1, "ngram_max": 3, "tree_depth": a.tree_depth, "tree_topk": a.tree_topk,
                 "tree_budget": a.tree_budget, "beam_width": a.beam_width, "beam_length": a.beam_length}
        if method in ("eagle-hot", "redrafter-hot"):
            method, knobs["hot_vocab"] = method.removesuffix("-hot"), min(a.draft_vocab, self.model.config.vocab_size)
        heads = {m: self.head(m) for m in HEADS if m == method and self.head(m) is not None}
        return make_drafter(method, knobs, draft=self.draft, target=self.model, heads=heads)


def label_of(method: str, a) -> str:
    return {"ar": "ar", "ngram": f"ngram k={a.k}", "draft": f"draft k={a.k}",
            "eagle": f"eagle D{a.tree_depth} K{a.tree_topk} N{a.tree_budget}",
            "eagle-hot": f"eagle D{a.tree_depth} K{a.tree_topk} N{a.tree_budget} hot {a.draft_vocab}",
            "eagle3": f"eagle3 D{a.tree_depth} K{a.tree_topk} N{a.tree_budget}",
            "redrafter": f"redrafter W{a.beam_width} L{a.beam_length}",
            "redrafter-hot": f"redrafter W{a.beam_width} L{a.beam_length} hot {a.draft_vocab}",
            "tree": f"tree verify {1 + a.tree_budget} nodes"}[method]


def goal_of(target: Target, batch: int, method: str) -> float | None:
    """The issue's bound on (method step / AR step), where it names one for these settings."""
    a = target.args
    if batch != 1:
        return None
    issue_tree = (a.tree_depth, a.tree_topk, a.tree_budget) == (4, 4, 16)
    issue_beams = (a.beam_width, a.beam_length) == (4, 4)
    if target.kind == "random" and target.name == "llama8b":
        return {"tree": 1.10 if a.tree_budget == 16 else None, "eagle": 1.35 if issue_tree else None,
                "eagle-hot": 1.35 if issue_tree else None,
                "redrafter": 1.35 if issue_beams else None,
                "redrafter-hot": 1.35 if issue_beams else None}.get(method)
    if target.kind == "preset" and target.name in ("tiny", "small"):
        return {"eagle": 2.0 if issue_tree else None, "redrafter": 2.0 if issue_beams else None}.get(method)
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(engine: SpecEngine, prompts: list[list[int]], device: torch.device) -> dict:
    """One generate: ms per target step, per-phase ms per step, decode tokens/s, mean tokens per row-step."""
    captured_before = len(engine.graph_stats().captured)
    with frozen_gc():
        sync(device)
        res = engine.generate(prompts)
        sync(device)
    steps = len(res.steps) + res.wasted_steps  # target steps run (overlap: one may run after every row is done)
    wall = max(res.t_done) - res.t_first_token
    row_steps = sum(len(s.rows) for s in res.steps)
    return {"ms_per_step": wall * 1e3 / max(steps, 1), "steps": steps,
            "phase_ms": {p: res.phase_ms.get(p, 0.0) / max(steps, 1) for p in PHASES},
            "tokens_per_s": sum(len(o) - 1 for o in res.outputs) / wall if wall > 0 else None,
            "tokens_per_row_step": sum(sum(s.emitted) for s in res.steps) / max(row_steps, 1),
            "captured_in_call": len(engine.graph_stats().captured) - captured_before}


def busy_fraction(intervals: list[tuple[float, float]]) -> float | None:
    """The share of the span from the first interval's start to the last one's end that some interval covers
    (kernels that overlap, e.g. with dependent launches, count once).

    >>> busy_fraction([(0, 2), (1, 3), (5, 6)])  # 0..3 and 5..6 covered of 0..6
    0.6666666666666666
    >>> busy_fraction([]) is None
    True
    """
    if not intervals:
        return None
    iv = sorted(intervals)
    covered, (lo, hi) = 0.0, iv[0]
    for start, end in iv[1:]:
        if start > hi:
            covered, (lo, hi) = covered + hi - lo, (start, end)
        else:
            hi = max(hi, end)
    covered += hi - lo
    span = max(end for _, end in iv) - iv[0][0]
    return covered / span if span > 0 else None


def profiled(engine: SpecEngine, prompts: list[list[int]], device: torch.device) -> dict:
    """One generate under torch.profiler -> `kernel_summary` of its device kernels (GPU only)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        s = time.perf_counter()
        res = engine.generate(prompts)
        sync(device)
        wall = time.perf_counter() - s
    events = [(ev.name, ev.time_range.start, ev.time_range.end) for ev in prof.events()
              if ev.device_type == torch.autograd.DeviceType.CUDA]
    return kernel_summary(events, len(res.steps) + res.wasted_steps, wall)


def kernel_summary(events: list[tuple[str, float, float]], steps: int, wall_s: float) -> dict:
    """Device events (name, start us, end us) of one generate of `steps` target steps that took `wall_s` -> per step:
    kernels, the time some kernel ran, the generate's wall time; the table by name ([name, launches, us] per step, the
    60 costliest; the prefill's spread over the steps); the ordered trace of two steps' kernels from the middle
    ([name, start us after the first, duration us]). None without events (CPU).

    Kernel time per step (`kernel_us_per_step`): the union of the kernel intervals between two consecutive step ends,
    median over the middle half of the run. A step ends with its one device -> host read (the accepted tokens, "Memcpy
    DtoH"), so this leaves the prefill out; without one such read per step, the whole run's union / steps.
    The profiler slows the host: a profiled generate's steps take longer than unprofiled ones and its graph replays
    wait on the host in between, so the share of the profiled span some kernel ran (`gpu_busy_profiled_span`) reads
    low; `measure_batch` divides the kernel time per step by the UNPROFILED step instead (`gpu_busy`).

    >>> ev = [("k", 0, 2), ("DtoH", 3, 4), ("k", 10, 12), ("k", 11, 13), ("DtoH", 14, 15), ("k", 20, 21),
    ...       ("DtoH", 22, 23)]
    >>> s = kernel_summary(ev, 3, 90e-6)
    >>> s["kernel_us_per_step"], s["steps_timed_by_marker"], round(s["profiled_ms_per_step"], 6)  # (4 + 2) / 2
    (3.0, 2, 0.03)
    >>> s["kernels_per_step"], s["kernel_table"][0], s["kernel_trace"][:2]
    (2.3333333333333335, ['k', 1.3333333333333333, 2.3333333333333335], [['DtoH', 0, 1], ['k', 7, 2]])
    >>> kernel_summary(ev, 30, 90e-6)["steps_timed_by_marker"]  # 3 reads for 30 steps: the whole run's union / steps
    0
    """
    if not events:
        return {"kernels_per_step": None, "gpu_busy_profiled_span": None}
    events = sorted(events, key=lambda e: e[1])
    steps = max(steps, 1)
    iv = [(start, end) for _, start, end in events]
    by_name: dict[str, list[float]] = {}
    for name, start, end in events:
        tot = by_name.setdefault(name[:80], [0, 0.0])
        tot[0] += 1
        tot[1] += end - start
    table = sorted(([name, n / steps, us / steps] for name, (n, us) in by_name.items()), key=lambda k: -k[2])
    per_step = len(events) / steps
    mid = len(events) // 2 - int(per_step) if len(events) > 2 * per_step else 0
    t_ref = events[mid][1]
    trace = [[name[:90], round(start - t_ref, 2), round(end - start, 2)]
             for name, start, end in events[mid:mid + int(2 * per_step)]]
    span_busy = busy_fraction(iv)
    ends = [i for i, (name, _, _) in enumerate(events) if "DtoH" in name]
    if abs(len(ends) - steps) > max(2, steps // 10):  # not one read per step: no markers to trust
        ends = []
    spans = [events[i + 1:j + 1] for i, j in zip(ends, ends[1:])]
    spans = spans[len(spans) // 4: len(spans) - len(spans) // 4] if len(spans) >= 4 else spans
    per_step_us = [busy_fraction([(a, b) for _, a, b in sp]) * (sp[-1][2] - sp[0][1]) for sp in spans if sp]
    return {"kernels_per_step": per_step,
            "kernel_us_per_step": statistics.median(per_step_us) if per_step_us
            else span_busy * (iv[-1][1] - iv[0][0]) / steps,
            "steps_timed_by_marker": len(per_step_us),
            "gpu_busy_profiled_span": span_busy, "profiled_ms_per_step": wall_s * 1e3 / steps,
            "kernel_table": table[:60], "kernel_trace": trace}


def median3(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def measure_batch(target: Target, batch: int, methods: list[tuple[str, str]], t0: float, notes: list[str]) \
        -> list[dict]:
    """Every method at one batch: engines built and warmed, then --rounds interleaved timed generates."""
    a, device = target.args, target.device
    prompts = target.prompts(batch)
    cfg = EngineConfig(max_new_tokens=a.steps, timing=True, cuda_graphs=True, compile=a.compile, overlap=a.overlap,
                       prefill_graphs=False, kernel_tuning=a.kernel_tuning)
    engines, errors, warm_s, outputs = {}, {}, {}, {}
    for method, label in methods:
        if time.perf_counter() - t0 > a.budget_s:
            errors[method] = "skipped: time budget spent"
            continue
        s, eng = time.perf_counter(), None
        try:
            drafter = target.drafter(method)
            eng = SpecEngine(engine_target(target.model, drafter), drafter, cfg, device)
            eng.reserve(batch, a.context)
            outputs[method] = eng.generate(prompts).outputs  # captures the graphs this batch's steps replay
            sync(device)
            engines[method] = eng
        except Exception as e:  # noqa: BLE001 - one failing method must not cost the call the other rows
            traceback.print_exc()
            errors[method] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            eng = None  # a half-built engine's caches go before the next one is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
        warm_s[method] = time.perf_counter() - s
        print(f"{time.perf_counter() - t0:7.1f}s  {target.name} b={batch} {label}: warm-up {warm_s[method]:.1f} s"
              f"{' ' + errors[method] if method in errors else ''}", flush=True)
    runs = {m: [] for m in engines}
    for r in range(a.rounds):
        if time.perf_counter() - t0 > a.budget_s and r > 0:
            notes.append(f"{target.name} batch {batch}: {r} of {a.rounds} rounds (time budget spent)")
            break
        for method in list(engines):
            try:
                runs[method].append(timed(engines[method], prompts, device))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                errors[method] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
                del engines[method]
    busy = {}
    if batch in a.busy_batches:
        for method in list(engines):
            if time.perf_counter() - t0 > a.budget_s:
                notes.append(f"{target.name} batch {batch}: GPU busy not profiled for {method} (time budget spent)")
                continue
            try:
                busy[method] = profiled(engines[method], prompts, device)
            except Exception as e:  # noqa: BLE001 - the timings stand without it
                traceback.print_exc()
                busy[method] = {"kernels_per_step": None,
                                "profile_error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
    rows = []
    ar = runs.get("ar") or []
    ar_ms = statistics.median(x["ms_per_step"] for x in ar) if ar else None
    ar_tps = statistics.median(x["tokens_per_s"] for x in ar) if ar else None
    for method, label in methods:
        row = {"target": target.name, "target_kind": target.kind, "batch": batch, "method": method, "label": label,
               "error": errors.get(method), "warmup_s": warm_s.get(method), "goal_max_ratio": goal_of(target, batch,
                                                                                                       method)}
        if method in outputs and "ar" in outputs:  # greedy: every drafter's output is AR's (bf16: near-ties aside)
            row["outputs_equal_ar"] = sum(o == r for o, r in zip(outputs[method], outputs["ar"]))
        rr = runs.get(method) or []
        if rr and row["error"] is None:
            ms = [x["ms_per_step"] for x in rr]
            tps = [x["tokens_per_s"] for x in rr if x["tokens_per_s"] is not None]
            med, lo, hi = median3(ms)
            row.update(ms_per_step=med, ms_per_step_min=lo, ms_per_step_max=hi, ms_per_step_rounds=ms,
                       ratio_vs_ar=med / ar_ms if ar_ms else None,
                       phase_ms_per_step={p: statistics.median(x["phase_ms"][p] for x in rr) for p in PHASES},
                       tokens_per_s=statistics.median(tps) if tps else None,
                       speedup_vs_ar=statistics.median(tps) / ar_tps if tps and ar_tps else None,
                       tokens_per_row_step=statistics.median(x["tokens_per_row_step"] for x in rr),
                       steps=rr[-1]["steps"], rounds=len(rr),
                       captured_in_timed=sum(x["captured_in_call"] for x in rr))
            if row["captured_in_timed"]:
                notes.append(f"{target.name} b={batch} {label}: {row['captured_in_timed']} graph(s) captured during "
                             "timed rounds (those rounds include capture time)")
            if method != "ar" and row["phase_ms_per_step"]["verify"] and ar and ar_ms:
                row["verify_ratio_vs_ar"] = row["phase_ms_per_step"]["verify"] / ar_ms
        if method in busy:
            row.update(busy[method])
            if row.get("kernel_us_per_step") is not None and row.get("ms_per_step"):
                row["gpu_busy"] = row["kernel_us_per_step"] / (row["ms_per_step"] * 1e3)
        if row["goal_max_ratio"] is not None and row.get("ratio_vs_ar") is not None:
            row["goal_met"] = row["ratio_vs_ar"] <= row["goal_max_ratio"]
        rows.append(row)
        print(f"{time.perf_counter() - t0:7.1f}s  {target.name} b={batch} {label:<26} "
              f"ms/step={fmt(row.get('ms_per_step'))} x AR={fmt(row.get('ratio_vs_ar'))} "
              f"tok/s={fmt(row.get('tokens_per_s'))} {row['error'] or ''}", flush=True)
    engines.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def stops_paying(rows: list[dict], target: str, method: str = "eagle") -> dict:
    """Per batch ([batch, speedup] pairs), `method`'s tokens/s over AR's on `target`, and the first batch where it
    falls below 1.

    >>> r = lambda b, s: {"target": "t", "method": "eagle", "batch": b, "speedup_vs_ar": s}
    >>> stops_paying([r(1, 1.5), r(4, 1.1), r(16, 0.9), r(32, 0.7)], "t")
    {'speedup_by_batch': [[1, 1.5], [4, 1.1], [16, 0.9], [32, 0.7]], 'stops_paying_at_batch': 16}
    """
    by_batch = sorted([r["batch"], r["speedup_vs_ar"]] for r in rows
                      if r["target"] == target and r["method"] == method and r.get("speedup_vs_ar") is not None)
    first = next((b for b, s in by_batch if s < 1.0), None)
    return {"speedup_by_batch": by_batch, "stops_paying_at_batch": first}


def table_md(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Target-step cost per method and batch · {m['device_name']} · {m['dtype']}", "",
             f"Prompts of {m['context']} tokens, {m['steps']} new tokens, {m['rounds']} interleaved rounds, "
             f"CUDA graphs on, compile {m['compile']}"
             + (f" (kernel_tuning {m['args']['kernel_tuning']})" if m["args"].get("kernel_tuning") else "")
             + f", overlap {fmt(m['overlap'])}; {m['elapsed_s']:.0f} s in all. "
             "ms/step: decode wall time / target steps (median [min, max] over rounds); phases: GPU ms per step; "
             "x AR: over the AR step of the same target and batch. GPU busy (goal on presets at batch 1: >= 80 % "
             "for eagle and redrafter): the time some kernel ran per decode step in one profiled generate over "
             "the unprofiled ms/step (busy in the profiled span, which the profiler's host overhead dilutes, in "
             "results.json).", ""]
    head = ["target", "batch", "method", "ms/step median [min, max]", "x AR step", "goal", "draft", "verify",
            "accept", "kv", "verify x AR step", "tokens/s", "tok/s x AR", "tokens per row-step", "GPU busy",
            "kernels per step", "outputs = AR"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        if r.get("ms_per_step") is None:
            lines.append(f"| {r['target']} | {r['batch']} | {r['label']} | {r['error'] or 'not measured'} |"
                         + " — |" * (len(head) - 4))
            continue
        goal = "—" if r["goal_max_ratio"] is None else \
            f"<= {r['goal_max_ratio']:.2f}x: {'met' if r.get('goal_met') else 'missed'}"
        ph = r["phase_ms_per_step"]
        lines.append("| " + " | ".join([
            r["target"], str(r["batch"]), r["label"],
            f"{r['ms_per_step']:.3f} [{r['ms_per_step_min']:.3f}, {r['ms_per_step_max']:.3f}]",
            f"{fmt(r['ratio_vs_ar'], '.2f')}x", goal, *(f"{ph[p]:.3f}" for p in PHASES),
            f"{fmt(r.get('verify_ratio_vs_ar'), '.2f')}x" if r.get("verify_ratio_vs_ar") is not None else "—",
            fmt(r["tokens_per_s"], ".1f"), f"{fmt(r['speedup_vs_ar'], '.2f')}x" if r["speedup_vs_ar"] else "—",
            fmt(r["tokens_per_row_step"], ".2f"),
            f"{r['gpu_busy']:.0%}" if r.get("gpu_busy") is not None else "—", fmt(r.get("kernels_per_step"), ".0f"),
            f"{r['outputs_equal_ar']}/{r['batch']}" if "outputs_equal_ar" in r else "—"]) + " |")
    if result["stops_paying"]:
        lines += ["", "## Where the tree stops paying (eagle tokens/s over AR per batch)", ""]
        for name, s in result["stops_paying"].items():
            per = ", ".join(f"b={b}: {v:.2f}x" for b, v in s["speedup_by_batch"])
            at = s["stops_paying_at_batch"]
            heads = result["meta"]["heads"].get(name, {}).get("eagle") or "—"
            lines.append(f"- {name} (eagle head: {heads}): {per or 'no eagle rows'}; "
                         + (f"below AR from batch {at}" if at else "at or above AR at every batch measured"))
    if result["notes"]:
        lines += ["", "Notes:"] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def write(out: Path, result: dict) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = table_md(result)
    (out / "table.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device(args.device)
    out = Path(args.out)
    rows, notes, names = [], [], []  # names: the targets measured (each model is freed before the next loads)
    heads: dict[str, dict] = {}

    from workbench.harness.telemetry import environment_info

    env = environment_info(str(device) if device.type == "cuda" else None)  # read once: git calls, NVML

    def result() -> dict:
        return {"meta": {"device": str(device), "device_name": env.get("device_name") or "cpu", "dtype": args.dtype,
                         "context": args.context, "steps": args.steps, "rounds": args.rounds, "compile": args.compile,
                         "overlap": args.overlap, "heads": heads, "elapsed_s": time.perf_counter() - t0,
                         "args": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()},
                         "env": env},
                "rows": rows, "notes": list(notes),
                "stops_paying": {n: stops_paying(rows, n) for n in names if any(
                    r["target"] == n and r["method"] == "eagle" for r in rows)}}

    makers = ([("random", args.target_config)] if args.target_config else []) + \
        ([("preset", args.preset)] if args.preset else [])
    for kind, name in makers:
        if time.perf_counter() - t0 > args.budget_s:
            notes.append(f"skipped (time budget spent): target {name}, batches {list(args.batches)}")
            continue
        try:
            target = Target.random(args, device) if kind == "random" else Target.preset(args, device)
            target.check_fits()
        except Exception as e:  # noqa: BLE001 - a bad preset or config is named, the other target still runs
            from workbench.harness.bench import BenchError
            if not isinstance(e, (BenchError, ValueError)):
                traceback.print_exc()
            notes.append(f"target {name} not measured: {type(e).__name__}: {e}")
            print(f"error: target {name}: {e}", file=sys.stderr)
            continue
        names.append(name)
        methods, why = target.methods()
        notes.extend(why)
        for i, batch in enumerate(args.batches):
            if time.perf_counter() - t0 > args.budget_s:
                notes.append(f"skipped (time budget spent): {name} batches {list(args.batches[i:])}")
                break
            rows.extend(measure_batch(target, batch, methods, t0, notes))
            heads[name] = dict(target.head_sources)
            write(out, result())
        del target
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    text = write(out, result())
    print("\n" + text)
    if not rows:
        print("error: nothing was measured (see the notes above)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
