"""Verification rules: hand-built cases and seeded statistical tests of losslessness."""
import math

import pytest
import torch

import workbench.engine.verify as verify_module
from workbench.engine.sampling import SamplingParams, probs_from_logits
from workbench.engine.tree import DraftTree, ancestor_matrix, verify_mask
from workbench.engine.verify import Verifier, accept_greedy, accept_sampled_chain, accept_sampled_tree

V = 12


def onehot_logits(rows: list[int]) -> torch.Tensor:
    """Target logits [1, len(rows), V] whose argmax at row i is rows[i]."""
    return torch.nn.functional.one_hot(torch.tensor([rows]), V).float() * 10


def test_chain_full_accept_gives_bonus():
    tree = DraftTree.chain(torch.tensor([[5, 7, 9]]))
    acc = accept_greedy(tree, onehot_logits([5, 7, 9, 4]))
    assert acc.num_accepted.tolist() == [3]
    assert acc.emitted[0, :4].tolist() == [5, 7, 9, 4]
    assert acc.path_nodes.tolist() == [[0, 1, 2]]


def test_chain_first_token_rejected():
    acc = accept_greedy(DraftTree.chain(torch.tensor([[5, 7, 9]])), onehot_logits([3, 7, 9, 4]))
    assert acc.num_accepted.tolist() == [0]
    assert acc.emitted[0, 0].item() == 3
    assert acc.path_nodes.tolist() == [[-1, -1, -1]]


def test_chain_mid_draft_reject():
    acc = accept_greedy(DraftTree.chain(torch.tensor([[5, 7, 9]])), onehot_logits([5, 7, 2, 4]))
    assert acc.num_accepted.tolist() == [2]
    assert acc.emitted[0, :3].tolist() == [5, 7, 2]


def test_padding_nodes_never_accepted():
    tree = DraftTree.chain(torch.tensor([[5, 0, 0]]), valid=torch.tensor([[True, False, False]]))
    acc = accept_greedy(tree, onehot_logits([5, 0, 0, 0]))  # target would "accept" the padding token 0
    assert acc.num_accepted.tolist() == [1]
    assert acc.emitted[0, :2].tolist() == [5, 0]


def tree_two_branches() -> DraftTree:
    # root -> a(5) -> b(6);  root -> c(8) -> d(2) -> e(3)
    token_ids = torch.tensor([[5, 6, 8, 2, 3]])
    parents = torch.tensor([[-1, 0, -1, 2, 3]])
    depths = torch.tensor([[1, 2, 1, 2, 3]])
    return DraftTree(token_ids, parents, depths, torch.ones(1, 5, dtype=torch.bool))


def test_tree_two_branches_picks_the_matching_branch():
    tree = tree_two_branches()
    # rows: root, a, b, c, d, e. Root's argmax is 8 -> branch c; at c: 2 (d matches); at d: 3 (e matches); at e: 11
    acc = accept_greedy(tree, onehot_logits([8, 6, 1, 2, 3, 11]))
    assert acc.num_accepted.tolist() == [3]
    assert acc.path_nodes.tolist() == [[2, 3, 4]]
    assert acc.emitted[0].tolist() == [8, 2, 3, 11]
    # root's argmax 5 -> branch a; at a: 6 (b matches); at b: 7 -> bonus 7
    acc = accept_greedy(tree, onehot_logits([5, 6, 7, 2, 3, 11]))
    assert acc.num_accepted.tolist() == [2]
    assert acc.path_nodes[0, :2].tolist() == [0, 1]
    assert acc.emitted[0, :3].tolist() == [5, 6, 7]


def test_tree_mask_and_ancestors():
    tree = tree_two_branches()
    anc = ancestor_matrix(tree.parents)[0].int().tolist()
    assert anc[4] == [0, 0, 1, 1, 1] and anc[1] == [1, 1, 0, 0, 0]
    mask = verify_mask(tree)[0].int().tolist()
    assert mask[0] == [1, 0, 0, 0, 0, 0]  # root sees itself
    assert mask[5] == [1, 0, 0, 1, 1, 1]  # e sees root, c, d, itself


def test_greedy_rule_agrees_between_chain_and_tree_paths():
    torch.manual_seed(0)
    for _ in range(50):
        k = 4
        draft = torch.randint(0, 3, (3, k))
        logits = torch.randn(3, k + 1, 3)
        chain = DraftTree.chain(draft)
        as_tree = DraftTree(draft, chain.parents.clone(), chain.depths.clone(), chain.valid.clone())
        a, b = accept_greedy(chain, logits), accept_greedy(as_tree, logits)
        assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.emitted, b.emitted)


# ---- statistical tests: emitted tokens follow the target distribution ----------------------------------------------

def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected < 5 are pooled."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)]) if (~big).any() else counts[big]
    exp = torch.cat([expected[big], expected[~big].sum().view(1)]) if (~big).any() else expected[big]
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    dof = int(keep.sum().item()) - 1
    # Wilson-Hilferty approximation of the chi-square upper tail
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
          SamplingParams(temperature=1.3, top_p=0.8)]


def chain_pvalues(params: SamplingParams, accept=None) -> list[float]:
    """Chain of 2 drafted from q, verified by `accept` (default: the real rule). The emitted tokens must follow p:
    p-values for the first emitted token, the second given an accepted first token, and the third (the bonus) given
    both drafts accepted."""
    accept = accept or accept_sampled_chain
    g = torch.Generator().manual_seed(1234)
    n = 40000
    target_logits = torch.randn(1, 3, V, generator=g).expand(n, 3, V).clone() * 1.5
    draft_logits = torch.randn(1, 2, V, generator=g).expand(n, 2, V).clone() * 1.5
    q = probs_from_logits(draft_logits, params)
    d1 = torch.multinomial(q[:, 0], 1, generator=g).squeeze(1)
    d2 = torch.multinomial(q[:, 1], 1, generator=g).squeeze(1)
    tree = DraftTree.chain(torch.stack([d1, d2], 1), draft_probs=q)
    acc = accept(tree, probs_from_logits(target_logits, params), g)
    p = probs_from_logits(target_logits[0], params)
    first = torch.bincount(acc.emitted[:, 0], minlength=V).float()
    second = acc.emitted[acc.num_accepted >= 1, 1]
    third = acc.emitted[acc.num_accepted == 2, 2]
    assert second.numel() > 1000 and third.numel() > 1000
    return [chi_square_pvalue(first, p[0]), chi_square_pvalue(torch.bincount(second, minlength=V).float(), p[1]),
            chi_square_pvalue(torch.bincount(third, minlength=V).float(), p[2])]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-topk5", "t1.3-topp0.8"])
def test_sampled_chain_tokens_follow_target(params):
    """First emitted token, second given an accepted first, bonus given both accepted: each follows p."""
    assert min(chain_pvalues(params)) > 1e-3


def _resample_from_p(tree, target_probs, g):
    """Lossy: after a rejection, resample from p instead of norm(max(p - q, 0))."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify_module, "_residual", lambda p, q: p)
        return accept_sampled_chain(tree, target_probs, g)


def _accept_every_draft(tree, target_probs, g):
    """Lossy: every draft token accepted, bonus from the right row."""
    k = tree.num_nodes
    bonus = torch.multinomial(target_probs[:, k], 1, generator=g)[:, 0]
    return verify_module._assemble(tree, tree.valid.clone(), bonus)


def _bonus_from_previous_row(tree, target_probs, g):
    """Lossy: the bonus after a fully accepted chain is drawn from the last draft's row, not the row after it."""
    acc = accept_sampled_chain(tree, target_probs, g)
    k = tree.num_nodes
    full = acc.num_accepted == k
    acc.emitted[full, k] = torch.multinomial(target_probs[full, k - 1], 1, generator=g)[:, 0]
    return acc


@pytest.mark.parametrize("lossy", [_resample_from_p, _accept_every_draft, _bonus_from_previous_row],
                         ids=["resample-from-p", "accept-all", "bonus-row"])
def test_sampled_chain_check_detects_lossy_rules(lossy):
    """The check above has power: run through the same procedure, lossy verification rules are rejected."""
    assert min(chain_pvalues(SamplingParams(temperature=1.0), lossy)) < 1e-6


@pytest.mark.parametrize("iid", [True, False], ids=["iid-children", "deterministic-candidates"])
def test_sampled_tree_follows_target(iid):
    """Root with 3 children (+ one grandchild under the first): the emitted first token follows p at the root; given
    the first child accepted, the second token follows p at that child."""
    g = torch.Generator().manual_seed(99)
    params = SamplingParams(temperature=1.0)
    n = 12000
    target_logits = (torch.randn(1, 5, V, generator=g) * 1.5).expand(n, 5, V).clone()
    q_root = probs_from_logits(torch.randn(V, generator=g) * 1.5, params)
    q_child = probs_from_logits(torch.randn(V, generator=g) * 1.5, params)
    if iid:
        kids = torch.multinomial(q_root, 3 * n, replacement=True, generator=g).view(n, 3)
        grand = torch.multinomial(q_child, n, replacement=True, generator=g).view(n, 1)
        draft_probs = torch.stack([q_root, q_root, q_root, q_child]).expand(n, 4, V)
    else:
        # candidates a good drafter would pick: the target's own top tokens (any fixed choice must be lossless)
        p_rows = probs_from_logits(target_logits[0], params)
        kids = p_rows[0].topk(3).indices.expand(n, 3)
        grand = p_rows[1].topk(1).indices.expand(n, 1)
        draft_probs = None
    tree = DraftTree(torch.cat([kids, grand], 1), torch.tensor([[-1, -1, -1, 0]]).expand(n, 4),
                     torch.tensor([[1, 1, 1, 2]]).expand(n, 4), torch.ones(n, 4, dtype=torch.bool), draft_probs)
    acc = accept_sampled_tree(tree, probs_from_logits(target_logits, params), g)
    p = probs_from_logits(target_logits[0], params)
    first = torch.bincount(acc.emitted[:, 0], minlength=V).float()
    assert chi_square_pvalue(first, p[0]) > 1e-3
    via_first_child = acc.path_nodes[:, 0] == 0
    second = acc.emitted[via_first_child & (acc.num_accepted >= 1), 1]
    assert second.numel() > 500
    assert chi_square_pvalue(torch.bincount(second, minlength=V).float(), p[1]) > 1e-3


def test_verifier_greedy_equals_sampled_rule_at_temperature_zero():
    torch.manual_seed(3)
    logits = torch.randn(4, 4, V)
    tree = DraftTree.chain(torch.randint(0, V, (4, 3)))
    tree.token_ids[:, 0] = logits[:, 0].argmax(-1)  # make some accepts happen
    a = Verifier(SamplingParams()).accept(tree, logits)
    b = accept_sampled_chain(tree, probs_from_logits(logits, SamplingParams()), torch.Generator().manual_seed(0))
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.emitted, b.emitted)


def test_verifier_greedy_settings_route_trees_to_accept_greedy(monkeypatch):
    def refuse(*args):
        raise AssertionError("greedy settings must not sample")

    monkeypatch.setattr(verify_module, "accept_sampled_tree", refuse)
    tree = tree_two_branches()
    logits = onehot_logits([8, 6, 1, 2, 3, 11])
    a, b = Verifier(SamplingParams()).accept(tree, logits), accept_greedy(tree, logits)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.emitted, b.emitted)
    assert torch.equal(a.path_nodes, b.path_nodes)


def beam_tree_with_onehot_target(seed: int) -> tuple[DraftTree, torch.Tensor]:
    """Random beams over 3 tokens, deduplicated (no two siblings share a token), and a one-hot target [B, 1+N, 3]."""
    g = torch.Generator().manual_seed(seed)
    tree, _ = DraftTree.from_beams(torch.randint(0, 3, (6, 4, 3), generator=g))
    target_logits = torch.randn(6, 1 + tree.num_nodes, 3, generator=g)
    return tree, torch.nn.functional.one_hot(target_logits.argmax(-1), 3).float()


@pytest.mark.parametrize("seed", range(5))
def test_sampled_tree_with_onehot_target_is_the_greedy_rule(seed):
    """A one-hot target leaves nothing to chance: the sampled rule must take the greedy path and token."""
    tree, target_probs = beam_tree_with_onehot_target(seed)
    a = accept_sampled_tree(tree, target_probs, torch.Generator().manual_seed(seed))
    b = accept_greedy(tree, target_probs)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.emitted, b.emitted)
    assert torch.equal(a.path_nodes, b.path_nodes)


@pytest.mark.parametrize("draft_probs", [False, True], ids=["candidates", "drafted-from-q"])
def test_sampled_tree_makes_no_host_sync(monkeypatch, draft_probs):
    """No .tolist() / .item() / bool(tensor) / int(tensor) during acceptance of a tree with a static depth bound."""
    tree, target_probs = beam_tree_with_onehot_target(0)
    target_probs = (target_probs + 0.1).softmax(-1)
    if draft_probs:
        tree.draft_probs = torch.full(tree.token_ids.shape + (3,), 1 / 3)

    def sync(*args):
        raise AssertionError("host sync")

    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    accept_sampled_tree(tree, target_probs, torch.Generator().manual_seed(0))
    monkeypatch.undo()


# beams as sibling ranks: root -> 3 children; the first -> 2 children; its first -> 2 children (depth 3)
BEAM_RANKS = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [2, 0, 0]])  # [W, L]


def beam_tree_pvalues(accept=None) -> list[float]:
    """Deterministic top-k-like beams (the beam / top-k drafter case), deduplicated by DraftTree.from_beams, verified by
    `accept` (default: the real rule). p-values for: the first emitted token; the second given the path went through
    the root's first child a; the third given a then its first child d; the bonus after d's first child f."""
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=1.0)
    n = 20000
    w, l = BEAM_RANKS.shape
    _, beam_node = DraftTree.from_beams(BEAM_RANKS.unsqueeze(0) * 10 + torch.arange(l))  # the shape: rank paths
    target_logits = torch.randn(1, 1 + w * l, V, generator=g) * 2.0
    p = probs_from_logits(target_logits[0], params)  # [1+N, V]
    parent_row = torch.cat([torch.zeros(w, 1, dtype=torch.long), beam_node[0, :, :-1] + 1], 1)  # [W, L]
    beams = p[parent_row].argsort(-1, descending=True).gather(-1, BEAM_RANKS.unsqueeze(-1)).squeeze(-1)  # top-k
    tree, node = DraftTree.from_beams(beams.unsqueeze(0).expand(n, w, l))
    assert torch.equal(node[0], beam_node[0])
    acc = (accept or accept_sampled_tree)(tree, probs_from_logits(target_logits.expand(n, -1, -1), params), g)
    a, d, f = beam_node[0, 0].tolist()
    pvalues = [chi_square_pvalue(torch.bincount(acc.emitted[:, 0], minlength=V).float(), p[0])]
    for depth, (cond, row) in enumerate([(acc.path_nodes[:, 0] == a, a + 1), (acc.path_nodes[:, 1] == d, d + 1),
                                         (acc.path_nodes[:, 2] == f, f + 1)], start=1):
        following = acc.emitted[cond, depth]
        assert following.numel() > 500
        pvalues.append(chi_square_pvalue(torch.bincount(following, minlength=V).float(), p[row]))
    return pvalues


def test_sampled_beam_tree_follows_target():
    """3 candidates at the root, 2 under the first, 2 under its first (depth 3): every emitted token follows p."""
    assert min(beam_tree_pvalues()) > 1e-3


def _tree_resample_from_p(tree, target_probs, g):
    """Lossy: after a rejection, keep p instead of norm(max(p - q, 0)) (a rejected candidate may come back)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify_module, "_residual", lambda p, q: p)
        return accept_sampled_tree(tree, target_probs, g)


def _tree_bonus_from_parent_row(tree, target_probs, g):
    """Lossy: the bonus after a path accepted to depth 3 is drawn from the row of the leaf's parent."""
    acc = accept_sampled_tree(tree, target_probs, g)
    full = acc.num_accepted == 3
    parent_rows = target_probs[full].gather(1, (acc.path_nodes[full, 1] + 1).view(-1, 1, 1).expand(-1, 1, V))
    acc.emitted[full, 3] = torch.multinomial(parent_rows.squeeze(1), 1, generator=g)[:, 0]
    return acc


@pytest.mark.parametrize("lossy", [_tree_resample_from_p, _tree_bonus_from_parent_row],
                         ids=["resample-from-p", "bonus-row"])
def test_sampled_beam_tree_check_detects_lossy_rules(lossy):
    """The beam-tree check has power: lossy tree rules are rejected."""
    assert min(beam_tree_pvalues(lossy)) < 1e-6


def test_distinct_siblings_skip_only_a_rule_that_changes_nothing():
    """Trees whose siblings never repeat a token (EAGLE's top-K, merged beams) are accepted the same with the
    duplicate-sibling rule skipped (distinct_siblings) as with it, greedy and on sampled choices; with a repeated
    sibling the rule is what keeps the later copy from being followed."""
    from workbench.engine.verify import accept_choices

    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        beams = torch.randint(0, 3, (3, 4, 3), generator=g)  # few tokens: many shared prefixes, merged
        tree, _ = DraftTree.from_beams(beams)
        assert tree.distinct_siblings
        choice = torch.randint(0, 3, (3, 1 + tree.num_nodes), generator=g)
        plain = DraftTree(tree.token_ids, tree.parents, tree.depths, tree.valid, depth_bound=tree.depth_bound)
        a, b = accept_choices(tree, choice), accept_choices(plain, choice)
        for name in ("num_accepted", "path_nodes", "emitted"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    # two root children holding token 5: the second one's child (token 6) is never followed under the rule
    twins = DraftTree(torch.tensor([[5, 5, 6]]), torch.tensor([[-1, -1, 1]]), torch.tensor([[1, 1, 2]]),
                      torch.ones(1, 3, dtype=torch.bool), depth_bound=2)
    choice = torch.tensor([[5, 9, 6, 7]])  # root row picks 5, node 1's row picks 6
    assert accept_choices(twins, choice).num_accepted.tolist() == [1]  # node 0 only: its row picks 9, the end
