"""Train a zoo preset: corpus -> tokenizer -> target -> draft (distilled) -> HF folders, manifest, prompts.

    paths = train_preset("tiny", out="/tmp/tiny", device="cuda")     # or: python -m workbench zoo train tiny

Runs on CPU (fp32, eager) and CUDA (bf16 autocast over fp32 master weights, torch.compile if the preset asks;
compilation that fails falls back to eager and is recorded). Seeds fix initialisation and batch order; a time
budget makes the step count depend on the machine, and GPU kernels are not bitwise deterministic, so two runs
agree closely, not exactly. Everything is written to a staging folder beside `out` and moved into place at the
end, so a crashed run never leaves a half-written preset where `resolve_preset` looks.
"""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from workbench.zoo.corpus import Corpus, CorpusError, load_corpus, path_bucket
from workbench.zoo.heldout_prompts import select_prompts, summarize, write_jsonl
from workbench.zoo.presets import (ModelSpec, PresetPaths, TrainSpec, ZooError, ZooPreset, get_preset, preset_home,
                                   resolve_dir)
from workbench.zoo.tokenizer import EOT, encode_documents, save_tokenizer, train_tokenizer

MANIFEST_VERSION = 1
CURVE_POINTS = 40  # train-loss samples kept in the manifest per model


@dataclass
class ModelReport:
    """What one model's training did; goes to manifest.json under "target" / "draft"."""

    params: int
    steps: int = 0
    tokens_seen: int = 0
    stopped_by: str = ""  # "max_seconds" | "max_steps"
    first_step_seconds: float = 0.0  # includes torch.compile when on
    train_seconds: float = 0.0  # whole loop, first step included
    tokens_per_s: float = 0.0  # steady state: after the first step
    compiled: bool = False
    compile_error: str | None = None
    final_train_ce: float = float("nan")
    heldout_loss: float = float("nan")
    heldout_ppl: float = float("nan")
    heldout_tokens: int = 0
    train_curve: list[dict] | None = None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _autocast(device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def build_model(spec: ModelSpec, vocab_size: int, eot_id: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**spec.hf_config(vocab_size, eot_id))
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def lr_at(step: int, progress: float, spec: TrainSpec) -> float:
    """Cosine from lr to min_lr_ratio * lr as progress goes 0 -> 1, times a linear warmup over warmup_steps.

    A product rather than warmup-then-cosine: a budget that ends inside the warmup still decays smoothly.
    """
    warmup = min(1.0, (step + 1) / spec.warmup_steps) if spec.warmup_steps > 0 else 1.0
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return spec.lr * warmup * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * cosine)


def _optimizer(model: torch.nn.Module, spec: TrainSpec, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, fused=device.type == "cuda")


def _distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(teacher_T || student_T), mean over tokens. Both logits [N, V]."""
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature**2


def train_model(model, stream: torch.Tensor, spec: TrainSpec, preset: ZooPreset, device: torch.device, seed: int,
                teacher=None, log: Callable[[str], None] = print, role: str = "model") -> ModelReport:
    """Train in place on random windows of `stream` ([N] int32 token ids, on `device`)."""
    report = ModelReport(params=sum(p.numel() for p in model.parameters()))
    seq_len = min(preset.seq_len, len(stream) - 2)
    batch = preset.batch_size
    if seq_len < 2:
        raise ZooError(f"training stream has {len(stream)} tokens: too few for one window")
    model.to(device).train()
    forward = model
    if preset.compile and device.type == "cuda":
        forward = torch.compile(model)
        report.compiled = True
    optimizer = _optimizer(model, spec, device)
    generator = torch.Generator(device=device).manual_seed(seed)  # on the device: no host sync per batch
    window = torch.arange(seq_len + 1, device=device)  # [T+1]
    n_starts = len(stream) - seq_len
    alpha = preset.distill.alpha if teacher is not None else 0.0
    curve: list[dict] = []
    ce_sum = torch.zeros((), device=device)
    ce_count, last_log_tokens = 0, 0
    log_every_s = max(0.5, spec.max_seconds / CURVE_POINTS)

    t_loop = time.perf_counter()
    t_steady = t_last_log = t_loop
    step, steady_tokens = 0, 0
    while True:
        steady_elapsed = time.perf_counter() - t_steady if step > 0 else 0.0
        if step >= spec.max_steps or steady_elapsed >= spec.max_seconds:
            report.stopped_by = "max_steps" if step >= spec.max_steps else "max_seconds"
            break
        lr = lr_at(step, max(step / spec.max_steps, steady_elapsed / spec.max_seconds), spec)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, n_starts, (batch,), generator=generator, device=device)  # [B]
        tokens = stream[starts[:, None] + window].long()  # [B, T+1]
        input_ids, labels = tokens[:, :-1], tokens[:, 1:]  # [B, T] each
        try:
            ce = _forward_backward(forward, teacher, input_ids, labels, alpha, preset, device)
        except Exception as e:  # noqa: BLE001 - compilation failures surface in the first forward/backward
            if step > 0 or forward is model:
                raise
            report.compiled, report.compile_error = False, f"{type(e).__name__}: {e}"[:2000]
            log(f"[{role}] torch.compile failed, training eager: {report.compile_error.splitlines()[0]}")
            forward = model
            optimizer.zero_grad(set_to_none=True)
            ce = _forward_backward(forward, teacher, input_ids, labels, alpha, preset, device)
        if spec.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ce_sum += ce.detach()
        ce_count += 1
        step += 1
        report.tokens_seen += batch * seq_len
        if step == 1:
            _sync(device)
            t_steady = t_last_log = time.perf_counter()
            report.first_step_seconds = t_steady - t_loop
            steady_tokens = report.tokens_seen
        now = time.perf_counter()
        if now - t_last_log >= log_every_s or step >= spec.max_steps:
            mean_ce = (ce_sum / ce_count).item()  # the one host sync per log interval
            now = time.perf_counter()
            rate = (report.tokens_seen - last_log_tokens) / max(now - t_last_log, 1e-9)
            curve.append({"step": step, "tokens": report.tokens_seen, "seconds": round(now - t_loop, 2),
                          "train_ce": round(mean_ce, 4), "lr": lr})
            log(f"[{role}] step {step:6d}  ce {mean_ce:.4f}  lr {lr:.2e}  {rate / 1e6:.3f} M tok/s  "
                f"{now - t_loop:6.1f} s")
            ce_sum.zero_()
            ce_count, last_log_tokens, t_last_log = 0, report.tokens_seen, now
    _sync(device)
    t_end = time.perf_counter()
    report.steps = step
    report.train_seconds = t_end - t_loop
    if step > 1:
        report.tokens_per_s = (report.tokens_seen - steady_tokens) / max(t_end - t_steady, 1e-9)
    if ce_count:
        curve.append({"step": step, "tokens": report.tokens_seen, "seconds": round(t_end - t_loop, 2),
                      "train_ce": round((ce_sum / ce_count).item(), 4), "lr": lr})
    report.final_train_ce = curve[-1]["train_ce"] if curve else float("nan")
    report.train_curve = _thin(curve, CURVE_POINTS)
    model.eval()
    return report


def _forward_backward(forward, teacher, input_ids, labels, alpha, preset, device) -> torch.Tensor:
    """Backpropagate the step's loss; returns the data cross-entropy (a 0-d tensor, no host sync)."""
    loss, ce = _step_loss(forward, teacher, input_ids, labels, alpha, preset, device)
    loss.backward()
    return ce


def _step_loss(forward, teacher, input_ids, labels, alpha, preset, device):
    with _autocast(device):
        logits = forward(input_ids=input_ids, use_cache=False).logits  # [B, T, V]
    logits = logits.flatten(0, 1)  # [B*T, V]
    ce = F.cross_entropy(logits.float(), labels.flatten())
    if alpha <= 0:
        return ce, ce
    with torch.no_grad(), _autocast(device):
        teacher_logits = teacher(input_ids=input_ids, use_cache=False).logits.flatten(0, 1)  # [B*T, V]
    kl = _distill_kl(logits, teacher_logits, preset.distill.temperature)
    return (1 - alpha) * ce + alpha * kl, ce


def _thin(curve: list[dict], points: int) -> list[dict]:
    if len(curve) <= points:
        return curve
    idx = np.linspace(0, len(curve) - 1, points).round().astype(int)
    return [curve[i] for i in sorted(set(idx.tolist()))]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, batch: int, max_tokens: int, device: torch.device) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) over non-overlapping windows spread evenly over the held-out stream.

    Returns (loss, number of scored tokens); the same windows for every model scored on the same stream.
    """
    model.eval()
    seq_len = min(seq_len, len(stream) - 1)
    n_windows = max(1, min((len(stream) - 1) // seq_len, max_tokens // seq_len))
    stride = (len(stream) - 1) // n_windows  # >= seq_len
    starts = torch.arange(n_windows, device=device) * stride  # [W]
    window = torch.arange(seq_len + 1, device=device)  # [T+1]
    total, count = torch.zeros((), device=device, dtype=torch.float64), 0
    for i in range(0, n_windows, batch):
        tokens = stream[starts[i : i + batch, None] + window].long()  # [b, T+1]
        with _autocast(device):
            logits = model(input_ids=tokens[:, :-1], use_cache=False).logits  # [b, T, V]
        total += F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum").double()
        count += tokens[:, 1:].numel()
    return (total / count).item(), count


def _round_to(model, dtype_name: str) -> None:
    """Round weights to the on-disk dtype so held-out metrics describe the saved model."""
    if dtype_name == "bfloat16":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(p.dtype))


def _save_model(model, folder: Path, dtype_name: str, tokenizer, seq_len: int) -> None:
    dtype = getattr(torch, dtype_name)
    model.to(device="cpu", dtype=dtype)
    model.config.dtype = dtype_name
    model.save_pretrained(str(folder))
    save_tokenizer(tokenizer, folder, model_max_length=seq_len)
    if not (folder / "model.safetensors").is_file():
        raise ZooError(f"save_pretrained wrote no {folder / 'model.safetensors'}: {sorted(os.listdir(folder))}")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    # a copied tree without history answers "HEAD" with a non-zero status
    return commit if out.returncode == 0 and len(commit) == 40 else None


def _tokenizer_texts(corpus: Corpus, max_bytes: int) -> list[str]:
    """Training files in path-hash order until max_bytes: a spread sample of every source."""
    texts, total = [], 0
    for f in sorted(corpus.train, key=lambda f: path_bucket(f.relpath, "tokenizer")):
        if total >= max_bytes:
            break
        texts.append(f.text)
        total += f.nbytes
    return texts


def _prepare_out(out: Path) -> Path:
    if out.exists() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise ZooError(f"refusing to replace {out}: it is not empty and holds no manifest.json (not a zoo preset)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def train_preset(preset: str | ZooPreset, out: str | Path | None = None, *, device: str | None = None,
                 max_seconds: float | None = None, max_steps: int | None = None,
                 log: Callable[[str], None] = print) -> PresetPaths:
    """Train target then draft and write a complete preset folder to `out` (default: the preset's home).

    max_seconds: total training budget, split between target and draft in the preset's proportions.
    max_steps: cap on optimizer steps per model (for smoke runs).
    """
    import tokenizers
    import transformers

    preset = get_preset(preset) if isinstance(preset, str) else preset
    out = Path(out) if out is not None else preset_home(preset.name)
    device_t = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device_t.type == "cuda" and not torch.cuda.is_available():
        raise ZooError("--device cuda asked for, but torch.cuda.is_available() is False")
    target_train, draft_train = preset.target_train, preset.draft_train
    if max_seconds is not None:
        share = target_train.max_seconds / (target_train.max_seconds + draft_train.max_seconds)
        target_train = replace(target_train, max_seconds=max_seconds * share)
        draft_train = replace(draft_train, max_seconds=max_seconds * (1 - share))
    if max_steps is not None:
        target_train = replace(target_train, max_steps=max_steps)
        draft_train = replace(draft_train, max_steps=max_steps)
    transformers.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    staging = _prepare_out(out)
    try:
        log(f"[zoo] preset {preset.name} -> {out} on {device_t} ({_device_name(device_t)})")
        try:
            corpus = load_corpus(preset.corpus)
        except CorpusError as e:
            raise ZooError(str(e)) from None
        cm = corpus.manifest()
        log(f"[zoo] corpus: {cm['files']} files ({cm['train_files']} train, {cm['heldout_files']} held out), "
            f"{cm['bytes'] / 1e6:.1f} MB, read in {time.perf_counter() - t0:.1f} s")
        t = time.perf_counter()
        tokenizer = train_tokenizer(_tokenizer_texts(corpus, preset.tokenizer_train_bytes), preset.vocab_size)
        eot_id = tokenizer.token_to_id(EOT)
        tokenizer_seconds = time.perf_counter() - t
        t = time.perf_counter()
        train_np = encode_documents(tokenizer, [f.text for f in corpus.train])
        heldout_np = encode_documents(tokenizer, [f.text for f in corpus.heldout])
        encode_seconds = time.perf_counter() - t
        log(f"[zoo] tokenizer {tokenizer.get_vocab_size()} tokens in {tokenizer_seconds:.1f} s; encoded "
            f"{len(train_np):,} train + {len(heldout_np):,} held-out tokens in {encode_seconds:.1f} s")
        train_stream = torch.from_numpy(train_np.astype(np.int32)).to(device_t)  # [N_train]
        heldout_stream = torch.from_numpy(heldout_np.astype(np.int32)).to(device_t)  # [N_heldout]
        vocab = tokenizer.get_vocab_size()

        reports: dict[str, ModelReport] = {}
        models = {}
        for role, spec, train_spec, seed in (("target", preset.target, target_train, preset.seed),
                                             ("draft", preset.draft, draft_train, preset.seed + 1)):
            model = build_model(spec, vocab, eot_id, seed)
            teacher = models.get("target") if role == "draft" and preset.distill.alpha > 0 else None
            report = train_model(model, train_stream, train_spec, preset, device_t, seed + 1000, teacher=teacher,
                                 log=log, role=role)
            _round_to(model, preset.save_dtype)
            report.heldout_loss, report.heldout_tokens = evaluate(
                model, heldout_stream, preset.seq_len, preset.batch_size, preset.eval_tokens, device_t)
            report.heldout_ppl = math.exp(report.heldout_loss)
            log(f"[{role}] {report.params / 1e6:.2f} M params, {report.steps} steps, {report.tokens_seen / 1e6:.1f} M "
                f"tokens, {report.tokens_per_s / 1e6:.3f} M tok/s, held-out loss {report.heldout_loss:.4f} "
                f"(ppl {report.heldout_ppl:.2f}) over {report.heldout_tokens:,} tokens")
            models[role], reports[role] = model, report

        for role, model in models.items():
            _save_model(model, staging / role, preset.save_dtype, tokenizer, preset.seq_len)
        prompts = select_prompts([(f.relpath, f.text) for f in corpus.heldout],
                                 lambda text: len(tokenizer.encode(text).ids),
                                 preset.num_prompts, preset.prompt_max_tokens, preset.seed)
        write_jsonl(staging / "prompts.jsonl", prompts)
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "preset": preset.name,
            "preset_config": preset.to_dict(),
            "budget": {"target": asdict(target_train), "draft": asdict(draft_train)},
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seed": preset.seed,
            "device": device_t.type,
            "device_name": _device_name(device_t),
            "python_version": sys.version.split()[0],
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "tokenizers_version": tokenizers.__version__,
            "git_commit": _git_commit(),
            "corpus": cm,
            "tokenizer": {
                "vocab_size": vocab, "eot_token": EOT, "eot_id": eot_id, "adds_bos": True,
                "train_bytes_sample": preset.tokenizer_train_bytes, "seconds": round(tokenizer_seconds, 2),
                "train_tokens": int(len(train_np)), "heldout_tokens": int(len(heldout_np)),
                "bytes_per_token": round(cm["train_bytes"] / max(1, len(train_np)), 3),
                "encode_seconds": round(encode_seconds, 2),
            },
            "target": asdict(reports["target"]),
            "draft": asdict(reports["draft"]),
            "distill": asdict(preset.distill) if preset.distill.alpha > 0 else None,
            "prompts": summarize(prompts),
            "total_seconds": round(time.perf_counter() - t0, 2),
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, allow_nan=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"[zoo] wrote {out} in {time.perf_counter() - t0:.1f} s")
    return resolve_dir(out, preset.name)
