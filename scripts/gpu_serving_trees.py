"""Trees and beams served under load beside AR and the chains: output tokens/s and p50 TPOT at fractions of the
saturation rate, with their spread over rounds (issue 40's "served under load" goal).

    python scripts/gpu_serving_trees.py --device cuda --preset small --out $OUT/serving_trees
    python scripts/gpu_serving_trees.py --device cpu --preset tiny --num-requests 4 --max-new-tokens 6 --repeats 1 \\
        --max-num-seqs 2 --rates 1 --out /tmp/st          # CPU smoke run (tests/test_gpu_serving_trees.py)

One process, one BenchSession, one engine per method (kept across runs; graphs captured before each run's clock, by
serve_bench). Parts:
  warm-up     one untimed closed-loop run per method (first-run costs, compile, captures)
  saturation  AR's request throughput at concurrency --max-num-seqs; the sweep's rates are --rates fractions of it
  sweep       Poisson arrivals at each rate, every method, --repeats rounds (round r: arrival seed r, the same arrivals
              for every method), methods interleaved within a round
A method written METHOD+cal (e.g. eagle+cal) serves METHOD with adaptive speculation: its warm-up run measures the
schedule on its engine (`calibration step`: tree on or off per batch size, by measured tokens per ms), and every timed
run serves with that schedule fixed (`k_by_batch`; the table names it).
Per (rate, method): output tokens/s and p50 TPOT / TTFT, median [min, max] over rounds, output tokens/s over AR's of
the same round (median of the paired ratios), mean accepted tokens per step, and greedy_matches_solo (the first
round's run checks --greedy-check-requests requests against their solo greedy output; bf16 may flip near-ties).
Output: results.json and table.md in --out, rewritten after every run; --budget-s stops cleanly.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.harness.bench import BenchSession  # noqa: E402
from workbench.serving.adaptive import format_k_by_batch  # noqa: E402
from workbench.serving.bench import engine_for, serve_bench  # noqa: E402
from workbench.serving.config import ServeConfig, check_config  # noqa: E402

METRICS = ("output_throughput", "tpot_ms_p50", "ttft_ms_p50", "mean_accepted_tokens")


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--methods", default="ar,draft,eagle,redrafter", help="comma-separated methods (ar first)")
    ap.add_argument("--k", type=int, default=4, help="draft length of the chains")
    ap.add_argument("--tree-depth", type=int, default=4)
    ap.add_argument("--tree-topk", type=int, default=4)
    ap.add_argument("--tree-budget", type=int, default=16)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--beam-length", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rates", type=floats, default=(0.5, 1.0), help="fractions of AR's saturation rate")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--greedy-check-requests", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--compile", default="auto", choices=("auto", "off", "default", "max-autotune"),
                    help="torch.compile of every method's step (auto: default on a GPU); off warms up in seconds")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.methods or args.methods[0] != "ar":
        ap.error("--methods must start with ar (the saturation rate and the ratios are AR's)")
    return args


CALIBRATED = "+cal"


def config_of(args, method: str) -> ServeConfig:
    """The method's ServeConfig; METHOD+cal: METHOD with the schedule measured before the run (calibration step)."""
    base = method.removesuffix(CALIBRATED)
    cfg = ServeConfig(method=base, calibration="step" if method.endswith(CALIBRATED) else "off", k=args.k,
                      tree_depth=args.tree_depth, tree_topk=args.tree_topk,
                      tree_budget=args.tree_budget, beam_width=args.beam_width, beam_length=args.beam_length,
                      max_num_seqs=args.max_num_seqs, num_requests=args.num_requests,
                      max_new_tokens=args.max_new_tokens, greedy_check_requests=0, warmup_requests=0,
                      compile=args.compile)
    check_config(cfg)  # a bad setting is named before any model loads
    return cfg


def label(args, method: str, schedule: str | None = None) -> str:
    base = method.removesuffix(CALIBRATED)
    name = {"draft": f"draft k={args.k}", "ngram": f"ngram k={args.k}",
            "eagle": f"eagle D{args.tree_depth} K{args.tree_topk} N{args.tree_budget}",
            "redrafter": f"redrafter W{args.beam_width} L{args.beam_length}"}.get(base, base)
    return name if base == method else f"{name}, adaptive ({schedule or 'schedule not measured'})"


def schedule_of(calibration_table: str | None) -> str | None:
    """The k_by_batch text of a calibrated run's schedule (its record's calibration_table), None without one.

    >>> schedule_of('{"measured": [], "schedule": [{"batch_start": 1, "batch_end": 4, "k": 16}, '
    ...             '{"batch_start": 5, "batch_end": 16, "k": 0}]}')
    '1-4:16,5-16:0'
    """
    if not calibration_table:
        return None
    chosen = json.loads(calibration_table).get("schedule") or []
    return format_k_by_batch([(c["batch_start"], c["batch_end"], c["k"]) for c in chosen]) or None


def spread(xs):
    xs = [x for x in xs if x is not None]
    return [statistics.median(xs), min(xs), max(xs)] if xs else None


def summarize(runs: list[dict], args, schedules: dict[str, str | None]) -> list[dict]:
    """Rows per (rate, method); schedules: each METHOD+cal's measured k_by_batch (its label names it)."""
    rows = []
    for frac in args.rates:
        ar = {r["round"]: r for r in runs if r["rate_frac"] == frac and r["method"] == "ar" and "error" not in r}
        for method in args.methods:
            mine = [r for r in runs if r["rate_frac"] == frac and r["method"] == method]
            ok = [r for r in mine if "error" not in r]
            row = {"rate_frac": frac, "method": method, "label": label(args, method, schedules.get(method)),
                   "rounds": len(ok),
                   "errors": [r["error"] for r in mine if "error" in r]}
            for m in METRICS:
                row[m] = spread([r.get(m) for r in ok])
            ratios = [r["output_throughput"] / ar[r["round"]]["output_throughput"] for r in ok
                      if r["round"] in ar and r.get("output_throughput") and ar[r["round"]].get("output_throughput")]
            row["output_x_ar"] = spread(ratios)
            checks = [r.get("greedy_matches_solo") for r in ok if r.get("greedy_solo_compared")]
            row["greedy_matches_solo"] = checks[0] if checks else None
            row["greedy_near_tie"] = next((r.get("greedy_near_tie") for r in ok if r.get("greedy_solo_compared")),
                                          None)
            rows.append(row)
    return rows


def fmt(s, spec=".0f") -> str:
    return "—" if not s else f"{s[0]:{spec}} [{s[1]:{spec}}, {s[2]:{spec}}]"


def write(out: Path, result: dict) -> None:
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    m = result["meta"]
    lines = [f"# Trees served under load · {m['preset']} · {m['device_name']} · {m['dtype']}", "",
             f"{m['num_requests']} requests x {m['max_new_tokens']} new tokens, max_num_seqs {m['max_num_seqs']}, "
             f"Poisson at fractions of AR's saturation rate ({_f(m.get('saturation_rps'))} req/s), "
             f"{m['repeats']} rounds (median [min, max]); torch.compile {m['args'].get('compile', 'auto')}; "
             f"{m['elapsed_s']:.0f} s.", "",
             "| rate | method | output tok/s | x AR (paired) | p50 TPOT ms | p50 TTFT ms | accepted / step | "
             "greedy = solo |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        greedy = {True: "yes", False: "no"}.get(r["greedy_matches_solo"], "—")
        if r["greedy_matches_solo"] is False and r.get("greedy_near_tie"):
            greedy = "no (near-tie)"
        lines.append(f"| {r['rate_frac']}x | {r['label']} | {fmt(r['output_throughput'])} | "
                     f"{fmt(r['output_x_ar'], '.2f')} | {fmt(r['tpot_ms_p50'], '.2f')} | {fmt(r['ttft_ms_p50'], '.1f')}"
                     f" | {fmt(r['mean_accepted_tokens'], '.2f')} | {greedy} |"
                     + (f" errors: {r['errors']}" if r["errors"] else ""))
    if result["skipped"]:
        lines += ["", "Skipped (budget): " + ", ".join(result["skipped"])]
    (out / "table.md").write_text("\n".join(lines) + "\n")


def _f(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    cfgs = {m: config_of(args, m) for m in args.methods}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    session = BenchSession.load(preset=args.preset, device=args.device, dtype=args.dtype)
    import torch
    dev = session.device
    meta = {"preset": args.preset, "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": str(next(session.target.parameters()).dtype), "num_requests": args.num_requests,
            "max_new_tokens": args.max_new_tokens, "max_num_seqs": args.max_num_seqs, "repeats": args.repeats,
            "args": vars(args)}
    result = {"meta": meta, "runs": [], "rows": [], "skipped": []}
    engines = {m: engine_for(session, cfgs[m]) for m in args.methods}

    def serve(method: str, **kw) -> dict:
        cfg = replace(cfgs[method], **kw)
        try:
            rec = serve_bench(session, cfg, engine=engines[method]).record
        except Exception as e:  # noqa: BLE001 - a failed run is recorded with its error; the others go on
            traceback.print_exc()
            return {"error": f"{type(e).__name__}: {e}"}
        return {k: rec.get(k) for k in (*METRICS, "request_throughput", "greedy_matches_solo", "greedy_solo_compared",
                                        "greedy_near_tie", "graph_captures_in_run", "mean_batch_size",
                                        "calibration_table", "k_by_batch")}

    def finish():
        meta["elapsed_s"] = time.perf_counter() - t0
        result["rows"] = summarize(result["runs"], args, {m: v["k_by_batch"] for m, v in meta["schedules"].items()})
        write(out, result)

    warm = dict(arrival="concurrency", max_concurrency=args.max_num_seqs, rate=0.0)
    meta["schedules"] = {}  # METHOD+cal -> the schedule its warm-up measured
    for m in args.methods:
        r = serve(m, **warm)
        schedule = schedule_of(r.get("calibration_table"))
        if m.endswith(CALIBRATED):  # measured once; every timed run serves with it fixed
            if schedule:
                cfgs[m] = replace(cfgs[m], calibration="off", k_by_batch=schedule)
            meta["schedules"][m] = {"k_by_batch": schedule, "calibration_table": r.get("calibration_table"),
                                    "error": r.get("error")}
        print(f"{time.perf_counter() - t0:7.1f}s warm-up {m}{f' (schedule {schedule})' if schedule else ''}",
              flush=True)
    sat = serve("ar", **warm)
    meta["saturation_rps"] = sat.get("request_throughput")
    if not meta["saturation_rps"]:
        meta["elapsed_s"] = time.perf_counter() - t0
        write(out, result)
        print(f"no saturation rate: {sat}", file=sys.stderr)
        return 1
    longest = 0.0
    for rep in range(args.repeats):
        for frac in args.rates:
            for m in args.methods:
                if time.perf_counter() - t0 + longest > args.budget_s:
                    result["skipped"].append(f"round {rep} {frac}x {m}")
                    continue
                t = time.perf_counter()
                check = args.greedy_check_requests if rep == 0 else 0
                r = serve(m, arrival="poisson", rate=frac * meta["saturation_rps"], seed=rep,
                          greedy_check_requests=check)
                longest = max(longest, time.perf_counter() - t)
                result["runs"].append({"round": rep, "rate_frac": frac, "method": m, **r})
                print(f"{time.perf_counter() - t0:7.1f}s round {rep} {frac}x {m}: "
                      f"{r.get('output_throughput') or r.get('error')}", flush=True)
                finish()
    finish()
    print((out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
