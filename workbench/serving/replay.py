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

from collections import deque
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


def replay(requests, traces, recorded_k: int, costs: CostModel, schedule=None, *, max_num_seqs: int = 16,
           adaptive=None, prefill_chunk: int = 0, slo_ttft_ms: float = 0.0, slo_tpot_ms: float = 0.0) -> dict:
    """requests: RequestState-like (req.id, req.prompt, req.max_new_tokens, t_arrival, req.measured) of the recorded
    run; schedule(batch_size) -> draft length (<= recorded_k), or `adaptive` (an AdaptiveSpeculation: its batch
    schedule, switch-off by acceptance and context limit per row, as the serving loop applies them; the step verifies
    the largest row k). prefill_chunk: prompt tokens prefilled per iteration, oldest admitted first (0 = whole
    prompts in the admitting iteration); a request decodes from the iteration after its prefill completes, as in the
    loop. Not modelled: the KV block pool (no preemption, no admission by blocks) and prefix reuse. Returns predicted
    vLLM-named metrics (goodput under the SLOs as `metrics.summarize` counts it)."""
    from types import SimpleNamespace

    runs = match_lengths(traces, recorded_k)
    order = sorted(requests, key=lambda s: (s.t_arrival, s.req.id))
    t, i = 0.0, 0
    waiting, prefilling, live = [], [], []  # prefilling: [state, prompt tokens left]; live: [state, pos, first_t]
    done: dict[int, tuple] = {}  # id -> (arrival, first token, done, output tokens, measured)
    row_state: dict[int, SimpleNamespace] = {}  # per request: the adaptive rules' state (spec_off, window)
    while i < len(order) or waiting or prefilling or live:
        while i < len(order) and order[i].t_arrival <= t:
            waiting.append(order[i])
            i += 1
        if not waiting and not prefilling and not live:
            t = order[i].t_arrival
            continue
        while waiting and len(live) + len(prefilling) < max_num_seqs:
            s = waiting.pop(0)
            prefilling.append([s, len(s.req.prompt)])
        b = len(live)
        batch_k = (adaptive.batch_k(b) if adaptive is not None else schedule(b)) if b else 0
        batch_k = min(batch_k, recorded_k)
        row_ks = []
        for s, pos, _ in live:
            if adaptive is None:
                row_ks.append(batch_k)
                continue
            st = row_state.setdefault(s.req.id, SimpleNamespace(spec_off=False, window=deque(maxlen=1)))
            row_ks.append(adaptive.row_k(st, len(s.req.prompt) + pos, batch_k))
        nodes = max(row_ks, default=0)
        budget, prefill_tokens, finished = prefill_chunk or float("inf"), 0, []
        for item in prefilling:  # oldest admitted first
            take = min(item[1], budget)
            item[1] -= take
            budget -= take
            prefill_tokens += take
            if item[1] == 0:
                finished.append(item[0])
            if budget <= 0:
                break
        t += costs.ms(b, nodes, prefill_tokens) / 1e3
        still = []
        for (s, pos, t_first), k in zip(live, row_ks):
            acc = min(k, _match_at(runs.get(s.req.id, []), pos))
            if adaptive is not None and k:
                adaptive.record(row_state[s.req.id], acc, k)
            pos += acc + 1
            if pos >= s.req.max_new_tokens:
                done[s.req.id] = (s.t_arrival, t_first, t, s.req.max_new_tokens, s.req.measured)
            else:
                still.append([s, pos, t_first])
        prefilling = [item for item in prefilling if item[1] > 0]
        for s in finished:
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
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99)}
