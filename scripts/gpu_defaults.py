"""Is `bench` with no speed flags as fast as the fastest flag combination? (issue 39's goal: >= 0.9x.)

Runs `python -m workbench bench` as a user would, once per configuration and round, the configurations interleaved
(A B C A B C ...), and compares the candidate's tokens/s: the median over rounds, with the min..max spread. Each run
also carries its own in-process AR baseline (speedup_vs_ar), so a drift of the machine between runs shows there.

    python scripts/gpu_defaults.py --preset tiny --rounds 3 --out $OUT/defaults_tiny.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CONFIGS = {  # name -> extra flags; "default" adds none
    "default": [],
    "bf16+graphs+compile": ["--dtype", "bfloat16", "--cuda-graphs", "--compile", "default"],
    "bf16+graphs": ["--dtype", "bfloat16", "--cuda-graphs", "--compile", "off"],
}
COMMON = ["--method", "draft", "--k", "4", "--batch", "1", "--num-prompts", "8", "--max-new-tokens", "128",
          "--temperature", "0", "--json", "--no-store"]
SHOWN = ("dtype", "cuda_graphs", "compile", "overlap", "tokens_per_s", "ar_tokens_per_s", "speedup_vs_ar",
         "mean_accepted_tokens", "greedy_matches_ar", "device_name")


def run_one(preset: str, name: str) -> dict:
    cmd = [sys.executable, "-m", "workbench", "bench", "--preset", preset, *COMMON, *CONFIGS[name]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rec = None
    for line in reversed(proc.stdout.splitlines()):
        try:
            rec = json.loads(line)
            break
        except json.JSONDecodeError:
            continue
    if proc.returncode != 0 or rec is None:
        return {"config": name, "preset": preset, "error": proc.stderr[-2000:], "rc": proc.returncode, "wall_s": wall}
    return {"config": name, "preset": preset, "wall_s": round(wall, 1), **{k: rec.get(k) for k in SHOWN}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from " + ", ".join(CONFIGS))
    ap.add_argument("--out", help="JSONL file: one line per run")
    args = ap.parse_args()
    names = args.configs.split(",")
    rows = []
    for r in range(args.rounds):
        for name in names:
            row = {"round": r, **run_one(args.preset, name)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    tps = {n: [x["tokens_per_s"] for x in rows if x["config"] == n and x.get("tokens_per_s")] for n in names}
    best = max((n for n in names if n != "default" and tps[n]), key=lambda n: statistics.median(tps[n]), default=None)
    print(f"\npreset {args.preset}: candidate tokens/s, median (min..max) over {args.rounds} rounds")
    for n in names:
        if tps[n]:
            print(f"  {n:>22}: {statistics.median(tps[n]):9.1f} ({min(tps[n]):.1f}..{max(tps[n]):.1f})")
    if best and tps["default"]:
        ratio = statistics.median(tps["default"]) / statistics.median(tps[best])
        print(f"  default / fastest ({best}): {ratio:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
