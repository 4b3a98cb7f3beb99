"""ReDrafter (Cheng et al. 2024, arXiv 2403.09919): a small recurrent head over the target's hidden states drafts W
beams of L tokens by beam search; the beams are merged into one prefix tree (`DraftTree.from_beams`) and verified.

The head's recurrence, per beam, from the target's final hidden state h of the last committed token:
    s_0 = h;   s_d, f_d = head(s_{d-1}, embed(x_{d-1}), h)   with x_0 = the root and embed = the TARGET's embedding
    logits_d = target.compute_logits(f_d)                       (the TARGET's LM head: the head owns no vocabulary)
Beam search keeps the W best prefixes by summed log-probability at every depth. With greedy settings the log-probs are
the plain log-softmax; with sampled settings they come from `sampling.probs_from_logits` with the target's own
temperature / top-k / top-p ("temperature consistency"). Either way the beams are deterministic candidates
(`draft_probs` None), which the verifier treats as one-hot q: lossless. `diversity_penalty` > 0 picks a depth's W
beams one at a time, each candidate's score lowered by penalty x (number of beams already picked at this depth with
the same token); a beam keeps its log-probability as its score.

Example: W = 2, L = 2, depth 1 picks tokens a, b (beams [a], [b]); depth 2 extends them to the 2 best of all
children, say [a, c] and [a, d] -> tree nodes a, c, d with parents -1, 0, 0 (the beam [b] fell out). W = 1 is a
chain (plain greedy drafting with the head).

The drafter keeps one tensor of state, `last_hidden` [R + 1, H]: per cache row, the target's hidden state of its
last committed token (set at prefill and by every commit, from what the engine hands over with `wants_hidden`). The
whole beam search reads only `last_hidden`, the row ids and the roots, so with fixed shapes it is one step (one CUDA
graph per batch bucket on a GPU). The head here is untrained unless loaded (`RedrafterHead.load`); an untrained head
drafts poorly (little is accepted) but the output is still exactly the target's. `python -m workbench zoo train-head
--kind redrafter --preset P` distils one from the frozen target (workbench/zoo/train_head.py) and saves it beside
the target as <preset>/redrafter/, where the bench finds it (workbench/zoo/heads.py checks it fits the target).

Hot vocabulary (`hot_vocab` V', FR-Spec, as EAGLE-2's): each depth scores only the head's V' most frequent tokens
(its ranking, counted by `zoo train-head` on the training text) through a [V', H] slice of the target's LM head
taken once in setup, so the L head evaluations read V' rows of it instead of all V (at Llama-3's 128,256 tokens the
L full LM-head passes are most of the search's bytes). Beams are still deterministic candidates: lossless as before;
tokens outside the hot set are never drafted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from workbench.engine.drafters.base import BatchState, DraftContext, OneStepDrafter
from workbench.engine.drafters.head_io import HotVocab, SavedHead
from workbench.engine.graphs import FixedShapeStep, on_device
from workbench.engine.sampling import probs_from_logits
from workbench.engine.topk import ranked_topk
from workbench.engine.tree import DraftTree, pack_tree


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int  # H: the target's hidden size (the recurrent state and the features have it)
    embed_size: int  # the target's token-embedding width (= H for Llama-family models)


class RedrafterHead(SavedHead):
    """The recurrent draft head: a GRU cell over the previous token's (target) embedding, and a residual MLP over
    [s_d; h] that makes the features the target's LM head reads. Saves and loads as a head folder (`SavedHead`).

        s_d = GRUCell(embed(x_{d-1}), s_{d-1})               # [..., H]
        f_d = s_d + W_2 silu(W_1 [s_d; h])                   # [..., H]
    """

    kind, label, config_class = "redrafter", "ReDrafter head", HeadConfig

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        h, e = config.hidden_size, config.embed_size
        self.cell = nn.GRUCell(e, h)
        self.up = nn.Linear(2 * h, h)
        self.down = nn.Linear(h, h)

    @classmethod
    def for_target(cls, target, seed: int = 0, std: float = 0.02) -> "RedrafterHead":
        """An untrained head sized for `target`, initialised deterministically from `seed`, in its dtype and device;
        its token ranking is id order (`zoo train-head` counts one)."""
        c = target.config
        head = cls(HeadConfig(c.hidden_size, c.hidden_size))
        head.reset_parameters(seed, std)
        head.hot_tokens = torch.arange(c.vocab_size)  # its token ranking: id order (it has seen no text)
        p = next(target.parameters())
        return head.to(device=p.device, dtype=p.dtype).eval()

    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for w in self.parameters():
                w.copy_(torch.randn(w.shape, generator=g) * std)

    def forward(self, state: torch.Tensor, prev_embed: torch.Tensor,
                anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """state [M, H], prev_embed [M, E], anchor [M, H] (the target's hidden h) -> (state [M, H], features [M, H])."""
        state = self.cell(prev_embed, state)
        features = state + self.down(nn.functional.silu(self.up(torch.cat([state, anchor], -1))))
        return state, features


class RedrafterDrafter(OneStepDrafter):
    name = "redrafter"
    wants_hidden = True
    proposes_beams = True
    distinct_siblings = True  # beams merged into a prefix tree: equal prefixes are one node
    reads_kv_len = False  # the search reads its roots from the engine's buffers (or `state.root` without them)
    overlaps = True

    def __init__(self, head: RedrafterHead, target, beam_width: int = 2, beam_length: int = 4,
                 diversity_penalty: float = 0.0, hot_vocab: int = 0):
        if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1:
            raise ValueError(f"beam_width (beams W) must be a whole number >= 1, got {beam_width!r}")
        if isinstance(beam_length, bool) or not isinstance(beam_length, int) or beam_length < 1:
            raise ValueError(f"beam_length (draft depth L) must be a whole number >= 1, got {beam_length!r}")
        if not (isinstance(diversity_penalty, (int, float)) and math.isfinite(diversity_penalty)
                and diversity_penalty >= 0):
            raise ValueError(f"diversity_penalty must be a finite number >= 0, got {diversity_penalty!r}")
        if head.config.hidden_size != target.config.hidden_size:
            raise ValueError(f"ReDrafter head has hidden size {head.config.hidden_size}, the target "
                             f"{target.config.hidden_size}: the head must be trained for this target")
        HotVocab.check(head, target.config.vocab_size, hot_vocab, ValueError, "zoo train-head --kind redrafter")
        if hot_vocab and beam_width > hot_vocab:
            raise ValueError(f"beam_width={beam_width} exceeds hot_vocab={hot_vocab}: depth 1 picks beam_width "
                             f"distinct tokens; lower beam_width or raise hot_vocab")
        self.hot_vocab = hot_vocab
        self._hot = HotVocab(hot_vocab) if hot_vocab else None  # the LM head's hot rows (setup)
        self.head, self.target = head, target
        self.beam_width, self.beam_length, self.diversity_penalty = beam_width, beam_length, float(diversity_penalty)
        self.num_nodes = beam_width * beam_length
        self.model_forwards_per_step = beam_length  # head evaluations (each over W beams)
        self.proposes_chains = beam_width == 1
        self.last_hidden: torch.Tensor | None = None  # [R + 1, H]: the last committed token's target hidden state
        self.step: FixedShapeStep | None = None  # the whole beam search as one fixed-shape step
        self._step_key = None
        self._step_buffers: tuple = (None, None)  # the engine's tokens / kv_len_all the step was built over

    def setup(self, ctx: DraftContext) -> None:
        super().setup(ctx)
        c = self.target.config
        dtype = next(self.target.parameters()).dtype
        stats = self.step.stats if self.step is not None else None  # cumulative across rebuilds, like the engine's
        if self.last_hidden is None or self.last_hidden.shape[0] != ctx.max_rows + 1 \
                or not on_device(self.last_hidden, ctx.device):
            self.step = self._step_key = None  # a captured search reads the old buffer: drop it first
            self.last_hidden = torch.zeros(ctx.max_rows + 1, c.hidden_size, dtype=dtype, device=ctx.device)
        # the search bakes the sampling settings in (greedy vs tempered log-probs) and reads the engine's buffers:
        # the very tensors (compared by identity while held here; an address could be reused by a tensor of another
        # shape, which a captured graph would read with the old one's)
        self._first_scores(ctx.device)
        if self._hot is not None and (self._hot.ids is None or not on_device(self._hot.ids, ctx.device)):
            self.step = self._step_key = None  # a captured search reads the old slice: drop it first
            self._hot.setup(self.head, self.target, ctx.device)
        key = (ctx.graphs, ctx.sampling)
        buffers = (ctx.tokens, ctx.kv_len_all)
        same = self._step_key == key and all(a is b for a, b in zip(self._step_buffers, buffers))
        self._step_buffers = buffers
        if ctx.graphs.fixed_shape and not same:
            self.step = FixedShapeStep("redrafter", self._draft, self._pads, ctx.graphs, ctx.device)
            self.step.stats = stats if stats is not None else self.step.stats
            self._step_key = key
        elif not ctx.graphs.fixed_shape:
            self.step = self._step_key = None

    def _pads(self, key) -> dict[str, torch.Tensor]:
        dev = self.ctx.device
        return {"rows": torch.tensor(self.ctx.max_rows, device=dev), "root": torch.tensor(0, device=dev)}

    def prefill(self, state: BatchState, prompt_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None = None) -> None:
        b = prompt_ids.shape[0]
        self.last_hidden[state.rows] = hidden[torch.arange(b, device=hidden.device), state.kv_len - 1]

    splits_commit = True

    def commit(self, state: BatchState, acc, old_kv_len_host: list[int],
               hidden: torch.Tensor | None = None) -> None:
        self.commit_device(state.rows, acc, hidden, None)

    def device_state(self) -> list[torch.Tensor]:
        return [self.last_hidden]

    @property
    def depth_bound(self) -> int:
        return self.beam_length

    def commit_device(self, rows: torch.Tensor, acc, hidden: torch.Tensor | None, pad_row: int | None) -> None:
        self.last_hidden[rows] = hidden.gather(1, acc.num_accepted.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1]))[:, 0]

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> float32 log-probabilities that score the beams (-inf where top-k / top-p cut)."""
        if self.ctx.sampling.greedy:
            return torch.log_softmax(logits.float(), -1)
        return probs_from_logits(logits, self.ctx.sampling).log()

    def _select(self, cand: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cand [B, W*V] scores of (parent beam, token) -> ([B, W] their scores, [B, W] indices of the kept
        candidates, best first)."""
        w = self.beam_width
        if self.diversity_penalty == 0.0:
            return ranked_topk(cand, w, log_softmax=False)
        b = cand.shape[0]
        finite = torch.where(torch.isneginf(cand), torch.full_like(cand, -1e30), cand)  # -inf: below any real one
        taken = torch.zeros_like(cand, dtype=torch.bool)
        same_token = torch.zeros(b, vocab, device=cand.device)  # [B, V]: beams picked at this depth per token
        picked = []
        for _ in range(w):
            score = finite - self.diversity_penalty * same_token.repeat(1, w)
            idx = score.masked_fill(taken, float("-inf")).argmax(-1)  # [B]
            picked.append(idx)
            taken.scatter_(1, idx.unsqueeze(1), True)
            same_token.scatter_add_(1, (idx % vocab).unsqueeze(1), torch.ones(b, 1, device=cand.device))
        idx = torch.stack(picked, 1)
        return cand.gather(1, idx), idx

    def _search(self, rows: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """rows [B], root [B] -> beam tokens [B, W, L]. Reads only `last_hidden` (what a CUDA graph captures)."""
        w, length = self.beam_width, self.beam_length
        embed = self.target.model.embed_tokens
        anchor = self.last_hidden[rows]  # [B, H]
        b, h = anchor.shape
        # [B*W, H], materialized: at B = 1 the reshape of the expand is a view with a zero row stride, which the GRU's
        # GEMM then reads through cuBLAS's unaligned fallback (9 us against 2.6 on tiny, H100)
        anchor = anchor.unsqueeze(1).expand(b, w, h).contiguous().view(b * w, h)
        state = anchor  # s_0 = h
        prev = root.unsqueeze(1).expand(b, w).reshape(b * w)  # [B*W]
        # [B, W]: only beam 0 is live before depth 1, so depth 1 picks W distinct children of the root
        score = self._first_scores(rows.device).expand(b, w)
        beams = torch.zeros(b, w, 0, dtype=torch.long, device=rows.device)
        for d in range(length):
            state, features = self.head(state, embed(prev), anchor)  # [B*W, H] each
            logits = self.target.compute_logits(features) if self._hot is None else self._hot.logits(features)
            vocab = logits.shape[-1]  # V, or V': the hot vocabulary's indices
            if self.ctx.sampling.greedy and self.diversity_penalty == 0.0:  # scored and ranked in one call
                score, idx = ranked_topk(logits, w, group=w, bias=score)  # [B, W] each over [B, W*V]
            else:
                cand = (score.unsqueeze(-1) + self.log_probs(logits).view(b, w, vocab)).view(b, w * vocab)
                score, idx = self._select(cand, vocab)  # [B, W] each
            parent, token = idx // vocab, idx % vocab
            if self._hot is not None:
                token = self._hot.ids[token]  # hot index -> target token id
            beams = torch.cat([beams.gather(1, parent.unsqueeze(-1).expand(-1, -1, d)), token.unsqueeze(-1)], -1)
            state = state.view(b, w, h).gather(1, parent.unsqueeze(-1).expand(-1, -1, h)).reshape(b * w, h)
            prev = token.reshape(b * w)
        return beams

    def _first_scores(self, device) -> torch.Tensor:
        """[1, W] float32: beam 0 at 0, the rest at -inf; made once per device (a captured search reads it: a host
        copy inside a capture is refused, so `setup` makes it first)."""
        scores = getattr(self, "_scores0", None)
        if scores is None or not on_device(scores, device):
            scores = torch.full((1, self.beam_width), float("-inf"), device=device)
            scores[:, 0] = 0.0
            self._scores0 = scores
        return scores

    def _roots(self, rows: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """The rows' roots read from the engine's buffers where the drafter was set up with them (so a step launched
        before the previous one is read finds its root on the device); else `root`."""
        if self.ctx.tokens is None or self.ctx.kv_len_all is None:
            return root
        return self.ctx.tokens[rows, self.ctx.kv_len_all[rows]]

    def _draft(self, rows: torch.Tensor, root: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """rows [B], root [B] -> the merged prefix tree's (token_ids, parents, depths, valid [B, W*L], beam_pairs
        [B, 2], all five packed [B, 4 W*L + 2]: `pack_tree`, the engine's tree step's input): the beam search and the
        merge as one fixed-shape step."""
        tree, _ = DraftTree.from_beams(self._search(rows, self._roots(rows, root)))
        fields = (tree.token_ids, tree.parents, tree.depths, tree.valid, tree.beam_pairs)
        # contiguous: one beam's chain has expanded parents / depths, which a kept step output cannot be copied into
        return tuple(x.contiguous() for x in fields) + (pack_tree(*fields),)

    def beam_tokens(self, state: BatchState) -> torch.Tensor:
        """The step's W beams of L tokens for state.rows: [B, W, L] long (eager; for inspection and tests)."""
        return self._search(state.rows, state.root)

    def propose(self, state: BatchState) -> DraftTree:
        if self.step is not None:
            root = state.root if self.ctx.tokens is None else None  # None: read from the engine's buffers
            parts = self.step(0, len(state.rows_host), {"rows": state.rows, "root": root}, state.rows_host)
        else:
            parts = self._draft(state.rows, state.root if self.ctx.tokens is None else None)
        tokens, parents, depths, valid, pairs, packed = parts
        return DraftTree(tokens, parents, depths, valid, None, is_chain=self.proposes_chains,
                         depth_bound=self.beam_length, beam_pairs=pairs, distinct_siblings=self.distinct_siblings,
                         packed=packed)

    @property
    def settings(self) -> dict:
        return {"beam_width": self.beam_width, "beam_length": self.beam_length,
                "diversity_penalty": self.diversity_penalty, "hot_vocab": self.hot_vocab}
