"""Weight format "gguf" on one GPU: a GGUF file's own Q4_1 blocks kept packed, against its dequantized bf16 model.

    python scripts/gpu_gguf.py --device cuda --out DIR [--configs smollm] [--gguf FILE.gguf]
    python scripts/gpu_gguf.py --device cuda --out DIR --configs 1.45b      # a second run: ~1 min writing its file

The GPU machine downloads nothing, so by default each config is a random-weight Llama written here as a GGUF whose
decoder linears are Q4_1 (the gguf package's own quantizer; token embedding Q8_0, as in SmolLM2's file), then loaded
with load_model in bf16. `--gguf FILE` adds a real file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf) as one more config.

exact : per config, every decoder linear of quantize_model(model, "gguf") on the GPU: kept packed or not (and the
        note), its float32 dequantized weight cast to bf16 == the loaded bf16 model's weight (bit for bit), and the
        Triton GEMV with float32 scales (quant_gemv_triton, M = 1 and 4) against its fp32 reference
        (quant_gemv_reference) and against the bf16 model's matmul: max abs / relative error.
decode: AR at batch 1 on the captured path (CUDA graphs, Triton paged attention) per format: none (the dequantized
        bf16 model), gguf-triton (float32 scales, quant_kernel auto = triton), gguf-dequant, int4 (aten tinygemm,
        group 32, bf16 scales: the file re-quantized, NOT the file's weights), int4-triton (group 32, bf16 scales):
        ms/token (median, min, max), weight MB as stored, the fraction of the HBM floor of that format's bytes, the
        speedup over none, and the greedy tokens' agreement with none's (gguf decodes with a different summation order
        than cuBLAS: bf16 near-ties may flip; prefill (> 16 rows) takes the dequant path, bit-equal to none).
Writes gguf_<part>.json and gguf_<part>.md into --out; one failing row or part is recorded, not fatal.
CPU smoke test: --device cpu --configs mini --max-new-tokens 8 --repeats 1 (the Triton rows then record why not).
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
from workbench.engine.quant.gguf import FUSED_PARTS, GgufInt4Linear  # noqa: E402

CONFIGS = {  # vocab, hidden, intermediate, layers, heads, kv heads
    "mini": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),  # CPU smoke test only
    "smollm": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),  # SmolLM2-135M's shapes
    "1.45b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=4),  # gpu_fastpath.py's 1.45 B
}
FORMATS = {"none": ("none", "auto"), "gguf-triton": ("gguf", "auto"), "gguf-dequant": ("gguf", "dequant"),
           "int4": ("int4", "aten"), "int4-triton": ("int4", "triton")}
_FILES: dict[str, Path] = {}  # config -> written GGUF (kept for both parts)
_MODELS: dict[str, tuple] = {}  # config -> (bf16 model loaded from it, load seconds): loaded once for both parts


def gguf_file(name: str, args) -> Path:
    """The config's GGUF: --gguf for "file", else a random-weight model written once (Q4_1 linears)."""
    if name == "file":
        return Path(args.gguf)
    if name not in _FILES:
        sys.path.insert(0, str(ROOT))
        from tests.gguf_files import Q, write_gguf
        from workbench.models import LlamaModel, ModelConfig

        cfg = ModelConfig(max_position_embeddings=4096, **CONFIGS[name])
        t0 = time.perf_counter()
        torch.manual_seed(0)
        model = LlamaModel(cfg, init_weights=False)
        model.reset_parameters()
        path = Path(args.tmp) / f"{name}.Q4_1.gguf"
        write_gguf(path, model.eval(), "llama", lambda i, part: Q.Q4_1, embedding=Q.Q8_0)
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
                    if not isinstance(mod, GgufInt4Linear):
                        continue
                    kept += 1
                    equal += bool(torch.equal(mod.dequantized_weight().to(torch.bfloat16), ref.weight))
                    if problem is None and i == 0:  # the Triton GEMV on layer 0's four shapes
                        for m in (1, 4):
                            x = torch.randn(m, mod.in_features, device=device, dtype=torch.bfloat16)
                            y = quant_gemv_triton(x, "int4", mod.weight, mod.scale, mod.zero, 32).float()
                            y_ref = quant_gemv_reference(x, "int4", mod.weight, mod.scale, mod.zero, 32).float()
                            y_bf16 = (x @ ref.weight.T).float()
                            scale = y_ref.abs().max().item()
                            worst[f"{attr} M={m}"] = {"max_abs_vs_ref": (y - y_ref).abs().max().item(),
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
    ap.add_argument("--parts", default="exact,decode")
    ap.add_argument("--configs", default="smollm", help=f"random-weight configs: {', '.join(CONFIGS)}")
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
        run_parts({"exact": part_exact, "decode": part_decode}, args.parts, args, device, env, out, "gguf", table)


if __name__ == "__main__":
    main()
