"""Greedy parity on the GPU: speculative output vs our autoregressive output, per dtype, with the first divergence.

    python scripts/gpu_parity.py --preset small
bf16 kernels reduce in a different order for a 1-token decode and a (k+1)-token verify, so near-tied logits can flip
an argmax; fp32 must match exactly.
"""
import argparse, json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workbench.harness.bench import BenchConfig, BenchSession

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="small")
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--max-new-tokens", type=int, default=64)
args = ap.parse_args()
for dtype in ("float32", "bfloat16"):
    s = BenchSession.load(preset=args.preset, device="cuda", dtype=dtype)
    for method in ("draft", "ngram"):
        r = s.run(BenchConfig(method=method, k=4, batch=args.batch, max_new_tokens=args.max_new_tokens, num_prompts=8,
                              warmup=0))
        first = [next((i for i, (a, b) in enumerate(zip(o, ar)) if a != b), None) for o, ar in zip(r.outputs, r.ar_outputs)]
        print(json.dumps({"dtype": dtype, "method": method, "greedy_matches_ar": r.record["greedy_matches_ar"],
                          "sequences_identical": sum(f is None for f in first), "sequences": len(first),
                          "first_divergence": first, "speedup_vs_ar": round(r.record["speedup_vs_ar"], 3)}), flush=True)
