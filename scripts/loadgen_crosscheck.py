"""Does a peer load generator read `workbench serve` as serve-bench does? (issue 43: aiperf beside serve-bench)

    python scripts/loadgen_crosscheck.py --num-requests 120 --max-new-tokens 32 --repeats 4 --rate-fraction 0.5 \
        --out docs/gpu_runs/2026-12-06/cpu_aiperf                  # saturation first, then 0.5x of it
    python scripts/loadgen_crosscheck.py --rate 4 --num-requests 16 --repeats 1 --out /tmp/x  # a quick look

One `python -m workbench serve` (its own process group, stopped at the end whatever happens) on a free loopback port,
measured by two clients in turn over the same load:
- NVIDIA's aiperf (a peer tool, installed in a venv of its own: `python3 -m venv /work/aiperf-venv &&
  /work/aiperf-venv/bin/pip install aiperf==0.13.0`; --aiperf PATH), streamed /v1/completions, fed a single-turn
  input file whose timestamps are serve-bench's own Poisson arrivals (`loadgen.arrival_times` at --rate, --seed) and
  whose prompts are the preset's prompt file cycled as serve-bench cycles it (`--fixed-schedule`), max_tokens
  --max-new-tokens with ignore_eos, token counts from the server's usage chunk;
- `python -m workbench serve-bench --endpoint URL` with the same prompts, arrivals, count and max tokens.
So both send the same requests at the same offsets. --rate 0 measures saturation first (serve-bench, every request
at once) and runs at --rate-fraction of it. The server is warmed once (--warmup-requests, all at once) before any
measured run; neither tool warms it again. Per repeat the two tools run back to back, the first one alternating
(aiperf first in even repeats), so a drift in the machine's load reaches both alike.
Per tool over repeats: mean [min, max] of output tok/s, request throughput, TTFT p50 / p99, TPOT p50 (aiperf's
"inter token latency": (end - first token) / (tokens - 1) per request), chunk gap p50 (aiperf's "inter chunk
latency", serve-bench's ITL) and E2E latency p50; the ratio of the means aiperf / serve-bench, and whether the
[min, max] ranges overlap. Output: table.md, results.json, raw/ (aiperf's summary export per run, serve-bench's JSON
row per run, the arrival offsets), server.log.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_AIPERF = "/work/aiperf-venv/bin/aiperf"
DEFAULT_OUT = "docs/gpu_runs/2026-12-06/cpu_aiperf"

# (row label, aiperf summary metric, its statistic, serve-bench record column)
METRICS = [
    ("output tok/s", "output_token_throughput", "avg", "output_throughput"),
    ("requests/s", "request_throughput", "avg", "request_throughput"),
    ("TTFT p50 ms", "time_to_first_token", "p50", "ttft_ms_p50"),
    ("TTFT p99 ms", "time_to_first_token", "p99", "ttft_ms_p99"),
    ("TPOT p50 ms", "inter_token_latency", "p50", "tpot_ms_p50"),
    ("chunk gap (ITL) p50 ms", "inter_chunk_latency", "p50", "itl_ms_p50"),
    ("E2E latency p50 ms", "request_latency", "p50", "e2el_ms_p50"),
]


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aiperf", default=None, help=f"the aiperf executable (default {DEFAULT_AIPERF}, else "
                    "`aiperf` on PATH)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="the server's torch CPU threads")
    ap.add_argument("--method", default="draft", help="the server's decoding method")
    ap.add_argument("--k", type=int, default=4, help="the server's draft length")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="the server's batch rows")
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson requests/s (0: measure saturation first and "
                    "run at --rate-fraction of it)")
    ap.add_argument("--rate-fraction", type=float, default=0.5)
    ap.add_argument("--saturation-requests", type=int, default=32, help="requests of the saturation burst")
    ap.add_argument("--num-requests", type=int, default=120, help="measured requests per run")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="max_tokens of every request (ignore_eos)")
    ap.add_argument("--warmup-requests", type=int, default=8, help="requests sent once, all at once, before any "
                    "measured run")
    ap.add_argument("--repeats", type=int, default=4, help="runs per tool (even: each tool goes first equally often)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival draws (the same every repeat)")
    ap.add_argument("--launch-timeout", type=float, default=180.0)
    ap.add_argument("--run-timeout", type=float, default=600.0, help="seconds one tool's run may take")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    for name in ("num_requests", "max_new_tokens", "repeats", "saturation_requests"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_new_tokens < 2:
        ap.error("--max-new-tokens must be >= 2 (TPOT needs two tokens)")
    if args.rate < 0 or not 0 < args.rate_fraction <= 1:
        ap.error("--rate must be >= 0 (0 = measure saturation) and --rate-fraction in (0, 1]")
    return args


def find_aiperf(path: str | None) -> str:
    """The aiperf executable: `path`, else the default venv's, else `aiperf` on PATH; SystemExit saying how to get
    it when there is none."""
    candidates = [path] if path else [DEFAULT_AIPERF, "aiperf"]
    for c in candidates:
        found = shutil.which(c) if os.sep not in c else (c if os.access(c, os.X_OK) else None)
        if found:
            return found
    raise SystemExit(f"error: aiperf not found ({' nor '.join(candidates)}). It is a peer tool, not a dependency: "
                     "install it in a venv of its own (python3 -m venv /work/aiperf-venv && "
                     "/work/aiperf-venv/bin/pip install aiperf==0.13.0) and pass --aiperf PATH if it lives elsewhere")


def schedule(prompts: list[str], n: int, rate: float, seed: int) -> list[dict]:
    """aiperf single-turn lines carrying serve-bench's own requests: the i-th request's arrival (ms from the start,
    `loadgen.arrival_times` as `endpoint.make_sent` draws it) and prompt (the file cycled)."""
    from workbench.serving.loadgen import arrival_times

    if not prompts:
        raise ValueError("the prompt file is empty")
    return [{"timestamp": round(t * 1e3, 3), "text": prompts[i % len(prompts)]}
            for i, t in enumerate(arrival_times(n, rate, "poisson", 1.0, seed))]


def aiperf_argv(aiperf: str, url: str, model: str, tokenizer: str, input_file: str, n: int, max_tokens: int,
                seed: int, artifact_dir: str) -> list[str]:
    return [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
            "--tokenizer", tokenizer, "--use-server-token-count",  # output tokens from the usage chunk, as ours
            "--use-legacy-max-tokens", "--osl", str(max_tokens),  # our /v1/completions reads max_tokens
            "--extra-inputs", "ignore_eos:true", "--input-file", input_file, "--custom-dataset-type", "single-turn",
            "--fixed-schedule", "--request-count", str(n), "--random-seed", str(seed),
            "--no-server-metrics", "--no-gpu-telemetry", "--export-level", "summary",
            "--artifact-dir", artifact_dir, "--ui", "none"]


def parse_aiperf_summary(summary: dict) -> dict:
    """The figures this check compares, from aiperf's profile_export_aiperf.json (metric -> {"unit", "avg", "p50",
    "p99", ...}), plus the run's health: completed and failed requests, output tokens per request, how late aiperf
    sent against the schedule."""
    def stat(name: str, key: str):
        m = summary.get(name)
        return m.get(key) if isinstance(m, dict) else None

    out = {label: stat(name, key) for label, name, key, _ in METRICS}
    ok = stat("request_count", "avg") or 0  # successful requests; completed_request_count adds the failed ones
    sent = stat("completed_request_count", "avg") or ok
    out.update(completed=int(ok), failed=int(sent - ok),
               output_tokens_min=stat("output_sequence_length", "min"),
               output_tokens_max=stat("output_sequence_length", "max"),
               duration_s=stat("benchmark_duration", "avg"), schedule_lag_ms_p99=stat("replay_sched_lag_p99", "avg"),
               version=summary.get("aiperf_version"))
    return out


def parse_serve_bench(rec: dict) -> dict:
    out = {label: rec.get(col) for label, _, _, col in METRICS}
    done = rec.get("completed") or 0
    per_req = rec.get("total_new_tokens", 0) / done if done else None
    out.update(completed=done, failed=rec.get("failed_requests") or 0, output_tokens_min=per_req,
               output_tokens_max=per_req, duration_s=rec.get("duration_s"), schedule_lag_ms_p99=None,
               version=rec.get("engine_version"))
    return out


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Per metric: each tool's mean and [min, max] over its runs, the ratio of the means aiperf / serve-bench and
    whether the ranges overlap.

    >>> summarize({"aiperf": [{"output tok/s": 10.0}, {"output tok/s": 12.0}],
    ...            "serve-bench": [{"output tok/s": 11.0}, {"output tok/s": 13.0}]})[0]["ratio"]
    0.916667
    """
    rows = []
    for label, *_ in METRICS:
        row = {"metric": label}
        for tool in ("aiperf", "serve-bench"):
            vals = [r[label] for r in runs.get(tool, []) if r.get(label) is not None]
            row[tool] = sum(vals) / len(vals) if vals else None
            row[tool + "_range"] = [min(vals), max(vals)] if vals else None
        a, s = row["aiperf_range"], row["serve-bench_range"]
        row["ratio"] = round(row["aiperf"] / row["serve-bench"], 6) if a and s and row["serve-bench"] else None
        row["overlap"] = bool(a and s and a[0] <= s[1] and s[0] <= a[1])
        rows.append(row)
    return rows


def run_group(argv: list[str], log_path: Path, timeout_s: float, env: dict | None = None) -> str:
    """Runs argv in a process group of its own (`launcher.ServerProcess`) and waits; the whole group is stopped
    afterwards whatever happens (aiperf forks workers), and a non-zero exit raises with the log's tail. Returns the
    log (stdout and stderr)."""
    from workbench.serving.launcher import ServerProcess, tail

    proc = ServerProcess.start(argv, log_path, env=env)
    try:
        code = proc.proc.wait(timeout=timeout_s)
    finally:
        proc.stop(grace_s=1.0)
    if code != 0:
        raise RuntimeError(f"{shlex.join(argv[:3])} ... exited with status {code}:\n{tail(log_path, 30)}")
    return Path(log_path).read_text(errors="replace")


def serve_bench_argv(url: str, prompts_path: str, rate: float, n: int, max_tokens: int, seed: int) -> list[str]:
    return [sys.executable, "-m", "workbench", "serve-bench", "--endpoint", url, "--prompts", prompts_path,
            "--arrival", "poisson", "--rate", str(rate), "--seed", str(seed), "--num-requests", str(n),
            "--max-new-tokens", str(max_tokens), "--warmup-requests", "0", "--no-store", "--json"]


def last_json(output: str) -> dict:
    """The last JSON object line of a serve-bench run's output (its `--json` row)."""
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"serve-bench printed no JSON row:\n{output[-2000:]}")


def run_json_get(url: str) -> str:
    import httpx

    resp = httpx.get(url, timeout=30.0)
    resp.raise_for_status()
    return resp.text


def fmt(v, spec=".1f") -> str:
    return "—" if v is None else f"{v:{spec}}"


def table(result: dict) -> str:
    a = result["args"]
    lines = [f"# aiperf against serve-bench on `workbench serve` · {a['preset']} · {a['device']} · {a['method']} "
             f"k = {a['k']}", "", f"`{result['command']}`", "",
             f"aiperf {result['aiperf_version']}, {result['server']}; {a['num_requests']} requests x "
             f"{a['max_new_tokens']} tokens (ignore_eos), Poisson at {result['rate']:.3f} req/s"
             + (f" ({a['rate_fraction']}x the measured saturation, {result['saturation_req_s']:.2f} req/s)"
                if result["saturation_req_s"] else "")
             + f", the same arrivals and prompts for both tools (seed {a['seed']}); {a['repeats']} repeat(s) per "
             f"tool, mean [min, max]; {result['elapsed_s']:.0f} s.", "",
             "| metric | aiperf | serve-bench | aiperf / serve-bench | ranges overlap |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        spec = ".3f" if r["metric"] == "requests/s" else ".1f"
        cell = (lambda t: fmt(r[t], spec) + (f" [{r[t + '_range'][0]:{spec}}, {r[t + '_range'][1]:{spec}}]"
                                             if r[t + "_range"] else ""))
        lines.append(f"| {r['metric']} | {cell('aiperf')} | {cell('serve-bench')} | {fmt(r['ratio'], '.3f')} | "
                     f"{'yes' if r['overlap'] else 'no'} |")
    health = []
    for tool in ("aiperf", "serve-bench"):
        rs = result["runs"][tool]
        health.append(f"{tool}: completed {sorted({r['completed'] for r in rs})}, failed "
                      f"{sum(r['failed'] for r in rs)}, tokens per request "
                      f"{sorted({r['output_tokens_min'] for r in rs} | {r['output_tokens_max'] for r in rs})}")
    lags = [r["schedule_lag_ms_p99"] for r in result["runs"]["aiperf"] if r["schedule_lag_ms_p99"] is not None]
    lines += ["", "; ".join(health) + "." + (f" aiperf's p99 lag behind the schedule: {fmt(max(lags), '.2f')} ms at "
                                              "most." if lags else ""),
              f"Server left running: {result['server_left_running']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    aiperf = find_aiperf(args.aiperf)

    from workbench.harness.prompts import load_prompts
    from workbench.serving.launcher import ServerProcess, alive, free_port
    from workbench.zoo import resolve_preset

    t0 = time.perf_counter()
    command = shlex.join(["python", "scripts/loadgen_crosscheck.py", *(sys.argv[1:] if argv is None else argv)])
    out = Path(args.out)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    preset = resolve_preset(args.preset)
    prompts_path = str(preset.prompts_path)
    prompts = [p.text for p in load_prompts(prompts_path)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_argv = [sys.executable, "-m", "workbench", "serve", "--preset", args.preset, "--device", args.device,
                   "--threads", str(args.threads), "--port", str(port), "--method", args.method, "--k", str(args.k),
                   "--max-num-seqs", str(args.max_num_seqs)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs: dict[str, list[dict]] = {"aiperf": [], "serve-bench": []}
    saturation = None
    server = ServerProcess.start(server_argv, out / "server.log", env=env)
    try:
        server.wait_healthy(url + "/health", args.launch_timeout)
        with tempfile.TemporaryDirectory(prefix="crosscheck-") as tmp:
            tmp = Path(tmp)

            def sb(rate: float, n: int, seed: int) -> list[str]:
                return serve_bench_argv(url, prompts_path, rate, n, args.max_new_tokens, seed)

            run_group(sb(0.0, args.warmup_requests, args.seed + 1), tmp / "warmup.log", args.run_timeout, env)
            rate = args.rate
            if rate == 0:
                rec = last_json(run_group(sb(0.0, args.saturation_requests, args.seed + 1), tmp / "sat.log",
                                          args.run_timeout, env))
                saturation = rec["request_throughput"]
                (raw / "saturation_serve_bench.json").write_text(json.dumps(rec, indent=1, default=str))
                rate = round(args.rate_fraction * saturation, 3)
            sched = schedule(prompts, args.num_requests, rate, args.seed)
            input_file = tmp / "aiperf_input.jsonl"
            input_file.write_text("".join(json.dumps(line) + "\n" for line in sched))
            (raw / "arrivals_ms.json").write_text(json.dumps([s["timestamp"] for s in sched]))
            model = json.loads(run_json_get(url + "/v1/models"))["data"][0]["id"]
            for rep in range(args.repeats):
                order = ("aiperf", "serve-bench") if rep % 2 == 0 else ("serve-bench", "aiperf")
                for tool in order:
                    print(f"repeat {rep}: {tool}", file=sys.stderr, flush=True)
                    if tool == "aiperf":
                        art = tmp / f"aiperf_r{rep}"
                        run_group(aiperf_argv(aiperf, url, model, str(preset.target_dir), str(input_file),
                                              args.num_requests, args.max_new_tokens, args.seed, str(art)),
                                  tmp / f"aiperf_r{rep}.log", args.run_timeout)
                        # the JSON summary only, compact (its CSV says the same; the per-request files are large)
                        summary = json.loads((art / "profile_export_aiperf.json").read_text())
                        (raw / f"aiperf_r{rep}.json").write_text(json.dumps(summary, separators=(",", ":")))
                        runs["aiperf"].append({"repeat": rep, **parse_aiperf_summary(summary)})
                    else:
                        rec = last_json(run_group(sb(rate, args.num_requests, args.seed), tmp / f"sb_r{rep}.log",
                                                  args.run_timeout, env))
                        (raw / f"serve_bench_r{rep}.json").write_text(json.dumps(rec, indent=1, default=str))
                        runs["serve-bench"].append({"repeat": rep, **parse_serve_bench(rec)})
    finally:
        server.stop()
    left = alive(server.pid)
    result = {"command": command, "args": vars(args), "aiperf": aiperf,
              "aiperf_version": next((r["version"] for r in runs["aiperf"]), None),
              "server": "`" + shlex.join(["python"] + server_argv[1:server_argv.index("--port") + 1] + ["PORT"]
                                         + server_argv[server_argv.index("--port") + 2:]) + "`",
              "rate": rate, "saturation_req_s": saturation, "rows": summarize(runs), "runs": runs,
              "server_left_running": left, "elapsed_s": time.perf_counter() - t0}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    text = table(result)
    (out / "table.md").write_text(text)
    print(text)
    bad = [r for t in runs.values() for r in t if r["failed"] or r["completed"] != args.num_requests
           or r["output_tokens_min"] != args.max_new_tokens or r["output_tokens_max"] != args.max_new_tokens]
    return 1 if left or bad else 0


if __name__ == "__main__":
    sys.exit(main())
