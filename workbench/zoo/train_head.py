"""Distil a ReDrafter head from a frozen zoo target: `python -m workbench zoo train-head --kind redrafter --preset tiny`.

Data: the preset's corpus (`load_corpus(preset.corpus)`, the same train / held-out split by path hash), encoded with
the target's own tokenizer.json into one stream per split and cut into windows of `seq_len` tokens.

One step, for a batch of windows x [B, T]: the target runs once without gradients, giving final hidden states
h_t and log-probabilities log p_t [B, T, V]. For every anchor t < T - L the head starts from s_0 = h_t and is fed
the target's embeddings of the TRUE tokens x_{t+1}, ..., x_{t+L} (teacher forcing); its depth-d features go through
the target's LM head to log q_d, and the loss is mean over d = 1..L of KL(p_{t+d} || q_d). This is the engine's
recurrence exactly: at depth d the drafter has fed the root x_{t+1} and its own tokens up to x_{t+d}.

Held-out report (the same windows every time, so heads compare): per depth d, the fraction of anchors where
argmax q_d == argmax p_{t+d} (teacher-forced top-1 agreement), and the expected accepted tokens of a greedy chain
of L, estimated as the mean over anchors of the number of leading depths that agree. The fed tokens are the corpus's,
not the target's own greedy continuation, so this estimates, not measures, the engine's acceptance (the bench does).

Seeds fix the head's initialisation and batch order; a time budget makes the step count depend on the machine
(like `zoo train`), so runs with equal `--max-steps` agree exactly on CPU, runs with a time budget closely.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from workbench.engine.drafters.redrafter import RedrafterHead
from workbench.zoo.corpus import Corpus, CorpusError, load_corpus, path_bucket
from workbench.zoo.heads import HEAD_MANIFEST, target_fingerprint
from workbench.zoo.presets import ZooError, get_preset, preset_home, resolve_dir
from workbench.zoo.tokenizer import encode_documents, load_tokenizer

HEAD_MANIFEST_VERSION = 1
CURVE_POINTS = 40


@dataclass(frozen=True)
class HeadTrainSpec:
    """The recipe; every field goes to the manifest. AdamW, linear warmup then cosine to min_lr_ratio * lr."""

    depth: int = 4  # L: teacher-forced depths trained and evaluated
    seq_len: int = 128  # window length T (anchors per window: T - L)
    batch_size: int = 8  # windows per step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_seconds: float = 240.0  # steady-state training budget (2 CPU cores: a few hundred steps)
    max_steps: int = 1_000_000
    train_windows: int = 4096  # windows cut from training files (files in path-hash order)
    eval_windows: int = 32  # held-out windows scored (the same ones every time)
    seed: int = 1234


@dataclass
class HeadEval:
    agreement_by_depth: list[float]  # [L]: teacher-forced top-1 agreement with the target at depth d
    expected_accepted_tokens: float  # mean leading run of agreeing depths (greedy chain of L)
    anchors: int


def token_windows(corpus_files, tokenizer, n_windows: int, seq_len: int, salt: str) -> torch.Tensor:
    """[N, T] long: non-overlapping windows of the encoded stream of files taken in path-hash order (N <= n)."""
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
def _target_pass(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] -> (hidden [B, T, H], target log-probs [B, T, V] float32)."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    hidden = target(ids, positions)
    return hidden, torch.log_softmax(target.compute_logits(hidden).float(), -1)


def _head_log_probs(head, target, ids: torch.Tensor, hidden: torch.Tensor, depth: int):
    """Teacher-forced head log-probs per depth: a list of L tensors [B, N, V], N = T - L anchors."""
    n = ids.shape[1] - depth
    anchor = hidden[:, :n]  # [B, N, H]
    b, _, h = anchor.shape
    anchor = anchor.reshape(b * n, h)
    with torch.no_grad():
        embeds = target.model.embed_tokens(ids)  # [B, T, E]
    state, out = anchor, []
    for d in range(1, depth + 1):
        state, features = head(state, embeds[:, d : d + n].reshape(b * n, -1), anchor)  # fed x_{t+d}
        out.append(torch.log_softmax(target.compute_logits(features).float(), -1).view(b, n, -1))
    return out


@torch.no_grad()
def agreement(target, windows: torch.Tensor, depth: int, predict, batch: int = 8) -> HeadEval:
    """Held-out top-1 agreement of a head with the target, for every head kind: `predict(ids [B, T], hidden [B, T, H])`
    returns per depth d = 1..depth the head's scores [B, N, V] (logits or log-probs, N = T - depth) for the token at
    t + d, compared with the target's argmax there; plus the mean leading run of agreeing depths."""
    agree = torch.zeros(depth, dtype=torch.float64)
    run_total, anchors = 0.0, 0
    for i in range(0, len(windows), batch):
        ids = windows[i : i + batch]
        hidden, target_logp = _target_pass(target, ids)
        n = ids.shape[1] - depth
        hits = torch.stack([q.argmax(-1) == target_logp[:, d : d + n].argmax(-1)
                            for d, q in enumerate(predict(ids, hidden), start=1)], -1)  # [B, N, L]
        agree += hits.double().sum((0, 1)).cpu()
        run_total += hits.long().cumprod(-1).sum().item()  # leading run of agreeing depths, summed over anchors
        anchors += hits.shape[0] * hits.shape[1]
    return HeadEval([round(x, 4) for x in (agree / anchors).tolist()], round(run_total / anchors, 4), anchors)


def evaluate_head(head, target, windows: torch.Tensor, depth: int, batch: int = 8) -> HeadEval:
    return agreement(target, windows, depth, lambda ids, hidden: _head_log_probs(head, target, ids, hidden, depth),
                     batch)


def _lr_at(step: int, progress: float, spec: HeadTrainSpec) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * cosine)


def _kl_loss(head, target, ids: torch.Tensor, spec: HeadTrainSpec) -> torch.Tensor:
    """Mean over depths of KL(p_{t+d} || q_d), teacher-forced (the module docstring's step)."""
    hidden, target_logp = _target_pass(target, ids)
    n = ids.shape[1] - spec.depth
    return sum(F.kl_div(q, target_logp[:, d + 1 : d + 1 + n], log_target=True, reduction="none").sum(-1).mean()
               for d, q in enumerate(_head_log_probs(head, target, ids, hidden, spec.depth))) / spec.depth


def train_head(head, target, windows: torch.Tensor, spec: HeadTrainSpec,
               log: Callable[[str], None] = print) -> dict:
    """Train `head` in place against the frozen `target`; returns {"steps", "train_seconds", "curve", ...}."""
    return distil(head, target, windows, spec, _kl_loss, tag="redrafter", metric="kl", log=log)


def distil(head, target, windows: torch.Tensor, spec, loss_fn, *, tag: str, metric: str,
           log: Callable[[str], None] = print) -> dict:
    """The training loop every head kind shares: AdamW on `head` against the frozen `target`, `spec.batch_size`
    random windows per step (seeded by `spec.seed`), `loss_fn(head, target, ids [B, T], spec)` -> scalar, warmup then
    cosine (`_lr_at`), gradient clipping, until `spec.max_steps` or `spec.max_seconds`. Returns {"steps",
    "train_seconds", "final_<metric>" (None unless finite), "stopped_by", "curve"}: the curve holds about
    CURVE_POINTS entries {"step", "seconds", <metric>, "lr"}, each the loss averaged since the previous one."""
    for p in target.parameters():
        p.requires_grad_(False)
    head.train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    generator = torch.Generator().manual_seed(spec.seed)
    curve, loss_sum, loss_count = [], 0.0, 0
    log_every_s = max(0.5, spec.max_seconds / CURVE_POINTS)
    t0 = t_last = time.perf_counter()
    step, lr = 0, spec.lr
    dev = next(target.parameters()).device
    while step < spec.max_steps and (step == 0 or time.perf_counter() - t0 < spec.max_seconds):
        lr = _lr_at(step, max(step / spec.max_steps, (time.perf_counter() - t0) / spec.max_seconds), spec)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = windows[torch.randint(0, len(windows), (spec.batch_size,), generator=generator)].to(dev)  # [B, T]
        loss = loss_fn(head, target, ids, spec)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1
        now = time.perf_counter()
        if now - t_last >= log_every_s:
            curve.append({"step": step, "seconds": round(now - t0, 2), metric: round(loss_sum / loss_count, 4),
                          "lr": lr})
            log(f"[{tag}] step {step:5d}  {metric} {loss_sum / loss_count:.4f}  lr {lr:.2e}  {now - t0:6.1f} s")
            loss_sum, loss_count, t_last = 0.0, 0, now
    seconds = time.perf_counter() - t0
    if loss_count:
        curve.append({"step": step, "seconds": round(seconds, 2), metric: round(loss_sum / loss_count, 4), "lr": lr})
    head.eval()
    final = curve[-1][metric] if curve else None
    return {"steps": step, "train_seconds": round(seconds, 2),
            f"final_{metric}": final if final is None or math.isfinite(final) else None,
            "stopped_by": "max_steps" if step >= spec.max_steps else "max_seconds", "curve": curve}


def load_training_data(preset: str, preset_dir, device: str, spec, corpus: Corpus | None, log, tag: str):
    """(paths, device, frozen float32 target, corpus, train windows, held-out windows on the device) for a head of
    `preset`. Every head kind reads the same windows (salted "redrafter"), so their held-out figures compare."""
    from workbench.models import load_model

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
    train_w = token_windows(corpus.train, tokenizer, spec.train_windows, spec.seq_len, "redrafter")
    eval_w = token_windows(corpus.heldout, tokenizer, spec.eval_windows, spec.seq_len, "redrafter-eval").to(dev)
    log(f"[{tag}] {preset}: {len(train_w)} train / {len(eval_w)} held-out windows of {spec.seq_len} tokens on {dev}")
    return paths, dev, target, corpus, train_w, eval_w


def train_redrafter_head(preset: str, *, out: str | Path | None = None, preset_dir: str | Path | None = None,
                         device: str = "cpu", spec: HeadTrainSpec = HeadTrainSpec(), corpus: Corpus | None = None,
                         log: Callable[[str], None] = print) -> Path:
    """Train, evaluate and save a head for the preset's target; returns the head folder (default:
    `<preset folder>/redrafter`). `corpus` overrides the preset's (tests pass a small one)."""
    return train_and_save("redrafter", preset, out=out, preset_dir=preset_dir, device=device, spec=spec, corpus=corpus,
                          log=log, make_head=lambda target: RedrafterHead.for_target(target, seed=spec.seed).float(),
                          train=train_head, evaluate=evaluate_head)


def train_and_save(kind: str, preset: str, *, out, preset_dir, device: str, spec, corpus: Corpus | None,
                   log: Callable[[str], None], make_head, train, evaluate) -> Path:
    """What `zoo train-head` does for every head kind: load the frozen target and the windows, make the untrained head
    (`make_head(target)`), score it on the held-out windows (`evaluate(head, target, windows, depth)`), train it
    (`train(head, target, windows, spec, log=)` -> report), score it again and save it with its manifest in `out`
    (default `<preset folder>/<kind>`). Returns the head folder."""
    t_start = time.perf_counter()
    paths, dev, target, corpus, train_w, eval_w = load_training_data(preset, preset_dir, device, spec, corpus, log,
                                                                     kind)
    out = Path(out) if out is not None else paths.root / kind
    head = make_head(target)
    before = evaluate(head, target, eval_w, spec.depth)
    log(f"[{kind}] untrained held-out agreement by depth {before.agreement_by_depth}")
    report = train(head, target, train_w, spec, log=log)
    after = evaluate(head, target, eval_w, spec.depth)
    log(f"[{kind}] {report['steps']} steps in {report['train_seconds']} s; held-out agreement by depth "
        f"{after.agreement_by_depth}, expected accepted tokens of a greedy chain {after.expected_accepted_tokens}")
    save_head(head, kind, preset, spec, dev, paths, out, corpus, (train_w, eval_w), report, (before, after), t_start)
    log(f"[{kind}] wrote {out}")
    return out


def save_head(head, kind: str, preset: str, spec, dev: torch.device, paths, out: Path, corpus: Corpus, windows,
              report: dict, evals: tuple[HeadEval, HeadEval], t_start: float) -> None:
    """head.save(out) + the manifest: recipe, target and tokenizer fingerprints, corpus, training report, held-out
    agreement before (untrained) and after training. `windows` = (train, held-out) windows."""
    from workbench.models import tokenizer_fingerprint

    (train_w, eval_w), (before, after) = windows, evals
    out.mkdir(parents=True, exist_ok=True)
    head.save(out)
    manifest = {
        "manifest_version": HEAD_MANIFEST_VERSION,
        "kind": kind,
        "preset": preset,
        "recipe": asdict(spec),
        "seed": spec.seed,
        "device": dev.type,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python_version": sys.version.split()[0],
        "torch_version": torch.__version__,
        "target": {"path": os.path.relpath(paths.target_dir, out), **target_fingerprint(paths.target_dir)},
        "tokenizer": {"sha256": tokenizer_fingerprint(paths.target_dir)},
        "corpus": {k: v for k, v in corpus.manifest().items() if k != "skipped"},
        "train": {"windows": len(train_w), **report},
        "heldout": {"windows": len(eval_w), "anchors": after.anchors,
                    "agreement_by_depth": after.agreement_by_depth,
                    "expected_accepted_tokens": after.expected_accepted_tokens,
                    "untrained_agreement_by_depth": before.agreement_by_depth,
                    "untrained_expected_accepted_tokens": before.expected_accepted_tokens},
        "total_seconds": round(time.perf_counter() - t_start, 2),
    }
    (out / HEAD_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
