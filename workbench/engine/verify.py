"""Lossless verification of draft trees against the target's logits.

Vocabulary, as in vLLM's rejection sampler and Leviathan et al. 2023 (arXiv 2211.17192):
- **accepted tokens**: draft nodes on the chosen root-to-leaf path that passed verification;
- **recovered token**: sampled from the residual distribution norm(max(p - q, 0)) where a draft token was rejected;
- **bonus token**: sampled from the target p after the last node of a fully accepted path (greedy: its argmax).
Each step emits accepted + 1 tokens: the accepted ones, then one recovered or bonus token.

Rules (p = target distribution, q = the draft distribution the node was drawn from; both shaped by
`sampling.probs_from_logits` with the same settings):
- greedy: at each node take the child whose token equals argmax(p); bonus = argmax at the last accepted node;
- sampled: visit a node's children in order; accept child x with probability min(1, p(x) / q(x)); after a rejection
  p <- norm(max(p - q, 0)) and try the next child; when all children fail, sample the recovered token from what is
  left of p. Deterministic candidates (no q: n-gram, top-k/beam candidates) use q = one-hot(x), which gives
  "accept with probability p(x); else zero p(x) and renormalise": the same as one draw y ~ p per verify row,
  followed where a child holds y (`accept_sampled_candidates`, vectorised over the whole tree: what the captured tree
  step runs). Both produce exact samples from p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.engine.sampling import SamplingParams, probs_from_logits, sample
from workbench.engine.tree import DraftTree, earlier_siblings, parent_rows, tree_ancestors


@dataclass
class Acceptance:
    num_accepted: torch.Tensor  # [B] long: accepted draft tokens (the bonus/recovered token not counted)
    path_nodes: torch.Tensor  # [B, D] long: node index at depth d+1 on the accepted path, -1 beyond it
    emitted: torch.Tensor  # [B, D + 1] long: accepted tokens, then the bonus/recovered token; rest is padding


def _first_max_index(score: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, ties broken towards the lowest index (torch.argmax does not promise that)."""
    return _first_max(score)[1]


def _first_max(score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, index) of the max over the last dim of a whole-number score >= 0, ties towards the lowest index:
    key = score * (n + 1) + (n - index), distinct per index, so key > n exactly where the score is > 0."""
    n = score.shape[-1]
    return torch.arange(n, 0, -1, device=score.device).add(score, alpha=n + 1).max(-1)


def _assemble(tree: DraftTree, on_path: torch.Tensor, last_token: torch.Tensor) -> Acceptance:
    """on_path [B, N] bool (accepted nodes, at most one per depth), last_token [B] -> Acceptance. Written as a
    reduction and selects, which inductor fuses with the acceptance: the scatters they replace ran as aten kernels of
    their own inside the compiled step (two per tree step, one per AR step in the H100 trace of 2026-12-07)."""
    b, n = tree.token_ids.shape
    d = tree.max_depth
    device = tree.token_ids.device
    num_accepted = on_path.sum(-1)
    column = torch.arange(d + 1, device=device)
    if n:
        # the path's node at depth j + 1: the one accepted node there, else -1
        at_depth = on_path.unsqueeze(1) & (tree.depths.unsqueeze(1) - 1 == column[:d].view(1, d, 1))  # [B, D, N]
        path_nodes = torch.where(at_depth, torch.arange(n, device=device).view(1, 1, n), -1).amax(-1)
        # the path's tokens, then the bonus/recovered token at column num_accepted (padding past it)
        emitted = torch.nn.functional.pad(tree.token_ids.gather(1, path_nodes.clamp(min=0)), (0, 1))
    else:
        path_nodes = torch.full((b, d), -1, dtype=torch.long, device=device)
        emitted = torch.zeros(b, d + 1, dtype=torch.long, device=device)
    emitted = torch.where(column == num_accepted.unsqueeze(1), last_token.unsqueeze(1), emitted)
    return Acceptance(num_accepted, path_nodes, emitted)


def _first_sibling(tree: DraftTree) -> torch.Tensor:
    """[B, N] bool: the node is valid and no earlier valid sibling (same parent) holds its token. Drafters list
    siblings without repeats (EAGLE's top-K, deduplicated beams); the rule keeps acceptance lossless if one did not."""
    repeated = (earlier_siblings(tree) & (tree.token_ids.unsqueeze(2) == tree.token_ids.unsqueeze(1))).any(-1)
    return tree.valid > repeated  # valid and not repeated


def accept_choices(tree: DraftTree, choice: torch.Tensor) -> Acceptance:
    """choice [B, 1+N] long: the token the target picks at each verify row (row 0 = root, row 1+i = node i) -> the
    longest path of nodes whose token is the choice at their parent, then the choice at its last node.

    With choice = argmax this is greedy verification. With choice sampled from p at every row it is lossless
    verification of deterministic candidates (one-hot q): trying a node's children in order, accepting child x with
    probability p(x) and zeroing it after a rejection (SpecInfer's rule with one-hot q) accepts x with probability
    p(x) and stops on a token outside the children with probability p(token): exactly one draw y ~ p, followed where a
    child holds y. Every emitted token is then a draw from p given the tokens before it. A repeated sibling token is
    never followed (only its first occurrence), so which branch is taken never depends on later rows' draws.

    Example (chain): draft [5, 7, 9], choices at rows [5, 7, 2, 4] -> accepted [5, 7], then 2.
    """
    if tree.num_nodes == 0:
        return _assemble(tree, tree.valid, choice[:, 0])
    expected = choice.gather(1, parent_rows(tree))  # [B, N]: the choice at each node's parent
    if tree.is_chain:
        on_path = (tree.valid & (tree.token_ids == expected)).long().cumprod(-1).bool()
        last_row = on_path.sum(-1)
    else:
        first = tree.valid if tree.distinct_siblings else _first_sibling(tree)
        eligible = first & (tree.token_ids == expected)
        anc = tree_ancestors(tree)  # [B, N, N]
        path_ok = (anc <= eligible.unsqueeze(1)).all(-1)  # every ancestor (and self) eligible
        key, best = _first_max(tree.depths * path_ok)  # the deepest such node, the first of equals
        reached = key > tree.num_nodes  # its depth is > 0: some node was accepted
        on_path = anc.gather(1, best.view(-1, 1, 1).expand(-1, 1, tree.num_nodes)).squeeze(1) & reached.unsqueeze(1)
        last_row = (best + 1) * reached
    return _assemble(tree, on_path, choice.gather(1, last_row.unsqueeze(1)).squeeze(1))


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Acceptance:
    """target_logits [B, 1+N, V] (row 0 = root, row 1+i = node i) -> the longest path of argmax matches.

    Example (chain): draft [5, 7, 9], target argmax at rows [5, 7, 2, 4] -> accepted [5, 7], bonus 2.
    """
    return accept_choices(tree, target_logits.argmax(-1))


def sample_rows(target_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """target_probs [B, M, V], uniforms [B, M] in [0, 1) -> one inverse-CDF draw per row [B, M] (no host sync)."""
    cdf = target_probs.cumsum(-1)
    ids = torch.searchsorted(cdf, (uniforms * cdf[..., -1]).unsqueeze(-1), right=True).squeeze(-1)
    return ids.clamp_(max=target_probs.shape[-1] - 1)


def accept_sampled_candidates(tree: DraftTree, target_probs: torch.Tensor, uniforms: torch.Tensor) -> Acceptance:
    """Lossless verification of a tree of deterministic candidates (draft_probs None), vectorised: one draw from p per
    verify row (uniforms [B, 1+N]), then `accept_choices`. What the captured tree step runs."""
    return accept_choices(tree, sample_rows(target_probs, uniforms))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)); falls back to p where the residual has no mass (then rejection had probability 0)."""
    r = (p - q).clamp_(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 1e-12, r / mass.clamp(min=1e-30), p)


def accept_sampled_chain(tree: DraftTree, target_probs: torch.Tensor,
                         generator: torch.Generator | None) -> Acceptance:
    """Leviathan et al. rejection sampling over a chain, vectorised over batch and positions (no host sync).

    target_probs [B, 1+k, V]; tree.draft_probs [B, k, V] or None (one-hot candidates).
    """
    b, k = tree.token_ids.shape
    x = tree.token_ids
    p_x = target_probs[:, :k].gather(-1, x.unsqueeze(-1)).squeeze(-1)  # node i's parent row is i
    if tree.draft_probs is not None:
        q_x = tree.draft_probs.gather(-1, x.unsqueeze(-1)).squeeze(-1)
    else:
        q_x = torch.ones_like(p_x)
    u = torch.rand(b, k, device=x.device, generator=generator)
    passed = tree.valid & (u * q_x < p_x)
    on_path = passed.long().cumprod(-1).bool()
    n_acc = on_path.sum(-1)  # [B]
    p_row = target_probs.gather(1, n_acc.view(b, 1, 1).expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    stop = n_acc.clamp(max=max(k - 1, 0))
    rejected = (n_acc < k) & tree.valid.gather(1, stop.unsqueeze(1)).squeeze(1) if k else torch.zeros_like(n_acc).bool()
    if k:
        if tree.draft_probs is not None:
            q_row = tree.draft_probs.gather(1, stop.view(b, 1, 1).expand(-1, 1, tree.draft_probs.shape[-1])).squeeze(1)
        else:
            q_row = torch.nn.functional.one_hot(x.gather(1, stop.unsqueeze(1)).squeeze(1), p_row.shape[-1]).float()
        final = torch.where(rejected.unsqueeze(1), _residual(p_row, q_row), p_row)
    else:
        final = p_row
    return _assemble(tree, on_path, sample(final, generator))


def _row(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [B, M, V], index [B] -> rows[b, index[b]] [B, V]."""
    return rows.gather(1, index.view(-1, 1, 1).expand(-1, 1, rows.shape[-1])).squeeze(1)


def accept_sampled_tree(tree: DraftTree, target_probs: torch.Tensor,
                        generator: torch.Generator | None) -> Acceptance:
    """Multi-candidate rejection sampling over a general tree (SpecInfer-style), vectorised (no host sync).

    target_probs [B, 1+N, V]; tree.draft_probs [B, N, V] or None (one-hot candidates). Every sequence walks down from
    the root in lockstep, one depth per round; within a round the current node's children are tried in node order,
    one sibling rank per inner round, with masked updates. A Python loop over depth and sibling rank only: both
    bounds are static (tree.max_depth, and N - depth + 1 since a node's ancestors are not its siblings).
    """
    b, n = tree.token_ids.shape
    dev = tree.token_ids.device
    node_idx = torch.arange(n, device=dev)  # [N]
    current = torch.full((b,), -1, dtype=torch.long, device=dev)  # [B] node the walk stands on, -1 = root
    p = target_probs[:, 0]  # [B, V]: target distribution at the current node, less the rejected children's q
    walking = torch.ones(b, dtype=torch.bool, device=dev)  # [B] still moving down
    final = p  # [B, V]: where the recovered / bonus token is sampled from
    on_path = torch.zeros(b, n, dtype=torch.bool, device=dev)  # [B, N]
    for depth in range(1, tree.max_depth + 1):
        children = tree.valid & (tree.parents == current.unsqueeze(1)) & walking.unsqueeze(1)  # [B, N]
        rank = children.long().cumsum(-1) - 1  # [B, N]: sibling order = node order
        moved_to = torch.full_like(current, -1)  # [B] accepted child, -1 = none yet
        for r in range(n - depth + 1):
            is_r = children & (rank == r)  # [B, N]: at most one True per row
            trying = is_r.any(-1) & (moved_to < 0)  # [B]
            child = _first_max_index(is_r.long())  # [B]; meaningless where not trying
            draft_token_ids = tree.token_ids.gather(1, child.unsqueeze(1))  # [B, 1]
            if tree.draft_probs is not None:
                q = _row(tree.draft_probs, child)  # [B, V]
            else:
                q = torch.nn.functional.one_hot(draft_token_ids.squeeze(1), p.shape[-1]).to(p.dtype)
            p_x = p.gather(1, draft_token_ids).squeeze(1)  # [B]
            q_x = q.gather(1, draft_token_ids).squeeze(1)  # [B]
            u = torch.rand(b, device=dev, generator=generator)
            accepted = trying & (u * q_x < p_x)  # [B]
            moved_to = torch.where(accepted, child, moved_to)
            p = torch.where((trying & ~accepted).unsqueeze(1), _residual(p, q), p)
        moved = moved_to >= 0  # [B]
        stopping = walking & ~moved  # [B]: every child rejected (recovered token) or a leaf (bonus token)
        final = torch.where(stopping.unsqueeze(1), p, final)
        on_path |= moved.unsqueeze(1) & (node_idx == moved_to.unsqueeze(1))
        current = torch.where(moved, moved_to, current)
        p = torch.where(moved.unsqueeze(1), _row(target_probs, current + 1), p)
        walking = moved
    final = torch.where(walking.unsqueeze(1), p, final)  # accepted down to the deepest level: bonus token
    return _assemble(tree, on_path, sample(final, generator))


class Verifier:
    """Picks the rule for the step: greedy; deterministic candidates (any tree without draft_probs) by one draw per
    verify row (`accept_sampled_candidates`); chains drafted from q by vectorised rejection sampling; trees drafted
    from q by `accept_sampled_tree`."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None = None):
        self.params = params
        self.generator = generator

    def uniforms(self, batch: int, num_nodes: int, device) -> torch.Tensor | None:
        """The draws a sampled step over deterministic candidates needs ([B, 1+N] float32 from the generator); None
        for greedy settings. Drawn outside a captured step, which then reads them as an input."""
        if self.params.greedy:
            return None
        return torch.rand(batch, 1 + num_nodes, device=device, generator=self.generator)

    def accept(self, tree: DraftTree, target_logits: torch.Tensor, uniforms: torch.Tensor | None = None
               ) -> Acceptance:
        """target_logits [B, 1+N, V] -> Acceptance. uniforms: `uniforms(...)` drawn ahead (a captured step's input);
        None = drawn here when the rule needs them."""
        if self.params.greedy:
            return accept_greedy(tree, target_logits)
        target_probs = probs_from_logits(target_logits, self.params)
        if tree.draft_probs is None:
            if uniforms is None:
                uniforms = self.uniforms(tree.token_ids.shape[0], tree.num_nodes, target_logits.device)
            return accept_sampled_candidates(tree, target_probs, uniforms)
        if tree.is_chain:
            return accept_sampled_chain(tree, target_probs, self.generator)
        return accept_sampled_tree(tree, target_probs, self.generator)
