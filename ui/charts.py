"""Plotly figures built from run records, traces and the result-store frame (pure functions: no Streamlit)."""
from __future__ import annotations

import math

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from ui.analysis import as_float

PHASES = (("draft", "time_draft_ms"), ("verify", "time_verify_ms"), ("accept", "time_accept_ms"),
          ("kv cache", "time_kv_ms"))


def acceptance_by_position(record: dict) -> go.Figure | None:
    """Bar per draft depth d: fraction of target steps whose accepted path reached depth d."""
    values = record.get("acceptance_by_position")
    if values is None or len(values) == 0:
        return None
    values = [float(v) for v in values]
    fig = go.Figure(go.Bar(x=list(range(1, len(values) + 1)), y=values, text=[f"{v:.0%}" for v in values],
                           textposition="outside"))
    fig.update_layout(title="Acceptance by draft position", xaxis_title="draft position (depth)",
                      yaxis_title="steps reaching it", yaxis_range=[0, 1.1], yaxis_tickformat=".0%", xaxis_dtick=1,
                      margin=dict(t=40, b=40), height=320)
    return fig


def accepted_per_step_histogram(traces: pd.DataFrame) -> go.Figure | None:
    """Histogram of accepted draft tokens per (sequence, target step)."""
    if traces is None or traces.empty or "accepted" not in traces:
        return None
    counts = traces["accepted"].dropna().astype(int).value_counts().sort_index()
    fig = go.Figure(go.Bar(x=counts.index.tolist(), y=(counts / counts.sum()).tolist(),
                           text=counts.tolist(), textposition="outside"))
    fig.update_layout(title=f"Accepted draft tokens per step ({int(counts.sum())} steps)",
                      xaxis_title="accepted tokens in the step", yaxis_title="share of steps",
                      yaxis_tickformat=".0%", xaxis_dtick=1, margin=dict(t=40, b=40), height=320)
    return fig


def time_split(record: dict) -> go.Figure | None:
    """Where the step time went: draft / verify / accept / KV cache (ms, summed over the run)."""
    names, values = [], []
    for name, col in PHASES:
        v = as_float(record.get(col))
        if v is not None and v > 0:
            names.append(name)
            values.append(v)
    if not values:
        return None
    fig = go.Figure(go.Pie(labels=names, values=values, hole=0.45, sort=False, textinfo="label+percent"))
    fig.update_layout(title=f"Time split by phase ({sum(values):.0f} ms)", margin=dict(t=40, b=10), height=320)
    return fig


def _speedup_frame(df: pd.DataFrame, x: str) -> pd.DataFrame:
    out = df[df["speedup_vs_ar"].notna() & df[x].notna()] if {"speedup_vs_ar", x} <= set(df.columns) else df.iloc[0:0]
    if "status" in out:
        out = out[out["status"].eq("ok").fillna(False)]
    return out


def _mean_line(df: pd.DataFrame, x: str, y: str, color: str, title: str, x_title: str, y_title: str,
               y_format: str | None = None) -> go.Figure | None:
    if df.empty:
        return None
    df = df.copy()
    df[color] = df[color].astype(str)
    agg = df.groupby([color, x], as_index=False)[y].mean().sort_values([color, x])
    fig = px.line(agg, x=x, y=y, color=color, markers=True, title=title)
    fig.add_trace(go.Scatter(x=df[x], y=df[y], mode="markers", marker=dict(size=5, color="rgba(120,120,120,0.35)"),
                             name="single runs", hovertext=df.get("run_id"), showlegend=True))
    _layout(fig, x, df, x_title, y_title)
    if y_format:
        fig.update_layout(yaxis_tickformat=y_format)
    return fig


def _layout(fig: go.Figure, x: str, df: pd.DataFrame, x_title: str, y_title: str, height: int = 380) -> None:
    fig.update_layout(xaxis_title=x_title, yaxis_title=y_title, margin=dict(t=40, b=40), height=height,
                      legend=dict(orientation="h", yanchor="top", y=-0.25, xanchor="left", x=0, title_text=""))
    if x in ("k", "batch"):
        fig.update_xaxes(dtick=1 if df[x].nunique() < 12 else None)


def speedup_lines(df: pd.DataFrame, x: str) -> go.Figure | None:
    """Speedup against `x` ("k" or "batch"): one line per combination of the other settings that differ (method,
    the other of k / batch, temperature, ...), through the median of the trusted runs; every run is a dot with its
    95 % interval as an error bar (hollow: no interval); flagged runs are red crosses, left out of the lines."""
    from ui import analysis

    data = _speedup_frame(df, x)
    if "method" in data:
        data = data[data["method"] != "ar"]
    if data.empty:
        return None
    other = {"k": "batch", "batch": "k"}[x]
    keys = ["method"] + [c for c in (other,) if c in data and data[c].nunique() > 1] \
        + analysis.differing_settings(data)
    data = data.assign(_series=[analysis.series_label(r, keys) for r in data.to_dict("records")],
                       _flagged=analysis.flag_mask(data).values,
                       _lo=pd.to_numeric(data.get("speedup_ci_low"), errors="coerce"),
                       _hi=pd.to_numeric(data.get("speedup_ci_high"), errors="coerce"),
                       speedup_vs_ar=data["speedup_vs_ar"].astype(float))
    fig = go.Figure()
    palette = px.colors.qualitative.Plotly
    for i, (name, group) in enumerate(sorted(data.groupby("_series"), key=lambda kv: kv[0])):
        color = palette[i % len(palette)]
        clean = group[~group["_flagged"]]
        if not clean.empty:
            med = clean.groupby(x)["speedup_vs_ar"].median().sort_index()
            fig.add_trace(go.Scatter(x=med.index, y=med.values, mode="lines", name=name, legendgroup=name,
                                     line=dict(color=color)))
            for has_ci, part in clean.groupby(clean["_lo"].notna() & clean["_hi"].notna()):
                fig.add_trace(go.Scatter(
                    x=part[x], y=part["speedup_vs_ar"], mode="markers", legendgroup=name, showlegend=False,
                    name=name + ("" if has_ci else " (no interval)"), hovertext=part.get("run_id"),
                    marker=dict(color=color, size=8, symbol="circle" if has_ci else "circle-open"),
                    error_y=dict(type="data", symmetric=False, array=(part["_hi"] - part["speedup_vs_ar"]).tolist(),
                                 arrayminus=(part["speedup_vs_ar"] - part["_lo"]).tolist(), visible=True)
                    if has_ci else None))
    flagged = data[data["_flagged"]]
    if not flagged.empty:
        fig.add_trace(go.Scatter(x=flagged[x], y=flagged["speedup_vs_ar"], mode="markers",
                                 name=f"flagged (noisy / implausible): {len(flagged)}",
                                 marker=dict(symbol="x", size=9, color="crimson"), hovertext=flagged.get("run_id")))
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    what = {"k": "draft length", "batch": "batch size"}[x]
    fig.update_layout(title=f"Speedup vs {what}, one line per " + ", ".join(keys))
    _layout(fig, x, data, {"k": "draft length k", "batch": "batch size"}[x], "speedup over autoregressive (x)", 420)
    return fig


def speedup_vs_k(df: pd.DataFrame) -> go.Figure | None:
    return speedup_lines(df, "k")


def speedup_vs_batch(df: pd.DataFrame) -> go.Figure | None:
    return speedup_lines(df, "batch")


def speedup_heatmap(df: pd.DataFrame, method: str) -> go.Figure | None:
    """Median speedup of one method over draft length k x batch size; the cell text is the value and the run count;
    flagged runs are left out, their number in the title."""
    from ui import analysis

    median, count, flagged = analysis.heatmap_table(df, method)
    if median.empty:
        return None
    text = [[f"{m:.2f}x<br>n={int(c)}" if not math.isnan(m) else "" for m, c in zip(mr, cr)]
            for mr, cr in zip(median.values, count.fillna(0).values)]
    fig = go.Figure(go.Heatmap(
        z=median.values, x=[str(b) for b in median.columns], y=[str(k) for k in median.index], text=text,
        texttemplate="%{text}", colorscale="RdYlGn", zmid=1.0, colorbar=dict(title="speedup"),
        hovertemplate="k=%{y} batch=%{x}<br>median speedup %{z:.2f}x<extra></extra>"))
    note = f"{flagged} flagged run(s) left out" if flagged else "no flagged runs"
    fig.update_layout(title=f"Speedup heatmap · {method} · median over runs · {note}", xaxis_title="batch size",
                      yaxis_title="draft length k", xaxis_type="category", yaxis_type="category",
                      margin=dict(t=50, b=40), height=120 + 45 * len(median.index))
    return fig


def acceptance_by_position_runs(df: pd.DataFrame, labels: dict) -> go.Figure | None:
    """Acceptance by draft position, one line per run (`labels`: run_id -> legend text)."""
    if "acceptance_by_position" not in df:
        return None
    fig = go.Figure()
    for _, row in df.iterrows():
        values = row["acceptance_by_position"]
        if values is None or (not isinstance(values, (list, tuple)) and not hasattr(values, "__len__")) \
                or len(values) == 0:
            continue
        values = [float(v) for v in values]
        fig.add_trace(go.Scatter(x=list(range(1, len(values) + 1)), y=values, mode="lines+markers",
                                 name=labels.get(row["run_id"], str(row["run_id"]))))
    if not fig.data:
        return None
    fig.update_layout(title="Acceptance by draft position, per run", xaxis_title="draft position (depth)",
                      yaxis_title="steps reaching it", yaxis_range=[0, 1.05], yaxis_tickformat=".0%", xaxis_dtick=1,
                      margin=dict(t=40, b=40), height=380,
                      legend=dict(orientation="h", yanchor="top", y=-0.25, xanchor="left", x=0))
    return fig


def latency_percentiles(df: pd.DataFrame, labels: dict, metric: str) -> go.Figure | None:
    """p50 / p90 / p99 of `metric` ("tpot" or "itl") per run, as grouped bars (ms)."""
    cols = [f"{metric}_ms_p{p}" for p in (50, 90, 99)]
    present = [c for c in cols if c in df]
    if not present or df[present].isna().all().all():
        return None
    names = [labels.get(r, str(r)) for r in df["run_id"]]
    fig = go.Figure([go.Bar(name=c.rsplit("_", 1)[1], x=names, y=pd.to_numeric(df[c], errors="coerce"))
                     for c in present])
    long = {"tpot": "TPOT (time per output token)", "itl": "ITL (inter-token latency)"}[metric]
    fig.update_layout(title=f"{long} percentiles per run", barmode="group", yaxis_title="ms",
                      margin=dict(t=40, b=40), height=380,
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1))
    return fig


def category_bars(table: pd.DataFrame) -> go.Figure | None:
    """Acceptance rate per prompt category (from analysis.category_breakdown)."""
    if table is None or table.empty:
        return None
    fig = go.Figure(go.Bar(x=table["category"].tolist(), y=table["acceptance_rate"].tolist(),
                           text=[f"{a:.0%} · {m:.2f} tok/step · {n} seq" for a, m, n in
                                 zip(table["acceptance_rate"].fillna(0), table["mean_accepted_tokens"],
                                     table["sequences"])],
                           textposition="outside"))
    fig.update_layout(title="Acceptance by prompt category", xaxis_title="category", yaxis_title="acceptance rate",
                      yaxis_tickformat=".0%", yaxis_range=[0, 1.15], margin=dict(t=40, b=40), height=380)
    return fig


def acceptance_vs_temperature(df: pd.DataFrame) -> go.Figure | None:
    if not {"temperature", "acceptance_rate", "method"} <= set(df.columns):
        return None
    data = df[df["acceptance_rate"].notna() & df["temperature"].notna() & (df["method"] != "ar")]
    data = data[["run_id", "method", "temperature", "acceptance_rate"]]
    return _mean_line(data, "temperature", "acceptance_rate", "method", "Acceptance rate vs temperature, by method",
                      "temperature", "acceptance rate", y_format=".0%")


def telemetry_timeline(rows: list[dict], keys: list[str]) -> go.Figure | None:
    if not rows:
        return None
    df = pd.DataFrame(rows)
    keys = [k for k in keys if k in df and df[k].notna().any()]
    if not keys or "t_s" not in df:
        return None
    fig = go.Figure()
    for k in keys:
        fig.add_trace(go.Scatter(x=df["t_s"], y=df[k], mode="lines", name=k))
    fig.update_layout(xaxis_title="seconds", margin=dict(t=20, b=40), height=300)
    return fig


# ---- trees and beams ---------------------------------------------------------------------------------------------

def acceptance_by_depth_methods(df: pd.DataFrame) -> go.Figure | None:
    """Acceptance by draft depth, one line per method (and per draft shape that differs within it), mean over runs."""
    from ui import analysis

    data = analysis.acceptance_by_depth_series(df)
    if data.empty:
        return None
    fig = go.Figure()
    for name, part in data.groupby("series", sort=True):
        fig.add_trace(go.Scatter(x=part["depth"].tolist(), y=part["acceptance"].tolist(), mode="lines+markers",
                                 name=name, hovertext=[f"{n} run(s)" for n in part["runs"]]))
    fig.update_layout(title="Acceptance by draft depth, per method (mean over runs)", xaxis_title="draft depth",
                      yaxis_title="steps whose path reached it", yaxis_range=[0, 1.05], yaxis_tickformat=".0%",
                      xaxis_dtick=1, margin=dict(t=40, b=40), height=380,
                      legend=dict(orientation="h", yanchor="top", y=-0.25, xanchor="left", x=0))
    return fig


def acceptance_by_rank_runs(df: pd.DataFrame, labels: dict) -> go.Figure | None:
    """Accepted path nodes per step by sibling rank (0 = the drafter's best child), grouped bars, one per run."""
    from ui import analysis

    if "acceptance_by_rank" not in df:
        return None
    fig = go.Figure()
    for _, row in df.iterrows():
        values = analysis._values(row["acceptance_by_rank"])
        if not values:
            continue
        fig.add_trace(go.Bar(x=[f"rank {r}" + (" (best)" if r == 0 else "") for r in range(len(values))], y=values,
                             name=labels.get(row["run_id"], str(row["run_id"]))))
    if not fig.data:
        return None
    fig.update_layout(title="Acceptance by node rank, per run", barmode="group",
                      xaxis_title="sibling rank of the accepted node (by draft score)",
                      yaxis_title="accepted nodes per step", margin=dict(t=40, b=40), height=380,
                      legend=dict(orientation="h", yanchor="top", y=-0.25, xanchor="left", x=0))
    return fig


DIVERSITY_METRICS = (("beam_diversity_mean", "beam diversity (distinct nodes / W x L)"),
                     ("beam_disagreement_mean", "pairwise token disagreement"))


def diversity_vs_beam_width(data: pd.DataFrame, color: str) -> go.Figure | None:
    """Beam diversity and pairwise disagreement against beam width W, side by side: a dot per run (or per run and
    category), a line through the mean per `color` group ("method" or "category")."""
    from plotly.subplots import make_subplots

    if data is None or data.empty or not {"beam_width", color} <= set(data.columns):
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=[t for _, t in DIVERSITY_METRICS], horizontal_spacing=0.1)
    palette = px.colors.qualitative.Plotly
    for i, (name, group) in enumerate(sorted(data.groupby(data[color].astype(str)), key=lambda kv: kv[0])):
        c = palette[i % len(palette)]
        for col, (metric, _) in enumerate(DIVERSITY_METRICS, start=1):
            if metric not in group:
                continue
            part = group[group[metric].notna()].assign(**{metric: lambda g, m=metric: g[m].astype(float)})
            if part.empty:
                continue
            mean = part.groupby("beam_width")[metric].mean().sort_index()
            fig.add_trace(go.Scatter(x=mean.index.tolist(), y=mean.tolist(), mode="lines", name=name, legendgroup=name,
                                     showlegend=col == 1, line=dict(color=c)), row=1, col=col)
            fig.add_trace(go.Scatter(x=part["beam_width"].tolist(), y=part[metric].tolist(), mode="markers",
                                     name=name, legendgroup=name, showlegend=False,
                                     hovertext=part["run_id"].tolist() if "run_id" in part else None,
                                     marker=dict(color=c, size=7, opacity=0.6)), row=1, col=col)
    if not fig.data:
        return None
    fig.update_xaxes(title_text="beam width W", dtick=1)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%")
    fig.update_layout(title=f"Diversity vs beam width, by {color}", margin=dict(t=70, b=40), height=400,
                      legend=dict(orientation="h", yanchor="top", y=-0.2, xanchor="left", x=0))
    return fig


def optimization_history(points: list[tuple[int, float, str | None]], maximize: bool, metric: str) -> go.Figure | None:
    """A single-objective study's trials (number, value, why it is left out or None) and the best value so far,
    drawn through the trusted trials only: an infeasible, noisy or implausible trial is a grey marker, never best."""
    if not points:
        return None
    pick = max if maximize else min
    fig = go.Figure()
    kept = [(n, v) for n, v, why in points if why is None]
    left = [(n, v, why) for n, v, why in points if why is not None]
    if kept:
        fig.add_trace(go.Scatter(x=[n for n, _ in kept], y=[v for _, v in kept], mode="markers", name=metric,
                                 marker={"color": "#1f77b4"}))
        best, line = None, []
        for n, v in sorted(kept):
            best = v if best is None else pick(best, v)
            line.append((n, best))
        last = max(n for n, _, _ in points)
        if line[-1][0] < last:
            line.append((last, line[-1][1]))
        fig.add_trace(go.Scatter(x=[n for n, _ in line], y=[b for _, b in line], mode="lines", line_shape="hv",
                                 name="Best value (trusted trials)", line={"color": "#d62728"}))
    if left:
        fig.add_trace(go.Scatter(x=[n for n, _, _ in left], y=[v for _, v, _ in left], mode="markers",
                                 name="Left out (infeasible, noisy or implausible)", marker={"color": "#bbbbbb"},
                                 text=[why for _, _, why in left], hovertemplate="trial %{x}: %{y}<br>%{text}"))
    fig.update_layout(title="Optimization history", xaxis_title="trial", yaxis_title=metric, height=420)
    return fig
