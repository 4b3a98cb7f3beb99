"""Paged attention's launch plan (tile height, split count) against the plan before 2026-12-07 (64-row tiles at most,
ceil(2 waves / programs) splits), per shape, in one process: microseconds per call replayed from a CUDA graph of 8
calls (the tree mask's bit-words built once, as the engine does), and each plan's max error against the float32
reference.

    python scripts/gpu_attention_plan.py --out $OUT/plan.json
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels.paged_attention as pa  # noqa: E402
from scripts.gpu_kernels import bf16, capture, graph_us, make_inputs, random_tree_mask  # noqa: E402

new_plan = pa.launch_plan


def old_plan(batch, q_heads, kv_heads, t, max_positions, device, head_dim=128):
    rows = q_heads // kv_heads * t
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    m_tiles = math.ceil(rows / block_m)
    programs = batch * kv_heads * m_tiles
    splits = max(1, min(math.ceil(2 * pa._sm_count(device) / programs), math.ceil(max_positions / pa.BLOCK_N)))
    return block_m, m_tiles, splits


ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--out", required=True)
out_path = Path(ap.parse_args().out)
SHAPES = {"llama8b": (32, 8, 128), "small": (12, 4, 64), "tiny": (8, 4, 32), "mha32_d128": (32, 32, 128),
          "gqa32/4_d64": (32, 4, 64), "gqa16/8_d256": (16, 8, 256)}
res = []
for name, (hq, hkv, d) in SHAPES.items():
    for ctx in ((512, 2048) if name == "llama8b" else (512,)):
        for batch in (1, 4, 16, 32):
            for t in (1, 5, 17):
                args = bf16(make_inputs(batch, hq, hkv, d, t, ctx))
                if t > 1:
                    args["intra_mask"] = random_tree_mask(batch, t - 1, torch.Generator().manual_seed(0)).cuda()
                args["bits"] = pa.mask_bits(args["intra_mask"], None, batch, t, args["q"].device)
                up = {k: v.float() if k in ("q", "k_pool", "v_pool") else v for k, v in args.items()}
                ref = pa.paged_attention_reference(**{k: v for k, v in up.items() if k != "bits"}, block_size=16)
                r = dict(shape=name, context=ctx, batch=batch, T=t)
                for label, plan in (("old", old_plan), ("new", new_plan)):
                    pa.launch_plan = plan
                    r[label + "_plan"] = plan(batch, hq, hkv, t, args["block_table"].shape[1] * 16, args["q"].device, d)
                    fn = lambda: pa.paged_attention_triton(**args, block_size=16)  # noqa: E731
                    r[label + "_err"] = (fn().float() - ref).abs().max().item()
                    r[label + "_us"] = round(graph_us(capture(fn)[0], 30), 2)
                pa.launch_plan = new_plan
                r["new_over_old"] = round(r["new_us"] / r["old_us"], 3)
                res.append(r); print(r, flush=True)
out_path.parent.mkdir(parents=True, exist_ok=True)
out_path.write_text(json.dumps(res, indent=1))
