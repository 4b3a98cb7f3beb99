"""An independent small model drafts a chain of k tokens, with its own KV cache.

Each step feeds the draft model [t_{L-1}, root] at positions [L-1, L] (L = committed KV length): t_{L-1}'s draft KV
may be missing when the whole previous draft was accepted, and recomputing it otherwise is harmless (same token,
same position, same context). Then k-1 single-token steps; rejected drafts are simply overwritten next step.
The draft cache is planned once per step for all k forwards (positions L-1 .. L+k-1), so each forward is a pure
device step. Greedy drafting with fixed shapes runs the whole chain (k forwards and the argmax between them) as one
step that reads the roots from the engine's persistent token and length buffers: one CUDA graph per batch bucket.
Sampled drafting replays one graph per forward (the 2-token one, then the 1-token one) and samples in between.
A step that verifies fewer nodes (`BatchState.num_nodes` = n < k, adaptive speculation) drafts only n tokens: n
forwards, and with greedy fixed shapes its own chain step (one graph per bucket and n), so a shorter draft costs less.
After steps that did not draft at all, `catch_up` writes the draft KV the chain's first forward does not cover.
`kv_quant` is the draft cache's own KV format (engine/kv_quant.py), independent of the target's: it can change
acceptance, never the output.
"""
from __future__ import annotations

import functools

import torch

from workbench.engine.drafters.base import BatchState, DraftContext, Drafter
from workbench.engine.graphs import FixedShapeStep, ModelStep, PrefillStep
from workbench.engine.kv_cache import make_cache
from workbench.engine.kv_quant import kv_format
from workbench.engine.sampling import probs_from_logits, sample
from workbench.engine.tree import DraftTree


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, model, k: int, kv_quant: str = "none"):
        if k < 1:
            raise ValueError(f"k (draft length) must be >= 1, got {k}")
        kv_format(kv_quant)  # KVFormatError names the formats, before any work
        self.model, self.k, self.kv_quant = model, k, kv_quant
        self.num_nodes = k
        self.model_forwards_per_step = k
        self.cache = None
        self.step: ModelStep | None = None  # one forward -> last-token logits
        self.chain_steps: dict[int, FixedShapeStep] = {}  # greedy: the whole chain of n tokens in one step, per n
        self._state: tuple | None = None  # (tokens, kv_len_all): the engine's persistent buffers the chain reads

    @property
    def overlaps(self) -> bool:  # the fused greedy chain reads roots and lengths from the engine's device buffers
        return self._fused()

    @property
    def reads_kv_len(self) -> bool:
        return not self._fused()

    def _fused(self) -> bool:
        return self.ctx.sampling.greedy and self.ctx.graphs.fixed_shape

    def setup(self, ctx: DraftContext) -> None:
        super().setup(ctx)
        need = ctx.max_len + self.k + 2
        if self.cache is not None and self.cache.fits(ctx.max_rows, need) and self.step.settings == ctx.graphs \
                and self.cache.max_rows == ctx.max_rows:
            self.cache.reset()
            return
        c = self.model.config
        self.cache = self.step = self.prefill_step = self._state = None  # free the old pool and its graphs first
        self.chain_steps = {}
        # as many rows as the target's cache, so that both caches' scratch pad_row is the same row index
        self.cache = make_cache(ctx.paged, num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                                head_dim=c.head_dim, max_rows=ctx.max_rows, max_len=need,
                                dtype=next(self.model.parameters()).dtype, device=ctx.device,
                                block_size=ctx.kv_block_size, attention=ctx.attention, kv_quant=self.kv_quant)
        self.step = ModelStep(self.model, self.cache, ctx.graphs, ctx.device, "draft", last_only=True)
        self.prefill_step = PrefillStep(self.model, self.cache, ctx.graphs, ctx.device, "draft")

    def _chain_pads(self, key) -> dict[str, torch.Tensor]:
        return {"rows": torch.tensor(self.cache.pad_row, device=self.ctx.device)}

    def _greedy_chain(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """rows [B] -> draft tokens [B, n]: n greedy forwards, reading roots and lengths from the engine's state.
        Its tensor work lives in `_chain_first` / `_chain_next` / `_chain_tokens`: each forward breaks the compiled
        graph at its attention, and dynamo runs a frame with a graph break inside a loop wholly eagerly."""
        logits, L = self._chain_first(rows)
        drafted = []
        for i in range(n):
            tok, logits = self._chain_next(rows, logits, L, i, i == n - 1)
            drafted.append(tok)
        return self._chain_tokens(drafted)

    def _chain_first(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The [t_(L-1), root] forward -> (its last logits [B, V], L [B])."""
        tokens, kv_len_all = self._state
        L = kv_len_all[rows]  # [B]
        ids = torch.stack([tokens[rows, L - 1], tokens[rows, L]], 1)  # [B, 2]: t_(L-1), root
        self.cache.prepare(rows, L - 1, 2, None, self.cache.static_span)
        return self.step.logits(ids, torch.stack([L - 1, L], 1)), L

    def _chain_next(self, rows: torch.Tensor, logits: torch.Tensor, L: torch.Tensor, i: int,
                    last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft token i from `logits`, then (unless last) its forward -> (token [B], the next logits)."""
        tok = logits.argmax(-1)  # [B]
        if last:
            return tok, None
        pos = L + 1 + i
        self.cache.prepare(rows, pos, 1, None, self.cache.static_span)
        return tok, self.step.logits(tok.unsqueeze(1), pos.unsqueeze(1))

    @staticmethod
    def _chain_tokens(drafted: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(drafted, 1)

    def _chain(self, n: int, tokens: torch.Tensor, kv_len_all: torch.Tensor) -> FixedShapeStep:
        """The fused greedy chain step of n tokens over the engine's buffers (made again when they change)."""
        if self._state is None or self._state[0] is not tokens:
            self._state, self.chain_steps = (tokens, kv_len_all), {}
        step = self.chain_steps.get(n)
        if step is None:
            name = "draft-chain" if n == self.k else f"draft-chain{n}"
            step = self.chain_steps[n] = FixedShapeStep(name, functools.partial(self._greedy_chain, n=n),
                                                        self._chain_pads, self.ctx.graphs, self.ctx.device)
        return step

    def prefill(self, state: BatchState, prompt_ids: torch.Tensor, positions: torch.Tensor) -> None:
        self.prefill_step(state.rows, state.rows_host, prompt_ids, positions)  # captured with prefill_graphs

    def catch_up(self, state: BatchState, ids: torch.Tensor, positions: torch.Tensor, start_host: list[int]) -> None:
        b, t = ids.shape
        self.cache.begin(state.rows, positions[:, 0], start_host, t, rows_host=state.rows_host, prefill=True)
        self.model(ids, positions, self.cache)

    def propose(self, state: BatchState) -> DraftTree:
        n = self.k if state.num_nodes is None else max(1, min(self.k, state.num_nodes))
        host = [x - 1 for x in state.kv_len_host]
        self.cache.plan(state.rows_host, host, n + 1)  # room for every forward of this step, planned once
        if self._fused():
            chain = self._chain(n, state.tokens, state.kv_len_all)
            drafted = chain(0, len(state.rows_host), {"rows": state.rows}, state.rows_host)
            return DraftTree.chain(drafted)
        rows, L = state.rows, state.kv_len
        prev = state.tokens[rows, L - 1]
        ids = torch.stack([prev, state.root], 1)  # [B, 2]
        logits = self.step(rows, state.rows_host, ids, torch.stack([L - 1, L], 1), L - 1, host)  # [B, V]
        params, gen = self.ctx.sampling, self.ctx.generator
        tokens, probs = [], []
        for i in range(n):
            if params.greedy:
                tok = logits.argmax(-1)
            else:
                q = probs_from_logits(logits, params)
                tok = sample(q, gen)
                probs.append(q)
            tokens.append(tok)
            if i < n - 1:
                pos = L + 1 + i
                logits = self.step(rows, state.rows_host, tok.unsqueeze(1), pos.unsqueeze(1), pos,
                                   [x + 2 + i for x in host])
        return DraftTree.chain(torch.stack(tokens, 1), draft_probs=torch.stack(probs, 1) if probs else None)

    def commit(self, state: BatchState, acc, old_kv_len_host: list[int]) -> None:
        for row, new_len in zip(state.rows_host, state.kv_len_host):
            self.cache.truncate(row, new_len)  # paged: give back blocks holding only rejected drafts

    def release(self, row: int) -> None:
        self.cache.free(row)

    def capture_graphs(self, sizes: list[int], node_counts: tuple[int, ...] | None = None) -> None:
        lengths = sorted({min(n, self.k) for n in (node_counts or (self.k,)) if n > 0})
        ctx = self.ctx
        for size in sizes:
            if self._fused():
                tokens, kv_len_all = (ctx.tokens, ctx.kv_len_all) if ctx.tokens is not None else \
                    (self._state or (None, None))
                if tokens is None:  # set up without an engine's buffers: captured on first use instead
                    continue
                for n in lengths:
                    self._chain(n, tokens, kv_len_all).capture(size, 0)
            else:
                for num_new in (2, 1):  # the [t_(L-1), root] forward, then the single-token ones
                    self.step.capture(size, num_new)

    def model_steps(self) -> list:
        return [s for s in (self.prefill_step, self.step, *self.chain_steps.values()) if s is not None]

    def kv_caches(self) -> list:
        return [self.cache] if self.cache is not None else []

    @property
    def settings(self) -> dict:
        return {"k": self.k, "kv_quant": self.kv_quant}
