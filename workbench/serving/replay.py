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

Step cost. `fit_costs` fits ms per iteration = c0 + c1 B + c2 B n + c3 P + c4 [n > 0] by least squares over measured
iterations (B decoding rows, n draft nodes verified per row, P prefill tokens), where graph buckets and the drafter's
forwards end up in the constants. Replay then walks the same arrivals through a simplified loop (a row per request
up to max_num_seqs, whole-prompt prefill in the admitting iteration, no block limit) and returns the vLLM-named
figures of `metrics.summarize` that it can predict.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.harness.metrics import percentile

FEATURES = ("1", "B", "B*n", "P", "n>0")


@dataclass
class CostModel:
    coef: list[float]  # one per FEATURES

    def ms(self, batch: int, nodes: int, prefill: int) -> float:
        x = (1.0, batch, batch * nodes, prefill, 1.0 if nodes else 0.0)
        return max(0.0, float(np.dot(self.coef, x)))


def fit_costs(iterations) -> CostModel:
    """iterations: IterationLog-like objects (batch_size, num_nodes, prefill_tokens, t_start, t_end), from any runs."""
    xs = [(1.0, i.batch_size, i.batch_size * i.num_nodes, i.prefill_tokens, 1.0 if i.num_nodes else 0.0)
          for i in iterations]
    ys = [(i.t_end - i.t_start) * 1e3 for i in iterations]
    coef, *_ = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)
    return CostModel([float(c) for c in coef])


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


def replay(requests, traces, recorded_k: int, costs: CostModel, schedule, *, max_num_seqs: int = 16) -> dict:
    """requests: RequestState-like (req.id, req.prompt, req.max_new_tokens, t_arrival, req.measured) of the recorded
    run; schedule(batch_size) -> draft length (<= recorded_k). Returns predicted vLLM-named metrics."""
    runs = match_lengths(traces, recorded_k)
    order = sorted(requests, key=lambda s: (s.t_arrival, s.req.id))
    t, i = 0.0, 0
    waiting, live = [], []  # live: [state, position, first_token_t]
    done: dict[int, tuple] = {}  # id -> (arrival, first token, done, output tokens, measured)
    while i < len(order) or waiting or live:
        while i < len(order) and order[i].t_arrival <= t:
            waiting.append(order[i])
            i += 1
        if not waiting and not live:
            t = order[i].t_arrival
            continue
        admitted = []
        while waiting and len(live) + len(admitted) < max_num_seqs:
            admitted.append(waiting.pop(0))
        b = len(live)
        k = min(schedule(b), recorded_k) if b else 0
        t += costs.ms(b, k, sum(len(s.req.prompt) for s in admitted)) / 1e3
        still = []
        for s, pos, t_first in live:
            pos += min(k, _match_at(runs.get(s.req.id, []), pos)) + 1
            if pos >= s.req.max_new_tokens:
                done[s.req.id] = (s.t_arrival, t_first, t, s.req.max_new_tokens, s.req.measured)
            else:
                still.append([s, pos, t_first])
        for s in admitted:
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
    return {"output_throughput": tokens / dur if dur > 0 else None, "request_throughput": len(rows) / dur
            if dur > 0 else None, "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99)}
