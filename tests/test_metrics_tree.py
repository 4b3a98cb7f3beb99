"""Tree and beam metrics of `workbench.harness.metrics.summarize`: hand-built StepRecords (a chain, a tree with wasted
nodes, merged beams) and a ReDrafter bench record on the tiny preset."""
import pytest

from workbench.engine.step import GenerationResult, StepRecord
from workbench.harness.bench import BenchConfig, BenchSession
from workbench.harness.metrics import summarize


def result(steps: list[tuple[list[int], list[int]]], num_nodes: int, beams: bool = False) -> GenerationResult:
    """One batch of 2 sequences; each step is (drafted per sequence, accepted per sequence)."""
    recs = [StepRecord(i, 0.1 * (i + 1), [0, 1], drafted, accepted, [a + 1 for a in accepted])
            for i, (drafted, accepted) in enumerate(steps)]
    return GenerationResult([[0] * 8, [0] * 8], 0.0, 0.05, [1.0, 1.0], recs, num_nodes=num_nodes, beams=beams)


def test_chain_tree_size_is_drafted_tokens():
    # k = 3 chain, two steps: sequence 0 accepts 3 then 1, sequence 1 accepts 0 then 2
    s = summarize([result([([3, 3], [3, 0]), ([3, 3], [1, 2])], num_nodes=3)])
    assert s.tree_size_mean == 3.0
    assert s.accepted_path_length_mean == pytest.approx(6 / 4)
    assert s.mean_accepted_tokens == pytest.approx(s.accepted_path_length_mean + 1)  # the bonus token
    assert s.wasted_node_fraction == pytest.approx(1 - 6 / 12) == pytest.approx(1 - s.acceptance_rate)
    assert s.acceptance_by_position == [3 / 4, 2 / 4, 1 / 4]
    assert s.beam_diversity_mean is None  # not a beam drafter


def test_tree_wasted_nodes_and_beam_diversity():
    # W = 3 beams of L = 2 (N = 6 slots): step 0 merges into 5 and 4 distinct nodes, step 1 into 6 and 2
    # (all beams identical); accepted paths 2, 1, 0, 2 -> 5 of 17 verified nodes on an accepted path
    s = summarize([result([([5, 4], [2, 1]), ([6, 2], [0, 2])], num_nodes=6, beams=True)])
    assert s.tree_size_mean == pytest.approx(17 / 4)
    assert s.wasted_node_fraction == pytest.approx(1 - 5 / 17)
    assert s.accepted_path_length_mean == pytest.approx(5 / 4)
    assert s.mean_accepted_tokens == pytest.approx(9 / 4)
    assert s.beam_diversity_mean == pytest.approx((5 / 6 + 4 / 6 + 6 / 6 + 2 / 6) / 4)
    # acceptance per depth counts accepted path lengths (not nodes): depth 1 reached 3 times, depth 2 twice
    assert s.acceptance_by_position[:2] == [3 / 4, 2 / 4] and not any(s.acceptance_by_position[2:])


def test_autoregressive_has_no_tree_figures():
    s = summarize([result([([0, 0], [0, 0])], num_nodes=0)])
    assert s.tree_size_mean == 0.0 and s.accepted_path_length_mean == 0.0
    assert s.wasted_node_fraction is None and s.beam_diversity_mean is None


@pytest.fixture(scope="module")
def session():
    return BenchSession.load(preset="tiny", device="cpu")


def test_redrafter_bench_record_has_tree_columns(session):
    rec = session.run(BenchConfig(method="redrafter", beam_width=2, beam_length=3, max_new_tokens=8, num_prompts=2,
                                  repeats=1)).record
    assert 0 < rec["tree_size_mean"] <= 2 * 3
    assert 0 <= rec["wasted_node_fraction"] <= 1
    assert rec["wasted_node_fraction"] == pytest.approx(1 - rec["acceptance_rate"])
    assert 0 <= rec["accepted_path_length_mean"] <= 3
    assert rec["mean_accepted_tokens"] == pytest.approx(rec["accepted_path_length_mean"] + 1)
    assert 0 < rec["beam_diversity_mean"] <= 1
    assert rec["beam_diversity_mean"] >= 1 / 2  # the first beam's L nodes are always distinct: >= 1 / W
    assert rec["beam_diversity_mean"] == pytest.approx(rec["tree_size_mean"] / (2 * 3))  # N = W x L in every step


@pytest.mark.parametrize("method", ["ar", "ngram"])
def test_other_methods_have_no_beam_diversity(session, method):
    rec = session.run(
        BenchConfig(method=method, k=3, max_new_tokens=8, num_prompts=2, repeats=1)).record
    assert rec["beam_diversity_mean"] is None
    if method == "ar":
        assert rec["tree_size_mean"] is None and rec["wasted_node_fraction"] is None
    else:
        assert 0 <= rec["tree_size_mean"] <= 3
