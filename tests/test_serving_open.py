"""The open-ended serving loop (`ServingLoop.open` / `submit` / `step` / `abort`), what `workbench serve` runs:
requests submitted between iterations get their solo greedy outputs; an aborted request, queued or mid-decode (a
step in flight over its row included), gives every block back; oversize requests are named errors at submit."""
import pytest

from tests.test_engine import draft, target  # noqa: F401 (fixtures)
from tests.test_serving import BS, make_engine, random_requests, solo  # noqa: F401 (fixtures)
from workbench.serving.config import RequestTooLargeError, ServeError
from workbench.serving.loop import ServingLoop, StepClock
from workbench.serving.request import Request
from workbench.serving.tuning import ServeTuning

MAX_LEN = 64


def open_loop(engine, **kw) -> ServingLoop:
    loop = ServingLoop(engine, [], clock=StepClock(), max_len=MAX_LEN, **{"max_num_seqs": 4, **kw})
    loop.open()
    return loop


def engine_for(kind, target, draft, full_overlap):
    """Fixed shapes (graphs) where the loop should launch ahead: what full overlap needs."""
    return make_engine(kind, target, draft, **({"cuda_graphs": True, "graph_batch_sizes": (1, 2, 4)}
                                               if full_overlap else {}))


def drain(loop, states, limit=500):
    for _ in range(limit):
        if not loop.busy:
            return
        loop.step()
    raise AssertionError(f"the loop still has work after {limit} iterations: {[s.phase for s in states]}")


@pytest.mark.parametrize("full_overlap", [True, False], ids=["full-overlap", "no-overlap"])
@pytest.mark.parametrize("kind", ["ar", "ngram", "draft"])
def test_requests_submitted_between_steps_get_their_solo_greedy_outputs(target, draft, solo, kind, full_overlap):
    loop = open_loop(engine_for(kind, target, draft, full_overlap), tuning=ServeTuning(full_overlap=full_overlap))
    assert loop.full_overlap == full_overlap
    reqs = sorted(random_requests(3, n=8), key=lambda r: r.arrival_s)
    states, drafted, it = {}, 0, 0
    while reqs or loop.busy:
        while reqs and reqs[0].arrival_s <= it:  # arrival_s read as the iteration to submit at
            r = reqs.pop(0)
            states[r.id] = loop.submit(r)
        drafted += sum(t.drafted for t in loop.step())
        it += 1
        assert it < 500
    for s in states.values():
        assert s.phase == "done" and s.output == solo(s.req), f"request {s.req.id} differs from its solo output"
        assert s.t_arrival is not None and s.t_first_token >= s.t_arrival
    assert drafted == sum(s.drafted for s in states.values())  # step's traces cover every step, once
    assert (drafted > 0) == (kind != "ar")
    assert loop.cache.free_blocks == loop.num_blocks and not loop._open.traces  # no history kept


@pytest.mark.parametrize("full_overlap", [True, False], ids=["full-overlap", "no-overlap"])
def test_aborted_requests_give_every_block_back(target, draft, solo, full_overlap, monkeypatch):
    engine = engine_for("ngram", target, draft, full_overlap)
    loop = open_loop(engine, max_num_seqs=2, tuning=ServeTuning(full_overlap=full_overlap))
    assert loop.full_overlap == full_overlap
    pending, released_under_step = [], []  # rows of each launched, unread step; releases of such rows

    def spy(name, real):
        def call(*args, **kwargs):
            if name == "launch_step":
                pending.append(set(args[0]))
            elif name == "finish_step":
                pending.pop(0)
            else:
                released_under_step.extend(args[0] for rows in pending if args[0] in rows)
            return real(*args, **kwargs)
        return call

    for name in ("launch_step", "finish_step", "release_row"):
        monkeypatch.setattr(engine, name, spy(name, getattr(engine, name)))
    long = [Request(i, [3, 9, 4, 1, 3, 9, 4, 1, 3, i], 40) for i in range(3)]
    states = [loop.submit(r) for r in long]
    for _ in range(4):
        loop.step()
    assert [s.phase for s in states] == ["decode", "decode", "waiting"]
    assert loop.cache.free_blocks < loop.num_blocks
    loop.abort(states[2])  # queued
    loop.abort(states[0])  # decoding (with full overlap: under a step in flight, released at the next boundary)
    assert states[2].phase == "aborted"
    assert (states[0].phase == "aborted") == (not full_overlap) and bool(pending) == full_overlap
    loop.step()
    assert states[0].phase == "aborted" and states[0].row is None
    n = len(states[0].output)
    drain(loop, states)
    assert len(states[0].output) == n  # no step after its abort
    assert states[1].phase == "done" and states[1].output == solo(long[1])
    assert loop.cache.free_blocks == loop.num_blocks and not loop.busy and not released_under_step
    loop.abort(states[1])  # a finished request stays done
    assert states[1].phase == "done"
    again = loop.submit(long[0])  # the loop keeps serving after aborts
    drain(loop, [again])
    assert again.output == solo(long[0]) and loop.cache.free_blocks == loop.num_blocks


def test_submit_names_a_request_that_can_never_run(target, draft):
    loop = open_loop(make_engine("ngram", target, draft))
    with pytest.raises(RequestTooLargeError, match="cache row holds 64"):
        loop.submit(Request(0, [1] * 60, 10))
    with pytest.raises(ServeError, match="empty prompt"):
        loop.submit(Request(1, [], 4))
    with pytest.raises(ServeError, match="max_new_tokens must be >= 1"):
        loop.submit(Request(2, [1, 2], 0))
    assert not loop.busy
    with pytest.raises(ServeError, match="needs max_len"):
        ServingLoop(make_engine("ar", target, draft), [])



@pytest.mark.parametrize("full_overlap", [True, False], ids=["full-overlap", "no-overlap"])
def test_the_first_token_hook_sees_each_first_token_before_the_rest_of_its_iteration(target, draft, solo,
                                                                                      full_overlap):
    """What `workbench serve` sends at once: the hook runs when a request's first token is read, once per request,
    before the drafter's prefill of its row (the request still in prefill), and its token is the solo output's."""
    loop = open_loop(engine_for("draft", target, draft, full_overlap), tuning=ServeTuning(full_overlap=full_overlap))
    seen = []
    loop.first_token_hook = lambda s: seen.append((s.req.id, list(s.output), s.phase))
    reqs = random_requests(3, n=6)
    states = [loop.submit(r) for r in reqs[:3]]
    loop.step()
    states += [loop.submit(r) for r in reqs[3:]]
    drain(loop, states)
    assert sorted(i for i, _, _ in seen) == sorted(r.id for r in reqs)  # once each
    by_id = {s.req.id: s for s in states}
    for i, out, phase in seen:
        assert phase == "prefill" and out == solo(by_id[i].req)[:1]
