"""Draft token trees: what every drafter proposes and the verifier checks.

Vocabulary (the engine's; see workbench/engine/step.py for the whole list):
- **root**: the last committed token of a sequence; its target logits predict draft depth 1. Its KV is written in the
  verify pass, which runs the target over `[root, node_0, ..., node_{N-1}]`.
- **draft tree**: N nodes per sequence, each with a token id, a parent index (-1 = child of the root) and a 1-based
  depth. Parents always come before their children. A chain of k tokens has parents `[-1, 0, 1, ..., k-2]`.
- Nodes beyond what a drafter proposed are padding (`valid = False`): shapes stay static and padding is never accepted.

Example: a root with two candidate continuations "a b" and "c":
    token_ids = [a, b, c]; parents = [-1, 0, -1]; depths = [1, 2, 1]
The verifier runs the target over [root, a, b, c] with positions [L, L+1, L+2, L+1] and the mask
    root: root | a: root a | b: root a b | c: root c
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    token_ids: torch.Tensor  # [B, N] long
    parents: torch.Tensor  # [B, N] long, -1 = child of the root
    depths: torch.Tensor  # [B, N] long, 1-based
    valid: torch.Tensor  # [B, N] bool; False = padding
    # [B, N, V] float32: the draft distribution each node's token was drawn from (its parent's q); None = the nodes
    # are deterministic candidates (greedy drafts, n-gram lookups), treated as one-hot q by lossless verification.
    draft_probs: torch.Tensor | None = None
    is_chain: bool = False  # parents == [-1, 0, ..., N-2] for every sequence: KV commit is a no-op

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]

    @property
    def max_depth(self) -> int:
        return self.num_nodes if self.is_chain else int(self.depths.max().item()) if self.num_nodes else 0

    @staticmethod
    def chain(token_ids: torch.Tensor, valid: torch.Tensor | None = None,
              draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """token_ids [B, k] -> the degenerate tree (a chain). `valid` [B, k] must be a prefix mask if given."""
        b, k = token_ids.shape
        dev = token_ids.device
        parents = (torch.arange(k, device=dev) - 1).expand(b, k)
        depths = torch.arange(1, k + 1, device=dev).expand(b, k)
        if valid is None:
            valid = torch.ones(b, k, dtype=torch.bool, device=dev)
        return DraftTree(token_ids, parents, depths, valid, draft_probs, is_chain=True)

    @staticmethod
    def empty(batch: int, device: torch.device | str) -> "DraftTree":
        z = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return DraftTree(z, z, z, z.bool(), None, is_chain=True)


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] -> anc [B, N, N] bool, anc[b, i, j] = node j is node i or one of its ancestors.

    Built by repeated parent lookup: after round r every node knows its ancestors up to 2^r levels up.
    >>> ancestor_matrix(torch.tensor([[-1, 0, -1]])).int().tolist()
    [[[1, 0, 0], [1, 1, 0], [0, 0, 1]]]
    """
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    if n == 0:
        return eye.clone()
    parent_onehot = torch.zeros(b, n, n + 1, dtype=torch.bool, device=parents.device)
    parent_onehot.scatter_(2, (parents % (n + 1)).unsqueeze(-1), True)  # -1 -> column n (the root, dropped)
    anc = (eye | parent_onehot[..., :n]).float()
    hops = 1
    while hops < n:  # reflexive closure squared: paths of length <= 2 * hops
        anc = (torch.bmm(anc, anc) > 0).float()
        hops *= 2
    anc = anc.bool()
    return anc


def verify_mask(tree: DraftTree) -> torch.Tensor | None:
    """The [B, 1+N, 1+N] bool mask among this step's tokens (root + nodes); None means plain causal (chains)."""
    if tree.is_chain:
        return None
    b, n = tree.parents.shape
    mask = torch.zeros(b, n + 1, n + 1, dtype=torch.bool, device=tree.parents.device)
    mask[:, :, 0] = True  # everyone sees the root
    mask[:, 1:, 1:] = ancestor_matrix(tree.parents)
    return mask
