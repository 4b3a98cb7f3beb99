"""A GPU benchmark suite: one process, same prompts, our engine vs Hugging Face transformers.

    python scripts/gpu_suite.py --preset small --out $OUT --budget-s 240

Runs, in priority order until the time budget is spent (so a lease never ends with nothing recorded):
  1. headline, batch 1: our AR baseline, draft_model k=4 and ngram k=4, each with HF generate() plain and
     assisted (assistant_model) / prompt lookup on the same weights and prompts;
  2. a sweep over draft length and batch size.
Every record goes to <out>/bench.jsonl as it finishes; a table is printed at the end. Greedy parity per dtype, with
the first divergence, is scripts/gpu_parity.py's job.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.harness.bench import BenchConfig, BenchError, BenchSession  # noqa: E402

COLS = ["method", "k", "batch", "dtype", "acceptance_rate", "mean_accepted_tokens", "tokens_per_s", "ar_tokens_per_s",
        "speedup_vs_ar", "hf_tokens_per_s", "hf_spec_tokens_per_s", "greedy_matches_ar", "tpot_ms_p50",
        "tpot_ms_p99", "ttft_ms", "draft_target_cost_ratio", "sm_util_pct", "gpu_busy_pct", "peak_mem_mb"]


def batch_plan(max_new: int, prompts: int) -> list[BenchConfig]:
    """Speedup vs batch size: the same prompts at batch 1, 4 and 8 for both drafters (no HF runs)."""
    return [BenchConfig(method=m, k=4, batch=b, max_new_tokens=max_new, num_prompts=prompts, repeats=2)
            for b in (8, 4, 1) for m in ("ngram", "draft")]


def plan(max_new: int, prompts: int) -> list[BenchConfig]:
    head = [BenchConfig(method=m, k=4, batch=1, max_new_tokens=max_new, num_prompts=prompts, repeats=3,
                        compare_hf=True) for m in ("draft", "ngram")]
    sweep = [BenchConfig(method="draft", k=k, batch=b, max_new_tokens=max_new, num_prompts=prompts, repeats=2)
             for b in (1, 8) for k in (2, 6, 8)]
    sweep += [BenchConfig(method="ngram", k=4, batch=8, max_new_tokens=max_new, num_prompts=prompts, repeats=2),
              BenchConfig(method="draft", k=4, batch=8, max_new_tokens=max_new, num_prompts=prompts, repeats=2)]
    return head + sweep


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="out")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--plan", choices=["suite", "batch"], default="suite",
                    help="suite: headline + sweep (default); batch: speedup vs batch size only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    session = BenchSession.load(preset=args.preset, device="cuda", dtype=args.dtype)
    print(f"loaded {args.preset} in {time.perf_counter() - t0:.1f}s", flush=True)
    records = []
    configs = (batch_plan if args.plan == "batch" else plan)(args.max_new_tokens, args.prompts)
    for cfg in configs:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget spent: skipped {cfg}", flush=True)
            continue
        try:
            rec = session.run(cfg).record
        except BenchError as e:
            rec = {"method": cfg.method, "k": cfg.k, "batch": cfg.batch, "error": str(e)}
        rec = {k: v for k, v in rec.items() if k != "telemetry_timeline"}
        records.append(rec)
        with open(out / "bench.jsonl", "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        print(" ".join(f"{c}={fmt(rec.get(c))}" for c in COLS[:12]), flush=True)
    print("\n| " + " | ".join(COLS) + " |")
    print("|" + "---|" * len(COLS))
    for rec in records:
        print("| " + " | ".join(fmt(rec.get(c)) for c in COLS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
