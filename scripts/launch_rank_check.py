"""Does a launch study rank settings as the in-process serving runs do? (issue 43's launch-study goal)

    python scripts/launch_rank_check.py --preset tiny --device cpu --method ngram --ks 1,2,3,4,5,6 --out out/rank
    python scripts/launch_rank_check.py --preset tiny --device cpu --ks 1,2 --num-requests 4 --max-new-tokens 8 \\
        --out /tmp/rank                                         # CPU smoke run (tests/test_launch_rank_check.py)

One process drives both sides over the same load (`--arrival`, `--rate`, `--num-requests`, the preset's prompts):
1. the launch study (studies/launch.py): `python -m workbench serve ... --k {k}` relaunched per k, measured through
   HTTP (serve-bench --endpoint), every server checked gone by PID afterwards;
2. in-process serve-bench at each k (`workbench.serving.bench.serve_bench`), the engine in this process;
interleaved k by k (a launch, then in process), every other round in reverse order, so a drift in the machine's
load reaches both sides alike; per k the median over --rounds with [min, max].
Per k: output tokens/s and p99 TPOT on both sides; the rank agreement of the two orderings by output tokens/s
(Spearman's rho and Kendall's tau-a), and whether both pick the same best k. Output: results.json, table.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft"))
    ap.add_argument("--ks", default="1,2,3,4,5,6", help="draft lengths, comma-separated")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--warmup-requests", type=int, default=4, help="untimed requests first, on both sides")
    ap.add_argument("--arrival", default="concurrency", choices=("concurrency", "poisson"))
    ap.add_argument("--rate", type=float, default=0.0, help="requests/s for poisson (0: all at once)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every k (medians, [min, max])")
    ap.add_argument("--launch-timeout", type=float, default=180.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        args.ks = [int(k) for k in args.ks.split(",") if k.strip()]
    except ValueError:
        ap.error(f"--ks {args.ks!r}: give whole numbers separated by commas, e.g. 1,2,4")
    if len(args.ks) < 2 or min(args.ks) < 1:
        ap.error("--ks needs at least two draft lengths >= 1 (a ranking of one is no ranking)")
    return args


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rho: Pearson's r of the ranks (ties averaged); None under two points or a constant side.

    >>> spearman([1, 2, 3], [10, 30, 20])
    0.5
    """
    import optuna
    import pandas as pd

    if len(a) < 2:
        return None
    r = pd.Series(a).rank().corr(pd.Series(b).rank())
    return None if r != r else round(float(r), 6)


def kendall(a: list[float], b: list[float]) -> float | None:
    """Kendall's tau-a: (concordant - discordant) / pairs.

    >>> kendall([1, 2, 3], [10, 30, 20])
    0.333333
    """
    n = len(a)
    if n < 2:
        return None
    s = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
            for i in range(n) for j in range(i + 1, n))
    return round(s / (n * (n - 1) / 2), 6)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import optuna
    import pandas as pd

    from studies.launch import parse_search, report, run_launch_study
    from workbench.harness.bench import BenchSession
    from workbench.harness.prompts import load_prompts
    from workbench.serving.bench import serve_bench
    from workbench.serving.config import ServeConfig, check_config
    from workbench.serving.launcher import LaunchTemplate, alive
    from workbench.zoo import resolve_preset

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ServeConfig(method=args.method, k=args.ks[0], max_num_seqs=args.max_num_seqs, arrival=args.arrival,
                      rate=args.rate, max_concurrency=args.max_num_seqs if args.arrival == "concurrency" else 0,
                      num_requests=args.num_requests, max_new_tokens=args.max_new_tokens,
                      warmup_requests=args.warmup_requests,
                      greedy_check_requests=0)
    check_config(cfg)
    prompts_path = str(resolve_preset(args.preset).prompts_path)
    storage = optuna.storages.InMemoryStorage()
    texts = [p.text for p in load_prompts(prompts_path)]
    t0 = time.perf_counter()
    template = LaunchTemplate(f"{sys.executable} -m workbench serve --preset {args.preset} --device {args.device} "
                              f"--port {{port}} --method {args.method} --k {{k}} --max-num-seqs {args.max_num_seqs}")
    session = BenchSession.load(preset=args.preset, device=args.device)
    runs, pids, reports = [], [], []
    for rnd in range(args.rounds):  # k by k, a launch then in process; every other round in reverse order
        for k in (args.ks if rnd % 2 == 0 else args.ks[::-1]):
            study, started = run_launch_study(template, parse_search([f"k={k}"], template), cfg, texts,
                                              study_name=f"rank-check-r{rnd}-k{k}", storage=storage, trials=1,
                                              log_dir=out / "launch_logs", launch_timeout=args.launch_timeout,
                                              prompts_source=prompts_path)
            pids += started
            reports.append(report(study, started))
            t = next((t for t in study.get_trials(deepcopy=False) if t.params.get("k") == k), None)
            rec = serve_bench(session, replace(cfg, k=k)).record
            ok = t is not None and t.state.name == "COMPLETE"
            runs.append({"round": rnd, "k": k,
                         "http_output_tok_s": t.user_attrs.get("output_throughput") if ok else None,
                         "http_tpot_ms_p99": t.values[1] if ok else None,
                         "http_acceptance": t.user_attrs.get("acceptance_rate") if ok else None,
                         "http_error": None if ok else (t.user_attrs.get("error") if t else "not run"),
                         "inproc_output_tok_s": rec.get("output_throughput"),
                         "inproc_tpot_ms_p99": rec.get("tpot_ms_p99"), "inproc_acceptance": rec.get("acceptance_rate")})
    rows = []
    for k in args.ks:
        mine = [r for r in runs if r["k"] == k]
        row = {"k": k, "http_error": next((r["http_error"] for r in mine if r["http_error"]), None)}
        for col in ("http_output_tok_s", "inproc_output_tok_s", "http_tpot_ms_p99", "inproc_tpot_ms_p99",
                    "http_acceptance", "inproc_acceptance"):
            vals = [r[col] for r in mine if r[col] is not None]
            row[col] = statistics.median(vals) if vals else None
            row[col + "_range"] = [min(vals), max(vals)] if vals else None
        rows.append(row)
    df = pd.DataFrame(rows)
    both = df.dropna(subset=["http_output_tok_s", "inproc_output_tok_s"])
    rho = spearman(both["http_output_tok_s"].tolist(), both["inproc_output_tok_s"].tolist())
    tau = kendall(both["http_output_tok_s"].tolist(), both["inproc_output_tok_s"].tolist())
    best_http = int(both.loc[both["http_output_tok_s"].idxmax(), "k"]) if len(both) else None
    best_in = int(both.loc[both["inproc_output_tok_s"].idxmax(), "k"]) if len(both) else None
    survivors = [p for p in pids if alive(p)]
    result = {"args": vars(args), "rows": rows, "runs": runs, "spearman_rho": rho, "kendall_tau": tau, "best_k_http": best_http,
              "best_k_inprocess": best_in, "servers_started": len(pids), "servers_left": survivors,
              "elapsed_s": time.perf_counter() - t0, "launch_reports": reports}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    fmt = (lambda v, spec=".1f": "—" if v is None or v != v else f"{v:{spec}}")
    spread = (lambda r, col: fmt(r[col]) + (f" [{r[col + '_range'][0]:.1f}, {r[col + '_range'][1]:.1f}]"
                                            if r[col + "_range"] and args.rounds > 1 else ""))
    lines = [f"# Launch study vs in-process serving · {args.preset} · {args.device} · {args.method}", "",
             f"{args.num_requests} requests x {args.max_new_tokens} new tokens, {args.arrival}"
             f"{' at ' + str(args.rate) + ' req/s' if args.arrival == 'poisson' else ''}, max_num_seqs "
             f"{args.max_num_seqs}; {args.rounds} round(s), median [min, max]; {result['elapsed_s']:.0f} s.", "",
             "| k | HTTP (launch study) output tok/s | in-process output tok/s | HTTP p99 TPOT ms | in-process p99 "
             "TPOT ms | HTTP acceptance | in-process acceptance |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['k']} | {spread(r, 'http_output_tok_s')} | {spread(r, 'inproc_output_tok_s')} | "
                     f"{fmt(r['http_tpot_ms_p99'], '.2f')} | {fmt(r['inproc_tpot_ms_p99'], '.2f')} | "
                     f"{fmt(r['http_acceptance'], '.3f')} | {fmt(r['inproc_acceptance'], '.3f')} |")
    lines += ["", f"Rank agreement by output tok/s: Spearman rho {fmt(rho, '.2f')}, Kendall tau {fmt(tau, '.2f')}; "
              f"best k: {best_http} over HTTP, {best_in} in process. Servers started {len(pids)}, left running "
              f"{len(survivors)}."]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if not survivors else 1


if __name__ == "__main__":
    sys.exit(main())
