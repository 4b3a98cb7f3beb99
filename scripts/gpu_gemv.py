"""Triton weight-only GEMVs (kernels/quant_gemv.py) on one GPU: parity, speed per linear, and AR decode with them.

    python scripts/gpu_gemv.py --device cuda --out DIR [--parts parity,speed,sweep,decode]

parity : every decoder linear shape of the random 1.45 B and 6.7 B configs (qkv, o, gate_up, down), M = 1, 4, 9, bf16
         activations: the Triton kernel against `quant_gemv_reference` (dequantize in fp32, fp32 matmul), per format
         (int8 per channel, int4 group 128 asymmetric, fp8 e4m3 per channel, dense = the bf16 weight itself): max
         |error| / max |reference|.
speed  : the same shapes and M, graph-replayed (one CUDA graph runs the call over `copies` clones of the weight, so
         the weights read per replay exceed the L2 cache and every call reads HBM): us per call and achieved GB/s of
         the stored weight bytes (scales included), for the Triton kernel, the aten path of the same module
         (_weight_int8pack_mm, tinygemm _weight_int4pack_mm, _scaled_mm with per-token activation quantization) and
         a bf16 F.linear of the same shape; speedup vs bf16.
sweep  : M = 1 on the 6.7 B shapes: BLOCK_N x SPLIT_K around `gemv_config`'s choice, so the heuristic can be checked.
tune   : M = 1 on the same shapes, wider: BLOCK_N x BLOCK_K x num_warps x num_stages (split auto or 1), best marked
         beside gemv_config's own tile (auto_us, speedup_vs_auto); int4 takes BLOCK_K values that divide the group or
         are multiples of it (K tiles of whole groups, the kernel's ELEMENTWISE form), e.g. --tune-block-k 128,256,512.
tc     : M = 1 on the --configs shapes: gemv_config's CUDA-core tile against tensor-core tiles (BLOCK_M = 16), with
         parity; the best per (format, shape) into gemv_tc_tiles.json (for scripts/gpu_quant.py --m1-tiles).
f16    : M > 1 (verify widths): int8 / fp8 tensor-core tiles with fp16 operands against the fp32-widened weight.
cvt    : M = 1: int8 / fp8 weights widened by integer ops against conversion instructions, and all 256 bytes exact.
rows   : int4 at verify widths (--rows-ms, default 5) on the --sweep-configs shapes: tinygemm, the one-group tiles
         and each multi-row tile of whole groups of the --rows-block-n x --rows-block-k x --rows-warps grid (passed
         per call as gemv_config's int4_rows), with parity and
         the speedup over tinygemm; the fastest parity-clean Triton tile per (shape, M) marked.
prefill: int4 past GEMV_MAX_ROWS (--prefill-ms, default 64,512) on the --sweep-configs shapes: bf16, tinygemm, kernel
         "triton" with its weight dequantized by one kernel (kernels/int4_dequant.py) and through the GEMV kernel's
         tensor-core form with no weight written (KernelTuning.int4_prefill_gemm_rows).
mma    : int4 at 1..16 rows (--mma-ms) on the tensor cores (kernels/int4_mma.py) on the --sweep-configs shapes: a grid
         of its tiles (--mma-block-n x --mma-warps x --mma-stages x --mma-per-sm) beside bf16,
         tinygemm and our CUDA-core GEMV, with parity; the best per (shape, M) marked, and per-layer sums.
read   : one-row int4 on the --sweep-configs shapes against a read-only floor: kernels/stream_read.py streams a buffer
         of the linear's stored int4 bytes (weight, scales, zeros) and of its bf16 bytes in one launch, over a grid of
         --read-blocks x --read-iters x --read-warps tiles (best marked), beside our GEMV, tinygemm and bf16 F.linear
         of the same shape; then the sums over one decoder layer (what no one-launch-per-linear design can beat).
decode : AR decode at batch 1 of the random 6.7 B (and --decode-configs) through scripts/gpu_quant.py's floor part,
         formats none + {int8,int4,fp8}-triton (quant_kernel "triton"): ms/token, fraction of that format's HBM floor,
         speedup vs bf16.
Every module runs with --kernel-tuning (kernels/tuning.py; recorded in the env block); variants a part compares are
passed per call (gemv_config overrides or a KernelTuning), never set on the kernel modules.
Writes gemv_<part>.json and gemv_<part>.md into --out; one failing row or part is recorded, not fatal.
CPU smoke test (the kernel runs under the interpreter only: TRITON_INTERPRET=1 with triton installed, else its rows
record why not):  python scripts/gpu_gemv.py --device cpu --out /tmp/g --configs mini --ms 1,3 --decode-configs mini
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_quant import CONFIGS, table  # noqa: E402
from gpu_timing import graph_us, run_parts  # noqa: E402
from kernels.quant_gemv import (GEMV_FORMATS, all_byte_values, counters_for, dequantize_weight,  # noqa: E402
                                quant_gemv_reference,
                                gemv_config, quant_gemv_triton, triton_problem)
from kernels.tuning import KernelTuning, format_tuning, parse_tuning  # noqa: E402
from workbench.engine.quant import linear_shapes, weight_bytes  # noqa: E402
from workbench.engine.quant.linears import (DenseGemvLinear, Fp8Linear, Int4Linear, Int8Linear,  # noqa: E402
                                            fp8_linear_reference)
from workbench.models import ModelConfig  # noqa: E402

L2_FLUSH_BYTES = 256e6  # weights cycled per graph replay: well past the H200's 50 MB L2


def kernel_ok(device: torch.device) -> str | None:
    """None when the Triton kernel can run here (a GPU, or the interpreter on a CPU), else why not."""
    import os

    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        problem = triton_problem("cuda")  # only "not installed" can be said of a CUDA device here
        if problem is None:
            _patch_interpreter_bf16_dot()
        return problem
    return triton_problem(device)


def _patch_interpreter_bf16_dot() -> None:
    """CPU smoke test only: the interpreter's tl.dot (triton 3.9) multiplies bf16 bit patterns as integers; widen
    bf16 operands to fp32 first (tests/test_kernels.py's fixture, applied for the whole process)."""
    import triton.language as tl
    from triton.runtime.interpreter import interpreter_builder as builder

    if getattr(builder, "_gemv_bf16_patch", False):
        return
    dot = builder.create_dot

    def widen(handle):
        return builder.cast_impl(handle, tl.float32) if handle.dtype == tl.bfloat16 else handle

    builder.create_dot = lambda a, b, acc, *rest: dot(widen(a), widen(b), acc, *rest)
    builder._gemv_bf16_patch = True


def shapes_of(config_names: str) -> list[tuple[str, str, int, int]]:
    """(config, linear, K, N) of every decoder linear of the named configs."""
    out = []
    for name in config_names.split(","):
        cfg = ModelConfig(vocab_size=32000, max_position_embeddings=4096, **CONFIGS[name])
        out += [(name, lin.split(".")[1], k, n) for lin, (k, n) in linear_shapes(cfg).items()]
    return out


def modules(fmt: str, k: int, n: int, device, dtype, group_size: int,
            tuning: KernelTuning = KernelTuning()) -> dict[str, nn.Module]:
    """{"triton": ..., "aten": ...} quant modules of one random [N, K] linear (weights ~ N(0, 0.02)), each with the
    run's KernelTuning (as the engine sets it)."""
    lin = nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    nn.init.normal_(lin.weight, std=0.02)
    with torch.no_grad():
        if fmt == "int8":
            mods = {"triton": Int8Linear(lin, "triton"), "aten": Int8Linear(lin, "aten" if device.type == "cuda"
                                                                                 else "dequant")}
        elif fmt == "int4":
            mods = {"triton": Int4Linear(lin, group_size, "triton"), "aten": Int4Linear(lin, group_size, "aten")}
        elif fmt == "dense":  # the unquantized weight through the GEMV; its cuBLAS twin is the "bf16" row
            mods = {"triton": DenseGemvLinear(lin, "triton")}
        else:
            mods = {"triton": Fp8Linear(lin, "triton"), **({"aten": Fp8Linear(lin, "aten")} if device.type == "cuda"
                                                            else {})}
    for mod in mods.values():
        mod.tuning = tuning
    return mods


def gemv_call(mod: nn.Module, x: torch.Tensor, tuning: KernelTuning | None = None, **override) -> torch.Tensor:
    """The Triton module's GEMV on x with a compared variant passed per call: gemv_config `override` entries (a sweep's
    tile or form) and / or a KernelTuning (None: the module's own)."""
    return quant_gemv_triton(x, mod.fmt if mod.fmt != "none" else "dense", **buffers(mod), counters=mod.gemv_counters,
                             tuning=tuning or mod.tuning, **override)


def buffers(mod: nn.Module) -> dict:
    if isinstance(mod, DenseGemvLinear):
        return dict(weight=mod.weight)
    extra = dict(zero=mod.zero, group_size=mod.group_size) if mod.fmt == "int4" else {}
    return dict(weight=mod.weight, scale=mod.scale, **extra)


def tile_case(fmt: str, k: int, n: int, device, args):
    """What a tile sweep of one (format, shape) times at M = 1: the Triton module, its rotating clones, the weight
    bytes one call reads (split-K counters left out) and a one-row input."""
    mod = modules(fmt, k, n, device, args.dtype, args.int4_group_size, args.tuning)["triton"]
    return (mod, rotating(mod, device), weight_bytes(mod) - mod.gemv_counters.numel() * 4,
            torch.randn(1, k, device=device, dtype=args.dtype))


def time_us(calls: list, device: torch.device, replays: int) -> float:
    """Microseconds per call of `calls` (a list of no-argument functions run in turn): CUDA-graph replays on a GPU
    (launch overhead out, as in the engine's captured steps), a perf_counter loop on a CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(replays):
            for fn in calls:
                fn()
        return (time.perf_counter() - t0) * 1e6 / (replays * len(calls))
    with torch.cuda.device(device):  # every call once per graph, the graph replayed `replays` times
        return graph_us(lambda: [fn() for fn in calls], 1, replays) / len(calls)


def rotating(mod: nn.Module, device: torch.device) -> list[nn.Module]:
    """The module and clones of it, enough that their weights together pass L2_FLUSH_BYTES (at most 64)."""
    count = 1 if device.type != "cuda" else max(2, min(64, math.ceil(L2_FLUSH_BYTES / weight_bytes(mod))))
    return [mod] + [copy.deepcopy(mod) for _ in range(count - 1)]


# ---- parts -------------------------------------------------------------------------------------------------------
def part_parity(args, device) -> list[dict]:
    rows = []
    problem = kernel_ok(device)
    for config, name, k, n in shapes_of(args.configs):
        for fmt in args.formats.split(","):
            mods = modules(fmt, k, n, device, args.dtype, args.int4_group_size, args.tuning)
            for m in map(int, args.ms.split(",")):
                row = dict(config=config, linear=name, K=k, N=n, M=m, format=fmt)
                x = torch.randn(m, k, device=device, dtype=args.dtype)
                ref = x.float() @ dequantize_weight(fmt, **buffers(mods["triton"])).T  # fp32, unrounded
                scale = ref.abs().max().item()
                try:
                    if problem:
                        raise RuntimeError(problem)
                    got = mods["triton"](x).float()
                    row["triton_max_err"] = (got - ref).abs().max().item()
                    row["triton_rel_err"] = row["triton_max_err"] / scale
                    row["triton_ok"] = row["triton_rel_err"] <= args.parity_rtol
                except Exception as e:  # noqa: BLE001
                    row["triton_error"] = f"{type(e).__name__}: {e}"[:300]
                if "aten" in mods:  # the aten path against its own math (fp8: activations quantized per token)
                    aten = mods["aten"]
                    want = (fp8_linear_reference(x.float(), aten.weight, aten.scale[0]) if fmt == "fp8"
                            else x.float() @ aten.dequantized_weight().T)
                    row["aten_rel_err"] = ((aten(x).float() - want).abs().max() / want.abs().max()).item()
                    if fmt == "fp8":  # what per-token activation quantization costs against weight-only fp8
                        row["aten_vs_weight_only_rel"] = ((aten(x).float() - ref).abs().max() / scale).item()
                rows.append(row)
            del mods
    return rows


def part_speed(args, device) -> list[dict]:
    rows = []
    problem = kernel_ok(device)
    for config, name, k, n in shapes_of(args.configs):
        lin = nn.Linear(k, n, bias=False, device=device, dtype=args.dtype)
        bf16 = rotating(lin, device)
        bf16_bytes = k * n * lin.weight.element_size()
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=device, dtype=args.dtype)
            base_us = time_us([lambda mod=mod: mod(x) for mod in bf16], device, args.replays)
            rows.append(dict(config=config, linear=name, K=k, N=n, M=m, format="bf16", kernel="F.linear",
                             us=base_us, gb_per_s=bf16_bytes / base_us / 1e3, speedup_vs_bf16=1.0))
            print(json.dumps(rows[-1]), flush=True)
        del bf16, lin
        for fmt in args.formats.split(","):
            mods = modules(fmt, k, n, device, args.dtype, args.int4_group_size, args.tuning)
            for kernel, mod in mods.items():
                if kernel == "triton" and problem:
                    rows.append(dict(config=config, linear=name, format=fmt, kernel=kernel, error=problem))
                    continue
                clones = rotating(mod, device)
                nbytes = weight_bytes(mod) - (mod.gemv_counters.numel() * 4 if hasattr(mod, "gemv_counters") else 0)
                triton_int4 = kernel == "triton" and fmt == "int4"
                for m in map(int, args.ms.split(",")):
                    # variants as (kernel suffix, KernelTuning or None, gemv_config overrides), each passed per call:
                    # --half2-compare: one-row int4 triton calls with packed fp16 words 0 / 1 / 2 (int4_half2);
                    # --int4-wide-rows-compare: int4 triton calls of M > 1 once more in one group per K tile
                    # (int4_rows False; the default K tiles of whole groups get the suffix "+i4r")
                    variants = [("+i4r" if triton_int4 and m > 1 else "", None, {})]
                    if triton_int4 and m == 1 and args.half2_compare:
                        variants = [(f"+h2={h}", dataclasses.replace(args.tuning, int4_half2=h), {}) for h in (0, 1, 2)]
                    if triton_int4 and m > 1 and args.int4_wide_rows_compare:
                        variants.append(("", None, dict(int4_rows=False)))
                    for suffix, tuning, over in variants:
                        row = dict(config=config, linear=name, K=k, N=n, M=m, format=fmt, kernel=mod.kernel + suffix)
                        try:
                            x = torch.randn(m, k, device=device, dtype=args.dtype)
                            calls = [lambda c=c: c(x) for c in clones] if tuning is None and not over else \
                                [lambda c=c: gemv_call(c, x, tuning, **over) for c in clones]
                            us = time_us(calls, device, args.replays)
                            base = next(r["us"] for r in rows if r["format"] == "bf16" and r["config"] == config
                                        and r["linear"] == name and r["M"] == m)
                            row.update(us=us, gb_per_s=nbytes / us / 1e3, speedup_vs_bf16=base / us,
                                       weight_mb=nbytes / 1e6)
                            if kernel == "triton":
                                cfg = gemv_config(fmt, m, n, k, args.int4_group_size, **over)
                                row["config_used"] = f"BM{cfg['BLOCK_M']} BN{cfg['BLOCK_N']} BK{cfg['BLOCK_K']} " \
                                    f"split{cfg['SPLIT_K']}"
                        except Exception as e:  # noqa: BLE001
                            row["error"] = f"{type(e).__name__}: {e}"[:300]
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                del clones
            del mods
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def part_sweep(args, device) -> list[dict]:
    rows = []
    problem = kernel_ok(device)
    if problem:
        return [dict(error=problem)]
    for config, name, k, n in shapes_of(args.sweep_configs):
        for fmt in args.formats.split(","):
            mod, clones, nbytes, x = tile_case(fmt, k, n, device, args)
            auto = gemv_config(fmt, 1, n, k, args.int4_group_size)
            for block_n in (16, 32, 64):
                for split in sorted({1, max(1, auto["SPLIT_K"] // 2), auto["SPLIT_K"], auto["SPLIT_K"] * 2}):
                    over = dict(BLOCK_N=block_n, SPLIT_K=split)
                    row = dict(config=config, linear=name, K=k, N=n, format=fmt, BLOCK_N=block_n, SPLIT_K=split,
                               auto=(block_n == auto["BLOCK_N"] and split == auto["SPLIT_K"]))
                    try:
                        us = time_us([lambda c=c: quant_gemv_triton(x, fmt, **buffers(c), **over) for c in clones],
                                     device, args.replays)
                        row.update(us=us, gb_per_s=nbytes / us / 1e3)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(row)
            del clones, mod
            best = min((r for r in rows if r.get("format") == fmt and r.get("linear") == name and "us" in r),
                       key=lambda r: r["us"], default=None)
            if best:
                best["best"] = True
                print(json.dumps(best), flush=True)
    return rows


def part_tune(args, device) -> list[dict]:
    """M = 1 on the --sweep-configs shapes: a wider grid than `sweep` (BLOCK_N x BLOCK_K x num_warps x num_stages x
    SPLIT_K; --tune-* set the values), gemv_config's own tile timed first, each tile's max |error| / max |reference|
    beside its time, the fastest within --parity-rtol per (shape, format) marked with its speedup over the first; the
    best that is not gemv_config's goes into gemv_tune_tiles.json (gpu_quant.py --m1-tiles, "+tc" rows). int4 takes
    the --tune-block-k values that divide the group size or are multiples of it (K tiles of whole groups; default 64,
    128: gemv_config's one-group tiles); --tune-cvt-bits adds the widening switch CVT_BITS to the grid (int8 / fp8,
    and int4's K tiles of whole groups)."""
    rows = []
    problem = kernel_ok(device)
    if problem:
        return [dict(error=problem)]
    t_end = time.perf_counter() + args.tune_budget_s
    best_tiles = {}
    for config, name, k, n in shapes_of(args.sweep_configs):
        for fmt in args.formats.split(","):
            mod, clones, nbytes, x = tile_case(fmt, k, n, device, args)
            g = args.int4_group_size
            if fmt == "int4":  # inside one group, or whole groups (gemv_config refuses anything else)
                block_ks = [b for b in ints(args.tune_block_k) or (64, 128) if g % b == 0 or b % g == 0]
            else:
                block_ks = ints(args.tune_block_k) or ([128, 256, 512] if fmt == "dense" else [256, 512, 1024])
            block_ks = sorted({min(b, max(16, 1 << (k - 1).bit_length())) for b in block_ks})  # none past K
            ref = x.float() @ dequantize_weight(fmt, **buffers(mod)).T  # [1, N] fp32: every tile's parity
            ref_max = ref.abs().max()
            auto_cfg = gemv_config(fmt, 1, n, k, args.int4_group_size)
            auto_row = dict(config=config, linear=name, K=k, N=n, format=fmt, tile="auto",
                            **{key: auto_cfg[key] for key in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages",
                                                              "SPLIT_K")})
            try:  # gemv_config's own choice first, timed the same way, so each best says what it beats
                got = quant_gemv_triton(x, fmt, **buffers(mod)).float()
                auto_row["rel_err"] = ((got - ref).abs().max() / ref_max).item()
                auto_row["us"] = time_us([lambda c=c: quant_gemv_triton(x, fmt, **buffers(c)) for c in clones],
                                         device, args.replays)
                auto_row["gb_per_s"] = nbytes / auto_row["us"] / 1e3
            except Exception as e:  # noqa: BLE001
                auto_row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(auto_row)
            print(json.dumps(auto_row), flush=True)
            cvts = [{"CVT_BITS": bool(v)} for v in ints(args.tune_cvt_bits)] or [{}]  # [{}]: the format's default
            if fmt == "int4" and ints(args.tune_half2):  # packed fp16 words (HALF2) as one more dimension
                cvts = [{**c, "HALF2": h} for c in cvts for h in ints(args.tune_half2)]
            for block_n in ints(args.tune_block_n) or (16, 32, 64):
                for block_k in block_ks:
                    for warps in ints(args.tune_warps) or (4, 8):
                        for stages in ints(args.tune_stages) or (2, 4):
                            auto = gemv_config(fmt, 1, n, k, g, BLOCK_N=block_n, BLOCK_K=block_k)
                            splits = ints(args.tune_splits) or [1, auto["SPLIT_K"]]
                            for split in sorted({s for s in splits if s <= math.ceil(k / block_k)}):
                                for cvt in cvts:
                                    if time.perf_counter() > t_end:
                                        rows.append(dict(config=config, linear=name, format=fmt,
                                                         error="tune budget spent"))
                                        _write_tiles(args, best_tiles, "gemv_tune_tiles.json")
                                        return rows
                                    over = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                                num_stages=stages, SPLIT_K=split, **cvt)
                                    row = dict(config=config, linear=name, K=k, N=n, format=fmt, **over)
                                    try:
                                        got = quant_gemv_triton(x, fmt, **buffers(mod), **over).float()
                                        row["rel_err"] = ((got - ref).abs().max() / ref_max).item()
                                        us = time_us([lambda c=c: quant_gemv_triton(x, fmt, **buffers(c), **over)
                                                      for c in clones], device, args.replays)
                                        row.update(us=us, gb_per_s=nbytes / us / 1e3)
                                    except Exception as e:  # noqa: BLE001
                                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                                    rows.append(row)
            del clones, mod, ref
            best = min((r for r in rows if r.get("format") == fmt and r.get("linear") == name and "us" in r
                        and r.get("config") == config and r["rel_err"] <= args.parity_rtol),
                       key=lambda r: r["us"], default=None)  # the fastest parity-clean tile
            if best:
                best["best"] = True
                if "us" in auto_row:  # gemv_config's own tile beside the best
                    best["auto_us"] = auto_row["us"]
                    best["speedup_vs_auto"] = auto_row["us"] / best["us"]
                if best.get("tile") != "auto":  # a measured tile for gpu_quant.py --m1-tiles ("+tc" rows)
                    best_tiles[f"{fmt},{n},{k}"] = {key: best[key] for key in ("BLOCK_N", "BLOCK_K", "num_warps",
                                                                               "num_stages", "SPLIT_K", "CVT_BITS",
                                                                               "HALF2")
                                                    if key in best}
                print(json.dumps(best), flush=True)
    _write_tiles(args, best_tiles, "gemv_tune_tiles.json")
    return rows


def part_tc(args, device) -> list[dict]:
    """M = 1 on the --configs shapes: the CUDA-core GEMV (gemv_config's tiles) against tensor-core tiles (BLOCK_M = 16,
    rows past M masked; int8 / fp8 multiply fp16 operands, one conversion per weight instead of fp8 -> fp16 -> fp32),
    each with its max |error| / max |reference|. The fastest parity-clean tile per (format, shape) goes into
    gemv_tc_tiles.json ({"fmt,N,K": overrides}, {} where gemv_config's own tile won), for gpu_quant.py --m1-tiles."""
    rows, best_tiles = [], {}
    problem = kernel_ok(device)
    if problem:
        return [dict(error=problem)]
    t_end = time.perf_counter() + args.tune_budget_s
    grid = [dict()] + [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=3)
                       for bn in (32, 64, 128) for bk in (128, 256) for w in (4, 8)]
    for config, name, k, n in shapes_of(args.configs):
        for fmt in args.formats.split(","):
            mod, clones, nbytes, x = tile_case(fmt, k, n, device, args)
            ref = x.float() @ dequantize_weight(fmt, **buffers(mod)).T
            case = []
            for over in grid:
                if time.perf_counter() > t_end:
                    rows.append(dict(config=config, linear=name, format=fmt, error="tc budget spent"))
                    _write_tiles(args, best_tiles)
                    return rows
                row = dict(config=config, linear=name, K=k, N=n, format=fmt, tile="auto" if not over else
                           f"M{over['BLOCK_M']} N{over['BLOCK_N']} K{over['BLOCK_K']} w{over['num_warps']}")
                try:
                    got = quant_gemv_triton(x, fmt, **buffers(mod), **over).float()
                    row["rel_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
                    us = time_us([lambda c=c: quant_gemv_triton(x, fmt, **buffers(c), **over) for c in clones],
                                 device, args.replays)
                    row.update(us=us, gb_per_s=nbytes / us / 1e3, over=over)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                case.append(row)
            ok = [r for r in case if "us" in r and r["rel_err"] <= args.parity_rtol]
            auto = next((r for r in case if r["tile"] == "auto" and "us" in r), None)
            if ok:
                best = min(ok, key=lambda r: r["us"])
                best["best"] = True
                if auto:
                    best["speedup_vs_auto"] = auto["us"] / best["us"]
                best_tiles[f"{fmt},{n},{k}"] = best["over"]
                print(json.dumps({kk: v for kk, v in best.items() if kk != "over"}), flush=True)
            rows.extend({kk: v for kk, v in r.items() if kk != "over"} for r in case)
            del clones, mod
    _write_tiles(args, best_tiles)
    return rows


def _flag_rows(args, device, flag: str, formats: tuple, ms: list[int]) -> list[dict]:
    """Per --configs shape, format in `formats` and M in `ms`: the kernel with override `flag` False, then True (same
    tiles otherwise): us per call, GB/s and max |error| / max |reference| of each, and True's speedup."""
    rows = []
    problem = kernel_ok(device)
    if problem:
        return [dict(error=problem)]
    for config, name, k, n in shapes_of(args.configs):
        for fmt in [f for f in args.formats.split(",") if f in formats]:
            mod = modules(fmt, k, n, device, args.dtype, args.int4_group_size, args.tuning)["triton"]
            clones = rotating(mod, device)
            nbytes = weight_bytes(mod) - mod.gemv_counters.numel() * 4
            for m in ms:
                x = torch.randn(m, k, device=device, dtype=args.dtype)
                ref = x.float() @ dequantize_weight(fmt, **buffers(mod)).T
                base = None
                for on in (False, True):
                    over = {flag: on}
                    row = dict(config=config, linear=name, K=k, N=n, M=m, format=fmt, **{flag.lower(): on})
                    try:
                        got = quant_gemv_triton(x, fmt, **buffers(mod), **over).float()
                        row["rel_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
                        us = time_us([lambda c=c: quant_gemv_triton(x, fmt, **buffers(c), **over) for c in clones],
                                     device, args.replays)
                        row.update(us=us, gb_per_s=nbytes / us / 1e3)
                        if on and base:
                            row["speedup"] = base / us
                        base = us
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del clones, mod
    return rows


def part_f16(args, device) -> list[dict]:
    """Verify widths (--ms, M > 1): int8 / fp8 tensor-core tiles with fp16 operands (F16_DOT, the default: one
    conversion per weight) against the weight widened to fp32 and narrowed to bf16."""
    return _flag_rows(args, device, "F16_DOT", ("int8", "fp8"), [m for m in map(int, args.ms.split(",")) if m > 1])


def part_cvt(args, device) -> list[dict]:
    """M = 1: int8 / fp8 weights widened to fp32 by integer ops (CVT_BITS, the default) against conversion
    instructions; then every byte value through both (exact or not: `all_bytes_exact`)."""
    rows = _flag_rows(args, device, "CVT_BITS", ("int8", "fp8"), [1])
    if kernel_ok(device):
        return rows
    for fmt in ("int8", "fp8"):
        w, want = all_byte_values(fmt, device)
        x = torch.zeros(1, 16, device=device)
        x[0, 0] = 1.0
        scale = torch.ones(256, device=device) if fmt == "int8" else torch.ones(1, 256, device=device)
        for on in (False, True):
            got = quant_gemv_triton(x, fmt, w, scale, CVT_BITS=on)[0]
            rows.append(dict(format=fmt, cvt_bits=on, all_bytes_exact=bool(torch.equal(got, want)),
                             max_err=(got - want).abs().max().item()))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def ints(text: str) -> list[int]:
    """"8,16" -> [8, 16]; "" -> []."""
    return [int(v) for v in text.split(",") if v]


def _write_tiles(args, best_tiles: dict, name: str = "gemv_tc_tiles.json") -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, name).write_text(json.dumps(best_tiles, indent=1))


def part_decode(args, device) -> list[dict]:
    from gpu_quant import part_floor

    formats = ",".join(["none"] + [f"{f}-triton" for f in args.formats.split(",")]
                       + [f for f in args.decode_extra.split(",") if f])
    ns = SimpleNamespace(floor_configs=args.decode_configs, vocab=args.vocab, prompt_len=64,
                         max_new_tokens=args.max_new_tokens, repeats=args.repeats, formats=formats,
                         floor_modes=args.decode_modes, int4_group_size=args.int4_group_size)
    return part_floor(ns, device)


def mark_best(rows: list[dict], kernel: str, rtol: float) -> list[dict]:
    """Mark the fastest timed row of `kernel` whose rel_err is within `rtol` ("best": True), print every row, and
    return them."""
    best = min((r for r in rows if r["kernel"] == kernel and "us" in r and r["rel_err"] <= rtol),
               key=lambda r: r["us"], default=None)
    if best:
        best["best"] = True
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def layer_sums(rows: list[dict], configs: str, kinds: tuple, tiled: str, ms: list[int]) -> list[dict]:
    """One "layer" row per (config, M, kernel): the sum of its rows' us over the linears, for `tiled` only the rows
    marked best (with their tiles named); printed and returned."""
    out = []
    for config in dict.fromkeys(c for c, *_ in shapes_of(configs)):
        for m in ms:
            for kind in kinds:
                per_linear = {r["linear"]: r for r in rows
                              if r.get("config") == config and r.get("M") == m and r.get("kernel") == kind
                              and "us" in r and (kind != tiled or r.get("best"))}
                if per_linear:
                    out.append(dict(config=config, linear="layer", kernel=kind, M=m,
                                    us=sum(r["us"] for r in per_linear.values()), linears=len(per_linear),
                                    tiles=", ".join(f"{lin}: {r['tile']}{' pdl' if r.get('pdl') else ''}"
                                                    for lin, r in per_linear.items()) if kind == tiled else "-"))
                    print(json.dumps(out[-1]), flush=True)
    return out


def part_rows(args, device) -> list[dict]:
    """int4 above one row (verify widths) on the --sweep-configs shapes, at each of --rows-ms: tinygemm ("aten"), our
    one-group tiles (int4_rows False) and each multi-row tile of the --rows-* grid (int4_rows), each with its max
    |error| / max |reference| and its speedup over tinygemm; the fastest parity-clean Triton tile per (shape, M) is
    marked."""
    rows = []
    problem = kernel_ok(device)
    if problem:
        return [dict(error=problem)]
    grid = [None] + [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=3) for bn in ints(args.rows_block_n)
                     for bk in ints(args.rows_block_k) for w in ints(args.rows_warps)]
    t_end = time.perf_counter() + args.tune_budget_s
    for config, name, k, n in shapes_of(args.sweep_configs):
        mods = modules("int4", k, n, device, args.dtype, args.int4_group_size, args.tuning)
        clones = {kind: rotating(mod, device) for kind, mod in mods.items()}
        nbytes = weight_bytes(mods["triton"]) - mods["triton"].gemv_counters.numel() * 4
        for m in ints(args.rows_ms):
            x = torch.randn(m, k, device=device, dtype=args.dtype)
            ref = x.float() @ dequantize_weight("int4", **buffers(mods["triton"])).T
            ref_max = ref.abs().max()
            at_m = []
            for kind, tile in [("aten", None)] + [("triton", t) for t in grid]:
                if time.perf_counter() > t_end:
                    rows.append(dict(config=config, linear=name, M=m, error="rows budget spent"))
                    return rows
                row = dict(config=config, linear=name, K=k, N=n, M=m, kernel=kind,
                           tile="-" if kind == "aten" else "one group" if tile is None else
                           f"{tile['BLOCK_N']}x{tile['BLOCK_K']} w{tile['num_warps']}")
                try:
                    with torch.no_grad():
                        # a Triton tile passed per call (an override: never kernels/int4_mma.py, which the mma part
                        # times)
                        calls = [lambda c=c: c(x) for c in clones[kind]] if kind == "aten" else \
                            [lambda c=c, t=tile: gemv_call(c, x, int4_rows=t or False) for c in clones[kind]]
                        got = calls[0]().float()
                        row["rel_err"] = ((got - ref).abs().max() / ref_max).item()
                        row["us"] = time_us(calls, device, args.replays)
                    row["gb_per_s"] = nbytes / row["us"] / 1e3
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                at_m.append(row)
            aten = next((r["us"] for r in at_m if r["kernel"] == "aten" and "us" in r), None)
            for r in at_m:
                if aten and "us" in r:
                    r["speedup_vs_tinygemm"] = aten / r["us"]
            rows += mark_best(at_m, "triton", args.parity_rtol)
        del mods, clones
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def part_prefill(args, device) -> list[dict]:
    """int4 calls past GEMV_MAX_ROWS (prefill) on the --sweep-configs shapes, at each of --prefill-ms: bf16 F.linear,
    tinygemm ("aten"), and kernel "triton" with its weight dequantized by one kernel ("triton+dq",
    kernels/int4_dequant.py) or no weight written at all ("triton+gemv": the GEMV kernel's tensor-core form over
    16-row tiles, KernelTuning.int4_prefill_gemm_rows), each with its max |error| / max |reference| and its speedup
    over bf16."""
    rows = []
    for config, name, k, n in shapes_of(args.sweep_configs):
        lin = nn.Linear(k, n, bias=False, device=device, dtype=args.dtype)
        nn.init.normal_(lin.weight, std=0.02)
        mods = modules("int4", k, n, device, args.dtype, args.int4_group_size, args.tuning)
        clones = {"bf16": rotating(lin, device), **{kind: rotating(mod, device) for kind, mod in mods.items()}}
        for m in ints(args.prefill_ms):
            x = torch.randn(m, k, device=device, dtype=args.dtype)
            ref = x.float() @ dequantize_weight("int4", **buffers(mods["triton"])).T
            base = None
            for kind, how in (("bf16", None), ("aten", None), ("triton", "dq"), ("triton", "gemv")):
                row = dict(config=config, linear=name, K=k, N=n, M=m, kernel=kind + (f"+{how}" if how else ""))
                # the GEMV row: the modules' tuning with this M under int4_prefill_gemm_rows (as a run would set it)
                tuning = dataclasses.replace(args.tuning, int4_prefill_gemm_rows=m if how == "gemv" else 0)
                for c in [mods[kind]] + clones[kind] if kind == "triton" else ():
                    c.tuning = tuning
                try:
                    with torch.no_grad():
                        if kind != "bf16":
                            row["rel_err"] = ((mods[kind](x).float() - ref).abs().max() / ref.abs().max()).item()
                        row["us"] = time_us([lambda c=c: c(x) for c in clones[kind]], device, args.replays)
                    base = base or row["us"]
                    row["speedup_vs_bf16"] = base / row["us"]
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
        del mods, clones, lin
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def part_read(args, device) -> list[dict]:
    """The read floor per linear (see the module docstring's "read"): rows per (shape, tile) for stream_read over
    the int4 and bf16 bytes, rows for the GEMV ("triton"), tinygemm ("aten") and F.linear, then one "layer" row per
    kernel summing its best over the config's linears."""
    from kernels.stream_read import stream_read

    rows, problem = [], kernel_ok(device)
    blocks, iters_, warps = ints(args.read_blocks), ints(args.read_iters), ints(args.read_warps)
    for config, name, k, n in shapes_of(args.sweep_configs):
        lin = nn.Linear(k, n, bias=False, device=device, dtype=args.dtype)
        nn.init.normal_(lin.weight, std=0.02)
        mods = modules("int4", k, n, device, args.dtype, args.int4_group_size, args.tuning)
        int4_bytes = weight_bytes(mods["triton"]) - mods["triton"].gemv_counters.numel() * 4
        x = torch.randn(1, k, device=device, dtype=args.dtype)
        base = dict(config=config, linear=name, K=k, N=n, M=1)
        for kind, calls_of, nbytes in (("bf16 F.linear", rotating(lin, device), k * n * 2),
                                       ("tinygemm", rotating(mods["aten"], device), int4_bytes),
                                       ("triton", rotating(mods["triton"], device), int4_bytes)):
            row = dict(base, kernel=kind, bytes=nbytes)
            if kind == "triton" and problem:
                row["error"] = problem
            else:
                try:
                    with torch.no_grad():
                        row["us"] = time_us([lambda c=c: c(x) for c in calls_of], device, args.replays)
                    row["gb_per_s"] = nbytes / row["us"] / 1e3
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del mods, lin
        for what, nbytes in (("int4", int4_bytes), ("bf16", k * n * 2)):
            words = math.ceil(nbytes / 4)
            count = 1 if device.type != "cuda" else max(2, min(64, math.ceil(L2_FLUSH_BYTES / nbytes)))
            bufs = [torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), dtype=torch.int32, device=device)
                    for _ in range(count)]
            outs = [torch.empty(triton_cdiv(words, 32), dtype=torch.int32, device=device) for _ in bufs]
            best = None
            for block in blocks:
                for iters in iters_:
                    for nw in warps:
                        row = dict(base, kernel=f"read {what}", bytes=nbytes, tile=f"{block} x {iters}, {nw} warps")
                        if problem:
                            row["error"] = problem
                        else:
                            try:
                                calls = [lambda b=b, o=o: stream_read(b, block, iters, nw, out=o)
                                         for b, o in zip(bufs, outs)]
                                calls[0]()  # compile outside the graph
                                row["us"] = time_us(calls, device, args.replays)
                                row["gb_per_s"] = nbytes / row["us"] / 1e3
                                best = row if best is None or row["us"] < best["us"] else best
                            except Exception as e:  # noqa: BLE001
                                row["error"] = f"{type(e).__name__}: {e}"[:300]
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            if best is not None:
                best["best"] = True
            del bufs, outs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for config in dict.fromkeys(c for c, *_ in shapes_of(args.sweep_configs)):
        for kind in ("bf16 F.linear", "read bf16", "tinygemm", "triton", "read int4"):
            timed = [r for r in rows if r["config"] == config and r["kernel"] == kind and "us" in r]
            per_linear = {}
            for r in timed:
                if r["linear"] not in per_linear or r["us"] < per_linear[r["linear"]]["us"]:
                    per_linear[r["linear"]] = r
            if per_linear:
                us, nbytes = sum(r["us"] for r in per_linear.values()), sum(r["bytes"] for r in per_linear.values())
                rows.append(dict(config=config, linear="layer", kernel=kind, M=1, us=us, bytes=nbytes,
                                 gb_per_s=nbytes / us / 1e3, linears=len(per_linear)))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def part_mma(args, device) -> list[dict]:
    """int4 at 1..16 rows on the tensor cores (kernels/int4_mma.py) on the --sweep-configs shapes, at each of
    --mma-ms: bf16 F.linear, tinygemm ("aten"), our CUDA-core GEMV ("triton", its default tile) and each int4_mma
    tile of the --mma-block-n x --mma-warps x --mma-stages x --mma-per-sm grid (per-sm: programs per SM the split
    aims at), each with its max |error| / max |reference|, its speedup over the GEMV and over bf16; the fastest
    parity-clean int4_mma tile per (shape, M) is marked. Then one "layer" row per kernel and M summing its best."""
    from kernels.int4_mma import int4_mma_gemv

    rows, problem = [], kernel_ok(device)
    if problem:
        return [dict(error=problem)]
    grid = [dict(BLOCK_N=bn, num_warps=w, num_stages=st, programs_per_sm=ps)
            for bn in ints(args.mma_block_n) for w in ints(args.mma_warps) for st in ints(args.mma_stages)
            for ps in ints(args.mma_per_sm) if not (bn >= 256 and w < 8)]
    for config, name, k, n in shapes_of(args.sweep_configs):
        lin = nn.Linear(k, n, bias=False, device=device, dtype=args.dtype)
        nn.init.normal_(lin.weight, std=0.02)
        mods = modules("int4", k, n, device, args.dtype, args.int4_group_size, args.tuning)
        clones = {"bf16": rotating(lin, device), **{kind: rotating(mod, device) for kind, mod in mods.items()}}
        nbytes = weight_bytes(mods["triton"]) - mods["triton"].gemv_counters.numel() * 4
        counters = counters_for(n, device)
        for m in ints(args.mma_ms):
            x = torch.randn(m, k, device=device, dtype=args.dtype)
            ref = x.float() @ dequantize_weight("int4", **buffers(mods["triton"])).T
            ref_max = ref.abs().max()
            at_m = []
            for kind, tile in [("bf16", None), ("aten", None), ("triton", None)] + [("mma", t) for t in grid]:
                row = dict(config=config, linear=name, K=k, N=n, M=m, kernel=kind,
                           tile="-" if tile is None else
                           f"{tile['BLOCK_N']} w{tile['num_warps']} s{tile['num_stages']} ps{tile['programs_per_sm']}")
                try:
                    with torch.no_grad():
                        if kind == "mma":
                            calls = [lambda c=c, t=tile: int4_mma_gemv(x, c.weight, c.scale, c.zero, c.group_size,
                                                                       counters, **t) for c in clones["triton"]]
                            got = calls[0]().float()
                        else:
                            calls = [lambda c=c: c(x) for c in clones[kind]]
                            got = calls[0]().float()
                        if kind != "bf16":
                            row["rel_err"] = ((got - ref).abs().max() / ref_max).item()
                        row["us"] = time_us(calls, device, args.replays)
                    row["gb_per_s"] = nbytes / row["us"] / 1e3
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                at_m.append(row)
            base = {r["kernel"]: r["us"] for r in at_m if r["kernel"] in ("bf16", "triton") and "us" in r}
            for r in at_m:
                if "us" in r:
                    r.update({f"speedup_vs_{key}": us / r["us"] for key, us in base.items()})
            rows += mark_best(at_m, "mma", args.parity_rtol)
        del mods, clones, lin
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows + layer_sums(rows, args.sweep_configs, ("bf16", "aten", "triton", "mma"), "mma", ints(args.mma_ms))


def fusion_inputs(fusion: str, k: int, n: int, device, dtype) -> tuple[torch.Tensor, dict]:
    """(x, keyword arguments) of a one-row call with `fusion` ("norm", "glu", "residual" or "glu+residual"): x
    [1, 2K] for SwiGLU, a norm weight near 1, a residual [1, N]."""
    x = torch.randn(1, 2 * k if "glu" in fusion else k, device=device, dtype=dtype)
    return x, dict(glu="glu" in fusion,
                   norm_weight=(1 + 0.1 * torch.randn(k, device=device)).to(dtype) if "norm" in fusion else None,
                   residual=torch.randn(1, n, device=device, dtype=dtype) if "residual" in fusion else None)


MODEL_FUSION = {"qkv_proj": "norm", "gate_up_proj": "norm", "o_proj": "residual", "down_proj": "glu+residual"}  # the
# fusions the model's linears take under gemv_fusion norm+glu+residual (gpu_quant's "+all")


def part_cuda(args, device) -> list[dict]:
    """One-row int4 in CUDA C++ (kernels/int4_cuda.py) on the --sweep-configs shapes: bf16 F.linear, tinygemm
    ("aten"), our Triton GEMV ("triton", its default tile, through the module as the model calls it, with
    KernelTuning.int4_cuda off for it, so the Triton kernel itself is timed) and each int4_cuda tile of the
    --cuda-rows-per-warp x --cuda-unroll x --cuda-warps x --cuda-wps x --cuda-pipe x --cuda-minb grid (or --cuda-tiles),
    with and without PDL (--cuda-pdl; with --cuda-model-fusion the Triton and CUDA rows take each linear's fusion as the
    model calls it), each with max |error| / max |reference| and its speedup over the GEMV and bf16; the fastest
    parity-clean tile per shape is marked. Then each fusion (RMSNorm prologue, SwiGLU prologue, residual epilogue)
    against quant_gemv_reference with the same fusion, timed with the shape's best tile beside the plain call and the
    Triton GEMV with that fusion; and one "layer" row per kernel summing its best."""
    from kernels.int4_cuda import cuda_problem, int4_cuda_gemv, parse_tile, tile_label

    rows, problem = [], kernel_ok(device) or cuda_problem(device)
    if problem:
        return [dict(error=problem)]
    grid = [dict(ROWS=r, UNROLL=u, WARPS=w, WORDS_PER_SUM=wps, PIPE=p, MINB=b) for r in ints(args.cuda_rows_per_warp)
            for u in ints(args.cuda_unroll) for w in ints(args.cuda_warps) for wps in ints(args.cuda_wps)
            for p in ints(args.cuda_pipe) for b in ints(args.cuda_minb) if b * w <= 16]  # MINB x warps <= 16:
    # at most 128 registers a thread (more blocks than that spill every step's weights)
    if args.cuda_tiles:  # an explicit list instead of the grid
        grid = [dict(parse_tile(t)) for t in args.cuda_tiles.split(";")]
    pdls = [bool(p) for p in ints(args.cuda_pdl)]
    triton_only = dataclasses.replace(args.tuning, int4_cuda=False)
    for config, name, k, n in shapes_of(args.sweep_configs):
        lin = nn.Linear(k, n, bias=False, device=device, dtype=args.dtype)
        nn.init.normal_(lin.weight, std=0.02)
        mods = modules("int4", k, n, device, args.dtype, args.int4_group_size, args.tuning)
        clones = {"bf16": rotating(lin, device), **{kind: rotating(mod, device) for kind, mod in mods.items()}}
        for c in clones["triton"]:  # "triton": the Triton GEMV itself (one-row int4 goes to the CUDA kernel otherwise)
            c.tuning = triton_only
        nbytes = weight_bytes(mods["triton"]) - mods["triton"].gemv_counters.numel() * 4
        x = torch.randn(1, k, device=device, dtype=args.dtype)
        ref = x.float() @ dequantize_weight("int4", **buffers(mods["triton"])).T
        fusion_kw, xin, ref_fused = {}, x, None
        if args.cuda_model_fusion:  # the call as the model makes it (MODEL_FUSION), for the Triton and CUDA rows
            xin, fusion_kw = fusion_inputs(MODEL_FUSION[name], k, n, device, args.dtype)
            m0 = mods["triton"]
            ref_fused = quant_gemv_reference(xin, "int4", m0.weight, m0.scale, m0.zero, m0.group_size,
                                             **fusion_kw).float()
        at_m = []
        for kind, tile, pdl in [("bf16", None, False), ("aten", None, False), ("triton", None, True)] + \
                [("cuda", t, p) for t in grid for p in pdls]:
            row = dict(config=config, linear=name, K=k, N=n, M=1, kernel=kind, pdl=pdl,
                       tile="-" if tile is None else tile_label(tile))
            fused = bool(fusion_kw) and kind in ("cuda", "triton")  # bf16 / tinygemm rows stay plain
            if fused:
                row["fusion"] = MODEL_FUSION[name]
            try:
                with torch.no_grad():
                    if kind == "cuda":
                        calls = [lambda c=c, t=tile, p=pdl: int4_cuda_gemv(xin if fused else x, c.weight, c.scale,
                                                                           c.zero, c.group_size, pdl=p,
                                                                           **(fusion_kw if fused else {}), **t)
                                 for c in clones["triton"]]
                    elif fused:
                        calls = [lambda c=c: quant_gemv_triton(xin, "int4", c.weight, c.scale, c.zero, c.group_size,
                                                               c.gemv_counters, tuning=triton_only, **fusion_kw)
                                 for c in clones["triton"]]
                    else:
                        calls = [lambda c=c: c(x) for c in clones[kind]]
                    got = calls[0]().float()
                    if kind != "bf16":
                        want = ref_fused if fused else ref
                        row["rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
                    row["us"] = time_us(calls, device, args.replays)
                row["gb_per_s"] = nbytes / row["us"] / 1e3
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            at_m.append(row)
        base = {r["kernel"]: r["us"] for r in at_m if r["kernel"] in ("bf16", "triton") and "us" in r}
        for r in at_m:
            if "us" in r:
                r.update({f"speedup_vs_{key}": us / r["us"] for key, us in base.items()})
        rows += mark_best(at_m, "cuda", args.parity_rtol)
        best = next((r for r in at_m if r.get("best")), None)
        best_tile = parse_tile(best["tile"]) if best else {}
        m = mods["triton"]
        for fusion in ("norm", "glu", "residual"):  # each fusion's parity (rule tile) and time (the best tile)
            row = dict(config=config, linear=name, K=k, N=n, M=1, kernel="cuda", fusion=fusion,
                       tile=best["tile"] if best else "rule")
            try:
                xin, kw = fusion_inputs(fusion, k, n, device, args.dtype)
                want = quant_gemv_reference(xin, "int4", m.weight, m.scale, m.zero, m.group_size, **kw).float()
                with torch.no_grad():
                    got = int4_cuda_gemv(xin, m.weight, m.scale, m.zero, m.group_size, **kw).float()
                row["rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
                row["ok"] = row["rel_err"] <= args.parity_rtol
                # timed with the shape's best tile, beside the plain call and the Triton GEMV with the same fusion
                with torch.no_grad():
                    row["us"] = time_us([lambda c=c: int4_cuda_gemv(xin, c.weight, c.scale, c.zero, c.group_size,
                                                                    pdl=True, **kw, **best_tile)
                                         for c in clones["triton"]], device, args.replays)
                    row["us_plain"] = time_us([lambda c=c: int4_cuda_gemv(x, c.weight, c.scale, c.zero,
                                                                          c.group_size, pdl=True, **best_tile)
                                               for c in clones["triton"]], device, args.replays)
                    row["triton_us"] = time_us([lambda c=c: quant_gemv_triton(xin, "int4", c.weight, c.scale,
                                                                              c.zero, c.group_size, c.gemv_counters,
                                                                              tuning=triton_only, **kw)
                                                for c in clones["triton"]], device, args.replays)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
        del mods, clones, lin
        torch.cuda.empty_cache()
    return rows + layer_sums(rows, args.sweep_configs, ("bf16", "aten", "triton", "cuda"), "cuda", [1])


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


PARTS = {"parity": part_parity, "speed": part_speed, "sweep": part_sweep, "tune": part_tune, "tc": part_tc,
         "f16": part_f16, "cvt": part_cvt, "decode": part_decode, "rows": part_rows,
         "prefill": part_prefill, "read": part_read, "mma": part_mma,
         "cuda": part_cuda}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="parity,speed,sweep,decode")
    ap.add_argument("--configs", default="1.45b,6.7b", help="configs whose linear shapes parity and speed use")
    ap.add_argument("--sweep-configs", default="6.7b")
    ap.add_argument("--decode-configs", default="6.7b")
    ap.add_argument("--decode-modes", default="graphs", help="gpu_fastpath modes the decode part runs")
    ap.add_argument("--tune-budget-s", type=float, default=150)
    ap.add_argument("--tune-block-n", default="", help="tune part: BLOCK_N values (default 16,32,64)")
    ap.add_argument("--tune-block-k", default="", help="tune part: BLOCK_K values (default 128,256,512 dense, "
                    "256,512,1024 int8 / fp8, 64,128 int4; int4 keeps those that divide --int4-group-size or are "
                    "multiples of it: K tiles of whole groups)")
    ap.add_argument("--tune-warps", default="", help="tune part: num_warps values (default 4,8)")
    ap.add_argument("--tune-stages", default="", help="tune part: num_stages values (default 2,4)")
    ap.add_argument("--tune-cvt-bits", default="", help="tune part: CVT_BITS values, e.g. 0,1 (default: the format's "
                    "own; int4 reads it in K tiles of whole groups only)")
    ap.add_argument("--tune-half2", default="", help="tune part: int4's HALF2 values (packed fp16 words), e.g. 0,1,2 "
                    "(default: the rule's)")
    ap.add_argument("--tune-splits", default="", help="tune part: SPLIT_K values (default 1 and gemv_config's)")
    ap.add_argument("--decode-extra", default="", help="more gpu_quant formats to decode beside none and the triton "
                    "ones, comma-separated (e.g. int4 = tinygemm, fp8 = _scaled_mm)")
    # int8g (GGUF Q8_0) has no module here: scripts/gpu_gguf.py --parts tiles times it
    ap.add_argument("--formats", default=",".join(f for f in GEMV_FORMATS if f != "int8g"))
    ap.add_argument("--ms", default="1,4,9", help="activation rows M")
    ap.add_argument("--int4-group-size", type=int, default=128)
    ap.add_argument("--kernel-tuning", default="", help="the KernelTuning every module runs with, field=value,... "
                    "(kernels/tuning.py, e.g. int4_half2=1 or int4_cuda=0; empty: the defaults)")
    ap.add_argument("--half2-compare", action="store_true", help="speed part: one-row int4 triton calls timed "
                    "with int4_half2 0, 1 and 2 (kernels 'triton+h2=0', 'triton+h2=1', 'triton+h2=2')")
    ap.add_argument("--rows-ms", default="5", help="rows part: activation rows M (verify widths)")
    ap.add_argument("--prefill-ms", default="64,512", help="prefill part: activation rows M (prompt tokens)")
    ap.add_argument("--read-blocks", default="256,512,1024,2048", help="read part: stream_read block (words)")
    ap.add_argument("--read-iters", default="1,2,4,8", help="read part: stream_read blocks per program")
    ap.add_argument("--read-warps", default="4,8", help="read part: stream_read num_warps values")
    ap.add_argument("--mma-ms", default="1,5,16", help="mma part: activation rows M (1..16)")
    ap.add_argument("--mma-block-n", default="64,128,256", help="mma part: int4_mma BLOCK_N values")
    ap.add_argument("--mma-warps", default="4,8", help="mma part: int4_mma num_warps values")
    ap.add_argument("--mma-stages", default="2,3,4", help="mma part: int4_mma num_stages values")
    ap.add_argument("--mma-per-sm", default="1,2,4", help="mma part: programs per SM the split aims at")
    ap.add_argument("--cuda-rows-per-warp", default="2,4", help="cuda part: int4_cuda ROWS (rows per warp) values")
    ap.add_argument("--cuda-unroll", default="2,4", help="cuda part: int4_cuda UNROLL (16-byte chunks per lane per "
                    "row per step) values")
    ap.add_argument("--cuda-warps", default="4,8", help="cuda part: int4_cuda WARPS (warps per block) values")
    ap.add_argument("--cuda-wps", default="4", help="cuda part: int4_cuda WORDS_PER_SUM values (words per fp16 sum)")
    ap.add_argument("--cuda-pipe", default="0", help="cuda part: int4_cuda PIPE values (1: the next step's loads "
                    "issued before this step's math)")
    ap.add_argument("--cuda-minb", default="0", help="cuda part: int4_cuda MINB values (blocks per SM the compiler "
                    "must fit: __launch_bounds__'s second argument; 0: none given)")
    ap.add_argument("--cuda-tiles", default="", help="cuda part: tiles as labels separated by ';' (e.g. 'r8 u1 w4 s4;"
                    "r2 u2 w8 s4 pipe') instead of the --cuda-* grid")
    ap.add_argument("--cuda-model-fusion", action="store_true", help="cuda part: time the Triton and CUDA rows with "
                    "each linear's fusion as the model calls it (MODEL_FUSION: q/k/v and gate/up the RMSNorm "
                    "prologue, o the residual, down SwiGLU + residual), so the best tile is the best fused one")
    ap.add_argument("--cuda-pdl", default="1", help="cuda part: launch with PDL (1), without (0), or both (0,1)")
    ap.add_argument("--rows-block-n", default="32,64,128", help="rows part: multi-row int4 tile BLOCK_N values")
    ap.add_argument("--rows-block-k", default="256,512", help="rows part: multi-row int4 tile BLOCK_K values")
    ap.add_argument("--rows-warps", default="4,8", help="rows part: multi-row int4 tile num_warps values")
    ap.add_argument("--int4-wide-rows-compare", action="store_true", help="speed part: int4 triton calls of M > 1 "
                    "timed in the default form (K tiles of whole groups on the tensor cores, kernel suffix '+i4r') "
                    "and once more with one group per K tile (no suffix); runs with int4_mma_rows=0, so those calls "
                    "stay in that kernel")
    ap.add_argument("--parity-rtol", type=float, default=2 ** -7, help="max |err| / max |ref| that counts as ok")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    args.dtype = torch.bfloat16
    args.tuning = parse_tuning(args.kernel_tuning)
    if args.int4_wide_rows_compare:  # the two multi-row forms themselves, not int4_mma's verify widths
        args.tuning = dataclasses.replace(args.tuning, int4_mma_rows=0)
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "kernel_tuning": format_tuning(args.tuning)}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    run_parts(PARTS, args.parts, args, device, env, out, "gemv", table)


if __name__ == "__main__":
    main()
