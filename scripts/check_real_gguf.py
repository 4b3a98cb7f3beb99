"""Check the workbench against a real pretrained GGUF model (outside CI; downloads nothing).

    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/acc .venv/bin/python scripts/check_real_gguf.py PATH.gguf [--prompts FILE]

1. `python -m workbench models info PATH --json` runs and reports sane numbers.
2. Our loader against transformers' own GGUF path: dequantization (a numpy reference for Q4_0/Q4_1/Q8_0 blocks,
   independent of the gguf package), tokenizer ids (ours vs AutoTokenizer(gguf_file=...), and the vocabulary vs the
   GGUF's token list), full-sequence logits (max relative error), and our engine's greedy output vs
   transformers' generate(). transformers' GGUF model path needs `accelerate`, which the project does not pin: put it
   on PYTHONPATH for this check (e.g. `pip install --no-deps --target /tmp/acc accelerate`); without it the
   transformers comparisons are skipped and reported as such.
3. `python -m workbench bench --model PATH --method ngram|ar --k 4 --batch 1 ... --json --no-store` on the prompts.

Exit status 0 when every check that ran passed, 1 otherwise. A 135 M model takes a few minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# Chat-style and code prompts; chat ones go through the GGUF's chat template when it has one.
CHAT = ["What is the capital of France? Answer in one sentence.",
        "Write a Python function that checks whether a string is a palindrome.",
        "Fix the bug in this code:\n\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
        "    return total / len(x)\n"]
RAW = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
# Extra strings for the tokenizer comparison only: unicode, digits, odd whitespace.
TOKENIZER_EXTRA = ["The quick brown fox. Émigré café naïve — 東京 🚀 1234567 and 2024",
                   "  leading spaces\n\n\ttabs and\r\nCRLF   trailing  "]
LOGIT_RTOL = 1e-4  # float32 on both sides, same weights: anything above this is a real difference

failures: list[str] = []


def check(ok: bool, what: str) -> bool:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        failures.append(what)
    return ok


def workbench_cli(*args: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "workbench", *args], cwd=ROOT, capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


# --- step 1 --------------------------------------------------------------------------------------------------------

def step_info(gguf_path: Path) -> dict:
    print("1. models info", flush=True)
    t0 = time.perf_counter()
    rc, out, err = workbench_cli("models", "info", str(gguf_path), "--json")
    wall = time.perf_counter() - t0
    info = {}
    if check(rc == 0, f"models info exits 0 (rc={rc}, {wall:.1f} s wall)"):
        info = json.loads(out.strip().splitlines()[-1])
        print("    " + json.dumps(info))
        check(info["layers"] >= 1 and info["hidden_size"] >= 1 and info["vocab_size"] >= 1, "sizes are positive")
        check(info["hidden_size"] == info["heads"] * info["head_dim"] or info["architecture"] != "llama",
              f"hidden_size {info['hidden_size']} = heads {info['heads']} x head_dim {info['head_dim']}")
        check(info["heads"] % info["kv_heads"] == 0, "heads divisible by kv_heads")
        # quantized files: the parameter count should be about file size / bytes-per-weight, never more than 8x it
        check(0 < info["parameters"] <= info["file_bytes"] * 8, f"parameters {info['parameters']:,} plausible for "
                                                                 f"{info['file_bytes']:,} bytes")
        check(bool(info["tokenizer_present"]), "GGUF carries a vocabulary")
    else:
        print(err[-2000:])
    return info


# --- step 2 --------------------------------------------------------------------------------------------------------

def _reference_dequant(raw: np.ndarray, kind: str, shape) -> np.ndarray:
    """ggml block formats written out by hand (ggml-quants.c), to check the gguf package's dequantize."""
    b = np.asarray(raw, dtype=np.uint8)
    if kind == "Q8_0":  # 32 weights: f16 d, 32 x int8
        b = b.reshape(-1, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        return (d * b[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(shape)
    if kind in ("Q4_0", "Q4_1"):  # 32 weights: f16 d [, f16 m], 16 bytes (low nibbles = first 16, high = last 16)
        head = 2 if kind == "Q4_0" else 4
        b = b.reshape(-1, head + 16)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        q = b[:, head:]
        q = np.concatenate([q & 15, q >> 4], axis=1).astype(np.float32)
        if kind == "Q4_0":
            return (d * (q - 8)).reshape(shape)
        m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        return (d * q + m).reshape(shape)
    raise ValueError(kind)


def check_dequant(gguf_path: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in seen or kind not in ("Q4_0", "Q4_1", "Q8_0"):
            continue
        seen.add(kind)
        ours = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        ref = _reference_dequant(t.data, kind, ours.shape)
        err = float(np.abs(ours - ref).max())
        check(err == 0.0, f"{kind} dequantization of {t.name} {ours.shape} matches the hand-written block decoder "
                          f"(max abs diff {err:.3g}, mean |w| {float(np.abs(ours).mean()):.3g})")
    other = sorted({t.tensor_type.name for t in reader.tensors} - seen - {"F32", "F16", "BF16"})
    if other:
        print(f"    (no hand-written reference for {', '.join(other)}; covered only by the logit comparison)")


def build_prompts(gguf_path: Path, prompts_file: str | None) -> list[str]:
    if prompts_file:
        from workbench.harness.prompts import load_prompts
        return [p.text for p in load_prompts(prompts_file)]
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if getattr(hf_tok, "chat_template", None):
        chat = [hf_tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                           add_generation_prompt=True) for c in CHAT]
    else:
        chat = CHAT
    return chat + RAW


def step_parity(gguf_path: Path, prompts: list[str], max_new: int) -> dict:
    print("2. parity with transformers", flush=True)
    from workbench.engine import EngineConfig, SpecEngine
    from workbench.models import load_model, load_tokenizer

    check_dequant(gguf_path)
    t0 = time.perf_counter()
    ours = load_model(gguf_path, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    tok = load_tokenizer(gguf_path)
    print(f"    load_model: {load_s:.1f} s; load_tokenizer: {time.perf_counter() - t0 - load_s:.1f} s", flush=True)
    out: dict = {"load_model_s": round(load_s, 2)}

    # vocabulary vs the GGUF's own token list (independent of transformers' tokenizer conversion)
    import gguf
    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields["tokenizer.ggml.tokens"]
    gguf_tokens = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    vocab = tok.get_vocab(with_added_tokens=True)
    by_id = {i: s for s, i in vocab.items()}
    same = sum(by_id.get(i) == s for i, s in enumerate(gguf_tokens))
    check(same == len(gguf_tokens) == len(vocab), f"tokenizer vocabulary = GGUF token list ({same}/{len(gguf_tokens)}"
                                                  f" ids agree, tokenizer has {len(vocab)})")
    check(len(gguf_tokens) == ours.config.vocab_size, f"vocab {len(gguf_tokens)} = config vocab_size "
                                                      f"{ours.config.vocab_size}")

    # our engine's greedy text (always); the transformers comparisons need accelerate
    ids = [tok.encode(p).ids for p in prompts]
    engine = SpecEngine(ours, None, EngineConfig(max_new_tokens=max_new), torch.device("cpu"))
    t0 = time.perf_counter()
    gen = [engine.generate([x]).outputs[0] for x in ids]
    out["engine_ar_s"] = round(time.perf_counter() - t0, 2)
    out["samples"] = [tok.decode(g) for g in gen]
    for p, s in zip(prompts, out["samples"]):
        print(f"    --- prompt: {p[-70:]!r}\n        output: {s!r}")

    import importlib.util
    if importlib.util.find_spec("accelerate") is None:
        print("    accelerate not importable: transformers comparisons SKIPPED (put accelerate on PYTHONPATH)")
        out["transformers"] = "skipped: no accelerate"
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    agree = 0
    texts = prompts + TOKENIZER_EXTRA
    for text in texts:
        a, b = tok.encode(text).ids, hf_tok.encode(text, add_special_tokens=False)
        agree += a == b
        if a != b:
            print(f"    token ids differ for {text[:60]!r}: ours {a[:20]} hf {b[:20]}")
        if tok.decode(a, skip_special_tokens=False) != text:
            print(f"    (decode(encode(x)) != x for {text[:60]!r})")
    check(agree == len(texts), f"token ids equal to AutoTokenizer(gguf_file=...) on {agree}/{len(texts)} strings")
    out["tokenizer_agree"] = f"{agree}/{len(texts)}"

    t0 = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                               dtype=torch.float32).eval()
    out["hf_load_s"] = round(time.perf_counter() - t0, 2)
    worst = 0.0
    for x in ids:
        t = torch.tensor([x])
        with torch.no_grad():
            lo = ours.compute_logits(ours(t, torch.arange(t.shape[1])[None], None)).float()
            lr = ref(t).logits.float()
        rel = ((lo - lr).abs().max() / lr.abs().max()).item()
        argmax = (lo.argmax(-1) == lr.argmax(-1)).float().mean().item()
        print(f"    {len(x):3d} tokens: max rel err {rel:.3e}, max abs {(lo - lr).abs().max().item():.3e}, "
              f"argmax agreement {argmax:.3f}")
        worst = max(worst, rel)
    out["logits_max_rel_err"] = worst
    check(worst <= LOGIT_RTOL, f"logits max relative error {worst:.3e} <= {LOGIT_RTOL:g}")
    matched = 0
    # our engine decodes a fixed length through EOS; so must generate() (min_new_tokens would mask EOS instead)
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    for x, g in zip(ids, gen):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([x]), max_new_tokens=max_new, do_sample=False,
                              attention_mask=torch.ones(1, len(x), dtype=torch.long))[0, len(x):].tolist()
        matched += hf == g
        if hf != g:
            first = next(i for i, (u, v) in enumerate(zip(hf, g)) if u != v)
            print(f"    engine vs generate() first differ at token {first}")
    check(matched == len(ids), f"our engine's greedy output = transformers generate() on {matched}/{len(ids)} prompts")
    out["engine_equals_hf_generate"] = f"{matched}/{len(ids)}"
    return out


# --- step 3 --------------------------------------------------------------------------------------------------------

def step_bench(gguf_path: Path, prompts_file: str, n: int, k: int, max_new: int) -> dict:
    print("3. bench (CPU, float32)", flush=True)
    keys = ["status", "error", "acceptance_rate", "mean_accepted_tokens", "acceptance_by_position", "tokens_per_s",
            "ar_tokens_per_s", "speedup_vs_ar", "greedy_matches_ar", "target_steps", "ar_target_steps",
            "total_new_tokens", "tpot_ms_p50", "time_verify_ms", "time_draft_ms"]
    out = {}
    for method in ("ngram", "ar"):
        args = ["bench", "--model", str(gguf_path), "--prompts", prompts_file, "--method", method, "--k", str(k),
                "--batch", "1", "--max-new-tokens", str(max_new), "--num-prompts", str(n), "--device", "cpu",
                "--json", "--no-store"]
        t0 = time.perf_counter()
        rc, stdout, stderr = workbench_cli(*args)
        wall = time.perf_counter() - t0
        if not check(rc == 0, f"bench --method {method} exits 0 (rc={rc}, {wall:.0f} s wall)"):
            print(stderr[-2000:])
            continue
        rec = json.loads(stdout.strip().splitlines()[-1])
        out[method] = {key: rec.get(key) for key in keys}
        print(f"    {method}: " + json.dumps(out[method]))
        check(rec.get("greedy_matches_ar") is True, f"{method}: greedy_matches_ar")
        check(rec.get("total_new_tokens") == n * max_new, f"{method}: {n} x {max_new} tokens generated")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path, help="path to a local .gguf file")
    ap.add_argument("--prompts", help="JSONL {\"prompt\": ...} file (default: built-in chat + code prompts)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json-out", help="write every number to this JSON file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gguf_path = args.gguf.resolve()
    if not gguf_path.is_file():
        print(f"error: {gguf_path} is not a file")
        return 2
    report: dict = {"gguf": str(gguf_path), "info": step_info(gguf_path)}
    prompts = build_prompts(gguf_path, args.prompts)[:args.num_prompts]
    report["parity"] = step_parity(gguf_path, prompts, args.max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = args.prompts
        if prompts_file is None:
            prompts_file = str(Path(tmp) / "prompts.jsonl")
            Path(prompts_file).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        report["bench"] = step_bench(gguf_path, prompts_file, len(prompts), args.k, args.max_new_tokens)
    report["failures"] = failures
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\n{len(failures)} failure(s)" + (": " + "; ".join(failures) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
