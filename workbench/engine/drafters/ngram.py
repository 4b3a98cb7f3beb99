"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the context's last n tokens and propose
what followed it. No model, no KV.

Two ways to the same proposals (tested equal on random histories):
- **host** (`lookup`): a scan of the host copy of each sequence's tokens (eager steps, and drafters set up without an
  engine's buffers);
- **device** (`device_lookup`): with fixed-shape steps the lookup is a fixed-shape step of its own over the engine's
  persistent token and length buffers (every candidate start compared at once, the latest match kept), captured in
  a CUDA graph per batch bucket. It reads roots and lengths from the device only, so the n-gram drafter then runs
  overlapped steps (`EngineConfig.overlap`) like the draft model's fused chain, and a step needs no host scan.

Example: tokens [1, 2, 3, 4, 1, 2] with n = 2 and k = 3: the suffix [1, 2] occurred at 0, followed by [3, 4, 1]
-> propose [3, 4, 1].
"""
from __future__ import annotations

import torch

from workbench.engine.drafters.base import BatchState, DraftContext, OneStepDrafter
from workbench.engine.graphs import FixedShapeStep
from workbench.engine.tree import DraftTree


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix of length max_n..min_n.

    >>> lookup([1, 2, 3, 4, 1, 2], k=3, min_n=1, max_n=2)
    [3, 4, 1]
    >>> lookup([5, 6, 7], k=2, min_n=1, max_n=2)
    []
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        first = suffix[0]
        # scan backwards so the latest match wins; start must leave room for at least one following token
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def device_lookup(history: torch.Tensor, root: torch.Tensor, k: int, min_n: int,
                  max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`lookup` for a batch at once, with fixed shapes: history [B, S] (row b's tokens are history[b, :root[b] + 1];
    what lies past the root is ignored), root [B] the root's index -> (draft token ids [B, k], valid [B, k]).

    For each n (longest first) every start s is compared at once: s matches when history[s + j] equals the suffix's
    j-th token for all j < n, and counts only if s + n <= root (one following token at least) and n <= root (as the
    host scan's range). A row keeps the first n that matches, at its latest start; the proposal is the k tokens after
    it, cut at the root. Invalid entries hold 0, as the host path leaves them.

    >>> ids, valid = device_lookup(torch.tensor([[1, 2, 3, 4, 1, 2, 0, 0]]), torch.tensor([5]), 3, 1, 2)
    >>> ids.tolist(), valid.tolist()
    ([[3, 4, 1]], [[True, True, True]])
    """
    b, s_len = history.shape
    dev = history.device
    root = root.clamp(0, s_len - 1)
    start = torch.full_like(root, -1)  # [B] index of the first proposed token, -1 = no match yet
    for n in range(max_n, min_n - 1, -1):
        width = s_len - n  # candidate starts 0 .. S - n - 1 (each with a following token inside the buffer)
        if width < 1:
            continue
        cand = torch.arange(width, device=dev)  # [W]
        match = (cand.unsqueeze(0) <= (root - n).unsqueeze(1)) & (root >= n).unsqueeze(1)  # [B, W]
        for j in range(n):
            suffix_j = history.gather(1, (root - n + 1 + j).clamp(min=0).unsqueeze(1))  # [B, 1]
            match &= history[:, j:j + width] == suffix_j
        latest = torch.where(match, cand.unsqueeze(0), torch.full_like(match, -1, dtype=torch.long)).amax(1)  # [B]
        start = torch.where((start < 0) & (latest >= 0), latest + n, start)
    positions = start.unsqueeze(1) + torch.arange(k, device=dev)  # [B, k]
    valid = (start >= 0).unsqueeze(1) & (positions <= root.unsqueeze(1))
    ids = history.gather(1, positions.clamp(0, s_len - 1))
    return torch.where(valid, ids, torch.zeros_like(ids)), valid


class NgramDrafter(OneStepDrafter):  # its one step: the device lookup (None: the host scan)
    name = "ngram"

    def __init__(self, k: int, min_n: int = 1, max_n: int = 3):
        if k < 1:
            raise ValueError(f"k (draft length) must be >= 1, got {k}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.num_nodes = k
        self.step: FixedShapeStep | None = None  # the device lookup, over `_state`'s buffers
        self._state: tuple | None = None  # (tokens [R + 1, S], kv_len_all [R + 1]): the engine's persistent buffers

    def _on_device(self) -> bool:
        ctx = getattr(self, "ctx", None)
        return ctx is not None and ctx.graphs.fixed_shape and ctx.tokens is not None

    @property
    def overlaps(self) -> bool:  # the device lookup reads roots and lengths from the engine's buffers only
        return self._on_device()

    @property
    def reads_kv_len(self) -> bool:  # the host scan reads tokens_host; the device lookup reads kv_len_all itself
        return False

    def setup(self, ctx: DraftContext) -> None:
        super().setup(ctx)
        if not self._on_device():
            self.step = self._state = None
        elif self._state is None or self._state[0] is not ctx.tokens or self.step.settings != ctx.graphs:
            self._state = (ctx.tokens, ctx.kv_len_all)  # new buffers: a new step (graphs read the old ones)
            self.step = FixedShapeStep("ngram-lookup", self._lookup, self._pads, ctx.graphs, ctx.device)

    def _pads(self, key) -> dict[str, torch.Tensor]:
        return {"rows": torch.tensor(self._state[0].shape[0] - 1, device=self.ctx.device)}  # the scratch pad_row

    def _lookup(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [B] -> (ids [B, k], valid [B, k]), reading only the engine's persistent buffers."""
        tokens, kv_len_all = self._state
        return device_lookup(tokens[rows], kv_len_all[rows], self.k, self.min_n, self.max_n)

    def propose(self, state: BatchState) -> DraftTree:
        if self.step is not None:
            ids, valid = self.step(0, len(state.rows_host), {"rows": state.rows}, state.rows_host)
            return DraftTree.chain(ids, valid)
        b = len(state.rows_host)
        ids = torch.zeros(b, self.k, dtype=torch.long)
        valid = torch.zeros(b, self.k, dtype=torch.bool)
        for i, row in enumerate(state.rows_host):
            found = lookup(state.tokens_host[row], self.k, self.min_n, self.max_n)
            if found:
                ids[i, :len(found)] = torch.tensor(found)
                valid[i, :len(found)] = True
        dev = state.tokens.device
        return DraftTree.chain(ids.to(dev, non_blocking=True), valid.to(dev, non_blocking=True))

    @property
    def settings(self) -> dict:
        return {"k": self.k, "ngram_min": self.min_n, "ngram_max": self.max_n}
