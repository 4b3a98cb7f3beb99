"""Serving metrics, named as `vllm bench serve` names them (over the measured requests only).

- request_throughput = completed requests / duration; output_throughput = their output tokens / duration;
  total_token_throughput = (prompt + output tokens) / duration; duration = first measured arrival -> last measured
  completion;
- TTFT = first token - arrival (queue time included, as a client sees it); queue time = admission - arrival;
- TPOT = (completion - first token) / (output tokens - 1), per request (requests of one token have none);
- ITL = gaps between successive emissions to a request (a speculative step emits several tokens at once, so ITL
  counts events, not tokens: vLLM's convention for chunks);
- E2EL = completion - arrival;
- goodput = requests meeting every SLO given (TTFT <= slo_ttft_ms, TPOT <= slo_tpot_ms) / duration (vLLM's
  `request_goodput`); with no SLO it equals request_throughput;
- kv_cache_util = blocks referenced by live rows / pool, per iteration (mean, max); prefix_hit_rate = prompt tokens
  found in cached blocks / prompt tokens looked up at admission; mean_batch_size = decoding rows per decode step;
- acceptance by batch size / by context length = accepted / drafted draft tokens of the steps with that live batch
  size / of rows whose context falls in that bin (bins of `context_bin` tokens);
- drain_s = last measured completion - last measured arrival (the tail once no request arrives any more);
  drain_output_share = the measured requests' output tokens emitted in that tail (at or after the last arrival:
  first tokens by their time, a step's tokens by its iteration's end) / all their output tokens. A run above
  saturation ends in a long tail of shrinking batches, where drafting pays more than at a full batch: its
  output_throughput mixes both regimes;
- arrival_window_output_throughput = the measured requests' output tokens emitted before the last arrival /
  (last measured arrival - first measured arrival): the output rate while requests still arrive, with the drain
  left out (None when every request arrives at once).
"""
from __future__ import annotations

import json

import pandas as pd

from workbench.harness.metrics import percentile
from workbench.serving.loop import ServeResult

CONTEXT_BIN = 64


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _pcts(name: str, xs: list[float]) -> dict:
    return {f"{name}_mean": _mean(xs), f"{name}_p50": percentile(xs, 50), f"{name}_p90": percentile(xs, 90),
            f"{name}_p99": percentile(xs, 99)}


def request_rows(result: ServeResult) -> pd.DataFrame:
    """One row per request (warm-up ones with measured = False): the per-request table stored beside the run."""
    rows = []
    for s in result.states:
        n = len(s.output)
        gaps = [(b - a) * 1e3 for a, b in zip(s.emit_times, s.emit_times[1:])]
        rows.append({"request": s.req.id, "measured": s.req.measured, "prompt_len": len(s.req.prompt),
                     "output_len": n, "arrival_s": s.t_arrival, "preemptions": s.preemptions,
                     "prefix_hit_tokens": s.prefix_hit_tokens, "steps": s.steps,
                     "queue_ms": (s.t_admitted - s.t_arrival) * 1e3,
                     "ttft_ms": (s.t_first_token - s.t_arrival) * 1e3,
                     "tpot_ms": (s.t_done - s.t_first_token) * 1e3 / (n - 1) if n > 1 else None,
                     "e2el_ms": (s.t_done - s.t_arrival) * 1e3, "itl_ms_mean": _mean(gaps),
                     "acceptance_rate": s.accepted / s.drafted if s.drafted else None})
    return pd.DataFrame(rows)


def summarize(result: ServeResult, slo_ttft_ms: float = 0.0, slo_tpot_ms: float = 0.0,
              context_bin: int = CONTEXT_BIN) -> dict:
    measured = [s for s in result.states if s.req.measured]
    ids = {s.req.id for s in measured}
    start = min(s.t_arrival for s in measured)
    duration = max(s.t_done for s in measured) - start
    out_tokens = sum(len(s.output) for s in measured)
    ttft = [(s.t_first_token - s.t_arrival) * 1e3 for s in measured]
    tpot = [(s.t_done - s.t_first_token) * 1e3 / (len(s.output) - 1) for s in measured if len(s.output) > 1]
    itl = [(b - a) * 1e3 for s in measured for a, b in zip(s.emit_times, s.emit_times[1:])]
    e2el = [(s.t_done - s.t_arrival) * 1e3 for s in measured]
    queue = [(s.t_admitted - s.t_arrival) * 1e3 for s in measured]

    def good(s) -> bool:
        n = len(s.output)
        tp = (s.t_done - s.t_first_token) * 1e3 / (n - 1) if n > 1 else 0.0
        return (not slo_ttft_ms or (s.t_first_token - s.t_arrival) * 1e3 <= slo_ttft_ms) and \
            (not slo_tpot_ms or tp <= slo_tpot_ms)

    its = [i for i in result.iterations if i.t_end > start]  # the measured window (warm-up iterations left out)
    steps = [i for i in its if i.batch_size]
    tr = [t for t in result.traces if t.request in ids]
    drafted = sum(t.drafted for t in tr)
    accepted = sum(t.accepted for t in tr)
    by_bs: dict[int, list[int]] = {}
    by_ctx: dict[int, list[int]] = {}
    for t in tr:
        for table, key in ((by_bs, t.batch_size), (by_ctx, t.context_len // context_bin * context_bin)):
            cell = table.setdefault(key, [0, 0])
            cell[0] += t.accepted
            cell[1] += t.drafted
    rate = lambda table: json.dumps({str(k): (a / d if d else None) for k, (a, d) in sorted(table.items())})  # noqa
    last_arrival = max(s.t_arrival for s in measured)
    drained = sum(t.emitted for t in tr if result.iterations[t.step].t_end >= last_arrival) + \
        sum(1 for s in measured if s.output and s.t_first_token is not None and s.t_first_token >= last_arrival)
    pairs = len(tr)
    rec = {
        "completed": len(measured), "duration_s": duration,
        "request_throughput": len(measured) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (out_tokens + sum(len(s.req.prompt) for s in measured)) / duration
        if duration > 0 else None,
        "goodput": sum(good(s) for s in measured) / duration if duration > 0 else None,
        **_pcts("ttft_ms", ttft), **_pcts("tpot_ms", tpot), **_pcts("itl_ms", itl), **_pcts("e2el_ms", e2el),
        "queue_ms_mean": _mean(queue), "queue_ms_p50": percentile(queue, 50), "queue_ms_p99": percentile(queue, 99),
        "preemptions": result.preemptions,
        "kv_cache_util_mean": _mean([i.used_blocks / result.num_blocks for i in its]),
        "kv_cache_util_max": max((i.used_blocks / result.num_blocks for i in its), default=None),
        "prefix_hit_rate": result.prefix_hit_rate,
        "mean_batch_size": _mean([i.batch_size for i in steps]),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_tokens": (accepted + pairs) / pairs if pairs else None,
        "acceptance_by_batch_size": rate(by_bs), "acceptance_by_context": rate(by_ctx),
        "total_new_tokens": out_tokens, "target_steps": len(steps),
        "tree_size_mean": drafted / pairs if pairs else None,
        "accepted_path_length_mean": accepted / pairs if pairs else None,
        "tokens_per_s": out_tokens / duration if duration > 0 else None,
        "ttft_ms": percentile(ttft, 50),
        "drain_s": max(s.t_done for s in measured) - last_arrival,
        "drain_output_share": drained / out_tokens if out_tokens else None,
        "arrival_window_output_throughput": (out_tokens - drained) / (last_arrival - start)
        if last_arrival > start else None,
    }
    for phase, ms in result.phase_ms.items():
        if phase in ("draft", "verify", "accept", "kv", "prefill"):
            rec[f"time_{phase}_ms"] = ms
    return rec
