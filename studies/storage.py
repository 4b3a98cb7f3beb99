"""Storage URL -> Optuna storage, chosen by what the URL says (Optuna's own guidance on parallel workers):

  sqlite:///results/studies.db         one process (the default; SQLite is not for parallel workers)
  journal:///abs/path/study.log         several processes on one machine (JournalStorage + JournalFileBackend);
  journal://relative/path.log           a bare path ending in .log means the same
  postgresql://user@host:port/db        several machines: RDBStorage with heartbeats, so a trial whose worker died is
  (also mysql://...)                    marked FAIL after `grace_period` and re-queued once by
                                        RetryHeartbeatStaleTrialCallback (Optuna 5's name for RetryFailedTrialCallback)

An unreachable or malformed URL raises StorageOpenError naming the URL (password hidden) and the cause.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import optuna

DEFAULT_STORAGE = "sqlite:///results/studies.db"
SPEC_KEY = "workbench_spec"  # the study user attr its StudySpec is stored under (studies.study writes it)
HEARTBEAT_INTERVAL_S = 10
GRACE_PERIOD_S = 60
MAX_RETRY = 2
RDB_SCHEMES = ("postgresql", "postgres", "mysql")


class StorageOpenError(RuntimeError):
    """The Optuna storage URL could not be opened; the message names it."""


def redact(url: str) -> str:
    """Hide a password in a URL: postgresql://u:secret@h/db -> postgresql://u:***@h/db."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def journal_path(url: str) -> Path | None:
    """The log file of a journal URL (journal:///abs.log, journal://rel.log, or a bare *.log path), else None."""
    if url.startswith("journal://"):
        return Path(url[len("journal://"):])
    if "://" not in url and url.endswith(".log"):
        return Path(url)
    return None


def is_parallel_safe(url: str) -> bool:
    """Whether several worker processes may share this storage."""
    return not url.startswith("sqlite")


def open_storage(url: str | None, *, heartbeat_interval: int = HEARTBEAT_INTERVAL_S,
                 grace_period: int = GRACE_PERIOD_S) -> optuna.storages.BaseStorage:
    url = url or DEFAULT_STORAGE
    path = journal_path(url)
    try:
        if path is not None:
            if not path.parent.exists():
                raise StorageOpenError(f"journal storage {url!r}: folder {str(path.parent)!r} does not exist")
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            return JournalStorage(JournalFileBackend(str(path)))
        scheme = url.split("://", 1)[0].split("+", 1)[0] if "://" in url else ""
        if scheme == "sqlite":
            db = url[len("sqlite:///"):]
            if db and db != ":memory:":
                Path(db).parent.mkdir(parents=True, exist_ok=True)
            return optuna.storages.RDBStorage(url)
        if scheme in RDB_SCHEMES:
            # heartbeats and the retry callback are flagged experimental by Optuna; they are what we want here
            warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
            connect_args = {"connect_timeout": 10} if scheme.startswith("postgres") else {}
            return optuna.storages.RDBStorage(
                url,
                engine_kwargs={"pool_pre_ping": True, "connect_args": connect_args},
                heartbeat_interval=heartbeat_interval,
                grace_period=grace_period,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY),
            )
        raise StorageOpenError(
            f"storage URL {redact(url)!r} is not supported: use sqlite:///FILE.db, journal:///FILE.log (or a path "
            f"ending .log), or postgresql://USER@HOST:PORT/DB")
    except StorageOpenError:
        raise
    except Exception as e:  # sqlalchemy OperationalError, ArgumentError, ImportError, OSError ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StorageOpenError(f"cannot open Optuna storage {redact(url)!r}: {reason}") from e

