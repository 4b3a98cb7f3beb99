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
With --profile, a third table: the verify step's kernels at T = 1 and at the widest T with a tree mask (torch.profiler,
eager calls; GPU time per step by kernel name), so the growth from T = 1 is named kernel by kernel.
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


def kernel_times(fn, device: torch.device, iters: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (microseconds per fn() call, launches per call)} over `iters` eager calls under torch.profiler
    (device kernels on a GPU; operators' self time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        if gpu:
            torch.cuda.synchronize(device)
    out: dict[str, list[float]] = {}
    for e in prof.events():
        if gpu and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time if gpu else e.self_cpu_time_total
        tot = out.setdefault(e.name, [0.0, 0])
        tot[0] += us
        tot[1] += 1
    return {name: (t / iters, n / iters) for name, (t, n) in out.items()}


def profile_rows(narrow: dict, wide: dict, width: int) -> list[dict]:
    """One row per kernel name: its time per step at T = 1 and T = width, largest growth first."""
    rows = []
    for name in set(narrow) | set(wide):
        (a, na), (b, nb) = narrow.get(name, (0.0, 0)), wide.get(name, (0.0, 0))
        rows.append({"part": "kernel", "name": name[:90], "us_t1": a, "us_wide": b, "calls_t1": na,
                     "calls_wide": nb, "width": width, "growth_us": b - a})
    rows.sort(key=lambda r: -abs(r["growth_us"]))
    total = {"part": "kernel", "name": "(all kernels)", "us_t1": sum(r["us_t1"] for r in rows),
             "us_wide": sum(r["us_wide"] for r in rows), "calls_t1": sum(r["calls_t1"] for r in rows),
             "calls_wide": sum(r["calls_wide"] for r in rows), "width": width}
    total["growth_us"] = total["us_wide"] - total["us_t1"]
    return [total] + rows


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
    ap.add_argument("--profile", action="store_true",
                    help="also time the verify step's kernels at T = 1 and the widest T (tree mask), by name")
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
        verify, calls = {}, {}
        for mask_kind in ("causal", "tree"):
            for m in args.widths:
                step = ModelStep(model, cache, GraphSettings(cuda_graphs=False, batch_sizes=(1,)), dev, "target")
                ids = torch.zeros(1, m, dtype=torch.long, device=dev)
                tree = tree_of(m, dev)
                mask = verify_mask(tree) if mask_kind == "tree" and m > 1 else None
                offs = torch.cat([torch.zeros(1, 1, dtype=torch.long, device=dev), tree.depths], 1)
                positions = args.context + (offs if mask is not None else torch.arange(m, device=dev).unsqueeze(0))
                rows_t, base = upload([0], dev), upload(base_host, dev)

                def call(m=m, mask=mask, ids=ids, positions=positions, step=step, rows_t=rows_t, base=base):
                    cache.prepare(rows_t, base, m, mask, cache.static_span)
                    return step.logits(ids, positions)
                us = timed(call, dev, max(args.iters // 4, 1), args.rounds)
                verify[(mask_kind, m)] = us
                calls[(mask_kind, m)] = call
                rows.append({"part": "verify", "name": mask_kind, "rows": m, "us": us})
        for r in rows:
            if r["part"] == "verify":
                r["x_t1"] = r["us"] / verify[("causal", 1)]
        if args.profile:
            narrow = kernel_times(calls[("causal", min(args.widths))], dev, args.iters)
            wide = kernel_times(calls[("tree", max_w)], dev, args.iters)
            rows.extend(profile_rows(narrow, wide, max_w))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "target": args.target_config, "dtype": str(dtype), "context": args.context, "iters": args.iters,
            "rounds": args.rounds}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Verify width · {meta['device']} · {args.target_config} · {dtype}", "",
             "| part | name | rows | us | GB/s or x T=1 |", "|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "kernel":
            continue
        extra = f"{r['gb_per_s']:.0f} GB/s" if r["part"] == "linear" else f"{r['x_t1']:.3f}x"
        lines.append(f"| {r['part']} | {r['name']} | {r['rows']} | {r['us']:.1f} | {extra} |")
    kernels = [r for r in rows if r["part"] == "kernel"]
    if kernels:
        lines += ["", f"Kernels of one verify step, eager (T = 1 causal against T = {max_w} tree mask; us per step):",
                  "",
                  f"| kernel | us, T = 1 | us, T = {max_w} | growth us | launches T = 1 / {max_w} |",
                  "|---|---|---|---|---|"]
        for r in kernels[:40]:
            lines.append(f"| `{r['name']}` | {r['us_t1']:.1f} | {r['us_wide']:.1f} | {r['growth_us']:+.1f} | "
                         f"{r['calls_t1']:.0f} / {r['calls_wide']:.0f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
