"""What-if replay's cost model and simulated loop: the fit recovers known coefficients from synthetic iterations
(draft prefill at join and catch-up included) and drops the columns its iterations cannot tell apart; the replay
does the draft model's work where the serving loop does it (prefill at join only where every step drafts, catch-ups
grouped by gap, `catch_up_max`), counted exactly against real loops on the same arrivals; a schedule at k = 0 at
every batch size replays with no draft work; fitted on off + a fixed k under a clock whose iterations cost a known
function of their work, a held-out k and schedule are predicted exactly (the old model misses); and a real CPU serve
(tiny preset) is predicted at its own setting."""
import random

import numpy as np
import pytest

from tests.test_engine import draft, target  # noqa: F401 (fixtures)
from tests.test_serving import BS, assert_solo, solo  # noqa: F401 (fixture)
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DraftModelDrafter
from workbench.serving import metrics, replay
from workbench.serving.adaptive import AdaptiveSpeculation
from workbench.serving.loop import IterationLog, ServingLoop, StepClock, _work
from workbench.serving.request import Request
from workbench.serving.tuning import ServeTuning

COUNTERS = ("draft_prefill_tokens", "draft_catch_up_tokens", "draft_catch_up_forwards", "draft_catch_up_slots",
            "draft_catch_up_skips")


def synthetic_iterations(coef: dict, n_its: int = 200, seed: int = 0, noise_ms: float = 0.0,
                         nodes=(0, 1, 2, 4)) -> list[IterationLog]:
    """Iterations whose ms is coef . features (+ Gaussian noise): random batch, draft length and prefill work,
    draft prefills at join and catch-ups in some of them."""
    rng = random.Random(seed)
    its, t = [], 0.0
    for _ in range(n_its):
        b, n = rng.randint(0, 16), rng.choice(nodes)
        n = n if b else 0
        forwards = rng.choice((0, 0, 1, 2, 3))
        tokens = sum(rng.randint(1, 40) for _ in range(forwards))
        joins = rng.randint(0, forwards)
        catch_ups = rng.choice((0, 0, 1, 2)) if n else 0
        slots = sum(rng.randint(1, 30) for _ in range(catch_ups))
        it = IterationLog(t, t, b, n, tokens, 0, 0, prefill_forwards=forwards,
                          draft_prefill_tokens=sum(rng.randint(1, 40) for _ in range(joins)), draft_prefills=joins,
                          catch_up_tokens=slots, catch_up_slots=slots, catch_up_forwards=catch_ups)
        ms = sum(c * x for c, x in zip((coef[f] for f in replay.FEATURES),
                                       replay.Work.of(it).features(replay.FEATURES)))
        it.t_end = t + (ms + rng.gauss(0, noise_ms)) / 1e3
        t = it.t_end
        its.append(it)
    return its


KNOWN = {"1": 0.8, "B": 0.05, "B*n": 0.01, "n": 0.3, "n>0": 0.4, "P": 0.002, "F": 2.5, "D": 0.001, "G": 1.7}


def test_fit_recovers_known_coefficients_with_draft_side_work():
    its = synthetic_iterations(KNOWN)
    costs = replay.fit_costs(its)
    assert costs.dropped == ()
    assert costs.named() == pytest.approx(KNOWN, rel=1e-6, abs=1e-9)
    noisy = replay.fit_costs(synthetic_iterations(KNOWN, n_its=2000, seed=1, noise_ms=0.05))
    for f in ("1", "n", "F", "G"):  # the large per-forward costs, from noisy timings
        assert noisy.named()[f] == pytest.approx(KNOWN[f], rel=0.1)
    old = replay.fit_costs(its, replay.OLD_FEATURES)  # blind to forwards and draft work: worse on the same data
    err = lambda c: max(abs(c.ms(replay.Work.of(i)) - (i.t_end - i.t_start) * 1e3) for i in its)  # noqa: E731
    assert err(costs) < 1e-6 < 0.1 < err(old)


def test_fit_drops_columns_its_iterations_cannot_tell_apart():
    """Speculation off + a fixed k = 4 with no draft model: n = 4 [n > 0] and no draft-side work. The fit keeps
    n (so a held-out k = 2 costs half the per-node draft work), drops [n > 0], D and G, and still reproduces every
    measured iteration."""
    coef = {**KNOWN, "n>0": 0.0, "D": 0.0, "G": 0.0}
    its = [i for i in synthetic_iterations(coef, nodes=(0, 4))]
    for i in its:  # no draft model: no draft prefill, no catch-up (their ms were priced at 0 above)
        i.draft_prefill_tokens = i.draft_prefills = i.catch_up_tokens = i.catch_up_slots = i.catch_up_forwards = 0
    costs = replay.fit_costs(its)
    assert costs.dropped == ("n>0", "D", "G")
    assert costs.named()["n>0"] == costs.named()["D"] == costs.named()["G"] == 0.0
    assert costs.named()["n"] == pytest.approx(KNOWN["n"], rel=1e-6)
    for i in its:
        assert costs.ms(replay.Work.of(i)) == pytest.approx((i.t_end - i.t_start) * 1e3, abs=1e-6)
    assert replay.independent_columns(np.array([[1.0, 0.0, 2.0, 4.0], [1.0, 0.0, 2.0, 0.0]])) == [0, 3]


def test_per_step_fit_keeps_the_draft_cost_per_step_where_the_fit_cannot_tell():
    """Every drafting step of the fit verifies one length (k = 4, as a fit on off + fixed k): n = 4 [n > 0], so the
    draft phase's cost can be per node or per step. FEATURES keeps n (a held-out k = 2 costs half the draft work),
    PER_STEP_FEATURES keeps [n > 0] (it costs all of it). Both fit the measured iterations equally well; on the
    held-out length they bound the truth, here a cost that is half per node and half per step. With lengths 1-4 in the
    fit both fits find the same costs."""
    truth = dict(KNOWN, **{"n": 0.3, "n>0": 1.2})
    its = synthetic_iterations(truth, nodes=(0, 4))  # speculation off and k = 4
    per_node, per_step = replay.fit_costs(its), replay.fit_costs(its, replay.PER_STEP_FEATURES)
    assert per_node.dropped == ("n>0",) and per_step.dropped == ("n",)
    for i in its:
        assert per_node.ms(replay.Work.of(i)) == pytest.approx(per_step.ms(replay.Work.of(i)), abs=1e-6)
    k2 = replay.Work.of(IterationLog(0, 0, 8, 2, 0, 0, 0))
    real = sum(truth[f] * x for f, x in zip(replay.FEATURES, k2.features(replay.FEATURES)))
    assert per_node.ms(k2) < real < per_step.ms(k2)
    both = synthetic_iterations(truth, nodes=(0, 1, 2, 3, 4))
    a, b = replay.fit_costs(both), replay.fit_costs(both, replay.PER_STEP_FEATURES)
    assert a.dropped == b.dropped == ()
    assert a.named() == pytest.approx(truth, rel=1e-6, abs=1e-9) and b.named() == pytest.approx(truth, rel=1e-6,
                                                                                                 abs=1e-9)


def test_fit_keeps_every_cost_nonnegative_unless_asked_not_to():
    """Prefill tokens and forwards together (F = 1 per prefill, P its prompt): a convex prefill cost (CPU attention)
    makes plain least squares price a forward below zero; the default fit keeps it at 0 and stays the best
    nonnegative fit (no coefficient can move without raising the error)."""
    its = []
    for j, p in enumerate([0, 10, 50, 100, 200, 300] * 10):
        ms = 1.0 + (0.1 * p + 1e-4 * p * p if p else 0.0)
        its.append(IterationLog(j, j + ms / 1e3, 0, 0, p, 0, 0, prefill_forwards=1 if p else 0))
    free = replay.fit_costs(its, nonnegative=False)
    fit = replay.fit_costs(its)
    assert free.named()["F"] < 0 and fit.named()["F"] == 0.0 and min(fit.coef) >= 0.0
    x = np.array([replay.Work.of(i).features(replay.FEATURES) for i in its])
    y = np.array([(i.t_end - i.t_start) * 1e3 for i in its])
    sse = lambda c: float(np.sum((x @ np.array(c) - y) ** 2))  # noqa: E731
    for j in (0, 5, 6):  # "1", "P", "F": each nudge (up, or down where room) fits worse
        for d in (1e-3, -1e-3):
            c = list(fit.coef)
            c[j] += d
            if c[j] >= 0:
                assert sse(c) > sse(fit.coef)


def test_fit_bad_input_is_a_named_error():
    with pytest.raises(ValueError, match="needs measured iterations"):
        replay.fit_costs([])
    with pytest.raises(ValueError, match="unknown cost feature"):
        replay.fit_costs(synthetic_iterations(KNOWN, n_its=5), ("1", "tokens"))


# ---- the simulated loop against real loops (StepClock: one unit per iteration, so the timelines are the same) -----
def engine_with(model, target, k=3):
    return SpecEngine(target, DraftModelDrafter(model, k), EngineConfig(max_new_tokens=64, kv_block_size=BS))


def arrivals(seed: int, n: int = 10) -> list[Request]:
    """Random prompts and lengths arriving over a few iterations: batch sizes 1-4 come and go."""
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(64) for _ in range(rng.randint(2, 14))], rng.randint(1, 14),
                    arrival_s=float(rng.randint(0, 16))) for i in range(n)]


STEP_CLOCK = replay.CostModel([1e3] + [0.0] * (len(replay.FEATURES) - 1))  # a StepClock iteration: 1 s, exactly
SCHEDULES = {"fixed": [], "off above 1": [(1, 1, 3), (2, 64, 0)], "switching": [(1, 1, 3), (2, 2, 0), (3, 64, 2)],
             "off": [(1, 64, 0)], "off while 1 waits": "queue"}  # the last: spec_off_queue = 1, fixed k otherwise


@pytest.fixture(scope="module", params=["random draft", "self draft"])
def recorded(request, target, draft):
    """A fixed k = 3 run per arrival seed: the replay's acceptance oracle. A random draft model accepts little, the
    target drafting for itself accepts everything (the oracle's chaining over full acceptances)."""
    model = draft if request.param == "random draft" else target
    return model, {seed: ServingLoop(engine_with(model, target), arrivals(seed), clock=StepClock(),
                                     max_num_seqs=4).run() for seed in (0, 1, 2)}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("catch_up_max", [0, 2])
def test_replay_does_the_draft_work_the_loop_does(target, solo, recorded, schedule, catch_up_max):
    model, runs = recorded
    caught_up = 0
    for seed, rec in runs.items():
        reqs = arrivals(seed)
        adaptive = lambda: AdaptiveSpeculation(3, off_queue=1) if SCHEDULES[schedule] == "queue" else \
            AdaptiveSpeculation(3, SCHEDULES[schedule])  # noqa: E731 (the rules keep no state)
        real = ServingLoop(engine_with(model, target), reqs, adaptive=adaptive(), clock=StepClock(), max_num_seqs=4,
                           catch_up_max=catch_up_max).run()
        assert_solo(real, reqs, solo)
        pred = replay.replay(rec.states, rec.traces, 3, STEP_CLOCK, adaptive=adaptive(),
                             max_num_seqs=4, draft_kv=rec.draft_kv, catch_up_max=catch_up_max)
        assert pred["iterations"] == len(real.iterations), f"seed {seed}"
        assert {c: pred[c] for c in COUNTERS} == {c: getattr(real, c) for c in COUNTERS}, f"seed {seed}"
        per_iteration = sum(i.draft_prefill_tokens + i.catch_up_tokens for i in real.iterations)
        assert per_iteration == real.draft_prefill_tokens + real.draft_catch_up_tokens  # the fit's columns add up
        caught_up += real.draft_catch_up_tokens
    if schedule in ("switching", "off above 1", "off while 1 waits") and not catch_up_max:  # the case this test is for: rows that
        assert caught_up > 0  # skipped drafting catch up, and the replay counted the same tokens


def test_a_schedule_at_k0_everywhere_replays_with_no_draft_work(recorded):
    """Off at every batch size: no draft prefill at join, no catch-up, and with costs that price draft work the
    prediction equals that of a drafter without its own KV; a fixed k on the same record prefills every prompt."""
    _, runs = recorded
    rec = runs[0]
    costs = replay.CostModel([KNOWN[f] for f in replay.FEATURES])
    off = replay.replay(rec.states, rec.traces, 3, costs, lambda b: 0, max_num_seqs=4, draft_kv=True)
    assert all(off[c] == 0 for c in COUNTERS)
    assert off == replay.replay(rec.states, rec.traces, 3, costs, lambda b: 0, max_num_seqs=4, draft_kv=False)
    fixed = replay.replay(rec.states, rec.traces, 3, costs, lambda b: 3, max_num_seqs=4, draft_kv=True)
    assert fixed["draft_prefill_tokens"] == sum(len(s.req.prompt) for s in rec.states)
    assert fixed["output_throughput"] != off["output_throughput"]


# ---- a real serve on the tiny preset (wall clock) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def session():
    from workbench.harness.bench import BenchSession

    return BenchSession.load(preset="tiny", device="cpu")


def test_replay_at_its_own_setting_predicts_a_real_cpu_serve(session):
    """A draft-model serve whose schedule drafts at batch 1 and 3+ and not at 2 (so rows skip drafting, catch up
    and are prefilled lazily), replayed at its own setting with costs fitted on its own iterations: tokens/s within
    10 % (wall-clock iterations on a shared CPU: a stall inside one iteration is spread over all by the fit; here
    it came within 0.5 %), and the draft work simulated within 15 % of what the run did (the arrival interleaving
    on a wall clock is not reproduced exactly; here it was)."""
    from workbench.serving.bench import adaptive_for, serve_bench
    from workbench.serving.config import ServeConfig

    cfg = ServeConfig(method="draft", k=3, rate=40.0, num_requests=12, warmup_requests=2, max_new_tokens=16,
                      max_num_seqs=4, k_by_batch="1:3,2:0,3-4:2")
    res = serve_bench(session, cfg).result
    costs = replay.fit_costs(res.iterations)
    pred = replay.replay(res.states, res.traces, cfg.k, costs, adaptive=adaptive_for(cfg, cfg.k),
                         max_num_seqs=cfg.max_num_seqs, draft_kv=res.draft_kv)
    real = metrics.summarize(res)
    assert res.draft_kv and res.draft_prefill_tokens == 0  # lazily: the schedule is 0 at batch 2
    assert abs(pred["output_throughput"] / real["output_throughput"] - 1) < 0.10
    assert pred["draft_catch_up_tokens"] == pytest.approx(res.draft_catch_up_tokens, rel=0.15)


# ---- held out: a clock whose iterations cost a known function of their work ------------------------------------
class WorkLoop(ServingLoop):
    """Time from work: each iteration lasts `coef` . FEATURES of what it did, in ms, and a step's tokens are stamped
    after its decode phase (the constant, the step, its catch-ups) as on a wall clock; the prefill phase's cost is
    the clock's tick. The work is read from the run's counters around the phases."""

    def __init__(self, *args, coef: dict, **kw):
        super().__init__(*args, clock=StepClock(), **kw)
        self.coef, self.decoded = coef, False

    def cost_s(self, work: replay.Work, whole: bool) -> float:
        ms = sum(self.coef[f] * x for f, x in zip(replay.FEATURES, work.features(replay.FEATURES)))
        return (ms if whole else ms - self.coef["1"]) / 1e3

    def _decode_launch(self, decoding, it, result):
        before, launch = _work(result), self.engine.launch_step

        def timed(live, tokens_host, timer, num_nodes=None, row_nodes=None, lengths=None):
            slots, forwards = (a - b for a, b in zip(_work(result)[4:], before[4:]))
            self.clock.t += self.cost_s(replay.Work(len(live), num_nodes, 0, 0, slots, forwards), whole=True)
            return launch(live, tokens_host, timer, num_nodes=num_nodes, row_nodes=row_nodes, lengths=lengths)

        self.engine.launch_step, self.decoded = timed, True
        try:
            return super()._decode_launch(decoding, it, result)
        finally:
            del self.engine.launch_step

    def _run_prefill(self, planned, result):
        self.before_prefill = _work(result)
        return super()._run_prefill(planned, result)

    def _finish_prefill(self, ran, result):
        tokens = super()._finish_prefill(ran, result)
        forwards, joined_tokens, joins = (a - b for a, b in zip(_work(result)[:3], self.before_prefill[:3]))
        self.clock.dt = self.cost_s(replay.Work(0, 0, tokens, forwards, joined_tokens, joins), whole=not self.decoded)
        self.decoded = False
        return tokens


# a draft model's chain costs its n forwards (no [n > 0] term: a fit on k in {0, 3} could not tell the two apart)
WORK_COSTS = {"1": 1.0, "B": 0.1, "B*n": 0.05, "n": 0.8, "n>0": 0.0, "P": 0.01, "F": 2.0, "D": 0.005, "G": 1.5}


@pytest.mark.parametrize("batch_prefill", [1, 4])
@pytest.mark.parametrize("spread_s", [0.04, 0.004], ids=["spread", "bursty"])
def test_held_out_settings_are_predicted_from_off_and_a_fixed_k(target, solo, batch_prefill, spread_s):
    """Fit on speculation off + fixed k = 3 (their iterations timed by WORK_COSTS), replay a held-out k = 1 and a
    schedule that skips drafting at batch 2 (catch-ups): the fit recovers WORK_COSTS and the replay the real loops'
    tokens/s under the same clock (to 0.5 %), the old model misses by more (it cannot price prefill forwards, the
    draft model's prefill at join, catch-ups or a shorter chain). With prefill forwards of up to 4 rows and bursty
    arrivals (several requests join in one iteration) the replay counts forwards as the loop ran them
    (the run's `ServeResult.tuning`)."""
    rng = random.Random(5)
    reqs = [Request(i, [rng.randrange(64) for _ in range(rng.randint(2, 30))], rng.randint(4, 16),
                    arrival_s=rng.uniform(0.0, spread_s)) for i in range(16)]
    serve = lambda drafter, adaptive=None: WorkLoop(  # noqa: E731
        SpecEngine(target, drafter, EngineConfig(max_new_tokens=64, kv_block_size=BS)), reqs, coef=WORK_COSTS,
        adaptive=adaptive, max_num_seqs=4, tuning=ServeTuning(batch_prefill=batch_prefill)).run()
    off, rec = serve(None), serve(DraftModelDrafter(target, 3))
    assert rec.batch_prefill == max(1, batch_prefill) and rec.tuning.batch_prefill == batch_prefill
    if batch_prefill > 1 and spread_s < 0.01:  # some forward held several rows' chunks
        assert sum(it.prefill_forwards for it in rec.iterations) < len(reqs)
    fit = off.iterations + rec.iterations
    new, old = replay.fit_costs(fit), replay.fit_costs(fit, replay.OLD_FEATURES, nonnegative=False)
    assert new.named() == pytest.approx(WORK_COSTS, rel=1e-6, abs=1e-9) and new.dropped == ("n>0",)
    for ranges in ([(1, 64, 1)], [(1, 1, 3), (2, 2, 0), (3, 64, 2)]):
        real = serve(DraftModelDrafter(target, 3), AdaptiveSpeculation(3, ranges))
        assert_solo(real, reqs, solo)
        errors = {}
        for name, costs in (("new", new), ("old", old)):
            pred = replay.replay(rec.states, rec.traces, 3, costs, adaptive=AdaptiveSpeculation(3, ranges),
                                 max_num_seqs=4, draft_kv=True, tuning=rec.tuning)
            errors[name] = abs(pred["output_throughput"] / metrics.summarize(real)["output_throughput"] - 1)
        assert errors["new"] < 0.005 and errors["old"] > 0.02, (ranges, errors)
