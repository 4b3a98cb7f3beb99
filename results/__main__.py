"""`python -m results {list,export,compact}`: inspect, export and compact the result store.

    python -m results list [--store DIR]
    python -m results export --format csv|parquet --out FILE [--study NAME] [--store DIR]
    python -m results compact [--study NAME] [--grace SECONDS] [--store DIR]

`export` and `list` read a consistent snapshot even while `compact` runs (or fail with exit 1, never a partial set);
`compact` also removes temp files and orphan traces older than --grace seconds (default 3600).

Exit codes: 0 ok, 2 usage error (including an unknown study name), 1 store error.
"""
from __future__ import annotations

import argparse
import sys
import warnings

from results.export import FORMATS
from results.store import GRACE_S, ResultStore, StoreError, StoreWarning


class _UsageError(Exception):
    pass


def _store(args: argparse.Namespace) -> ResultStore:
    return ResultStore(args.store)


def _check_study(store: ResultStore, study: str | None) -> None:
    if study is not None and not store.has_study(study):
        known = store.studies()
        listing = ", ".join(repr(s) for s in known) if known else "(none: the store is empty)"
        raise _UsageError(f"unknown study {study!r} in {store.root}; known studies: {listing}")


def _report_skips(store: ResultStore) -> None:
    for path, reason in store.last_load_errors:
        print(f"warning: skipped {path}: {reason}", file=sys.stderr)


def cmd_list(args: argparse.Namespace) -> int:
    store = _store(args)
    names = store.studies()
    if not names:
        print(f"{store.root}: no runs")
        return 0
    df = store.load(columns=["study", "status"])
    _report_skips(store)
    study_col = df["study"].fillna("adhoc")
    width = max(len(n) for n in names)
    print(f"{'study':<{width}}  runs  ok  failed")
    for name in names:
        rows = df[study_col == name]
        ok = int((rows["status"] == "ok").fillna(False).sum())
        failed = int((rows["status"] == "failed").fillna(False).sum())
        print(f"{name:<{width}}  {len(rows):>4}  {ok:>2}  {failed:>6}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    store = _store(args)
    _check_study(store, args.study)
    df = store.load(study=args.study)
    _report_skips(store)
    path = store.export(df, args.out, args.format)
    print(f"wrote {len(df)} rows x {df.shape[1]} columns to {path}")
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    store = _store(args)
    _check_study(store, args.study)
    done = store.compact(args.study, grace_s=args.grace)
    _report_skips(store)
    if not done:
        print("nothing to compact")
    for name, rows in done.items():
        print(f"{name}: {rows} rows in one file")
    cleanup = store.last_cleanup
    if any(cleanup.values()):
        print(f"removed {cleanup['tmp_files']} stale temp file(s) and {cleanup['orphan_traces']} orphan trace file(s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", default=None, help="store root (default: $WORKBENCH_STORE or results/store)")
    parser = argparse.ArgumentParser(prog="python -m results", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", parents=[common], help="row counts per study")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("export", parents=[common], help="write all (or one study's) runs to a file")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="output file")
    p.add_argument("--study", default=None, help="one study (\"adhoc\" = runs without a study)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("compact", parents=[common], help="merge each study's per-run files into one")
    p.add_argument("--study", default=None)
    p.add_argument("--grace", type=float, default=GRACE_S,
                   help="seconds: temp files and orphan traces younger than this are kept (a writer may be live)")
    p.set_defaults(func=cmd_compact)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoreWarning)   # printed by _report_skips instead
            code = args.func(args)
    except _UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (StoreError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
