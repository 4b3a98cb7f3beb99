"""What-if replay: predict a serving run's throughput and latency for settings not run, from one run's recorded
acceptance traces and a step-cost curve fitted to measured iterations.

Acceptance oracle. A run at draft length k records, per request and decode step, the output position p (tokens
emitted before the step) and the accepted count a. For greedy chains the drafts from any position inside an
accepted run continue the same chain, so the *match length* from p is a when a < k (the next draft token was
wrong), and, when all k were accepted, k + 1 + the match length at the next recorded position (the bonus token
is the target's own; what the drafter would have guessed there is approximated by what it guessed next). From a
position p' inside a recorded run starting at p the match length is L(p) - (p' - p). A replayed step at draft length
k' <= k accepts min(k', L) tokens. Exact for greedy draft models where a < k; an approximation otherwise (n-gram
lookups, full acceptance) - the prediction error against real runs says how good.

Step cost. `fit_costs` fits ms per iteration as a linear function of what the iteration did (`FEATURES`):
    ms = c0 + c1 B + c2 B n + c3 n + c4 [n > 0] + c5 P + c6 F + c7 D + c8 G
by least squares over measured iterations: B decoding rows, n draft nodes verified per row (a draft model runs n
forwards for them), P target prefill tokens in F forwards (of up to ServeTuning.batch_prefill request chunks), and
the draft model's work outside its chain: D positions written in G forwards, by the draft prefill when a request joins
where every step drafts and by catch-up forwards (rows x T, padding included) before a row that skipped drafting drafts
again. Draft prefill and catch-up share c7 and c8 (the same kind of work: a draft-model forward over T positions
outside the chain's graphs), so a fit on runs that never catch up (speculation off and a fixed k) still prices the
catch-ups of a schedule with k = 0 at some batch sizes. Graph buckets end up in the constants. A column the measured
iterations cannot tell apart from the columns before it in FEATURES order is dropped (coefficient 0, named in
`CostModel.dropped`): one that is all zero (no draft model: D, G; no catch-up and no prefill at join), or a multiple
of earlier ones (n = k [n > 0] when every drafting step of the fit verified k nodes: n is kept, so a shorter held-out
k costs fewer draft forwards - a prior, not a measurement: phase times on the H200 put the draft
phase about half per node, half per step, a CPU's tiny models nearly all per step; iterations that verify other
lengths, such as the loop calibration's, tell the two apart). Coefficients are fitted >= 0 (`nnls`). `OLD_FEATURES` is
the model from before the prefill forwards and the draft-side work were counted, kept so that scripts/gpu_serving.py
can report both fits' errors on one run.

Replay then walks the same arrivals through a simplified loop (a row per request up to max_num_seqs, prefill of up
to prefill_chunk tokens per iteration oldest admitted first, a request decoding from the iteration after its prefill
completes, the draft model's prefill at join and catch-ups as `ServingLoop` does them, no block limit) and returns
the vLLM-named figures of `metrics.summarize` that it can predict, and the draft-side work it simulated.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from workbench.harness.metrics import percentile
from workbench.serving.adaptive import AdaptiveSpeculation
from workbench.serving.loop import catch_up_groups
from workbench.serving.tuning import ServeTuning

FEATURES = ("1", "B", "B*n", "n", "n>0", "P", "F", "D", "G")
OLD_FEATURES = ("1", "B", "B*n", "P", "n>0")  # c0 + c1 B + c2 B n + c3 P + c4 [n > 0]: no forwards, no draft work
# FEATURES with [n > 0] before n: where the fit's drafting steps all verified one length (n = k [n > 0]), the draft
# phase's cost is kept per step instead of per node, the other end of the prior in the module docstring. A held-out
# shorter k is then charged the full k's draft cost; the per-node fit charges it in proportion. The two predictions
# bound what the fit cannot tell (scripts/gpu_serving.py reports both; the per-node fit tends to overpredict a
# held-out shorter k past saturation).
PER_STEP_FEATURES = ("1", "B", "B*n", "n>0", "n", "P", "F", "D", "G")


@dataclass(frozen=True)
class Work:
    """What one iteration did, as the cost model reads it."""
    batch: int  # B: decoding rows of the step (0: no step)
    nodes: int  # n: draft nodes verified per row (0: autoregressive or no step)
    prefill_tokens: int = 0  # P: target prefill tokens
    prefill_forwards: int = 0  # F: target prefill forwards (each of up to tuning.batch_prefill request chunks)
    draft_tokens: int = 0  # D: draft-model positions written outside the chain (prefill at join + catch-up slots)
    draft_forwards: int = 0  # G: those forwards

    @classmethod
    def of(cls, it) -> Work:
        """From an IterationLog (one recorded before the work counters existed counts none of them)."""
        get = lambda name: getattr(it, name, 0)  # noqa: E731
        return cls(it.batch_size, it.num_nodes, it.prefill_tokens, get("prefill_forwards"),
                   get("draft_prefill_tokens") + get("catch_up_slots"),
                   get("draft_prefills") + get("catch_up_forwards"))

    def features(self, names) -> list[float]:
        values = {"1": 1, "B": self.batch, "B*n": self.batch * self.nodes, "n": self.nodes, "n>0": self.nodes > 0,
                  "P": self.prefill_tokens, "F": self.prefill_forwards, "D": self.draft_tokens,
                  "G": self.draft_forwards}
        return [float(values[n]) for n in names]


@dataclass
class CostModel:
    coef: list[float]  # ms per unit of each feature
    features: tuple[str, ...] = FEATURES
    dropped: tuple[str, ...] = ()  # features the fit's iterations could not tell apart (their coef is 0)

    def ms(self, work: Work) -> float:
        return max(0.0, float(np.dot(self.coef, work.features(self.features))))

    def named(self) -> dict[str, float]:
        return dict(zip(self.features, self.coef))


def fit_costs(iterations, features: tuple[str, ...] = FEATURES, nonnegative: bool = True) -> CostModel:
    """iterations: IterationLog-like objects (t_start, t_end in s; the work `Work.of` reads), from any runs.
    Least squares of ms per iteration on `features` (a subset of FEATURES, in order of preference), after dropping
    the columns `independent_columns` finds dependent; nonnegative: every coefficient >= 0 (`nnls`: each feature is
    work that costs time; unconstrained, correlated columns such as P and F, or D and P, trade costs of opposite
    signs that cancel on the fit's iterations and not on a held-out setting's). nonnegative False is plain least
    squares (the fit before draft-side work was counted). ValueError for no iterations or an unknown feature."""
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown cost feature(s) {unknown}: choose from {FEATURES}")
    its = list(iterations)
    if not its:
        raise ValueError("fit_costs needs measured iterations (ServeResult.iterations of a served run); got none")
    x = np.array([Work.of(i).features(features) for i in its])  # [iterations, features]
    y = np.array([(i.t_end - i.t_start) * 1e3 for i in its])  # [iterations] ms
    keep = independent_columns(x)
    coef = np.zeros(len(features))
    if keep:
        coef[keep] = nnls(x[:, keep], y) if nonnegative else np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
    return CostModel([float(c) for c in coef], tuple(features),
                     tuple(f for j, f in enumerate(features) if j not in keep))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson-Hanson active set), a [rows, cols] with independent columns,
    b [rows]; columns are scaled to unit norm inside (the tolerance is then one for all).

    >>> nnls(np.array([[1., 0.], [0., 1.], [1., 1.]]), np.array([2., -1., 1.]))  # unconstrained: (2, -1)
    array([1.5, 0. ])
    """
    scale = np.linalg.norm(a, axis=0)
    a = a / scale
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 1e-10 * max(1.0, float(np.linalg.norm(b)))
    for _ in range(3 * n + 10):  # each outer step adds a column; inner steps only remove
        grad = a.T @ (b - a @ x)
        if passive.all() or grad[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            gap = x[neg] - z[neg]  # >= 0; 0 only where both are 0 (then the column just leaves)
            step = np.min(np.where(gap > 0, x[neg] / np.where(gap > 0, gap, 1.0), 0.0))
            x = x + step * (z - x)
            passive &= x > 1e-12
            x[~passive] = 0.0
    return x / scale


def independent_columns(x: np.ndarray, tol: float = 1e-6) -> list[int]:
    """Indices of the columns of x [rows, cols] kept left to right: each whose part orthogonal to the columns kept
    before it is more than `tol` of its norm (so an all-zero column, or a multiple of earlier ones, is dropped).

    >>> independent_columns(np.array([[1., 0., 2., 4.], [1., 0., 2., 0.], [1., 0., 2., 4.]]))  # zero; 2 x the first
    [0, 3]
    """
    basis: list[np.ndarray] = []
    keep = []
    for j in range(x.shape[1]):
        col = x[:, j].astype(float)
        norm = np.linalg.norm(col)
        if norm == 0:
            continue
        rest = col.copy()
        for _ in range(2):  # twice: Gram-Schmidt loses orthogonality once
            for q in basis:
                rest -= np.dot(q, rest) * q
        if np.linalg.norm(rest) > tol * norm:
            basis.append(rest / np.linalg.norm(rest))
            keep.append(j)
    return keep


def match_lengths(traces, k: int) -> dict[int, list[tuple[int, int]]]:
    """traces: StepTrace-like rows of one run at draft length k -> per request, [(position, match length)] sorted."""
    by_req: dict[int, list] = {}
    for t in traces:
        by_req.setdefault(t.request, []).append(t)
    out = {}
    for req, rows in by_req.items():
        rows.sort(key=lambda t: t.step)
        pos, steps = 1, []  # the prefill emitted token 1
        for t in rows:
            steps.append((pos, t.accepted))
            pos += t.accepted + 1
        lengths = [0] * len(steps)
        for i in range(len(steps) - 1, -1, -1):
            a = steps[i][1]
            lengths[i] = a if a < k or i == len(steps) - 1 else k + 1 + lengths[i + 1]
        out[req] = [(p, n) for (p, _), n in zip(steps, lengths)]
    return out


def _match_at(runs: list[tuple[int, int]], pos: int) -> int:
    best = 0
    for p, n in runs:
        if p > pos:
            break
        best = max(0, n - (pos - p))
    return best


def replay(requests, traces, recorded_k: int, costs: CostModel, schedule=None, *, max_num_seqs: int = 16,
           adaptive=None, prefill_chunk: int = 0, draft_kv: bool = False, catch_up_max: int = 0,
           slo_ttft_ms: float = 0.0, slo_tpot_ms: float = 0.0, tuning: ServeTuning = ServeTuning()) -> dict:
    """requests: RequestState-like (req.id, req.prompt, req.max_new_tokens, t_arrival, req.measured) of the recorded
    run; schedule(batch_size) -> draft length (<= recorded_k), or `adaptive` (an AdaptiveSpeculation: its batch
    schedule, switch-off by acceptance and context limit per row, as the serving loop applies them; the step verifies
    the largest row k). prefill_chunk: prompt tokens prefilled per iteration, oldest admitted first (0 = whole
    prompts in the admitting iteration); a request decodes from the iteration after its prefill completes, as in the
    loop. draft_kv: the drafter keeps its own KV (a draft model; `ServeResult.draft_kv`): as in the loop, it is
    prefilled when a request's prefill completes if every step drafts (`AdaptiveSpeculation.drafts_always`), else
    left empty, and before a row drafts the positions it misses are caught up (grouped by `catch_up_groups`; with
    catch_up_max > 0 a row more than that many generated tokens behind stays autoregressive). tuning: the recorded
    run's loop tuning (`ServeResult.tuning`): an iteration's prefill chunks run in forwards of up to its batch_prefill
    rows, as in the loop (0 or 1: a forward per chunk). Not modelled: the KV block pool (no preemption, no admission
    by blocks), prefix reuse, and what runs beside a step in flight (overlap_prefill, full_overlap: the costs fitted
    on the recorded run's iterations carry them on average).

    Returns predicted vLLM-named metrics (goodput under the SLOs as `metrics.summarize` counts it; times in ms,
    throughputs per s) and the simulated work over every request, warm-up ones too, named as `ServeResult` counts it:
    iterations, draft_prefill_tokens, draft_catch_up_tokens / _forwards / _slots / _skips."""
    if adaptive is None:
        if schedule is None:
            raise ValueError("replay needs schedule(batch_size) -> k or an AdaptiveSpeculation (adaptive=)")
        adaptive = AdaptiveSpeculation(recorded_k, [(b, b, schedule(b)) for b in range(1, max_num_seqs + 1)])
    runs = match_lengths(traces, recorded_k)
    at_join = draft_kv and adaptive.drafts_always(max_num_seqs)  # the loop's _prefill_draft_at_join
    order = sorted(requests, key=lambda s: (s.t_arrival, s.req.id))
    t, i = 0.0, 0
    waiting, prefilling, live = [], [], []  # prefilling: [state, prompt tokens left]; live: [state, pos, first_t]
    done: dict[int, tuple] = {}  # id -> (arrival, first token, done, output tokens, measured)
    row_state: dict[int, SimpleNamespace] = {}  # per request: the adaptive rules' state (spec_off, window)
    valid: dict[int, int] = {}  # per request: positions below which the draft model's KV is valid (draft_kv)
    count = dict.fromkeys(("iterations", "draft_prefill_tokens", "draft_catch_up_tokens", "draft_catch_up_forwards",
                           "draft_catch_up_slots", "draft_catch_up_skips"), 0)
    while i < len(order) or waiting or prefilling or live:
        while i < len(order) and order[i].t_arrival <= t:
            waiting.append(order[i])
            i += 1
        if not waiting and not prefilling and not live:
            t = order[i].t_arrival
            continue
        count["iterations"] += 1
        while waiting and len(live) + len(prefilling) < max_num_seqs:
            s = waiting.pop(0)
            prefilling.append([s, len(s.req.prompt)])
        # decode: the rows' draft lengths, then (draft model) the catch-up of the rows that draft
        contexts = [len(s.req.prompt) + pos - 1 for s, pos, _ in live]  # the loop's: committed tokens before the root
        batch_k = min(adaptive.batch_k(len(live), len(waiting)), recorded_k) if live else 0
        ks = [adaptive.row_k(row_state[s.req.id], c, batch_k) for (s, _, _), c in zip(live, contexts)]
        if draft_kv and catch_up_max and any(ks):
            for j, ((s, _, _), c) in enumerate(zip(live, contexts)):
                if ks[j] and c - 1 - max(valid[s.req.id], len(s.req.prompt)) > catch_up_max:
                    ks[j] = 0
                    count["draft_catch_up_skips"] += 1
        nodes = max(ks, default=0)
        draft_tokens = draft_forwards = 0
        if nodes and draft_kv:
            behind = [(s.req.id, valid[s.req.id], c - 1) for (s, _, _), c, k in zip(live, contexts, ks)
                      if k and valid[s.req.id] < c - 1]
            for group in catch_up_groups([end - start for _, start, end in behind]):
                gaps = [behind[g][2] - behind[g][1] for g in group]
                count["draft_catch_up_tokens"] += sum(gaps)
                count["draft_catch_up_forwards"] += 1
                count["draft_catch_up_slots"] += len(group) * max(gaps)
                draft_tokens += len(group) * max(gaps)
                draft_forwards += 1
                for g in group:
                    valid[behind[g][0]] = behind[g][2]
        current = [valid.get(s.req.id, 0) >= c - 1 for (s, _, _), c in zip(live, contexts)]
        # prefill: up to prefill_chunk tokens, oldest admitted first; a completed one's draft model at join
        budget, prefill_tokens, prefill_forwards, finished = prefill_chunk or math.inf, 0, 0, []
        for item in prefilling:
            if budget <= 0:
                break
            take = min(item[1], budget)
            item[1] -= take
            budget -= take
            prefill_tokens += take
            prefill_forwards += 1  # chunks here; forwards of up to batch_prefill chunks below
            if item[1] == 0:
                finished.append(item[0])
                if at_join:
                    draft_tokens += len(item[0].req.prompt)
                    draft_forwards += 1
                    count["draft_prefill_tokens"] += len(item[0].req.prompt)
        prefill_forwards = math.ceil(prefill_forwards / max(1, tuning.batch_prefill))
        t += costs.ms(Work(len(live), nodes, prefill_tokens, prefill_forwards, draft_tokens, draft_forwards)) / 1e3
        still = []
        for (s, pos, t_first), k, cur in zip(live, ks, current):
            acc = min(k, _match_at(runs.get(s.req.id, []), pos))
            if k:
                adaptive.record(row_state[s.req.id], acc, k)
            pos += acc + 1
            if nodes and draft_kv and cur:  # the chain fed [t_(L-1), root] and its drafts (the last one unless
                root = len(s.req.prompt) + pos - 1  # all were accepted); a row still behind keeps its hole
                valid[s.req.id] = root if acc < nodes else root - 1
            if pos >= s.req.max_new_tokens:
                done[s.req.id] = (s.t_arrival, t_first, t, s.req.max_new_tokens, s.req.measured)
            else:
                still.append([s, pos, t_first])
        prefilling = [item for item in prefilling if item[1] > 0]
        for s in finished:
            valid[s.req.id] = len(s.req.prompt) if at_join else 0
            row_state[s.req.id] = SimpleNamespace(spec_off=False, window=deque(maxlen=1))
            if s.req.max_new_tokens <= 1:
                done[s.req.id] = (s.t_arrival, t, t, 1, s.req.measured)
            else:
                still.append([s, 1, t])
        live = still
    rows = [v for v in done.values() if v[4]]
    start, end = min(r[0] for r in rows), max(r[2] for r in rows)
    tokens = sum(r[3] for r in rows)
    tpot = [(r[2] - r[1]) * 1e3 / (r[3] - 1) for r in rows if r[3] > 1]
    ttft = [(r[1] - r[0]) * 1e3 for r in rows]
    dur = end - start
    good = sum(1 for r in rows if (not slo_ttft_ms or (r[1] - r[0]) * 1e3 <= slo_ttft_ms)
               and (not slo_tpot_ms or r[3] <= 1 or (r[2] - r[1]) * 1e3 / (r[3] - 1) <= slo_tpot_ms))
    return {"goodput": good / dur if dur > 0 else None, "output_throughput": tokens / dur if dur > 0 else None,
            "request_throughput": len(rows) / dur if dur > 0 else None, "tpot_ms_p50": percentile(tpot, 50),
            "tpot_ms_p99": percentile(tpot, 99),
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99), **count}
