"""Distil an EAGLE head from a frozen zoo target: `python -m workbench zoo train-head --kind eagle --preset tiny`.

Data: the same windows as the ReDrafter head (workbench/zoo/train_head.py `load_training_data`): the preset's corpus,
encoded with the target's tokenizer, cut into windows of `seq_len` tokens; held-out windows from held-out files.

One step, for a batch of windows x [B, T]: the target runs once without gradients, giving final hidden states h_t and
log-probabilities log p_t. The head is then rolled out `depth` passes over the anchors t < T - depth, the way the
drafter uses it ("training-time test", as EAGLE-3 trains):
    pass 1:     input (h_t, x_{t+1}) at position t            -> f1_t, predicts h_{t+1} and p_{t+1}
    pass d > 1: input (f(d-1)_t, x_{t+d}) at position t+d-1  -> fd_t, predicts h_{t+d} and p_{t+d}
Pass 1 attends causally over the window's real entries; a pass-d entry sees the real entries 0..t and its own
anchor's entries of passes 2..d: exactly the committed entries and the ancestors a depth-d tree node sees in the
engine. The tokens are the corpus's (teacher forcing); the features after pass 1 are the head's own predictions.
Loss per pass: `kl_weight` x KL(p || q) through the target's final norm and LM head + `reg_weight` x smooth L1 to the
target's hidden state; passes weighted `depth_decay`^(d-1).

Held-out report (the same windows every time): per depth d, the fraction of anchors where the head's top-1 token equals
the target's (pass d, teacher-forced tokens: acceptance of a greedy chain, estimated), and the expected accepted tokens
of a greedy chain of `depth` (the mean leading run of agreeing depths). The bench measures the real acceptance.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.engine.drafters.eagle import EagleHead
from workbench.models.attention import expand_kv
from workbench.zoo.corpus import Corpus
from workbench.zoo.head_training import HeadEval, HeadRecipe, agreement, distil, rank_tokens, train_and_save
from workbench.zoo.head_training import target_pass as _target_pass


@dataclass(frozen=True)
class EagleTrainSpec(HeadRecipe):
    """The EAGLE recipe (the shared fields: HeadRecipe); every field goes to the manifest."""

    depth: int = 3  # rollout passes trained and evaluated (held-out agreement at depth 1..depth)
    lr: float = 2e-3
    kl_weight: float = 1.0  # KL(target || head) through the shared LM head
    reg_weight: float = 1.0  # smooth L1 of the predicted hidden state to the target's
    depth_decay: float = 0.8  # pass d weighs depth_decay^(d-1)
    style: str = "workbench"  # EagleHeadConfig.style: "eagle" trains the published EAGLE-1/2 structure (exportable)


class RolloutAttention:
    """The head's attention over a rollout: pass 1 causal over the window, a later pass's entry t sees pass-1 entries
    0..t and entry t of every pass since (the diagonal). Keys of earlier passes are kept here."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # per pass, [B, Hkv, N, D]
        self.values: list[torch.Tensor] = []

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        n, dev = q.shape[2], q.device
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        eye = torch.eye(n, dtype=torch.bool, device=dev)
        mask = torch.cat([causal] + [eye] * (len(self.keys) - 1), 1)  # [N, passes * N]
        groups = q.shape[1] // k.shape[1]
        keys, values = torch.cat(self.keys, 2), torch.cat(self.values, 2)
        return F.scaled_dot_product_attention(q, expand_kv(keys, groups), expand_kv(values, groups), attn_mask=mask)


def rollout(head: EagleHead, target, ids: torch.Tensor, hidden: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """ids [B, T], hidden [B, T, H] (the target's) -> per pass d = 1..depth the head's features [B, N, H], N = T - depth
    (entry t of pass d predicts the target's hidden state at t + d)."""
    n = ids.shape[1] - depth
    attn = RolloutAttention()
    anchors = torch.arange(n, device=ids.device).expand(ids.shape[0], n)  # [B, N]
    feats, out = hidden[:, :n], []
    for d in range(1, depth + 1):
        feats = head(target, feats, ids[:, d:d + n], anchors + d - 1, attn)  # fed x_{t+d}
        out.append(feats)
    return out


def _loss(head, target, ids, spec: EagleTrainSpec) -> torch.Tensor:
    hidden, target_logp = _target_pass(target, ids)
    n = ids.shape[1] - spec.depth
    total, weights = 0.0, 0.0
    for d, f in enumerate(rollout(head, target, ids, hidden, spec.depth), start=1):
        logq = torch.log_softmax(target.compute_logits(f).float(), -1)
        kl = F.kl_div(logq, target_logp[:, d:d + n], log_target=True, reduction="none").sum(-1).mean()
        reg = F.smooth_l1_loss(f.float(), hidden[:, d:d + n].float())
        w = spec.depth_decay ** (d - 1)
        total, weights = total + w * (spec.kl_weight * kl + spec.reg_weight * reg), weights + w
    return total / weights


def evaluate_eagle(head: EagleHead, target, windows: torch.Tensor, depth: int, batch: int = 8) -> HeadEval:
    """Held-out top-1 agreement with the target per depth (teacher-forced tokens, predicted features)."""
    return agreement(target, windows, depth, lambda ids, hidden: [
        target.compute_logits(f) for f in rollout(head, target, ids, hidden, depth)], batch)


def train_eagle(head: EagleHead, target, windows: torch.Tensor, spec: EagleTrainSpec,
                log: Callable[[str], None] = print, **kw) -> dict:
    """Train `head` in place against the frozen `target`; returns {"steps", "train_seconds", "curve", ...}. `kw`:
    `distil`'s evaluation, checkpoint and resume arguments."""
    return distil(head, target, windows, spec, _loss, tag="eagle", metric="loss", log=log, **kw)


def train_eagle_head(preset: str, *, out: str | Path | None = None, preset_dir: str | Path | None = None,
                     device: str = "cpu", spec: EagleTrainSpec = EagleTrainSpec(), corpus: Corpus | None = None,
                     log: Callable[[str], None] = print, resume: bool = False) -> Path:
    """Train, evaluate and save an EAGLE head for the preset's target; returns the head folder (default:
    `<preset folder>/eagle`). `corpus` overrides the preset's (tests pass a small one); `resume` continues from the
    folder's checkpoint."""
    return train_and_save("eagle", preset, out=out, preset_dir=preset_dir, device=device, spec=spec, corpus=corpus,
                          log=log, make_head=lambda target: EagleHead.for_target(target, seed=spec.seed,
                                                                                 style=spec.style).float(),
                          loss_fn=_loss, metric="loss", evaluate=evaluate_eagle, resume=resume,
                          prepare=rank_tokens)


