"""Results page: the result store as a filterable, sortable table; runs side by side; charts; CSV/Parquet download."""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from ui import charts
from ui.common import get_store, store_root

P = "res_"
TABLE_COLUMNS = ["created_at", "status", "method", "k", "batch", "temperature", "speedup_vs_ar", "noisy", "plausible",
                 "acceptance_rate",
                 "mean_accepted_tokens", "tokens_per_s", "ar_tokens_per_s", "ttft_ms", "tpot_ms_p50", "study",
                 "trial_id", "ngram_min", "ngram_max", "max_new_tokens", "preset", "device", "dtype", "device_name",
                 "run_id"]
CONFIG_COLUMNS = ["method", "k", "ngram_min", "ngram_max", "batch", "max_new_tokens", "temperature", "top_k", "top_p",
                  "seed", "dtype", "device", "paged", "kv_block_size", "num_prompts", "repeats", "warmup", "preset",
                  "target_path", "draft_path", "prompts_source", "study", "trial_id", "device_name", "torch_version",
                  "git_commit", "hostname"]
METRIC_COLUMNS = ["status", "error", "speedup_vs_ar", "acceptance_rate", "mean_accepted_tokens", "tokens_per_s",
                  "ar_tokens_per_s", "ttft_ms", "tpot_ms_p50", "tpot_ms_p90", "itl_ms_p50", "time_draft_ms",
                  "time_verify_ms", "time_accept_ms", "time_kv_ms", "peak_mem_mb", "total_new_tokens", "target_steps",
                  "wall_s", "greedy_matches_ar", "speedup_ci_low", "speedup_ci_high", "ar_tokens_per_s_cv",
                  "tokens_per_s_cv", "noisy", "noisy_reason", "plausible", "implausible_reason", "sm_util_pct",
                  "gpu_busy_pct"]
FILTERS = [("study", "Study"), ("method", "Method"), ("preset", "Preset"), ("status", "Status"), ("device", "Device"),
           ("batch", "Batch size")]
HIGHLIGHT = "background-color: rgba(255, 196, 0, 0.30)"


def _missing(v) -> bool:
    if v is None or v is pd.NA or v is pd.NaT:
        return True
    return isinstance(v, float) and math.isnan(v)


def _key(v) -> str:
    """Hashable, comparable form of a cell (lists and NA included)."""
    if isinstance(v, (list, tuple, np.ndarray)):
        return repr([float(x) if isinstance(x, (int, float, np.number)) else x for x in v])
    return "—" if _missing(v) else repr(v)


def load_runs() -> pd.DataFrame:
    store = get_store()
    df = store.load()
    for path, reason in store.last_load_errors[:5]:
        st.warning(f"skipped unreadable file {path}: {reason}")
    return df


def filter_frame(df: pd.DataFrame) -> pd.DataFrame:
    present = [(n, label) for n, label in FILTERS if n in df and not df[n].isna().all()]
    cols = st.columns(max(1, len(present)))
    for col, (name, label) in zip(cols, present):
        # runs without a study are "adhoc" (as in the store's folders); the frame itself keeps them null
        column = df[name].astype("object").where(df[name].notna(), "adhoc") if name == "study" else df[name]
        values = sorted(column.dropna().unique().tolist(), key=lambda v: (str(type(v)), v))
        with col:
            chosen = st.multiselect(label, values, key=f"{P}filter_{name}", placeholder="all")
        if chosen:
            df = df[column.isin(chosen)]
    cols = st.columns([2, 1, 1])
    sortable = [c for c in TABLE_COLUMNS if c in df]
    with cols[0]:
        default = sortable.index("created_at") if "created_at" in sortable else 0
        sort_by = st.selectbox("Sort by", sortable, index=default, key=f"{P}sort_by")
    with cols[1]:
        descending = st.toggle("Descending", value=True, key=f"{P}sort_desc")
    with cols[2]:
        st.session_state.setdefault(f"{P}all_columns", False)
        st.toggle("All columns", key=f"{P}all_columns")
    return df.sort_values(sort_by, ascending=not descending, na_position="last", kind="stable")


def run_label(row: pd.Series) -> str:
    parts = [str(row.get("method"))]
    if not _missing(row.get("k")) and row.get("method") not in ("ar",):
        parts.append(f"k={row.get('k')}")
    parts.append(f"b={row.get('batch')}")
    created = row.get("created_at")
    when = created.strftime("%m-%d %H:%M:%S") if hasattr(created, "strftime") else str(created)
    return f"{when} · {' '.join(parts)} · {str(row.get('run_id'))[-6:]}"


def compare_frame(runs: pd.DataFrame, only_diff: bool) -> tuple[pd.DataFrame, list[str]]:
    """Fields as rows, runs as columns; returns the frame and the names of the fields whose values differ."""
    fields = [c for c in METRIC_COLUMNS + CONFIG_COLUMNS if c in runs.columns]
    table = runs.set_index(runs.apply(run_label, axis=1))[fields].T
    differs = [f for f in fields if len({_key(v) for v in table.loc[f]}) > 1]
    if only_diff:
        table = table.loc[[f for f in fields if f in differs or f in METRIC_COLUMNS]]
    return table, differs


def _style(table: pd.DataFrame, differs: list[str]):
    def cell(v) -> str:
        if isinstance(v, (list, tuple, np.ndarray)):
            return "[" + ", ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in list(v)) + "]"
        if _missing(v):
            return "—"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    shown = table.map(cell)
    return shown.style.apply(lambda row: [HIGHLIGHT if row.name in differs else "" for _ in row], axis=1)


def export_bytes(df: pd.DataFrame, fmt: str) -> bytes:
    """Bytes of `df` written by the store's own export (the same format as `python -m results export`)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"runs.{fmt}"
        get_store().export(df.reset_index(drop=True), path, fmt=fmt)
        return path.read_bytes()


def downloads(df: pd.DataFrame, what: str, key: str) -> None:
    """CSV and Parquet of `df`; the bytes are made only when a button is pressed (deferred download)."""
    cols = st.columns([1, 1, 3])
    for col, fmt, mime in ((cols[0], "csv", "text/csv"), (cols[1], "parquet", "application/octet-stream")):
        with col:
            st.download_button(f"{fmt.upper() if fmt == 'csv' else fmt.title()} ({len(df)} runs)",
                               lambda fmt=fmt: export_bytes(df, fmt), file_name=f"{what}.{fmt}", mime=mime,
                               key=f"{P}{key}_{fmt}", icon=":material/download:", on_click="ignore")


def _add_table_selection() -> None:
    """Rows ticked in the table join the comparison."""
    ids = st.session_state.get(f"{P}view_ids", [])
    rows = st.session_state[f"{P}table"].selection.rows
    picked = [ids[r] for r in rows if r < len(ids)]
    st.session_state[f"{P}compare"] = list(dict.fromkeys(st.session_state.get(f"{P}compare", []) + picked))


def render() -> None:
    st.title("Results")
    st.caption(f"Store: `{store_root()}`")
    try:
        df = load_runs()
    except Exception as exc:  # noqa: BLE001
        st.error(f"cannot read the result store {store_root()}: {exc}")
        return
    if df.empty:
        st.info("The store is empty: start a benchmark on the Run page or a study on the Tune page.")
        return
    view = filter_frame(df)
    st.session_state[f"{P}view_ids"] = view["run_id"].tolist()
    columns = list(view.columns) if st.session_state.get(f"{P}all_columns") else [c for c in TABLE_COLUMNS if c in view]
    st.dataframe(view[columns], hide_index=True, width="stretch", height=min(420, 38 + 35 * len(view)),
                 key=f"{P}table", on_select=_add_table_selection, selection_mode="multi-row",
                 column_config={"speedup_vs_ar": st.column_config.NumberColumn("speedup", format="%.2fx"),
                                "acceptance_rate": st.column_config.NumberColumn("acceptance", format="percent")})
    st.caption(f"{len(view)} of {len(df)} runs · click a column header to sort · tick rows to compare them")
    downloads(view, "runs", "view")

    st.subheader("Compare runs")
    labels = {rid: run_label(row) for rid, row in df.set_index("run_id", drop=False).iterrows()}
    current = [r for r in st.session_state.get(f"{P}compare", []) if r in labels]
    st.session_state[f"{P}compare"] = current
    picked = st.multiselect("Runs to compare", list(labels), key=f"{P}compare", format_func=labels.get,
                            placeholder="pick two or more runs (or tick rows above)")
    if len(picked) >= 1:
        runs = df[df["run_id"].isin(picked)]
        only_diff = st.toggle("Only configuration fields that differ (metrics always shown)", value=True,
                              key=f"{P}only_diff")
        table, differs = compare_frame(runs, only_diff)
        st.dataframe(_style(table, differs), width="stretch", height=min(900, 38 + 35 * len(table)))
        config_diffs = [f for f in differs if f in CONFIG_COLUMNS]
        st.caption("Highlighted: fields whose values differ. Configuration differences: "
                   + (", ".join(config_diffs) if config_diffs else "none"))
        downloads(runs, "compared_runs", "compare")

    st.subheader("Charts")
    st.caption("Over the filtered runs; lines are means per setting, grey dots single runs.")
    cols = st.columns(3)
    for col, (fig, what) in zip(cols, ((charts.speedup_vs_k(view), "speedup vs draft length"),
                                       (charts.speedup_vs_batch(view), "speedup vs batch size"),
                                       (charts.acceptance_vs_temperature(view), "acceptance vs temperature"))):
        with col:
            if fig is None:
                st.info(f"no runs with data for {what}")
            else:
                st.plotly_chart(fig, width="stretch", key=f"{P}chart_{what}")


if __name__ == "__main__":
    render()
