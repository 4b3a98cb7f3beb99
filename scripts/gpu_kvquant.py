"""KV-cache formats on the GPU: the Triton kernel's parity with quantized KV, and AR decode ms/token per format.

    python scripts/gpu_kvquant.py --device cuda --out $OUT       # one H200: about 1-2 minutes
    python scripts/gpu_kvquant.py --device cpu --out /tmp/kvq --config tiny --context 48 --max-new-tokens 6 \
        --batches 1,2 --repeats 1                                # CPU smoke test (kernel part skipped)

kernel : for a few shapes (GQA 32/4 at head dim 64, MHA 32/32 at 128; decode T = 1, a 9-token tree, long contexts)
         and each format, the kernel with bf16 queries over the format's pool against the reference that dequantizes
         in float32 (`err_fp32`, `ok` within TOLERANCE), the attention change the format itself makes against the
         unquantized pool (`format_err`, information only), and microseconds per call replayed from a CUDA graph
         with the achieved GB/s over the bytes the kernel must read (values + scales).
decode : a random-weight Llama (1.45 B: 22 x 2048, GQA 32/4, bf16; random weights, so only costs mean anything),
         AR with CUDA graphs and attention "auto" (the Triton kernel on a paged cache), prompts of --context tokens,
         batch 1 and 16: decode ms per step per format, tokens/s, the KV bytes per token and cache size, and the
         fraction of the HBM floor of that format's bytes (weights + the KV the step reads, at 4.3 TB/s).
Writes <out>/results.json (every row, the environment, the arguments) and <out>/table.md (the same as tables).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.paged_attention import TRITON_AVAILABLE, paged_attention_reference  # noqa: E402
from workbench.engine import EngineConfig, SpecEngine  # noqa: E402
from workbench.engine.kv_quant import KV_FORMATS  # noqa: E402
from workbench.engine.tree import DraftTree, verify_mask  # noqa: E402
from scripts.gpu_timing import graph_us  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
TOLERANCE = 2e-2  # bf16 queries against the float32 reference of the same (dequantized) pool: a few bf16 ulps
CALLS_PER_GRAPH = 8
BLOCK_SIZE = 16
FORMATS = tuple(KV_FORMATS)  # none, int8, fp8
KERNEL_SHAPES = [  # (model, batch, T, context): model -> (Hq, Hkv, D)
    ("gqa32/4_d64", 1, 1, 4096), ("gqa32/4_d64", 16, 1, 4096), ("gqa32/4_d64", 8, 9, 1024),
    ("mha32_d128", 1, 1, 4096), ("mha32_d128", 4, 9, 1024)]
MODELS = {"gqa32/4_d64": (32, 4, 64), "mha32_d128": (32, 32, 128)}
CONFIGS = {"1.45b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=22, num_attention_heads=32,
                         num_key_value_heads=4),
           "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2)}  # CPU smoke test only
KERNEL_COLS = ["model", "batch", "T", "context", "kv_quant", "ok", "err_fp32", "format_err", "graph_us", "gbps",
               "error"]
DECODE_COLS = ["config", "kv_quant", "batch", "context", "attention", "ms_per_step", "tokens_per_s",
               "kv_bytes_per_token", "kv_cache_mb", "floor_ms", "fraction_of_floor", "error"]


# ---- kernel parity and speed -------------------------------------------------------------------------------------
def kernel_inputs(batch, hq, hkv, dim, t, context, device, seed=0) -> dict:
    """bf16 queries and a float32 pool (quantized per format below), shuffled blocks, ragged rows, a tree at T = 9."""
    gen = torch.Generator(device).manual_seed(seed)
    max_blocks = math.ceil((context + t) / BLOCK_SIZE)
    num_blocks = batch * max_blocks
    base_len = context - torch.randint(0, BLOCK_SIZE, (batch,), generator=gen, device=device)
    base_len[0] = context
    intra = None
    if t > 1:
        g = torch.Generator().manual_seed(seed)
        parents = torch.stack([torch.randint(-1, i, (batch,), generator=g) if i else torch.full((batch,), -1)
                               for i in range(t - 1)], 1)
        intra = verify_mask(DraftTree(torch.zeros_like(parents), parents, torch.ones_like(parents),
                                      torch.ones_like(parents).bool())).to(device)  # [B, T, T]
    return dict(q=torch.randn(batch, hq, t, dim, generator=gen, device=device).bfloat16(),
                pools=[torch.randn(num_blocks * BLOCK_SIZE, hkv, dim, generator=gen, device=device) for _ in "kv"],
                block_table=torch.randperm(num_blocks, generator=gen, device=device).view(batch, max_blocks),
                rows=torch.randperm(batch, generator=gen, device=device), base_len=base_len, intra_mask=intra)


def format_args(inputs: dict, name: str) -> dict:
    """The kernel's arguments for one format: the pool as the cache stores it (bf16 for none) and its scales."""
    fmt = KV_FORMATS[name]
    common = {k: inputs[k] for k in ("q", "block_table", "rows", "base_len", "intra_mask")}
    if not fmt.quantized:
        return dict(common, k_pool=inputs["pools"][0].bfloat16(), v_pool=inputs["pools"][1].bfloat16())
    (k, ks), (v, vs) = (fmt.quantize(x) for x in inputs["pools"])
    return dict(common, k_pool=fmt.kernel_view(k), v_pool=fmt.kernel_view(v), k_scales=ks, v_scales=vs)


def upcast(kw: dict) -> dict:
    """The float32 reference's arguments: float32 queries; bf16 pools widened (quantized ones are dequantized in
    float32 by the reference itself)."""
    return {k: v.float() if k == "q" or (k in ("k_pool", "v_pool") and v.dtype == torch.bfloat16) else v
            for k, v in kw.items()}


def part_kernel(args) -> list[dict]:
    if args.device == "cpu" or not TRITON_AVAILABLE:
        why = "no CUDA device asked for" if args.device == "cpu" else "triton is not installed"
        return [{"kv_quant": "all", "error": f"skipped: {why} (the interpreter runs these in tests/test_kernels.py)"}]
    from kernels.paged_attention import paged_attention_triton

    rows = []
    for model, batch, t, context in KERNEL_SHAPES:
        hq, hkv, dim = MODELS[model]
        inputs = kernel_inputs(batch, hq, hkv, dim, t, context, args.device)
        exact = paged_attention_reference(inputs["q"].float(), *inputs["pools"], inputs["block_table"],
                                          inputs["rows"], inputs["base_len"], inputs["intra_mask"], BLOCK_SIZE)
        for name in FORMATS:
            rec = {"model": model, "batch": batch, "T": t, "context": context, "kv_quant": name}
            try:
                kw = format_args(inputs, name)
                got = paged_attention_triton(**kw, block_size=BLOCK_SIZE).float()
                want = paged_attention_reference(**upcast(kw), block_size=BLOCK_SIZE)
                rec["err_fp32"] = (got - want).abs().max().item()
                rec["format_err"] = (want - exact).abs().max().item()
                rec["ok"] = rec["err_fp32"] <= TOLERANCE
                rec["graph_us"] = graph_us(lambda: paged_attention_triton(**kw, block_size=BLOCK_SIZE),  # noqa: B023
                                            CALLS_PER_GRAPH)
                per_slot = dim * kw["k_pool"].element_size() + (4 if KV_FORMATS[name].quantized else 0)
                read = 2 * (inputs["base_len"] + t).sum().item() * hkv * per_slot
                rec["gbps"] = read / (rec["graph_us"] * 1e-6) / 1e9
            except Exception as e:  # noqa: BLE001 - one failing shape must not hide the others
                rec["error"] = f"{type(e).__name__}: {e}"[:400]
            rows.append(rec)
            print(rec, flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows


# ---- AR decode per format ----------------------------------------------------------------------------------------
def part_decode(args) -> list[dict]:
    from workbench.models import LlamaModel, ModelConfig

    dev = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.context + args.max_new_tokens + 8
    cfg = ModelConfig(vocab_size=32000, max_position_embeddings=1 << max(12, (max_len - 1).bit_length()),
                      **CONFIGS[args.config])
    with torch.device(dev):
        model = LlamaModel(cfg, init_weights=False).to(torch.bfloat16)
    model.reset_parameters()
    model.eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, cfg.vocab_size, (max(batches), args.context), generator=gen).tolist()
    rows = []
    for batch in batches:
        for name in FORMATS:
            rec = {"config": args.config, "params": sum(p.numel() for p in model.parameters()), "kv_quant": name,
                   "batch": batch, "context": args.context, "max_new_tokens": args.max_new_tokens}
            try:
                engine = SpecEngine(model, None, EngineConfig(
                    max_new_tokens=args.max_new_tokens, cuda_graphs=True, graph_batch_sizes=tuple(sorted(batches)),
                    attention=args.attention, kv_quant=name), dev)
                batch_prompts = prompts[:batch]
                engine.reserve(batch, args.context)
                engine.generate(batch_prompts)  # warm-up: allocates, compiles the kernel
                engine.capture_graphs(batch)
                rec["attention"] = "triton" if engine.cache.kernel is not None else "sdpa"
                ms = []
                for _ in range(args.repeats):
                    res = engine.generate(batch_prompts)
                    decode_s = max(res.t_done) - res.t_first_token  # decode steps only (prefill excluded)
                    ms.append(decode_s * 1e3 / (args.max_new_tokens - 1))
                rec["ms_per_step"] = statistics.median(ms)
                rec["ms_min"], rec["ms_max"] = min(ms), max(ms)
                rec["tokens_per_s"] = batch * 1e3 / rec["ms_per_step"]
                rec["kv_bytes_per_token"] = engine.cache.bytes_per_token
                rec["kv_cache_mb"] = engine.cache.nbytes / 2**20
                kv_read = batch * (args.context + args.max_new_tokens / 2) * engine.cache.bytes_per_token
                rec["floor_ms"] = (weight_bytes + kv_read) / HBM_BYTES_PER_S * 1e3
                rec["fraction_of_floor"] = rec["floor_ms"] / rec["ms_per_step"]
                rec["graph_misses"] = res.graph_stats.misses if res.graph_stats else None
            except Exception as e:  # noqa: BLE001 - record it, keep measuring the other settings
                rec["error"] = f"{type(e).__name__}: {e}"[:400]
            rows.append(rec)
            print(rec, flush=True)
            engine = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ---- output ------------------------------------------------------------------------------------------------------
def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def table(rows: list[dict], cols: list[str]) -> str:
    cols = [c for c in cols if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (smoke test: kernel part skipped)")
    ap.add_argument("--out", required=True, help="folder for results.json and table.md")
    ap.add_argument("--parts", default="kernel,decode")
    ap.add_argument("--config", default="1.45b", choices=tuple(CONFIGS))
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens per sequence")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attention", default="auto", choices=("auto", "sdpa", "triton"))
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda asked for, but no CUDA GPU is visible; use --device cpu for the smoke test")
    if args.max_new_tokens < 2:
        ap.error("--max-new-tokens must be >= 2 (decode time is measured after the first token)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = {"args": vars(args), "env": {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "triton": _triton_version()}, "tolerance": TOLERANCE}
    for part in args.parts.split(","):
        t_part = time.perf_counter()
        try:
            results[part] = globals()[f"part_{part}"](args)
        except Exception as e:  # noqa: BLE001 - one failing part must not lose the other
            import traceback
            traceback.print_exc()
            results[part] = [{"error": f"{type(e).__name__}: {e}"[:400]}]
        results[f"{part}_s"] = time.perf_counter() - t_part
    results["wall_s"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = [f"# KV-cache formats ({results['env']['device']}, torch {results['env']['torch']}, "
          f"triton {results['env']['triton']}; {results['wall_s']:.0f} s)"]
    if "kernel" in results:
        md += ["", f"## Triton kernel vs the float32 dequantized reference (bf16 queries; ok: err <= {TOLERANCE})", "",
               table(results["kernel"], KERNEL_COLS)]
    if "decode" in results:
        md += ["", f"## AR decode, random-weight {args.config}, CUDA graphs, context {args.context} "
               f"(floor: weights + KV bytes read per step at {HBM_BYTES_PER_S / 1e12:.1f} TB/s)", "",
               table(results["decode"], DECODE_COLS)]
    (out / "table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    failed = [r for r in results.get("kernel", []) if "ok" in r and not r["ok"]]
    errors = [r for part in ("kernel", "decode") for r in results.get(part, [])
              if r.get("error") and not r["error"].startswith("skipped")]
    return 1 if failed or errors else 0


def _triton_version() -> str | None:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
