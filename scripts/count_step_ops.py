"""Device ops per decode step, by phase, on the CPU: what a launch-bound GPU step pays for (issue 40).

    python scripts/count_step_ops.py --preset tiny --out out/ops.json
    python scripts/count_step_ops.py --methods ar,eagle --max-new-tokens 6     # what tests/test_count_step_ops.py runs

At batch 1 with CUDA graphs a small model's target step is bound by kernel launches, so its cost follows the number
of kernels it launches. This counts, under a TorchDispatchMode, the aten ops each decode step dispatches that would
launch device work: views and metadata ops (view, expand, slice, select, unsqueeze, as_strided, t, permute, detach,
alias, ...: `OpOverload.is_view` or METADATA_OPS), allocations without a fill (empty*), and ops whose tensor outputs
are all empty are left out; a reshape or flatten that had to copy (its result not in its input's storage) counts.
Everything else counts one (a CPU-only decomposition may differ from the GPU's by a few ops).

Engines run as on the GPU: the preset's models in float32, CUDA graphs on (on a CPU the same fixed-shape steps run
eagerly over their padded buffers; their outputs are not copied into kept tensors, a CPU-only copy), the paged cache,
greedy. Attention (--attention): "kernel" (default) takes the GPU's kernel path, where each paged cache (the target's,
the EAGLE head's, the draft model's) writes K/V and attends in one call and a tree or prefix mask becomes bit-words
once per forward: the two Triton launches (K/V write, attention) are stood in for by their PyTorch references, run
uncounted and counted as two launches; "sdpa" is the CPU's gather + SDPA path with its [B, 1, T, S] masks. Two
warm-up generates (the stand-ins go in after the first, once the caches exist), then a counted one; overlap is off
so that each decode step is one `decode_step` call (an overlapped step launches the same device work).

Methods (--methods): ar; draft k (the preset's draft model); eagle D K N (the preset's EAGLE head); redrafter W L (the
preset's ReDrafter head). Phases, innermost wins, a drafter's phase holds everything called inside it:
  draft          the drafter's propose (its captured step, input copies included)
  verify         the target step up to its logits (input copies, cache prepare, tree mask, the model, the LM head)
  accept+commit  after the logits, inside the target step: acceptance, the accepted path's KV moved, tokens and
                 lengths written, the drafter's device commit, the packed result
  other          the rest of the step (the live rows' lengths, the host read's copy, the kv phase)
Output: a table on stdout (per method the median per step of each phase, total and x AR) and, with --out, JSON with
every step's counts and the op names per phase.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.engine import EngineConfig, SpecEngine  # noqa: E402
from workbench.engine import graphs  # noqa: E402
from workbench.engine.drafters import engine_target, make_drafter  # noqa: E402

METHODS = ("ar", "draft", "eagle", "redrafter")
PHASES = ("draft", "verify", "accept+commit", "other")
aten = torch.ops.aten
# ops that only make or read metadata (no device work) beyond those `OpOverload.is_view` names
METADATA_OPS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
                aten._reshape_alias, aten._unsafe_view, aten.lift_fresh, aten.detach, aten.alias, aten.t,
                aten.size, aten.sym_size, aten.stride, aten.sym_stride, aten.numel, aten.sym_numel, aten.dim,
                aten.is_contiguous, aten.is_same_size, aten.resolve_conj, aten.resolve_neg, aten.set_}


def launches(func, out, args=()) -> bool:
    """Whether the op `func` (an OpOverload) with result `out` on `args` would launch device work. An op that may
    return a view (reshape, flatten) launches a copy where its result does not share its input's storage."""
    if func.overloadpacket in METADATA_OPS:
        return False
    tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
    if func.is_view:
        base = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return base is not None and any(t.numel() and t.untyped_storage().data_ptr() !=
                                        base.untyped_storage().data_ptr() for t in tensors)
    return not tensors or any(t.numel() for t in tensors)  # all-empty outputs: no kernel runs


class OpCounter(TorchDispatchMode):
    """Counts launching ops into the current phase (a stack: `phase(name)`); a drafter's phase is never left for an
    inner one (its head calls the target's embedding and LM head)."""

    def __init__(self):
        super().__init__()
        self.stack = ["other"]
        self.counts: Counter = Counter()
        self.names: dict[str, Counter] = {p: Counter() for p in PHASES}
        self.paused = False  # a stand-in for a kernel runs its reference uncounted
        self.active = False  # inside a counted decode step (the stand-ins record only then)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and launches(func, out, args):
            self.record(str(func.overloadpacket.__name__))
        return out

    def record(self, name: str) -> None:
        if not self.active:
            return
        phase = self.stack[-1]
        self.counts[phase] += 1
        self.names[phase][name] += 1

    def push(self, name: str) -> None:
        self.stack.append("draft" if "draft" in self.stack else name)

    def pop(self) -> None:
        self.stack.pop()

    def switch(self, name: str) -> None:
        """Inside a target step, the innermost phase becomes `name` (the step past its logits)."""
        if self.stack[-1] == "verify":
            self.stack[-1] = name


def wrap(obj, attr: str, counter: OpCounter, phase: str | None = None, after: str | None = None):
    """obj.attr (a method, looked up on the instance) runs in `phase` (None: the caller's); with `after`, the
    innermost phase becomes `after` once it returns. Set on the instance only; returns the undo."""
    fn = getattr(obj, attr)

    def wrapped(*args, **kwargs):
        if phase is not None:
            counter.push(phase)
        try:
            out = fn(*args, **kwargs)
        finally:
            if phase is not None:
                counter.pop()
        if after is not None:
            counter.switch(after)
        return out

    setattr(obj, attr, wrapped)
    return lambda: delattr(obj, attr)


class KernelStandIns:
    """The kernel path of paged caches on a CPU: `write_kernel` (K/V write + attention) and `kernel` (attention) run
    kernels.paged_attention's PyTorch references uncounted and record the launches the Triton kernels make."""

    def __init__(self, counter: OpCounter):
        self.counter = counter

    def _uncounted(self, fn, *args, **kwargs):
        self.counter.paused = True
        try:
            return fn(*args, **kwargs)
        finally:
            self.counter.paused = False

    def attention(self, q, k_pool, v_pool, block_table, rows, base_len, intra_mask, block_size, **extra):
        from kernels.paged_attention import paged_attention_reference

        extra = {k: v for k, v in extra.items() if k in ("k_scales", "v_scales", "rope", "prefix_mask")}
        out = self._uncounted(paged_attention_reference, q, k_pool, v_pool, block_table, rows, base_len, intra_mask,
                              block_size, **extra)
        self.counter.record("paged_attention (kernel)")
        return out

    def write_attention(self, q, k, v, slots, k_pool, v_pool, block_table, rows, base_len, intra_mask, block_size,
                        rope=None, prefix_mask=None, bits=None):
        from kernels.paged_attention import paged_kv_write_reference

        self._uncounted(paged_kv_write_reference, k, v, k_pool, v_pool, slots, rope=rope)
        self.counter.record("paged_kv_write (kernel)")
        return self.attention(q, k_pool, v_pool, block_table, rows, base_len, intra_mask, block_size, rope=rope,
                              prefix_mask=prefix_mask)

    def install(self, engine: SpecEngine) -> int:
        """On the engine's paged caches and its drafter's; returns how many caches took them."""
        caches = [engine.cache, getattr(engine.drafter, "cache", None)]
        done = 0
        for cache in caches:
            if cache is not None and hasattr(cache, "block_table") and not cache.format.quantized:
                cache.kernel, cache.write_kernel = self.attention, self.write_attention
                done += 1
        return done


class PhaseStep:
    """A step (FixedShapeStep, ModelStep: called through their class's __call__) run in a phase; anything else is
    the step's own."""

    def __init__(self, step, counter: OpCounter, phase: str):
        self._step, self._counter, self._phase = step, counter, phase

    def __call__(self, *args, **kwargs):
        self._counter.push(self._phase)
        try:
            return self._step(*args, **kwargs)
        finally:
            self._counter.pop()

    def __getattr__(self, name):
        return getattr(self._step, name)


def instrument(engine: SpecEngine, counter: OpCounter) -> list:
    """Phase markers on this engine's drafter, target steps and LM head (see the module docstring); returns the
    undos."""
    undo = []
    if engine.drafter is not None:
        undo.append(wrap(engine.drafter, "propose", counter, "draft"))
    for name in ("accept_step", "tree_step", "target_step"):
        step = getattr(engine, name)
        if step is not None:
            setattr(engine, name, PhaseStep(step, counter, "verify"))
            undo.append(lambda name=name, step=step: setattr(engine, name, step))
    undo.append(wrap(engine.target, "compute_logits", counter, after="accept+commit"))
    return undo


def label_of(method: str, a) -> str:
    return {"ar": "ar", "draft": f"draft k={a.k}", "eagle": f"eagle D{a.tree_depth} K{a.tree_topk} N{a.tree_budget}",
            "redrafter": f"redrafter W{a.beam_width} L{a.beam_length}"}[method]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", help="zoo preset (default tiny)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)} (default all)")
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate (default 1)")
    ap.add_argument("--context", type=int, default=32, help="prompt length in tokens (default 32)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="tokens per prompt (default 16)")
    ap.add_argument("--k", type=int, default=4, help="draft chain length (default 4)")
    ap.add_argument("--tree-depth", type=int, default=4, help="eagle depth D (default 4)")
    ap.add_argument("--tree-topk", type=int, default=4, help="eagle top-k K (default 4)")
    ap.add_argument("--tree-budget", type=int, default=16, help="eagle nodes N (default 16)")
    ap.add_argument("--beam-width", type=int, default=4, help="redrafter beams W (default 4)")
    ap.add_argument("--beam-length", type=int, default=4, help="redrafter beam length L (default 4)")
    ap.add_argument("--attention", choices=("kernel", "sdpa"), default="kernel",
                    help="kernel: the GPU's attention path with the Triton launches stood in for (default); sdpa: the "
                         "CPU's gather + SDPA")
    ap.add_argument("--out", default=None, help="JSON file for the counts (default: table only)")
    args = ap.parse_args(argv)
    args.methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        ap.error(f"--methods: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(METHODS)}")
    for name in ("batch", "context", "max_new_tokens", "k", "tree_depth", "tree_topk", "tree_budget", "beam_width",
                 "beam_length"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_new_tokens < 2:
        ap.error("--max-new-tokens must be >= 2 (the first token comes from the prefill, not a decode step)")
    return args


def prompts_of(session, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` tokens: windows of the preset's prompt text at different offsets."""
    ids = [i for p in session.prompts for i in session.tokenizer.encode(p.text).ids]
    if not ids:
        raise ValueError("the preset's prompts encode to no tokens")
    return [[ids[(r * 97 + j) % len(ids)] for j in range(length)] for r in range(batch)]


def count_method(session, method: str, a, prompts: list[list[int]]) -> dict:
    """One warm-up generate, then the counted one: per step the launching ops of each phase."""
    knobs = {"k": a.k, "tree_depth": a.tree_depth, "tree_topk": a.tree_topk, "tree_budget": a.tree_budget,
             "beam_width": a.beam_width, "beam_length": a.beam_length, "diversity_penalty": 0.0}
    heads = {"eagle": session.eagle_head, "redrafter": session.redrafter_head}
    drafter = make_drafter(method, knobs, draft=session.draft, target=session.target, heads=heads)
    cfg = EngineConfig(max_new_tokens=a.max_new_tokens, cuda_graphs=True, overlap=False, paged=True,
                       attention="sdpa", prefill_graphs=False)
    engine = SpecEngine(engine_target(session.target, drafter), drafter, cfg, session.device)
    warm = engine.generate(prompts)
    counter = OpCounter()
    if a.attention == "kernel":
        KernelStandIns(counter).install(engine)
        warm = engine.generate(prompts)
    undo = instrument(engine, counter)
    steps: list[dict] = []
    decode_step = engine.decode_step

    def counted_step(*args, **kwargs):
        before = Counter(counter.counts)
        counter.active = True
        try:
            with counter:
                out = decode_step(*args, **kwargs)
        finally:
            counter.active = False
        steps.append({p: counter.counts[p] - before[p] for p in PHASES})
        return out

    engine.decode_step = counted_step
    try:
        res = engine.generate(prompts)
    finally:
        for fn in undo + [lambda: delattr(engine, "decode_step")]:
            fn()
    if res.outputs != warm.outputs:
        raise RuntimeError(f"{method}: the counted generate's outputs differ from the warm-up's")
    median = {p: statistics.median(s[p] for s in steps) for p in PHASES}
    totals = [sum(s.values()) for s in steps]
    n = len(steps)
    return {"method": method, "label": label_of(method, a), "steps": n, "per_step": median,
            "total": statistics.median(totals), "total_min": min(totals), "total_max": max(totals),
            "step_counts": steps, "tokens_per_step": sum(len(o) - 1 for o in res.outputs) / max(n, 1),
            "ops": {p: dict(counter.names[p].most_common()) for p in PHASES}, "outputs": res.outputs}


def table(rows: list[dict]) -> str:
    ar = next((r["total"] for r in rows if r["method"] == "ar"), None)
    head = "| method | " + " | ".join(PHASES) + " | total [min, max] | x AR | tokens/step |"
    lines = [head, "|" + "---|" * (len(PHASES) + 5)]
    for r in rows:
        ratio = f"{r['total'] / ar:.2f}" if ar else "-"
        lines.append(f"| {r['label']} | " + " | ".join(f"{r['per_step'][p]:g}" for p in PHASES) +
                     f" | {r['total']:g} [{r['total_min']}, {r['total_max']}] | {ratio} | {r['tokens_per_step']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from workbench.harness.bench import BenchSession

    torch.manual_seed(0)
    session = BenchSession.load(preset=a.preset, device="cpu", dtype="float32")
    prompts = prompts_of(session, a.batch, a.context)
    kept = graphs.STATIC_CPU_OUTPUTS
    graphs.STATIC_CPU_OUTPUTS = False  # a replayed graph's outputs are static: no copy into kept tensors on a GPU
    try:
        rows = [count_method(session, m, a, prompts) for m in a.methods]
    finally:
        graphs.STATIC_CPU_OUTPUTS = kept
    out = table(rows)
    print(f"launching ops per decode step (median over steps), preset {a.preset}, batch {a.batch}, attention "
          f"{a.attention}, CPU:")
    print(out)
    if a.out:
        path = Path(a.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"preset": a.preset, "batch": a.batch, "context": a.context, "attention": a.attention,
                                    "max_new_tokens": a.max_new_tokens, "phases": list(PHASES), "rows": rows},
                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
