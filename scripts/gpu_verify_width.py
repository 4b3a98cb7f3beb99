"""What a verify pass costs by its width: the target over T tokens per row (T = 1 + draft nodes), batch 1.

    python scripts/gpu_verify_width.py --device cuda --out $OUT/width            # random Llama-3.1-8B shapes, bf16
    python scripts/gpu_verify_width.py --device cpu --target-config tiny-random --widths 1,5 --iters 2 --out out/w

Two tables, each timed over --iters replays of a captured CUDA graph (GPU; plain calls on a CPU), median of --rounds:
- linears: every distinct weight of the target (fused q/k/v, o, fused gate/up, down, LM head) as `F.linear` over M
  rows, M in --widths: microseconds and the weight bytes read per second (what bounds a decode step);
- verify: the engine's fixed-shape target step (workbench.engine.graphs.ModelStep over a paged KV cache, the Triton
  attention where it applies) over T = M tokens at --context committed tokens, with a causal mask and with a tree
  mask (a root and M - 1 nodes in branches of depth <= 4), and its ratio to T = 1.
A tree of N nodes verifies N + 1 tokens: the rows show what each extra node costs and where the GEMMs change kernels.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_tree_steps import RANDOM_CONFIGS, random_target  # noqa: E402
from workbench.engine.graphs import GraphSettings, ModelStep, upload  # noqa: E402
from workbench.engine.kv_cache import make_cache  # noqa: E402
from workbench.engine.tree import DraftTree, verify_mask  # noqa: E402


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def timed(fn, device: torch.device, iters: int, rounds: int) -> float:
    """Median microseconds of one fn() call: a CUDA graph of `iters` calls replayed per round on a GPU."""
    if device.type != "cuda":
        import time
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) / iters * 1e6)
        return statistics.median(out)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(out)


def tree_of(width: int, device) -> DraftTree:
    """width - 1 nodes in branches of up to 4 nodes (the root's children first, then deeper), one row."""
    n = width - 1
    parents, depths = [], []
    for i in range(n):
        branch, depth = i % 4, i // 4  # 4 branches grown one level at a time
        parents.append(-1 if depth == 0 else i - 4)
        depths.append(depth + 1)
    t = torch.tensor
    return DraftTree(t([[0] * n], device=device), t([parents], device=device), t([depths], device=device),
                     torch.ones(1, n, dtype=torch.bool, device=device), depth_bound=max(depths, default=0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target-config", default="llama8b", choices=sorted(RANDOM_CONFIGS))
    ap.add_argument("--widths", type=ints, default=(1, 2, 4, 5, 8, 9, 16, 17, 24, 25, 32, 33))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_target(args.target_config, dtype, dev)
    cfg = model.config
    layer = model.model.layers[0]
    weights = {name: mod.weight for name, mod in layer.named_modules() if isinstance(mod, torch.nn.Linear)}
    weights["lm_head"] = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    rows = []
    with torch.inference_mode():
        for name, w in weights.items():
            for m in args.widths:
                x = torch.randn(m, w.shape[1], dtype=dtype, device=dev)
                us = timed(lambda: torch.nn.functional.linear(x, w), dev, args.iters, args.rounds)
                rows.append({"part": "linear", "name": name, "shape": list(w.shape), "rows": m, "us": us,
                             "gb_per_s": w.numel() * w.element_size() / us / 1e3})
        max_w = max(args.widths)
        cache = make_cache(True, num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                           head_dim=cfg.head_dim, max_rows=1, max_len=args.context + max_w + 16, dtype=dtype,
                           device=dev, block_size=16, attention="auto")
        base_host = [args.context]
        cache.plan([0], base_host, max_w)
        verify = {}
        for mask_kind in ("causal", "tree"):
            for m in args.widths:
                step = ModelStep(model, cache, GraphSettings(cuda_graphs=False, batch_sizes=(1,)), dev, "target")
                ids = torch.zeros(1, m, dtype=torch.long, device=dev)
                tree = tree_of(m, dev)
                mask = verify_mask(tree) if mask_kind == "tree" and m > 1 else None
                offs = torch.cat([torch.zeros(1, 1, dtype=torch.long, device=dev), tree.depths], 1)
                positions = args.context + (offs if mask is not None else torch.arange(m, device=dev).unsqueeze(0))
                rows_t, base = upload([0], dev), upload(base_host, dev)

                def call():
                    cache.prepare(rows_t, base, m, mask, cache.static_span)
                    return step.logits(ids, positions)
                us = timed(call, dev, max(args.iters // 4, 1), args.rounds)
                verify[(mask_kind, m)] = us
                rows.append({"part": "verify", "name": mask_kind, "rows": m, "us": us})
        for r in rows:
            if r["part"] == "verify":
                r["x_t1"] = r["us"] / verify[("causal", 1)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "target": args.target_config, "dtype": str(dtype), "context": args.context, "iters": args.iters,
            "rounds": args.rounds}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Verify width · {meta['device']} · {args.target_config} · {dtype}", "",
             "| part | name | rows | us | GB/s or x T=1 |", "|---|---|---|---|---|"]
    for r in rows:
        extra = f"{r['gb_per_s']:.0f} GB/s" if r["part"] == "linear" else f"{r['x_t1']:.3f}x"
        lines.append(f"| {r['part']} | {r['name']} | {r['rows']} | {r['us']:.1f} | {extra} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
