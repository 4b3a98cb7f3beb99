"""The result store: one Parquet file per run, written atomically, read back as one typed pandas frame.

Layout under the root (default `<repo>/results/store`, `$WORKBENCH_STORE` overrides):

    runs/<study>/<run_id>.parquet        one run-record row; <study> is the study name percent-encoded,
                                         "adhoc" for runs without a study
    runs/<study>/compact-<ts>-<rand>.parquet   many rows, written by `compact`; its Parquet key-value metadata
                                         `workbench.replaces` lists the file names it merged (the manifest)
    runs/.generation                     a random token that `compact` replaces before it deletes anything
    runs/.snapshot.lock                  flock: `compact` deletes under it exclusively; a reader's last try shares it
    traces/<run_id>.parquet              per-step rows of one run (run_id, seq, step, drafted, accepted, emitted)

Writers never touch an existing file: each writes `.<name>.<pid>.<rand>.tmp` in the target folder, fsyncs it and
`os.replace`s it to its final name, so any number of processes may append at once and a reader sees either the
whole file or none of it. Readers skip dot-files and anything not ending in `.parquet`.

Snapshot reads while `compact` runs. Compaction (1) writes the merged file with its manifest, atomically, (2)
replaces `runs/.generation`, (3) deletes the files it merged. `load` reads the generation, lists the files, reads
them (compact files first), and reads the generation again. The set is consistent when the generation did not
change and every listed file that vanished is named in the manifest of a compact file it read: a run file written
before the load started is then either read or inside a merged file that was read (a merged file exists before the
generation changes, and the generation changes before any delete). Otherwise `load` tries again; its last try holds
the shared lock (POSIX), so deletes wait for it. A load that still cannot get a consistent set raises StoreError:
it never returns a partial set. A run seen twice (in a merged file and as its own file during the window, or after
a crash between write and delete) is kept once, by run_id. `compact` also removes temp files and orphan traces
(traces of no stored run) older than a grace period (default an hour), so a live writer's files are never touched.

Why our own protocol and not a table format (Delta Lake via `deltalake`, tried 2026-12-01): `deltalake` 1.6.6 installs
here (52 MB wheel, 142 MB installed, Rust) and, in the same writers + compactor + readers trial, appended without
conflicts and read consistent snapshots, but only while compaction did not vacuum: vacuuming the replaced files
right away made 2 of 282 loads fail (FileNotFoundError), so replaced files must stay for a retention period and
the store grows a file per append plus a log entry each until then. Its appends reject a record with a new column
unless `schema_mode="merge"`, and even then a column whose type differs from an earlier row fails the append
(string into float), where each of our per-run files keeps its own types (declared columns are checked on
append). It would also be the one compiled dependency of a leaf package (pandas + pyarrow). Our protocol passes the
same trial (tests/test_results_store_concurrency.py) with about 100 lines, so we keep it; see docs/INTERFACES.md.

`load` casts declared columns to `results.schema` types, fills columns that older files lack with nulls, keeps
undeclared columns. A file that cannot be read is skipped, named in `last_load_errors` and in a `StoreWarning`;
`strict=True` raises `StoreError` instead.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import secrets
import time
import urllib.parse
import uuid
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from results import schema as S

ADHOC = "adhoc"
ENV_VAR = "WORKBENCH_STORE"
GRACE_S = 3600.0   # temp files and orphan traces older than this are a killed writer's leftovers; compact removes them
MANIFEST_KEY = b"workbench.replaces"   # Parquet key-value metadata of a compact file: JSON list of merged file names
LOAD_ATTEMPTS = 4   # tries for a consistent snapshot; the last one holds the shared snapshot lock


class StoreError(RuntimeError):
    """A store operation failed; the message names the file or study and the problem."""


class StoreWarning(UserWarning):
    """A file was skipped (or partly nulled) while loading; see ResultStore.last_load_errors."""


def default_root() -> Path:
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parent / "store"


def new_run_id(now_ns: int | None = None) -> str:
    """32 hex chars: 12 of milliseconds since the epoch (so ids sort by creation time), then 20 random."""
    ms = (time.time_ns() if now_ns is None else now_ns) // 1_000_000
    return f"{ms:012x}{uuid.uuid4().hex[:20]}"


def study_dirname(study: str | None) -> str:
    """Folder name of a study: percent-encoded (reversible, no path separators); None -> "adhoc"."""
    if study is None:
        return ADHOC
    if not isinstance(study, str) or study in ("", ".", ".."):
        raise StoreError(f"invalid study name {study!r}: use a non-empty string other than '.' and '..'")
    return urllib.parse.quote(study, safe="")


def _study_from_dirname(name: str) -> str:
    return urllib.parse.unquote(name)


def _replace_atomic(path: Path, write) -> None:
    """write(tmp), fsync it, then rename it over `path`: a reader sees the old file or the new one, never a part."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:   # the bytes must be on disk before the name points at them
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _write_atomic(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_atomic(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def _write_text_atomic(text: str, path: Path) -> None:
    _replace_atomic(path, lambda tmp: tmp.write_text(text))


def _parquet_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir()
                  if p.name.endswith(".parquet") and not p.name.startswith(".") and p.is_file())


def _utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


class ResultStore:
    """Append-only Parquet store of run records and their per-step traces (see the module docstring)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.last_load_errors: list[tuple[str, str]] = []
        self.last_cleanup: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"ResultStore({str(self.root)!r})"

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def traces_dir(self) -> Path:
        return self.root / "traces"

    @property
    def requests_dir(self) -> Path:
        return self.root / "requests"

    # ------------------------------------------------------------------------------------------------ writing

    def append(self, record: Mapping[str, Any], traces: pd.DataFrame | None = None,
               requests: pd.DataFrame | None = None) -> str:
        """Store one run record (and its trace rows); returns its run_id.

        Fills run_id, created_at and schema_version when missing. The record's declared columns must fit their
        types (`results.schema.SchemaError` otherwise); undeclared keys are kept with inferred types. Traces are
        written first, so a reader that sees the run also finds its traces.
        """
        rec = dict(record)
        if rec.get("run_id") in (None, ""):
            rec["run_id"] = new_run_id()
        run_id = str(rec["run_id"])
        if not all(c.isalnum() or c in "-_." for c in run_id) or run_id.startswith("."):
            raise StoreError(f"run_id {run_id!r} is not usable as a file name (letters, digits, - _ . only)")
        rec["run_id"] = run_id
        if rec.get("created_at") is None:
            rec["created_at"] = _utc_now()
        if rec.get("schema_version") is None:
            rec["schema_version"] = S.SCHEMA_VERSION
        study = rec.get("study")
        folder = self.runs_dir / study_dirname(study)
        table = S.record_to_table(rec)
        try:
            if traces is not None:
                self._write_traces(run_id, traces)
            if requests is not None:  # serving runs: one row per request, beside the traces
                self._write_traces(run_id, requests, self.requests_dir, S.request_specs())
            _write_atomic(table, folder / f"{run_id}.parquet")
        except OSError as exc:   # a store that is a file, read-only, or full: say which store and why
            raise StoreError(f"cannot write run {run_id} to the result store {self.root}: "
                             f"{type(exc).__name__}: {exc}") from exc
        return run_id

    def _write_traces(self, run_id: str, traces: pd.DataFrame, folder: Path | None = None,
                      specs: Mapping[str, S.ColumnSpec] | None = None) -> None:
        tr = traces.copy()
        if "run_id" in tr.columns and tr["run_id"].notna().any() and (tr["run_id"].dropna() != run_id).any():
            raise StoreError(f"traces for run {run_id} carry other run_ids: {sorted(set(tr['run_id'].dropna()))[:3]}")
        tr["run_id"] = run_id
        tr = tr[["run_id"] + [c for c in tr.columns if c != "run_id"]]
        table = S.frame_to_table(tr.reset_index(drop=True), specs or S.trace_specs())
        _write_atomic(table, (folder or self.traces_dir) / f"{run_id}.parquet")

    # ------------------------------------------------------------------------------------------------ reading

    def studies(self) -> list[str]:
        """Names of studies with at least one stored run ("adhoc" holds runs without a study)."""
        if not self.runs_dir.is_dir():
            return []
        return sorted(_study_from_dirname(d.name) for d in self.runs_dir.iterdir()
                      if d.is_dir() and not d.name.startswith(".") and _parquet_files(d))

    def has_study(self, study: str) -> bool:
        return bool(_parquet_files(self.runs_dir / study_dirname(study)))

    def run_files(self, study: str | None = None) -> list[Path]:
        """Parquet files holding run rows: of one study (None = every study; "adhoc" = runs without a study)."""
        if study is not None:
            return _parquet_files(self.runs_dir / study_dirname(study))
        if not self.runs_dir.is_dir():
            return []
        return [p for d in sorted(self.runs_dir.iterdir()) if d.is_dir() and not d.name.startswith(".")
                for p in _parquet_files(d)]

    def _read_tables(self, files: Iterable[Path], specs: Mapping[str, S.ColumnSpec], columns: list[str] | None,
                     strict: bool, errors: list[tuple[str, str]], vanished: list[Path] | None = None,
                     covered: set[Path] | None = None) -> list[pa.Table]:
        """Read and conform `files`; files that vanished go to `vanished`, files named by a manifest to `covered`."""
        tables = []
        for path in files:
            problems: list[str] = []
            try:
                pf = pq.ParquetFile(path)
                if covered is not None:
                    covered.update(path.parent / name for name in _manifest(pf))
                if columns is None:
                    table = pf.read()
                else:
                    present = set(pf.schema_arrow.names)
                    table = pf.read(columns=[c for c in columns if c in present])
                if "run_id" in specs and "run_id" not in table.column_names:
                    raise StoreError("no run_id column")
                if "schema_version" in specs:   # run rows; traces carry no version
                    table = _upgrade(table)
                table = S.conform_table(table, specs, on_problem=problems.append)
            except FileNotFoundError:
                if vanished is not None:
                    vanished.append(path)
                continue   # compacted away between listing and reading; `load` decides whether that is safe
            except Exception as exc:   # noqa: BLE001 - any unreadable file is reported, never fatal by default
                reason = f"{type(exc).__name__}: {exc}"
                if strict:
                    raise StoreError(f"cannot read {path}: {reason}") from exc
                errors.append((str(path), reason))
                continue
            for problem in problems:
                if strict:
                    raise StoreError(f"{path}: {problem}")
                errors.append((str(path), problem))
            tables.append(table)
        return tables

    def _report(self, errors: list[tuple[str, str]]) -> None:
        self.last_load_errors = errors
        if errors:
            lines = "\n".join(f"  {p}: {r}" for p, r in errors[:10])
            more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
            warnings.warn(f"result store {self.root}: {len(errors)} file problem(s), rows skipped or nulled:\n"
                          f"{lines}{more}", StoreWarning, stacklevel=3)

    def load(self, study: str | None = None, columns: Iterable[str] | None = None,
             filters: Mapping[str, Any] | None = None, strict: bool = False) -> pd.DataFrame:
        """All run rows (or one study's), one per run_id, sorted by created_at then run_id.

        columns: only these (plus nothing else); declared columns absent from every file come back as nulls.
        filters: {column: value} keeps rows equal to value; a list/tuple/set value keeps rows in it; None keeps
        nulls. Declared columns always have their declared dtypes (see results.schema).
        """
        specs = S.run_specs()
        wanted = None if columns is None else list(dict.fromkeys(columns))
        read_cols = None
        if wanted is not None:
            extra = ["run_id", "created_at", "schema_version", *(filters or {})]
            read_cols = list(dict.fromkeys(wanted + extra))
        tables, errors = self._read_snapshot(study, specs, read_cols, strict)
        self._report(errors)
        table = S.concat_tables(tables) if tables else pa.table({})
        table = S.complete_table(table, specs)
        df = S.table_to_frame(table, specs)
        if len(df):
            df = df.sort_values(["created_at", "run_id"], kind="stable", na_position="first")
            df = df.drop_duplicates(subset="run_id", keep="last")
        df = _apply_filters(df, filters)
        if wanted is not None:
            df = df[[c for c in wanted if c in df.columns]]
        return df.reset_index(drop=True)

    def _generation(self) -> str:
        try:
            return (self.runs_dir / ".generation").read_text()
        except (FileNotFoundError, NotADirectoryError):
            return ""

    def _read_snapshot(self, study: str | None, specs: Mapping[str, S.ColumnSpec], columns: list[str] | None,
                       strict: bool) -> tuple[list[pa.Table], list[tuple[str, str]]]:
        """Tables of one consistent set of run files (see "Snapshot reads" in the module docstring)."""
        for attempt in range(LOAD_ATTEMPTS):
            last = attempt == LOAD_ATTEMPTS - 1
            with _snapshot_lock(self.runs_dir, shared=True) if last else contextlib.nullcontext():
                before = self._generation()
                # compact files first, so their manifests tell which vanished originals they hold
                files = sorted(self.run_files(study), key=lambda p: not p.name.startswith("compact-"))
                errors: list[tuple[str, str]] = []
                vanished: list[Path] = []
                covered: set[Path] = set()
                tables = self._read_tables(files, specs, columns, strict, errors, vanished, covered)
                lost = [p for p in vanished if p not in covered]
                if not lost and self._generation() == before:
                    return tables, errors
            time.sleep(0.01 * (attempt + 1))
        raise StoreError(f"result store {self.root}: no consistent set of run files after {LOAD_ATTEMPTS} tries "
                         f"(files vanished while reading: {', '.join(p.name for p in lost[:5]) or 'none'}; "
                         f"compaction generation changed: {self._generation() != before}); try again")

    def load_traces(self, run_ids: Iterable[str] | None = None, strict: bool = False) -> pd.DataFrame:
        """Trace rows of the given runs (None = all), typed per results.schema.TRACE_SPECS."""
        return self._load_per_run(self.traces_dir, S.trace_specs(), ["run_id", "seq", "step"], run_ids, strict)

    def load_requests(self, run_ids: Iterable[str] | None = None, strict: bool = False) -> pd.DataFrame:
        """Per-request rows of serving runs (None = all), typed per results.schema.REQUEST_SPECS."""
        return self._load_per_run(self.requests_dir, S.request_specs(), ["run_id", "request"], run_ids, strict)

    def _load_per_run(self, folder: Path, specs, order: list[str], run_ids: Iterable[str] | None,
                      strict: bool) -> pd.DataFrame:
        """The rows of `folder`'s per-run files (`<run_id>.parquet`; run_ids None = all), typed per `specs`, sorted by
        `order`; unreadable files reported as by `load` (or raised when strict)."""
        if run_ids is None:
            files = _parquet_files(folder)
        else:
            files = [folder / f"{r}.parquet" for r in dict.fromkeys(str(r) for r in run_ids)]
            files = [p for p in files if p.is_file()]
        errors: list[tuple[str, str]] = []
        tables = self._read_tables(files, specs, None, strict, errors)
        self._report(errors)
        table = S.complete_table(S.concat_tables(tables) if tables else pa.table({}), specs)
        df = S.table_to_frame(table, specs)
        if len(df):
            df = df.sort_values(order, kind="stable").reset_index(drop=True)
        return df

    # ---------------------------------------------------------------------------------------------- housekeeping

    def compact(self, study: str | None = None, grace_s: float = GRACE_S) -> dict[str, int]:
        """Merge each study's files (per-run and earlier compact files) into one `compact-<ts>-<rand>.parquet`.

        Only files listed at the start are merged; the merged file (with the manifest of what it replaces) is
        written before the generation marker changes and before any original is deleted, so a concurrent `load`
        sees every run (see the module docstring); runs appended meanwhile stay as they are. Unreadable files are
        left in place (and reported as by load). Concurrent compactions of one study are serialised by a lock file
        where fcntl exists. Also removes temp files (`.*.tmp`) and orphan traces (no stored run has their run_id)
        older than `grace_s` seconds; counts go to `last_cleanup`. Returns {study: rows in the new file} for
        studies that had two or more files.
        """
        names = [study] if study is not None else self.studies()
        out = {}
        removed_tmp = _remove_stale_tmp(self.runs_dir, grace_s)
        for name in names:
            folder = self.runs_dir / study_dirname(name)
            with _folder_lock(folder) as got:
                if not got:
                    continue
                removed_tmp += _remove_stale_tmp(folder, grace_s)
                files = _parquet_files(folder)
                if len(files) < 2:
                    continue
                errors: list[tuple[str, str]] = []
                vanished: list[Path] = []
                tables = self._read_tables(files, S.run_specs(), None, False, errors, vanished)
                self._report(errors)
                skipped = {p for p, _ in errors} | {str(p) for p in vanished}
                merged = [p for p in files if str(p) not in skipped]
                if len(merged) < 2:
                    continue
                table = S.complete_table(S.concat_tables(tables))
                df_ids = table.column("run_id").to_pylist()
                if len(set(df_ids)) != len(df_ids):
                    table = _dedupe_table(table)
                manifest = json.dumps(sorted(p.name for p in merged)).encode()
                table = table.replace_schema_metadata({**(table.schema.metadata or {}), MANIFEST_KEY: manifest})
                ts = _utc_now().strftime("%Y%m%dT%H%M%S%fZ")
                _write_atomic(table, folder / f"compact-{ts}-{secrets.token_hex(3)}.parquet")
                with _snapshot_lock(self.runs_dir, shared=False):
                    _write_text_atomic(secrets.token_hex(8), self.runs_dir / ".generation")
                    for p in merged:
                        with contextlib.suppress(FileNotFoundError):
                            p.unlink()
                out[name] = table.num_rows
        removed_tmp += _remove_stale_tmp(self.traces_dir, grace_s)
        self.last_cleanup = {"tmp_files": removed_tmp, "orphan_traces": self._remove_orphan_traces(grace_s)}
        return out

    def _remove_orphan_traces(self, grace_s: float) -> int:
        """Delete trace files older than grace_s whose run is in no run file; none when any run file is unreadable."""
        now = time.time()
        old = []
        for p in _parquet_files(self.traces_dir):
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > grace_s:
                    old.append(p)
        if not old:
            return 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoreWarning)
            known = set(self.load(columns=["run_id"])["run_id"])
        if self.last_load_errors:   # an unreadable run file may hold these runs: keep their traces
            return 0
        removed = 0
        for p in old:
            if p.stem not in known:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed += 1
        return removed

    # ------------------------------------------------------------------------------------------------ export

    def export(self, df: pd.DataFrame, path: str | os.PathLike, fmt: str | None = None) -> Path:
        """Write `df` as CSV or Parquet (fmt None: from the suffix); see results.export."""
        from results.export import export_frame
        return export_frame(df, path, fmt)


def _upgrade(table: pa.Table) -> pa.Table:
    """Bring rows written at older schema versions to SCHEMA_VERSION (rows without a version count as 0).

    Migrated rows carry the current schema_version afterwards, so `compact` persists the upgrade once."""
    n = table.num_rows
    if n == 0:
        return table
    if "schema_version" in table.column_names:
        versions = [0 if v is None else int(v) for v in table.column("schema_version").to_pylist()]
    else:
        versions = [0] * n
    if versions and max(versions) > S.SCHEMA_VERSION:
        raise StoreError(f"written at schema_version {max(versions)}, newer than this code's "
                         f"{S.SCHEMA_VERSION}: update the workbench")
    if all(v == S.SCHEMA_VERSION for v in versions) and "schema_version" in table.column_names:
        return table
    parts = []
    for version in sorted(set(versions)):
        part = table.filter(pa.array([v == version for v in versions])) if len(set(versions)) > 1 else table
        while version < S.SCHEMA_VERSION:
            part = S.MIGRATIONS[version](part)
            version += 1
        current = pa.array([S.SCHEMA_VERSION] * part.num_rows, type=pa.int64())
        if "schema_version" in part.column_names:
            part = part.set_column(part.column_names.index("schema_version"), "schema_version", current)
        else:
            part = part.append_column("schema_version", current)
        parts.append(part)
    return S.concat_tables(parts) if len(parts) > 1 else parts[0]


def _dedupe_table(table: pa.Table) -> pa.Table:
    seen: dict[Any, int] = {}
    for i, rid in enumerate(table.column("run_id").to_pylist()):
        seen[rid] = i
    return table.take(sorted(seen.values()))


def _apply_filters(df: pd.DataFrame, filters: Mapping[str, Any] | None) -> pd.DataFrame:
    if not filters:
        return df
    mask = pd.Series(True, index=df.index)
    for col, value in filters.items():
        if col not in df.columns:
            raise StoreError(f"filter on unknown column {col!r}")
        series = df[col]
        if value is None:
            mask &= series.isna()
        elif isinstance(value, (list, tuple, set, frozenset)):
            mask &= series.isin(list(value)).fillna(False).astype(bool)
        else:
            mask &= (series == value).fillna(False).astype(bool)
    return df[mask]


def _manifest(pf: pq.ParquetFile) -> list[str]:
    """File names a compact file replaces (its `workbench.replaces` metadata); [] for other files."""
    raw = (pf.schema_arrow.metadata or {}).get(MANIFEST_KEY)
    return [str(n) for n in json.loads(raw)] if raw else []


def _remove_stale_tmp(folder: Path, grace_s: float) -> int:
    """Delete `.*.tmp` files in `folder` not modified for grace_s seconds (a live writer's are fresh); returns count."""
    if not folder.is_dir():
        return 0
    now = time.time()
    removed = 0
    for p in folder.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > grace_s:
                p.unlink()
                removed += 1
    return removed


@contextlib.contextmanager
def _snapshot_lock(runs_dir: Path, shared: bool):
    """Blocking flock on `runs/.snapshot.lock`: compact deletes under it exclusively, a reader's last try shares it.

    No-op where fcntl is missing or the file cannot be opened (a read-only store): then retries alone protect reads."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        fh = open(runs_dir / ".snapshot.lock", "a+")
    except OSError:
        yield
        return
    with fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """Non-blocking exclusive lock on `<folder>/.compact.lock`; yields False if another process holds it."""
    try:
        import fcntl
    except ImportError:   # not POSIX: duplicates from concurrent compactions are removed by load's dedupe
        yield True
        return
    if not folder.is_dir():
        yield False
        return
    with open(folder / ".compact.lock", "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
