"""Which ops of each fixed-shape step run outside torch.compile's graphs, on the CPU (issue 40).

    python scripts/eager_step_ops.py --methods ar,draft,eagle,redrafter

A captured step on the GPU replays whatever its body launched: ops inside torch.compile's graphs as inductor's fused
kernels, ops outside them one eager kernel each. A model forward breaks the graph at every attention call (the fused
K/V write + attention launch stays outside torch.compile, llama.attend_uncompiled), and dynamo runs a frame with a
graph break inside a loop wholly eagerly, so a drafter that loops over forwards in one function ran its glue (gathers,
index arithmetic, argmax, concatenations) as separate eager kernels: ~23 per EAGLE draft on tiny before its draft was
split into methods.

This builds each method's engine on the preset (float32, CUDA graphs on: the fixed-shape steps, run eagerly on a CPU;
the kernel path's attention stood in by its PyTorch reference, kept outside torch.compile as on the GPU), compiles
every fixed-shape step with a backend that only marks its graphs, and counts, per step call, the aten ops that would
launch device work (scripts/count_step_ops.py's rule, by name here) outside every graph. The steps' input copies
(`copy_` into their persistent buffers) are outside by design.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.count_step_ops import KernelStandIns, OpCounter, prompts_of  # noqa: E402
from workbench.engine import EngineConfig, SpecEngine, graphs  # noqa: E402
from workbench.engine.drafters import engine_target, make_drafter  # noqa: E402
from workbench.engine.graphs import FixedShapeStep  # noqa: E402

METHODS = ("ar", "draft", "eagle", "redrafter")
# ops that launch nothing (views, metadata, allocation without a fill), by their aten name
NO_LAUNCH = {"view", "expand", "slice", "select", "unsqueeze", "squeeze", "as_strided", "t", "permute", "detach",
             "alias", "reshape", "empty", "empty_like", "empty_strided", "transpose", "flatten", "unflatten",
             "lift_fresh", "_unsafe_view", "resolve_conj", "resolve_neg", "contiguous", "split", "split_with_sizes",
             "unbind", "chunk", "narrow", "expand_as", "view_as", "_reshape_alias", "item", "_local_scalar_dense",
             "is_nonzero", "numel", "size", "to", "lift_fresh_copy"}
GRAPH, STAND_IN, STEP = "eager_step_ops:graph", "eager_step_ops:stand-in", "eager_step_ops:step:"


def _marking_backend(gm, example_inputs):
    forward = gm.forward

    def run(*args):
        with record_function(GRAPH):
            return forward(*args)
    return run


def _stand_ins(counter: OpCounter) -> KernelStandIns:
    """count_step_ops' kernel stand-ins, marked and kept outside torch.compile (as the Triton calls are)."""
    stand_ins = KernelStandIns(counter)
    for name in ("attention", "write_attention"):
        fn = getattr(stand_ins, name)

        def marked(*args, _fn=fn, **kwargs):
            with record_function(STAND_IN):
                return _fn(*args, **kwargs)
        setattr(stand_ins, name, torch.compiler.disable(marked))
    return stand_ins


def eager_ops(session, method: str, prompts: list[list[int]], knobs: dict) -> dict[str, dict]:
    """{step name: {"calls": n, "eager": {op: per call}, "in_graph": ops per call}} of one generate."""
    init, call = FixedShapeStep.__init__, FixedShapeStep.__call__

    def marking_init(self, *args, **kwargs):  # every step this engine makes compiles with the marking backend
        init(self, *args, **kwargs)
        graphs.raise_recompile_limits()  # as a compiled engine does: past torch's default of 8 graphs per frame,
        # the model's frames (one per step width and model, shared by the target and the draft model) ran eagerly
        self._fn = torch.compile(self.body, backend=_marking_backend, dynamic=False)

    def marked_call(self, *args, **kwargs):
        with record_function(STEP + self.name):
            return call(self, *args, **kwargs)
    FixedShapeStep.__init__, FixedShapeStep.__call__ = marking_init, marked_call
    try:
        heads = {"eagle": session.eagle_head, "redrafter": session.redrafter_head}
        drafter = make_drafter(method, knobs, draft=session.draft, target=session.target, heads=heads)
        cfg = EngineConfig(max_new_tokens=8, cuda_graphs=True, overlap=False, paged=True, attention="sdpa",
                           prefill_graphs=False)
        engine = SpecEngine(engine_target(session.target, drafter), drafter, cfg, session.device)
        engine.generate(prompts)  # the caches and steps exist
        _stand_ins(OpCounter()).install(engine)
        engine.generate(prompts)  # compiled for the kernel path
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate(prompts)
    finally:
        FixedShapeStep.__init__, FixedShapeStep.__call__ = init, call
    events = prof.events()
    calls = collections.Counter(ev.name[len(STEP):] for ev in events if ev.name.startswith(STEP))
    eager: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    in_graph: collections.Counter = collections.Counter()
    for ev in events:
        if not ev.name.startswith("aten::") or ev.name[6:] in NO_LAUNCH:
            continue
        parent, step, graph, skip = ev.cpu_parent, None, False, False
        while parent is not None:
            skip |= parent.name.startswith("aten::") or parent.name == STAND_IN  # counted at its outermost op
            graph |= parent.name == GRAPH
            if step is None and parent.name.startswith(STEP):
                step = parent.name[len(STEP):]
            parent = parent.cpu_parent
        if skip or step is None:
            continue
        if graph:
            in_graph[step] += 1
        else:
            eager[step][ev.name[6:]] += 1
    return {name: {"calls": n, "eager": {op: c / n for op, c in eager[name].most_common()},
                   "in_graph": in_graph[name] / n} for name, n in calls.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--methods", default=",".join(METHODS))
    a = ap.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        ap.error(f"--methods: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(METHODS)}")
    from workbench.harness.bench import BenchSession

    torch.manual_seed(0)
    session = BenchSession.load(preset=a.preset, device="cpu", dtype="float32")
    knobs = {"k": 4, "tree_depth": 4, "tree_topk": 4, "tree_budget": 16, "beam_width": 4, "beam_length": 4,
             "diversity_penalty": 0.0}
    kept = graphs.STATIC_CPU_OUTPUTS
    graphs.STATIC_CPU_OUTPUTS = False
    try:
        print("| method | step | eager ops per call | in-graph ops per call | eager ops |\n|---|---|---|---|---|")
        for m in methods:
            for name, r in eager_ops(session, m, prompts_of(session, 1, 64), knobs).items():
                ops = ", ".join(f"{op} {c:g}" for op, c in r["eager"].items()) or "-"
                print(f"| {m} | {name} | {sum(r['eager'].values()):g} | {r['in_graph']:g} | {ops} |")
    finally:
        graphs.STATIC_CPU_OUTPUTS = kept
    return 0


if __name__ == "__main__":
    sys.exit(main())
