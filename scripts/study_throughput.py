"""Study throughput (issue 8): how many trials one worker finishes in a fixed wall time, and where a trial's time goes.

    python scripts/study_throughput.py --device cuda --preset small --seconds 150 --out $OUT
    # CPU smoke run (tiny preset, fewer tokens):
    python scripts/study_throughput.py --device cpu --preset tiny --seconds 60 --max-new-tokens 16 --threads 1 --out out/thr

Runs `python -m studies.run` (the best_k script: draft model and n-gram, k 1-8; one worker, in a subprocess) on a
fresh study for --seconds of wall time, with the issue's settings: --num-prompts 8 x --max-new-tokens 128, CUDA graphs
on, the study's defaults otherwise (float32, 1 warm-up, 3 repeats, and every trial runs its own AR baseline
interleaved with the candidate). Then it sends SIGTERM (the study fails and re-queues the running trial and exits)
and reads the result store it wrote. It never trains: the preset must be trained already (a named error otherwise).

Written progressively under --out: `store/` (the result store, one row per finished trial), `trials.log` (one line
per trial), `study.db` (the Optuna storage). At the end: `summary.json` and `summary.md` with
- trials completed (status ok) and failed, within the window;
- trials per minute in the steady state: (completed - 1) / (time between the first and the last completed row), so model
  loading and the first trial's set-up are outside it, and that rate x 10 (the issue's goal: >= 120 per 10 minutes);
- the mean per-trial time breakdown (results.schema group "trial_time"; the first row left out as start-up):
  engine build + graph capture, warm-up, timed passes (`wall_s`), quality/KV columns, store write (each row carries
  the previous row's), everything else (Optuna, checks, telemetry, the record); and the same per method;
- the timed passes split (`wall_prefill_s`, `wall_decode_s`, `wall_setup_s`, `wall_finish_s`, `wall_other_s`): prefill
  and decode are tokens/s's window, the rest is per-call and per-pass work outside it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# breakdown: (label, column); "store write" comes from the next row (a row cannot time its own write)
PARTS = (("engine build + graph capture", "trial_engine_s"), ("warm-up", "trial_warmup_s"),
         ("timed passes", "wall_s"), ("quality / KV columns", "trial_quality_s"),
         ("store write", "trial_prev_store_s"), ("everything else", "trial_other_s"))
# the timed passes (wall_s) split by where their generate calls spent it; tokens/s's window is prefill + decode
PASS_PARTS = (("prefill (first tokens)", "wall_prefill_s"), ("decode steps", "wall_decode_s"),
              ("per-call setup (before prefill)", "wall_setup_s"),
              ("per-call finish (after the last token)", "wall_finish_s"),
              ("between calls (loop, pass syncs)", "wall_other_s"))
GOAL_PER_10_MIN = 120
GRACE_S = 60  # after SIGTERM: the study fails and re-queues its running trial, then exits; SIGKILL after this


class ThroughputError(ValueError):
    """A setting this benchmark cannot run; the message says what to use instead."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--preset", default="small", help="a trained zoo preset (default small; never trained here)")
    p.add_argument("--seconds", type=float, default=150.0, help="wall time of the study (default 150)")
    p.add_argument("--out", required=True, help="folder for the store, the trial log and the summary")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cuda-graphs", default="on", choices=("on", "off"))
    p.add_argument("--prefill-graphs", default="on", choices=("on", "off"),
                   help="capture the prompt forwards too (default on; off = eager prefill, the old way)")
    p.add_argument("--dtype", help="model dtype (default: the study's, auto: the model's half dtype on a GPU, float32 on a CPU)")
    p.add_argument("--threads", type=int, help="torch CPU threads of the worker (CPU runs on a shared machine)")
    p.add_argument("--sampler-seed", type=int, default=0, help="seed of the study's sampler (default 0)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Named errors for bad settings, before anything starts."""
    if not math.isfinite(args.seconds) or args.seconds < 10:
        raise ThroughputError(f"--seconds {args.seconds}: give at least 10 (a trial alone takes seconds)")
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise ThroughputError("--num-prompts and --max-new-tokens must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise ThroughputError(f"--threads {args.threads}: give a whole number >= 1")
    kind, _, index = args.device.partition(":")
    if not (args.device in ("cpu", "cuda") or (kind == "cuda" and index.isdigit())):
        raise ThroughputError(f"--device {args.device!r}: use cpu, cuda or cuda:N")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ThroughputError(f"--out {out} is not empty: give a new or empty folder (a study resumed from an old "
                              "store would mix its rows into the count)")
    from workbench.zoo import ZooError, resolve_preset

    try:
        resolve_preset(args.preset)
    except ZooError as e:
        raise ThroughputError(f"--preset {args.preset}: {e} (this script never trains; train it first with "
                              f"`python -m workbench zoo train {args.preset} --device cuda`)") from None


def study_command(args: argparse.Namespace, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "studies.run", "--preset", args.preset, "--study", "throughput",
           "--trials", "100000", "--device", args.device, "--cuda-graphs", args.cuda_graphs,
           "--prefill-graphs", args.prefill_graphs,
           "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
           "--storage", f"sqlite:///{(out / 'study.db').resolve()}", "--store", str((out / "store").resolve()),
           "--sampler-seed", str(args.sampler_seed)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


def run_study(cmd: list[str], seconds: float, log_path: Path) -> dict:
    """The study for `seconds` of wall time (then SIGTERM, then SIGKILL after GRACE_S); its output goes to log_path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=seconds)
            stopped = "exited by itself"
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=GRACE_S)
                stopped = "SIGTERM at the end of the window"
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
                stopped = f"SIGKILL ({GRACE_S} s after SIGTERM)"
    return {"exit_code": code, "stopped": stopped, "wall_s": time.time() - t0, "started_at": t0}


def _mean(values) -> float | None:
    vals = []
    for v in values:
        try:
            x = float(v)
        except TypeError:  # None, pd.NA: a column a row does not fill
            continue
        if not math.isnan(x):
            vals.append(x)
    return sum(vals) / len(vals) if vals else None


def summarize(store_dir: Path, run: dict, args: argparse.Namespace) -> dict:
    """Counts, steady-state rate and the mean per-trial breakdown from the rows the study stored."""
    from results.store import ResultStore

    df = ResultStore(store_dir).load() if store_dir.exists() else None
    summary: dict = {"settings": {k: getattr(args, k) for k in ("device", "preset", "seconds", "num_prompts",
                                                                  "max_new_tokens", "cuda_graphs", "dtype")},
                     "run": run, "goal_per_10_min": GOAL_PER_10_MIN}
    if df is None or df.empty:
        return {**summary, "trials_completed": 0, "trials_failed": 0, "note": "no trial was stored"}
    df = df.sort_values("created_at").reset_index(drop=True)
    ok = df[df["status"] == "ok"]
    summary.update(trials_completed=int(len(ok)), trials_failed=int((df["status"] != "ok").sum()),
                   first_row_s=(df["created_at"].iloc[0].timestamp() - run["started_at"]))
    # the rate counts completed trials only: a trial cancelled at the window's end may leave a failed row
    span = (ok["created_at"].iloc[-1] - ok["created_at"].iloc[0]).total_seconds() if len(ok) else 0.0
    if len(ok) >= 2 and span > 0:
        per_min = (len(ok) - 1) / span * 60
        summary.update(steady_span_s=span, trials_per_minute=per_min, trials_per_10_min=per_min * 10,
                       seconds_per_trial=span / (len(ok) - 1), goal_met=per_min * 10 >= GOAL_PER_10_MIN)
    steady = ok.iloc[1:] if len(ok) > 1 else ok  # the first row carries start-up (first engine, reference perplexity)
    cols = [c for _, c in PARTS if c in steady]

    def breakdown(rows, parts=PARTS) -> dict:
        out = {label: _mean(rows[col].tolist()) if col in rows else None for label, col in parts}
        out["sum of parts"] = sum(v for v in out.values() if v is not None)
        return out

    summary["breakdown_s"] = breakdown(steady)
    summary["breakdown_by_method_s"] = {m: {**breakdown(g), "trials": int(len(g))}
                                        for m, g in steady.groupby("method")}
    if any(col in steady and steady[col].notna().any() for _, col in PASS_PARTS):  # none in older rows
        summary["pass_split_s"] = breakdown(steady, PASS_PARTS)
        summary["pass_split_by_method_s"] = {m: breakdown(g, PASS_PARTS) for m, g in steady.groupby("method")}
    keep = ["trial_id", "method", "k", "ngram_min", "ngram_max", "status", "tokens_per_s", "ar_tokens_per_s",
            "speedup_vs_ar", "graph_capture_s", "trial_s", *cols, *[c for _, c in PASS_PARTS if c in df]]
    rows = df[[c for c in keep if c in df]].copy()
    rows["created_at"] = df["created_at"].astype(str)
    summary["trials"] = json.loads(rows.to_json(orient="records"))
    summary["device_name"] = str(df["device_name"].dropna().iloc[0]) if df["device_name"].notna().any() else None
    summary["git_commit"] = str(df["git_commit"].dropna().iloc[0]) if df["git_commit"].notna().any() else None
    return summary


def _fmt(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def markdown(s: dict) -> str:
    st = s["settings"]
    lines = [f"# Study throughput: {st['preset']} on {s.get('device_name') or st['device']}",
             "",
             f"One worker, best_k (draft model / n-gram, k 1-8), {st['num_prompts']} prompts x {st['max_new_tokens']} "
             f"new tokens, CUDA graphs {st['cuda_graphs']}, dtype {st['dtype'] or 'auto (study default)'}, "
             f"{st['seconds']:.0f} s window ({s['run']['stopped']}, exit {s['run']['exit_code']}); git "
             f"{s.get('git_commit')}.",
             "",
             "| trials completed | failed | steady span | trials / minute | per 10 minutes (goal >= "
             f"{s['goal_per_10_min']}) | s / trial |",
             "|---|---|---|---|---|---|",
             f"| {s['trials_completed']} | {s['trials_failed']} | {_fmt(s.get('steady_span_s'), 1)} s | "
             f"{_fmt(s.get('trials_per_minute'), 2)} | **{_fmt(s.get('trials_per_10_min'), 0)}** "
             f"({'met' if s.get('goal_met') else 'missed'}) | {_fmt(s.get('seconds_per_trial'), 2)} |",
             ""]
    if "breakdown_s" in s:
        methods = list(s["breakdown_by_method_s"])
        lines += ["Mean seconds per trial (first row left out; `store write` is each row's predecessor's):", "",
                  "| part | all | " + " | ".join(methods) + " |",
                  "|---|---|" + "---|" * len(methods)]
        for label in [p for p, _ in PARTS] + ["sum of parts"]:
            lines.append(f"| {label} | {_fmt(s['breakdown_s'][label])} | "
                         + " | ".join(_fmt(s["breakdown_by_method_s"][m][label]) for m in methods) + " |")
        lines.append("| trials | " + str(sum(s["breakdown_by_method_s"][m]["trials"] for m in methods)) + " | "
                     + " | ".join(str(s["breakdown_by_method_s"][m]["trials"]) for m in methods) + " |")
    if "pass_split_s" in s:
        methods = list(s["pass_split_by_method_s"])
        lines += ["", "The timed passes split (mean seconds per trial, both sides, every repeat; tokens/s counts "
                  "prefill + decode):", "",
                  "| part of the timed passes | all | " + " | ".join(methods) + " |",
                  "|---|---|" + "---|" * len(methods)]
        for label in [p for p, _ in PASS_PARTS] + ["sum of parts"]:
            lines.append(f"| {label} | {_fmt(s['pass_split_s'][label])} | "
                         + " | ".join(_fmt(s["pass_split_by_method_s"][m][label]) for m in methods) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except ThroughputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = run_study(study_command(args, out), args.seconds, out / "trials.log")
    summary = summarize(out / "store", run, args)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    table = markdown(summary)
    (out / "summary.md").write_text(table)
    print(table, end="")
    return 0 if summary["trials_completed"] > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
