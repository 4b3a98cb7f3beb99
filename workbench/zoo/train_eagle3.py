"""Distil an EAGLE-3 head from a frozen zoo target: `python -m workbench zoo train-head --kind eagle3 --preset tiny`.

The data, the rollout and the held-out report are the EAGLE head's (workbench/zoo/train_eagle.py): the same windows,
`depth` passes of training-time test (pass 1 reads the target's three aux layers, fused by fc; pass d > 1 reads the
head's own previous outputs, attending to the real entries and its own anchor's earlier passes). What differs:

- the draft vocabulary: `draft_vocab_size` (0 = the whole vocabulary) of the target's most frequent tokens in the
  training windows (ties to the lower id), set as d2t / t2d before training;
- the loss: the head predicts tokens, not features (EAGLE-3 drops the feature regression): per pass, the KL from the
  target's next-token distribution restricted to the draft vocabulary (renormalised) to the head's, passes weighted
  `depth_decay`^(d-1);
- agreement counts the head's top-1 mapped to a target id (a token outside the draft vocabulary never agrees).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.engine.drafters.eagle3 import Eagle3Head, with_aux_hidden
from workbench.settings import parse_aux_layers
from workbench.zoo.corpus import Corpus
from workbench.zoo.head_training import HeadEval, agreement, distil, token_ranking, train_and_save
from workbench.zoo.head_training import target_pass as _target_pass
from workbench.zoo.train_eagle import EagleTrainSpec, rollout


@dataclass(frozen=True)
class Eagle3TrainSpec(EagleTrainSpec):
    """EAGLE's recipe plus the draft vocabulary and the target layers; every field goes to the manifest."""

    draft_vocab_size: int = 0  # 0 = the target's whole vocabulary
    eagle3_layers: str = "auto"  # the `eagle3_layers` setting: auto = 2, N/2, N-3 (1, N/2, N-1 on shallow targets)
    reg_weight: float = 0.0  # unused: EAGLE-3 trains on tokens only


def frequent_tokens(windows: torch.Tensor, vocab_size: int, n: int) -> torch.Tensor:
    """The `n` most frequent token ids of `windows` (ties to the lower id), sorted.

    >>> frequent_tokens(torch.tensor([[3, 3, 1, 2, 2, 2]]), 5, 2).tolist()
    [2, 3]
    """
    return token_ranking(windows, vocab_size)[:n].sort().values


def _loss(head: Eagle3Head, target, ids: torch.Tensor, spec: Eagle3TrainSpec) -> torch.Tensor:
    view = with_aux_hidden(target, head.config.aux_layers)
    hidden, target_logp = _target_pass(view, ids)  # [B, T, H + 3H], [B, T, V]
    n = ids.shape[1] - spec.depth
    draft_ids = head.draft_to_target
    total, weights = 0.0, 0.0
    for d, f in enumerate(rollout(head, view, ids, hidden, spec.depth), start=1):
        p = torch.log_softmax(target_logp[:, d:d + n][..., draft_ids], -1)  # the target's, on the draft vocabulary
        logq = torch.log_softmax(head.draft_logits(f).float(), -1)
        kl = F.kl_div(logq, p, log_target=True, reduction="none").sum(-1).mean()
        w = spec.depth_decay ** (d - 1)
        total, weights = total + w * kl, weights + w
    return total / weights


def evaluate_eagle3(head: Eagle3Head, target, windows: torch.Tensor, depth: int, batch: int = 8) -> HeadEval:
    """Held-out top-1 agreement with the target per depth (teacher-forced tokens, predicted features)."""
    view = with_aux_hidden(target, head.config.aux_layers)
    return agreement(view, windows, depth, lambda ids, hidden: [
        head.draft_log_probs(f) for f in rollout(head, view, ids, hidden, depth)], batch)


def set_draft_vocab(head: Eagle3Head, windows: torch.Tensor) -> None:
    """The draft vocabulary: the training windows' most frequent tokens (the whole vocabulary keeps no d2t)."""
    if head.config.draft_vocab_size < head.config.vocab_size:
        head.set_draft_vocab(frequent_tokens(windows, head.config.vocab_size, head.config.draft_vocab_size))


def train_eagle3(head: Eagle3Head, target, windows: torch.Tensor, spec: Eagle3TrainSpec,
                 log: Callable[[str], None] = print, **kw) -> dict:
    """Set the draft vocabulary from `windows`, then train `head` in place against the frozen `target` (`kw`:
    `distil`'s evaluation, checkpoint and resume arguments)."""
    set_draft_vocab(head, windows)
    report = distil(head, target, windows, spec, _loss, tag="eagle3", metric="loss", log=log, **kw)
    return {**report, **describe(head)}


def describe(head: Eagle3Head) -> dict:
    """The head's draft vocabulary and target layers, for the training report."""
    return {"draft_vocab_size": head.config.draft_vocab_size,
            "eagle3_layers": ",".join(map(str, head.config.aux_layers))}


def make_eagle3_head(target, spec: Eagle3TrainSpec) -> Eagle3Head:
    """An untrained float32 head for `target` with the recipe's layers and draft vocabulary size (its d2t is set
    from the training windows by `train_eagle3`)."""
    vd = spec.draft_vocab_size or target.config.vocab_size
    if not 1 <= vd <= target.config.vocab_size:
        raise ValueError(f"draft_vocab_size={vd} must be in 1..{target.config.vocab_size} (the target's vocabulary)")
    draft = None if vd == target.config.vocab_size else torch.arange(vd)
    return Eagle3Head.for_target(target, seed=spec.seed, aux_layers=parse_aux_layers(spec.eagle3_layers),
                                 draft_tokens=draft).float()


def train_eagle3_head(preset: str, *, out: str | Path | None = None, preset_dir: str | Path | None = None,
                      device: str = "cpu", spec: Eagle3TrainSpec = Eagle3TrainSpec(), corpus: Corpus | None = None,
                      log: Callable[[str], None] = print, resume: bool = False) -> Path:
    """Train, evaluate and save an EAGLE-3 head for the preset's target; returns the head folder (default:
    `<preset folder>/eagle3`). `corpus` overrides the preset's (tests pass a small one); `resume` continues from the
    folder's checkpoint."""
    return train_and_save("eagle3", preset, out=out, preset_dir=preset_dir, device=device, spec=spec, corpus=corpus,
                          log=log, make_head=lambda target: make_eagle3_head(target, spec), loss_fn=_loss,
                          metric="loss", evaluate=evaluate_eagle3, resume=resume, prepare=set_draft_vocab,
                          describe=describe)
