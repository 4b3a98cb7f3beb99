"""Serving under load on one GPU: a rate sweep (light -> saturation) with speculation off, a fixed k and adaptive;
goodput and p99 TPOT per rate; the adaptive schedule's thresholds at +/- 1 (fixed concurrency); replay prediction
error on held-out settings. Writes OUT/results.json and OUT/table.md.

    python scripts/gpu_serving.py --device cuda --preset small --out $OUT
    python scripts/gpu_serving.py --device cpu --preset tiny --num-requests 6 --max-new-tokens 8 --rates 0.5,1 \\
        --out /tmp/serving_smoke                                     # CPU smoke test (seconds)

Saturation is measured first: the request throughput of speculation off at fixed concurrency max_num_seqs; the
sweep's rates are fractions of it (--rates). SLOs for goodput default to 3x / 2x the light-load TTFT / TPOT of
speculation off (printed in the results), unless given.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import settings  # noqa: E402
from workbench.harness.bench import BenchSession  # noqa: E402
from workbench.serving import replay  # noqa: E402
from workbench.serving.bench import serve_bench  # noqa: E402
from workbench.serving.config import ServeConfig  # noqa: E402

SHOW = ["setting", "rate", "request_throughput", "output_throughput", "goodput", "tpot_ms_p99", "ttft_ms_p99",
        "mean_batch_size", "acceptance_rate", "preemptions"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--method", default="draft", choices=("draft", "ngram"))
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--k-by-batch", default="1-4:4,5-8:3,9-16:2,17-64:1",
                   help="adaptive schedule (studies' batch_schedule export: studies.schedule.k_by_batch_text)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--rates", default="0.25,0.5,0.75,1.0,1.5", help="fractions of the measured saturation rate")
    p.add_argument("--slo-ttft-ms", type=float, default=0.0)
    p.add_argument("--slo-tpot-ms", type=float, default=0.0)
    p.add_argument("--cuda-graphs", action="store_true", help="capture graphs per batch bucket (default: eager)")
    p.add_argument("--no-thresholds", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_begin = time.perf_counter()
    dtype = args.dtype if args.device != "cpu" else "float32"
    session = BenchSession.load(preset=args.preset, device=args.device, dtype=dtype)
    base = ServeConfig(method=args.method, k=args.k, max_new_tokens=args.max_new_tokens,
                       num_requests=args.num_requests, warmup_requests=args.warmup_requests,
                       max_num_seqs=args.max_num_seqs, cuda_graphs=args.cuda_graphs,
                       graph_batch_sizes=tuple(b for b in settings.KNOBS["graph_batch_sizes"].default
                                               if b <= args.max_num_seqs) or (1,))
    settings_of = {"off": dict(method="ar"), f"k={args.k}": {}, "adaptive": dict(k_by_batch=args.k_by_batch),
                   "k=2 (held out)": dict(k=2)}
    runs, records = {}, []

    def run(name: str, **kw):
        cfg = replace(base, **settings_of[name], **kw)
        res = serve_bench(session, cfg)
        rec = {key: res.record.get(key) for key in SHOW if key not in ("setting",)}
        rec.update(setting=name, arrival=cfg.arrival, max_concurrency=cfg.max_concurrency,
                   ttft_ms_p50=res.record["ttft_ms_p50"], tpot_ms_p50=res.record["tpot_ms_p50"],
                   acceptance_by_batch_size=res.record["acceptance_by_batch_size"])
        print(json.dumps(rec), flush=True)
        return res, rec

    sat, sat_rec = run("off", arrival="concurrency", max_concurrency=args.max_num_seqs)
    saturation = sat_rec["request_throughput"]
    light, _ = run("off", rate=0.1 * saturation)
    slo_ttft = args.slo_ttft_ms or 3 * light.record["ttft_ms_p50"]
    slo_tpot = args.slo_tpot_ms or 2 * light.record["tpot_ms_p50"]
    base = replace(base, slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot)
    for frac in (float(x) for x in args.rates.split(",")):
        for name in settings_of:
            res, rec = run(name, rate=frac * saturation)
            rec["rate_fraction"] = frac
            records.append(rec)
            runs[(name, frac)] = res
    thresholds = []
    if not args.no_thresholds:
        for lo, hi, k in settings.parse_k_by_batch(args.k_by_batch)[:-1]:
            for c in (hi, hi + 1):
                if c <= args.max_num_seqs:
                    _, rec = run("adaptive", arrival="concurrency", max_concurrency=c)
                    rec["threshold"] = hi
                    thresholds.append(rec)
    # replay: costs fitted on "off" and fixed-k runs; predict the held-out k=2 and adaptive runs from the k traces
    fit = [it for (name, _), r in runs.items() if name in ("off", f"k={args.k}") for it in r.result.iterations]
    costs = replay.fit_costs(fit)
    schedule = settings.parse_k_by_batch(args.k_by_batch)
    sched = lambda b: next((k for lo, hi, k in schedule if lo <= b <= hi), args.k)  # noqa: E731
    errors = []
    for (name, frac), r in runs.items():
        if name not in ("k=2 (held out)", "adaptive"):
            continue
        rec_run = runs[(f"k={args.k}", frac)].result
        pred = replay.replay(rec_run.states, rec_run.traces, args.k, costs,
                             (lambda b: 2) if name.startswith("k=2") else sched, max_num_seqs=args.max_num_seqs)
        real = r.record["output_throughput"]
        errors.append({"setting": name, "rate_fraction": frac, "real_output_throughput": real,
                       "predicted_output_throughput": pred["output_throughput"],
                       "error": pred["output_throughput"] / real - 1 if real else None,
                       "real_tpot_ms_p99": r.record["tpot_ms_p99"], "predicted_tpot_ms_p99": pred["tpot_ms_p99"]})
    result = {"preset": args.preset, "device": str(session.device), "dtype": dtype, "method": args.method, "k": args.k,
              "k_by_batch": args.k_by_batch, "saturation_request_throughput": saturation, "slo_ttft_ms": slo_ttft,
              "slo_tpot_ms": slo_tpot, "sweep": records, "thresholds": thresholds,
              "replay_costs": dict(zip(replay.FEATURES, costs.coef)), "replay": errors,
              "wall_s": time.perf_counter() - t_begin}
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "table.md").write_text(table(result))
    print(table(result))
    return 0


def _f(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def table(r: dict) -> str:
    lines = [f"# Serving sweep: {r['preset']} on {r['device']} ({r['dtype']}), {r['method']} k={r['k']}, adaptive "
             f"{r['k_by_batch']}", "",
             f"saturation (off, concurrency = max_num_seqs): {_f(r['saturation_request_throughput'], 2)} req/s; "
             f"SLOs TTFT <= {_f(r['slo_ttft_ms'])} ms, TPOT <= {_f(r['slo_tpot_ms'])} ms", "",
             "| rate (x sat) | setting | req/s | out tok/s | goodput | p99 TPOT ms | p99 TTFT ms | batch | accept |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in r["sweep"]:
        lines.append(f"| {x['rate_fraction']} | {x['setting']} | {_f(x['request_throughput'], 2)} | "
                     f"{_f(x['output_throughput'])} | {_f(x['goodput'], 2)} | {_f(x['tpot_ms_p99'])} | "
                     f"{_f(x['ttft_ms_p99'])} | {_f(x['mean_batch_size'])} | {_f(x['acceptance_rate'], 2)} |")
    if r["thresholds"]:
        lines += ["", "Adaptive schedule at each threshold and threshold + 1 (fixed concurrency):", "",
                  "| threshold | concurrency | out tok/s | p99 TPOT ms | batch |", "|---|---|---|---|---|"]
        for x in r["thresholds"]:
            lines.append(f"| {x['threshold']} | {x['max_concurrency']} | {_f(x['output_throughput'])} | "
                         f"{_f(x['tpot_ms_p99'])} | {_f(x['mean_batch_size'])} |")
    lines += ["", "Replay (costs fitted on off + fixed k; acceptance from the fixed-k traces):", "",
              "| setting | rate (x sat) | real tok/s | predicted | error | real p99 TPOT | predicted |",
              "|---|---|---|---|---|---|---|"]
    for e in r["replay"]:
        lines.append(f"| {e['setting']} | {e['rate_fraction']} | {_f(e['real_output_throughput'])} | "
                     f"{_f(e['predicted_output_throughput'])} | {_f(100 * e['error'] if e['error'] is not None else None)} % | "
                     f"{_f(e['real_tpot_ms_p99'])} | {_f(e['predicted_tpot_ms_p99'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
