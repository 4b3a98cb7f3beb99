"""The `serving` study: search the serving knobs for goodput (maximize) and p99 TPOT (minimize) at one request rate,
with what-if replay (workbench/serving/replay.py) as a cheap first fidelity.

    python -m studies.serving --preset tiny --device cpu --study serve-demo --rate 20 --num-requests 8 \\
        --max-new-tokens 16 --replay-trials 40 --real-trials 3

1. **record** (real): two serve-bench runs at the base settings, speculation off and a fixed k = --k; their
   iterations fit the step-cost model, the fixed-k run's per-step traces are the acceptance oracle.
2. **replay** fidelity: --replay-trials Optuna trials (multi-objective TPE), each scored by replay, no engine work.
3. **real** fidelity: the best --real-trials distinct replay trials (their Pareto front first, then by goodput) are
   enqueued with the same params and run for real; their rows go to the result store under the study name (the
   Serving page shows them), with the replay's prediction beside the measurement.

Trees and beams (eagle, redrafter) are searched as the engine serves them: whole or not at all, so each bucket's
param is 0 (off) or 1 (the full tree on; `AdaptiveSpeculation(tree=True)` reads any nonzero k so), and so is
long_context_k; replay then reads the recorded tree steps' accepted lengths as a chain's (positions a later tree
reaches from another root are an estimate, as for a calibration's shorter lengths).

Searched: the draft length per batch-size bucket (`k_by_batch`; equal k everywhere = fixed k, 0 everywhere = off),
switch-off by acceptance (`spec_off_acceptance`, `spec_window`), the context cut-off (`spec_max_context`,
`long_context_k`), switch-off by queue (`spec_off_queue`), `prefill_chunk` and `sched_policy`. Replay models the first
five and chunked prefill (and a draft model's prefill at join and catch-ups, as the loop runs them); it does not model
the KV block pool, so `sched_policy` only matters in the real trials (every trial records `replay_ignores`).
Every trial has user attr `fidelity` = "replay" | "real"; real ones also `replay_goodput`, `replay_tpot_ms_p99`,
`run_id`. The record runs verify one draft length, so the step-cost fit cannot tell a per-node draft cost from a
per-step one (workbench/serving/replay.py); replay trials are scored with the per-node fit and also carry the per-step
fit's prediction (`replay_goodput_per_step`, `replay_tpot_ms_p99_per_step`; real trials keep both), the other end of
what the fit cannot tell: a trial's shorter draft lengths cost less under the first. The report gives both errors.
One study = one rate: resuming a study under another rate or base settings is refused.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from workbench.settings import SCHED_POLICIES

STUDY_KEY = "serving_study"
DIRECTIONS = ("maximize", "minimize")
OBJECTIVES = ("goodput", "tpot_ms_p99")
WINDOWS, CONTEXTS, CHUNKS = (4, 8, 16), (0, 64, 128, 256), (0, 16, 32, 64)
QUEUES = (0, 1, 4, 16)  # spec_off_queue: never, or off while this many requests wait
REPLAY_IGNORES = "sched_policy (no KV block pool in replay)"


class ServingStudyError(ValueError):
    """A serving-study setting that cannot work; the message names it and what to do."""


def buckets(max_num_seqs: int) -> list[tuple[int, int]]:
    """Batch-size buckets (1, 2, 3-4, 5-8, ...) up to max_num_seqs, inclusive.

    >>> buckets(6)
    [(1, 1), (2, 2), (3, 4), (5, 6)]
    """
    out, lo = [], 1
    while lo <= max_num_seqs:
        hi = min(max(lo, 2 * (lo - 1)), max_num_seqs)
        out.append((lo, hi))
        lo = hi + 1
    return out


def distributions(max_num_seqs: int, k_max: int) -> dict:
    dists = {f"k_bs{lo}": IntDistribution(0, k_max) for lo, _ in buckets(max_num_seqs)}
    dists.update(spec_off_acceptance=FloatDistribution(0.0, 0.6, step=0.05),
                 spec_window=CategoricalDistribution(WINDOWS), spec_max_context=CategoricalDistribution(CONTEXTS),
                 long_context_k=IntDistribution(0, k_max), spec_off_queue=CategoricalDistribution(QUEUES),
                 prefill_chunk=CategoricalDistribution(CHUNKS), sched_policy=CategoricalDistribution(SCHED_POLICIES))
    return dists


def k_by_batch_text(params: dict, max_num_seqs: int) -> str:
    """The bucket params as a `--k-by-batch` schedule.

    >>> k_by_batch_text({"k_bs1": 3, "k_bs2": 2, "k_bs3": 0}, 4)
    '1-1:3,2-2:2,3-4:0'
    """
    return ",".join(f"{lo}-{hi}:{params[f'k_bs{lo}']}" for lo, hi in buckets(max_num_seqs))


def is_tree_method(cfg) -> bool:
    """Whether cfg's method is served whole or not at all (workbench.serving.loop.verifies_shorter): eagle and eagle3
    (their K = 1 chains too) and redrafter with beam_width > 1 (one beam is a chain).

    >>> from types import SimpleNamespace as N
    >>> is_tree_method(N(method="eagle", tree_topk=1)), is_tree_method(N(method="redrafter", beam_width=1))
    (True, False)
    """
    return cfg.method in ("eagle", "eagle3") or (cfg.method == "redrafter" and cfg.beam_width > 1)


def config_of(base, params: dict):
    """The ServeConfig a trial's params describe (draft length k = the base's k, the schedule caps it per bucket)."""
    keys = ("spec_off_acceptance", "spec_window", "spec_max_context", "long_context_k", "prefill_chunk",
            "sched_policy")
    return replace(base, k_by_batch=k_by_batch_text(params, base.max_num_seqs), **{k: params[k] for k in keys},
                   spec_off_queue=params.get("spec_off_queue", 0))  # (trials from before it was searched: never)


def check(base, replay_trials: int, real_trials: int) -> None:
    from workbench.serving.config import ServeError, check_config

    try:
        check_config(base)
    except ServeError as e:
        raise ServingStudyError(str(e)) from None
    if base.method == "ar":
        raise ServingStudyError("method 'ar': the serving study searches speculation schedules; use a speculative "
                                "method (draft, ngram, eagle, redrafter)")
    if base.rate <= 0:
        raise ServingStudyError("--rate must be > 0 requests/s: the study optimizes goodput at one arrival rate")
    if base.calibration != "off":
        raise ServingStudyError(f"--calibration {base.calibration}: the study searches k_by_batch itself (each trial "
                                "sets one); drop --calibration")
    if replay_trials < 1 or not 0 <= real_trials <= replay_trials:
        raise ServingStudyError(f"need --replay-trials >= 1 and 0 <= --real-trials <= --replay-trials, got "
                                f"{replay_trials} and {real_trials}")


def pick_for_real(trials: list, n: int) -> list:
    """The replay trials to run for real: their Pareto front (by goodput), then the rest by goodput; distinct
    params only."""
    scored = [t for t in trials if t.values is not None]

    def dominated(a) -> bool:
        return any(b.values[0] >= a.values[0] and b.values[1] <= a.values[1] and b.values != a.values for b in scored)

    front = sorted((t for t in scored if not dominated(t)), key=lambda t: -t.values[0])
    rest = sorted((t for t in scored if dominated(t)), key=lambda t: -t.values[0])
    out, seen = [], set()
    for t in front + rest:
        key = json.dumps(t.params, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out[:n]


def run_study(session, base, *, study_name: str, storage, replay_trials: int, real_trials: int, store=None,
              seed: int = 0, log=print) -> optuna.Study:
    """Record, replay trials, real trials; returns the Optuna study (user attrs as in the module docstring)."""
    from workbench.serving import replay
    from workbench.serving.bench import adaptive_for, serve_bench

    check(base, replay_trials, real_trials)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=study_name, storage=storage, directions=list(DIRECTIONS),
                                sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, replay_trials)),
                                load_if_exists=True)
    spec = {"base": json.loads(json.dumps(asdict(base))), "objectives": list(OBJECTIVES)}
    old = study.user_attrs.get(STUDY_KEY)
    if old is not None and old != spec:
        differs = sorted(k for k in set(old["base"]) | set(spec["base"]) if old["base"].get(k) != spec["base"].get(k))
        raise ServingStudyError(f"study {study_name!r} already exists with other base settings ({', '.join(differs)}):"
                                " choose another --study name")
    study.set_user_attr(STUDY_KEY, spec)

    def run_real(cfg):
        out = serve_bench(session, cfg, study=study_name)
        if store is not None:
            store.append(out.record, out.traces, requests=out.requests)
        return out

    tree = is_tree_method(base)
    log("[serving] record: speculation off and " + ("the full tree" if tree else f"fixed k={base.k}") +
        f" at rate {base.rate:g}")
    off = run_real(replace(base, method="ar"))
    rec = run_real(base)
    fit = off.result.iterations + rec.result.iterations
    costs, per_step = replay.fit_costs(fit), replay.fit_costs(fit, replay.PER_STEP_FEATURES)
    # a tree's k is its node count (what a step verifies); its buckets are off (0) or on (1)
    recorded_k = max((t.num_nodes for t in rec.result.traces), default=0) if tree else base.k
    dists = distributions(base.max_num_seqs, 1 if tree else base.k)

    def predict(cfg, costs=costs) -> dict:
        return replay.replay(rec.result.states, rec.result.traces, recorded_k, costs, max_num_seqs=cfg.max_num_seqs,
                             adaptive=adaptive_for(cfg, recorded_k, tree=tree), prefill_chunk=cfg.prefill_chunk,
                             draft_kv=rec.result.draft_kv, catch_up_max=cfg.spec_catch_up_max,
                             slo_ttft_ms=cfg.slo_ttft_ms, slo_tpot_ms=cfg.slo_tpot_ms,
                             tuning=rec.result.tuning)

    done = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("fidelity") == "replay"]
    for _ in range(max(0, replay_trials - len(done))):
        trial = study.ask(dists)
        trial.set_user_attr("fidelity", "replay")
        trial.set_user_attr("replay_ignores", REPLAY_IGNORES)
        cfg = config_of(base, trial.params)
        pred = predict(cfg)
        if pred["goodput"] is None or pred["tpot_ms_p99"] is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        alt = predict(cfg, per_step)
        trial.set_user_attr("replay_goodput_per_step", alt["goodput"])
        trial.set_user_attr("replay_tpot_ms_p99_per_step", alt["tpot_ms_p99"])
        study.tell(trial, [pred["goodput"], pred["tpot_ms_p99"]])
    replayed = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                if t.user_attrs.get("fidelity") == "replay"]
    real_done = {json.dumps(t.params, sort_keys=True) for t in study.get_trials(deepcopy=False)
                 if t.user_attrs.get("fidelity") == "real"}
    for src in pick_for_real(replayed, real_trials):
        if json.dumps(src.params, sort_keys=True) in real_done:
            continue
        study.enqueue_trial(src.params, user_attrs={"fidelity": "real", "replay_trial": src.number,
                                                    "replay_goodput": src.values[0],
                                                    "replay_tpot_ms_p99": src.values[1],
                                                    "replay_goodput_per_step":
                                                        src.user_attrs.get("replay_goodput_per_step"),
                                                    "replay_tpot_ms_p99_per_step":
                                                        src.user_attrs.get("replay_tpot_ms_p99_per_step")})
        trial = study.ask(dists)
        cfg = config_of(base, trial.params)
        log(f"[serving] real trial {trial.number} (replay trial {src.number}): --k-by-batch {cfg.k_by_batch} "
            f"--prefill-chunk {cfg.prefill_chunk} --sched-policy {cfg.sched_policy}")
        try:
            out = run_real(cfg)
        except Exception as e:  # noqa: BLE001 - a failed real run is a FAILED trial with its reason
            trial.set_user_attr("error", f"{type(e).__name__}: {e}")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        r = out.record
        trial.set_user_attr("run_id", r["run_id"])
        if r.get("goodput") is None or r.get("tpot_ms_p99") is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        study.tell(trial, [r["goodput"], r["tpot_ms_p99"]])
    return study


def _pct(pred, real) -> str:
    return "n/a" if pred is None or not real else f"{(pred - real) / real:+.0%}"


def report(study: optuna.Study, max_num_seqs: int) -> str:
    trials = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    real = [t for t in trials if t.user_attrs.get("fidelity") == "real"]
    replayed = [t for t in trials if t.user_attrs.get("fidelity") == "replay"]
    lines = [f"study {study.study_name!r}: {len(replayed)} replay trials, {len(real)} real trials "
             f"(objectives: maximize goodput, minimize p99 TPOT)"]
    for t in sorted(real, key=lambda t: -t.values[0]):
        p, a = t.params, t.user_attrs
        lines.append(f"  real trial {t.number}: goodput {t.values[0]:.3g} req/s (replay "
                     f"{_pct(a.get('replay_goodput'), t.values[0])}, per-step "
                     f"{_pct(a.get('replay_goodput_per_step'), t.values[0])}), p99 TPOT {t.values[1]:.3g} ms (replay "
                     f"{_pct(a.get('replay_tpot_ms_p99'), t.values[1])}, per-step "
                     f"{_pct(a.get('replay_tpot_ms_p99_per_step'), t.values[1])})"
                     f" · --k-by-batch {k_by_batch_text(p, max_num_seqs)} --spec-off-acceptance "
                     f"{p['spec_off_acceptance']:g} --spec-window {p['spec_window']} --spec-max-context "
                     f"{p['spec_max_context']} --long-context-k {p['long_context_k']} --spec-off-queue "
                     f"{p.get('spec_off_queue', 0)} --prefill-chunk "
                     f"{p['prefill_chunk']} --sched-policy {p['sched_policy']}")
    if not real:
        lines.append("  no real trial completed: the replay front is a prediction only")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from dataclasses import fields

    from workbench.harness.bench_cli import add_knob
    from workbench.serving.config import SERVE_CONFIG_KNOBS, ServeConfig

    p = argparse.ArgumentParser(prog="python -m studies.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", required=True)
    p.add_argument("--storage", default="sqlite:///results/studies.db", help="Optuna storage URL (studies.storage)")
    p.add_argument("--replay-trials", type=int, default=40)
    p.add_argument("--real-trials", type=int, default=3)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--store", help="result store folder (default: results/store or $WORKBENCH_STORE)")
    p.add_argument("--no-store", action="store_true")
    p.add_argument("--sampler-seed", type=int, default=0)
    p.add_argument("--out", help="also write trials.json (every trial: fidelity, params, values, prediction) and "
                   "report.md into this folder")
    real = p.add_argument_group("a real server, relaunched per trial (studies/launch.py)")
    real.add_argument("--launch", metavar="TEMPLATE", help="the server's command line with {name} placeholders for "
                      "the searched settings and {port}, literal braces doubled (see studies/launch.py); replaces "
                      "the in-process search")
    real.add_argument("--search", action="append", default=[], metavar="NAME=V1,V2",
                      help="values of one template placeholder (repeat per placeholder)")
    real.add_argument("--trials", type=int, default=6, help="launches (default 6; all settings when fewer exist)")
    real.add_argument("--launch-timeout", type=float, default=300.0, help="seconds to wait for /health per launch")
    real.add_argument("--launch-logs", default="results/launch_logs", help="folder of each launch's log")
    real.add_argument("--prompts", help="prompt file of the load (default: the preset's prompts)")
    real.add_argument("--model", dest="served_model", help="the served model's name (default: the first of "
                      "/v1/models)")
    base_group = p.add_argument_group("base serving settings (ServeConfig; the searched knobs are overridden)")
    for knob in SERVE_CONFIG_KNOBS:
        add_knob(base_group, knob)
    args = p.parse_args(argv)
    base = ServeConfig(**{f.name: getattr(args, f.name) for f in fields(ServeConfig)})
    if args.launch is not None or args.search:
        return launch_main(args, base)
    try:
        check(base, args.replay_trials, args.real_trials)
    except ServingStudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from results.store import ResultStore
    from studies.storage import StorageOpenError, open_storage
    from workbench.harness.bench import BenchError, BenchSession

    try:
        storage = open_storage(args.storage)
    except StorageOpenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    store = None if args.no_store else ResultStore(args.store) if args.store else ResultStore()
    try:
        kw = {"dtype": args.dtype} if args.dtype else {}
        session = BenchSession.load(preset=args.preset, device=args.device, **kw)
        study = run_study(session, base, study_name=args.study, storage=storage, replay_trials=args.replay_trials,
                          real_trials=args.real_trials, store=store, seed=args.sampler_seed)
    except (BenchError, ServingStudyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_report(study, report(study, base.max_num_seqs), args.out)
    return 0


def write_report(study: optuna.Study, text: str, out: str | None) -> None:
    """The report on stdout; with --out also trials.json (every trial) and report.md there."""
    print(text)
    if out:
        from pathlib import Path

        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "trials.json").write_text(json.dumps(trials_json(study), indent=1, default=str))
        (folder / "report.md").write_text("```\n" + text + "\n```\n")


def launch_main(args, base) -> int:
    """--launch: tune a real server by relaunching it per trial (studies/launch.py)."""
    from pathlib import Path

    from results.store import ResultStore
    from studies.launch import LaunchStudyError, parse_search, report as launch_report, run_launch_study
    from studies.storage import StorageOpenError, open_storage
    from workbench.harness.bench_cli import builtin_prompts
    from workbench.harness.prompts import PromptFileError, load_prompts
    from workbench.serving.config import ServeError, check_config
    from workbench.serving.launcher import LaunchError, LaunchTemplate
    from workbench.zoo import ZooError, resolve_preset

    try:
        if args.launch is None:
            raise LaunchStudyError("--search needs --launch TEMPLATE (the server's command line)")
        template = LaunchTemplate(args.launch)
        space = parse_search(args.search, template)
        check_config(base)
        path = args.prompts or (str(resolve_preset(args.preset).prompts_path) if args.preset else builtin_prompts())
        prompts = [q.text for q in load_prompts(path)]
        storage = open_storage(args.storage)
    except (LaunchError, LaunchStudyError, ServeError, PromptFileError, ZooError, StorageOpenError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    store = None if args.no_store else ResultStore(args.store) if args.store else ResultStore()

    def progress(number, params, rec, error):
        got = (f"goodput {rec['goodput']:.3f} req/s, p99 TPOT {rec['tpot_ms_p99']:.2f} ms" if rec and not error
               else f"failed: {error}")
        print(f"trial {number} {params}: {got}", flush=True)

    try:
        study, pids = run_launch_study(template, space, base, prompts, study_name=args.study, storage=storage,
                                       trials=args.trials, log_dir=Path(args.launch_logs), model=args.served_model,
                                       launch_timeout=args.launch_timeout, store=store, seed=args.sampler_seed,
                                       prompts_source=path, on_trial=progress)
    except LaunchStudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_report(study, launch_report(study, pids), args.out)
    return 0


def trials_json(study: optuna.Study) -> list[dict]:
    return [{"number": t.number, "state": t.state.name, "fidelity": t.user_attrs.get("fidelity"),
             "params": t.params, "values": dict(zip(OBJECTIVES, t.values)) if t.values else None,
             **{k: v for k, v in t.user_attrs.items() if k != "fidelity"}}
            for t in study.get_trials(deepcopy=False)]


if __name__ == "__main__":
    sys.exit(main())
