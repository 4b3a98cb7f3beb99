"""An independent small model drafts a chain of k tokens, with its own KV cache.

Each step feeds the draft model [t_{L-1}, root] at positions [L-1, L] (L = committed KV length): t_{L-1}'s draft KV
may be missing when the whole previous draft was accepted, and recomputing it otherwise is harmless (same token,
same position, same context). Then k-1 single-token steps; rejected drafts are simply overwritten next step.
The draft cache is planned once per step for all k forwards (positions L-1 .. L+k-1), so each forward is a pure
device step: with CUDA graphs, one graph for the 2-token forward and one for the 1-token forward per batch bucket.
"""
from __future__ import annotations

import torch

from workbench.engine.drafters.base import BatchState, DraftContext, Drafter
from workbench.engine.graphs import ModelStep
from workbench.engine.kv_cache import make_cache
from workbench.engine.sampling import probs_from_logits, sample
from workbench.engine.tree import DraftTree


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, model, k: int):
        if k < 1:
            raise ValueError(f"k (draft length) must be >= 1, got {k}")
        self.model, self.k = model, k
        self.num_nodes = k
        self.model_forwards_per_step = k
        self.cache = None
        self.step: ModelStep | None = None

    def setup(self, ctx: DraftContext) -> None:
        super().setup(ctx)
        need = ctx.max_len + self.k + 2
        if self.cache is not None and self.cache.fits(ctx.max_rows, need) and self.step.settings == ctx.graphs:
            self.cache.reset()
            return
        c = self.model.config
        self.cache = self.step = None  # free the old pool and its graphs first
        self.cache = make_cache(ctx.paged, num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                                head_dim=c.head_dim, max_rows=ctx.max_rows, max_len=need,
                                dtype=next(self.model.parameters()).dtype, device=ctx.device,
                                block_size=ctx.kv_block_size, attention=ctx.attention)
        self.step = ModelStep(self.model, self.cache, ctx.graphs, ctx.device, "draft", last_only=True)

    def prefill(self, state: BatchState, prompt_ids: torch.Tensor, positions: torch.Tensor) -> None:
        b = prompt_ids.shape[0]
        zeros = torch.zeros(b, dtype=torch.long, device=prompt_ids.device)
        self.cache.begin(state.rows, zeros, [0] * b, prompt_ids.shape[1], rows_host=state.rows_host)
        self.model(prompt_ids, positions, self.cache)

    def propose(self, state: BatchState) -> DraftTree:
        rows, L = state.rows, state.kv_len
        host = [x - 1 for x in state.kv_len_host]
        self.cache.plan(state.rows_host, host, self.k + 1)  # room for every forward of this step, planned once
        prev = state.tokens[rows, L - 1]
        ids = torch.stack([prev, state.root], 1)  # [B, 2]
        logits = self.step(rows, state.rows_host, ids, torch.stack([L - 1, L], 1), L - 1, host)  # [B, V]
        params, gen = self.ctx.sampling, self.ctx.generator
        tokens, probs = [], []
        for i in range(self.k):
            if params.greedy:
                tok = logits.argmax(-1)
            else:
                q = probs_from_logits(logits, params)
                tok = sample(q, gen)
                probs.append(q)
            tokens.append(tok)
            if i < self.k - 1:
                pos = L + 1 + i
                logits = self.step(rows, state.rows_host, tok.unsqueeze(1), pos.unsqueeze(1), pos,
                                   [x + 2 + i for x in host])
        return DraftTree.chain(torch.stack(tokens, 1), draft_probs=torch.stack(probs, 1) if probs else None)

    def commit(self, state: BatchState, acc, old_kv_len_host: list[int]) -> None:
        for row, new_len in zip(state.rows_host, state.kv_len_host):
            self.cache.truncate(row, new_len)  # paged: give back blocks holding only rejected drafts

    def release(self, row: int) -> None:
        self.cache.free(row)

    def capture_graphs(self, sizes: list[int]) -> None:
        for size in sizes:
            for num_new in (2, 1):  # the [t_(L-1), root] forward, then the single-token ones
                self.step.capture(size, num_new)

    def model_steps(self) -> list:
        return [self.step] if self.step is not None else []

    @property
    def settings(self) -> dict:
        return {"k": self.k}
