"""EAGLE-3 (Li et al. 2025, arXiv 2503.01840): the EAGLE-2 dynamic tree drafted by a head that reads three of the
target's layers and predicts tokens over its own, reduced vocabulary.

The head, per position i, from the target's residual stream at the inputs of three layers (low, middle, high:
a_i = [r_i^(l1); r_i^(l2); r_i^(l3)], [3H]) and the NEXT token x_{i+1}:
    g_i     = fc(a_i)                                                    # fused feature [H]; fc [H, 3H], no bias
    u_i     = [input_layernorm(embed(x_{i+1})); hidden_norm(g_i)]        # [2H]: the layer's attention reads 2H
    y_i     = g_i + o_proj(attention(q/k/v of u_i))                      # residual = the un-normed g_i
    f_{i+1} = y_i + mlp(post_attention_layernorm(y_i))                   # the layer output, before any norm
    logits  = lm_head(norm(f_{i+1}))                                     # [Vd] over the draft vocabulary
    target token id = draft id + d2t[draft id]
A predicted f stands in for the fused g at the next depth (fc is only applied to the target's own features), as the
published heads are run (SafeAILab's EAGLE-3 code, vLLM's Eagle3LlamaForCausalLM). `embed` is the target's (shared);
the head has its own `norm` and `lm_head`. Module and buffer names are the published checkpoints' (`fc`, `midlayer.*`,
`norm`, `lm_head`, `d2t`, `t2d`), so `state_dict()` is that layout as it is.

Which layers: "aux layer j" is the residual stream entering decoder layer j (after j layers; 0 = the embeddings), as
vLLM and the EAGLE-3 code capture it, concatenated in increasing layer order. The published default for an N-layer
target is (2, N // 2, N - 3); where those are not three distinct increasing layers (N < 8) `default_aux_layers` spreads
them as (1, N // 2, N - 1) instead. The engine gets them through the target's aux view (`with_aux_hidden`): its forward
returns [final-norm hidden; aux] ([.., 4H]) and its `compute_logits` reads the first H, so every engine path that hands
hidden states to a drafter (prefill, chunks, the captured tree step) carries the aux features with no engine change.

Everything else (head KV cache, pending pairs, frontier forwards, rerank, lossless verification of deterministic
children) is EAGLE-2's drafter (eagle.py): the tree's scores are the head's log-probabilities over the draft
vocabulary, scattered into the target vocabulary (-inf elsewhere), so a token outside the draft vocabulary is never
drafted and the verification, which decides every emitted token, stays exact at any temperature.
"""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from workbench.engine.drafters.base import DrafterError
from workbench.engine.drafters.eagle import EagleDrafter, EagleSettingsError, check_tree, rope_rows
from workbench.engine.drafters.head_io import SavedHead
from workbench.engine.topk import ranked_topk
from workbench.models.config import ModelConfig
from workbench.settings import parse_aux_layers  # noqa: F401 (the setting's parser, re-exported)
from workbench.models.llama import MLP, Attention, Linear, RMSNorm, full_config


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The three target layers an EAGLE-3 head reads by default: the published (2, N // 2, N - 3) where those are
    three distinct increasing layers, else (1, N // 2, N - 1).

    >>> default_aux_layers(32), default_aux_layers(12), default_aux_layers(6)
    ((2, 16, 29), (2, 6, 9), (1, 3, 5))
    """
    published = (2, num_layers // 2, num_layers - 3)
    if 0 <= published[0] < published[1] < published[2] < num_layers:
        return published
    spread = (1, num_layers // 2, num_layers - 1)
    if 0 <= spread[0] < spread[1] < spread[2] < num_layers:
        return spread
    raise EagleSettingsError(f"an EAGLE-3 head reads three distinct layers; the target has only {num_layers}")


def check_aux_layers(layers: tuple[int, ...], num_layers: int) -> None:
    if len(layers) != 3 or any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0 \
            or layers[-1] >= num_layers:
        raise EagleSettingsError(f"EAGLE-3 aux layers {','.join(map(str, layers))} must be three increasing layer "
                                 f"indices in 0..{num_layers - 1} (the target has {num_layers} layers): set "
                                 f"--eagle3-layers, e.g. {','.join(map(str, default_aux_layers(num_layers)))}")


_AUX_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> {layers: view}, not in its state


def with_aux_hidden(target, layers: tuple[int, ...]):
    """The target's aux view: the same modules and weights (a shallow copy, no parameter copied), whose forward also
    returns the residual streams entering `layers` (`LlamaModel.aux_hidden_layers`). One view per layer set, kept on
    the target, so the engine and the drafter share it."""
    layers = tuple(layers)
    if tuple(getattr(target, "aux_hidden_layers", ())) == layers:
        return target
    views = _AUX_VIEWS.setdefault(target, {})
    if layers not in views:
        view = copy.copy(target)  # nn.Module's dicts of parameters and submodules are shared, not copied
        object.__setattr__(view, "aux_hidden_layers", layers)
        views[layers] = view
    return views[layers]


@dataclass(frozen=True)
class Eagle3HeadConfig:
    """The head's shapes: hidden_size H (the target's), its layer's attention and MLP, the target vocabulary V, the
    draft vocabulary Vd and the target layers it reads (`aux_layers`, increasing)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...] = field(default=())
    norm_before_residual: bool = False  # the attention's residual is hidden_norm(g), not g (a config key some heads set)

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))

    @classmethod
    def of_target(cls, c: ModelConfig, aux_layers: tuple[int, ...] | None = None,
                  draft_vocab_size: int | None = None) -> "Eagle3HeadConfig":
        return cls(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                   c.rms_norm_eps, c.vocab_size, draft_vocab_size or c.vocab_size,
                   aux_layers or default_aux_layers(c.num_hidden_layers))

    def layer_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=1, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps)


class Eagle3Layer(nn.Module):
    """The head's decoder layer (`midlayer`): attention over [input_layernorm(embed); hidden_norm(g)] (q/k/v read
    2H), residual g, then the usual post-attention norm and SwiGLU MLP."""

    def __init__(self, config: Eagle3HeadConfig):
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        c, h = config.layer_config(), config.hidden_size
        self.self_attn = Attention(c, 0)
        q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.self_attn.qkv_proj = Linear(2 * h, q_rows + 2 * kv_rows, bias=False)  # saved as q/k/v_proj [.., 2H]
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)

    def forward(self, embed, g, cos, sin, attn):
        residual, qkv = self.pre(embed, g, cos, sin, attn)
        return self.post(residual, self.self_attn.attend(attn, *qkv))

    def pre(self, embed, g, cos, sin, attn) -> tuple[torch.Tensor, tuple]:
        """`forward` up to the attention call -> (the residual, `Attention.attend`'s q, k, v, rope)."""
        gn = self.hidden_norm(g)
        u = torch.cat([self.input_layernorm(embed), gn], -1)
        return gn if self.norm_before_residual else g, self.self_attn.project(u, cos, sin, attn)

    def post(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        y = self.self_attn.output(attended, residual=residual)
        return self.mlp(y, residual=y, norm=self.post_attention_layernorm)


class Eagle3Head(SavedHead):
    """`forward(target, hidden, token_ids, positions, attn)` -> the layer outputs f [B, T, H] (before the norm).
    hidden: the target aux view's [B, T, H + 3H] (final-norm hidden, then the aux features: fused by fc), or the
    head's own predicted f [B, T, H] (read as they are). `draft_log_probs(f)` -> float32 log-probabilities over the
    target vocabulary, -inf outside the draft vocabulary."""

    kind, label, config_class = "eagle3", "EAGLE-3 head", Eagle3HeadConfig

    def __init__(self, config: Eagle3HeadConfig):
        super().__init__()
        self.config = config
        h, n = config.hidden_size, len(config.aux_layers)
        self.fc = nn.Linear(n * h, h, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        # target id = draft id + d2t[draft id]; t2d[target id]: in the draft vocabulary (the published buffers)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.t2d[:config.draft_vocab_size] = True

    @classmethod
    def for_target(cls, target, seed: int = 0, std: float = 0.02, aux_layers: tuple[int, ...] | None = None,
                   draft_tokens: torch.Tensor | None = None) -> "Eagle3Head":
        """An untrained head for `target` from `seed`; `draft_tokens`: the target ids of the draft vocabulary (e.g.
        the most frequent tokens of a corpus; default: the whole vocabulary)."""
        c = full_config(target)
        vd = c.vocab_size if draft_tokens is None else int(draft_tokens.numel())
        head = cls(Eagle3HeadConfig.of_target(c, aux_layers, vd))
        head.reset_parameters(seed, std)
        if draft_tokens is not None:
            head.set_draft_vocab(draft_tokens)
        p = next(target.parameters())
        return head.to(device=p.device, dtype=p.dtype).eval()

    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> None:
        """Normal(0, std) matrices, unit norm weights; fc starts as the mean of the three aux features plus noise."""
        g = torch.Generator().manual_seed(seed)
        h, n = self.config.hidden_size, len(self.config.aux_layers)
        with torch.no_grad():
            for name, w in self.named_parameters():
                w.copy_(torch.ones_like(w) if name.endswith("norm.weight") else torch.randn(w.shape, generator=g) * std)
            self.fc.weight += torch.eye(h).repeat(1, n) / n

    def set_draft_vocab(self, draft_tokens: torch.Tensor) -> None:
        """The draft vocabulary as target ids [Vd] (distinct, in [0, V)), sorted: d2t and t2d follow."""
        ids = torch.as_tensor(draft_tokens, dtype=torch.long).flatten().sort().values
        check_draft_vocab(ids, self.config.vocab_size, self.config.draft_vocab_size)
        self.d2t.copy_(ids.to(self.d2t.device) - torch.arange(ids.numel(), device=self.d2t.device))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] long: the target id of every draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def check_target(self, target) -> None:
        """ValueError unless the head fits `target`: hidden size, heads, head dim, vocabulary, layers."""
        c = full_config(target)
        ours, want = self.config, Eagle3HeadConfig.of_target(c, self.config.aux_layers or None)
        for name in ("hidden_size", "head_dim", "num_key_value_heads", "vocab_size"):
            if getattr(ours, name) != getattr(want, name):
                raise ValueError(f"EAGLE-3 head has {name} {getattr(ours, name)}, the target {getattr(want, name)}: "
                                 f"the head must be trained for this target (zoo train-head --kind eagle3)")
        check_aux_layers(ours.aux_layers, c.num_hidden_layers)

    @property
    def attention(self):
        """The layer's `Attention` (its `attend` runs between `pre` and `post`)."""
        return self.midlayer.self_attn

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., H] (a predicted feature: kept) or [.., H + 3H] (the aux view's: fc over the aux part)."""
        h = self.config.hidden_size
        return hidden if hidden.shape[-1] == h else self.fc(hidden[..., h:])

    def forward(self, target, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                attn=None, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """rope: the (cos, sin_signed) [B, T, 1, Dh] rows of `positions` where the caller looked them up; None: looked
        up here (as `EagleHead.forward`)."""
        from workbench.models.attention import CausalAttention

        attn = CausalAttention() if attn is None else attn
        residual, qkv = self.pre(target, hidden, token_ids, positions, attn, rope)
        return self.post(target, residual, self.midlayer.self_attn.attend(attn, *qkv))

    def pre(self, target, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, attn,
            rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, tuple]:
        """`forward` up to the attention call, as `EagleHead.pre` (the draft calls the attention between the halves)."""
        g = self.fuse(hidden)
        cos, sin = rope if rope is not None else rope_rows(target, positions, g.dtype)
        return self.midlayer.pre(target.model.embed_tokens(token_ids), g, cos, sin, attn)

    def post(self, target, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return self.midlayer.post(residual, attended)

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [.., H] -> logits over the draft vocabulary [.., Vd]."""
        return self.lm_head(self.norm(features))

    def draft_log_probs(self, features: torch.Tensor) -> torch.Tensor:
        """features [.., H] -> float32 log-probabilities [.., V] over the target vocabulary (-inf outside the draft
        vocabulary)."""
        logp = torch.log_softmax(self.draft_logits(features).float(), -1).clamp(max=0.0)
        full = logp.new_full((*logp.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.scatter(-1, self.draft_to_target.expand_as(logp), logp)


def check_draft_vocab(ids: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> None:
    """ValueError unless `ids` (target ids of the draft vocabulary) are `draft_vocab_size` distinct ids in [0, V)."""
    if ids.numel() != draft_vocab_size:
        raise ValueError(f"the draft vocabulary has {ids.numel()} tokens, the head's draft_vocab_size is "
                         f"{draft_vocab_size}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"draft tokens map outside the target vocabulary 0..{vocab_size - 1} "
                         f"(ids {int(ids.min())}..{int(ids.max())}): d2t does not belong to this target")
    if ids.unique().numel() != ids.numel():
        raise ValueError("two draft ids map to the same target id: d2t is not a draft vocabulary")


class Eagle3Drafter(EagleDrafter):
    """EAGLE-2's tree drafter (same knobs: tree_depth, tree_topk, tree_budget) over an EAGLE-3 head. `target` is
    the plain target: the drafter keeps its aux view (`self.target`), which the engine must run
    (`drafters.engine_target`)."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head, target, tree_depth: int = 4, tree_topk: int = 4, tree_budget: int = 16,
                 aux_layers: tuple[int, ...] | None = None):
        if aux_layers is not None and tuple(aux_layers) != head.config.aux_layers:
            raise EagleSettingsError(f"eagle3_layers={','.join(map(str, aux_layers))}, but the head was trained on "
                                     f"layers {','.join(map(str, head.config.aux_layers))}: set --eagle3-layers auto "
                                     f"(or to the head's layers)")
        check_tree(tree_depth, tree_topk, tree_budget, head.config.draft_vocab_size)
        if tuple(getattr(target, "aux_hidden_layers", ())) not in ((), head.config.aux_layers):
            raise DrafterError("EAGLE-3: the target is another head's aux view; pass the plain target")
        super().__init__(head, with_aux_hidden(target, head.config.aux_layers), tree_depth, tree_topk, tree_budget)

    def _feature_width(self) -> int:
        return self.target.config.hidden_size * (1 + len(self.head.config.aux_layers))

    def _top(self, features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K best over the draft vocabulary, mapped to target ids (no [.., V] scatter: top-K of Vd logits)."""
        score, idx = ranked_topk(self.head.draft_logits(features), k)
        return score, self.head.draft_to_target[idx]

    @property
    def settings(self) -> dict:
        out = {**super().settings, "eagle3_layers": ",".join(map(str, self.head.config.aux_layers))}
        out.pop("hot_vocab")  # EAGLE-3's draft vocabulary is its head's (draft_vocab_size)
        return out
