"""`python -m studies.worker --storage URL --study NAME --device cuda:N [--trials N]`: one worker of an existing study.

The study (its script, search space, run settings, models) was created by `python -m studies.run ... --workers 0`;
this process loads the models once on its device and runs trials until it has run --trials of them, or the study
reached its total (`studies.run --trials`). Start one per GPU, on as many machines as share the storage; see
studies/README.md.
"""
from __future__ import annotations

import argparse
import signal
import sys


from studies.run import CANCELLED_MESSAGE, StoreWriteError, open_store, prepare_process, print_trial, session_for
from studies.space import first_value
from studies.storage import StorageOpenError, open_storage, redact
from studies.study import (Cancelled, StudyMismatchError, StudyNotFoundError, counted_trials, create_or_resume,
                           load_study, run_trials, sweep_stale_trials)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", required=True, help="the study's Optuna storage URL (journal:///F.log, postgresql://...)")
    p.add_argument("--study", required=True, help="name of an existing study")
    p.add_argument("--device", default="cpu", help="this worker's device: cpu, cuda:0, cuda:1, ...")
    p.add_argument("--trials", type=int, help="run at most this many trials (default: until the study's total)")
    p.add_argument("--store", help="result store root (default: $WORKBENCH_STORE or results/store)")
    p.add_argument("--threads", type=int, help="torch CPU threads for this process (default: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no line per trial")
    p.add_argument("--sweep", action="store_true",
                   help="only fail and re-queue the study's RUNNING trials whose worker on this host is gone, then exit "
                        "(what every worker does before its first trial; the dashboard runs it after a Cancel)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from workbench.harness.bench import BenchError

    prepare_process(args.threads)
    if args.sweep:
        try:
            failed = sweep_stale_trials(load_study(open_storage(args.storage), args.study))
        except (StorageOpenError, StudyMismatchError, StudyNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"study {args.study!r}: {len(failed)} stale trial(s) failed and re-queued", flush=True)
        return 0
    try:
        storage = open_storage(args.storage)
        study, spec = create_or_resume(storage, args.study, None)
        session_for(spec, args.device)(first_value(spec.space.dtype))  # models load once, before the first trial
    except (StorageOpenError, StudyMismatchError, StudyNotFoundError, BenchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = study.user_attrs.get("target_trials")
    if args.trials is None and target is None:
        print(f"error: study {args.study!r} has no total number of trials; give --trials", file=sys.stderr)
        return 2
    store = open_store(args.store)
    try:
        ran = run_trials(study, spec, store=store, device=args.device, n_trials=args.trials,
                         on_trial=None if args.quiet else print_trial, session_for=session_for(spec, args.device))
    except Cancelled:
        print(CANCELLED_MESSAGE, file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    except StoreWriteError as e:  # the trial's record is printed above: the measurement is not lost
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    done, _ = counted_trials(study)
    print(f"worker on {args.device} ran {ran} trials of study {args.study!r} in {redact(args.storage)} "
          f"({done} of {target if target is not None else '?'} done)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
