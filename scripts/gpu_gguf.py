"""Weight format "gguf" on one GPU: a GGUF file's own Q4_1 / Q8_0 blocks kept packed, against its dequantized model.

    python scripts/gpu_gguf.py --device cuda --out DIR [--configs smollm,smollm-q8] [--gguf FILE.gguf]
    python scripts/gpu_gguf.py --device cuda --out DIR --configs 1.45b      # a second run: ~1 min writing its file

The GPU machine downloads nothing, so by default each config is a random-weight Llama written here as a GGUF whose
decoder linears are Q4_1 (a name ending in "-q8": Q8_0) (the gguf package's own quantizer; token embedding Q8_0, as
in SmolLM2's file), then loaded with load_model in bf16. `--gguf FILE` adds a real file (e.g.
SmolLM2-135M-Instruct.Q4_1.gguf) as one more config.

exact : per config, every decoder linear of quantize_model(model, "gguf") on the GPU: kept packed or not (and the
        note), its float32 dequantized weight cast to bf16 == the loaded bf16 model's weight (bit for bit), and the
        Triton GEMV with the file's scales (quant_gemv_triton: format int4 for Q4_x with float32 scale and zero,
        int8g for Q8_0 with its float16 d; M = 1 and 4)
        against its fp32 reference (quant_gemv_reference) and against the bf16 model's matmul: max abs / relative
        error.
decode: AR at batch 1 on the captured path (CUDA graphs, Triton paged attention) per format: none (the dequantized
        bf16 model), gguf-triton (the file's scales, quant_kernel auto = triton), gguf-dequant, int4 (aten tinygemm,
        group 32, bf16 scales: the file re-quantized, NOT the file's weights), int4-triton (group 32, bf16 scales),
        int8 (per-channel int8, quant_kernel auto: the Triton int8 GEMV on a GPU; re-quantized, NOT the file's):
        ms/token (median, min, max), weight MB as stored, the fraction of the HBM floor of that format's bytes, the
        speedup over none, and the greedy tokens' agreement with none's (gguf decodes with a different summation order
        than cuBLAS: bf16 near-ties may flip; prefill (> 16 rows) takes the dequant path, bit-equal to none).
tiles : the int8g GEMV (GGUF Q8_0's layout, no file needed: random int8 + float16 scales per 32) at M = 1 on
        --tile-config's decoder shapes, CUDA-graph replays over rotating weight copies (> L2): gemv_config's
        (group-tiled) tiles against a few BLOCK_N / num_warps / SPLIT_K choices, beside int8 (per channel) and int4
        (group 32) at their own configs and the bf16 cuBLAS matmul: us per call and GB/s of the bytes each reads.
Writes gguf_<part>.json and gguf_<part>.md into --out; one failing row or part is recorded, not fatal.
CPU smoke test: --device cpu --configs mini,mini-q8 --max-new-tokens 8 --repeats 1 (the Triton rows then record why
not).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_timing import equal_prefix, floor_row, run_parts, sync  # noqa: E402
from workbench.engine import EngineConfig, SpecEngine  # noqa: E402
from workbench.engine.quant import check_quant, gguf_kernel, quantize_model, weight_bytes  # noqa: E402
from workbench.engine.quant.gguf import FUSED_PARTS, GgufInt4Linear, GgufInt8Linear  # noqa: E402

CONFIGS = {  # vocab, hidden, intermediate, layers, heads, kv heads
    "mini": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),  # CPU smoke test only
    "smollm": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),  # SmolLM2-135M's shapes
    "1.45b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=4),  # gpu_fastpath.py's 1.45 B
}
FORMATS = {"none": ("none", "auto"), "gguf-triton": ("gguf", "auto"), "gguf-dequant": ("gguf", "dequant"),
           "int4": ("int4", "aten"), "int4-triton": ("int4", "triton"), "int8": ("int8", "auto")}
_FILES: dict[str, Path] = {}  # config -> written GGUF (kept for both parts)
_MODELS: dict[str, tuple] = {}  # config -> (bf16 model loaded from it, load seconds): loaded once for both parts


def gguf_file(name: str, args) -> Path:
    """The config's GGUF: --gguf for "file", else a random-weight model written once (Q4_1 linears; Q8_0 for a name
    ending in "-q8", e.g. "smollm-q8")."""
    if name == "file":
        return Path(args.gguf)
    if name not in _FILES:
        sys.path.insert(0, str(ROOT))
        from tests.gguf_files import Q, write_gguf
        from workbench.models import LlamaModel, ModelConfig

        base = name.removesuffix("-q8")
        kind = Q.Q8_0 if name.endswith("-q8") else Q.Q4_1
        cfg = ModelConfig(max_position_embeddings=4096, **CONFIGS[base])
        t0 = time.perf_counter()
        torch.manual_seed(0)
        model = LlamaModel(cfg, init_weights=False)
        model.reset_parameters()
        path = Path(args.tmp) / f"{base}.{kind.name}.gguf"
        write_gguf(path, model.eval(), "llama", lambda i, part: kind, embedding=Q.Q8_0)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s", flush=True)
        _FILES[name] = path
    return _FILES[name]


def load(name: str, args, device: torch.device):
    """(the config's GGUF loaded by load_model in bf16 on the device, seconds load_model took), once per config."""
    from workbench.models import load_model

    if name not in _MODELS:
        path = gguf_file(name, args)
        t0 = time.perf_counter()
        model = load_model(path, dtype=torch.bfloat16, device=device).eval()
        sync(device)
        _MODELS[name] = model, time.perf_counter() - t0
    return _MODELS[name]


def _configs(args) -> list[str]:
    return args.configs.split(",") + (["file"] if args.gguf else [])


def part_exact(args, device: torch.device) -> list[dict]:
    from kernels.quant_gemv import quant_gemv_reference, quant_gemv_triton, triton_problem

    rows = []
    for name in _configs(args):
        row: dict = {"config": name}
        try:
            model, row["load_s"] = load(name, args, device)
            t0 = time.perf_counter()
            packed = quantize_model(model, "gguf", kernel="dequant")
            sync(device)
            row["pack_s"] = time.perf_counter() - t0
            row["note"] = packed.gguf_packing.note()
            equal = kept = 0
            worst = {}
            problem = triton_problem(device)
            for i, layer in enumerate(packed.model.layers):
                for fused in FUSED_PARTS:
                    parent, attr = fused.split(".")
                    mod = getattr(getattr(layer, parent), attr)
                    ref = getattr(getattr(model.model.layers[i], parent), attr)
                    if not isinstance(mod, (GgufInt4Linear, GgufInt8Linear)):
                        continue
                    kept += 1
                    equal += bool(torch.equal(mod.dequantized_weight().to(torch.bfloat16), ref.weight))
                    if problem is None and i == 0:  # the Triton GEMV on layer 0's four shapes
                        fmt, buffers = mod._gemv_args()  # ("int4", q/scale/zero/32) or ("int8g", q/scale/32)
                        for m in (1, 4):
                            x = torch.randn(m, mod.in_features, device=device, dtype=torch.bfloat16)
                            y = quant_gemv_triton(x, fmt, **buffers).float()
                            y_ref = quant_gemv_reference(x, fmt, **buffers).float()
                            y_bf16 = (x @ ref.weight.T).float()
                            scale = y_ref.abs().max().item()
                            worst[f"{fmt} {attr} M={m}"] = {"max_abs_vs_ref": (y - y_ref).abs().max().item(),
                                                      "rel_vs_ref": (y - y_ref).abs().max().item() / scale,
                                                      "rel_vs_bf16_matmul": (y - y_bf16).abs().max().item() / scale}
            row.update(linears_kept=kept, weights_equal_bf16=equal, all_equal=equal == kept,
                       triton=problem or worst)
            del packed
        except Exception as e:  # noqa: BLE001 - record it, keep the other configs
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def part_decode(args, device: torch.device) -> list[dict]:
    rows = []
    for name in _configs(args):
        try:
            base, load_s = load(name, args, device)
        except Exception as e:  # noqa: BLE001
            rows.append({"config": name, "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        cfg = base.config
        prompts = [list(range(100, 100 + args.prompt_len))]
        outputs: dict[str, list[int]] = {}
        for fmt_name in args.formats.split(","):
            fmt, kernel = FORMATS[fmt_name]
            row = {"config": name, "format": fmt_name, "load_s": load_s,
                   "kernel": gguf_kernel(kernel, device) if fmt == "gguf" else kernel}
            try:
                check_quant(fmt, cfg, device, torch.bfloat16, 32, kernel=kernel, source=base.source_path)
                t0 = time.perf_counter()
                model = quantize_model(base, fmt, group_size=32, kernel=kernel)
                sync(device)
                row["quantize_s"] = time.perf_counter() - t0
                graphs = device.type == "cuda"
                engine = SpecEngine(model, None, EngineConfig(max_new_tokens=args.max_new_tokens, cuda_graphs=graphs),
                                    device)
                engine.reserve(1, len(prompts[0]))
                engine.generate(prompts)
                if graphs:
                    engine.capture_graphs(1)
                ms = []
                for _ in range(args.repeats):
                    res = engine.generate(prompts)
                    sync(device)
                    ms.append((res.t_done[0] - res.t_first_token) * 1e3 / (len(res.outputs[0]) - 1))
                outputs[fmt_name] = res.outputs[0]
                row.update(weight_mb=weight_bytes(model) / 2**20,
                           **floor_row(model, ms, args.prompt_len, args.max_new_tokens))
                if "none" in outputs:
                    ref = outputs["none"]
                    row.update(tokens_equal_to_none_until=equal_prefix(ref, res.outputs[0]), tokens=len(ref))
                del engine, model
            except Exception as e:  # noqa: BLE001 - record it, keep measuring the other formats
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        ref = next((r for r in rows if r["config"] == name and r.get("format") == "none" and "error" not in r), None)
        for r in rows:
            if ref and r["config"] == name and "error" not in r and "ms_per_token_median" in r:
                r["speedup_vs_none"] = ref["ms_per_token_median"] / r["ms_per_token_median"]
        del base
        _MODELS.pop(name, None)  # the decode part is the last user
    return rows


def part_tiles(args, device: torch.device) -> list[dict]:
    """int8g GEMV tiles at M = 1 on --tile-config's shapes (random buffers, no file), against int8 / int4 / bf16."""
    import itertools
    import math

    import torch.nn.functional as F

    from kernels.quant_gemv import counters_for, gemv_config, quant_gemv_triton, triton_problem
    from workbench.engine.quant import linear_shapes
    from workbench.models import ModelConfig

    problem = triton_problem(device)
    if problem:
        return [{"config": args.tile_config, "error": problem}]
    from gpu_timing import graph_us

    cfg = ModelConfig(max_position_embeddings=4096, **CONFIGS[args.tile_config.removesuffix("-q8")])
    sm = torch.cuda.get_device_properties(device).multi_processor_count
    g, rows = 32, []
    for name, (k, n) in linear_shapes(cfg).items():
        copies = max(2, math.ceil(args.tile_mb * 1e6 / (n * k)))  # rotating copies > L2: weights come from HBM
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        counters = counters_for(n, device)
        rand_scale = lambda cols: torch.rand(n, cols, device=device) / 64 + 1e-3  # noqa: E731
        kinds = {  # name -> (format, buffers per copy, bytes one call reads)
            "int8g": ("int8g", [dict(weight=torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device),
                                     scale=rand_scale(k // g).half(), group_size=g) for _ in range(copies)],
                      n * k + 2 * n * k // g),  # the module's layout: int8 + the fp16 d per 32
            "int8": ("int8", [dict(weight=torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device),
                                   scale=rand_scale(1)[:, 0].bfloat16()) for _ in range(copies)], n * k + 2 * n),
            "int4-gguf": ("int4", [dict(weight=torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device),
                                        scale=rand_scale(k // g), zero=rand_scale(k // g), group_size=g)
                                   for _ in range(copies)], n * k // 2 + 8 * n * k // g),
        }
        # auto = gemv_config's group-tiled form (one group per K tile); K tiles spanning groups (each weight times its
        # group's scale, gathered per lane) measured 3-6x slower on the H200 and were removed
        auto = gemv_config("int8g", 1, n, k, g, sm)
        variants = [("auto", {})] + [(f"BN{bn} w{w}", dict(BLOCK_N=bn, num_warps=w)) for bn in (32, 64, 128)
                                     for w in (4, 8)]
        variants += [(f"BN{auto['BLOCK_N']} split{sk}", dict(SPLIT_K=sk)) for sk in (1, 2 * auto["SPLIT_K"])]
        runs = [("int8g", label, over) for label, over in variants] + [("int8", "auto", {}), ("int4-gguf", "auto", {})]
        for kind, label, over in runs:
            fmt, bufs, nbytes = kinds[kind]
            row = dict(config=args.tile_config, linear=name, K=k, N=n, format=kind, tiles=label)
            try:
                it = itertools.cycle(bufs)
                cfg_used = gemv_config(fmt, 1, n, k, bufs[0].get("group_size"), sm, **over)
                row.update({key: cfg_used[key] for key in ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps")})
                us = graph_us(lambda: quant_gemv_triton(x, fmt, **next(it), counters=counters, **over), copies)
                row.update(us=us, gb_per_s=nbytes / us / 1e3)
            except Exception as e:  # noqa: BLE001 - record it, keep the other tiles
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
        it = itertools.cycle(ws)
        us = graph_us(lambda: F.linear(x, next(it)), len(ws))
        rows.append(dict(config=args.tile_config, linear=name, K=k, N=n, format="bf16", tiles="cuBLAS", us=us,
                         gb_per_s=2 * n * k / us / 1e3))
        for r in rows[-len(runs) - 1:]:
            print(json.dumps(r), flush=True)
        del kinds, ws
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(dict.fromkeys(k for r in rows for k in r if k != "triton" and k != "note"))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
             *["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]]
    for r in rows:  # the long fields below the table
        for key in ("note", "triton"):
            if key in r:
                lines.append(f"\n{r['config']} {key}: {json.dumps(r[key], default=str)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="exact,decode,tiles")
    ap.add_argument("--configs", default="smollm,smollm-q8",
                    help=f"random-weight configs: {', '.join(CONFIGS)}; a '-q8' suffix writes Q8_0 linears "
                         "(else Q4_1)")
    ap.add_argument("--tile-config", default="1.45b", help="the shapes of part tiles (no file is written)")
    ap.add_argument("--tile-mb", type=float, default=256, help="part tiles rotates int8 weight copies of this size "
                                                                "(MB; the H200's L2 is 50 MB)")
    ap.add_argument("--gguf", default=None, help="also measure this .gguf file (config 'file')")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    with tempfile.TemporaryDirectory() as tmp:  # the written GGUFs stay out of --out (they are large)
        args.tmp = tmp
        run_parts({"exact": part_exact, "decode": part_decode, "tiles": part_tiles}, args.parts, args, device, env,
                  out, "gguf", table)


if __name__ == "__main__":
    main()
