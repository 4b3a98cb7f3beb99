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
Budgets, the held-out curve, early stopping, resume and self-distillation data: workbench/zoo/head_training.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.engine.drafters.redrafter import RedrafterHead
from workbench.zoo.corpus import Corpus
from workbench.zoo.head_training import (CURVE_POINTS, HEAD_MANIFEST_VERSION, HeadEval,  # noqa: F401 - re-exported
                                         HeadRecipe, agreement, distil, load_training_data, save_head, token_windows,
                                         rank_tokens, train_and_save)
from workbench.zoo.head_training import lr_at as _lr_at  # noqa: F401
from workbench.zoo.head_training import target_pass as _target_pass


@dataclass(frozen=True)
class HeadTrainSpec(HeadRecipe):
    """The ReDrafter recipe (the shared fields: HeadRecipe); every field goes to the manifest."""

    depth: int = 4  # L: teacher-forced depths trained and evaluated
    lr: float = 3e-3


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


def evaluate_head(head, target, windows: torch.Tensor, depth: int, batch: int = 8) -> HeadEval:
    return agreement(target, windows, depth, lambda ids, hidden: _head_log_probs(head, target, ids, hidden, depth),
                     batch)


def _kl_loss(head, target, ids: torch.Tensor, spec: HeadTrainSpec) -> torch.Tensor:
    """Mean over depths of KL(p_{t+d} || q_d), teacher-forced (the module docstring's step)."""
    hidden, target_logp = _target_pass(target, ids)
    n = ids.shape[1] - spec.depth
    return sum(F.kl_div(q, target_logp[:, d + 1 : d + 1 + n], log_target=True, reduction="none").sum(-1).mean()
               for d, q in enumerate(_head_log_probs(head, target, ids, hidden, spec.depth))) / spec.depth


def train_head(head, target, windows: torch.Tensor, spec: HeadTrainSpec,
               log: Callable[[str], None] = print, **kw) -> dict:
    """Train `head` in place against the frozen `target`; returns {"steps", "train_seconds", "curve", ...}. `kw`:
    `distil`'s evaluation, checkpoint and resume arguments."""
    return distil(head, target, windows, spec, _kl_loss, tag="redrafter", metric="kl", log=log, **kw)


def train_redrafter_head(preset: str, *, out: str | Path | None = None, preset_dir: str | Path | None = None,
                         device: str = "cpu", spec: HeadTrainSpec = HeadTrainSpec(), corpus: Corpus | None = None,
                         log: Callable[[str], None] = print, resume: bool = False) -> Path:
    """Train, evaluate and save a head for the preset's target; returns the head folder (default:
    `<preset folder>/redrafter`). `corpus` overrides the preset's (tests pass a small one); `resume` continues from
    the folder's checkpoint."""
    return train_and_save("redrafter", preset, out=out, preset_dir=preset_dir, device=device, spec=spec, corpus=corpus,
                          log=log, make_head=lambda target: RedrafterHead.for_target(target, seed=spec.seed).float(),
                          loss_fn=_kl_loss, metric="kl", evaluate=evaluate_head, resume=resume,
                          prepare=rank_tokens)
