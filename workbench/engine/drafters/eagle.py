"""EAGLE-2 (Li et al. 2024, arXiv 2406.16858; the head of EAGLE, arXiv 2401.15077): a one-layer head over the
target's hidden states drafts a dynamic token tree.

The head, per position i, from the target's hidden state h_i and the NEXT token x_{i+1}:
    f_{i+1} = norm(layer(fc([h_i; embed(x_{i+1})])))       # predicted hidden state of position i + 1, [..., H]
    logits  = lm_head(f_{i+1})                              # predicts x_{i+2}
`layer` is one Llama decoder layer with its own small KV cache; `embed`, `norm` (the final RMSNorm) and `lm_head` are
the TARGET's own modules, shared, never copied. The engine hands the drafter final-norm hidden states (the
`wants_hidden` contract), so the head's prediction is taken after the target's final norm too: it lives in the same
space as the real ones, and a predicted feature can stand in for a real one at the next depth.

Head cache: entry i holds the pair (h_i, x_{i+1}). With L committed tokens and the root x_L, entries 0..L-1 are
final; their last one, (h_{L-1}, root), gives the feature that drafts depth 1. The pairs a step commits (the root's
and the accepted nodes' hidden states with the tokens after them) are run at the start of the next `propose`, so every
head forward is timed under "draft" and a step is one fixed-shape step (one CUDA graph per batch bucket on a GPU).

Dynamic tree (EAGLE-2), `tree_depth` D, `tree_topk` K, `tree_budget` N:
- depth 1: the K most likely tokens after the root are candidates, and all of them are the frontier;
- depth d + 1 (d = 1 .. D-1): one batched head forward over the K frontier nodes (each sees the committed entries,
  its ancestors in the draft and itself: tree attention through `KVCache.prepare(prefix_mask=)`); each frontier node's
  top-K children become candidates, scored by cumulative log-probability (the path's summed log-probs); the K best of
  those K x K children are the next frontier;
- rerank: of all K + (D-1) K^2 candidates, the N with the best cumulative log-probability. A child never scores above
  its parent and a stable sort puts the parent (earlier candidate) first among ties, so every kept node's parent is
  kept; sorted back into candidate order (depth-major), parents come before children: a valid `DraftTree` with a
  static N nodes and `depth_bound` D.
Example: K = 2, D = 2, N = 3; depth 1 gives a (log p -0.1) and b (-2.3); a's children c (-0.2), d (-1.5), b's e (-0.1),
f (-3.0) score -0.3, -1.6, -2.4, -5.3; the best 3 of {a, b, c, d, e, f} are a, c, d: nodes [a, c, d], parents
[-1, 0, 0].

Hot vocabulary (`hot_vocab` V', FR-Spec, Zhao et al. 2025, arXiv 2502.14856): the head drafts from the V' most
frequent tokens only, through a [V', H] slice of the target's LM head taken once in setup, so each depth reads V'
rows of it instead of all V (at Llama-3's 128,256 tokens the four full LM-head passes are most of the draft's bytes).
The ranking is the head's `hot_tokens` (token ids, most frequent first: every id where `zoo train-head` counted it on
the training text and saved it beside the head; a published head's folder may hold a token map of the first N instead,
`hot_tokens_N.pt` as `zoo export-head --hot-vocab N` writes it, SGLang's --speculative-token-map format). Scores are
the log-softmax over the hot tokens; verification is the target's, so the output is exactly as without it, only
tokens outside the hot set are never drafted.

The children are deterministic top-K candidates, so `DraftTree.draft_probs` stays None and sampled verification treats
each as one-hot q (engine/verify.py): the output is exactly target-distributed at any temperature. Scores are the
head's plain log-softmax (its confidence), independent of the sampling settings. No host sync anywhere in `propose`.
An untrained head drafts poorly, but the output is still exactly the target's; `python -m workbench zoo train-head
--kind eagle --preset P` distils one (workbench/zoo/train_eagle.py) into <preset>/eagle/.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workbench.engine.drafters.base import BatchState, DraftContext, OneStepDrafter
from workbench.engine.drafters.head_io import HotVocab, SavedHead
from workbench.engine.graphs import FixedShapeStep
from workbench.engine.kv_cache import make_cache
from workbench.engine.topk import ranked_topk
from workbench.engine.tree import DraftTree, pack_tree
from workbench.models.config import ModelConfig
from workbench.choices import tree_capacity
from workbench.models.llama import DecoderLayer, Linear, full_config


class EagleSettingsError(ValueError):
    """A tree setting the drafter cannot build; the message names the knob and what is allowed."""


def check_tree(depth, topk, budget, vocab_size: int | None = None) -> None:
    """EagleSettingsError unless the tree can be built: 1 <= D, 1 <= K (<= vocabulary), D <= N <= K + (D-1) K^2."""
    for name, value in (("tree_depth", depth), ("tree_topk", topk), ("tree_budget", budget)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EagleSettingsError(f"{name} must be a whole number >= 1, got {value!r}")
    if vocab_size is not None and topk > vocab_size:
        raise EagleSettingsError(f"tree_topk={topk} exceeds the vocabulary ({vocab_size} tokens): lower tree_topk")
    if budget < depth:
        raise EagleSettingsError(f"tree_budget={budget} is below tree_depth={depth}: the budget must hold at least one "
                                 f"full-depth path; raise tree_budget to >= {depth} or lower tree_depth")
    if budget > tree_capacity(depth, topk):
        raise EagleSettingsError(f"tree_budget={budget} exceeds the {tree_capacity(depth, topk)} candidates that "
                                 f"tree_depth={depth}, tree_topk={topk} offer (K + (D-1) K^2): lower tree_budget or "
                                 f"raise tree_topk / tree_depth")


def rerank(cand_tokens: torch.Tensor, cand_scores: torch.Tensor, cand_parents: torch.Tensor, cand_depths: torch.Tensor,
           budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the `budget` candidates with the best cumulative log-probability, as a tree (no host sync).

    cand_* [B, C]: token, score, parent (candidate index, -1 = the root; parents come before children) and depth of
    each candidate -> (token_ids, parents (node index, -1 = root), depths), each [B, budget], in candidate order.
    A child scores at most its parent and the sort is stable, so a kept child's parent is always kept.

    The module docstring's example (K = 2, D = 2, N = 3): candidates a, b, then a's children c, d and b's e, f:
    >>> tok = torch.tensor([[10, 11, 12, 13, 14, 15]])
    >>> score = torch.tensor([[-0.1, -2.3, -0.3, -1.6, -2.4, -5.3]])
    >>> rerank(tok, score, torch.tensor([[-1, -1, 0, 0, 1, 1]]), torch.tensor([[1, 1, 2, 2, 2, 2]]), 3)
    (tensor([[10, 12, 13]]), tensor([[-1,  0,  0]]), tensor([[1, 2, 2]]))
    """
    keep = torch.sort(cand_scores, stable=True, dim=-1, descending=True).indices[:, :budget].sort(-1).values  # [B, N]
    # a kept parent's node index is its place in the sorted `keep`; the root (-1) sorts before every candidate: -1
    parents = torch.searchsorted(keep, cand_parents.gather(1, keep), right=True) - 1
    return cand_tokens.gather(1, keep), parents, cand_depths.gather(1, keep)


EAGLE_STYLES = ("workbench", "eagle")


@dataclass(frozen=True)
class EagleHeadConfig:
    """The head's decoder layer: the target's attention and MLP shapes (its RoPE tables are the target's), and its
    structure (`style`):

    "workbench"  fc([hidden; embed]) -> decoder layer (with its input RMSNorm) -> the target's final norm
    "eagle"      the published EAGLE-1/2 head: fc([embed; hidden]) -> decoder layer without an input norm -> no
                 final norm (the layer's output goes to the target's LM head as it is), as SafeAILab's cnets.py and
                 vLLM's EagleLlamaForCausalLM compute it; `fc_bias` as the checkpoint has it
    Both read the target's final-norm hidden states (what a Hugging Face Llama returns).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    style: str = "workbench"
    fc_bias: bool = True

    def __post_init__(self) -> None:
        if self.style not in EAGLE_STYLES:
            raise ValueError(f"EAGLE head style {self.style!r} is unknown; choose one of {', '.join(EAGLE_STYLES)}")

    @classmethod
    def of_target(cls, c: ModelConfig, style: str = "workbench") -> "EagleHeadConfig":
        return cls(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                   c.rms_norm_eps, style=style)

    def layer_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=1, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps)


class EagleHead(SavedHead):
    """fc over [hidden; token embedding] -> one decoder layer -> the target's final norm: a predicted hidden state.

    `forward(target, hidden, token_ids, positions, attn)`: hidden [B, T, H] (target hidden states, or predicted ones),
    token_ids [B, T] (the token AFTER each hidden state's position), positions [B, T] (RoPE positions of the head's
    entries), attn an AttentionBackend (the head's KV cache; None = plain causal, for training) -> features [B, T, H].
    The target is an argument, not a submodule: its embedding, norm and LM head are shared, never saved here.
    Saves and loads as a head folder (`SavedHead`; HF names for the layer's q/k/v and gate/up).
    """

    kind, label, config_class = "eagle", "EAGLE head", EagleHeadConfig

    def __init__(self, config: EagleHeadConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layer = DecoderLayer(config.layer_config(), 0)
        if config.style == "eagle":
            self.layer.input_layernorm = None  # the published head's first layer has none

    @property
    def attention(self):
        """The layer's `Attention` (its `attend` runs between `pre` and `post`)."""
        return self.layer.self_attn

    @property
    def hidden_columns(self) -> slice:
        """fc's input columns that read the hidden state (the rest read the token embedding)."""
        h = self.config.hidden_size
        return slice(h, 2 * h) if self.config.style == "eagle" else slice(0, h)

    @classmethod
    def for_target(cls, target, seed: int = 0, std: float = 0.02, style: str = "workbench") -> "EagleHead":
        """An untrained head sized for `target`, initialised deterministically from `seed`, in its dtype and device;
        its token ranking is id order (it has seen no text; `zoo train-head` counts one)."""
        head = cls(EagleHeadConfig.of_target(full_config(target), style))
        head.reset_parameters(seed, std)
        head.hot_tokens = torch.arange(target.config.vocab_size)
        p = next(target.parameters())
        return head.to(device=p.device, dtype=p.dtype).eval()

    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> None:
        """Normal(0, std) matrices, zero biases, unit norm weights; the fc starts as [I; 0] plus noise, so the
        untrained head passes the target's hidden state through (a useful start for training)."""
        g = torch.Generator().manual_seed(seed)
        h = self.config.hidden_size
        with torch.no_grad():
            for name, w in self.named_parameters():
                if name.endswith("norm.weight"):
                    w.fill_(1.0)
                elif name.endswith("bias"):
                    w.zero_()
                else:
                    w.copy_(torch.randn(w.shape, generator=g) * std)
            self.fc.weight[:, self.hidden_columns] += torch.eye(h)

    def check_target(self, target) -> None:
        """ValueError unless this head's layer fits `target` (it shares the target's embedding, norm and RoPE)."""
        want = EagleHeadConfig.of_target(full_config(target))
        if (self.config.hidden_size, self.config.head_dim) != (want.hidden_size, want.head_dim):
            raise ValueError(f"EAGLE head has hidden size {self.config.hidden_size} / head dim {self.config.head_dim}, "
                             f"the target {want.hidden_size} / {want.head_dim}: the head must be trained for this "
                             f"target (zoo train-head --kind eagle)")
        if self.config.num_key_value_heads != want.num_key_value_heads:  # its KV cache is shaped like the target's
            raise ValueError(f"EAGLE head has {self.config.num_key_value_heads} KV heads, the target "
                             f"{want.num_key_value_heads}: the head must be trained for this target "
                             f"(zoo train-head --kind eagle)")

    def forward(self, target, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                attn=None, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """rope: the (cos, sin_signed) [B, T, 1, Dh] rows of `positions` where the caller looked them up (a draft
        looks up all its frontier levels' at once); None: looked up here."""
        from workbench.models.attention import CausalAttention

        attn = CausalAttention() if attn is None else attn
        x, qkv = self.pre(target, hidden, token_ids, positions, attn, rope)
        return self.post(target, x, self.layer.self_attn.attend(attn, *qkv))

    # `forward` in two halves around the attention call, for the draft: its compiled methods between two attentions
    # call one forward's `post` and the next one's `pre`, so torch.compile traces them into one graph with the draft's
    # own work (each half inside the layer's frames was a graph of its own: residual adds and norms that did not fuse)
    def pre(self, target, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, attn,
            rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, tuple]:
        """-> (x: the layer's input [B, T, H], its residual; (q, k, v, rope): `Attention.attend`'s arguments)."""
        embed = target.model.embed_tokens(token_ids)
        published = self.config.style == "eagle"
        x = self.fc(torch.cat([embed, hidden] if published else [hidden, embed], -1))  # [B, T, H]
        cos, sin = rope if rope is not None else rope_rows(target, positions, x.dtype)
        norm = None if published else self.layer.input_layernorm  # the published head's first layer has none
        return x, self.layer.self_attn.project(x, cos, sin, attn, norm)

    def post(self, target, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """`pre`'s x and the attention's output -> the predicted features [B, T, H] (the layer's o_proj and MLP with
        their residuals, then the target's final norm; the published head: none)."""
        x = self.layer.post(x, attended)
        return x if self.config.style == "eagle" else target.model.norm(x)


def rope_rows(target, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's (cos, sin_signed) RoPE rows at `positions` [...]: each [..., 1, Dh] (a head dim for broadcast)."""
    cos_table, sin_table = target.rope_tables(positions.device, dtype)
    return cos_table[positions].unsqueeze(-2), sin_table[positions].unsqueeze(-2)


class EagleDrafter(OneStepDrafter):
    name = "eagle"
    wants_hidden = True
    reads_kv_len = False  # the draft reads its own pending pairs
    distinct_siblings = True  # a node's children are its top-K tokens
    overlaps = True  # propose reads the device only (the engine's kv_len_host may be upper bounds)

    def __init__(self, head: EagleHead, target, tree_depth: int = 4, tree_topk: int = 4, tree_budget: int = 16,
                 hot_vocab: int = 0):
        vocab = target.config.vocab_size
        HotVocab.check(head, vocab, hot_vocab, EagleSettingsError, "zoo train-head --kind eagle")
        check_tree(tree_depth, tree_topk, tree_budget, hot_vocab or vocab)
        head.check_target(target)
        self.hot_vocab = hot_vocab
        self._hot = HotVocab(hot_vocab) if hot_vocab else None  # the LM head's hot rows (setup)
        self.head, self.target = head, target
        self.tree_depth, self.tree_topk, self.tree_budget = tree_depth, tree_topk, tree_budget
        self.num_nodes = tree_budget
        self.model_forwards_per_step = tree_depth  # the committed pairs' forward + D-1 frontier forwards
        self.proposes_chains = tree_topk == 1  # K = 1 forces N = D: the head's greedy chain
        self.cache = None
        self.step: FixedShapeStep | None = None  # the whole draft (pending pairs, D-1 depths, rerank) as one step
        self._key = None
        # per cache row (+ pad_row): the committed pairs not yet run through the head (at most 1 + D of them)
        self.pend_hidden: torch.Tensor | None = None  # [R + 1, 1 + D, H] the target's hidden states h_j
        self.pend_tokens: torch.Tensor | None = None  # [R + 1, 1 + D] long: the token after each, x_{j+1}
        # [3, R + 1] long, per row: head position of the first pending pair, index of the last valid one (valid pairs
        # - 1), the root's position (first + valid pairs): one tensor, so a step reads and writes them in one launch
        self.pend_pos: torch.Tensor | None = None

    # -- buffers --------------------------------------------------------------------------------------------------
    def _draft_slots(self) -> int:
        return (self.tree_depth - 1) * self.tree_topk  # head entries of the frontier forwards, after the root

    def setup(self, ctx: DraftContext) -> None:
        super().setup(ctx)
        c, d = full_config(self.target), self.tree_depth  # the head's own (replicated) layer
        need = ctx.max_len + 1 + d + self._draft_slots()
        if self.cache is not None and self.cache.fits(ctx.max_rows, need) and self.cache.max_rows == ctx.max_rows \
                and self._key == (ctx.graphs, ctx.paged, ctx.kv_block_size, torch.device(ctx.device)):
            self.cache.reset()
            return
        dtype = next(self.target.parameters()).dtype
        stats = self.step.stats if self.step is not None else None  # cumulative across rebuilds, like the engine's
        self.cache = self.step = None  # free the old pool and the graphs that read it first
        rows = ctx.max_rows + 1
        self.cache = make_cache(ctx.paged, num_layers=1, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                                max_rows=ctx.max_rows, max_len=need, dtype=dtype, device=ctx.device,
                                block_size=ctx.kv_block_size, attention=ctx.attention)  # the kernel takes prefix masks
        self.pend_hidden = torch.zeros(rows, 1 + d, self._feature_width(), dtype=dtype, device=ctx.device)
        self.pend_tokens = torch.zeros(rows, 1 + d, dtype=torch.long, device=ctx.device)
        self.pend_pos = torch.zeros(3, rows, dtype=torch.long, device=ctx.device)
        self._pad_pos = torch.tensor([[0], [0], [1]], device=ctx.device)  # pad_row: 1 pair at position 0, root at 1
        self.pend_pos[:, ctx.max_rows:] = self._pad_pos
        if self._hot is not None:  # the LM head's hot rows, one copy (a quantized head's dequantized)
            self._hot.setup(self.head, self.target, ctx.device)
        k, slots = self.tree_topk, self._draft_slots()
        # constants the step reads (built here: a host->device copy inside a captured step is refused)
        self._cand_depth = torch.cat([torch.ones(k, dtype=torch.long)] + [torch.full((k * k,), i, dtype=torch.long)
                                                                          for i in range(2, d + 1)]).to(ctx.device)
        self._eye = torch.eye(k, dtype=torch.bool, device=ctx.device)
        self._pend_offsets = torch.arange(1 + d, device=ctx.device)  # the pending pairs' positions after the first
        levels = torch.arange(d - 1)  # frontier level depth - 1: its slots start at root + level K, RoPE at root + level
        self._level_offsets = torch.stack([levels * k, levels]).unsqueeze(-1).to(ctx.device)  # [2, D-1, 1]
        self._level_slots = (levels.view(-1, 1, 1) * k + torch.arange(k)).to(ctx.device)  # [D-1, 1, K] after the root
        self._root_children = torch.arange(k, device=ctx.device).unsqueeze(0)  # depth 1's candidate indices [1, K]
        self._root_parents = torch.full((1, 1, k), -1, dtype=torch.long, device=ctx.device)
        self._no_ancestors = torch.zeros(1, k, slots, dtype=torch.bool, device=ctx.device)
        # per level, the one-hot draft slot of each of its K frontier nodes [D-1, K, (D-1) K]
        self._slot_of = torch.eye(slots, dtype=torch.bool, device=ctx.device).view(max(d - 1, 1), k, slots) \
            if slots else torch.zeros(1, k, 0, dtype=torch.bool, device=ctx.device)
        self._valid = torch.ones(max(rows, max(ctx.graphs.batch_sizes)), self.tree_budget, dtype=torch.bool,
                                 device=ctx.device)  # every node valid: row slices of it are the step's mask
        self._key = (ctx.graphs, ctx.paged, ctx.kv_block_size, torch.device(ctx.device))
        if ctx.graphs.fixed_shape:
            self.step = FixedShapeStep("eagle", self._draft, self._pads, ctx.graphs, ctx.device)
            self.step.stats = stats if stats is not None else self.step.stats

    def _feature_width(self) -> int:
        """The width of the hidden states the engine hands this drafter (the target's hidden size)."""
        return self.target.config.hidden_size

    def _pads(self, key) -> dict[str, torch.Tensor]:
        return {"rows": torch.tensor(self.cache.pad_row, device=self.ctx.device)}

    # -- the contract ---------------------------------------------------------------------------------------------
    def prefill(self, state: BatchState, prompt_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None = None) -> None:
        """Head entries (h_i, x_{i+1}) for the prompts; the last one (h_{P-1}, root) stays pending."""
        b, p = prompt_ids.shape
        rows = state.rows
        next_ids = state.tokens[rows, 1:p + 1]  # [B, P]: x_{i+1}; at i = P_b - 1 the root (written before prefill)
        zeros = torch.zeros(b, dtype=torch.long, device=rows.device)
        self.cache.begin(rows, zeros, [0] * b, p, rows_host=state.rows_host, prefill=True)
        self.head(self.target, hidden, next_ids, positions, self.cache)
        last = state.kv_len - 1  # [B]
        arange = torch.arange(b, device=rows.device)
        self.pend_hidden[rows, 0] = hidden[arange, last]
        self.pend_tokens[rows, 0] = state.root
        self.pend_pos[:, rows] = torch.stack([last, torch.zeros_like(last), state.kv_len])  # one pair: the root's
        for row, n in zip(state.rows_host, state.kv_len_host):
            self.cache.truncate(row, n - 1)

    def propose(self, state: BatchState) -> DraftTree:
        # room for every head entry of this step: the pending pairs (<= 1 + D), then the frontier forwards. The first
        # pending pair sits at the previous step's root, at most the root's index - 1: sized from the engine's (upper
        # bound of the) root index, so a step launched before the last one is read plans without reading the device
        base_host = [n - 1 for n in state.kv_len_host]
        self.cache.plan(state.rows_host, base_host, 1 + self.tree_depth + self._draft_slots())
        if self.step is not None:
            tokens, parents, depths, valid, packed = self.step(0, len(state.rows_host), {"rows": state.rows},
                                                               state.rows_host)
        else:
            tokens, parents, depths, valid, packed = self._draft(state.rows)
        return DraftTree(tokens, parents, depths, valid, None, is_chain=self.proposes_chains,
                         depth_bound=self.tree_depth, distinct_siblings=self.distinct_siblings, packed=packed)

    splits_commit = True

    def commit(self, state: BatchState, acc, old_kv_len_host: list[int],
               hidden: torch.Tensor | None = None) -> None:
        """The step's committed pairs become pending: (h of the root, first accepted token), ..., (h of the last
        accepted node, bonus/recovered token); entries past acc.num_accepted are padding."""
        self.commit_device(state.rows, acc, hidden, None)
        self.commit_host(state, old_kv_len_host)

    def commit_device(self, rows: torch.Tensor, acc, hidden: torch.Tensor | None, pad_row: int | None) -> None:
        root = self.pend_pos[2, rows]  # the old root's position: the first pending pair's now
        self.pend_pos[:, rows] = torch.stack([root, acc.num_accepted, root + acc.num_accepted + 1])
        w = hidden.shape[1]  # 1 + D, or fewer for a step verified shorter (a K = 1 chain cut by the engine)
        self.pend_hidden[rows, :w] = hidden  # entries past the count are padding
        self.pend_tokens[rows, :w] = acc.emitted
        if pad_row is not None:  # padding rows of a captured step: the scratch row keeps one pair at position 0
            self.pend_pos[:, pad_row:] = self._pad_pos

    @property
    def pend_base(self) -> torch.Tensor:
        """[R + 1] long: head position of each row's first pending pair."""
        return self.pend_pos[0]

    @property
    def pend_count(self) -> torch.Tensor:
        """[R + 1] long: each row's valid pending pairs (>= 1)."""
        return self.pend_pos[1] + 1

    def device_state(self) -> list[torch.Tensor]:
        return [self.pend_pos, self.pend_hidden, self.pend_tokens]

    @property
    def depth_bound(self) -> int:
        return self.tree_depth

    def commit_host(self, state: BatchState, old_kv_len_host: list[int]) -> None:
        for row, base in zip(state.rows_host, old_kv_len_host):
            self.cache.truncate(row, base)  # paged: give back blocks that held only this step's draft entries

    def release(self, row: int) -> None:
        self.cache.free(row)

    # -- the draft, one fixed-shape step --------------------------------------------------------------------------
    def _top(self, features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """features [..., H] -> the K best (float32 log-probabilities, target token ids) [..., K] through the target's
        LM head (the scores of the tree), or its hot rows only (hot_vocab)."""
        if self._hot is None:
            return ranked_topk(self.target.compute_logits(features), k)
        score, idx = ranked_topk(self._hot.logits(features), k)  # EAGLE-2's features are the target's width
        return score, self._hot.ids[idx]

    # The draft is split into methods so that torch.compile traces its tensor work. Each head forward breaks the
    # compiled graph at its attention (one launch kept outside torch.compile, llama.attend_uncompiled), and dynamo
    # runs a frame with a graph break inside a loop wholly eagerly: written inline, the loop over depths ran its
    # gathers, index arithmetic and concatenations as ~23 separate eager ops per draft (tiny). `_draft` only calls
    # the attention and the compiled methods between two attentions: `_begin` (the root forward's first half),
    # `_advance` (one forward's second half, its children and the next frontier, then the next forward's first half)
    # and `_finish` (the last forward's second half and the rerank). Each is one graph, so inductor fuses one level's
    # frontier gathers with the next level's input (the head's halves, `pre` and `post`, are plain calls inside them):
    # D + 1 graphs per draft.
    def _draft(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """rows [B] -> (token_ids, parents, depths [B, N] long, valid [B, N] bool, the four packed [B, 4N + 2]:
        `pack_tree`, the engine's tree step's input). Reads only the pending buffers and the head's cache (what a CUDA
        graph captures)."""
        x, qkv, root = self._begin(rows)
        state = cands = None
        for depth in range(1, self.tree_depth):
            x, qkv, state, cands = self._advance(rows, depth, x, self._attend(qkv), root, state, cands)
        return self._finish(rows, x, self._attend(qkv), root, state, cands)

    def _attend(self, qkv: tuple) -> torch.Tensor:
        """The head's attention over its cache: `pre`'s q, k, v (the head's one layer, index 0)."""
        return self.head.attention.attend(self.cache, *qkv)

    def _begin(self, rows: torch.Tensor) -> tuple:
        """The root forward's first half: the pending committed pairs into the head's layer -> (its input, the
        attention's arguments, root = (each row's last valid pair [B], the root's position [B]))."""
        d_max, span = self.tree_depth, self.cache.static_span
        base, last, root_pos = self.pend_pos[:, rows]  # [B] each: first pair's position, last pair, root's position
        positions = base.unsqueeze(1) + self._pend_offsets  # [B, 1 + D]: head positions, also the slots written
        self.cache.prepare(rows, base, 1 + d_max, None, span, write_pos=positions)
        x, qkv = self.head.pre(self.target, self.pend_hidden[rows], self.pend_tokens[rows], positions, self.cache)
        return x, qkv, (last, root_pos)

    def _advance(self, rows: torch.Tensor, depth: int, x: torch.Tensor, attended: torch.Tensor, root: tuple,
                 state: tuple | None, cands: list | None) -> tuple:
        """Forward depth - 1's second half, its children (`_grow`), then frontier level `depth`'s forward's first
        half -> (its input, the attention's arguments, the frontier's state, the candidate lists)."""
        state, cands = self._grow(rows, depth - 1, x, attended, root, state, cands)
        front_score, front_tok, front_cand, front_feat, ancestors, levels = state
        level_start, level_pos, level_write, level_rope = levels
        k, span, b = self.tree_topk, self.cache.static_span, rows.shape[0]
        first = (depth - 1) * k  # the frontier's draft slots: first .. first + K - 1
        self.cache.prepare(rows, level_start[depth - 1], k, self._eye.expand(b, k, k), span,
                           prefix_mask=ancestors[:, :, :first], write_pos=level_write[depth - 1])
        x, qkv = self.head.pre(self.target, front_feat, front_tok, level_pos[depth - 1].unsqueeze(1).expand(b, k),
                               self.cache, rope=(level_rope[0][depth - 1], level_rope[1][depth - 1]))
        return x, qkv, state, cands

    def _finish(self, rows: torch.Tensor, x: torch.Tensor, attended: torch.Tensor, root: tuple, state: tuple | None,
                cands: list | None) -> tuple[torch.Tensor, ...]:
        """The last forward's second half and its children, then the rerank -> `_draft`'s outputs."""
        _, cands = self._grow(rows, self.tree_depth - 1, x, attended, root, state, cands)
        return self._rerank(cands, rows.shape[0])

    def _grow(self, rows: torch.Tensor, depth: int, x: torch.Tensor, attended: torch.Tensor, root: tuple,
              state: tuple | None, cands: list | None) -> tuple[tuple | None, list]:
        """Forward `depth`'s second half (0: the root's over the pending pairs; d >= 1: frontier level d's) and its
        children added to the candidate lists [tokens, scores, parents] -> (the next frontier's state, the lists)."""
        if depth == 0:
            return self._root(rows, x, attended, root)
        return self._level(rows, depth, x, attended, state, cands), cands

    def _root(self, rows: torch.Tensor, x: torch.Tensor, attended: torch.Tensor,
              root: tuple) -> tuple[tuple, list[list[torch.Tensor]]]:
        """The root forward's features; the last valid pending pair drafts depth 1 (the root's top-K children, all
        of them the frontier) -> (the frontier's state, the candidate lists [tokens, scores, parents])."""
        d_max, k = self.tree_depth, self.tree_topk
        b = rows.shape[0]
        last, root_pos = root
        feats = self.head.post(self.target, x, attended)  # [B, 1 + D, H]
        h = feats.shape[-1]
        root_feat = feats.gather(1, last.view(b, 1, 1).expand(-1, 1, h))  # [B, 1, H]
        # per frontier level (depth - 1): where its K entries start [D-1, B], and their RoPE position [D-1, B] (the
        # depth-d frontier entries sit at root_pos + d - 1)
        level_start, level_pos = self._level_offsets + root_pos
        level_write = self._level_slots + root_pos.unsqueeze(1)  # [D-1, B, K]: the slots each level writes
        level_rope = rope_rows(self.target, level_pos.unsqueeze(-1).expand(d_max - 1, b, k), feats.dtype)
        front_score, front_tok = self._top(root_feat.squeeze(1), k)  # [B, K] each
        front_cand = self._root_children.expand(b, k)  # [B, K]: frontier's candidate indices
        front_feat = root_feat.expand(b, k, h)  # [B, K, H]: the feature each frontier node's entry reads
        ancestors = self._no_ancestors.expand(b, k, self._draft_slots())  # [B, K, (D-1) K] draft slots above each
        cands = [[front_tok], [front_score], [self._root_parents.expand(b, 1, k)]]  # parents: candidate indices
        levels = (level_start, level_pos, level_write, level_rope)
        return (front_score, front_tok, front_cand, front_feat, ancestors, levels), cands

    def _level(self, rows: torch.Tensor, depth: int, x: torch.Tensor, attended: torch.Tensor, state: tuple,
               cands: list[list[torch.Tensor]]) -> tuple:
        """Frontier level `depth`'s (1 .. D-1) features: each frontier node's children scored and added to `cands`,
        the K best of them the next frontier -> the next frontier's state (the last level: the state unchanged)."""
        k = self.tree_topk
        front_score, front_tok, front_cand, front_feat, ancestors, levels = state
        b = rows.shape[0]
        f = self.head.post(self.target, x, attended)  # [B, K, H]
        child_logp, child_tok = self._top(f, k)  # [B, K, K]
        child_score = (front_score.unsqueeze(-1) + child_logp).flatten(1)  # [B, K*K]
        child_tok = child_tok.flatten(1)
        cands[0].append(child_tok)
        cands[1].append(child_score)
        cands[2].append(front_cand.unsqueeze(-1).expand(b, k, k))  # each frontier node's K children
        if depth == self.tree_depth - 1:
            return state
        # the K best of the K*K children, ties to the earlier (the ranking kernel's rule); a sort, which inductor can
        # fuse with the sum where ranked_topk's kernel is a launch of its own
        front_score, best = child_score.sort(dim=-1, descending=True, stable=True)
        front_score, best = front_score[:, :k], best[:, :k]  # [B, K]
        parent = best // k  # [B, K]: frontier rank of each new frontier node's parent
        front_cand = k + (depth - 1) * k * k + best  # candidate indices: K at depth 1, K*K per level after
        front_tok = child_tok.gather(1, best)
        front_feat = f.gather(1, parent.unsqueeze(-1).expand(-1, -1, f.shape[-1]))
        # the parent's ancestors and the parent's own slot
        ancestors = ancestors.gather(1, parent.unsqueeze(-1).expand(-1, -1, ancestors.shape[-1])) | \
            self._slot_of[depth - 1][parent]
        return front_score, front_tok, front_cand, front_feat, ancestors, levels

    def _rerank(self, cands: list[list[torch.Tensor]], b: int) -> tuple[torch.Tensor, ...]:
        """The candidates reranked to the node budget -> (token_ids, parents, depths, valid, packed)."""
        n_cand = self._cand_depth.shape[0]
        tokens, parents, depths = rerank(torch.cat(cands[0], 1), torch.cat(cands[1], 1),
                                         torch.cat(cands[2], 1).view(b, n_cand),
                                         self._cand_depth.expand(b, n_cand), self.tree_budget)
        valid = self._valid[:b]
        return tokens, parents, depths, valid, pack_tree(tokens, parents, depths, valid)

    @property
    def settings(self) -> dict:
        return {"tree_depth": self.tree_depth, "tree_topk": self.tree_topk, "tree_budget": self.tree_budget,
                "hot_vocab": self.hot_vocab}
