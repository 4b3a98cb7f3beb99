"""Frames the Results page shows, computed from the result-store frame (pure pandas: no Streamlit, no torch).

Vocabulary:
- a *flagged* run is one whose numbers should not be acted on: `noisy` (its repeats do not support the headline)
  or not `plausible` (a consistency check failed). Flagged runs are shown, marked, and never crowned "best".
- a run's *interval* is `[speedup_ci_low, speedup_ci_high]` (95 %, over repeats); a run of one repeat has none.
- a *trusted* run is a finished (`status` ok) run that is not flagged and has a speedup.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

REL_TOLERANCE = 0.05  # compare view: differences below 5 % (and inside the runs' spread) are not highlighted


def _bool_col(df: pd.DataFrame, name: str) -> pd.Series:
    """A nullable bool column as object True / False / None per row (missing column: all None)."""
    if name not in df:
        return pd.Series([None] * len(df), index=df.index, dtype="object")
    return df[name].astype("object").where(df[name].notna(), None)


def flag_mask(df: pd.DataFrame) -> pd.Series:
    """True for runs flagged noisy or implausible."""
    noisy = _bool_col(df, "noisy").map(lambda v: v is True or v is np.True_)
    implausible = _bool_col(df, "plausible").map(lambda v: v is False or v is np.False_)
    return (noisy | implausible).astype(bool)


def flag_text(row) -> str:
    """'' for a clean run, else the flags and their reasons: 'implausible: ...; noisy: ...'."""
    parts = []
    plausible, noisy = row.get("plausible"), row.get("noisy")
    if plausible is not None and plausible is not pd.NA and not bool(plausible):
        parts.append(f"implausible: {row.get('implausible_reason') or 'no reason stored'}")
    if noisy is not None and noisy is not pd.NA and bool(noisy):
        parts.append(f"noisy: {row.get('noisy_reason') or 'no reason stored'}")
    return "; ".join(parts)


def trusted_mask(df: pd.DataFrame) -> pd.Series:
    ok = df["status"].eq("ok").fillna(False) if "status" in df else pd.Series(True, index=df.index)
    has = df["speedup_vs_ar"].notna() if "speedup_vs_ar" in df else pd.Series(False, index=df.index)
    return (ok & has & ~flag_mask(df)).astype(bool)


def as_float(v) -> float | None:
    """A cell as a float; None for missing, NaN or non-numeric values."""
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def speedup_text(row) -> str:
    """'1.52x [1.40, 1.61]', or '1.52x (no interval)' for a run of one repeat; '—' without a speedup.

    >>> speedup_text({"speedup_vs_ar": 1.5, "speedup_ci_low": 1.4, "speedup_ci_high": 1.61})
    '1.50x [1.40, 1.61]'
    >>> speedup_text({"speedup_vs_ar": 0.8})
    '0.80x (no interval)'
    """
    s = as_float(row.get("speedup_vs_ar"))
    if s is None:
        return "—"
    lo, hi = as_float(row.get("speedup_ci_low")), as_float(row.get("speedup_ci_high"))
    return f"{s:.2f}x [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else f"{s:.2f}x (no interval)"


def with_trust_columns(df: pd.DataFrame) -> pd.DataFrame:
    """`df` plus `speedup_interval` (text) and `flags` (text, '' when clean) for the table."""
    out = df.copy()
    records = out.to_dict("records")
    out["speedup_interval"] = [speedup_text(r) for r in records]
    out["flags"] = [flag_text(r) for r in records]
    return out


def best_run(df: pd.DataFrame) -> tuple[pd.Series | None, int]:
    """(the trusted run with the highest speedup or None, how many flagged runs were passed over)."""
    flagged = int((flag_mask(df) & df.get("speedup_vs_ar", pd.Series(dtype=float)).notna()).sum()) \
        if "speedup_vs_ar" in df else 0
    trusted = df[trusted_mask(df)]
    if "method" in trusted:
        trusted = trusted[trusted["method"] != "ar"]
    if trusted.empty:
        return None, flagged
    return trusted.loc[trusted["speedup_vs_ar"].idxmax()], flagged


# ---- heatmap ------------------------------------------------------------------------------------------------------

def heatmap_table(df: pd.DataFrame, method: str) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """(median speedup, run count, flagged runs left out) over draft length k (rows) x batch size (columns) for one
    method; only finished runs with a speedup count, flagged ones are left out (and counted)."""
    need = {"method", "k", "batch", "speedup_vs_ar"}
    if not need <= set(df.columns):
        return pd.DataFrame(), pd.DataFrame(), 0
    runs = df[(df["method"] == method) & df["speedup_vs_ar"].notna() & df["k"].notna() & df["batch"].notna()]
    if "status" in runs:
        runs = runs[runs["status"].eq("ok").fillna(False)]
    flagged = flag_mask(runs)
    runs = runs[~flagged]
    if runs.empty:
        return pd.DataFrame(), pd.DataFrame(), int(flagged.sum())
    runs = runs.assign(k=runs["k"].astype(int), batch=runs["batch"].astype(int),
                       speedup_vs_ar=runs["speedup_vs_ar"].astype(float))
    median = runs.pivot_table(index="k", columns="batch", values="speedup_vs_ar", aggfunc="median").sort_index()
    count = runs.pivot_table(index="k", columns="batch", values="speedup_vs_ar", aggfunc="count").sort_index()
    return median, count.reindex_like(median), int(flagged.sum())


# ---- grouping by the settings that differ ------------------------------------------------------------------------

GROUP_SETTINGS = ("temperature", "max_new_tokens", "preset", "device", "dtype", "top_k", "top_p", "paged",
                  "cuda_graphs", "ngram_min", "ngram_max")
SHORT = {"temperature": "T", "max_new_tokens": "new", "batch": "b", "k": "k", "beam_width": "W",
         "beam_length": "L"}


def differing_settings(df: pd.DataFrame, candidates=GROUP_SETTINGS) -> list[str]:
    """Settings among `candidates` with more than one value in `df` (what a chart must not average over)."""
    return [c for c in candidates if c in df and df[c].astype("object").where(df[c].notna(), "—").nunique() > 1]


def series_label(row, keys: list[str]) -> str:
    """'draft · b=2 · T=0.7' for keys ['method', 'batch', 'temperature']."""
    parts = []
    for key in keys:
        v = row.get(key)
        if key == "method":
            parts.append(str(v))
        else:
            v = "—" if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)) else v
            parts.append(f"{SHORT.get(key, key)}={v:g}" if isinstance(v, float) else f"{SHORT.get(key, key)}={v}")
    return " · ".join(parts)


# ---- compare view -------------------------------------------------------------------------------------------------

SPREAD_OF = {"speedup_vs_ar": "ci", "tokens_per_s": "tokens_per_s_cv", "ar_tokens_per_s": "ar_tokens_per_s_cv"}


def relative_spread(row, field: str) -> float:
    """A run's own relative spread of `field`: half its speedup interval / speedup, or its repeat CV; 0 if unknown."""
    how = SPREAD_OF.get(field)
    if how == "ci":
        s, lo, hi = as_float(row.get("speedup_vs_ar")), as_float(row.get("speedup_ci_low")), as_float(row.get("speedup_ci_high"))
        return (hi - lo) / 2 / abs(s) if s and lo is not None and hi is not None else 0.0
    if how:
        return as_float(row.get(how)) or 0.0
    return 0.0


def compare_deltas(runs: pd.DataFrame, baseline_id: str, fields: list[str]) -> pd.DataFrame:
    """One row per (candidate run, numeric field): baseline, candidate, delta (candidate - baseline), ratio
    (candidate / baseline), threshold (the larger of 5 % and the two runs' relative spreads) and `significant`
    (|ratio - 1| beyond the threshold; a zero baseline counts any change).

    >>> runs = pd.DataFrame({"run_id": ["a", "b"], "tokens_per_s": [100.0, 103.0], "tokens_per_s_cv": [0.01, 0.01]})
    >>> compare_deltas(runs, "a", ["tokens_per_s"])[["delta", "ratio", "significant"]].values.tolist()
    [[3.0, 1.03, False]]
    """
    base = runs[runs["run_id"] == baseline_id].iloc[0]
    rows = []
    for _, cand in runs[runs["run_id"] != baseline_id].iterrows():
        for field in fields:
            b, c = as_float(base.get(field)), as_float(cand.get(field))
            if isinstance(base.get(field), (bool, np.bool_)) or b is None or c is None:
                continue
            ratio = c / b if b else None
            threshold = max(REL_TOLERANCE, relative_spread(base, field), relative_spread(cand, field))
            significant = (abs(ratio - 1) > threshold) if ratio is not None else (c != b)
            rows.append({"run_id": cand["run_id"], "field": field, "baseline": b, "candidate": c, "delta": c - b,
                         "ratio": ratio, "threshold": threshold, "significant": bool(significant)})
    return pd.DataFrame(rows, columns=["run_id", "field", "baseline", "candidate", "delta", "ratio", "threshold",
                                       "significant"])


# ---- per-category breakdown --------------------------------------------------------------------------------------

def prompt_categories(prompts_source: str | None) -> tuple[list[str] | None, str | None]:
    """Categories of the prompts in `prompts_source`, in file order, or (None, why not)."""
    if prompts_source is None or prompts_source is pd.NA or not str(prompts_source):
        return None, "the run stores no prompt file (prompts_source is empty)"
    from ui.catalog import load_prompt_file, prompt_path

    if not prompt_path(prompts_source).is_file():
        return None, f"the run's prompt file is not here any more: {prompt_path(prompts_source)}"
    prompts, why = load_prompt_file(prompts_source)
    if prompts is None:
        return None, why
    return [p.category for p in prompts], None


def category_breakdown(traces: pd.DataFrame, categories: list[str]) -> pd.DataFrame:
    """Acceptance per prompt category of one run from its per-step traces. Sequence `seq` of a run is prompt
    `seq % len(categories)` of its prompt file (the bench takes the first `num_prompts` prompts, cycling).

    Columns: category, sequences, steps, drafted, accepted, acceptance_rate (accepted / drafted),
    mean_accepted_tokens (accepted + 1 per step, as the run's own headline).
    """
    cols = ["category", "sequences", "steps", "drafted", "accepted", "acceptance_rate", "mean_accepted_tokens"]
    if traces is None or traces.empty or not categories or not {"seq", "drafted", "accepted"} <= set(traces.columns):
        return pd.DataFrame(columns=cols)
    t = traces.assign(category=[categories[int(s) % len(categories)] for s in traces["seq"]])
    g = t.groupby("category")
    out = pd.DataFrame({"sequences": g["seq"].nunique(), "steps": g.size(), "drafted": g["drafted"].sum(),
                        "accepted": g["accepted"].sum()})
    out["acceptance_rate"] = (out["accepted"] / out["drafted"].where(out["drafted"] > 0)).astype(float)
    out["mean_accepted_tokens"] = g["accepted"].mean().astype(float) + 1
    return out.reset_index()[cols]


# ---- trees and beams ---------------------------------------------------------------------------------------------

def _values(cell) -> list[float]:
    """A list cell (list, tuple, array) as floats; [] for missing or non-list cells."""
    if cell is None or isinstance(cell, (str, bytes)) or not hasattr(cell, "__len__"):
        return []
    out = []
    for x in cell:
        v = as_float(x)
        out.append(0.0 if v is None else v)
    return out


def depth_curve(cell, depth_bound=None) -> list[float]:
    """A run's acceptance by position, cut to the depths a path can reach: `depth_bound` (a beam run's beam_length)
    when given, else without the trailing zeros a tree's N-long list carries past its deepest depth.

    >>> depth_curve([0.8, 0.4, 0.0, 0.0, 0.0, 0.0], depth_bound=3)
    [0.8, 0.4, 0.0]
    >>> depth_curve([0.8, 0.4, 0.0, 0.0])
    [0.8, 0.4]
    """
    values = _values(cell)
    bound = as_float(depth_bound)
    if bound is not None and bound >= 1:
        return values[:int(bound)]
    while values and values[-1] == 0.0:
        values.pop()
    return values


TREE_SERIES = ("k", "beam_width", "beam_length", "tree_budget", "tree_depth", "tree_topk", "batch")


def acceptance_by_depth_series(df: pd.DataFrame) -> pd.DataFrame:
    """Mean acceptance by depth per series (method plus the draft-shape settings that differ within it: k, beam width
    and length, tree budget / depth / top-k, batch), over the finished speculative runs. Columns: series, depth
    (1-based), acceptance (mean over the series' runs, a run's missing depths counted 0), runs.

    >>> runs = pd.DataFrame({"method": ["redrafter", "redrafter", "draft"], "beam_width": [2, 4, None],
    ...                      "beam_length": [2, 2, None], "k": [0, 0, 2], "status": ["ok"] * 3,
    ...                      "acceptance_by_position": [[0.6, 0.2, 0, 0], [0.8, 0.4, 0, 0, 0, 0, 0, 0], [0.5, 0.25]]})
    >>> acceptance_by_depth_series(runs).values.tolist()
    [['draft', 1, 0.5, 1], ['draft', 2, 0.25, 1], ['redrafter · W=2', 1, 0.6, 1], ['redrafter · W=2', 2, 0.2, 1], \
['redrafter · W=4', 1, 0.8, 1], ['redrafter · W=4', 2, 0.4, 1]]
    """
    cols = ["series", "depth", "acceptance", "runs"]
    if not {"method", "acceptance_by_position"} <= set(df.columns):
        return pd.DataFrame(columns=cols)
    runs = df[df["method"] != "ar"]
    if "status" in runs:
        runs = runs[runs["status"].eq("ok").fillna(False)]
    rows = []
    for method, group in runs.groupby("method"):
        keys = [c for c in TREE_SERIES if c in group and group[c].astype("object").where(group[c].notna(), "—")
                .nunique() > 1]
        labels = pd.Series([series_label(r, ["method"] + keys) for r in group.to_dict("records")], index=group.index)
        for label, part in group.groupby(labels):
            curves = [depth_curve(r.get("acceptance_by_position"), r.get("beam_length") if method == "redrafter"
                                  else None) for r in part.to_dict("records")]
            curves = [c for c in curves if c]
            if not curves:
                continue
            for d in range(max(len(c) for c in curves)):
                rows.append([label, d + 1, float(np.mean([c[d] if d < len(c) else 0.0 for c in curves])),
                             len(curves)])
    return pd.DataFrame(rows, columns=cols)


def beam_runs(df: pd.DataFrame) -> pd.DataFrame:
    """Finished runs that recorded beam diversity (beam drafters), with beam_width as an int."""
    need = {"beam_width", "beam_diversity_mean"}
    if not need <= set(df.columns):
        return df.iloc[0:0]
    runs = df[df["beam_diversity_mean"].notna() & df["beam_width"].notna()]
    if "status" in runs:
        runs = runs[runs["status"].eq("ok").fillna(False)]
    return runs.assign(beam_width=runs["beam_width"].astype(int))


def beam_metrics_by_category(runs: pd.DataFrame, traces: pd.DataFrame,
                             categories: dict[str, list[str]]) -> pd.DataFrame:
    """Beam diversity and disagreement per (run, prompt category) from the runs' per-step traces: diversity =
    drafted / (W x L) per step (as the run's own beam_diversity_mean), disagreement = the steps' beam_disagreement;
    both averaged over the category's steps. `categories`: run_id -> the run's prompt categories in file order
    (sequence i is prompt i, cycled). Columns: run_id, method, beam_width, category, beam_diversity_mean,
    beam_disagreement_mean, steps.
    """
    cols = ["run_id", "method", "beam_width", "category", "beam_diversity_mean", "beam_disagreement_mean", "steps"]
    if traces is None or traces.empty or not {"run_id", "seq", "drafted"} <= set(traces.columns):
        return pd.DataFrame(columns=cols)
    rows = []
    for _, run in runs.iterrows():
        cats = categories.get(run["run_id"])
        w, length = as_float(run.get("beam_width")), as_float(run.get("beam_length"))
        tr = traces[traces["run_id"] == run["run_id"]]
        if not cats or tr.empty or not w or not length:
            continue
        tr = tr.assign(category=[cats[int(s) % len(cats)] for s in tr["seq"]],
                       _div=tr["drafted"].astype(float) / (w * length),
                       _dis=pd.to_numeric(tr.get("beam_disagreement", pd.Series(np.nan, index=tr.index)),
                                          errors="coerce").astype(float))
        for cat, part in tr.groupby("category"):
            dis = part["_dis"].dropna()
            rows.append([run["run_id"], run.get("method"), int(w), cat, float(part["_div"].mean()),
                         float(dis.mean()) if len(dis) else None, len(part)])
    return pd.DataFrame(rows, columns=cols)
