"""Tree and beam metrics of `workbench.harness.metrics.summarize`: hand-built StepRecords (a chain, a tree with wasted
nodes, merged beams, accepted nodes of several sibling ranks), the engine's per-step ranks and beam disagreement on an
oracle whose accepted path is known, and ReDrafter bench records on the tiny preset."""
import json

import pytest
import torch

from tests.test_engine import target  # noqa: F401 (fixture)
from workbench.engine.step import GenerationResult, StepRecord
from workbench.harness.bench import BenchConfig, BenchSession
from workbench.harness.metrics import summarize, traces_frame


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


def test_acceptance_by_depth_and_rank():
    # a tree step: sequence 0 accepts through ranks [1, 0], sequence 1 through [0]; then [2, 1, 0] and nothing
    recs = [StepRecord(0, 0.1, [0, 1], [6, 6], [2, 1], [3, 2], path_ranks=[[1, 0], [0]]),
            StepRecord(1, 0.2, [0, 1], [6, 6], [3, 0], [4, 1], path_ranks=[[2, 1, 0], []])]
    s = summarize([GenerationResult([[0] * 8, [0] * 8], 0.0, 0.05, [1.0, 1.0], recs, num_nodes=6)])
    assert s.acceptance_by_depth_rank == [[1 / 4, 1 / 4, 1 / 4], [1 / 4, 1 / 4, 0.0], [1 / 4, 0.0, 0.0]]
    assert s.acceptance_by_rank == [3 / 4, 2 / 4, 1 / 4]
    # row sums are acceptance by position, the whole sum the accepted path length
    assert [sum(row) for row in s.acceptance_by_depth_rank] == s.acceptance_by_position[:3]
    assert sum(s.acceptance_by_rank) == pytest.approx(s.accepted_path_length_mean)
    assert s.beam_disagreement_mean is None  # no beam pairs recorded


def test_chains_are_rank_zero_and_beam_disagreement_is_averaged_per_step():
    s = summarize([result([([3, 3], [3, 0]), ([3, 3], [1, 2])], num_nodes=3)])  # records without ranks: chains
    assert s.acceptance_by_rank == [6 / 4] and s.acceptance_by_depth_rank == [[3 / 4], [2 / 4], [1 / 4]]
    recs = [StepRecord(0, 0.1, [0, 1], [4, 2], [1, 1], [2, 2], path_ranks=[[0], [0]], beam_pairs=[(3, 4), (0, 4)]),
            StepRecord(1, 0.2, [0], [3], [0], [1], path_ranks=[[]], beam_pairs=[(2, 4)])]
    res = GenerationResult([[0] * 8, [0] * 8], 0.0, 0.05, [1.0, 1.0], recs, num_nodes=4, beams=True)
    s = summarize([res])
    assert s.beam_disagreement_mean == pytest.approx((3 / 4 + 0 + 2 / 4) / 3)
    tr = traces_frame([res], "r")
    assert tr["path_ranks"].tolist() == ["[0]", "[0]", "[]"]
    assert tr["beam_disagreement"].tolist() == [0.75, 0.0, 0.5]
    assert summarize([result([([0, 0], [0, 0])], num_nodes=0)]).acceptance_by_rank == []  # AR: nothing drafted


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "fixed-shape"])
def test_engine_records_the_oracle_paths_ranks_and_beam_disagreement(cuda_graphs, target):
    """The oracle's beams: wrong | right[:1] + wrong[1:] | right (tests/test_redrafter.py). Its accepted path is
    node L (the root's rank-1 child), node 2L (L's rank-1 child: beam 1 came first), then rank-0 children; the beam
    pairs differ at 1/3, 3/3 and 2/3 of the depths (L = 3): disagreement 2/3 every step."""
    from tests.test_engine import PROMPTS
    from tests.test_redrafter import OracleRedrafter
    from workbench.engine import EngineConfig, SpecEngine
    from workbench.engine.drafters import RedrafterHead

    drafter = OracleRedrafter(RedrafterHead.for_target(target), target, beam_width=3, beam_length=3)
    engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=9, cuda_graphs=cuda_graphs,
                                                      graph_batch_sizes=(1, 2, 4)))
    res = engine.generate(PROMPTS)
    assert all(ranks == [1, 1, 0] for s in res.steps for ranks in s.path_ranks)
    assert all(pair == (6, 9) for s in res.steps for pair in s.beam_pairs)
    s = summarize([res])
    assert s.acceptance_by_depth_rank == [[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]]
    assert s.beam_disagreement_mean == pytest.approx(2 / 3)
    tr = traces_frame([res])
    assert {json.loads(x) == [1, 1, 0] for x in tr["path_ranks"]} == {True}


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
    assert 0 <= rec["beam_disagreement_mean"] <= 1
    # rank metrics add up to the path length; per depth, to the acceptance by position
    assert sum(rec["acceptance_by_rank"]) == pytest.approx(rec["accepted_path_length_mean"])
    by_depth = json.loads(rec["acceptance_by_depth_rank"])
    assert [sum(row) for row in by_depth] == pytest.approx(rec["acceptance_by_position"][:len(by_depth)])
    assert len(rec["acceptance_by_rank"]) <= 2  # W = 2: at most two children per node


def test_traces_of_a_beam_run_round_trip_through_the_store(session, tmp_path):
    from results.store import ResultStore

    res = session.run(BenchConfig(method="redrafter", beam_width=3, beam_length=2, max_new_tokens=6, num_prompts=1,
                                  repeats=1))
    store = ResultStore(tmp_path / "store")
    rid = store.append(res.record, res.traces)
    row = store.load().set_index("run_id").loc[rid]
    assert row["beam_disagreement_mean"] == pytest.approx(res.record["beam_disagreement_mean"])
    assert json.loads(row["acceptance_by_depth_rank"]) == json.loads(res.record["acceptance_by_depth_rank"])
    tr = store.load_traces([rid])
    assert [len(json.loads(x)) for x in tr["path_ranks"]] == tr["accepted"].tolist()
    assert tr["beam_disagreement"].notna().all() and tr["beam_disagreement"].between(0, 1).all()


@pytest.mark.parametrize("method", ["ar", "ngram"])
def test_other_methods_have_no_beam_diversity(session, method):
    rec = session.run(
        BenchConfig(method=method, k=3, max_new_tokens=8, num_prompts=2, repeats=1)).record
    assert rec["beam_diversity_mean"] is None and rec["beam_disagreement_mean"] is None
    if method == "ar":
        assert rec["acceptance_by_rank"] is None and rec["acceptance_by_depth_rank"] is None
        assert rec["tree_size_mean"] is None and rec["wasted_node_fraction"] is None
    else:
        assert 0 <= rec["tree_size_mean"] <= 3
        assert len(rec["acceptance_by_rank"]) == 1  # a chain: rank 0 only
