"""A/B of the engine's step loop: this tree's `SpecEngine` against the one in another revision's step.py, same
process, same models, same prompts, interleaved repeats. For refactors of workbench/engine/step.py that must not
change outputs or slow the host side of a step (the decode_step unification was one).

    git show 9d7cddc:workbench/engine/step.py > scripts/_ref_step.py      # the revision to compare against
    python scripts/bench_step_loop.py --device cuda --out $OUT --ref-step scripts/_ref_step.py    # one H200: ~1 min
    python scripts/bench_step_loop.py --device cpu --out /tmp/sl --ref-step scripts/_ref_step.py \
        --batches 1,2 --max-new-tokens 8 --repeats 1 --modes eager          # CPU smoke test

Per (method, mode, batch): tokens/s of each engine (median over --repeats interleaved runs, after a warm-up that
also captures graphs), their ratio (this / ref), target steps, and whether every output equals the reference
engine's token for token (both run the same device work, so any difference is a bug; greedy). Without --ref-step
only this tree's engine runs. Modes: eager, graphs (CUDA graphs, attention auto), graphs+overlap. Writes
<out>/results.json (rows, arguments, environment) and <out>/table.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.gpu_timing import sync  # noqa: E402
from workbench.engine import EngineConfig, SpecEngine  # noqa: E402
from workbench.engine.drafters import make_drafter as registry_drafter  # noqa: E402

MODES = {"eager": {"attention": "sdpa", "overlap": False}, "graphs": {"cuda_graphs": True, "overlap": False},
         "graphs+overlap": {"cuda_graphs": True, "overlap": True}}
COLS = ["method", "mode", "batch", "tok_s", "ref_tok_s", "ratio", "steps", "ms_per_step", "ref_ms_per_step",
        "outputs_equal"]


class ArgError(ValueError):
    """A bad argument; the message says which and what to pass."""


def load_ref_engine(path: str):
    """The SpecEngine class of another revision's step.py (loaded as its own module beside today's engine)."""
    src = Path(path)
    if not src.is_file():
        raise ArgError(f"--ref-step {path}: no such file; write one with "
                       f"`git show REV:workbench/engine/step.py > {path}`")
    spec = importlib.util.spec_from_file_location("workbench.engine._ref_step", src)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module.SpecEngine, module.EngineConfig


def load_preset(name: str, dtype: torch.dtype, device: str):
    from workbench.harness.prompts import load_prompts
    from workbench.models import load_model, load_tokenizer
    from workbench.zoo import resolve_preset

    paths = resolve_preset(name)
    target = load_model(str(paths.target_dir), dtype=dtype, device=device).eval()
    draft = load_model(str(paths.draft_dir), dtype=dtype, device=device).eval()
    tok = load_tokenizer(str(paths.target_dir))
    prompts = [tok.encode(p.text).ids for p in load_prompts(str(paths.prompts_path))]
    return target, draft, prompts


def make_drafter(method: str, draft, k: int):
    """ar, draft or ngram (n-grams 1-3) through the drafter registry."""
    return registry_drafter(method, {"k": k, "ngram_min": 1, "ngram_max": 3}, draft=draft)


def timed(engine, prompts, device: str) -> tuple[float, list, int]:
    sync(device)
    t0 = time.perf_counter()
    res = engine.generate(prompts)
    sync(device)
    return time.perf_counter() - t0, res.outputs, len(res.steps)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", required=True, help="cuda | cuda:N | cpu")
    ap.add_argument("--out", required=True, help="folder for results.json and table.md")
    ap.add_argument("--ref-step", help="another revision's workbench/engine/step.py (see above); none: this tree only")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--methods", default="ar,draft,ngram")
    ap.add_argument("--modes", default="eager,graphs,graphs+overlap")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        args.batch_list = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise ArgError(f"--batches {args.batches!r}: give whole numbers separated by commas, e.g. 1,16") from None
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        raise ArgError(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    bad = [m for m in args.methods.split(",") if m not in ("ar", "draft", "ngram")]
    if bad:
        raise ArgError(f"--methods: unknown {bad}; choose from ar, draft, ngram")
    if min(args.batch_list) < 1 or args.repeats < 1 or args.max_new_tokens < 1 or args.prompt_len < 1:
        raise ArgError("--batches, --repeats, --max-new-tokens and --prompt-len must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ArgError(f"--device {args.device}: no CUDA device here; pass --device cpu for a smoke test")
    if not args.device.startswith("cuda") and any("graphs" in m for m in args.modes.split(",")):
        print("note: graph modes on the CPU run the fixed-shape steps eagerly", file=sys.stderr)
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        ref = load_ref_engine(args.ref_step) if args.ref_step else None
    except ArgError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dev = args.device
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    target, draft, prompts = load_preset(args.preset, dtype, dev)
    long_enough = [p[:args.prompt_len] for p in prompts if len(p) >= args.prompt_len] or prompts
    rows = []
    for method in args.methods.split(","):
        for mode in args.modes.split(","):
            for batch in args.batch_list:
                batch_prompts = (long_enough * batch)[:batch]
                engines = {"this": SpecEngine(target, make_drafter(method, draft, args.k),
                                              EngineConfig(max_new_tokens=args.max_new_tokens, **MODES[mode]), dev)}
                if ref is not None:
                    ref_engine, ref_config = ref
                    engines["ref"] = ref_engine(target, make_drafter(method, draft, args.k),
                                                ref_config(max_new_tokens=args.max_new_tokens, **MODES[mode]), dev)
                for eng in engines.values():  # warm-up: caches sized, graphs captured outside the timed runs
                    eng.reserve(batch, max(len(p) for p in batch_prompts))
                    eng.generate(batch_prompts)
                    eng.capture_graphs(batch)
                    eng.generate(batch_prompts)
                times = {name: [] for name in engines}
                outs, steps = {}, {}
                for _ in range(args.repeats):  # interleaved, so drift hits both engines alike
                    for name, eng in engines.items():
                        t, outs[name], steps[name] = timed(eng, batch_prompts, dev)
                        times[name].append(t)
                tokens = sum(len(o) for o in outs["this"])
                wall = {name: statistics.median(ts) for name, ts in times.items()}
                row = {"method": method, "mode": mode, "batch": batch, "tok_s": tokens / wall["this"],
                       "steps": steps["this"], "ms_per_step": wall["this"] * 1e3 / max(steps["this"], 1),
                       "overlaps": engines["this"].overlaps(), "repeats_s": times}
                if ref is not None:
                    row.update(ref_tok_s=tokens / wall["ref"], ratio=wall["ref"] / wall["this"],
                               ref_ms_per_step=wall["ref"] * 1e3 / max(steps["ref"], 1),
                               outputs_equal=outs["this"] == outs["ref"], ref_steps=steps["ref"])
                rows.append(row)
                print({k: row.get(k) for k in COLS}, flush=True)
    write(args, rows)
    return 0 if all(r.get("outputs_equal", True) for r in rows) else 1


def write(args, rows: list[dict]) -> None:
    from workbench.harness.telemetry import environment_info

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "args": {k: v for k, v in vars(args).items()},
                                                  "environment": environment_info()}, indent=1, default=str) + "\n")

    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)

    lines = ["| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COLS) + " |" for r in rows]
    text = "\n".join(lines) + "\n\nratio = this engine's tokens/s / the reference's (median of interleaved repeats)\n"
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
