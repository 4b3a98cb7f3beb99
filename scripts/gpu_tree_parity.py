"""Where a tree or beam drafter's greedy output leaves AR's on the GPU: the same run repeated, and one engine setting
changed at a time (overlap, CUDA graphs, compile, attention backend), per dtype.

    python scripts/gpu_tree_parity.py --preset tiny --methods redrafter,eagle --out DIR

For each (dtype, method, variant) it runs the benchmark twice and writes one JSON line: greedy_matches_ar and the
near-tie flag of each run, the first divergence per prompt, whether the two runs produced the same tokens (a captured
step that reads a stale or unwritten buffer shows up as two runs that differ), and the graphs captured. A variant whose
two runs differ, or that diverges beyond the near-tie margin while a neighbouring variant matches, points at the part
of the step that setting changes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {  # name -> BenchConfig overrides, one setting changed from the default at a time
    "default": {},
    "no_overlap": {"overlap": False},
    "no_compile": {"compile": "off"},
    "no_graphs": {"cuda_graphs": False, "compile": "off"},
    "sdpa": {"attention": "sdpa"},
    "sdpa_no_graphs": {"attention": "sdpa", "cuda_graphs": False, "compile": "off", "overlap": False},
}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", default="redrafter,eagle")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench_fastpath import parity
    from workbench.harness.bench import BenchConfig, BenchSession

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with (out / "parity.jsonl").open("a") as f:
        for dtype in args.dtypes.split(","):
            session = BenchSession.load(preset=args.preset, device=args.device, dtype=dtype)
            for method in args.methods.split(","):
                for variant in args.variants:
                    if time.perf_counter() - t0 > args.budget_s:
                        print(f"[budget] stop before {dtype} {method} {variant}", flush=True)
                        return 0
                    cfg = BenchConfig(method=method, batch=args.batch, num_prompts=args.num_prompts,
                                      max_new_tokens=args.max_new_tokens, repeats=1, beam_width=4, beam_length=4,
                                      tree_depth=4, tree_topk=4, tree_budget=16, **VARIANTS[variant])
                    row = {"preset": args.preset, "dtype": dtype, "method": method, "variant": variant}
                    try:
                        runs = [session.run(cfg) for _ in range(2)]
                    except Exception as e:  # one variant failing (e.g. a backend missing here) is a finding too
                        row["error"] = f"{type(e).__name__}: {e}"
                        row["traceback"] = traceback.format_exc().splitlines()[-12:]
                        print(json.dumps(row), flush=True)
                        f.write(json.dumps(row) + "\n")
                        continue
                    row.update({
                        "greedy_matches_ar": [r.record["greedy_matches_ar"] for r in runs],
                        "greedy_near_tie": [r.record.get("greedy_near_tie") for r in runs],
                        "first_divergence": [parity(r.outputs, r.ar_outputs)["first_divergence"] for r in runs],
                        "runs_identical": runs[0].outputs == runs[1].outputs,
                        "ar_runs_identical": runs[0].ar_outputs == runs[1].ar_outputs,
                        "mean_accepted": [round(r.record["mean_accepted_tokens"], 3) for r in runs],
                        "graph_buckets_captured": [r.record.get("graph_buckets_captured") for r in runs],
                        "cuda_graphs": runs[0].record.get("cuda_graphs"), "compile": runs[0].record.get("compile"),
                        "attention": runs[0].record.get("attention"),
                    })
                    print(json.dumps(row), flush=True)
                    f.write(json.dumps(row) + "\n")
            del session
    return 0


if __name__ == "__main__":
    sys.exit(main())
