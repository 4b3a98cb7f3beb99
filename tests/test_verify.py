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
