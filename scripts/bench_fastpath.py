"""Our engine beside gpt-fast (and HF transformers) on the same weights and prompts, in one process, on one GPU.

    python scripts/bench_fastpath.py --preset tiny --methods ar,draft --cuda-graphs --out $OUT
    python scripts/bench_fastpath.py --preset tiny --methods ar,draft --cuda-graphs --compile default --hf --out $OUT
    python scripts/bench_fastpath.py --random-config 1.45b --cuda-graphs --out $OUT
    python scripts/bench_fastpath.py --random-config 6.7b --cuda-graphs --out $OUT
    # CPU smoke run (fp32, gpt-fast eager):
    python scripts/bench_fastpath.py --preset tiny --device cpu --dtype float32 --max-new-tokens 8 --num-prompts 2 \
        --repeats 1 --out out/fastpath

gpt-fast is imported at run time from `--gpt-fast DIR` (default .anchors/gpt-fast, git-ignored: export it with
`git --git-dir=<mirror of pytorch-labs/gpt-fast> archive HEAD | tar -x -C .anchors/gpt-fast`; checked against
commit 32971d3, 2024-09-15). Nothing of it is committed here. Without it, our engine is still timed and the JSON
says why gpt-fast is missing.

What runs, batch 1, greedy, equal-length prompts (gpt-fast sizes its KV cache and compiled graphs from the prompt):
- ours: `SpecEngine(target, drafter, EngineConfig(max_new_tokens, **fast))`, drafter None (ar) or
  `DraftModelDrafter(draft, k)` (draft). `fast` holds `--cuda-graphs` (cuda_graphs, graph_batch_sizes=(1,)) and
  `--compile MODE` (compile), each passed only if EngineConfig has that field; the JSON lists applied and missing.
- gpt-fast: its own `generate()` on the converted weights, compiled as its `main` does on CUDA: `decode_one_token`
  (and `model_forward` when speculating) with torch.compile(mode="reduce-overhead", fullgraph=True); `prefill` only
  with --gpt-fast-compile-prefill (its `--compile_prefill`). Its all-accepted branch (a 1-token draft forward) is
  compiled at the start of the warm-up pass, so no compilation lands in a timed pass. Greedy = top_k=1 (one-hot
  probabilities, so its sampler and its acceptance test are exact argmax). KV caches are set up once for the longest
  need, so AR and speculative share them (AR attends over k+1 more masked slots than on its own). Importing its
  generate.py sets inductor options (coordinate_descent_tuning, ...) process-wide: our --compile runs under them too
  (JSON: inductor).
- HF (--hf): transformers `generate()`, eager, on our weights; one timed pass after one warm-up prompt (it is 10-100x
  slower), AR only.
Per method: one untimed warm-up pass over all prompts per system (compilation, graph capture; its outputs are the
parity check), then --repeats timed passes interleaved ours, gpt-fast, ours, gpt-fast. tok/s = generated tokens /
wall (prefill included), median [min, max] over repeats. Mean accepted = accepted draft tokens per target step.
HBM floor (AR): (all weight bytes + KV bytes read at the mean context) / 4.3e12 B/s (the H200's HBM bandwidth).

gpt-fast fixes, applied in memory to the text of its generate.py before exec (files on disk untouched; each edit
replaces part of one line, so line numbers in tracebacks stay right; an edit whose target is not found exactly once
is skipped and reported). Its speculative path at HEAD assumes batch-free shapes that its batch refactor changed:
  1. `draft_tokens = torch.cat(draft_tokens)` -> `... .view(-1)`: draft tokens [k, 1] -> [k]
  2. `draft_probs = torch.stack(draft_probs)` -> `... .view(speculate_k, -1)`: draft probs [k, 1, V] -> [k, V]
  3. `seq[input_pos + 1 :` -> `seq[0, input_pos + 1 :`: the speculative loop writes row 0 of seq [B, T]
If its tokenizer.py cannot be imported (it needs sentencepiece and tiktoken; tokens are ours here), a stub stands in.
Weights: ours -> gpt-fast names; q/k rows permuted per head from HF rotate-half order to gpt-fast's interleaved
(complex) RoPE pairs, as its convert_hf_checkpoint.py does; tied embeddings copied into its `output`.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

import torch
import torch._inductor.config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.engine import EngineConfig, SpecEngine  # noqa: E402
from workbench.engine.drafters import make_drafter  # noqa: E402
from workbench.models import LlamaModel  # noqa: E402
from workbench.models.config import ModelConfig, ModelLoadError  # noqa: E402
from workbench.zoo import ZooError  # noqa: E402

HBM_BYTES_PER_S = 4.3e12  # measured copy bandwidth of the H200 (docs: ENVIRONMENT.md)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPILE_MODES = ("off", "default", "max-autotune")
METHODS = ("ar", "draft")
# Random-weight Llamas for cost-only runs (acceptance from random weights means nothing): 1.45 G and 6.74 G parameters.
RANDOM_CONFIGS = {
    "1.45b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=4, rms_norm_eps=1e-5),
    "6.7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5),
}
GPT_FAST_FIXES = (  # (what, text in its generate.py, replacement)
    ("draft tokens [k, 1] -> [k]", "draft_tokens = torch.cat(draft_tokens)",
     "draft_tokens = torch.cat(draft_tokens).view(-1)"),
    ("draft probs [k, 1, V] -> [k, V]", "draft_probs = torch.stack(draft_probs)",
     "draft_probs = torch.stack(draft_probs).view(speculate_k, -1)"),
    ("speculative loop writes row 0 of seq", "seq[input_pos + 1 :", "seq[0, input_pos + 1 :"),
)


# -- gpt-fast: import with fixes, weight conversion ------------------------------------------------------------------
def load_gpt_fast(root: Path) -> tuple[types.ModuleType, types.ModuleType, list[dict], str]:
    """(its model module, its generate module with GPT_FAST_FIXES applied, fixes report, sha256 of both sources)."""
    root = Path(root).resolve()
    if not (root / "generate.py").is_file() or not (root / "model.py").is_file():
        raise FileNotFoundError(f"no gpt-fast checkout at {root} (generate.py, model.py); see this script's docstring")
    source = (root / "generate.py").read_text()
    digest = hashlib.sha256((root / "model.py").read_bytes() + source.encode()).hexdigest()[:16]
    fixes = []
    for what, old, new in GPT_FAST_FIXES:
        n = source.count(old)
        if n == 1:
            source = source.replace(old, new)
        fixes.append({"fix": what, "from": old, "to": new, "applied": n == 1, **({} if n == 1 else {"found": n})})
    # Registered under names of ours: torch.compile re-imports a traced function's module by its __name__.
    model_mod = _module_from_file("gpt_fast_model", root / "model.py")
    try:
        tokenizer_mod = _module_from_file("gpt_fast_tokenizer", root / "tokenizer.py")
    except ImportError as e:
        tokenizer_mod = types.ModuleType("gpt_fast_tokenizer")
        tokenizer_mod.get_tokenizer = _unavailable(f"gpt-fast's tokenizer.py does not import here ({e})")
    saved = {name: sys.modules.get(name) for name in ("model", "tokenizer")}
    sys.modules.update(model=model_mod, tokenizer=tokenizer_mod)  # its `from model import ...`, `from tokenizer ...`
    try:
        gen = sys.modules["gpt_fast_generate"] = types.ModuleType("gpt_fast_generate")
        gen.__file__ = str(root / "generate.py")
        exec(compile(source, gen.__file__, "exec"), gen.__dict__)
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return model_mod, gen, fixes, digest


def _module_from_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def _unavailable(why: str):
    def fail(*args, **kwargs):
        raise ImportError(why)
    return fail


def gpt_fast_args(cfg: ModelConfig, block_size: int) -> dict:
    """Keyword arguments of gpt-fast's ModelArgs for our config; ValueError for what it cannot represent."""
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        raise ValueError("gpt-fast has no biases; this model has some")
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError(f"gpt-fast needs head_dim * heads == hidden ({cfg.head_dim} * {cfg.num_attention_heads} "
                         f"!= {cfg.hidden_size})")
    return dict(block_size=block_size, vocab_size=cfg.vocab_size, n_layer=cfg.num_hidden_layers,
                n_head=cfg.num_attention_heads, dim=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                n_local_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rope_base=cfg.rope_theta,
                norm_eps=cfg.rms_norm_eps,
                rope_scaling=dataclasses.asdict(cfg.rope_scaling) if cfg.rope_scaling else None)


def interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[n_heads * D, H] q or k rows in HF rotate-half order (pairs i, i + D/2) -> interleaved pairs (2i, 2i + 1).

    >>> interleave_rope_rows(torch.arange(4.).view(4, 1), 1).flatten().tolist()
    [0.0, 2.0, 1.0, 3.0]
    """
    d = w.shape[0] // n_heads
    return w.view(n_heads, 2, d // 2, -1).transpose(1, 2).reshape(w.shape)


def gpt_fast_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """Our weights under gpt-fast's names, as new tensors (q/k rows interleaved for its RoPE; tied head copied)."""
    cfg = model.config
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = {"tok_embeddings.weight": model.model.embed_tokens.weight.detach().clone(),
           "norm.weight": model.model.norm.weight.detach().clone(),
           "output.weight": model.lm_head_weight.detach().clone()}
    for i, layer in enumerate(model.model.layers):
        q, k, v = layer.self_attn.qkv_proj.weight.detach().split([q_rows, kv_rows, kv_rows])
        gate, up = layer.mlp.gate_up_proj.weight.detach().chunk(2)
        p = f"layers.{i}."
        out[p + "attention.wqkv.weight"] = torch.cat([interleave_rope_rows(q, cfg.num_attention_heads),
                                                      interleave_rope_rows(k, cfg.num_key_value_heads), v])
        out[p + "attention.wo.weight"] = layer.self_attn.o_proj.weight.detach().clone()
        out[p + "feed_forward.w1.weight"] = gate.clone()
        out[p + "feed_forward.w3.weight"] = up.clone()
        out[p + "feed_forward.w2.weight"] = layer.mlp.down_proj.weight.detach().clone()
        out[p + "attention_norm.weight"] = layer.input_layernorm.weight.detach().clone()
        out[p + "ffn_norm.weight"] = layer.post_attention_layernorm.weight.detach().clone()
    return out


def to_gpt_fast(model_mod: types.ModuleType, model: LlamaModel, block_size: int):
    """gpt-fast Transformer holding `model`'s weights (same device and dtype), in eval mode, without caches."""
    with torch.device("meta"):
        gf = model_mod.Transformer(model_mod.ModelArgs(**gpt_fast_args(model.config, block_size)))
    gf.load_state_dict(gpt_fast_state_dict(model), assign=True, strict=True)
    return gf.eval()


# -- models, prompts, floor ------------------------------------------------------------------------------------------
def random_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaModel:
    """A random-weight Llama of RANDOM_CONFIGS[name] (`random_llama`)."""
    return random_llama(ModelConfig(**RANDOM_CONFIGS[name]), dtype, device, seed)


def random_llama(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaModel:
    """A random-weight Llama built directly in `dtype` on `device` (no fp32 copy, no files)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(cfg, init_weights=False)
    finally:
        torch.set_default_dtype(default)
    model.reset_parameters(generator=torch.Generator(device=device).manual_seed(seed))
    return model.eval().requires_grad_(False)


def equal_length_prompts(token_lists: list[list[int]], prompt_len: int, n: int) -> list[list[int]]:
    """The first `prompt_len` tokens of the first `n` token lists that have that many (shorter ones skipped).

    >>> equal_length_prompts([[1, 2, 3], [4], [5, 6, 7, 8], [9, 9]], 2, 2)
    [[1, 2], [5, 6]]
    """
    out = [t[:prompt_len] for t in token_lists if len(t) >= prompt_len][:n]
    if not out:
        raise ValueError(f"no prompt has {prompt_len} tokens; lower --prompt-len")
    return out


def hbm_floor_ms(cfg: ModelConfig, dtype_bytes: int, prompt_len: int, max_new_tokens: int) -> dict:
    """Bytes one decode step must read (every weight + K and V at the mean context) / HBM bandwidth.

    >>> f = hbm_floor_ms(ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
    ...                  num_attention_heads=2), 2, 6, 4)
    >>> f["weight_bytes"], f["kv_bytes_per_token"], f["mean_context"]
    (504, 128, 8.0)
    """
    mean_ctx = prompt_len + max_new_tokens / 2  # decode steps read contexts prompt_len + 1 .. prompt_len + new - 1
    weight_bytes = cfg.num_parameters() * dtype_bytes
    kv_bytes = int(2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * mean_ctx * dtype_bytes)
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes, "mean_context": mean_ctx,
            "floor_ms": (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3}


def hf_model_from(model: LlamaModel, device: torch.device):
    """transformers LlamaForCausalLM with our weights (same dtype and device)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf_cfg = LlamaConfig.from_dict(model.config.to_hf_dict())
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=next(model.parameters()).dtype)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF weights do not line up: missing {missing}, unexpected {unexpected}")
    return hf.eval()


# -- runners: prompt [T] -> (generated tokens, accepted draft tokens per target step) --------------------------------
def ours_runner(target, draft, k: int, max_new: int, fast: dict, device: torch.device):
    engine = SpecEngine(target, make_drafter("draft" if draft is not None else "ar", {"k": k}, draft=draft),
                        EngineConfig(max_new_tokens=max_new, **fast), device)

    def run(prompt: list[int]) -> tuple[list[int], list[int]]:
        res = engine.generate([prompt])
        return res.outputs[0], ([a for s in res.steps for a in s.accepted] if draft is not None else [])
    return run


def gpt_fast_runner(gen: types.ModuleType, target, draft, k: int, max_new: int, device: torch.device,
                    prewarm=None):
    """`prewarm` runs 3 times before the first generate (cudagraph trees: warm up, then record): it compiles a branch
    that greedy decoding of the warm-up prompts may never take, so that no compilation lands in a timed pass."""
    pending = [prewarm] if prewarm is not None else []

    def run(prompt: list[int]) -> tuple[list[int], list[int]]:
        while pending:
            with torch.no_grad():
                for _ in range(3):
                    pending[0]()
            pending.pop()
        x = torch.tensor(prompt, dtype=torch.int, device=device)  # [T], as its encode_tokens returns
        seq, stats = gen.generate(target, x, max_new, batch_size=1, interactive=False, draft_model=draft,
                                  speculate_k=k, temperature=1.0, top_k=1)
        accepted = [n for n, count in enumerate(stats["accept_counts"]) for _ in range(count)]
        return seq[0, len(prompt):].tolist(), (accepted if draft is not None else [])
    return run


def hf_runner(hf, max_new: int, device: torch.device):
    def run(prompt: list[int]) -> tuple[list[int], list[int]]:
        ids = torch.tensor([prompt], device=device)
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                          min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist(), []
    return run


def timed_pass(run, prompts: list[list[int]], device: torch.device) -> dict:
    """All prompts one at a time: wall seconds, generated tokens, outputs, accepted counts."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    outputs, accepted = [], []
    sync()
    t0 = time.perf_counter()
    for p in prompts:  # each system sets its own grad mode (ours inference_mode, gpt-fast and HF no_grad)
        toks, acc = run(p)
        outputs.append(toks)
        accepted += acc
    sync()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(len(o) for o in outputs), "outputs": outputs, "accepted": accepted}


def summarize(passes: list[dict], floor: dict | None) -> dict:
    tps = [p["tokens"] / p["wall_s"] for p in passes]
    med = statistics.median(tps)
    acc = passes[0]["accepted"]
    out = {"tok_s": {"median": med, "min": min(tps), "max": max(tps)}, "tok_s_runs": tps, "ms_per_token": 1e3 / med,
           "mean_accepted_tokens": sum(acc) / len(acc) if acc else None}
    if floor is not None:
        out["floor_fraction"] = floor["floor_ms"] / out["ms_per_token"]
    return out


def parity(a: list[list[int]], b: list[list[int]]) -> dict:
    """Equal sequences of a and b, and per pair the first index where they differ (None: identical)."""
    first = []
    for s, t in zip(a, b):
        tail = None if len(s) == len(t) else min(len(s), len(t))
        first.append(next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), tail))
    return {"equal": sum(f is None for f in first), "of": len(first), "first_divergence": first}


# -- main ------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="zoo preset (target + draft), e.g. tiny, small")
    src.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), help="random-weight Llama, AR cost only")
    ap.add_argument("--methods", default=None, help="comma list of ar,draft (default: ar,draft; ar for random configs)")
    ap.add_argument("--k", type=int, default=4, help="draft length")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cuda-graphs", action="store_true", help="ours: cuda_graphs=True, graph_batch_sizes=(1,)")
    ap.add_argument("--compile", choices=COMPILE_MODES, default=None, help="ours: EngineConfig.compile")
    ap.add_argument("--overlap", action="store_true", help="ours: EngineConfig.overlap (launch step t+1 before "
                    "reading step t)")
    ap.add_argument("--gpt-fast", default=str(ROOT / ".anchors" / "gpt-fast"), help="gpt-fast checkout")
    ap.add_argument("--gpt-fast-eager", action="store_true", help="do not torch.compile gpt-fast (never on CPU)")
    ap.add_argument("--gpt-fast-compile-prefill", action="store_true", help="its --compile_prefill")
    ap.add_argument("--hf", action="store_true", help="also time transformers generate() (AR, one pass)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/fastpath")
    args = ap.parse_args(argv)
    args.methods = args.methods or ("ar" if args.random_config else "ar,draft")
    try:
        check_args(args)
    except ValueError as e:
        ap.error(str(e))
    return args


def check_args(args: argparse.Namespace) -> None:
    methods = [m for m in args.methods.split(",") if m]
    if not methods or set(methods) - set(METHODS):
        raise ValueError(f"--methods {args.methods!r}: choose from {','.join(METHODS)}")
    if "draft" in methods and args.random_config:
        raise ValueError("--random-config has no draft model: use --methods ar")
    for name, low in (("k", 1), ("prompt_len", 1), ("num_prompts", 1), ("max_new_tokens", 2), ("repeats", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")


def fast_settings(args: argparse.Namespace) -> tuple[dict, dict]:
    """(settings EngineConfig has, settings asked for that it lacks): the engine's fast path is work in progress."""
    asked = {"overlap": bool(args.overlap)}  # the engine's default is on: this script's --overlap turns it on
    if args.cuda_graphs:
        asked.update(cuda_graphs=True, graph_batch_sizes=(1,))
    if args.compile is not None:
        asked["compile"] = args.compile
    have = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in asked.items() if k in have}, {k: v for k, v in asked.items() if k not in have}


def load_models(args, methods: list[str], device: torch.device, dtype: torch.dtype):
    """(target, draft or None, prompts [N][prompt_len])."""
    if args.random_config:
        target = random_model(args.random_config, dtype, device, args.seed)
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, target.config.vocab_size, (args.num_prompts, args.prompt_len), generator=g)
        return target, None, prompts.tolist()
    from workbench.harness.prompts import load_prompts
    from workbench.models import load_model, load_tokenizer
    from workbench.zoo import resolve_preset

    paths = resolve_preset(args.preset)
    target = load_model(paths.target_dir, dtype=dtype, device=device).eval()
    draft = load_model(paths.draft_dir, dtype=dtype, device=device).eval() if "draft" in methods else None
    tok = load_tokenizer(paths.target_dir)
    ids = [tok.encode(p.text).ids for p in load_prompts(paths.prompts_path)]
    return target, draft, equal_length_prompts(ids, args.prompt_len, args.num_prompts)


def gpt_fast_runners(gen, model_mod, target, draft, methods: list[str], args, device: torch.device,
                     compiled: bool) -> dict:
    """method -> runner on converted copies of our models, compiled as its main() does (by its module globals)."""
    gf_target = to_gpt_fast(model_mod, target, args.prompt_len + args.max_new_tokens + args.k + 2)
    gf_draft = to_gpt_fast(model_mod, draft, gf_target.config.block_size) if draft is not None else None
    with torch.device(device):  # once, big enough for AR and speculative: its generate() then keeps them
        for m in (gf_target, gf_draft):
            if m is not None:
                m.setup_caches(max_batch_size=1, max_seq_length=args.prompt_len + args.max_new_tokens + args.k + 1)
    prewarm = None
    if compiled:
        gen.decode_one_token = torch.compile(gen.decode_one_token, mode="reduce-overhead", fullgraph=True)
        if "draft" in methods:
            gen.model_forward = torch.compile(gen.model_forward, mode="reduce-overhead", fullgraph=True)
        if args.gpt_fast_compile_prefill:
            gen.prefill = torch.compile(gen.prefill, fullgraph=True, dynamic=True)
        if gf_draft is not None:
            def prewarm():  # its all-accepted branch: the draft on the last draft token
                ids = torch.zeros(1, 1, dtype=torch.int, device=device)
                gen.model_forward(gf_draft, ids, torch.tensor([args.prompt_len], device=device))
    return {m: gpt_fast_runner(gen, gf_target, gf_draft if m == "draft" else None, args.k, args.max_new_tokens, device,
                               prewarm if m == "draft" else None) for m in methods}


def time_systems(runs: dict, prompts: list[list[int]], repeats: int, device: torch.device, floor: dict | None,
                 label: str) -> tuple[dict, dict]:
    """One warm-up pass per system, then `repeats` passes interleaved A B A B. (results, warm-up passes)."""
    results, warm, passes = {}, {}, {name: [] for name in runs}
    for name, run in list(runs.items()):
        try:
            warm[name] = timed_pass(run, prompts, device)
            print(f"[{label}] {name}: warm-up {warm[name]['wall_s']:.1f}s", flush=True)
        except Exception as e:
            runs.pop(name)
            results[name] = {"error": _error(e)}
            print(f"[{label}] {name} failed in warm-up: {results[name]['error'].splitlines()[0]}", flush=True)
    for _ in range(repeats):
        for name, run in list(runs.items()):
            try:
                passes[name].append(timed_pass(run, prompts, device))
            except Exception as e:
                runs.pop(name)
                results[name] = {"error": _error(e)}
    for name in runs:
        results[name] = {**summarize(passes[name], floor), "warmup_s": warm[name]["wall_s"]}
    return results, warm


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    methods = [m for m in args.methods.split(",") if m]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"fastpath-{args.preset or args.random_config}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    torch.manual_seed(args.seed)
    fast, missing = fast_settings(args)
    report: dict = {"config": {**vars(args), "methods": methods}, "device": _device_name(device),
                    "torch": torch.__version__, "ours": {"fast_path_applied": fast, "fast_path_missing": missing},
                    "gpt_fast": {"dir": args.gpt_fast}, "results": {m: {} for m in methods}, "parity": {}}

    def save() -> None:  # after every stage, so a run cut short still leaves what it measured
        out_path.write_text(json.dumps(report, indent=1, default=str) + "\n")

    gf = report["gpt_fast"]
    try:  # first, so our --compile runs under the inductor options its import sets
        gf_model, gen, gf["fixes"], gf["source_sha256"] = load_gpt_fast(Path(args.gpt_fast))
    except Exception as e:
        gen = None
        gf["error"] = f"import: {type(e).__name__}: {e}"
        print(f"gpt-fast unavailable ({gf['error']}); timing ours only", flush=True)
    report["inductor"] = {k: getattr(torch._inductor.config, k, None) for k in ("coordinate_descent_tuning",
                                                                                "fx_graph_cache")}
    t0 = time.perf_counter()
    try:
        target, draft, prompts = load_models(args, methods, device, dtype)
    except (ZooError, ModelLoadError, ValueError) as e:
        raise SystemExit(f"cannot load models or prompts: {e}") from None
    cfg, need = target.config, args.prompt_len + args.max_new_tokens + args.k + 2
    for role, m in (("target", target), ("draft", draft)):
        if m is not None and need > m.config.max_position_embeddings:
            raise SystemExit(f"{role} context {m.config.max_position_embeddings} < {need} positions needed")
    report["config"].update(num_prompts_used=len(prompts), target_params=cfg.num_parameters(),
                            target_config=dataclasses.asdict(cfg),
                            draft_params=draft.config.num_parameters() if draft is not None else None)
    floor = report["floor"] = hbm_floor_ms(cfg, dtype.itemsize, args.prompt_len, args.max_new_tokens)
    print(f"loaded target {cfg.num_parameters() / 1e6:.1f} M params in {time.perf_counter() - t0:.1f}s; "
          f"{len(prompts)} prompts x {args.prompt_len} tokens; HBM floor {floor['floor_ms']:.3f} ms/token; "
          f"ours fast path {fast or 'eager'} (missing from EngineConfig: {missing or 'none'})", flush=True)

    systems = {"ours": {m: ours_runner(target, draft if m == "draft" else None, args.k, args.max_new_tokens, fast,
                                       device) for m in methods}}
    if gen is not None:
        try:
            compiled = device.type == "cuda" and not args.gpt_fast_eager
            systems["gpt_fast"] = gpt_fast_runners(gen, gf_model, target, draft, methods, args, device, compiled)
            gf.update(compiled=compiled, compile_prefill=compiled and args.gpt_fast_compile_prefill)
        except Exception as e:
            gf["error"] = f"convert: {type(e).__name__}: {e}"
            print(f"gpt-fast conversion failed: {gf['error']}", flush=True)
    save()
    for method in methods:
        runs = {name: by_method[method] for name, by_method in systems.items()}
        report["results"][method], warm = time_systems(runs, prompts, args.repeats, device,
                                                       floor if method == "ar" else None, method)
        if "ours" in warm and "gpt_fast" in warm:
            report["parity"][f"{method}: ours vs gpt_fast"] = parity(warm["ours"]["outputs"],
                                                                     warm["gpt_fast"]["outputs"])
        save()
        if method == "ar" and args.hf and "ours" in warm:
            try:
                run = hf_runner(hf_model_from(target, device), args.max_new_tokens, device)
                timed_pass(run, prompts[:1], device)  # warm-up on one prompt: eager HF is 10-100x slower
                hf_pass = timed_pass(run, prompts, device)
                report["results"]["ar"]["hf"] = summarize([hf_pass], floor)
                report["parity"]["ar: ours vs hf"] = parity(warm["ours"]["outputs"], hf_pass["outputs"])
            except Exception as e:
                report["results"]["ar"]["hf"] = {"error": _error(e)}
            save()
    print_table(report)
    print(f"wrote {out_path}", flush=True)
    return 0


def print_table(report: dict) -> None:
    print("\n| method | system | tok/s median [min, max] | ms/token | mean accepted | floor % |")
    print("|---|---|---|---|---|---|")
    for method, by_system in report["results"].items():
        for name, r in by_system.items():
            if "error" in r:
                print(f"| {method} | {name} | error: {r['error'].splitlines()[0][:80]} | | | |")
                continue
            t, acc, fl = r["tok_s"], r["mean_accepted_tokens"], r.get("floor_fraction")
            print(f"| {method} | {name} | {t['median']:.1f} [{t['min']:.1f}, {t['max']:.1f}] | {r['ms_per_token']:.3f}"
                  f" | {'' if acc is None else f'{acc:.2f}'} | {'' if fl is None else f'{100 * fl:.1f}'} |")
    for what, p in report["parity"].items():
        print(f"parity {what}: {p['equal']}/{p['of']} sequences equal (first divergence: {p['first_divergence']})")
    fixes = report["gpt_fast"].get("fixes") or []
    print(f"gpt-fast: {report['gpt_fast'].get('error') or 'ok'}; fixes applied "
          f"{sum(f['applied'] for f in fixes)}/{len(fixes)}; compiled {report['gpt_fast'].get('compiled')}", flush=True)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exception(e)[-3:])


if __name__ == "__main__":
    sys.exit(main())
