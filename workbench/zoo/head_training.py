"""What every draft-head trainer of `zoo train-head` shares (ReDrafter: train_head.py, EAGLE: train_eagle.py).

A kind brings its recipe (a `HeadRecipe` subclass), its untrained head, its loss and its held-out evaluation; this
module does the rest:

- **data**: windows of `seq_len` tokens. `data="corpus"`: the preset's corpus encoded with the target's tokenizer
  (train windows from training files, held-out windows from held-out files). `data="self"`: self-distillation, the
  target's own greedy continuations of prompts cut from those windows (their first `self_prompt_tokens` tokens),
  generated once by the engine's autoregressive loop and cached under `<head folder>/cache/` keyed by the target's
  fingerprint; held-out windows are continuations of held-out prompts.
- **budgets**: `max_steps`, `max_seconds` (the loop's wall time, evaluations included) and `max_tokens` (training
  tokens seen: steps x batch_size x seq_len); whichever comes first stops, and the cosine schedule follows whichever
  is furthest along.
- **held-out curve**: every `eval_every` steps (and once at the end) the kind's evaluation on the held-out windows:
  teacher-forced top-1 agreement by depth and the expected accepted tokens of a greedy chain; each point goes to the
  manifest's curve and to a progress line with the percentage done and an ETA by the binding budget.
- **best weights, early stopping**: the saved head is the evaluation with the highest expected accepted tokens;
  with `patience` K > 0 training stops after K evaluations without improvement.
- **resume**: `<head folder>/train_state.pt` (written at every evaluation and at the end) holds the head's current
  weights, the optimizer state, the batch sampler's state, the counters, the curves and the best weights so far;
  `resume=True` continues from it, refusing a checkpoint of another kind, target or recipe (budgets, `eval_every` and
  `patience` may change). An interrupted run resumed with the same budgets gives the uninterrupted run's weights.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from workbench.zoo.corpus import Corpus, CorpusError, load_corpus
from workbench.zoo.heads import HEAD_MANIFEST, target_fingerprint
from workbench.zoo.presets import ZooError, get_preset, preset_home, resolve_dir
from workbench.zoo.tokenizer import encode_documents, load_tokenizer

HEAD_MANIFEST_VERSION = 2  # 2 adds train.tokens_seen, heldout.curve, data, device_name; version 1 still loads
CHECKPOINT = "train_state.pt"
CHECKPOINT_VERSION = 1
SELF_CACHE = "cache"  # beside the head: self-distillation windows, keyed by the target's fingerprint
CURVE_POINTS = 40
DATA_SOURCES = ("corpus", "self")
STOP_REASONS = ("max_steps", "max_seconds", "max_tokens", "early_stop")
RUN_CONTROL = ("max_seconds", "max_steps", "max_tokens", "eval_every", "patience")  # may change on --resume


class RecipeError(ZooError):
    """A recipe field that cannot train (a negative budget, an unknown data source, ...)."""


class ResumeError(ZooError):
    """`--resume` without a checkpoint, or with one of another kind, target or recipe."""


@dataclass(frozen=True)
class HeadRecipe:
    """The fields every head recipe has; every field goes to the manifest. AdamW, linear warmup then cosine to
    min_lr_ratio * lr."""

    depth: int = 4  # depths trained and evaluated
    seq_len: int = 128  # window length T (anchors per window: T - depth)
    batch_size: int = 8  # windows per step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_seconds: float = 240.0  # wall time of the training loop (2 CPU cores: a few hundred steps)
    max_steps: int = 1_000_000
    max_tokens: int | None = None  # training tokens seen (steps x batch_size x seq_len); None = no token budget
    eval_every: int = 50  # steps between held-out evaluations; 0 = only at the end
    patience: int = 0  # stop after this many evaluations without a better expected accepted tokens; 0 = never
    train_windows: int = 4096  # windows cut from training files (files in path-hash order)
    eval_windows: int = 32  # held-out windows scored (the same ones every time)
    data: str = "corpus"  # "corpus" | "self" (the target's greedy continuations of corpus prompts)
    self_prompt_tokens: int = 32  # data="self": corpus tokens each window starts from
    self_tokens: int | None = None  # data="self": training tokens generated (None: train_windows x seq_len)
    seed: int = 1234

    def __post_init__(self) -> None:
        positive = ("depth", "seq_len", "batch_size", "max_seconds", "max_steps", "train_windows", "eval_windows",
                    "self_prompt_tokens")
        for name in positive:
            if not getattr(self, name) > 0:
                raise RecipeError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_tokens", "self_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise RecipeError(f"{name} must be > 0 (or unset for no limit), got {value}")
        for name in ("lr", "weight_decay", "warmup_steps", "eval_every", "patience", "seed"):
            if not getattr(self, name) >= 0:
                raise RecipeError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.data not in DATA_SOURCES:
            raise RecipeError(f"data must be one of {', '.join(DATA_SOURCES)}, got {self.data!r}")
        if self.seq_len <= self.depth:
            raise RecipeError(f"seq_len ({self.seq_len}) must exceed depth ({self.depth}): no anchor would remain")
        if self.data == "self" and self.self_prompt_tokens >= self.seq_len:
            raise RecipeError(f"self_prompt_tokens ({self.self_prompt_tokens}) must be below seq_len ({self.seq_len}):"
                              " nothing would be generated")
        if self.patience and not self.eval_every:
            raise RecipeError("patience needs evaluations during training: set eval_every > 0")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass
class HeadEval:
    agreement_by_depth: list[float]  # [L]: teacher-forced top-1 agreement with the target at depth d
    expected_accepted_tokens: float  # mean leading run of agreeing depths (greedy chain of L)
    anchors: int


# ---------------------------------------------------------------------------------------------------------- data

def token_windows(corpus_files, tokenizer, n_windows: int, seq_len: int, salt: str) -> torch.Tensor:
    """[N, T] long: non-overlapping windows of the encoded stream of files taken in path-hash order (N <= n)."""
    from workbench.zoo.corpus import path_bucket

    files = sorted(corpus_files, key=lambda f: path_bucket(f.relpath, salt))
    need, parts, have = n_windows * seq_len, [], 0
    for start in range(0, len(files), 64):
        if have >= need:
            break
        part = encode_documents(tokenizer, [f.text for f in files[start : start + 64]])
        parts.append(part)
        have += len(part)
    stream = np.concatenate(parts)[: (min(have, need) // seq_len) * seq_len].astype(np.int64)
    if len(stream) < seq_len:
        raise ZooError(f"corpus too small for one {seq_len}-token window")
    return torch.from_numpy(stream).view(-1, seq_len)


@torch.no_grad()
def greedy_continuations(target, prompts: torch.Tensor, new_tokens: int, device: torch.device,
                         batch: int) -> torch.Tensor:
    """prompts [N, P] -> [N, P + new_tokens]: each prompt followed by the target's greedy continuation, decoded by
    the engine's autoregressive loop (no drafter)."""
    from workbench.engine.step import EngineConfig, SpecEngine

    engine = SpecEngine(target, None, EngineConfig(max_new_tokens=new_tokens), device)
    rows = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch].tolist()
        outputs = engine.generate(chunk).outputs
        rows.extend(p + o for p, o in zip(chunk, outputs))
    return torch.tensor(rows, dtype=torch.long)


def self_windows(target, prompt_windows: torch.Tensor, spec: HeadRecipe, cache_dir: Path, key: dict,
                 device: torch.device, log: Callable[[str], None], tag: str) -> tuple[torch.Tensor, dict]:
    """The target's greedy continuations of the first `self_prompt_tokens` of each window, loaded from `cache_dir`
    when a file of the same key (target fingerprint, prompts, lengths) is there; (windows [N, T], info)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir / f"self_{key['split']}_{digest}.pt"
    if path.is_file():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("key") == key:
            log(f"[{tag}] self-distillation {key['split']} windows from the cache {path}")
            return saved["windows"], {"cache": str(path), "cached": True, "generation_seconds": 0.0}
    prompts = prompt_windows[:, : spec.self_prompt_tokens]
    t0 = time.perf_counter()
    batch = 512 if device.type == "cuda" else 16
    log(f"[{tag}] generating {len(prompts)} {key['split']} windows: the target's greedy continuation of "
        f"{spec.self_prompt_tokens}-token corpus prompts to {spec.seq_len} tokens")
    windows = greedy_continuations(target, prompts, spec.seq_len - spec.self_prompt_tokens, device, batch)
    seconds = time.perf_counter() - t0
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"key": key, "windows": windows}, tmp)
    os.replace(tmp, path)
    log(f"[{tag}] generated {windows.numel() - prompts.numel()} tokens in {seconds:.1f} s -> {path}")
    return windows, {"cache": str(path), "cached": False, "generation_seconds": round(seconds, 2)}


def load_training_data(preset: str, preset_dir, device: str, spec: HeadRecipe, corpus: Corpus | None, log, tag: str,
                       out: Path | None = None):
    """(paths, device, frozen float32 target, corpus, train windows, held-out windows on the device, data info) for a
    head of `preset`. Corpus windows are salted "redrafter" for every kind, so their held-out figures compare;
    `out` is the head folder (whose cache holds self-distillation windows; default `<preset folder>/<tag>`)."""
    from workbench.models import load_model, tokenizer_fingerprint

    zoo_preset = get_preset(preset)
    paths = resolve_dir(preset_dir, preset) if preset_dir else resolve_dir(preset_home(preset), preset)
    dev = torch.device(device)
    torch.manual_seed(spec.seed)
    target = load_model(paths.target_dir, dtype=torch.float32, device=dev).eval()
    tokenizer = load_tokenizer(paths.tokenizer_path)
    if corpus is None:
        try:
            corpus = load_corpus(zoo_preset.corpus)
        except CorpusError as e:
            raise ZooError(str(e)) from None
    n_train = spec.train_windows
    if spec.data == "self" and spec.self_tokens is not None:
        n_train = max(1, spec.self_tokens // spec.seq_len)
    train_w = token_windows(corpus.train, tokenizer, n_train, spec.seq_len, "redrafter")
    eval_w = token_windows(corpus.heldout, tokenizer, spec.eval_windows, spec.seq_len, "redrafter-eval")
    info: dict = {"source": spec.data}
    if spec.data == "self":
        out = Path(out) if out is not None else paths.root / tag
        base = {"target_id": target_fingerprint(paths.target_dir)["id"],
                "tokenizer_sha256": tokenizer_fingerprint(paths.target_dir), "seq_len": spec.seq_len,
                "prompt_tokens": spec.self_prompt_tokens, "corpus_files_sha256": corpus.manifest()["files_sha256"]}
        train_w, ti = self_windows(target, train_w, spec, out / SELF_CACHE, {**base, "split": "train",
                                   "windows": len(train_w)}, dev, log, tag)
        eval_w, ei = self_windows(target, eval_w, spec, out / SELF_CACHE, {**base, "split": "heldout",
                                  "windows": len(eval_w)}, dev, log, tag)
        info.update({"prompt_tokens": spec.self_prompt_tokens,
                     "generated_tokens": len(train_w) * (spec.seq_len - spec.self_prompt_tokens),
                     "train_cache": os.path.relpath(ti["cache"], out),
                     "heldout_cache": os.path.relpath(ei["cache"], out),
                     "cached": ti["cached"] and ei["cached"],
                     "generation_seconds": round(ti["generation_seconds"] + ei["generation_seconds"], 2)})
    info.update({"train_windows": len(train_w), "heldout_windows": len(eval_w), "seq_len": spec.seq_len})
    eval_w = eval_w.to(dev)
    log(f"[{tag}] {preset}: {len(train_w)} train / {len(eval_w)} held-out windows of {spec.seq_len} tokens "
        f"({spec.data}) on {dev}")
    return paths, dev, target, corpus, train_w, eval_w, info


def token_ranking(windows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] every token id, most frequent in `windows` first (ties, and unseen ids, in id order).

    >>> token_ranking(torch.tensor([[3, 3, 1, 2, 2, 2]]), 5).tolist()
    [2, 3, 1, 0, 4]
    """
    counts = torch.bincount(windows.flatten().cpu(), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.float64) / (vocab_size + 1)  # stable tie-break, lower id first
    return counts.argsort(descending=True)


def rank_tokens(head, windows: torch.Tensor) -> None:
    """The head's token ranking (hot_vocab) from the training windows; saved beside it as hot_tokens.safetensors."""
    head.set_hot_tokens(token_ranking(windows, head.hot_tokens.numel()))  # an untrained head's: id order, all ids


# ---------------------------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def target_pass(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] -> (hidden [B, T, H], target log-probs [B, T, V] float32)."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    hidden = target(ids, positions)
    return hidden, torch.log_softmax(target.compute_logits(hidden).float(), -1)


@torch.no_grad()
def agreement(target, windows: torch.Tensor, depth: int, predict, batch: int = 8) -> HeadEval:
    """Held-out top-1 agreement of a head with the target, for every head kind: `predict(ids [B, T], hidden [B, T, H])`
    returns per depth d = 1..depth the head's scores [B, N, V] (logits or log-probs, N = T - depth) for the token at
    t + d, compared with the target's argmax there; plus the mean leading run of agreeing depths."""
    agree = torch.zeros(depth, dtype=torch.float64)
    run_total, anchors = 0.0, 0
    for i in range(0, len(windows), batch):
        ids = windows[i : i + batch]
        hidden, target_logp = target_pass(target, ids)
        n = ids.shape[1] - depth
        hits = torch.stack([q.argmax(-1) == target_logp[:, d : d + n].argmax(-1)
                            for d, q in enumerate(predict(ids, hidden), start=1)], -1)  # [B, N, L]
        agree += hits.double().sum((0, 1)).cpu()
        run_total += hits.long().cumprod(-1).sum().item()  # leading run of agreeing depths, summed over anchors
        anchors += hits.shape[0] * hits.shape[1]
    return HeadEval([round(x, 4) for x in (agree / anchors).tolist()], round(run_total / anchors, 4), anchors)


# ------------------------------------------------------------------------------------------------------ training

def lr_at(step: int, progress: float, spec: HeadRecipe) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * cosine)


def progress(step: int, tokens: int, seconds: float, spec: HeadRecipe) -> tuple[float, str]:
    """(fraction of the run done, the budget furthest along: the one that will stop it)."""
    parts = {"max_steps": step / spec.max_steps, "max_seconds": seconds / spec.max_seconds}
    if spec.max_tokens is not None:
        parts["max_tokens"] = tokens / spec.max_tokens
    name = max(parts, key=parts.get)
    return min(1.0, parts[name]), name


def budget_reached(step: int, tokens: int, seconds: float, spec: HeadRecipe) -> str | None:
    if step >= spec.max_steps:
        return "max_steps"
    if spec.max_tokens is not None and tokens >= spec.max_tokens:
        return "max_tokens"
    if seconds >= spec.max_seconds:
        return "max_seconds"
    return None


def fmt_duration(seconds: float) -> str:
    """A duration as the progress line prints it.

    >>> fmt_duration(8.6), fmt_duration(75.4), fmt_duration(3725)
    ('9s', '1m15s', '1h02m')
    """
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@dataclass
class Checkpoint:
    """Where to keep the training state, and what a checkpoint must match to be resumed."""

    path: Path
    identity: dict  # {"kind", "target_id", "tokenizer_sha256"}

    def save(self, state: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        torch.save({"checkpoint_version": CHECKPOINT_VERSION, **self.identity, **state}, tmp)
        os.replace(tmp, self.path)  # a run killed mid-write keeps the previous checkpoint


def recipe_differences(saved: dict, spec: HeadRecipe) -> list[str]:
    now = asdict(spec)
    return [f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" for k in sorted(set(saved) | set(now))
            if k not in RUN_CONTROL and saved.get(k) != now.get(k)]


def load_checkpoint(ckpt: Checkpoint, spec: HeadRecipe) -> dict:
    """The checkpoint at `ckpt.path` if it continues this run; ResumeError naming what differs otherwise."""
    if not ckpt.path.is_file():
        raise ResumeError(f"--resume: no checkpoint {ckpt.path}; train without --resume first (a checkpoint is "
                          "written at every evaluation and at the end of a run)")
    try:
        state = torch.load(ckpt.path, map_location="cpu", weights_only=False)  # the sampler's state stays on the CPU
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same advice
        raise ResumeError(f"--resume: checkpoint {ckpt.path} is unreadable ({e}); train without --resume") from None
    for key, what in (("kind", "head kind"), ("target_id", "target"), ("tokenizer_sha256", "tokenizer")):
        if state.get(key) != ckpt.identity[key]:
            raise ResumeError(f"--resume: checkpoint {ckpt.path} is for {what} {state.get(key)!r}, not "
                              f"{ckpt.identity[key]!r}; train without --resume or pick another --out")
    diff = recipe_differences(state["recipe"], spec)
    if diff:
        raise ResumeError(f"--resume: the recipe differs from checkpoint {ckpt.path} in {', '.join(diff)}; only "
                          f"{', '.join(RUN_CONTROL)} may change on resume")
    return state


def distil(head, target, windows: torch.Tensor, spec: HeadRecipe, loss_fn, *, tag: str, metric: str,
           log: Callable[[str], None] = print, evaluate: Callable | None = None,
           eval_windows: torch.Tensor | None = None, checkpoint: Checkpoint | None = None,
           resume: dict | None = None) -> dict:
    """The training loop every head kind shares: AdamW on `head` against the frozen `target`, `spec.batch_size`
    random windows per step (seeded by `spec.seed`), `loss_fn(head, target, ids [B, T], spec)` -> scalar, warmup then
    cosine (`lr_at`), gradient clipping, bf16 autocast on a GPU, until a budget or early stopping. With `evaluate(head, target, windows,
    depth)` -> HeadEval and `eval_windows`, the held-out curve is taken every `spec.eval_every` steps and at the end,
    and `head` ends with the best evaluation's weights. `checkpoint`: where the state is saved at each evaluation
    and at the end; `resume`: a state `load_checkpoint` returned, continued from.

    Returns {"steps", "tokens_seen", "train_seconds", "final_<metric>" (None unless finite), "stopped_by", "curve",
    "eval_curve", "best"}: `curve` holds about CURVE_POINTS entries {"step", "seconds", <metric>, "lr"}, each the
    loss averaged since the previous one; `eval_curve` {"step", "tokens", "seconds", "agreement_by_depth",
    "expected_accepted_tokens"} per evaluation; `best` the best evaluation (None without evaluations)."""
    for p in target.parameters():
        p.requires_grad_(False)
    head.train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    generator = torch.Generator().manual_seed(spec.seed)
    st = {"step": 0, "tokens": 0, "seconds": 0.0, "curve": [], "eval_curve": [], "best": None, "best_head": None,
          "since_best": 0}
    if resume is not None:
        head.load_state_dict(resume["head"])
        optimizer.load_state_dict(resume["optimizer"])
        generator.set_state(resume["generator"])
        st.update({k: resume[k] for k in st})
    start_step, start_tokens = st["step"], st["tokens"]
    evaluating = evaluate is not None and eval_windows is not None
    loss_sum, loss_count = 0.0, 0
    log_every_s = max(0.5, spec.max_seconds / CURVE_POINTS)
    t0 = t_last = time.perf_counter()
    base_seconds = st["seconds"]
    lr = spec.lr
    dev = next(target.parameters()).device
    autocast = dev.type == "cuda"  # as `zoo train`: bf16 matmuls over fp32 weights on a GPU; evaluations stay fp32

    def elapsed() -> float:
        return base_seconds + time.perf_counter() - t0

    def status(now_s: float) -> str:
        frac, binding = progress(st["step"], st["tokens"], now_s, spec)
        start_frac = progress(start_step, start_tokens, base_seconds, spec)[0]
        run_s = now_s - base_seconds
        eta = run_s * (1 - frac) / (frac - start_frac) if frac > start_frac else float("nan")
        eta_s = fmt_duration(eta) if math.isfinite(eta) else "?"
        return f"{100 * frac:5.1f}%  ETA {eta_s} ({binding})  step {st['step']:5d}  tokens {st['tokens']:,}"

    def save_state() -> None:
        if checkpoint is not None:
            checkpoint.save({"recipe": asdict(spec), "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                             "generator": generator.get_state(), **{k: st[k] for k in st}})

    def run_eval() -> str:
        """Evaluate, update the curve and the best weights; returns the progress line (logged once saved)."""
        head.eval()
        ev = evaluate(head, target, eval_windows, spec.depth)
        head.train()
        point = {"step": st["step"], "tokens": st["tokens"], "seconds": round(elapsed(), 2),
                 "agreement_by_depth": ev.agreement_by_depth, "expected_accepted_tokens": ev.expected_accepted_tokens}
        st["eval_curve"].append(point)
        if st["best"] is None or ev.expected_accepted_tokens > st["best"]["expected_accepted_tokens"]:
            st["best"], st["since_best"] = point, 0
            st["best_head"] = {k: v.detach().clone() for k, v in head.state_dict().items()}
        else:
            st["since_best"] += 1
        agree = "/".join(f"{a:.3f}" for a in ev.agreement_by_depth)
        return (f"[{tag}] {status(point['seconds'])}  held-out agreement by depth {agree}  expected accepted "
                f"{ev.expected_accepted_tokens:.3f} (best {st['best']['expected_accepted_tokens']:.3f} at step "
                f"{st['best']['step']})")

    stopped_by = budget_reached(st["step"], st["tokens"], st["seconds"], spec)
    if stopped_by == "max_seconds" and st["step"] == start_step == 0:
        stopped_by = None  # a fresh run takes at least one step
    while stopped_by is None:
        frac = progress(st["step"], st["tokens"], elapsed(), spec)[0]
        lr = lr_at(st["step"], frac, spec)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = windows[torch.randint(0, len(windows), (spec.batch_size,), generator=generator)].to(dev)  # [B, T]
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(head, target, ids, spec)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        st["step"] += 1
        st["tokens"] += spec.tokens_per_step
        loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1
        now = time.perf_counter()
        if now - t_last >= log_every_s:
            st["curve"].append({"step": st["step"], "seconds": round(elapsed(), 2),
                                metric: round(loss_sum / loss_count, 4), "lr": lr})
            log(f"[{tag}] {status(elapsed())}  {metric} {loss_sum / loss_count:.4f}  lr {lr:.2e}")
            loss_sum, loss_count, t_last = 0.0, 0, now
        if evaluating and spec.eval_every and st["step"] % spec.eval_every == 0:
            line = run_eval()
            if spec.patience and st["since_best"] >= spec.patience:
                stopped_by = "early_stop"
            st["seconds"] = elapsed()
            save_state()  # before the line: a run killed after it resumes from here
            log(line)
        if stopped_by is None:
            stopped_by = budget_reached(st["step"], st["tokens"], elapsed(), spec)
    if loss_count:
        st["curve"].append({"step": st["step"], "seconds": round(elapsed(), 2),
                            metric: round(loss_sum / loss_count, 4), "lr": lr})
    if evaluating and (not st["eval_curve"] or st["eval_curve"][-1]["step"] != st["step"]):
        log(run_eval())
    st["seconds"] = elapsed()
    save_state()  # the last weights (not the best) with the optimizer: what a resumed run continues from
    if st["best_head"] is not None:
        head.load_state_dict(st["best_head"])
    head.eval()
    final = st["curve"][-1][metric] if st["curve"] else None
    best = st["best"]
    if evaluating:
        log(f"[{tag}] stopped by {stopped_by} at step {st['step']} ({st['tokens']:,} tokens, "
            f"{fmt_duration(st['seconds'])}); keeping the weights of step {best['step']}")
    return {"steps": st["step"], "tokens_seen": st["tokens"], "train_seconds": round(st["seconds"], 2),
            f"final_{metric}": final if final is None or math.isfinite(final) else None,
            "stopped_by": stopped_by, "resumed_from_step": start_step if resume is not None else None,
            "autocast": "bfloat16" if autocast else None,
            "curve": st["curve"], "eval_curve": st["eval_curve"], "best": best}


# -------------------------------------------------------------------------------------------- train, save, report

def train_and_save(kind: str, preset: str, *, out, preset_dir, device: str, spec: HeadRecipe, corpus: Corpus | None,
                   log: Callable[[str], None], make_head, loss_fn, metric: str, evaluate,
                   resume: bool = False, prepare=None, describe=None) -> Path:
    """What `zoo train-head` does for every head kind: load the frozen target and the windows, make the untrained head
    (`make_head(target)`), score it on the held-out windows (`evaluate(head, target, windows, depth)`), train it
    (`distil` with `loss_fn`), and save the best weights with the manifest and the checkpoint in `out` (default
    `<preset folder>/<kind>`). `resume`: continue from `out`'s checkpoint; `prepare(head, train_windows)` sets what a
    head derives from its data before training (EAGLE-3's draft vocabulary); `describe(head)` adds fields to the
    manifest's training report. Returns the head folder."""
    from workbench.models import tokenizer_fingerprint

    t_start = time.perf_counter()
    paths = resolve_dir(preset_dir, preset) if preset_dir else resolve_dir(preset_home(preset), preset)
    out = Path(out) if out is not None else paths.root / kind
    ckpt = Checkpoint(out / CHECKPOINT, {"kind": kind, "target_id": target_fingerprint(paths.target_dir)["id"],
                                         "tokenizer_sha256": tokenizer_fingerprint(paths.target_dir)})
    state = load_checkpoint(ckpt, spec) if resume else None  # refused before any work
    paths, dev, target, corpus, train_w, eval_w, data = load_training_data(preset, preset_dir, device, spec, corpus,
                                                                           log, kind, out)
    head = make_head(target)
    if prepare is not None:
        prepare(head, train_w)
    before = evaluate(head, target, eval_w, spec.depth)
    log(f"[{kind}] untrained held-out agreement by depth {before.agreement_by_depth}")
    if state is not None:
        log(f"[{kind}] resuming from {ckpt.path} at step {state['step']} ({state['tokens']:,} tokens)")
    report = distil(head, target, train_w, spec, loss_fn, tag=kind, metric=metric, log=log, evaluate=evaluate,
                    eval_windows=eval_w, checkpoint=ckpt, resume=state)
    if describe is not None:
        report.update(describe(head))
    best = report["best"]
    after = HeadEval(best["agreement_by_depth"], best["expected_accepted_tokens"], before.anchors)
    log(f"[{kind}] {report['steps']} steps, {report['tokens_seen']:,} tokens in {report['train_seconds']} s "
        f"(stopped by {report['stopped_by']}); held-out agreement by depth {after.agreement_by_depth}, expected "
        f"accepted tokens of a greedy chain {after.expected_accepted_tokens}")
    save_head(head, kind, preset, spec, dev, paths, out, corpus, (train_w, eval_w), report, (before, after), t_start,
              data)
    log(f"[{kind}] wrote {out}")
    return out


def save_head(head, kind: str, preset: str, spec, dev: torch.device, paths, out: Path, corpus: Corpus, windows,
              report: dict, evals: tuple[HeadEval, HeadEval], t_start: float, data: dict | None = None) -> None:
    """head.save(out) + the manifest: recipe, target and tokenizer fingerprints, corpus, data source, training report
    (steps, tokens seen, stop reason, loss curve), held-out agreement before (untrained) and after training and the
    held-out curve. `windows` = (train, held-out) windows."""
    from workbench.models import tokenizer_fingerprint

    (train_w, eval_w), (before, after) = windows, evals
    out.mkdir(parents=True, exist_ok=True)
    head.save(out)
    report = dict(report)
    eval_curve, best = report.pop("eval_curve", []), report.pop("best", None)
    gen_s = (data or {}).get("generation_seconds", 0.0)
    manifest = {
        "manifest_version": HEAD_MANIFEST_VERSION,
        "kind": kind,
        "preset": preset,
        "recipe": asdict(spec),
        "seed": spec.seed,
        "device": dev.type,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python_version": sys.version.split()[0],
        "torch_version": torch.__version__,
        "target": {"path": os.path.relpath(paths.target_dir, out), **target_fingerprint(paths.target_dir)},
        "tokenizer": {"sha256": tokenizer_fingerprint(paths.target_dir)},
        "corpus": {k: v for k, v in corpus.manifest().items() if k != "skipped"},
        "data": data or {"source": "corpus"},
        "train": {"windows": len(train_w), **report,
                  "gpu_seconds": round(report["train_seconds"] + gen_s, 2) if dev.type == "cuda" else None},
        "heldout": {"windows": len(eval_w), "anchors": after.anchors,
                    "agreement_by_depth": after.agreement_by_depth,
                    "expected_accepted_tokens": after.expected_accepted_tokens,
                    "best_step": best["step"] if best else None,
                    "untrained_agreement_by_depth": before.agreement_by_depth,
                    "untrained_expected_accepted_tokens": before.expected_accepted_tokens,
                    "curve": eval_curve},
        "total_seconds": round(time.perf_counter() - t_start, 2),
    }
    (out / HEAD_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
