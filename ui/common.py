"""Helpers shared by the pages: where things live, input fields that show their own errors, the job panel.

Validation helpers (`parse_int`, `parse_float`, `check_model_path`) are plain functions returning
`(value, error message | None)` so they are testable without Streamlit; the `*_field` wrappers draw a widget and,
right below it, its error.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import streamlit as st

from ui import jobs

REPO_ROOT = jobs.REPO_ROOT
PYTHON = sys.executable
# choices the engine runs only on a CUDA GPU (fp8 weights need compute capability 8.9+): hidden where none is visible
GPU_ONLY_CHOICES = {"target_quant": ("fp8",), "draft_quant": ("fp8",)}


def store_root() -> Path:
    """The result store the pages read and the jobs write: `$WORKBENCH_STORE` or `<repo>/results/store`."""
    return Path(os.environ.get("WORKBENCH_STORE") or REPO_ROOT / "results" / "store").expanduser()


def get_store():
    from results.store import ResultStore

    return ResultStore(store_root())


def study_storage_url() -> str:
    """Optuna storage every study launched from the UI uses (`$WORKBENCH_STUDY_STORAGE` overrides).

    A JournalStorage file: several worker processes on one machine may share it (SQLite may not).
    """
    env = os.environ.get("WORKBENCH_STUDY_STORAGE")
    if env:
        return env
    return str(REPO_ROOT / "results" / "journal.log")


# ---- parsing (no Streamlit) ------------------------------------------------------------------------------------

def parse_int(text: str, name: str, low: float | None = None,
              high: float | None = None) -> tuple[int | None, str | None]:
    """'4' -> (4, None); 'abc' -> (None, 'k must be a whole number, got 'abc''); out of range -> (None, message).

    >>> parse_int("4", "k", 1, 16), parse_int("x", "k")[1], parse_int("40", "k", 1, 16)[1]
    ((4, None), "k must be a whole number, got 'x'", 'k must be between 1 and 16, got 40')
    """
    text = str(text).strip()
    try:
        value = int(text)
    except ValueError:
        try:
            as_float = float(text)
        except ValueError:
            return None, f"{name} must be a whole number, got {text!r}"
        if not as_float.is_integer():
            return None, f"{name} must be a whole number, got {text!r}"
        value = int(as_float)
    return _range_check(value, name, low, high)


def parse_float(text: str, name: str, low: float | None = None,
                high: float | None = None) -> tuple[float | None, str | None]:
    text = str(text).strip()
    try:
        value = float(text)
    except ValueError:
        return None, f"{name} must be a number, got {text!r}"
    if value != value or value in (float("inf"), float("-inf")):
        return None, f"{name} must be a finite number, got {text!r}"
    return _range_check(value, name, low, high)


def _range_check(value, name, low, high):
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        return None, f"{name} must be between {lo} and {hi}, got {value:g}"
    return value, None


def parse_knob(knob, text: str):
    """A list knob's text (workbench.settings.Knob of kind "ints") -> (value, None) or (None, the registry's message).

    >>> from workbench.settings import KNOBS
    >>> parse_knob(KNOBS["graph_batch_sizes"], "1,2,4"), parse_knob(KNOBS["graph_batch_sizes"], "4,2")[1]
    (((1, 2, 4), None), 'graph_batch_sizes=4,2 must be strictly increasing (sorted, no duplicates), e.g. 2,4')
    """
    from workbench.settings import SettingError

    try:
        value = knob.parse(text)
        knob.check(value)
    except SettingError as e:
        return None, str(e)
    return value, None


def check_model_path(text: str, role: str) -> tuple[Path | None, str | None]:
    """A Hugging Face style model folder (config.json + *.safetensors) or a .gguf file; message names what is wrong."""
    text = str(text).strip()
    if not text:
        return None, f"{role} model path is empty"
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = (REPO_ROOT / path) if (REPO_ROOT / path).exists() else path.resolve()
    if not path.exists():
        return None, f"{role} model path does not exist: {path}"
    if path.is_file():
        if path.suffix != ".gguf":
            return None, f"{role} model file must be a .gguf file or a folder with config.json: {path}"
        return path, None
    if not (path / "config.json").is_file():
        return None, f"{role} model folder has no config.json: {path}"
    if not any(path.glob("*.safetensors")):
        return None, f"{role} model folder has no *.safetensors weights: {path}"
    return path, None


# ---- widgets ------------------------------------------------------------------------------------------------------

class Errors(dict):
    """Field key -> error message of the current run of a page; falsy values are dropped."""

    def add(self, key: str, message: str | None) -> None:
        if message:
            self[key] = message
            st.error(message, icon=":material/error:")

    def __bool__(self) -> bool:
        return any(self.values())


def int_field(label: str, key: str, default: int, errors: Errors, low=None, high=None, help=None,
              name: str | None = None) -> int | None:
    """A text input read as a whole number in [low, high]; a bad value shows its error right below."""
    with st.container():
        text = st.text_input(label, value=str(default), key=key, help=help)
        value, err = parse_int(text, name or label, low, high)
        errors.add(key, err)
    return value


def float_field(label: str, key: str, default: float, errors: Errors, low=None, high=None, help=None,
                name: str | None = None) -> float | None:
    with st.container():
        text = st.text_input(label, value=f"{default:g}", key=key, help=help)
        value, err = parse_float(text, name or label, low, high)
        errors.add(key, err)
    return value


def knob_field(knob, key: str, errors: Errors, default=None, choices: tuple | None = None):
    """The widget a setting of workbench.settings asks for, with its label, help, bounds and default (its quick
    default unless given): a toggle for a boolean, a select box for choices (`choices`: a subset of the knob's, e.g.
    without the GPU-only ones), a text input for a number or a list (a bad value shows its error right below)."""
    default = knob.quick if default is None else default
    if knob.kind == "bool" and knob.auto:  # auto / on / off: "auto" is resolved per device by the engine
        options = knob.allowed
        return st.selectbox(knob.label, options, index=options.index(default) if default in options else 0, key=key,
                            help=knob.help, format_func=knob.format)
    if knob.kind == "bool":
        return st.toggle(knob.label, value=bool(default), key=key, help=knob.help)
    if knob.choices:
        choices = tuple(choices or knob.choices)
        index = choices.index(default) if default in choices else 0
        return st.selectbox(knob.label, choices, index=index, key=key, help=knob.help)
    if knob.kind in ("int", "float"):
        field = int_field if knob.kind == "int" else float_field
        return field(knob.label, key, default, errors, knob.low, knob.high, help=knob.help, name=knob.name)
    with st.container():
        value, err = parse_knob(knob, st.text_input(knob.label, value=knob.format(default), key=key, help=knob.help))
        errors.add(key, err)
    return value


# ---- jobs -------------------------------------------------------------------------------------------------------

STATUS_ICON = {jobs.RUNNING: ":material/progress_activity:", jobs.DONE: ":material/check_circle:",
               jobs.FAILED: ":material/error:", jobs.CANCELLED: ":material/cancel:", jobs.LOST: ":material/help:"}


def fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def job_label(job: jobs.Job) -> str:
    """Stable label of a job for pickers (no status in it: a changing label would reset the widget)."""
    created = time.strftime("%m-%d %H:%M:%S", time.localtime(job.meta.get("created_at", 0)))
    return f"{created} · {job.title}"


def job_panel(job: jobs.Job, key_prefix: str, show_log: bool = True) -> str:
    """Status line, progress bar, cancel button and log tail of one job; returns its status."""
    status = job.status()
    prog = job.progress()
    fraction = prog.get("fraction")
    text = f"{status} · {fmt_duration(job.elapsed_s())}"
    if prog.get("text") and status == jobs.RUNNING:
        text += f" · {prog['text'][:120]}"
    if status == jobs.RUNNING:
        cols = st.columns([5, 1])
        with cols[0]:
            st.progress(min(1.0, max(0.0, fraction or 0.0)), text=text)
        with cols[1]:
            if st.button("Cancel", key=f"{key_prefix}cancel_{job.id}", icon=":material/stop_circle:"):
                job.cancel(wait_s=3.0)
                st.rerun()
    else:
        st.markdown(f"{STATUS_ICON.get(status, '')} **{job.title}**: {text}")
        if status in (jobs.FAILED, jobs.LOST):
            st.error(job.error_text() or status, icon=":material/error:")
    if show_log:
        with st.expander("Log", expanded=False):
            st.code(job.log_tail() or "(no output yet)", language=None)
    return status
