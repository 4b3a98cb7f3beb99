"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the context's last n tokens and propose
what followed it. No model, no KV: it reads the host copy of each sequence's tokens.

Example: tokens [1, 2, 3, 4, 1, 2] with n = 2 and k = 3: the suffix [1, 2] occurred at 0, followed by [3, 4, 1]
-> propose [3, 4, 1].
"""
from __future__ import annotations

import torch

from workbench.engine.drafters.base import BatchState, Drafter
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


class NgramDrafter(Drafter):
    name = "ngram"
    reads_kv_len = False  # it works on the host copy of the tokens

    def __init__(self, k: int, min_n: int = 1, max_n: int = 3):
        if k < 1:
            raise ValueError(f"k (draft length) must be >= 1, got {k}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.num_nodes = k

    def propose(self, state: BatchState) -> DraftTree:
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
