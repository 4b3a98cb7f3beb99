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
    # Static bound on depths known to the drafter (beam length L, tree depth); None = read depths.max() (a host sync).
    depth_bound: int | None = None
    # [B, 2] long, set by `from_beams`: (differing, compared) (beam pair, depth) token positions of the merged beams,
    # what `beam_disagreement` divides; None = not made from beams
    beam_pairs: torch.Tensor | None = None
    # no two valid siblings hold the same token (the drafter guarantees it; from_beams' trees have it): acceptance
    # skips the duplicate-sibling rule, which would change nothing
    distinct_siblings: bool = False
    # [B, 4N + 2] long: token_ids, parents, depths, valid and beam_pairs (zeros without) side by side, where the
    # drafter's captured step wrote them so (`pack_tree`): the engine's tree step takes it as its one input, one copy
    # where the five fields took five (~2 us each on tiny's H100 step); None = packed by the engine when it needs it
    packed: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]

    @property
    def max_depth(self) -> int:
        """Deepest path the tree can hold: static for chains and trees with depth_bound, else read on the host."""
        if self.is_chain:
            return self.num_nodes
        if self.depth_bound is not None:
            return self.depth_bound
        return int(self.depths.max().item()) if self.num_nodes else 0

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


    @staticmethod
    def from_beams(beam_tokens: torch.Tensor,
                   beam_valid: torch.Tensor | None = None) -> tuple["DraftTree", torch.Tensor]:
        """Deduplicate W beams of length L into one prefix tree per sequence, vectorised (no host sync).

        beam_tokens [B, W, L] long; beam_valid [B, W, L] bool (a prefix mask per beam; None = all valid)
        -> (tree with N = W * L nodes, beam_node [B, W, L] long: the node holding beam w's token at depth d+1, -1 where
        the beam is invalid). Nodes are beam-major: (w, d) is a duplicate of (w', d) for the smallest w' whose first
        d + 1 tokens are equal; the first occurrences keep their beam-major order (so parents come before children)
        and padding (valid = False, parent -1, depth 1) fills the tail. Beams are deterministic candidates (no q).
        W = 1 gives `DraftTree.chain`.

        Example: beams [[a, b], [a, c], [d, e]] -> nodes a, b, c, d, e (+ 1 padding) with parents -1, 0, 0, -1, 3:
        >>> tree, beam_node = DraftTree.from_beams(torch.tensor([[[1, 2], [1, 3], [4, 5]]]))
        >>> tree.token_ids.tolist(), tree.parents.tolist(), tree.depths.tolist()
        ([[1, 2, 3, 4, 5, 0]], [[-1, 0, 0, -1, 3, -1]], [[1, 2, 2, 1, 2, 1]])
        >>> tree.valid.int().tolist()
        [[1, 1, 1, 1, 1, 0]]
        >>> beam_node.tolist()
        [[[0, 1], [0, 2], [3, 4]]]
        """
        b, w, l = beam_tokens.shape
        dev = beam_tokens.device
        if beam_valid is None and w == 1:
            beam_valid = torch.ones(b, w, l, dtype=torch.bool, device=dev)
        # [B, W, L]: the prefix mask enforced; None: every beam whole (the masking below would change nothing)
        valid = None if beam_valid is None else beam_valid.long().cumprod(-1).bool()
        if w == 1:
            nodes = torch.arange(l, device=dev).expand(b, 1, l)
            tree = DraftTree.chain(beam_tokens[:, 0], valid[:, 0])
            tree.beam_pairs = torch.zeros(b, 2, dtype=torch.long, device=dev)  # one beam: no pair to compare
            return tree, torch.where(valid, nodes, torch.full_like(nodes, -1))
        n = w * l
        # same[b, i, j, d]: beams i and j agree on their first d + 1 tokens and both are valid there
        same = (beam_tokens.unsqueeze(2) == beam_tokens.unsqueeze(1)).long().cumprod(-1).bool()  # [B, W, W, L]
        beam_idx = torch.arange(w, device=dev)  # [W]
        if valid is not None:
            same &= valid.unsqueeze(2) & valid.unsqueeze(1)
        rep = torch.where(same, beam_idx.view(1, 1, w, 1), w).amin(2)  # [B, W, L]: first beam sharing the prefix
        if valid is None:
            keep = rep == beam_idx.view(1, w, 1)  # [B, W, L]: first occurrences become nodes
        else:  # invalid (w, d) match nothing (they point at themselves) and are no node
            rep = torch.where(valid, rep, beam_idx.view(1, w, 1))
            keep = valid & (rep == beam_idx.view(1, w, 1))
        new_idx = keep.view(b, n).long().cumsum(-1) - 1  # [B, W*L]: node index of each kept (w, d)
        depth_idx = torch.arange(l, device=dev)  # [L]
        beam_node = new_idx.gather(1, (rep * l + depth_idx).view(b, n)).view(b, w, l)  # [B, W, L]
        if valid is not None:
            beam_node = torch.where(valid, beam_node, torch.full_like(beam_node, -1))
        parent = torch.cat([torch.full_like(beam_node[..., :1], -1), beam_node[..., :-1]], -1)  # [B, W, L]
        # node j holds the j-th kept (w, d) in beam-major order: a stable sort puts the kept ones first, in that
        # order, and one gather per field places them (gathers of one index fuse into one kernel where four
        # scatters into filled tensors took eight on the GPU); nodes past the kept count are padding
        src = torch.sort((~keep).view(b, n).int(), dim=-1, stable=True).indices  # [B, N]
        used = torch.arange(n, device=dev) < keep.view(b, n).sum(-1, keepdim=True)  # [B, N]

        def place(values: torch.Tensor, fill: int) -> torch.Tensor:
            """values [B, W, L] -> [B, N]: kept (w, d) at their node index, `fill` on the padding nodes."""
            return torch.where(used, values.reshape(b, n).gather(1, src), fill)

        depths = (depth_idx + 1).expand(b, w, l)
        tree = DraftTree(place(beam_tokens, 0), place(parent, -1), place(depths, 1), used,
                         depth_bound=l, beam_pairs=beam_pair_counts(beam_tokens, valid), distinct_siblings=True)
        return tree, beam_node


def pack_tree(token_ids: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, valid: torch.Tensor,
              beam_pairs: torch.Tensor | None = None) -> torch.Tensor:
    """A tree's fields [B, N] (and beam_pairs [B, 2]) -> [B, 4N + 2] long, side by side (`DraftTree.packed`).

    >>> t = torch.tensor
    >>> pack_tree(t([[7, 8]]), t([[-1, 0]]), t([[1, 2]]), t([[True, False]]))
    tensor([[ 7,  8, -1,  0,  1,  2,  1,  0,  0,  0]])
    """
    pairs = beam_pairs if beam_pairs is not None else torch.zeros(token_ids.shape[0], 2, dtype=torch.long,
                                                                   device=token_ids.device)
    return torch.cat([token_ids, parents, depths, valid.long(), pairs], 1)


def unpack_tree(packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`pack_tree`'s [B, 4N + 2] -> (token_ids, parents, depths [B, N] long, valid [B, N] bool, beam_pairs [B, 2]).

    >>> [x.tolist() for x in unpack_tree(torch.tensor([[7, 8, -1, 0, 1, 2, 1, 0, 3, 4]]))]
    [[[7, 8]], [[-1, 0]], [[1, 2]], [[True, False]], [[3, 4]]]
    """
    n = (packed.shape[1] - 2) // 4
    tokens, parents, depths, valid, pairs = packed.split([n, n, n, n, 2], 1)
    return tokens, parents, depths, valid.bool(), pairs


def tree_input(tree: DraftTree) -> torch.Tensor:
    """The tree as the engine's tree step reads it: the drafter's packed tensor, else packed here."""
    return tree.packed if tree.packed is not None else pack_tree(tree.token_ids, tree.parents, tree.depths,
                                                                 tree.valid, tree.beam_pairs)


def beam_diversity(tree: DraftTree, beams: int, length: int) -> torch.Tensor:
    """Distinct valid prefix-tree nodes / (W x L), per sequence [B] float: 1 = all beams differ from the first token,
    1 / W = all beams identical.

    >>> tree, _ = DraftTree.from_beams(torch.tensor([[[1, 2], [1, 3], [4, 5]], [[1, 2], [1, 2], [1, 2]]]))
    >>> [round(x, 3) for x in beam_diversity(tree, 3, 2).tolist()]  # 5 of 6 nodes distinct; one chain of 2
    [0.833, 0.333]
    """
    return tree.valid.sum(-1).float() / (beams * length)


def beam_pair_counts(beam_tokens: torch.Tensor, beam_valid: torch.Tensor | None = None) -> torch.Tensor:
    """beam_tokens [B, W, L] -> [B, 2] long: (differing, compared) over the W (W - 1) / 2 beam pairs and the L depths
    where both beams are valid; "differing" counts positions whose tokens differ (token by token: two beams that
    diverged may agree again later). No host sync; W = 1 gives (0, 0).

    >>> beam_pair_counts(torch.tensor([[[1, 2, 3], [1, 5, 3], [4, 5, 6]]])).tolist()  # pairs differ at 1, 3, 2
    [[6, 9]]
    """
    b, w, l = beam_tokens.shape
    i, j = torch.triu_indices(w, w, offset=1, device=beam_tokens.device)  # [P] each: the beam pairs i < j
    differ = beam_tokens[:, i] != beam_tokens[:, j]  # [B, P, L]
    if beam_valid is None:  # every position compared
        return torch.stack([differ.sum((1, 2)), torch.full((b,), i.numel() * l, device=beam_tokens.device)], -1)
    both = beam_valid[:, i] & beam_valid[:, j]  # [B, P, L]
    return torch.stack([(differ & both).sum((1, 2)), both.sum((1, 2))], -1)


def beam_disagreement(tree: DraftTree) -> torch.Tensor:
    """Mean pairwise token disagreement of the beams a tree was merged from, per sequence [B] float: the fraction of
    depths at which two beams hold different tokens, averaged over the beam pairs (for beams of equal valid length,
    as beam drafters propose them; else pooled over the compared positions). 0 = all beams identical, 1 = no two
    beams share a token at any depth; NaN for one beam (no pairs).

    >>> tree, _ = DraftTree.from_beams(torch.tensor([[[1, 2, 3], [1, 5, 3], [4, 5, 6]]]))
    >>> [round(x, 3) for x in beam_disagreement(tree).tolist()]  # pairs differ at 1/3, 3/3, 2/3 of the depths
    [0.667]
    """
    if tree.beam_pairs is None:
        raise ValueError("beam_disagreement needs a tree made by DraftTree.from_beams (tree.beam_pairs is None)")
    return tree.beam_pairs[:, 0].float() / tree.beam_pairs[:, 1].float()


def sibling_rank(tree: DraftTree) -> torch.Tensor:
    """[B, N] long: each valid node's rank among its siblings (the valid nodes with the same parent), in node order,
    -1 for padding. Node order is the order the verifier tries siblings in, and drafters list better-scored siblings
    first (beam-major nodes of beams sorted best first; a tree drafter's reranked candidates), so rank r is the
    (r+1)-th best child by draft score. Chains: all 0.

    >>> tree, _ = DraftTree.from_beams(torch.tensor([[[1, 2], [1, 3], [4, 5]]]))  # a, b, c, d, e (+ padding)
    >>> sibling_rank(tree).tolist()  # a and d are the root's children 0 and 1; b and c are a's children 0 and 1
    [[0, 0, 1, 1, 0, -1]]
    """
    return torch.where(tree.valid, earlier_siblings(tree).sum(-1), -1)


def earlier_siblings(tree: DraftTree) -> torch.Tensor:
    """[B, N, N] bool: node j is a valid sibling of node i (same parent) listed before it (j < i); made once per tree
    (the verifier's duplicate-sibling rule and the sibling ranks both read it)."""
    cached = tree.__dict__.get("_earlier_siblings")
    if cached is None:
        same = (tree.parents.unsqueeze(2) == tree.parents.unsqueeze(1)) & tree.valid.unsqueeze(1)  # [B, N, N]
        cached = tree.__dict__["_earlier_siblings"] = same.tril(-1)  # j < i
    return cached


def tree_closure(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """parents [B, N] -> [B, 1+N, 1+N] bool over [root, nodes]: entry (i, j) = token j is token i or one of its
    ancestors (index 0 is the root, node k is index 1 + k). max_depth: a bound on the nodes' depths (DraftTree's
    depth_bound) or None.

    With a bound D: each token's ancestors up to D hops, by D - 1 parent lookups, compared with every index at once;
    without one: the reflexive parent relation squared until it holds paths of every length.
    >>> tree_closure(torch.tensor([[-1, 0, -1]]), 2).int().tolist()
    [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]]
    >>> torch.equal(tree_closure(torch.tensor([[-1, 0, -1]])), tree_closure(torch.tensor([[-1, 0, -1]]), 2))
    True
    """
    return _closure_of(torch.nn.functional.pad(parents + 1, (1, 0)), max_depth)


def _closure_of(up: torch.Tensor, max_depth: int | None) -> torch.Tensor:
    """`tree_closure` from up [B, 1+N]: each token's parent index (the root's is itself, 0)."""
    b, n = up.shape[0], up.shape[1] - 1
    dev = up.device
    idx = torch.arange(n + 1, device=dev)
    if max_depth is not None and max_depth <= 8:  # a few lookups are fewer launches than the squarings below
        hops = [idx.expand(b, n + 1), up]
        for _ in range(max_depth - 1):
            hops.append(up.gather(1, hops[-1]))
        return (torch.stack(hops, -1).unsqueeze(-1) == idx).any(-2)  # [B, 1+N, 1+D, 1+N] -> [B, 1+N, 1+N]
    reach = ((up.unsqueeze(-1) == idx) | torch.eye(n + 1, dtype=torch.bool, device=dev)).float()
    length = 1
    while length < n:  # paths of length <= 2 * length; counts of paths clamped back to 0 / 1
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
        length *= 2
    return reach.bool()


def _closure(tree: DraftTree) -> torch.Tensor:
    """`tree_closure` of the tree, made once per tree (the verify mask and acceptance both read it)."""
    cached = tree.__dict__.get("_closure")
    if cached is None:
        up = torch.nn.functional.pad(tree.parents + 1, (1, 0))  # [B, 1+N]
        tree.__dict__["_parent_rows"] = up[:, 1:]
        cached = tree.__dict__["_closure"] = _closure_of(up, tree.depth_bound)
    return cached


def parent_rows(tree: DraftTree) -> torch.Tensor:
    """[B, N] long: each node's parent's verify row (1 + parent; the root's row is 0); the closure's when made."""
    cached = tree.__dict__.get("_parent_rows")
    return cached if cached is not None else tree.parents + 1


def ancestor_matrix(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """parents [B, N] -> anc [B, N, N] bool, anc[b, i, j] = node j is node i or one of its ancestors (`tree_closure`
    without the root; max_depth: a bound on the depths, or None).

    >>> ancestor_matrix(torch.tensor([[-1, 0, -1]])).int().tolist()
    [[[1, 0, 0], [1, 1, 0], [0, 0, 1]]]
    """
    return tree_closure(parents, max_depth)[:, 1:, 1:]


def tree_ancestors(tree: DraftTree) -> torch.Tensor:
    """`ancestor_matrix` of the tree (a view of its closure, made once per tree)."""
    return _closure(tree)[:, 1:, 1:]


def verify_mask(tree: DraftTree) -> torch.Tensor | None:
    """The [B, 1+N, 1+N] bool mask among this step's tokens (root + nodes); None means plain causal (chains). Every
    token sees the root, itself and its ancestors: the tree's closure (made once per tree; do not write into it)."""
    if tree.is_chain:
        return None
    return _closure(tree)
