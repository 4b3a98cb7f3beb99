"""Serving under load on one GPU: is adaptive speculation at least as good as the better of speculation off and a
fixed k at every load, and does its schedule have cliffs? Writes OUT/results.json and OUT/table.md.

    python scripts/gpu_serving.py --device cuda --preset small --out $OUT                 # ~2-4 min on one H200
    python scripts/gpu_serving.py --device cpu --preset tiny --num-requests 6 --warmup-requests 2 --max-new-tokens 8 \\
        --rates 0.5,1 --max-num-seqs 4 --out /tmp/serving_smoke                         # CPU smoke test

Parts, in this order (after the saturation part, a run is skipped, and listed under "skipped", when the longest
run of its part so far would end past --budget-s):
  calibrate   step: ms per isolated decode step by batch bucket and draft length 0..k, and tokens per step at each
              length (workbench/serving/calibrate.py), kept for comparison; after the warm-up, loop: a short
              closed-loop serve per (batch bucket as concurrency, k in 0..k) on the engine that serves, within
              --calibration-budget-s; the adaptive schedule is loop's (the k with the most output tokens/s per batch
              size, ties within --min-gain to the smaller), or step's with --calibration step, or --k-by-batch's
  warm-up     one short untimed run per engine (first-run costs, graph captures) before anything is measured
  saturation  request throughput of speculation off at fixed concurrency max_num_seqs; the sweep's rates are fractions
              of it; SLOs for goodput default to 3x / 2x the light-load TTFT / TPOT of speculation off
  sweep       Poisson arrivals at each rate: off, fixed k, adaptive, and a held-out k = 2 (for the replay);
              --repeats rounds, settings interleaved, round r with arrival seed r (the same arrivals for every
              setting of a round); the goal check reads the medians over rounds (one run near saturation can queue
              up after a single stall: an adaptive run doing fixed k's work once read 0.79x of it)
  thresholds  for each schedule threshold t (a batch size where the schedule's k changes): fixed concurrency t - 1, t,
              t + 1 with off, fixed k and adaptive, --repeats rounds (one run is ~0.5 s: single runs differed by
              +-10 %); a cliff is adaptive's median output tokens/s dropping more than --cliff-pct % from one
              concurrency to the next, or falling more than --cliff-pct % below the better of off and fixed k;
              beyond the noise when it is also larger than the rounds' spread at those points
  replay      costs fitted on off + fixed k (every round); predicts the held-out k = 2 and adaptive in each round
              from that round's fixed-k traces, and compares the medians over the rounds (every round's error kept),
              with the old cost model and the new one (draft prefill at join, catch-ups, prefill forwards)
              side by side (and the new one fitted with the loop calibration's iterations too, which cover
              every k: off + one fixed k cannot tell a per-node draft cost from a per-step one), and the
              draft-side tokens each setting really ran beside the replay's
Every run uses graphs captured before its clock starts, for every draft length it can use; each record carries
graph_captures_in_run (captures inside the run: should be 0) and the draft catch-up counters. results.json and
table.md are rewritten after every run, so a run killed by a timeout keeps everything measured before it.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import settings  # noqa: E402
from workbench.harness.bench import BenchSession  # noqa: E402
from workbench.serving import replay  # noqa: E402
from workbench.serving.adaptive import format_k_by_batch  # noqa: E402
from workbench.serving.bench import adaptive_for, engine_for, serve_bench  # noqa: E402
from workbench.serving.calibrate import calibrate, calibrate_loop  # noqa: E402
from workbench.serving.config import ServeConfig  # noqa: E402
from workbench.serving.schedules import SCHEDULE_SHAPES  # noqa: E402
from workbench.serving.tuning import (ServeTuning, ServeTuningError, format_serve_tuning,  # noqa: E402
                                      parse_serve_tuning)

SHOW = ["request_throughput", "output_throughput", "goodput", "tpot_ms_p99", "tpot_ms_p50", "ttft_ms_p99",
        "ttft_ms_p50", "mean_batch_size", "acceptance_rate", "preemptions", "graph_captures_in_run",
        "graph_misses_in_run", "draft_catch_up_tokens", "draft_catch_up_forwards", "draft_catch_up_slots",
        "acceptance_by_batch_size", "draft_prefill_tokens", "draft_catch_up_skips",
        # where a run's time went (ms, summed over the run; CUDA events): draft = chains + catch-ups, prefill = target
        # prefills + draft prefills at join; compare adaptive's with off's where its schedule says off
        "time_prefill_ms", "time_draft_ms", "time_verify_ms", "time_accept_ms", "time_kv_ms",
        # the tail after the last arrival (above saturation a run ends in shrinking batches: 20.4)
        "drain_s", "drain_output_share", "arrival_window_output_throughput", "loop_batch_prefill", "loop_overlap",
        "loop_steps_ahead", "serve_tuning"]


def other_shape(shape: str) -> str:
    """The calibration_shape a --shape-controls run serves beside `shape`: the next of SCHEDULE_SHAPES, cyclically
    (sticky -> monotone -> free -> sticky), so each shape is compared with the one it was built to improve on."""
    return SCHEDULE_SHAPES[(SCHEDULE_SHAPES.index(shape) + 1) % len(SCHEDULE_SHAPES)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16", help="model dtype on a GPU (float32 on a CPU)")
    p.add_argument("--method", default="draft", choices=("draft", "ngram"))
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--k-by-batch", default="auto",
                   help="adaptive schedule 'start-end:k,...'; auto = measured by the calibration part")
    p.add_argument("--calibration", default="loop", choices=("loop", "step"),
                   help="which measurement the adaptive schedule comes from (both are recorded unless the loop one "
                   "is skipped for the budget)")
    p.add_argument("--calibration-shape", default=settings.SERVE_KNOBS["calibration_shape"].default,
                   choices=SCHEDULE_SHAPES,
                   help="how the loop calibration's tokens/s become a schedule (workbench/serving/calibrate.py)")
    p.add_argument("--calibration-budget-s", type=float, default=40.0,
                   help="wall-clock budget of the loop calibration (runs past it are skipped and listed)")
    # 6 and 0.10: one ~0.3 s closed-loop run of 3 x b requests varied ~10 % on the H200, so runs are twice as long
    # and a longer draft must win by more than that noise
    p.add_argument("--calibration-repeats", type=int, default=settings.SERVE_KNOBS["calibration_repeats"].default,
                   help=settings.SERVE_KNOBS["calibration_repeats"].help.replace("%", "%%"))
    p.add_argument("--calibration-requests", type=int, default=6,
                   help="loop calibration: requests per run = this x the concurrency (the first round is warm-up)")
    p.add_argument("--min-gain", type=float, default=0.10,
                   help="a longer draft must beat the best shorter one by this fraction of tokens/ms")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--rates", default="0.5,1.0,1.5,2.0", help="fractions of the measured saturation rate")
    p.add_argument("--slo-ttft-ms", type=float, default=0.0)
    p.add_argument("--slo-tpot-ms", type=float, default=0.0)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="graphs per batch bucket and draft length (default: on for cuda, off on a CPU)")
    p.add_argument("--calibration-steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="sweep rounds (arrival seeds 0..R-1); medians are compared")
    p.add_argument("--no-thresholds", action="store_true")
    p.add_argument("--eager-prefill-controls", action="store_true",
                   help="also run off and fixed k with prefill_graphs off (prompts eager, decode captured) in every "
                   "sweep round, interleaved with the rest: the captured prefill against the eager one on the same "
                   "arrivals (prefill_checks)")
    p.add_argument("--serve-tuning", default=settings.SERVE_KNOBS["serve_tuning"].default, metavar="FIELD=VALUE,...",
                   help="how the serving loop runs in every run and in the loop calibration (the serve knob "
                   "serve_tuning: batch_prefill, overlap_prefill, full_overlap; empty = the defaults); the control "
                   "runs below change one field of it")
    p.add_argument("--batch-prefill-controls", type=int, default=0, metavar="N",
                   help="also run off and fixed k with an iteration's prefill chunks in forwards of up to N rows "
                   "(serve_tuning batch_prefill=N; 1 = a forward per row; the default is 4) in every sweep "
                   "round, on the same arrivals (batch_prefill_checks: ratio = the default's / N's)")
    p.add_argument("--overlap-controls", action="store_true",
                   help="also run off and fixed k with the step read before the prefill is planned "
                   "(serve_tuning overlap_prefill=0; on by default: the prefill enqueued behind the step "
                   "in flight) in every sweep round, on the same arrivals (overlap_checks: ratio = overlapped / "
                   "sequential)")
    p.add_argument("--full-overlap-controls", action="store_true",
                   help="also run off and fixed k with serve_tuning full_overlap (each step launched before the "
                   "previous one is read, where that applies) the other way from --serve-tuning's (on by default) "
                   "in every sweep round, on the same arrivals (full_overlap_checks: ratio = default / control)")
    p.add_argument("--gc-controls", action="store_true",
                   help="also run off and fixed k with gc_freeze off (the collector free to rescan the whole heap "
                   "inside the run) in every sweep round (gc_checks)")
    p.add_argument("--shape-controls", action="store_true",
                   help="also serve the loop calibration's schedule under another calibration_shape (the next one "
                   "of sticky -> monotone -> free -> sticky) in every sweep round and at every threshold of either "
                   "schedule (shape_checks, and "
                   "threshold_checks_other_shape for its cliffs)")
    p.add_argument("--threshold-requests", type=int, default=12,
                   help="measured requests per threshold run (at least 3 x the concurrency)")
    p.add_argument("--cliff-pct", type=float, default=10.0)
    p.add_argument("--spec-off-queue", type=int, default=0, help="the adaptive setting drafts nothing in a step "
                   "while at least this many requests wait for a row (spec_off_queue; 0 = never)")
    p.add_argument("--catch-up-max", type=int, default=0,
                   help="adaptive's spec_catch_up_max: a row that decoded more than this many tokens at k = 0 stays "
                   "autoregressive when the batch dips into a drafting size (0 = always catch up)")
    p.add_argument("--profile-settings", default="",
                   help="after the sweep, one more run of each of these settings (comma-separated names, e.g. "
                        "'k=4,adaptive,k=2 (held out)') at the last rate under torch.profiler: host (and GPU) time and "
                        "op counts per step, and which ops differ from the first setting (profiles.md)")
    p.add_argument("--profile-requests", type=int, default=128, help="requests of each profiled run")
    p.add_argument("--sync-sites", default="",
                   help="after the profiles, one more run of each of these settings at the last rate (--profile-"
                        "requests requests) with torch.cuda.set_sync_debug_mode('warn'): every host-device "
                        "synchronization PyTorch makes, counted per serving iteration by the workbench lines that "
                        "called it (syncs.md); with --repeats 0 only warm-up, saturation and these runs are served")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="wall-clock budget after the models are loaded (H200, small: about 30 s more in total)")
    args = p.parse_args(argv)
    if args.batch_prefill_controls < 0:
        p.error(f"--batch-prefill-controls {args.batch_prefill_controls}: give the control runs' most rows per "
                "prefill forward (1 = a forward per row; 0 = no control runs)")
    try:
        args.tuning = parse_serve_tuning(args.serve_tuning)
    except ServeTuningError as e:
        p.error(f"--serve-tuning: {e}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_begin = time.perf_counter()
    elapsed = lambda: time.perf_counter() - t_begin  # noqa: E731
    dtype = args.dtype if args.device != "cpu" else "float32"
    graphs = args.cuda_graphs if args.cuda_graphs is not None else args.device.startswith("cuda")
    session = BenchSession.load(preset=args.preset, device=args.device, dtype=dtype)
    buckets = tuple(b for b in settings.KNOBS["graph_batch_sizes"].default if b < args.max_num_seqs)
    base = ServeConfig(method=args.method, k=args.k, max_new_tokens=args.max_new_tokens,
                       num_requests=args.num_requests, warmup_requests=args.warmup_requests,
                       max_num_seqs=args.max_num_seqs, cuda_graphs=graphs,
                       graph_batch_sizes=buckets + (args.max_num_seqs,), serve_tuning=args.serve_tuning)
    tuning = args.tuning  # every run's loop, the controls' but for the field each changes
    result = {"preset": args.preset, "device": str(session.device), "dtype": dtype, "method": args.method,
              "k": args.k, "catch_up_max": args.catch_up_max, "cuda_graphs": graphs, "budget_s": args.budget_s,
              "cliff_pct": args.cliff_pct, "serve_tuning": format_serve_tuning(tuning),
              "k_by_batch": None, "schedule_source": None, "sweep": [], "thresholds": [], "threshold_checks": [],
              "skipped": [], "replay": [], "done": False}
    engines: dict[tuple, object] = {}  # (method, k) -> engine, reused across runs (cache and graphs kept)
    last_wall: dict[str, float] = {}

    def flush() -> None:  # after every part and run: a timeout loses only the run in flight
        result["wall_s"] = elapsed()
        for name, text in (("results.json", json.dumps(result, indent=2, default=str) + "\n"),
                           ("table.md", table(result))):
            tmp = out / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(out / name)

    def engine(cfg):
        key = (cfg.method, cfg.k if cfg.method != "ar" else 0, cfg.prefill_graphs)
        if key not in engines:
            engines[key] = engine_for(session, cfg)
        return engines[key]

    # -- calibrate (step): ms per isolated step, kept for comparison with the loop calibration -------------------
    # every prompt a measured run uses (requests cycle the prompt set): the warm-up serves them all, so each engine's
    # cache is sized once for every later run (which then reuses it and its graphs)
    used = session.encode(min(len(session.prompts), args.num_requests + args.warmup_requests))
    bs = base.kv_block_size
    serve_len = -(-(max(map(len, used)) + args.max_new_tokens + args.k + 2) // bs) * bs  # the loop's max_len
    step_ranges = None
    if args.k_by_batch == "auto":
        t0 = time.perf_counter()
        cal = calibrate(engine(base), used, base.graph_batch_sizes, steps=args.calibration_steps, max_len=serve_len)
        step_ranges = cal.schedule(args.max_num_seqs, min_gain=args.min_gain)
        result["calibration"] = {"table": cal.table(), "mean_tokens": cal.mean_tokens, "padded": cal.padded,
                                 "k_by_batch": format_k_by_batch(step_ranges), "wall_s": time.perf_counter() - t0}
        print(f"step calibration: schedule {format_k_by_batch(step_ranges)}", flush=True)
        flush()
    fixed = f"k={args.k}"
    settings_of = {"off": dict(method="ar"), fixed: {}, "adaptive": dict(k_by_batch=""), "k=2 (held out)": dict(k=2)}
    if args.eager_prefill_controls:
        settings_of.update({EAGER.format("off"): dict(method="ar", prefill_graphs=False),
                            EAGER.format(fixed): dict(prefill_graphs=False)})
    if args.gc_controls:
        settings_of.update({GC.format("off"): dict(method="ar", gc_freeze=False),
                            GC.format(fixed): dict(gc_freeze=False)})
    batched = BATCHED.format(n=max(1, args.batch_prefill_controls))  # "{}, prefill rows N"
    ahead = ahead_label(tuning.full_overlap)
    # off and fixed k again, each with one field of the loop's tuning changed
    for on, label, control in ((args.batch_prefill_controls, batched,
                                replace(tuning, batch_prefill=args.batch_prefill_controls)),
                               (args.overlap_controls, SEQUENTIAL, replace(tuning, overlap_prefill=False)),
                               (args.full_overlap_controls, ahead,
                                replace(tuning, full_overlap=not tuning.full_overlap))):
        if on:
            text = format_serve_tuning(control)
            settings_of.update({label.format("off"): dict(method="ar", serve_tuning=text),
                                label.format(fixed): dict(serve_tuning=text)})
    if args.batch_prefill_controls:
        result["batch_prefill"] = {"default": tuning.batch_prefill, "control": args.batch_prefill_controls}
    if args.full_overlap_controls:
        result["full_overlap"] = {"default": tuning.full_overlap, "control": not tuning.full_overlap}
    runs: dict[tuple, object] = {}

    def run(name: str, part: str, essential: bool = False, **kw):
        cfg = replace(base, **settings_of[name], **kw)
        guess = last_wall.get(part, 0.0)
        if not essential and elapsed() + guess > args.budget_s:
            result["skipped"].append({"part": part, "setting": name, **{k: v for k, v in kw.items()
                                                                        if k in ("rate", "max_concurrency")}})
            flush()
            return None, None
        t0 = time.perf_counter()
        res = serve_bench(session, cfg, engine=engine(cfg))
        last_wall[part] = max(last_wall.get(part, 0.0), time.perf_counter() - t0)
        rec = {key: res.record.get(key) for key in SHOW}
        rec.update(setting=name, rate=cfg.rate, arrival=cfg.arrival, max_concurrency=cfg.max_concurrency,
                   wall_s=time.perf_counter() - t0)
        print(json.dumps({"part": part, **rec}), flush=True)
        return res, rec

    # -- warm-up: first-run costs and graph captures outside every measured run ----------------------------------
    warm = dict(arrival="concurrency", max_concurrency=args.max_num_seqs, warmup_requests=0,
                num_requests=max(args.max_num_seqs, len(used)))
    for name in ("off", fixed, "k=2 (held out)") + tuple(
            n for n in settings_of if n.endswith((EAGER.format(""), GC.format(""), batched.format(""),
                                                  SEQUENTIAL.format(""), ahead.format("")))):
        run(name, "warm-up", essential=True, **warm)
    # -- calibrate (loop): closed-loop serves per (batch bucket, k) on the fixed-k engine, its cache and graphs ---
    if args.k_by_batch == "auto":
        budget = min(args.calibration_budget_s, args.budget_s - elapsed())
        loop_ranges = None
        cal_iterations = []
        if budget > 0:
            cal = calibrate_loop(engine(base), used, base.graph_batch_sizes, max_new_tokens=args.max_new_tokens,
                                 max_num_seqs=args.max_num_seqs, requests_per_size=args.calibration_requests,
                                 budget_s=budget, min_gain=args.min_gain, max_len=serve_len,
                                 shape=args.calibration_shape, repeats=args.calibration_repeats, tuning=tuning)
            loop_ranges, cal_iterations = cal.schedule(args.max_num_seqs), cal.iterations
            other = other_shape(args.calibration_shape)
            result["loop_calibration"] = {"table": cal.table(), "k_by_batch": format_k_by_batch(loop_ranges),
                                          "shape": args.calibration_shape, "other_shape": other,
                                          "other_k_by_batch": format_k_by_batch(cal.schedule(args.max_num_seqs,
                                                                                             other)),
                                          "uniform": cal.uniform, "wall_s": cal.wall_s, "budget_s": budget,
                                          "skipped": [list(x) for x in cal.skipped]}
            print(f"loop calibration: schedule {format_k_by_batch(loop_ranges)} ({cal.wall_s:.1f} s"
                  + (", one k for every size: a draft model under full overlap" if cal.uniform else "") + ")",
                  flush=True)
        else:
            result["skipped"].append({"part": "calibration-loop", "setting": "adaptive"})
        if args.calibration == "loop" and loop_ranges is not None:
            ranges, source = loop_ranges, "measured (loop calibration)"
        else:
            ranges = step_ranges
            source = "measured (step calibration" + (")" if args.calibration == "step" else
                                                     "; the loop calibration was skipped for the budget)")
        k_by_batch = format_k_by_batch(ranges)
    else:
        ranges, k_by_batch, source = settings.parse_k_by_batch(args.k_by_batch), args.k_by_batch, "given"
        cal_iterations = []
    settings_of["adaptive"] = dict(k_by_batch=k_by_batch, spec_catch_up_max=args.catch_up_max,
                                   spec_off_queue=args.spec_off_queue)
    result.update(k_by_batch=k_by_batch, schedule_source=source, spec_off_queue=args.spec_off_queue)
    print(f"schedule {k_by_batch} ({source})", flush=True)
    other_ranges = None
    if args.shape_controls and "loop_calibration" in result and source.startswith("measured (loop"):
        lcal = result["loop_calibration"]
        other_ranges = settings.parse_k_by_batch(lcal["other_k_by_batch"])
        settings_of[OTHER] = dict(k_by_batch=lcal["other_k_by_batch"], spec_catch_up_max=args.catch_up_max)
        result["other_shape"] = {"shape": lcal["other_shape"], "k_by_batch": lcal["other_k_by_batch"]}
    flush()
    run("adaptive", "warm-up", essential=True, **warm)
    if other_ranges is not None:
        run(OTHER, "warm-up", essential=True, **warm)
    # -- saturation and SLOs ------------------------------------------------------------------------------------
    _, sat = run("off", "saturation", True, arrival="concurrency", max_concurrency=args.max_num_seqs)
    saturation = sat["request_throughput"]
    light, _ = run("off", "light", True, rate=0.1 * saturation, num_requests=min(args.num_requests, 8),
                   warmup_requests=min(args.warmup_requests, 2))
    slo_ttft = args.slo_ttft_ms or 3 * light.record["ttft_ms_p50"]
    slo_tpot = args.slo_tpot_ms or 2 * light.record["tpot_ms_p50"]
    base = replace(base, slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot)
    result.update(saturation_request_throughput=saturation, saturation_mean_batch=sat["mean_batch_size"],
                  slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot)
    flush()
    # -- the rate sweep -----------------------------------------------------------------------------------------
    for frac in (float(x) for x in args.rates.split(",")):
        for rep in range(args.repeats):
            for position, name in enumerate(round_order(list(settings_of), rep)):
                res, rec = run(name, "sweep", rate=frac * saturation, seed=rep)
                if res is not None:
                    rec.update(rate_fraction=frac, repeat=rep, position=position)
                    result["sweep"].append(rec)
                    runs[(name, frac, rep)] = res  # the replay's fit, oracle and reference: every round
                    result["sweep_checks"] = sweep_checks(result["sweep"], fixed)
                    result["prefill_checks"] = control_checks(result["sweep"], fixed, EAGER)
                    result["gc_checks"] = control_checks(result["sweep"], fixed, GC)
                    result["batch_prefill_checks"] = control_checks(result["sweep"], fixed, batched)
                    result["overlap_checks"] = control_checks(result["sweep"], fixed, SEQUENTIAL)
                    result["full_overlap_checks"] = control_checks(result["sweep"], fixed, ahead)
                    if other_ranges is not None:
                        result["shape_checks"] = shape_checks(result["sweep"])
                    flush()
    # -- thresholds +/- 1 at fixed concurrency --------------------------------------------------------------------
    thresholds = [lo for lo, _, _ in ranges[1:] if lo <= args.max_num_seqs]
    result["schedule_thresholds"] = thresholds
    adaptives = ("adaptive",)
    if other_ranges is not None:  # both schedules at the thresholds of either
        result["other_shape"]["thresholds"] = [lo for lo, _, _ in other_ranges[1:] if lo <= args.max_num_seqs]
        thresholds = sorted(set(thresholds) | set(result["other_shape"]["thresholds"]))
        adaptives = ("adaptive", OTHER)
    if not args.no_thresholds:
        for rep in range(args.repeats):
            for t in thresholds:
                for c in (t - 1, t, t + 1):
                    if not 1 <= c <= args.max_num_seqs:
                        continue
                    for name in ("off", fixed) + adaptives:
                        n = max(args.threshold_requests, 3 * c)
                        _, rec = run(name, "thresholds", arrival="concurrency", max_concurrency=c, num_requests=n,
                                     warmup_requests=min(args.warmup_requests, c))
                        if rec is None:
                            continue
                        rec.update(threshold=t, repeat=rep)
                        result["thresholds"].append(rec)
                        result["threshold_checks"] = threshold_checks(result["thresholds"], fixed, args.cliff_pct)
                        if other_ranges is not None:
                            result["threshold_checks_other_shape"] = threshold_checks(
                                result["thresholds"], fixed, args.cliff_pct, adaptive=OTHER)
                        flush()
    def watched(names: str, part: str, watch):
        """One more run of each named setting at the last rate under `watch` (`profiled`, `counted_syncs`): yields
        (name, the run's result, what `watch` recorded); an unknown name is skipped by name."""
        frac = float(args.rates.split(",")[-1])
        for name in [n.strip() for n in names.split(",") if n.strip()]:
            if name not in settings_of:
                result["skipped"].append({"part": part, "setting": name, "why": "no such setting"})
                continue
            # no solo greedy check after these runs: its decodes are not the serving loop's (profiles, syncs)
            res, seen = watch(lambda n=name: run(n, part, True, rate=frac * saturation, seed=0,
                                                 num_requests=args.profile_requests, greedy_check_requests=0),
                              args.device.startswith("cuda"))
            if res is not None:
                yield name, res, seen

    # -- profiles: where a setting's steps spend host time (why adaptive trails the fixed k it runs: 19.5) --------
    if args.profile_settings:
        profiles = {name: op_summary(prof, max(1, len(res.result.iterations)))
                    for name, res, prof in watched(args.profile_settings, "profile", profiled)}
        result["profiles"] = profiles
        (out / "profiles.md").write_text(profile_table(profiles))
    # -- syncs: where the host waits for the GPU, by call site (the profile's cudaStreamSynchronize calls) ---------
    if args.sync_sites:
        syncs = result["syncs"] = {}
        for name, res, sites in watched(args.sync_sites, "syncs", counted_syncs):
            syncs[name] = {"iterations": max(1, len(res.result.iterations)), "total": sum(sites.values()),
                           "sites": dict(sites.most_common())}
            (out / "syncs.md").write_text(sync_table(syncs))
            flush()
        (out / "syncs.md").write_text(sync_table(syncs))
        flush()
    # -- replay -------------------------------------------------------------------------------------------------
    fit = [it for (name, _, _), r in runs.items() if name in ("off", fixed) for it in r.result.iterations]
    if fit:
        # the cost models on the same iterations and traces: the old one (no prefill forwards, no draft-side work)
        # and the new one, so the difference is measured on one run; and the new one fitted with the loop
        # calibration's iterations too (they verify every k in 0..k, so n and [n > 0] come apart)
        models = {"old": replay.fit_costs(fit, replay.OLD_FEATURES, nonnegative=False), "new": replay.fit_costs(fit),
                  "per-step": replay.fit_costs(fit, replay.PER_STEP_FEATURES)}
        if cal_iterations:
            models["new+cal"] = replay.fit_costs(fit + cal_iterations)
        result["replay_costs"] = {m: c.named() for m, c in models.items()}
        result["replay_dropped"] = {m: list(c.dropped) for m, c in models.items()}
        # the adaptive setting's rules as its real run built them (its schedule, and the queue rule if given)
        adaptive_rules = adaptive_for(replace(base, **settings_of["adaptive"]), args.k, ranges)
        # each round r is predicted from round r's fixed-k traces (its own arrivals) and scored against round r's
        # real run; the entry compares the medians over the rounds both have (one run near saturation varies by
        # 10-30 % from round to round), and keeps every round's error
        for name, frac in sorted({(n, f) for n, f, _ in runs if n in ("k=2 (held out)", "adaptive")}):
            reps = sorted(rep for n, f, rep in runs if (n, f) == (name, frac) and (fixed, frac, rep) in runs)
            if not reps:
                continue
            reals = [runs[(name, frac, rep)].record["output_throughput"] for rep in reps]
            first = runs[(name, frac, reps[0])].record
            real = statistics.median(reals)
            entry = {"setting": name, "rate_fraction": frac, "rounds": len(reps), "real_output_throughput": real,
                     "real_round_output_throughput": reals, "real_tpot_ms_p99": statistics.median(
                         runs[(name, frac, rep)].record["tpot_ms_p99"] for rep in reps),
                     "real_draft_prefill_tokens": first.get("draft_prefill_tokens"),
                     "real_draft_catch_up_tokens": first.get("draft_catch_up_tokens")}
            for m, costs in models.items():
                preds = []
                for rep in reps:
                    rec_run = runs[(fixed, frac, rep)].result
                    preds.append(replay.replay(
                        rec_run.states, rec_run.traces, args.k, costs, lambda b: 2, max_num_seqs=args.max_num_seqs,
                        prefill_chunk=base.prefill_chunk, adaptive=adaptive_rules if name == "adaptive" else None,
                        draft_kv=rec_run.draft_kv, catch_up_max=args.catch_up_max if name == "adaptive" else 0,
                        tuning=rec_run.tuning))
                tps = [p["output_throughput"] for p in preds]
                pred = statistics.median(tps)
                pre = REPLAY_MODELS[m][0]
                entry.update({f"{pre}predicted_output_throughput": pred,
                              f"{pre}error": pred / real - 1 if real and pred else None,
                              f"{pre}round_errors": [t / x - 1 if x and t else None for t, x in zip(tps, reals)],
                              f"{pre}predicted_tpot_ms_p99": statistics.median(p["tpot_ms_p99"] for p in preds)})
                if m == "new":  # round 0's, against round 0's real counts (the simulation must match them)
                    entry.update(predicted_draft_prefill_tokens=preds[0]["draft_prefill_tokens"],
                                 predicted_draft_catch_up_tokens=preds[0]["draft_catch_up_tokens"])
            result["replay"].append(entry)
    result["done"] = True
    flush()
    print(table(result))
    return 0


def profiled(fn, cuda: bool):
    """fn() under torch.profiler (CPU activity, and CUDA on a GPU): (fn's first result, the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        res, _ = fn()
    return res, prof


SYNC_WARNING = "synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") says


def counted_syncs(fn, cuda: bool, roots: tuple[str, ...] = ("workbench", "kernels")):
    """fn() with every host-device synchronization PyTorch makes reported (torch.cuda.set_sync_debug_mode("warn") on a
    GPU; a warning whose text holds SYNC_WARNING): (fn's first result, Counter of call sites, `call_site` of each).
    The engine's explicit waits (`HostCopy.get`: a step's read, an iteration's first tokens) wait on an event, which
    the debug mode does not see: they are counted too, as they are called (on a CPU as well)."""
    import traceback
    import warnings
    from collections import Counter

    import torch

    from workbench.engine.step import HostCopy

    sites = Counter()
    real_get = HostCopy.get

    def counted_get(self):
        warnings.warn(f"HostCopy.get waits on an event: counted as a {SYNC_WARNING}")
        return real_get(self)

    def show(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING in str(message):
            sites[call_site(traceback.extract_stack()[:-1], roots)] += 1

    with warnings.catch_warnings():  # restores warnings.showwarning and the filters on the way out
        warnings.simplefilter("always")
        warnings.showwarning = show
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        HostCopy.get = counted_get
        try:
            res, _ = fn()
        finally:
            HostCopy.get = real_get
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    return res, sites


def call_site(stack, roots: tuple[str, ...], depth: int = 2) -> str:
    """The innermost `depth` frames of `stack` (traceback.extract_stack(), outermost first) in a folder named in
    `roots`, innermost first: "workbench/engine/step.py:508 finish_step < workbench/serving/loop.py:382 _decode";
    the innermost frame of all when none is. Decorators' frames (named "wrapper") are left out.

    >>> import traceback
    >>> fs = [traceback.FrameSummary("/r/workbench/serving/loop.py", 382, "_decode"),
    ...       traceback.FrameSummary("/r/workbench/engine/step.py", 67, "wrapper"),
    ...       traceback.FrameSummary("/r/workbench/engine/step.py", 508, "finish_step"),
    ...       traceback.FrameSummary("/usr/lib/torch/_tensor.py", 9, "cpu")]
    >>> call_site(fs, ("workbench",))
    'workbench/engine/step.py:508 finish_step < workbench/serving/loop.py:382 _decode'
    """
    ours = []
    for f in reversed(stack):
        parts = Path(f.filename).parts
        hit = next((i for i in range(len(parts) - 1, -1, -1) if parts[i] in roots), None)
        if hit is not None and f.name != "wrapper":
            ours.append(f"{'/'.join(parts[hit:])}:{f.lineno} {f.name}")
            if len(ours) == depth:
                break
    if not ours and stack:
        f = stack[-1]
        ours.append(f"{f.filename}:{f.lineno} {f.name}")
    return " < ".join(ours)


def sync_table(syncs: dict) -> str:
    """Markdown: per setting its iterations and synchronizations per iteration, then its call sites."""
    if not syncs:
        return "No sync runs.\n"
    lines = ["# Host-device synchronizations made by PyTorch, per serving iteration "
             "(torch.cuda.set_sync_debug_mode)", "", "| setting | iterations | syncs | per iteration |",
             "|---|---|---|---|"]
    lines += [f"| {n} | {s['iterations']} | {s['total']} | {s['total'] / s['iterations']:.2f} |"
              for n, s in syncs.items()]
    for n, s in syncs.items():
        lines += ["", f"## {n}: call sites (innermost first)", "", "| site | syncs | per iteration |", "|---|---|---|"]
        lines += [f"| `{site}` | {c} | {c / s['iterations']:.2f} |" for site, c in s["sites"].items()]
    return "\n".join(lines) + "\n"


def op_summary(prof, steps: int) -> dict:
    """Per op name: calls, host self µs and device self µs, each per serving iteration (`steps`); and the totals."""
    ops = {}
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0.0)
        ops[e.key] = {"calls": e.count / steps, "host_us": e.self_cpu_time_total / steps, "device_us": dev / steps}
    return {"steps": steps, "host_us": sum(o["host_us"] for o in ops.values()),
            "device_us": sum(o["device_us"] for o in ops.values()), "ops": ops}


def profile_diff(a: dict, b: dict, top: int = 15) -> list[tuple[str, float, float]]:
    """The ops whose host µs per iteration differ most from setting a to setting b: (op, calls b - a, µs b - a).

    >>> a = {"ops": {"x": {"calls": 1.0, "host_us": 5.0}, "y": {"calls": 2.0, "host_us": 8.0}}}
    >>> b = {"ops": {"x": {"calls": 1.0, "host_us": 5.5}, "z": {"calls": 3.0, "host_us": 30.0}}}
    >>> profile_diff(a, b)
    [('z', 3.0, 30.0), ('y', -2.0, -8.0), ('x', 0.0, 0.5)]
    """
    names = set(a["ops"]) | set(b["ops"])
    zero = {"calls": 0.0, "host_us": 0.0}
    rows = [(n, b["ops"].get(n, zero)["calls"] - a["ops"].get(n, zero)["calls"],
             b["ops"].get(n, zero)["host_us"] - a["ops"].get(n, zero)["host_us"]) for n in names]
    return sorted(rows, key=lambda r: -abs(r[2]))[:top]


def profile_table(profiles: dict) -> str:
    """Markdown: per profiled setting its iterations and host / device µs per iteration, its top ops, and each later
    setting's largest host-time differences from the first."""
    if not profiles:
        return "No profiled runs.\n"
    lines = ["# Serving profiles (per serving iteration; times include the profiler's own overhead)", "",
             "| setting | iterations | host µs / iteration | device µs / iteration |", "|---|---|---|---|"]
    lines += [f"| {n} | {p['steps']} | {p['host_us']:.1f} | {p['device_us']:.1f} |" for n, p in profiles.items()]
    names = list(profiles)
    for n in names:
        lines += ["", f"## {n}: top ops by host µs per iteration", "", "| op | calls | host µs | device µs |",
                  "|---|---|---|---|"]
        ops = sorted(profiles[n]["ops"].items(), key=lambda kv: -kv[1]["host_us"])[:20]
        lines += [f"| {op} | {o['calls']:.2f} | {o['host_us']:.1f} | {o['device_us']:.1f} |" for op, o in ops]
    for n in names[1:]:
        lines += ["", f"## {n} against {names[0]}: the largest host-time differences per iteration", "",
                  "| op | calls | host µs |", "|---|---|---|"]
        lines += [f"| {op} | {dc:+.2f} | {du:+.1f} |" for op, dc, du in profile_diff(profiles[names[0]],
                                                                                       profiles[n])]
    return "\n".join(lines) + "\n"


EAGER = "{}, eager prefill"  # the control settings of --eager-prefill-controls
OTHER = "adaptive, other shape"  # and of --shape-controls
GC = "{}, gc unfrozen"  # and of --gc-controls
BATCHED = "{{}}, prefill rows {n}"  # and of --batch-prefill-controls N (.format(n=N))
SEQUENTIAL = "{}, step read first"  # and of --overlap-controls


def ahead_label(default: bool) -> str:
    """The control settings of --full-overlap-controls: full overlap the other way from the runs' `default`."""
    return "{}, no full overlap" if default else "{}, full overlap"


def control_checks(sweep: list[dict], fixed: str, control: str = EAGER) -> list[dict]:
    """Per rate and setting (off, fixed k): the setting (captured prefill, frozen GC heap: the defaults) against its
    control (`control`: eager prefill, or the heap left unfrozen) on the same arrivals, over the rounds both
    finished: median output tokens/s and their ratio, the spread over rounds ((max - min) / median), and the
    prefill's median share of the run's wall time. Keys say captured / eager for the setting / its control."""
    out = []
    for frac in sorted({x["rate_fraction"] for x in sweep}):
        for name in ("off", fixed):
            by = {s: {x.get("repeat", 0): x for x in sweep if x["rate_fraction"] == frac and x["setting"] == s}
                  for s in (name, control.format(name))}
            reps = sorted(set(by[name]) & set(by[control.format(name)]))
            if not reps:
                continue
            row = {"rate_fraction": frac, "setting": name, "rounds": len(reps)}
            for tag, s in (("captured", name), ("eager", control.format(name))):
                tps = [by[s][r]["output_throughput"] for r in reps]
                med = statistics.median(tps)
                shares = [by[s][r]["time_prefill_ms"] / (1000 * by[s][r]["wall_s"]) for r in reps
                          if by[s][r].get("time_prefill_ms") is not None and by[s][r].get("wall_s")]
                row.update({f"{tag}_output_throughput": med, f"{tag}_spread": (max(tps) - min(tps)) / med if med else None,
                            f"{tag}_prefill_share": statistics.median(shares) if shares else None,
                            f"{tag}_tpot_ms_p99": statistics.median(by[s][r]["tpot_ms_p99"] for r in reps),
                            f"{tag}_ttft_ms_p99": statistics.median(by[s][r]["ttft_ms_p99"] for r in reps)})
            e = row["eager_output_throughput"]
            row["ratio"] = row["captured_output_throughput"] / e if e else None
            out.append(row)
    return out


# cost model -> (key prefix in a replay entry, column title)
REPLAY_MODELS = {"old": ("old_", "old model"), "new": ("", "new model"),
                 "per-step": ("step_", "new, draft cost per step"),
                 "new+cal": ("cal_", "new, + calibration iterations")}


def round_order(names: list[str], rep: int) -> list[str]:
    """The settings of sweep round `rep`, rotated by the round, so that no setting always runs first or last (in a
    fixed order an order effect of 0.3-0.5 % cannot be told apart from a real one). Each record keeps its `position`.

    >>> [round_order(["off", "k=4", "adaptive"], r) for r in range(3)]
    [['off', 'k=4', 'adaptive'], ['k=4', 'adaptive', 'off'], ['adaptive', 'off', 'k=4']]
    """
    shift = rep % len(names) if names else 0
    return names[shift:] + names[:shift]


def spread(values: list[float]) -> float | None:
    """(max - min) / median of one setting's rounds: how far apart the same setting reads (None below 2 rounds).

    >>> spread([90.0, 100.0, 120.0])
    0.3
    """
    xs = [v for v in values if v is not None]
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 and statistics.median(xs) else None


def medians(rows: list[dict]) -> dict:
    """The median over repeats of each numeric SHOW key (None when no repeat has it), and the repeats counted."""
    med = {"repeats": len(rows)}
    for key in ("request_throughput", "output_throughput", "goodput", "tpot_ms_p99", "ttft_ms_p99",
                "mean_batch_size", "acceptance_rate"):
        xs = [x[key] for x in rows if x.get(key) is not None]
        med[key] = statistics.median(xs) if xs else None
    return med


def sweep_checks(sweep: list[dict], fixed: str) -> list[dict]:
    """Per rate: adaptive's goodput and output tokens/s against the better of off and fixed k (medians over the
    repeats each setting has, compared only over rounds all three finished). The verdict (`adaptive_ge_best`) is
    judged by goodput, or by output tokens/s where fewer than GOODPUT_MIN_SHARE of off's and of fixed k's requests
    met the SLOs (`verdict_key` says which).
    `within_noise`: not above the best (by that metric) but at or above that setting's own lowest round, i.e. inside
    what the same setting reads from round to round; `best_spread` is that setting's spread of it over the rounds."""
    out = []
    for frac in sorted({x["rate_fraction"] for x in sweep}):
        at_rate = [x for x in sweep if x["rate_fraction"] == frac]
        reps = {x.get("repeat", 0) for x in at_rate}
        complete = {r for r in reps if {"off", fixed, "adaptive"} <= {x["setting"] for x in at_rate
                                                                       if x.get("repeat", 0) == r}}
        if not complete:
            continue
        at = {s: medians([x for x in at_rate if x["setting"] == s and x.get("repeat", 0) in complete])
              for s in ("off", fixed, "adaptive")}
        row = {"rate_fraction": frac, "repeats": len(complete)}
        for key in ("goodput", "output_throughput"):
            best = max(at["off"][key] or 0.0, at[fixed][key] or 0.0)
            row[f"{key}_best_of_off_fixed"] = best
            row[f"{key}_adaptive"] = at["adaptive"][key]
            row[f"{key}_ratio"] = at["adaptive"][key] / best if best and at["adaptive"][key] is not None else None
        row["tpot_ms_p99"] = {s: at[s]["tpot_ms_p99"] for s in ("off", fixed, "adaptive")}
        # the verdict's metric: goodput, unless in neither off nor fixed k did GOODPUT_MIN_SHARE of the requests meet
        # the SLOs (an overloaded rate); then output tokens/s: 0 against 0 says nothing (it read "within noise" for
        # every setting), and 15 against 7 req/s of 520 is a handful of requests
        met = max(goodput_share(at[s]) for s in ("off", fixed))
        key = "goodput" if met >= GOODPUT_MIN_SHARE else "output_throughput"
        row["verdict_key"] = key
        row["adaptive_ge_best"] = (row[f"{key}_ratio"] or 0) >= 1.0
        best_setting = max(("off", fixed), key=lambda s: at[s][key] or 0.0)
        rounds = [x[key] for x in at_rate if x["setting"] == best_setting and x.get("repeat", 0) in complete
                  and x.get(key) is not None]
        row["best_setting"], row["best_spread"] = best_setting, spread(rounds)
        row["within_noise"] = not row["adaptive_ge_best"] and len(rounds) > 1 and \
            (at["adaptive"][key] or 0.0) >= min(rounds)
        # paired per metric against that metric's own best setting: when every goodput is 0, "off" wins the tie
        # by goodput, and output tokens/s would then be read against off instead of the better fixed k
        best_by = {key: max(("off", fixed), key=lambda s: at[s][key] or 0.0) for key in PAIRED_KEYS}
        row["output_throughput_best_setting"] = best_by["output_throughput"]
        row.update(paired_rounds(at_rate, complete, best_by))
        out.append(row)
    return out


PAIRED_KEYS = ("goodput", "output_throughput")
GOODPUT_MIN_SHARE = 0.10  # the goal check judges by goodput only where this share of requests met the SLOs


def goodput_share(med: dict) -> float:
    """Goodput / request throughput of a setting's medians: the share of its requests that met the SLOs (0 without).

    >>> goodput_share({"goodput": 15.0, "request_throughput": 520.0}) < GOODPUT_MIN_SHARE
    True
    """
    return (med.get("goodput") or 0.0) / med["request_throughput"] if med.get("request_throughput") else 0.0


def paired_rounds(at_rate: list[dict], complete: set, best: dict[str, str]) -> dict:
    """Adaptive against the best setting round by round: the rounds of one rate replay the same arrivals for every
    setting, so each round's ratio cancels what the round shares (the machine's state, the trace). Per key of `best`
    (key -> the setting best by that key): the ratios in round order and a verdict: "ge" every round at or above 1,
    "lt" every round below, "mixed" (indistinguishable in these rounds), None for one round; and `{key}_paired_p`,
    the one-sided sign test's p-value for the side most rounds fell on (no difference: each round above or below
    with probability 1/2). All of 3 rounds on one side gives only p = 0.125: a verdict of 3 rounds is a direction,
    not a significant result at 5 % (that needs 5 rounds all on one side).

    >>> rows = [dict(setting=s, repeat=r, goodput=g, output_throughput=t) for s, r, g, t in (
    ...     ("adaptive", 0, 9.0, 100.0), ("off", 0, 10.0, 98.0), ("adaptive", 1, 12.0, 110.0), ("off", 1, 11.0, 100.0))]
    >>> got = paired_rounds(rows, {0, 1}, {"goodput": "off", "output_throughput": "off"})
    >>> [round(x, 3) for x in got["goodput_paired"]], got["goodput_paired_verdict"], got["goodput_paired_p"]
    ([0.9, 1.091], 'mixed', 0.75)
    >>> got["output_throughput_paired_verdict"], got["output_throughput_paired_p"]
    ('ge', 0.25)
    """
    out = {}
    for key, best_setting in best.items():
        by = {s: {x.get("repeat", 0): x.get(key) for x in at_rate if x["setting"] == s} for s in ("adaptive",
                                                                                                 best_setting)}
        ratios = [by["adaptive"][r] / by[best_setting][r] for r in sorted(complete)
                  if by["adaptive"].get(r) is not None and by[best_setting].get(r)]
        out[f"{key}_paired"] = ratios
        out[f"{key}_paired_verdict"] = None if len(ratios) < 2 else \
            "ge" if min(ratios) >= 1.0 else "lt" if max(ratios) < 1.0 else "mixed"
        out[f"{key}_paired_p"] = sign_test_p(sum(r < 1.0 for r in ratios), len(ratios)) if len(ratios) > 1 else None
    return out


def sign_test_p(below: int, n: int) -> float:
    """One-sided sign test: P(at least max(below, n - below) of n rounds on one side | each side 1/2).

    >>> sign_test_p(3, 3), sign_test_p(0, 5), sign_test_p(1, 2)
    (0.125, 0.03125, 0.75)
    """
    k = max(below, n - below)
    return sum(math.comb(n, j) for j in range(k, n + 1)) / 2 ** n


def shape_checks(sweep: list[dict]) -> list[dict]:
    """Per rate: adaptive (the loop calibration's schedule) against the same table under the other shape (OTHER),
    medians of output tokens/s over the rounds both finished, and their ratio."""
    out = []
    for frac in sorted({x["rate_fraction"] for x in sweep}):
        by = {s: {x.get("repeat", 0): x["output_throughput"] for x in sweep
                  if x["rate_fraction"] == frac and x["setting"] == s} for s in ("adaptive", OTHER)}
        reps = sorted(set(by["adaptive"]) & set(by[OTHER]))
        if reps:
            a, o = (statistics.median(by[s][r] for r in reps) for s in ("adaptive", OTHER))
            out.append({"rate_fraction": frac, "rounds": len(reps), "adaptive": a, "other_shape": o,
                        "ratio": a / o if o else None})
    return out


def threshold_checks(rows: list[dict], fixed: str, cliff_pct: float, adaptive: str = "adaptive") -> list[dict]:
    """Per threshold: adaptive's output tokens/s at each concurrency against the better of off and fixed k, and the
    change from one concurrency to the next, on medians over the rounds each (concurrency, setting) has; `cliff`
    when either falls by more than cliff_pct %. `adaptive`: the setting checked (OTHER for the shape control)."""
    out = []
    for t in sorted({x["threshold"] for x in rows}):
        keys = {(x["max_concurrency"], x["setting"]) for x in rows if x["threshold"] == t}
        at = {key: medians([x for x in rows if x["threshold"] == t and (x["max_concurrency"], x["setting"]) == key])
              for key in keys}
        cs = sorted({c for c, _ in at})
        points, reasons = [], []
        beyond = False  # a cliff larger than the rounds' own spread at the points it compares
        for c in cs:
            a, off, fx = (at.get((c, s)) for s in (adaptive, "off", fixed))
            if a is None or off is None or fx is None:
                continue
            best = max(off["output_throughput"] or 0.0, fx["output_throughput"] or 0.0)
            ratio = a["output_throughput"] / best if best else None
            points.append({"concurrency": c, "repeats": a["repeats"], "adaptive": a["output_throughput"],
                           "spread": spread([x["output_throughput"] for x in rows if x["threshold"] == t
                                             and (x["max_concurrency"], x["setting"]) == (c, adaptive)]),
                           "best_of_off_fixed": best,
                           "ratio": ratio, "tpot_ms_p99": {"off": off["tpot_ms_p99"], fixed: fx["tpot_ms_p99"],
                                                           "adaptive": a["tpot_ms_p99"]}})
            if ratio is not None and ratio < 1 - cliff_pct / 100:
                reasons.append(f"at concurrency {c} adaptive is {100 * (1 - ratio):.0f} % below the better of off "
                               f"and fixed k")
                beyond |= points[-1]["spread"] is None or 1 - ratio > points[-1]["spread"]
        for p, q in zip(points, points[1:]):
            if p["adaptive"] and q["adaptive"] < p["adaptive"] * (1 - cliff_pct / 100):
                drop = 1 - q["adaptive"] / p["adaptive"]
                noise = max((x for x in (p["spread"], q["spread"]) if x is not None), default=None)
                beyond |= noise is None or drop > noise
                reasons.append(f"adaptive tokens/s drops {100 * drop:.0f} % from concurrency {p['concurrency']} to "
                               f"{q['concurrency']}" + (f" (its rounds spread up to {100 * noise:.0f} %)"
                                                        if noise is not None else ""))
        out.append({"threshold": t, "points": points, "cliff": bool(reasons), "reasons": reasons,
                    "cliff_beyond_noise": bool(reasons) and beyond})
    return out


def _phases(x: dict) -> str:
    return " / ".join(_f(x.get(f"time_{p}_ms")) for p in ("prefill", "draft", "verify"))


def _f(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def table(r: dict) -> str:
    lines = [f"# Serving: {r['preset']} on {r['device']} ({r['dtype']}, graphs {'on' if r['cuda_graphs'] else 'off'}), "
             f"{r['method']} k={r['k']}, adaptive {r['k_by_batch']} ({r['schedule_source']})"
             + (f", no drafts while >= {r['spec_off_queue']} requests wait" if r.get("spec_off_queue") else ""), ""]
    cal = r.get("calibration")
    if cal:
        ks = sorted({x["k"] for x in cal["table"]})
        lines += ["Step calibration: ms per isolated decode step (tokens per ms, all rows) by batch size and draft "
                  "length; tokens per row per step: " + ", ".join(f"k={k}: {_f(cal['mean_tokens'][k], 2)}" for k in ks), "",
                  "| batch | " + " | ".join(f"k={k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
        for b in sorted({x["batch_size"] for x in cal["table"]}):
            cells = {x["k"]: x for x in cal["table"] if x["batch_size"] == b}
            lines.append(f"| {b} | " + " | ".join(f"{_f(cells[k]['step_ms'], 3)} ({_f(cells[k]['tokens_per_ms'], 2)})"
                                                   for k in ks) + " |")
        lines += ["", f"Step calibration's schedule: {cal.get('k_by_batch')}", ""]
    lcal = r.get("loop_calibration")
    if lcal:
        ks = sorted({x["k"] for x in lcal["table"]})
        lines += [f"Loop calibration: output tokens/s of a closed-loop serve at concurrency = batch size, per draft "
                  f"length (* = chosen); {_f(lcal['wall_s'])} s of a {_f(lcal['budget_s'])} s budget"
                  + (f", skipped (b, k): {lcal['skipped']}" if lcal["skipped"] else ""), "",
                  "| batch | " + " | ".join(f"k={k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
        for b in sorted({x["batch_size"] for x in lcal["table"]}):
            cells = {x["k"]: x for x in lcal["table"] if x["batch_size"] == b}
            lines.append(f"| {b} | " + " | ".join(
                "-" if k not in cells or cells[k]["tokens_per_s"] is None else
                f"{_f(cells[k]['tokens_per_s'])}{'*' if cells[k].get('chosen') else ''}" for k in ks) + " |")
        lines += ["", f"Loop calibration's schedule: {lcal['k_by_batch']}" + (
            f" ({lcal['shape']}; {lcal['other_shape']} would be {lcal['other_k_by_batch']})"
            if lcal.get("shape") else ""), ""]
    if "saturation_request_throughput" in r:
        lines += [f"saturation (off, concurrency = max_num_seqs): {_f(r['saturation_request_throughput'], 2)} req/s at "
                  f"mean batch {_f(r['saturation_mean_batch'])}; SLOs TTFT <= {_f(r['slo_ttft_ms'])} ms, "
                  f"TPOT <= {_f(r['slo_tpot_ms'])} ms", ""]
    lines += ["| rate (x sat) | round | setting | req/s | out tok/s | while arriving | drain share | goodput | "
              "p99 TPOT ms | p99 TTFT ms | batch | accept | captures in run | prefill / draft / verify ms | "
              "draft prefill / catch-up tokens |", "|---" * 15 + "|"]
    for x in r["sweep"]:
        lines.append(f"| {x['rate_fraction']} | {x.get('repeat', 0)} | {x['setting']} | "
                     f"{_f(x['request_throughput'], 2)} | {_f(x['output_throughput'])} | "
                     f"{_f(x.get('arrival_window_output_throughput'))} | {_f(x.get('drain_output_share'), 2)} | "
                     f"{_f(x['goodput'], 2)} | {_f(x['tpot_ms_p99'])} | "
                     f"{_f(x['ttft_ms_p99'])} | {_f(x['mean_batch_size'])} | {_f(x['acceptance_rate'], 2)} | "
                     f"{_f(x['graph_captures_in_run'])} | {_phases(x)} | {_f(x.get('draft_prefill_tokens'))} / "
                     f"{_f(x.get('draft_catch_up_tokens'))} |")
    if r.get("sweep_checks"):
        lines += ["", "Goal: adaptive >= the better of off and fixed k at every rate (medians over the rounds all "
                  "three finished):", "",
                  "| rate (x sat) | rounds | goodput adaptive / best | out tok/s adaptive / best | best setting's "
                  "spread over rounds (verdict metric) | met (by) | goodput / out tok/s, round by round (paired) |",
                  "|---|---|---|---|---|---|---|"]
        for c in r["sweep_checks"]:
            verdict = "yes" if c["adaptive_ge_best"] else \
                "no, within noise (above the best setting's lowest round)" if c.get("within_noise") else "no"
            verdict += f" (out tok/s: under {GOODPUT_MIN_SHARE:.0%} of requests met the SLOs)" \
                if c.get("verdict_key") == "output_throughput" else " (goodput)"
            paired = " / ".join(" ".join(_f(v, 3) for v in c.get(f"{key}_paired") or []) + (
                f" ({c[f'{key}_paired_verdict']}, sign test p = {c[f'{key}_paired_p']:.3g})"
                if c.get(f"{key}_paired_verdict") and c.get(f"{key}_paired_p") is not None else
                f" ({c[f'{key}_paired_verdict']})" if c.get(f"{key}_paired_verdict") else "")
                for key in ("goodput", "output_throughput"))
            lines.append(f"| {c['rate_fraction']} | {c.get('repeats', 1)} | {_f(c['goodput_ratio'], 3)} | "
                         f"{_f(c['output_throughput_ratio'], 3)} | {_f(c.get('best_spread'), 3)} | {verdict} | "
                         f"{paired} |")
    for key, title, a, b in (
            ("prefill_checks", "Captured prefill against eager prefill (prefill_graphs on / off; decode captured in "
             "both)", "captured", "eager"),
            ("gc_checks", "Frozen GC heap against an unfrozen one (gc_freeze on / off)", "frozen", "unfrozen"),
            ("batch_prefill_checks", "The default prefill forwards (up to {default} rows) against forwards of up to "
             "{control} rows (--batch-prefill-controls)", "default", "{control} rows"),
            ("overlap_checks", "The prefill enqueued behind the step in flight against the step read first "
             "(--overlap-controls)", "overlapped", "sequential"),
            ("full_overlap_checks", "The default loop against full overlap (each step launched before the previous "
             "one is read) switched the other way (--full-overlap-controls)", "default",
             # (a results.json without the "full_overlap" entry ran ServeTuning's default)
             ahead_label(r.get("full_overlap", {}).get("default", ServeTuning().full_overlap)).format("")[2:])):
        if not r.get(key):
            continue
        title, b = (x.format(**r.get("batch_prefill", {})) for x in (title, b))
        lines += ["", f"{title}, same arrivals, medians over the rounds both finished; spread = (max - min) / median "
                  "over rounds; prefill share = prefill forwards' GPU time / run wall time:", "",
                  f"| rate (x sat) | setting | rounds | out tok/s {a} | {b} | ratio | spread {a} | {b} | "
                  f"prefill share {a} | {b} | p99 TTFT ms {a} | {b} | p99 TPOT ms {a} | {b} |",
                  "|---" * 15 + "|"]
        for c in r[key]:
            lines.append(f"| {c['rate_fraction']} | {c['setting']} | {c['rounds']} | "
                         f"{_f(c['captured_output_throughput'])} | {_f(c['eager_output_throughput'])} | "
                         f"{_f(c['ratio'], 3)} | {_f(c['captured_spread'], 2)} | {_f(c['eager_spread'], 2)} | "
                         f"{_f(c['captured_prefill_share'], 2)} | {_f(c['eager_prefill_share'], 2)} | "
                         f"{_f(c['captured_ttft_ms_p99'])} | {_f(c['eager_ttft_ms_p99'])} | "
                         f"{_f(c['captured_tpot_ms_p99'])} | {_f(c['eager_tpot_ms_p99'])} |")
    if r["thresholds"]:
        lines += ["", f"Thresholds {r['schedule_thresholds']} at concurrency t - 1, t, t + 1 (cliff: a drop of more "
                  f"than {r['cliff_pct']:g} %):", "",
                  "| threshold | concurrency | round | setting | out tok/s | p99 TPOT ms | batch | captures in run | "
                  "prefill / draft / verify ms | draft prefill / catch-up tokens |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for x in sorted(r["thresholds"], key=lambda x: (x["threshold"], x["max_concurrency"], x.get("repeat", 0))):
            lines.append(f"| {x['threshold']} | {x['max_concurrency']} | {x.get('repeat', 0)} | {x['setting']} | "
                         f"{_f(x['output_throughput'])} | {_f(x['tpot_ms_p99'])} | {_f(x['mean_batch_size'])} | "
                         f"{_f(x['graph_captures_in_run'])} | {_phases(x)} | {_f(x.get('draft_prefill_tokens'))} / "
                         f"{_f(x.get('draft_catch_up_tokens'))} |")
        lines.append("")
        for key, who in (("threshold_checks", "adaptive"), ("threshold_checks_other_shape", OTHER)):
            for c in r.get(key, []):
                lines.append(f"- threshold {c['threshold']} ({who}): " + (
                    ("**cliff**" if c.get("cliff_beyond_noise", True) else "cliff by the bar, within the rounds' "
                     "spread") + ": " + "; ".join(c["reasons"]) if c["cliff"] else "no cliff"))
    elif "schedule_thresholds" in r and not r["schedule_thresholds"]:
        lines += ["", "The schedule has no thresholds below max_num_seqs (one draft length for every batch size)."]
    if r.get("shape_checks"):
        o = r["other_shape"]
        lines += ["", f"adaptive (the calibration's schedule {r['k_by_batch']}) against the same table under the "
                  f"{o['shape']} shape ({o['k_by_batch']}), same arrivals, medians over rounds:", "",
                  "| rate (x sat) | rounds | adaptive out tok/s | other shape | ratio |", "|---|---|---|---|---|"]
        lines += [f"| {c['rate_fraction']} | {c['rounds']} | {_f(c['adaptive'])} | {_f(c['other_shape'])} | "
                  f"{_f(c['ratio'], 3)} |" for c in r["shape_checks"]]
    if r["replay"]:
        pct = lambda e: None if e is None else 100 * e  # noqa: E731
        models = [m for m in REPLAY_MODELS if m in r.get("replay_costs", {})]
        lines += ["", "Replay (costs fitted on off + fixed k; acceptance from the fixed-k traces; each round predicted "
                  "from its own arrivals, tok/s and errors are medians over the rounds). Old model: ms = c0 + "
                  "c1 B + c2 B n + c3 P + c4 [n>0]; new: + n, prefill forwards, draft prefill at join and catch-up "
                  "(positions and forwards), fitted >= 0, simulated as the loop runs them (workbench/serving/replay.py)"
                  + ("; new, draft cost per step: the new model keeping [n>0] where the fit cannot tell it from n "
                     "(every drafting step of the fit verified one length; replay.PER_STEP_FEATURES)"
                     if "per-step" in models else "")
                  + ("; new + calibration iterations: the new model fitted with the loop calibration's runs too"
                     if "new+cal" in models else "") + ":", "",
                  "| setting | rate (x sat) | real tok/s | "
                  + " | ".join(f"{REPLAY_MODELS[m][1]} | error" for m in models) + " | real p99 TPOT | predicted (new) | draft prefill / catch-up tokens: real | predicted |",
                  "|---" * (7 + 2 * len(models)) + "|"]
        for e in r["replay"]:
            cells = " | ".join(f"{_f(e.get(REPLAY_MODELS[m][0] + 'predicted_output_throughput'))} | "
                               f"{_f(pct(e.get(REPLAY_MODELS[m][0] + 'error')))} %" for m in models)
            lines.append(f"| {e['setting']} | {e['rate_fraction']} | {_f(e['real_output_throughput'])} | {cells} | "
                         f"{_f(e['real_tpot_ms_p99'])} | {_f(e['predicted_tpot_ms_p99'])} | "
                         f"{_f(e.get('real_draft_prefill_tokens'))} / {_f(e.get('real_draft_catch_up_tokens'))} | "
                         f"{_f(e.get('predicted_draft_prefill_tokens'))} / "
                         f"{_f(e.get('predicted_draft_catch_up_tokens'))} |")
        for m in models:
            pre = REPLAY_MODELS[m][0]
            errs = [abs(e[f"{pre}error"]) for e in r["replay"] if e.get(f"{pre}error") is not None]
            if errs:
                coef = ", ".join(f"{k}: {_f(v, 3)}" for k, v in r["replay_costs"][m].items())
                dropped = r["replay_dropped"][m]
                lines.append(f"- {m} model: largest |error| {_f(100 * max(errs))} %, mean "
                             f"{_f(100 * sum(errs) / len(errs))} %; coefficients (ms) {coef}"
                             + (f"; dropped {dropped}" if dropped else ""))
    if r["skipped"]:
        lines += ["", f"Skipped for the budget ({r['budget_s']:g} s): " + ", ".join(
            f"{s['part']} {s['setting']}" + (f" c={s['max_concurrency']}" if s.get("max_concurrency") else "")
            for s in r["skipped"])]
    lines += ["", f"wall {_f(r.get('wall_s'))} s" + ("" if r.get("done") else " (partial: the script was still "
                                                                             "running, or was stopped)")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
