"""Draft trees: beams deduplicated into prefix trees (hand-built cases and the docstring examples)."""
import doctest

import pytest
import torch

import workbench.engine.tree as tree_module
from workbench.engine.tree import DraftTree, ancestor_matrix, beam_diversity


def test_docstring_examples():
    assert doctest.testmod(tree_module).failed == 0


def beams(rows: list[list[list[int]]]) -> torch.Tensor:
    return torch.tensor(rows)  # [B, W, L]


def test_identical_beams_collapse_to_one_chain():
    tree, beam_node = DraftTree.from_beams(beams([[[4, 5, 6]] * 3]))
    assert tree.num_nodes == 9
    assert tree.valid[0].int().tolist() == [1, 1, 1] + [0] * 6
    assert tree.token_ids[0, :3].tolist() == [4, 5, 6]
    assert tree.parents[0, :3].tolist() == [-1, 0, 1] and tree.depths[0, :3].tolist() == [1, 2, 3]
    assert beam_node.tolist() == [[[0, 1, 2]] * 3]
    assert beam_diversity(tree, 3, 3).tolist() == [torch.tensor(1 / 3).item()]


def test_shared_prefixes_share_nodes():
    # beams: a b c | a b d | a e f -> a(0) b(1) c(2) d(3) e(4) f(5)
    tree, beam_node = DraftTree.from_beams(beams([[[1, 2, 3], [1, 2, 4], [1, 5, 6]]]))
    n = 6
    assert tree.token_ids[0, :n].tolist() == [1, 2, 3, 4, 5, 6]
    assert tree.parents[0, :n].tolist() == [-1, 0, 1, 1, 0, 4]
    assert tree.depths[0, :n].tolist() == [1, 2, 3, 3, 2, 3]
    assert tree.valid[0].int().tolist() == [1] * n + [0] * 3
    assert beam_node.tolist() == [[[0, 1, 2], [0, 1, 3], [0, 4, 5]]]
    assert tree.max_depth == 3  # static: no host read


def test_same_token_under_different_prefixes_is_not_merged():
    # a b | c b: both beams hold b at depth 2, under different parents
    tree, beam_node = DraftTree.from_beams(beams([[[1, 2], [3, 2]]]))
    assert tree.parents[0].tolist() == [-1, 0, -1, 2]
    assert beam_node.tolist() == [[[0, 1], [2, 3]]]
    assert beam_diversity(tree, 2, 2).tolist() == [1.0]


def test_one_beam_is_the_chain():
    tokens = beams([[[7, 8, 9, 10]], [[1, 1, 1, 1]]])
    tree, beam_node = DraftTree.from_beams(tokens)
    chain = DraftTree.chain(tokens[:, 0])
    assert tree.is_chain
    assert torch.equal(tree.parents, chain.parents) and torch.equal(tree.depths, chain.depths)
    assert torch.equal(tree.token_ids, chain.token_ids)
    assert beam_node.tolist() == [[[0, 1, 2, 3]], [[0, 1, 2, 3]]]


def test_invalid_tails_are_padding():
    # beam 1 stops after one token (and its tail token would otherwise be new); beam 2 is wholly invalid
    tokens = beams([[[1, 2, 3], [1, 9, 9], [5, 6, 7]]])
    valid = torch.tensor([[[True, True, True], [True, False, True], [False, False, False]]])  # not a prefix mask
    tree, beam_node = DraftTree.from_beams(tokens, valid)
    assert tree.valid[0].int().tolist() == [1, 1, 1] + [0] * 6
    assert tree.token_ids[0, :3].tolist() == [1, 2, 3]
    assert beam_node.tolist() == [[[0, 1, 2], [0, -1, -1], [-1, -1, -1]]]
    assert (tree.parents[0, 3:] == -1).all() and (tree.depths[0, 3:] == 1).all()


def test_batch_of_two_sequences_with_different_structures():
    tokens = beams([[[1, 2], [1, 3], [4, 5]],  # a b | a c | d e
                    [[6, 7], [8, 9], [6, 7]]])  # f g | h i | f g
    tree, beam_node = DraftTree.from_beams(tokens)
    assert tree.token_ids.tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
    assert tree.parents.tolist() == [[-1, 0, 0, -1, 3, -1], [-1, 0, -1, 2, -1, -1]]
    assert tree.valid.int().tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    assert beam_node.tolist() == [[[0, 1], [0, 2], [3, 4]], [[0, 1], [2, 3], [0, 1]]]
    assert torch.allclose(beam_diversity(tree, 3, 2), torch.tensor([5 / 6, 4 / 6]))


def test_beam_node_holds_the_beam_and_its_ancestors_are_the_beam_prefix():
    """Random beams over a small vocabulary (many shared prefixes): every beam is the token path to its nodes."""
    g = torch.Generator().manual_seed(5)
    b, w, l = 4, 5, 4
    tokens = torch.randint(0, 2, (b, w, l), generator=g)
    tree, beam_node = DraftTree.from_beams(tokens)
    assert torch.equal(tree.token_ids.gather(1, beam_node.view(b, -1)).view(b, w, l), tokens)
    parents_of = tree.parents.gather(1, beam_node.view(b, -1)).view(b, w, l)
    assert torch.equal(parents_of[..., 1:], beam_node[..., :-1]) and (parents_of[..., 0] == -1).all()
    assert (tree.parents < torch.arange(w * l)).all()  # parents before children
    anc = ancestor_matrix(tree.parents)  # distinct valid nodes = distinct token paths
    for s in range(b):
        paths = {tuple(tree.token_ids[s, anc[s, i]].tolist()) for i in range(w * l) if tree.valid[s, i]}
        assert len(paths) == int(tree.valid[s].sum())
        assert len(paths) == len({tuple(tokens[s, j, :d + 1].tolist()) for j in range(w) for d in range(l)})


def test_sibling_rank_follows_node_order_and_marks_padding():
    from workbench.engine.tree import sibling_rank

    # beams: a b c | a b d | a e f -> a(0) b(1) c(2) d(3) e(4) f(5): b, e are a's children 0 and 1; c, d b's 0 and 1
    tree, _ = DraftTree.from_beams(beams([[[1, 2, 3], [1, 2, 4], [1, 5, 6]]]))
    assert sibling_rank(tree).tolist() == [[0, 0, 0, 1, 1, 0, -1, -1, -1]]
    chain = DraftTree.chain(torch.tensor([[7, 8, 9]]), torch.tensor([[True, True, False]]))
    assert sibling_rank(chain).tolist() == [[0, 0, -1]]
    # a hand-built tree whose siblings are not contiguous: root children 0, 2, 3; node 1 is a child of node 0
    hand = DraftTree(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[-1, 0, -1, -1]]), torch.tensor([[1, 2, 1, 1]]),
                     torch.ones(1, 4, dtype=torch.bool))
    assert sibling_rank(hand).tolist() == [[0, 0, 1, 2]]


def test_beam_disagreement_counts_tokens_not_prefixes():
    from workbench.engine.tree import beam_disagreement, beam_pair_counts

    # identical beams: 0; W = 1: no pairs (NaN); beams that diverge and meet again agree at the meeting depth
    same, _ = DraftTree.from_beams(beams([[[4, 5, 6]] * 3]))
    assert same.beam_pairs.tolist() == [[0, 9]] and beam_disagreement(same).tolist() == [0.0]
    one, _ = DraftTree.from_beams(beams([[[4, 5, 6]]]))
    assert one.beam_pairs.tolist() == [[0, 0]] and torch.isnan(beam_disagreement(one)).all()
    met, _ = DraftTree.from_beams(beams([[[1, 2, 3], [4, 2, 3]]]))
    assert met.valid.sum().item() == 6  # the prefix tree keeps them apart (diversity 1) ...
    assert beam_disagreement(met).tolist() == [torch.tensor(1 / 3).item()]  # ... but only depth 1 differs
    # positions where either beam is invalid are not compared
    valid = torch.tensor([[[True, True, False], [True, True, True]]])
    assert beam_pair_counts(beams([[[1, 2, 3], [1, 5, 6]]]), valid).tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="from_beams"):
        beam_disagreement(DraftTree.chain(torch.tensor([[1, 2]])))


def random_parents(g: torch.Generator, b: int, n: int) -> tuple[torch.Tensor, int]:
    """[B, N] parents of random trees (each node's parent an earlier node or the root) and their deepest depth."""
    parents = torch.full((b, n), -1, dtype=torch.long)
    depths = torch.ones(b, n, dtype=torch.long)
    for s in range(b):
        for i in range(1, n):
            p = int(torch.randint(-1, i, (1,), generator=g))
            parents[s, i] = p
            depths[s, i] = 1 if p < 0 else int(depths[s, p]) + 1
    return parents, int(depths.max())


def test_tree_closure_is_the_same_with_and_without_a_depth_bound():
    """The bounded parent lookups and the unbounded squarings give the same closure, which holds exactly the root,
    each token itself and the tokens reached by walking up its parents."""
    from workbench.engine.tree import tree_closure

    g = torch.Generator().manual_seed(11)
    for n in (1, 2, 5, 9, 17, 24):
        parents, deepest = random_parents(g, 3, n)
        want = torch.zeros(3, n + 1, n + 1, dtype=torch.bool)
        want[:, :, 0] = True
        for s in range(3):
            for i in range(n):
                j = i
                while j >= 0:
                    want[s, i + 1, j + 1] = True
                    j = int(parents[s, j])
        assert torch.equal(tree_closure(parents), want), n
        for bound in (deepest, deepest + 1):  # a bound over 8 takes the squarings
            assert torch.equal(tree_closure(parents, bound), want), (n, bound)
        assert torch.equal(ancestor_matrix(parents, deepest), want[:, 1:, 1:])


def test_whole_beams_without_a_mask_make_the_same_tree_as_with_an_all_true_one():
    """beam_valid None skips the masking (fewer launches): the tree, beam nodes and beam pairs are those of an
    all-true mask, on random beams with many shared prefixes."""
    g = torch.Generator().manual_seed(3)
    for w, l in ((2, 3), (4, 4), (5, 2)):
        tokens = torch.randint(0, 3, (4, w, l), generator=g)
        bare, bare_nodes = DraftTree.from_beams(tokens)
        masked, masked_nodes = DraftTree.from_beams(tokens, torch.ones(4, w, l, dtype=torch.bool))
        for name in ("token_ids", "parents", "depths", "valid", "beam_pairs"):
            assert torch.equal(getattr(bare, name), getattr(masked, name)), (w, l, name)
        assert torch.equal(bare_nodes, masked_nodes) and bare.depth_bound == masked.depth_bound == l


def prefix_tree_reference(tokens: list[list[int]], valid: list[list[bool]]) -> tuple[list, list, list]:
    """One row's W beams of L tokens (with prefix masks) merged by a dictionary of prefixes, beam-major: the plain
    loop `from_beams` vectorises -> (token_ids, parents, depths) of its nodes, in node order."""
    node_of: dict[tuple, int] = {}
    toks, parents, depths = [], [], []
    for beam, ok in zip(tokens, valid):
        for d in range(len(beam)):
            if not all(ok[:d + 1]):
                break
            prefix = tuple(beam[:d + 1])
            if prefix not in node_of:
                node_of[prefix] = len(toks)
                toks.append(beam[d])
                parents.append(node_of[prefix[:-1]] if d else -1)
                depths.append(d + 1)
    return toks, parents, depths


def test_from_beams_matches_a_loop_over_prefixes_on_random_masked_beams():
    """The vectorised merge (one stable sort and gathers) against the reference loop: random beams over a 3-token
    vocabulary (many shared prefixes), random prefix masks, several widths and lengths; padding nodes hold token 0,
    parent -1, depth 1 and are invalid."""
    g = torch.Generator().manual_seed(11)
    for w, l in ((2, 3), (4, 4), (5, 2), (3, 5)):
        tokens = torch.randint(0, 3, (6, w, l), generator=g)
        lengths = torch.randint(0, l + 1, (6, w), generator=g)
        valid = torch.arange(l) < lengths.unsqueeze(-1)  # prefix masks, some beams empty
        for mask in (valid, None):
            tree, _ = DraftTree.from_beams(tokens, mask)
            for row in range(6):
                ok = (mask if mask is not None else torch.ones_like(valid))[row].tolist()
                want = prefix_tree_reference(tokens[row].tolist(), ok)
                k = len(want[0])
                assert tree.valid[row].tolist() == [True] * k + [False] * (w * l - k), (w, l, row)
                got = (tree.token_ids[row], tree.parents[row], tree.depths[row])
                assert [x[:k].tolist() for x in got] == list(want), (w, l, row)
                assert [x[k:].tolist() for x in got] == [[0] * (w * l - k), [-1] * (w * l - k), [1] * (w * l - k)]
