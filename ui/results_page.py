"""Results page: the result store as a filterable, sortable table; runs side by side; charts; CSV/Parquet download."""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from ui import analysis, charts
from ui.common import get_store, store_root

P = "res_"
TABLE_COLUMNS = ["created_at", "status", "flags", "method", "k", "batch", "temperature", "speedup_vs_ar",
                 "speedup_interval", "noisy", "plausible", "acceptance_rate",
                 "mean_accepted_tokens", "tokens_per_s", "ar_tokens_per_s", "ttft_ms", "tpot_ms_p50", "study",
                 "trial_id", "ngram_min", "ngram_max", "max_new_tokens", "preset", "device", "dtype", "device_name",
                 "run_id"]
CONFIG_COLUMNS = ["method", "k", "ngram_min", "ngram_max", "batch", "max_new_tokens", "temperature", "top_k", "top_p",
                  "seed", "dtype", "device", "paged", "kv_block_size", "num_prompts", "repeats", "warmup", "preset",
                  "target_path", "draft_path", "draft_head", "draft_head_layout", "draft_head_dtype",
                  "draft_head_params", "draft_vocab_size", "prompts_source", "study", "trial_id", "device_name",
                  "torch_version", "git_commit", "hostname"]
METRIC_COLUMNS = ["status", "error", "speedup_vs_ar", "acceptance_rate", "mean_accepted_tokens", "tokens_per_s",
                  "ar_tokens_per_s", "ttft_ms", "tpot_ms_p50", "tpot_ms_p90", "itl_ms_p50", "time_draft_ms",
                  "time_verify_ms", "time_accept_ms", "time_kv_ms", "peak_mem_mb", "total_new_tokens", "target_steps",
                  "wall_s", "greedy_matches_ar", "speedup_ci_low", "speedup_ci_high", "ar_tokens_per_s_cv",
                  "tokens_per_s_cv", "noisy", "noisy_reason", "plausible", "implausible_reason", "sm_util_pct",
                  "gpu_busy_pct"]
FILTERS = [("study", "Study"), ("method", "Method"), ("preset", "Preset"), ("status", "Status"), ("device", "Device"),
           ("batch", "Batch size")]
HIGHLIGHT = "background-color: rgba(255, 196, 0, 0.30)"  # a metric that moved beyond 5 % and the runs' spread
CONFIG_HIGHLIGHT = "background-color: rgba(90, 160, 255, 0.20)"  # a setting that differs
TRUST_TEXT = ("speedup_interval", "flags")  # display-only columns (analysis.with_trust_columns), not exported
MAX_RUN_LINES = 12  # per-run charts (acceptance by position, latency percentiles) show at most this many runs
MAX_BEAM_RUNS = 40  # diversity by prompt category reads the traces of at most this many beam runs


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
    if row.get("method") == "redrafter":  # beams: their shape, not k (which a beam drafter does not read)
        parts.append(f"W={row.get('beam_width')} L={row.get('beam_length')}")
    elif not _missing(row.get("k")) and row.get("method") not in ("ar",):
        parts.append(f"k={row.get('k')}")
    if not _missing(row.get("batch")):  # serving runs have none (max_num_seqs instead)
        parts.append(f"b={row.get('batch')}")
    created = row.get("created_at")
    when = created.strftime("%m-%d %H:%M:%S") if hasattr(created, "strftime") else str(created)
    return f"{when} · {' '.join(parts)} · {str(row.get('run_id'))[-6:]}"


def _short(label: str) -> str:
    """The run-id tail of a run label ('... · 3fa9c1'), what the delta columns are named after."""
    return label.rsplit(" · ", 1)[-1]


def compare_frame(runs: pd.DataFrame, only_diff: bool, baseline_id: str | None = None):
    """Fields as rows, runs as columns (the baseline first), then per other run a `Δ <id>` (run - baseline) and a
    `ratio <id>` (run / baseline) column for numeric fields. Returns (table, the fields whose values differ, the
    (field, column) cells to highlight: metrics that moved beyond 5 % and beyond either run's own spread)."""
    if baseline_id is None or baseline_id not in set(runs["run_id"]):
        baseline_id = runs["run_id"].iloc[0]
    runs = pd.concat([runs[runs["run_id"] == baseline_id], runs[runs["run_id"] != baseline_id]])
    fields = [c for c in METRIC_COLUMNS + CONFIG_COLUMNS if c in runs.columns]
    labels = runs.apply(run_label, axis=1)
    table = runs.set_index(labels)[fields].T.astype("object")
    differs = [f for f in fields if len({_key(v) for v in table.loc[f]}) > 1]
    if only_diff:
        table = table.loc[[f for f in fields if f in differs or f in METRIC_COLUMNS]]
    marked: set[tuple[str, str]] = set()
    numeric = [f for f in table.index if f not in ("status", "error", "noisy", "plausible", "greedy_matches_ar")]
    deltas = analysis.compare_deltas(runs, baseline_id, numeric)
    for rid, label in zip(runs["run_id"].iloc[1:], labels.iloc[1:]):
        d = deltas[deltas["run_id"] == rid].set_index("field")
        dcol, rcol = f"Δ {_short(label)}", f"ratio {_short(label)}"
        table[dcol] = [d.at[f, "delta"] if f in d.index else None for f in table.index]
        table[rcol] = [d.at[f, "ratio"] if f in d.index else None for f in table.index]
        for f in d.index[d["significant"]]:
            marked |= {(f, label), (f, dcol), (f, rcol)}
    return table, differs, marked


def _cell(v) -> str:
    if isinstance(v, (list, tuple, np.ndarray)):
        return "[" + ", ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in list(v)) + "]"
    if _missing(v):
        return "—"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _style(table: pd.DataFrame, differs: list[str], marked: set[tuple[str, str]]):
    shown = table.map(_cell)

    def css(frame: pd.DataFrame) -> pd.DataFrame:
        out = pd.DataFrame("", index=frame.index, columns=frame.columns)
        for f in frame.index:
            if f in differs and f in CONFIG_COLUMNS:
                out.loc[f, :] = CONFIG_HIGHLIGHT
        for f, col in marked:
            if f in out.index and col in out.columns:
                out.loc[f, col] = HIGHLIGHT
        return out

    return shown.style.apply(css, axis=None)


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


def best_section(view: pd.DataFrame) -> None:
    """The best speedup among the filtered runs, flagged (noisy / implausible) runs never counted."""
    best, flagged = analysis.best_run(view)
    skipped = f" ({flagged} flagged run(s) not considered)" if flagged else ""
    if best is None:
        st.info("No trusted run with a speedup in this view: a best run needs status ok and no noisy / implausible "
                f"flag{skipped}.", icon=":material/info:")
        return
    speedup = analysis.as_float(best.get("speedup_vs_ar"))
    if speedup is not None and speedup < 1.0:  # the best is still a slowdown: never a green "best" box
        st.warning(f"Slowdown: even the best trusted run is slower than autoregressive decoding: "
                   f"**{analysis.speedup_text(best)}** · {run_label(best)}{skipped}", icon=":material/trending_down:")
        return
    st.success(f"Best trusted speedup: **{analysis.speedup_text(best)}** · {run_label(best)}{skipped}",
               icon=":material/verified:")


def flags_note(view: pd.DataFrame) -> None:
    flagged = view[analysis.flag_mask(view)]
    if flagged.empty:
        return
    with st.expander(f":material/warning: {len(flagged)} flagged run(s): noisy or implausible, excluded from "
                     "best / heatmap / lines", expanded=False):
        for _, row in flagged.head(20).iterrows():
            st.markdown(f"- {run_label(row)}: {analysis.flag_text(row)}")


def compare_section(df: pd.DataFrame) -> None:
    st.subheader("Compare runs")
    labels = {rid: run_label(row) for rid, row in df.set_index("run_id", drop=False).iterrows()}
    current = [r for r in st.session_state.get(f"{P}compare", []) if r in labels]
    st.session_state[f"{P}compare"] = current
    picked = st.multiselect("Runs to compare", list(labels), key=f"{P}compare", format_func=labels.get,
                            placeholder="pick two or more runs (or tick rows above)")
    if len(picked) < 1:
        return
    runs = df[df["run_id"].isin(picked)]
    cols = st.columns([2, 3])
    with cols[0]:
        if st.session_state.get(f"{P}baseline") not in picked:
            st.session_state[f"{P}baseline"] = picked[0]
        baseline = st.selectbox("Baseline", picked, key=f"{P}baseline", format_func=labels.get,
                                help="Δ columns: run - baseline; ratio columns: run / baseline")
    with cols[1]:
        only_diff = st.toggle("Only configuration fields that differ (metrics always shown)", value=True,
                              key=f"{P}only_diff")
    table, differs, marked = compare_frame(runs, only_diff, baseline)
    st.dataframe(_style(table, differs, marked), width="stretch", height=min(900, 38 + 35 * len(table)))
    config_diffs = [f for f in differs if f in CONFIG_COLUMNS]
    moved = sorted({f for f, _ in marked})
    st.caption(f"Yellow: metrics that differ from the baseline by more than {analysis.REL_TOLERANCE:.0%} and more "
               "than either run's own spread (speedup interval, tokens/s CV); blue: settings that differ. "
               "Metrics beyond the spread: " + (", ".join(moved) if moved else "none")
               + ". Configuration differences: " + (", ".join(config_diffs) if config_diffs else "none"))
    flagged = runs[analysis.flag_mask(runs)]
    if not flagged.empty:
        st.warning("Flagged among the compared runs: " + "; ".join(
            f"{labels[r['run_id']]}: {analysis.flag_text(r)}" for _, r in flagged.iterrows()),
            icon=":material/warning:")
    downloads(runs.drop(columns=list(TRUST_TEXT), errors="ignore"), "compared_runs", "compare")


def _chart(fig, missing: str, key: str) -> None:
    if fig is None:
        st.info(missing)
    else:
        st.plotly_chart(fig, width="stretch", key=f"{P}chart_{key}")


def charts_section(view: pd.DataFrame, df: pd.DataFrame) -> None:
    st.subheader("Charts")
    st.caption("Over the filtered runs. Lines are medians of trusted runs, one per combination of the settings "
               "that differ; dots are single runs with their 95 % interval (hollow: no interval, one repeat); red "
               "crosses are flagged runs, left out of lines and heatmaps.")
    cols = st.columns(2)
    with cols[0]:
        _chart(charts.speedup_vs_k(view), "no runs with data for speedup vs draft length", "speedup_k")
    with cols[1]:
        _chart(charts.speedup_vs_batch(view), "no runs with data for speedup vs batch size", "speedup_batch")

    st.markdown("**Speedup heatmap: draft length k x batch size**")
    methods = sorted(m for m in view["method"].dropna().unique() if m != "ar") if "method" in view else []
    if not methods:
        st.info("no speculative runs in this view")
    else:
        cols = st.columns(min(2, len(methods)))
        for i, method in enumerate(methods):
            with cols[i % len(cols)]:
                _chart(charts.speedup_heatmap(view, method),
                       f"{method}: no trusted run with a speedup (flagged runs are left out)", f"heat_{method}")

    picked = [r for r in st.session_state.get(f"{P}compare", []) if r in set(df["run_id"])]
    runs = df[df["run_id"].isin(picked)] if picked else view.head(MAX_RUN_LINES)
    where = "the compared runs" if picked else f"the first {len(runs)} runs of the table (pick runs to compare " \
                                               "to choose)"
    st.markdown(f"**Per run: acceptance by position and latency** · {where}")
    labels = {r["run_id"]: run_label(r) for _, r in runs.iterrows()}
    cols = st.columns(3)
    with cols[0]:
        _chart(charts.acceptance_by_position_runs(runs, labels), "no acceptance-by-position data", "acc_pos")
    with cols[1]:
        _chart(charts.latency_percentiles(runs, labels, "tpot"), "no TPOT percentiles", "tpot")
    with cols[2]:
        _chart(charts.latency_percentiles(runs, labels, "itl"), "no ITL percentiles", "itl")
    _chart(charts.acceptance_vs_temperature(view), "no runs with data for acceptance vs temperature", "acc_temp")


def trees_section(view: pd.DataFrame, df: pd.DataFrame) -> None:
    """Draft trees and beams: acceptance by depth per method, acceptance by node rank per run, and beam diversity /
    pairwise disagreement against beam width, coloured by method or by prompt category (from the runs' traces)."""
    st.subheader("Trees and beams")
    st.caption("Acceptance by depth: fraction of steps whose accepted path reached each depth, mean over the runs of a "
               "method (and draft shape). Node rank: a node's place among its siblings by draft score (0 = best); "
               "bars count accepted nodes of each rank per step (they sum to the accepted path length; chains are "
               "rank 0 only). Beam diversity = distinct prefix-tree nodes / (W x L); pairwise disagreement = "
               "fraction of depths where two beams' tokens differ, averaged over beam pairs.")
    picked = [r for r in st.session_state.get(f"{P}compare", []) if r in set(df["run_id"])]
    ranked = df[df["run_id"].isin(picked)] if picked else view
    if "acceptance_by_rank" in ranked:
        ranked = ranked[[bool(analysis._values(v)) for v in ranked["acceptance_by_rank"]]]
    ranked = ranked.head(MAX_RUN_LINES)
    labels = {r["run_id"]: run_label(r) for _, r in ranked.iterrows()}
    cols = st.columns(2)
    with cols[0]:
        _chart(charts.acceptance_by_depth_methods(view), "no finished speculative run with acceptance by depth",
               "tree_depth")
    with cols[1]:
        _chart(charts.acceptance_by_rank_runs(ranked, labels),
               "no run with acceptance by node rank (runs recorded before it was measured have none)", "tree_rank")
    color = st.radio("Colour diversity by", ["method", "prompt category"], key=f"{P}diversity_color",
                     horizontal=True, help="prompt category: each beam run's traces split by its prompt file's "
                                           "categories (sequence i is prompt i)")
    beams = analysis.beam_runs(view)
    if beams.empty:
        st.info("no beam-drafter runs (e.g. redrafter) with beam diversity in this view")
        return
    if color == "method":
        _chart(charts.diversity_vs_beam_width(beams, "method"), "no beam runs", "diversity")
        return
    beams = beams.head(MAX_BEAM_RUNS)
    categories, missing = {}, []
    for _, run in beams.iterrows():
        cats, why = analysis.prompt_categories(run.get("prompts_source"))
        if cats is None:
            missing.append(f"{run_label(run)}: {why}")
        else:
            categories[run["run_id"]] = cats
    try:
        traces = get_store().load_traces(list(categories)) if categories else None
    except Exception as exc:  # noqa: BLE001
        st.warning(f"cannot read the traces of the beam runs: {exc}")
        return
    data = analysis.beam_metrics_by_category(beams, traces, categories)
    _chart(charts.diversity_vs_beam_width(data, "category"), "no per-step traces of beam runs with a prompt file",
           "diversity")
    if missing:
        st.caption(f"{len(missing)} beam run(s) left out: " + "; ".join(missing[:5]))


def category_section(df: pd.DataFrame) -> None:
    """Acceptance per prompt category of one run: its traces' sequences joined to its prompt file's categories."""
    st.subheader("Per prompt category")
    st.caption("Sequence i of a run is prompt i of its prompt file (cycled), so a run's per-step traces give the "
               "acceptance per category (e.g. Spec-Bench / MT-bench question.jsonl). Traces carry no timings: "
               "there is no per-category speedup.")
    spec = df[(df["method"] != "ar") & df["status"].eq("ok").fillna(False)] if "method" in df else df.iloc[0:0]
    if spec.empty:
        st.info("no finished speculative run")
        return
    spec = pd.concat([spec[analysis.trusted_mask(spec)], spec[~analysis.trusted_mask(spec)]])  # trusted first
    labels = {rid: run_label(row) for rid, row in spec.set_index("run_id", drop=False).iterrows()}
    rid = st.selectbox("Run", list(labels), key=f"{P}category_run", format_func=labels.get)
    row = spec[spec["run_id"] == rid].iloc[0]
    categories, why = analysis.prompt_categories(row.get("prompts_source"))
    if categories is None:
        st.info(f"No per-category breakdown: {why}")
        return
    if len(set(categories)) < 2:
        st.info(f"The prompt file has a single category ({categories[0] if categories else '—'}): nothing to "
                "break down.")
        return
    try:
        traces = get_store().load_traces([rid])
    except Exception as exc:  # noqa: BLE001
        st.warning(f"cannot read the traces of run {rid}: {exc}")
        return
    table = analysis.category_breakdown(traces, categories)
    if table.empty:
        st.info("No per-step traces stored for this run.")
        return
    cols = st.columns([3, 2])
    with cols[0]:
        _chart(charts.category_bars(table), "no data", "category")
    with cols[1]:
        st.dataframe(table, hide_index=True, width="stretch",
                     column_config={"acceptance_rate": st.column_config.NumberColumn("acceptance", format="percent"),
                                    "mean_accepted_tokens": st.column_config.NumberColumn("tokens/step",
                                                                                          format="%.2f")})


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
    df = analysis.with_trust_columns(df)
    view = filter_frame(df)
    best_section(view)
    st.session_state[f"{P}view_ids"] = view["run_id"].tolist()
    columns = list(view.columns) if st.session_state.get(f"{P}all_columns") else [c for c in TABLE_COLUMNS if c in view]
    st.dataframe(view[columns], hide_index=True, width="stretch", height=min(420, 38 + 35 * len(view)),
                 key=f"{P}table", on_select=_add_table_selection, selection_mode="multi-row",
                 column_config={"speedup_vs_ar": st.column_config.NumberColumn("speedup", format="%.2fx"),
                                "speedup_interval": st.column_config.TextColumn(
                                    "speedup [95% interval]", help="over repeats; (no interval): one repeat"),
                                "flags": st.column_config.TextColumn(
                                    "flags", help="noisy or implausible runs: do not act on them"),
                                "acceptance_rate": st.column_config.NumberColumn("acceptance", format="percent")})
    st.caption(f"{len(view)} of {len(df)} runs · click a column header to sort · tick rows to compare them")
    flags_note(view)
    downloads(view.drop(columns=list(TRUST_TEXT), errors="ignore"), "runs", "view")
    compare_section(df)
    charts_section(view, df)
    trees_section(view, df)
    category_section(view)


if __name__ == "__main__":
    render()
