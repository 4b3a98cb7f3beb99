"""Adaptive speculation pays for the draft model only where it drafts: with a schedule whose k is 0 at a batch size,
rows decoding there run no draft-model forward at all (no prefill at their join, no catch-up, no chain), exactly as
with speculation off; and `catch_up_max` keeps a row that decoded long at k = 0 from a whole-context catch-up when
the batch dips into a drafting size. Counted with spies on the drafter (forwards and tokens), never timed. Outputs
stay equal to each request's solo greedy output throughout."""
import pytest

from tests.test_engine import draft, target  # noqa: F401 (fixtures)
from tests.test_serving import BS, assert_solo, random_requests, solo  # noqa: F401 (fixture)
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DraftModelDrafter
from workbench.serving.adaptive import AdaptiveSpeculation
from workbench.serving.config import ServeError
from workbench.serving.loop import ServingLoop, StepClock
from workbench.serving.request import Request

OFF_ABOVE_ONE = [(1, 1, 1), (2, 64, 0)]  # the loop calibration's schedule on the H200: '1:1,2-16:0'


class CountingDrafter(DraftModelDrafter):
    """Counts the draft model's work by kind: prefill at join, catch-up, chain (tokens fed = rows x T)."""

    def __init__(self, model, k):
        super().__init__(model, k)
        self.count = {"prefill": [0, 0], "catch_up": [0, 0], "chain": [0, 0]}  # kind -> [forwards, tokens]

    def _add(self, kind, forwards, tokens):
        self.count[kind][0] += forwards
        self.count[kind][1] += tokens

    def prefill(self, state, prompt_ids, positions):
        self._add("prefill", 1, prompt_ids.numel())
        super().prefill(state, prompt_ids, positions)

    def catch_up(self, state, ids, positions, start_host):
        self._add("catch_up", 1, ids.numel())
        super().catch_up(state, ids, positions, start_host)

    def propose(self, state):
        n = self.k if state.num_nodes is None else state.num_nodes
        self._add("chain", n, len(state.rows_host) * (n + 1))
        return super().propose(state)

    @property
    def tokens(self) -> int:
        return sum(t for _, t in self.count.values())


def engine_with(drafter, target):
    return SpecEngine(target, drafter, EngineConfig(max_new_tokens=64, kv_block_size=BS))


def closed_loop(concurrency: int, rounds: int = 3, max_new_tokens: int = 9) -> list[Request]:
    """`concurrency` requests at a time, all arriving at once, of one output length: they join in waves of
    `concurrency` and leave together, so the live batch is `concurrency` at every decode step."""
    prompts = [[(7 * i + j) % 61 + 1 for j in range(5 + 3 * i % 11)] for i in range(concurrency * rounds)]
    return [Request(i, p, max_new_tokens, 0.0) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("concurrency", [2, 3])
def test_a_batch_size_at_k0_runs_no_draft_model_at_all(target, draft, solo, concurrency):
    """The H200 threshold check: at concurrency 2, where '1:1,2-16:0' says off, adaptive was 17 % below off. A wave
    of joins used to prefill the draft model for its first joiner (the batch it saw was itself alone: k = 1), for
    nothing; now only a row's first draft pays for its draft KV."""
    reqs = closed_loop(concurrency)
    drafter = CountingDrafter(draft, 3)
    res = ServingLoop(engine_with(drafter, target), reqs, adaptive=AdaptiveSpeculation(3, OFF_ABOVE_ONE),
                      clock=StepClock(), max_num_seqs=4, max_concurrency=concurrency).run()
    assert_solo(res, reqs, solo)
    assert {it.batch_size for it in res.iterations if it.batch_size} == {concurrency}
    assert {t.num_nodes for t in res.traces} == {0}
    assert drafter.count == {"prefill": [0, 0], "catch_up": [0, 0], "chain": [0, 0]}
    assert res.draft_prefill_tokens == 0 and res.draft_catch_up_tokens == 0


def test_lazy_draft_kv_costs_what_a_prefill_at_join_costs_where_rows_draft(target, draft, solo):
    """At concurrency 1 the schedule drafts at every step: the draft model gets each prompt once, by catch-up before
    the row's first draft instead of at its join (one token fewer: the chain's first forward feeds t_(L-1))."""
    reqs = closed_loop(1, rounds=4)
    drafter = CountingDrafter(draft, 3)
    res = ServingLoop(engine_with(drafter, target), reqs, adaptive=AdaptiveSpeculation(3, OFF_ABOVE_ONE),
                      clock=StepClock(), max_num_seqs=4, max_concurrency=1).run()
    assert_solo(res, reqs, solo)
    assert drafter.count["prefill"] == [0, 0]
    assert drafter.count["catch_up"] == [len(reqs), sum(len(r.prompt) - 1 for r in reqs)]
    assert {t.num_nodes for t in res.traces} == {1}


def test_a_fixed_k_still_prefills_the_draft_model_at_join(target, draft, solo):
    reqs = closed_loop(2)
    drafter = CountingDrafter(draft, 3)
    res = ServingLoop(engine_with(drafter, target), reqs, clock=StepClock(), max_num_seqs=4,
                      max_concurrency=2).run()
    assert_solo(res, reqs, solo)
    assert drafter.count["prefill"] == [len(reqs), sum(len(r.prompt) for r in reqs)]
    assert res.draft_prefill_tokens == drafter.count["prefill"][1] and drafter.count["catch_up"] == [0, 0]


def long_and_short() -> list[Request]:
    """A long request decodes beside a short one (batch 2: k = 0) for 12 steps, then alone (batch 1: k = 1)."""
    return [Request(0, [3, 1, 4, 1, 5, 9, 2, 6], 30, 0.0), Request(1, [2, 7, 1, 8, 2, 8], 12, 0.0)]


def test_catch_up_max_keeps_a_row_that_decoded_long_at_k0_autoregressive(target, draft, solo):
    reqs = long_and_short()
    counts = {}
    for limit in (0, 4):
        drafter = CountingDrafter(draft, 3)
        res = ServingLoop(engine_with(drafter, target), reqs, adaptive=AdaptiveSpeculation(3, OFF_ABOVE_ONE),
                          clock=StepClock(), max_num_seqs=4, catch_up_max=limit).run()
        assert_solo(res, reqs, solo)
        counts[limit] = (drafter.count, res)
    unlimited, res0 = counts[0]
    assert unlimited["catch_up"][0] == 1 and res0.draft_catch_up_tokens > 8  # its prompt and 12 generated tokens
    assert res0.draft_catch_up_skips == 0
    limited, res4 = counts[4]
    assert limited == {"prefill": [0, 0], "catch_up": [0, 0], "chain": [0, 0]}  # never drafts: 11 missed > 4
    assert res4.draft_catch_up_skips == sum(1 for t in res4.traces if t.batch_size == 1)
    assert {t.num_nodes for t in res4.traces} == {0}


def test_catch_up_max_still_lets_a_fresh_row_draft(target, draft, solo):
    """A row that has missed only its prompt catches up as a fixed k would have prefilled it at join."""
    reqs = closed_loop(1, rounds=3)
    drafter = CountingDrafter(draft, 3)
    res = ServingLoop(engine_with(drafter, target), reqs, adaptive=AdaptiveSpeculation(3, OFF_ABOVE_ONE),
                      clock=StepClock(), max_num_seqs=4, max_concurrency=1, catch_up_max=1).run()
    assert_solo(res, reqs, solo)
    assert res.draft_catch_up_skips == 0 and {t.num_nodes for t in res.traces} == {1}


def test_catch_up_max_below_zero_is_a_named_error(target, draft):
    with pytest.raises(ServeError, match="catch_up_max"):
        ServingLoop(engine_with(DraftModelDrafter(draft, 3), target), long_and_short(), clock=StepClock(),
                    catch_up_max=-1)


def test_gpu_serving_threshold_check_reads_medians_over_rounds():
    """One ~0.5 s threshold run can stall (single runs differed by +-10 % on the H200): the cliff check reads the
    median of each (concurrency, setting) over the rounds."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_serving

    def rec(c, setting, rep, tok):
        return {"threshold": 2, "max_concurrency": c, "setting": setting, "repeat": rep, "output_throughput": tok,
                "tpot_ms_p99": 1.0}

    rows = [rec(c, s, rep, 100.0 * c) for c in (1, 2) for s in ("off", "k=4", "adaptive") for rep in range(3)]
    rows[3 * 3 + 2 * 3 + 0]["output_throughput"] = 150.0  # concurrency 2, adaptive, round 0: a stall
    (check,) = gpu_serving.threshold_checks(rows, "k=4", 10.0)
    assert not check["cliff"] and [p["repeats"] for p in check["points"]] == [3, 3]
    assert check["points"][1]["adaptive"] == 200.0
    rows[3 * 3 + 2 * 3 + 1]["output_throughput"] = 150.0  # a second stalled round: the median falls, a cliff
    (check,) = gpu_serving.threshold_checks(rows, "k=4", 10.0)
    assert check["cliff"] and "concurrency 2" in check["reasons"][0]


def test_a_drafting_step_catches_up_only_the_rows_that_draft(target, draft, solo):
    """A (long) decodes beside B and C at batch 3 (k = 0), then alone and beside D at batch 1-2 (k = 3): with
    catch_up_max, A stays autoregressive in steps where D drafts; only D's prompt is caught up, and A's draft KV
    (written by the batch's chains, with a hole below) is never read for a draft."""
    reqs = [Request(0, [3, 1, 4, 1, 5, 9, 2, 6], 30, 0.0), Request(1, [2, 7, 1, 8], 10, 0.0),
            Request(2, [1, 6, 1, 8, 0, 3], 10, 0.0), Request(3, [5, 7, 7, 2, 1], 12, 14.0)]
    drafter = CountingDrafter(draft, 3)
    engine = engine_with(drafter, target)
    caught = []
    catch_up = engine.catch_up_drafter
    engine.catch_up_drafter = lambda rows, starts, ends: (caught.append(list(zip(rows, starts, ends))),
                                                          catch_up(rows, starts, ends))
    res = ServingLoop(engine, reqs, adaptive=AdaptiveSpeculation(3, [(1, 2, 3), (3, 64, 0)]), clock=StepClock(),
                      max_num_seqs=4, catch_up_max=4).run()
    assert_solo(res, reqs, solo)
    drafting = [t for t in res.traces if t.num_nodes]
    assert drafting and {t.request for t in drafting if t.k} == {3}  # D drafts, A never does
    assert any(t.request == 0 for t in drafting)  # ... though A shares steps where D drafts
    assert caught == [[(caught[0][0][0], 0, len(reqs[3].prompt) - 1)]]  # D's prompt, once
    assert res.draft_catch_up_skips == sum(1 for t in res.traces if t.request == 0 and t.batch_size <= 2)
