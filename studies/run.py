"""`python -m studies.run`: create (or resume) a study and run it; print the best settings / Pareto front at the end.

    python -m studies.run --preset tiny --study demo --trials 20                      # best_k, local SQLite
    python -m studies.run --preset tiny --study sched --script batch_schedule --trials 24 --batch 1,2,4,8
    python -m studies.run --preset tiny --study front --script pareto --trials 20
    python -m studies.run --study graphs --cuda-graphs off,on --compile off,default --graph-batch-sizes 1,2,4,8
        (search CUDA graphs and torch.compile as two more dimensions; the buckets are a fixed setting)
    python -m studies.run --study big --script pareto --trials 200 --storage journal:///tmp/big.log --workers 0
        (create only; then start `python -m studies.worker` processes, see studies/README.md)

--trials N is the study's total: resuming a study that already has N trials runs none. A trial's run that cannot be
written to the result store (a file, read-only, full) is printed on stdout, the store problem named on stderr, and
the exit status is 3 (the trial is FAIL in the study; run the same command again to redo it). Re-running with another
script, search space, objective or models under the same --study name is refused with the differences listed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna

from studies.objective import POOL, ModelSpec
from studies.scripts import SCRIPTS, UnknownScriptError, get_script
from studies.space import (GLOBAL_KNOBS, METHODS, SEARCH_KNOBS, SETTING_KNOBS, RunSettings, SpaceError, first_value,
                           parse_dim)
from studies.storage import DEFAULT_STORAGE, StorageOpenError, is_parallel_safe, open_storage, redact
from studies.study import (SPEC_KEY, Cancelled, StudyMismatchError, StudyNotFoundError, StudySpec, counted_trials,
                           create_or_resume, preflight, run_trials, sweep_stale_trials)
from workbench.settings import KNOBS, SettingError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", required=True, help="study name (created if new, resumed if it exists)")
    p.add_argument("--script", help=f"one of {', '.join(SCRIPTS)} (default: the study's, or best_k for a new study)")
    p.add_argument("--trials", type=_count("--trials", 1), default=20, help="total number of trials of the study (default 20)")
    p.add_argument("--storage", default=DEFAULT_STORAGE,
                   help=f"Optuna storage URL: sqlite:///F.db, journal:///F.log, postgresql://... (default "
                        f"{DEFAULT_STORAGE})")
    p.add_argument("--store", help="result store root (default: $WORKBENCH_STORE or results/store)")
    p.add_argument("--device", default="cpu", help="device of the in-process worker (cpu, cuda:0, ...)")
    p.add_argument("--workers", type=_count("--workers", 0), default=1,
                   help="1: run trials in this process; 0: only create the study; N > 1: start N "
                        "`studies.worker` processes (needs a journal or PostgreSQL storage)")
    p.add_argument("--devices", help="comma-separated devices for --workers N, assigned round-robin "
                                     "(default: --device for all)")
    p.add_argument("--threads", type=_count("--threads", 1), help="torch CPU threads per worker process (default: torch's choice; "
                                                "on a shared CPU, cores / workers avoids oversubscription)")
    p.add_argument("--export-dir", help="where batch_schedule writes its schedule (default out/schedules/STUDY)")
    p.add_argument("--max-num-seqs", type=_count("--max-num-seqs", 1),
                   help="the serving limit batch_schedule's engine snippets state every batch size up to; above the "
                        "largest bucket speculation is off (default: the largest bucket)")
    p.add_argument("--sampler-seed", type=_count("--sampler-seed", 0, 2**32 - 1), help="seed the sampler (single-process runs only)")
    g = p.add_argument_group("models (stored with the study)")
    g.add_argument("--preset", help="zoo preset (default tiny unless --model is given)")
    g.add_argument("--model", help="target model directory or .gguf file")
    g.add_argument("--draft", help="draft model directory")
    g.add_argument("--draft-head", help="a published EAGLE-1/2 (method eagle) or EAGLE-3 (method eagle3) draft-head "
                   "checkpoint folder")
    g.add_argument("--prompts", help="prompt file (JSONL or question.jsonl); default: the preset's held-out prompts")
    g = p.add_argument_group("search space: a value, a list a,b,c, or a range lo-hi; booleans off/on "
                             "(default: the script's)")
    g.add_argument("--methods", help=f"some of {','.join(METHODS)}")
    for name in SEARCH_KNOBS:
        g.add_argument(KNOBS[name].flag, dest=name, help=KNOBS[name].help.replace("%", "%%"))
    g.add_argument("--sampler", choices=("tpe", "nsga2"), help="default tpe")
    g = p.add_argument_group("run settings, the same for every trial (booleans off/on)")
    for name in SETTING_KNOBS:
        g.add_argument(KNOBS[name].flag, dest=name, type=_setting_type(name),
                       help=f"{KNOBS[name].help} (default {KNOBS[name].format(KNOBS[name].quick)})".replace("%", "%%"))
    return p


def _count(flag: str, low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in low..high, else an error that names the flag, the value and the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            wanted = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: give a whole number {wanted}")
        return value

    return parse


def _setting_type(name: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return KNOBS[name].parse(text)
        except SettingError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _models(args: argparse.Namespace, base: ModelSpec | None) -> ModelSpec:
    base = base or ModelSpec(preset="tiny")
    if args.preset is None and args.model is None and args.draft is None:
        head = getattr(args, "draft_head", None)
        base = base if head is None else dataclasses.replace(base, draft_head=head)
        return base if args.prompts is None else dataclasses.replace(base, prompts=args.prompts)
    return ModelSpec(preset=args.preset, model=args.model, draft=args.draft, prompts=args.prompts,
                     draft_head=getattr(args, "draft_head", None))


def build_spec(args: argparse.Namespace, stored: StudySpec | None) -> StudySpec:
    """The stored spec (when resuming) or the script's defaults, with every flag given on the command line applied."""
    script = get_script(args.script) if args.script else get_script(stored.script if stored else "best_k")
    base = stored if stored is not None and stored.script == script.name else None
    space = base.space if base else script.space
    changes: dict[str, Any] = {name: parse_dim(name, getattr(args, name)) for name in SEARCH_KNOBS
                               if getattr(args, name) is not None}
    if args.methods is not None:
        changes["methods"] = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    space = dataclasses.replace(space, **changes)
    settings = base.settings if base else RunSettings()
    settings = dataclasses.replace(settings, **{n: getattr(args, n) for n in SETTING_KNOBS
                                                if getattr(args, n) is not None})
    return StudySpec(script=script.name, objective=script.objective, space=space, settings=settings,
                     models=_models(args, base.models if base else (stored.models if stored else None)),
                     sampler=args.sampler or (base.sampler if base else "tpe"))


class StoreWriteError(RuntimeError):
    """A trial's run could not be written to the result store (its record was printed on stdout first)."""


class RecordFirstStore:
    """The result store of a study process. A write that fails prints the trial's record on stdout, so the
    measurement is not lost, then raises StoreWriteError naming the store problem: the process ends with exit status 3,
    as `bench` and `serve-bench` do."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def append(self, record: dict[str, Any], traces: Any = None, **parts: Any) -> str:
        from results.store import StoreError

        try:
            return self.store.append(record, traces, **parts)
        except (StoreError, OSError) as e:
            shown = {k: v for k, v in record.items() if k != "telemetry_timeline"}
            print(json.dumps(shown, default=str), flush=True)
            raise StoreWriteError(f"the run of trial {record.get('trial_id')} was not stored (its record is printed "
                                  f"above): {e}") from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def open_store(root: str | None) -> RecordFirstStore:
    from results.store import ResultStore

    return RecordFirstStore(ResultStore(root=root) if root else ResultStore())


def prepare_process(threads: int | None) -> None:
    """Per worker process: torch CPU threads (if given) and quiet Optuna logging (trials are printed by print_trial,
    failed ones with their reason, not as tracebacks)."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna").setLevel(logging.ERROR)


def session_for(spec: StudySpec, device: str):
    """dtype -> this process's (cached) engine session for the study's models on `device`."""
    return lambda dtype: POOL.get(spec.models, device, dtype)


def print_trial(study: optuna.Study, t: optuna.trial.FrozenTrial) -> None:
    """One line per finished trial: its knobs (only those its method reads) and its values or failure reason."""
    c = t.user_attrs.get("config", {})
    used = METHODS[c["method"]].knobs if c.get("method") in METHODS else ()
    knobs = " ".join(f"{k}={c[k]}" for k in ("method", *used, *GLOBAL_KNOBS) if k in c)
    if t.user_attrs.get("requeued_from") is not None:
        knobs += f" (re-run of trial {t.user_attrs['requeued_from']})"
    if t.state.name == "COMPLETE":
        vals = ", ".join(f"{m} {v:.4g}" for m, v in zip(study.metric_names or ["value"], t.values))
        flag = "" if t.user_attrs.get("feasible", True) else "  INFEASIBLE (output differs from autoregressive)"
        print(f"trial {t.number:3d} {knobs}: {vals}{flag}", flush=True)
    else:
        print(f"trial {t.number:3d} {knobs}: {t.state.name} {t.user_attrs.get('error', '')}", flush=True)


CANCELLED_MESSAGE = ("cancelled (SIGTERM): the running trial is FAIL (user attr failed_reason) and its parameters are "
                     "re-queued; run the same command to resume the study")


def spawn_workers(args: argparse.Namespace, n: int) -> list[subprocess.Popen]:
    devices = (args.devices or args.device).split(",")
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "studies.worker", "--storage", args.storage, "--study", args.study,
               "--device", devices[i % len(devices)].strip()]
        if args.store:
            cmd += ["--store", args.store]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        procs.append(subprocess.Popen(cmd))
    return procs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from workbench.harness.bench import BenchError  # the engine's "cannot run this" (e.g. untrained preset, bad model path)

    prepare_process(args.threads)
    try:
        if args.script:
            get_script(args.script)
        if args.workers > 1 and not is_parallel_safe(args.storage):
            raise StorageOpenError(f"--workers {args.workers} needs a storage several processes can share: "
                                   f"{redact(args.storage)!r} is SQLite; use journal:///PATH.log or postgresql://...")
        storage = open_storage(args.storage)
        stored = None
        try:
            study_id = storage.get_study_id_from_name(args.study)
            attrs = storage.get_study_user_attrs(study_id)
            if SPEC_KEY not in attrs:
                raise StudyMismatchError(f"study {args.study!r} exists but was not created by studies.run: pick "
                                         f"another --study name")
            stored = StudySpec.from_dict(attrs[SPEC_KEY])
        except KeyError:
            pass
        spec = build_spec(args, stored)
        if stored is not None:  # refuse a changed space before loading any model
            study, spec = create_or_resume(storage, args.study, spec, target_trials=args.trials,
                                           seed=args.sampler_seed)
        if args.workers == 1:  # load the models before the first trial: a bad model path stops here, not per trial
            spec.validate()
            session = session_for(spec, args.device)(first_value(spec.space.dtype))
            if stored is None:
                preflight(spec, session)  # a new space's extremes must be runnable by these models
        if stored is None:
            study, spec = create_or_resume(storage, args.study, spec, target_trials=args.trials,
                                           seed=args.sampler_seed)
    except (UnknownScriptError, StorageOpenError, StudyMismatchError, StudyNotFoundError, SpaceError,
            BenchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    script = get_script(spec.script)
    sweep_stale_trials(study)  # trials left RUNNING by a killed run must not count toward --trials
    done, _ = counted_trials(study)
    print(f"study {args.study!r} ({script.name}: {script.question}) in {redact(args.storage)}: "
          f"{done} of {args.trials} trials done", flush=True)
    if args.workers == 0:
        print(f"created; join it with: python -m studies.worker --storage {args.storage} --study {args.study} "
              f"--device cuda:0", flush=True)
        return 0
    store = open_store(args.store)
    if args.workers == 1:
        try:
            run_trials(study, spec, store=store, device=args.device, on_trial=print_trial,
                       session_for=session_for(spec, args.device), sweep=False)
        except Cancelled:
            print(CANCELLED_MESSAGE, file=sys.stderr, flush=True)
            return 128 + signal.SIGTERM
        except StoreWriteError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 3
    else:
        codes = [p.wait() for p in spawn_workers(args, args.workers)]
        if any(codes):
            print(f"warning: worker exit codes {codes}", file=sys.stderr)
    print(script.report(study), flush=True)
    if script.export is not None:
        out = Path(args.export_dir or Path("out") / "schedules" / args.study)
        from workbench.serving.config import ServeError

        try:
            written = script.export(study, out, max_num_seqs=args.max_num_seqs)
        except ServeError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        for name, path in written.items():
            print(f"wrote {name}: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
