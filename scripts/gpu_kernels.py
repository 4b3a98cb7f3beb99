"""Paged attention on the GPU: the Triton kernel against its reference (gather + SDPA), for parity and for time.

    python scripts/gpu_kernels.py --out $OUT            # ~72 shapes, bf16, block 16; about a minute on an H200

For each shape (batch x model x step tokens x context) it records:
- max |triton - reference| against the float32 reference (the same bf16 inputs, upcast) and against the bf16
  reference, and `ok`: the float32 error is within TOLERANCE;
- microseconds per call, eager and replayed from a captured CUDA graph (CALLS_PER_GRAPH calls in one graph, like the
  layers of a step), for both; the reference gathers exactly the blocks the longest row needs, as the engine does;
- `graph_follows_inputs`: a graph captured once and replayed after the lengths and block tables changed in place
  gives the eager result for the new values (the kernel reads them on the device);
- the kernel's achieved bandwidth over the K/V bytes it must read.
One failing shape records its error and the others still run. Rows go to <out>/kernels.json; a table to stdout.
T = 9 steps verify a random 8-node draft tree (tree mask); T = 1 and 5 are causal; T = 4 with M = 8 is an EAGLE
frontier forward (4 frontier nodes, each seeing itself and a random half of the 8 draft slots before the step through
a prefix mask).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from kernels.paged_attention import launch_plan, paged_attention_reference, paged_attention_triton  # noqa: E402
from workbench.engine.tree import DraftTree, verify_mask  # noqa: E402
from scripts import gpu_timing  # noqa: E402
from scripts.gpu_timing import eager_us  # noqa: E402

MODELS = {"gqa32/4_d64": (32, 4, 64), "mha32_d128": (32, 32, 128)}  # name -> (Hq, Hkv, D)
BATCHES, CONTEXTS = (1, 8, 32), (256, 1024, 4096)
STEPS = ((1, 0), (5, 0), (9, 0), (4, 8))  # (step tokens T, prefix slots M)
BLOCK_SIZE = 16
DEVICE = "cuda"
TOLERANCE = 2e-2  # bf16 inputs, against the float32 reference: about a few bf16 ulps of the output
CALLS_PER_GRAPH = 8
COLS = ["model", "batch", "T", "M", "context", "splits", "ok", "err_fp32", "err_bf16", "triton_us", "ref_us",
        "triton_graph_us", "ref_graph_us", "graph_speedup", "triton_gbps", "graph_follows_inputs", "error"]


def random_tree_mask(batch: int, nodes: int, gen: torch.Generator) -> torch.Tensor:
    """[B, 1 + nodes, 1 + nodes] verify mask of random trees (each node's parent drawn among the earlier ones)."""
    parents = torch.stack([torch.randint(-1, i, (batch,), generator=gen) if i else torch.full((batch,), -1)
                           for i in range(nodes)], 1)
    tree = DraftTree(torch.zeros_like(parents), parents, torch.ones_like(parents), torch.ones_like(parents).bool())
    return verify_mask(tree)


def make_inputs(batch, hq, hkv, dim, t, context, prefix=0, seed=0):
    """A shuffled pool with exactly the blocks the rows need; rows are permuted and lengths a little ragged. prefix =
    M > 0: each token sees itself among the step's and a random half of the M slots before it (prefix_mask)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    max_blocks = math.ceil((context + t) / BLOCK_SIZE)
    num_blocks = batch * max_blocks
    pool_shape = (num_blocks * BLOCK_SIZE, hkv, dim)
    base_len = context - torch.randint(0, BLOCK_SIZE, (batch,), generator=gen, device=DEVICE)
    base_len[0] = context  # the longest row fills the table
    intra_mask = random_tree_mask(batch, t - 1, torch.Generator().manual_seed(seed)).to(DEVICE) if t == 9 else None
    extra = {}
    if prefix:
        intra_mask = torch.eye(t, dtype=torch.bool, device=DEVICE).expand(batch, t, t)
        extra["prefix_mask"] = torch.rand(batch, t, prefix, generator=gen, device=DEVICE) < 0.5  # [B, T, M]
    return dict(
        q=torch.randn(batch, hq, t, dim, generator=gen, device=DEVICE),  # [B, Hq, T, D]
        k_pool=torch.randn(pool_shape, generator=gen, device=DEVICE),  # [slots, Hkv, D]
        v_pool=torch.randn(pool_shape, generator=gen, device=DEVICE),
        block_table=torch.randperm(num_blocks, generator=gen, device=DEVICE).view(batch, max_blocks),  # [B, blocks]
        rows=torch.randperm(batch, generator=gen, device=DEVICE),  # [B]
        base_len=base_len,  # [B]
        intra_mask=intra_mask,  # [B, T, T] or None
        **extra)


def bf16(args):
    return {k: v.bfloat16() if k in ("q", "k_pool", "v_pool") else v for k, v in args.items()}


def capture(fn):
    return gpu_timing.capture(fn, CALLS_PER_GRAPH)


def graph_us(graph, reps=20) -> float:
    return eager_us(graph.replay, reps) / CALLS_PER_GRAPH


def run_shape(model, batch, t, prefix, context) -> dict:
    hq, hkv, dim = MODELS[model]
    args = bf16(make_inputs(batch, hq, hkv, dim, t, context, prefix))
    upcast = {k: v.float() if k in ("q", "k_pool", "v_pool") else v for k, v in args.items()}
    rec = {"model": model, "hq": hq, "hkv": hkv, "head_dim": dim, "batch": batch, "T": t, "M": prefix,
           "context": context, "block_size": BLOCK_SIZE, "dtype": "bfloat16", "tree": t == 9}
    rec["block_m"], rec["m_tiles"], rec["splits"] = launch_plan(batch, hq, hkv, t, args["block_table"].shape[1] *
                                                                BLOCK_SIZE, args["q"].device, dim)

    got = paged_attention_triton(**args, block_size=BLOCK_SIZE)
    rec["err_fp32"] = (got.float() - paged_attention_reference(**upcast, block_size=BLOCK_SIZE)).abs().max().item()
    ref_bf16 = paged_attention_reference(**args, block_size=BLOCK_SIZE)
    rec["err_bf16"] = (got.float() - ref_bf16.float()).abs().max().item()
    rec["ok"] = rec["err_fp32"] <= TOLERANCE
    del upcast

    triton_fn = lambda: paged_attention_triton(**args, block_size=BLOCK_SIZE)  # noqa: E731
    ref_fn = lambda: paged_attention_reference(**args, block_size=BLOCK_SIZE)  # noqa: E731
    rec["triton_us"], rec["ref_us"] = eager_us(triton_fn), eager_us(ref_fn)
    triton_graph, graph_out = capture(triton_fn)
    rec["triton_graph_us"] = graph_us(triton_graph)
    try:
        ref_graph, _ = capture(ref_fn)
        rec["ref_graph_us"] = graph_us(ref_graph)
        rec["graph_speedup"] = rec["ref_graph_us"] / rec["triton_graph_us"]
    except RuntimeError as e:  # the reference failing to capture must not hide the kernel's figures
        rec["ref_graph_error"] = str(e)
    kv_bytes = 2 * (args["base_len"] + t).sum().item() * hkv * dim * 2
    rec["triton_gbps"] = kv_bytes / (rec["triton_graph_us"] * 1e-6) / 1e9

    # the same graph, new values: shorter rows and another block order, written in place
    args["base_len"].sub_(torch.arange(batch, device=DEVICE) % 3 + 1)
    args["block_table"].copy_(args["block_table"].flip(1))
    triton_graph.replay()
    rec["graph_follows_inputs"] = torch.equal(graph_out, triton_fn())
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--budget-s", type=float, default=90)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    records = []
    for model in MODELS:
        for t, prefix in STEPS:
            for batch in BATCHES:
                for context in CONTEXTS:
                    shape = {"model": model, "batch": batch, "T": t, "M": prefix, "context": context}
                    if time.perf_counter() - t0 > args.budget_s:
                        records.append({**shape, "error": "skipped: time budget spent"})
                        continue
                    try:
                        rec = run_shape(model, batch, t, prefix, context)
                    except Exception as e:  # one failing shape must not stop the others
                        rec = {**shape, "error": f"{type(e).__name__}: {e}"}
                    torch.cuda.empty_cache()
                    records.append(rec)
                    print(" ".join(f"{c}={fmt(rec.get(c))}" for c in COLS if c in rec), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "tolerance": TOLERANCE, "calls_per_graph": CALLS_PER_GRAPH,
            "wall_s": time.perf_counter() - t0}
    (out / "kernels.json").write_text(json.dumps({"meta": meta, "rows": records}, indent=1))
    print(json.dumps(meta))
    print("\n| " + " | ".join(COLS) + " |")
    print("|" + "---|" * len(COLS))
    for rec in records:
        print("| " + " | ".join(fmt(rec.get(c)) for c in COLS) + " |")
    failed = [r for r in records if r.get("error") or not r.get("ok") or not r.get("graph_follows_inputs")]
    print(f"\n{len(records) - len(failed)}/{len(records)} shapes ok (parity within {TOLERANCE}, graph follows inputs)")
    return 1 if failed else 0


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "" if v is None else str(v)


if __name__ == "__main__":
    sys.exit(main())
