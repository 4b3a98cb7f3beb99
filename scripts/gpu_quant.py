"""Weight formats on one GPU: decode speed against each format's HBM floor, then a target x draft precision grid.

    python scripts/gpu_quant.py --device cuda --out DIR [--parts floor,grid] [--preset small]

floor : random-weight Llama 1.45 B (22 x 2048, GQA 32/4) and 6.7 B (32 x 4096, MHA), vocab 32000, bf16, AR at batch 1
        on the engine's captured path (CUDA graphs, Triton paged attention), per weight format: ms/token (median,
        min, max over repeats) and the fraction of the HBM floor of *that format's* bytes: (decoder weights as stored
        + LM head + KV read per token) / 4.3 TB/s (the embedding table is not read, only one row of it; gpu_fastpath.py
        counted the whole table, so its bf16 fractions are a little higher for the same time). Formats: none, int8
        (aten._weight_int8pack_mm), int8-dq (dequantize + matmul: what torch.compile can fuse; add --floor-modes
        graphs,graphs+compile to see it compiled), int4 (tinygemm _weight_int4pack_mm), int4-awq (same kernels, AWQ
        scales from random calibration tokens: the speed is the point here), fp8 (_scaled_mm, row-wise scales).
        --floor-ngram K decodes with the n-gram drafter instead (verifies of K + 1 rows in the model; on random weights
        it accepts nothing, so each step is one verify and ms/token its time).
grid  : a zoo preset (--preset; it must exist locally) in bf16, method draft k=4, batch 1, graphs on, through
        BenchSession.run: for each (target format, draft format): acceptance, tokens/s, speedup vs the AR of the same
        target format and vs bf16 AR, held-out perplexity delta, token agreement, acceptance change, greedy parity
        against the same quantized target's AR; each quantized cell once per --grid-quant-kernels entry (e.g.
        aten,triton: tinygemm against ours for int4).
Writes quant_<part>.json and quant_<part>.md (a table) into --out; one failing row or part is recorded, not fatal.
CPU smoke test: --device cpu --floor-configs mini --formats none,int8,int4 --preset tiny --int4-group-size 32 ...
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_fastpath import MODES, RANDOM_CONFIGS, warm  # noqa: E402
from gpu_timing import equal_prefix, floor_row, kernel_summary, run_parts, sync  # noqa: E402
from workbench.engine import EngineConfig, SpecEngine  # noqa: E402
from workbench.engine.drafters import make_drafter  # noqa: E402
from workbench.engine.quant import check_quant, norms_folded, quantize_model, set_fusion  # noqa: E402
from kernels.pdl import pdl_problem, set_pdl  # noqa: E402
from kernels.quant_gemv import set_m1_tiles  # noqa: E402
from kernels.tuning import format_tuning, parse_tuning  # noqa: E402
from workbench.engine.quant import apply_kernel_tuning  # noqa: E402

CONFIGS = {**RANDOM_CONFIGS, "mini": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)}  # CPU smoke test only
FORMAT_KERNELS = {"none": ("none", "auto"), "int8": ("int8", "aten"), "int8-dq": ("int8", "dequant"),
                  "int4": ("int4", "aten"), "int4-awq": ("int4-awq", "aten"), "fp8": ("fp8", "auto"),
                  # kernels/quant_gemv.py (quant_kernel "triton"; fp8 then weight-only): scripts/gpu_gemv.py
                  "int8-triton": ("int8", "triton"), "int4-triton": ("int4", "triton"), "fp8-triton": ("fp8", "triton"),
                  "dense-triton": ("none", "triton")}  # unquantized bf16 through the dense GEMV (not cuBLAS)
# a Triton format may end in a fusion suffix (linears.QuantLinear.fusion, set on every GEMV linear of the model):
# "+res" (the MLP's residual add in the down GEMV's epilogue; the engine's default), "+glu" (also SiLU-mul in its
# prologue), "+norm" (the RMSNorms in the q/k/v and gate/up prologues, the attention residual in o_proj's epilogue,
# and "+res"), "+all" (all of them): e.g. fp8-triton+all; without a suffix every linear is unfused here
FUSIONS = {"": "off", "res": "residual", "glu": "glu+residual", "norm": "norm+residual", "all": "norm+glu+residual",
           "glo": "glu+residual+ores"}  # glo: glu + o_proj's residual epilogue, the norms left to torch.compile
# and "+tc": this row's one-row GEMVs take the measured tiles of --m1-tiles (other rows keep gemv_config's table);
# "+pdl": this row's Triton kernels (GEMVs, K/V write, attention) are launched with programmatic dependent launch
# (kernels/pdl.py), and its greedy tokens are compared with the same row without "+pdl" (run that row first);
# "@MODE" at the very end runs the format in that floor mode only (e.g. none@graphs+max-autotune+overlap).
# Kernel variants a row compares are KernelTuning fields (kernels/tuning.py) on top of --kernel-tuning, recorded in the
# row's `kernel_tuning`: "+h2" / "+h2w" / "+h20": one-row int4 words in packed fp16 arithmetic with a scale per K tile /
# per word, or fp32 words, for every tile (int4_half2 1 / 2 / 0; without them each tile's own); "+pg": int4 prompts
# through the GEMV kernel's tensor-core form, no weight written (int4_prefill_gemm_rows); "+mma0": int4 verify widths
# stay in kernels/quant_gemv.py instead of kernels/int4_mma.py (int4_mma_rows 0); "+cu0": one-row int4 in the Triton
# GEMV instead of the CUDA C++ one (int4_cuda 0; "+cu" restates the default).
ROW_TUNING = {"pdl": {}, "h2": dict(int4_half2=1), "h2w": dict(int4_half2=2), "h20": dict(int4_half2=0),
              "pg": dict(int4_prefill_gemm_rows=1 << 20), "mma0": dict(int4_mma_rows=0),
              "cu": dict(int4_cuda=True), "cu0": dict(int4_cuda=False)}
PDL_SWITCHES = ("pdl",)  # the suffixes that launch the row with PDL
# "+qh": the LM head quantized too, in the row's format (quantize_model(head=True), the knob quant_head): a different
# model, so it stays in the row's plain name (its tokens are compared with rows of the same "+qh" only); the row
# records the head's error against its dequantized weight in fp32 (head_rel_err)


def parse_format(spec: str) -> tuple[str, str, bool, str | None, bool]:
    """"fp8-triton+all+tc+pdl@graphs+compile+overlap" -> ("fp8-triton", "norm+glu+residual", True,
    "graphs+compile+overlap", True): the FORMAT_KERNELS name, the fusion, whether measured tiles apply, the only mode,
    whether the row launches with PDL."""
    spec, _, only_mode = spec.partition("@")
    base, *parts = spec.split("+")
    tc, pdl = "tc" in parts, any(p in PDL_SWITCHES for p in parts)
    fusions = [p for p in parts if p not in ("tc", "qh") and p not in ROW_TUNING]
    if base not in FORMAT_KERNELS or len(fusions) > 1 or (fusions and fusions[0] not in FUSIONS):
        raise SystemExit(f"format {spec!r}: a name of {sorted(FORMAT_KERNELS)}, then at most one of "
                         f"{['+' + f for f in FUSIONS if f]}, '+tc', '+qh', then any of "
                         f"{['+' + t for t in ROW_TUNING]}, '@MODE'")
    return base, FUSIONS[fusions[0] if fusions else ""], tc, only_mode or None, pdl


def head_error(model, device: torch.device) -> float:
    """max |head(x) - x @ dequantized.T| / max |x @ dequantized.T| for one random row x (the one-row kernel: the
    CUDA GEMV on a GPU for int4), the reference in fp32."""
    x = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    with torch.no_grad():
        ref = x.float() @ model.lm_head.dequantized_weight().float().T
        got = model.compute_logits(x).float()
    return float((got - ref).abs().max() / ref.abs().max())


def glu_out_error(model, device: torch.device) -> float | None:
    """Layer 0's gate/up with its RMSNorm, one random row, through `swiglu_linear` (None when it does not apply):
    max |got - want| / max |want|, want = SwiGLU in fp32 of the fp32 reference's [gate | up] rounded to bf16."""
    from kernels.quant_gemv import quant_gemv_reference

    layer = model.model.layers[0]
    lin, norm = layer.mlp.gate_up_proj, layer.post_attention_layernorm
    x = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    with torch.no_grad():
        got = lin.swiglu_linear(x, norm.weight, norm.eps)
        if got is None:
            return None
        y = quant_gemv_reference(x, "int4", lin.weight, lin.scale, lin.zero, lin.group_size,
                                 norm_weight=norm.weight, eps=norm.eps).to(torch.bfloat16).float()
        gate, up = y.chunk(2, dim=-1)
        want = gate * torch.sigmoid(gate) * up
    return float((got.float() - want).abs().max() / want.abs().max())


def part_floor(args, device: torch.device) -> list[dict]:
    from workbench.models import LlamaModel, ModelConfig

    rows = []
    for name in args.floor_configs.split(","):
        cfg = ModelConfig(vocab_size=args.vocab, max_position_embeddings=4096, **CONFIGS[name])
        with device:
            base = LlamaModel(cfg, init_weights=False).to(torch.bfloat16)
        base.reset_parameters()
        base.eval()
        prompts = [list(range(100, 100 + args.prompt_len))]
        bf16_tokens: dict[str, list[int]] = {}
        row_tokens: dict[tuple[str, str], tuple[str, list[int]]] = {}  # (format without row switches, mode) ->
        # (the first such row's format, its greedy tokens)
        for fmt_spec in args.formats.split(","):
            base_name, fusion, tc, only_mode, pdl = parse_format(fmt_spec)
            fmt_name = fmt_spec.partition("@")[0]
            plain_name = "+".join(p for p in fmt_name.split("+") if p not in ROW_TUNING)  # the same model
            tuning = dataclasses.replace(args.tuning, **{field: v for p in fmt_name.split("+") if p in ROW_TUNING
                                                         for field, v in ROW_TUNING[p].items()})
            fmt, kernel = FORMAT_KERNELS[base_name]
            head = "qh" in fmt_name.split("+")
            for mode in [only_mode] if only_mode else args.floor_modes.split(","):
                row = {"config": name, "format": fmt_name, "mode": mode, "kernel_tuning": format_tuning(tuning)}
                # every row compiles afresh: the cache dynamo keeps across rows once pushed later rows past its
                # recompile limit, and they ran partly eager; frames compiled go in the row
                torch._dynamo.reset()
                counters.clear()
                try:
                    if tc and not getattr(args, "tiles", None):
                        raise ValueError("+tc needs --m1-tiles (a tiles file from scripts/gpu_gemv.py --parts tc)")
                    set_m1_tiles(args.tiles if tc else {})
                    if pdl and pdl_problem(device):
                        raise ValueError(f"+pdl: {pdl_problem(device)}")
                    set_pdl(pdl)  # read when the warm-up captures the step's graphs
                    check_quant(fmt, cfg, device, torch.bfloat16, args.int4_group_size, kernel=kernel, head=head)
                    t0 = time.perf_counter()
                    calib = torch.randint(0, args.vocab, (4, 128), generator=torch.Generator().manual_seed(0))
                    model = quantize_model(base, fmt, group_size=args.int4_group_size, kernel=kernel,
                                           calibration=calib if fmt == "int4-awq" else None, head=head)
                    set_fusion(model, fusion)  # what each GEMV linear fuses (linears.QuantLinear.fusion)
                    apply_kernel_tuning(model, tuning)  # (the engine sets it again; the checks below need it now)
                    sync(device)
                    row["quantize_s"] = time.perf_counter() - t0
                    row["norms_folded"] = norms_folded(model)
                    if head:
                        row["head_rel_err"] = head_error(model, device)
                    if fmt.startswith("int4"):
                        row["glu_out_rel_err"] = glu_out_error(model, device)
                    drafter = make_drafter("ngram", {"k": args.floor_ngram, "ngram_min": 1, "ngram_max": 3}) \
                        if args.floor_ngram else None
                    engine = SpecEngine(model, drafter, EngineConfig(max_new_tokens=args.max_new_tokens,
                                                                     **MODES[mode], pdl=pdl,
                                                                     kernel_tuning=format_tuning(tuning)), device)
                    warm(engine, prompts, 1)
                    ms, prefill_ms = [], []
                    for _ in range(args.repeats):
                        res = engine.generate(prompts)
                        sync(device)
                        ms.append((res.t_done[0] - res.t_first_token) * 1e3 / (len(res.outputs[0]) - 1))
                        prefill_ms.append((res.t_first_token - res.t_start) * 1e3)
                    row["prefill_ms_median"] = statistics.median(prefill_ms)
                    if drafter is not None:  # ms per emitted token then includes the drafts' verifies
                        acc = [a for st in res.steps for a in st.accepted]
                        row.update(ngram_k=args.floor_ngram, steps=len(res.steps),
                                   mean_accepted=sum(acc) / max(1, len(acc)))
                    tokens = res.outputs[0]
                    if (plain_name, mode) in row_tokens:  # the first row of the same model: launches moved, not
                        first, first_tokens = row_tokens[(plain_name, mode)]  # values
                        row["tokens_equal_to_plain_row"] = equal_prefix(tokens, first_tokens)
                        row["plain_row"] = first
                    else:
                        row_tokens[(plain_name, mode)] = (fmt_name, tokens)
                    if fmt_name == "none":
                        bf16_tokens[mode] = tokens
                    elif mode in bf16_tokens:  # greedy tokens equal to bf16's (same mode) before the first difference
                        row["tokens_equal_to_bf16"] = equal_prefix(tokens, bf16_tokens[mode])
                        row["tokens_compared"] = min(len(tokens), len(bf16_tokens[mode]))
                    row.update(floor_row(model, ms, args.prompt_len, args.max_new_tokens))
                    row["dynamo_frames"] = counters["frames"]["total"]
                    if args.profile:
                        row.update(kernel_profile(engine, prompts, args.profile_top))
                    del engine, model
                except Exception as e:  # noqa: BLE001 - record it, keep measuring the other formats
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                    traceback.print_exc()  # the whole story in the step's log (the row keeps 400 characters)
                set_pdl(False)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        by = {(r["config"], r["mode"]): r for r in rows if r["format"] == "none" and "error" not in r}
        for r in rows:  # tokens/s relative to bf16 of the same config and mode
            ref = by.get((r["config"], r["mode"]))
            if ref and "error" not in r:
                r["speedup_vs_bf16"] = ref["ms_per_token_median"] / r["ms_per_token_median"]
        del base
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def part_grid(args, device: torch.device) -> list[dict]:
    from workbench.harness.bench import BenchConfig, BenchSession

    session = BenchSession.load(preset=args.preset, device=str(device), dtype=args.grid_dtype)
    rows, bf16_ar = [], None
    kernels = args.grid_quant_kernels.split(",")
    heads = [bool(int(h)) for h in args.grid_quant_head.split(",")]
    cells = [(tq, dq, qk, qh) for tq in args.grid_targets.split(",") for dq in args.grid_drafts.split(",")
             for qk in ([kernels[0]] if (tq, dq) == ("none", "none") else kernels)  # bf16 x bf16: once
             for qh in ([False] if (tq, dq) == ("none", "none") else heads)]
    for tq, dq, qk, qh in cells:
        row = {"target_quant": tq, "draft_quant": dq, "quant_kernel": qk, "quant_head": qh}
        cfg = BenchConfig(method="draft", k=4, batch=1, max_new_tokens=args.grid_new_tokens,
                          num_prompts=args.grid_prompts, repeats=args.repeats, warmup=1, temperature=0.0,
                          cuda_graphs=True, graph_batch_sizes=(1,), target_quant=tq, draft_quant=dq,
                          int4_group_size=args.int4_group_size, quant_kernel=qk, quant_head=qh,
                          kernel_tuning=args.kernel_tuning)
        try:
            rec = session.run(cfg).record
            if tq == "none" and bf16_ar is None:
                bf16_ar = rec["ar_tokens_per_s"]
            row.update({k: rec.get(k) for k in (
                "acceptance_rate", "mean_accepted_tokens", "tokens_per_s", "ar_tokens_per_s", "speedup_vs_ar",
                "quant_ppl_delta_pct", "quant_token_agreement", "quant_sequences_identical",
                "quant_acceptance_ref", "quant_acceptance_delta", "quant_within_bound", "greedy_matches_ar",
                "kernel_tuning",
                "greedy_near_tie", "target_weight_mb", "draft_weight_mb", "noisy", "plausible")})
            row["speedup_vs_bf16_ar"] = rec["tokens_per_s"] / bf16_ar if bf16_ar else None
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def kernel_profile(engine, prompts, top: int) -> dict:
    """One more generate under torch.profiler: `kernel_summary` of its decode tokens (top kernels as top_kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        res = engine.generate(prompts)
        torch.cuda.synchronize()
    summary = kernel_summary(prof, len(res.outputs[0]), top)
    summary["top_kernels"] = summary.pop("top")
    return summary


def load_m1_tiles(path: str) -> dict:
    """A tiles file ({"fmt,N,K": overrides}, scripts/gpu_gemv.py --parts tc) -> {(fmt, N, K): overrides}."""
    table = {}
    for key, over in json.loads(Path(path).read_text()).items():
        fmt, n, k = key.split(",")
        table[(fmt, int(n), int(k))] = over
    set_m1_tiles(table)  # checked here, before any model is built; installed per row ("+tc")
    set_m1_tiles({})
    return table


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], list)))  # lists: in the JSON
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
                      *["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="floor,grid")
    ap.add_argument("--floor-configs", default="1.45b,6.7b")
    ap.add_argument("--formats", default="none,int8,int8-dq,int4,int4-awq,fp8")
    ap.add_argument("--floor-modes", default="graphs", help=f"engine modes of gpu_fastpath: {', '.join(MODES)}")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--floor-ngram", type=int, default=0, help="floor part: decode with the n-gram drafter at this k "
                    "(0: AR), so int4 verifies of k + 1 rows are timed in the model; rows record mean_accepted and "
                    "steps, and ms per token is per emitted token")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--int4-group-size", type=int, default=128)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--grid-dtype", default="bfloat16")
    ap.add_argument("--grid-targets", default="none,int8,int4,int4-awq,fp8")
    ap.add_argument("--grid-drafts", default="none,int8,int4")
    ap.add_argument("--grid-quant-head", default="0", help="grid part: quant_head values (0, 1 or 0,1), each a row "
                    "per quantized cell (the LM heads quantized too, in each model's format)")
    ap.add_argument("--grid-quant-kernels", default="auto", help="grid part: quant_kernel values, each a row per "
                    "quantized cell (e.g. aten,triton: tinygemm against ours for int4); bf16 x bf16 runs once, auto")
    ap.add_argument("--grid-prompts", type=int, default=4)
    ap.add_argument("--grid-new-tokens", type=int, default=96)
    ap.add_argument("--m1-tiles", default="", help="a JSON file of one-row GEMV tiles per shape, as scripts/gpu_gemv.py "
                    "--parts tc writes it (gemv_tc_tiles.json): used instead of gemv_config's table")
    ap.add_argument("--profile", action="store_true", help="each floor row: one more generate under torch.profiler "
                    "(kernels per token, kernel time, the top kernels)")
    ap.add_argument("--profile-top", type=int, default=14)
    ap.add_argument("--kernel-tuning", default="", help="the KernelTuning every row starts from, field=value,... "
                    "(kernels/tuning.py; a row's suffixes change fields on top of it)")
    args = ap.parse_args()
    args.tuning = parse_tuning(args.kernel_tuning)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__}
    args.tiles = load_m1_tiles(args.m1_tiles) if args.m1_tiles else {}
    if args.tiles:
        env["m1_tiles"] = {",".join(map(str, key)): over for key, over in args.tiles.items()}
    run_parts({"floor": part_floor, "grid": part_grid}, args.parts, args, device, env, out, "quant", table)


if __name__ == "__main__":
    main()
