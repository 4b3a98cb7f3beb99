"""The drafters' ranking on the GPU: PyTorch ops (log_softmax, then torch.topk) against the fused kernel
(kernels/fused_topk.py), per drafter shape.

    python scripts/gpu_topk.py --out $OUT/topk.json

Three uses, each at the presets' and the 8B shape's vocabularies and batch 1 / 4 / 16:
  level     an EAGLE level: B*K rows of V bf16 logits -> the K best log-probabilities per row
  beam      a ReDrafter depth: B*W rows of V logits plus each beam's score -> the W best of each row's W*V candidates
  frontier  EAGLE's next frontier: the K best of B rows of K*K float32 scores
Each is timed as a CUDA graph of 8 calls (microseconds per call, median of 5 replays), in one process: `torch` is
log_softmax + torch.topk, `fused` the kernel with launch_plan's chunks, `fused_<b>` with first-pass chunks of b
elements. `max_err` is the fused values' largest difference from the float32 reference, `same_idx` whether its
indices equal the reference's (bf16 logits hold ties, which may pick other, equally good, indices).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.fused_topk import BLOCKS, fused_topk_reference, fused_topk_triton, launch_plan  # noqa: E402
from scripts.gpu_kernels import capture, graph_us  # noqa: E402

VOCABS = (("tiny", 4096), ("small", 8192), ("8B hot 32k", 32000), ("8B", 128256))
K = 4


def cases():
    for batch in (1, 4, 16):
        for name, v in VOCABS:
            yield "level", name, batch, v
            yield "beam", name, batch, v
        yield "frontier", "", batch, K * K


def timed(fn) -> float:
    graph, _ = capture(fn)
    return statistics.median(graph_us(graph, 10) for _ in range(5))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for use, vocab, batch, v in cases():
        rec = {"use": use, "vocab": vocab, "batch": batch, "v": v, "k": K}
        if use == "frontier":
            x = torch.randn(batch, v, device="cuda", generator=gen)
            ops = {"torch": lambda: x.topk(K, -1)}
            fused = {0: lambda: fused_topk_triton(x, K, False)}
            want = fused_topk_reference(x, K, False)
        elif use == "level":
            x = (3 * torch.randn(batch * K, v, device="cuda", generator=gen)).bfloat16()
            ops = {"torch": lambda: torch.log_softmax(x.float(), -1).clamp(max=0.0).topk(K, -1)}
            fused = {b: (lambda b=b: fused_topk_triton(x, K, True, max_block=b)) for b in (0,) + BLOCKS}
            want = fused_topk_reference(x, K, True)
        else:
            x = (3 * torch.randn(batch * K, v, device="cuda", generator=gen)).bfloat16()
            score = torch.randn(batch, K, device="cuda", generator=gen)

            def cand():
                return (score.unsqueeze(-1) + torch.log_softmax(x.float(), -1).view(batch, K, v)).view(batch, K * v)
            ops = {"torch": lambda: cand().topk(K, -1)}
            fused = {b: (lambda b=b: fused_topk_triton(x, K, True, group=K, bias=score, max_block=b))
                     for b in (0,) + BLOCKS}
            want = fused_topk_reference(x, K, True, group=K, bias=score)
        for name, fn in ops.items():
            rec[name + "_us"] = timed(fn)
        for b, fn in fused.items():
            name = f"fused_{b}" if b else "fused"
            rec[name + "_us"] = timed(fn)
            values, idx = fn()
            rec[name + "_max_err"] = float((values - want[0]).abs().max())
            rec[name + "_same_idx"] = bool(torch.equal(idx, want[1]))
        rec["plan"] = list(launch_plan(v, K, K if use == "beam" else 1))
        rec["speedup"] = rec["torch_us"] / rec["fused_us"]
        rows.append(rec)
        times = "  ".join(f"{b}:{rec[f'fused_{b}_us']:6.2f}" for b in fused if b)
        print(f"{use:8s} {vocab:10s} b={batch:<3d} torch {rec['torch_us']:7.2f}  fused {rec['fused_us']:6.2f} "
              f"(chunk {rec['plan'][0]}) {rec['speedup']:5.2f}x  err {rec['fused_max_err']:.1e} "
              f"same_idx={rec['fused_same_idx']}  by chunk {times}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
