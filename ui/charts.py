"""Plotly figures built from run records, traces and the result-store frame (pure functions: no Streamlit)."""
from __future__ import annotations

import math

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

PHASES = (("draft", "time_draft_ms"), ("verify", "time_verify_ms"), ("accept", "time_accept_ms"),
          ("kv cache", "time_kv_ms"))


def _num(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


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
        v = _num(record.get(col))
        if v is not None and v > 0:
            names.append(name)
            values.append(v)
    if not values:
        return None
    fig = go.Figure(go.Pie(labels=names, values=values, hole=0.45, sort=False, textinfo="label+percent"))
    fig.update_layout(title=f"Time split by phase ({sum(values):.0f} ms)", margin=dict(t=40, b=10), height=320)
    return fig


def _speedup_frame(df: pd.DataFrame, x: str) -> pd.DataFrame:
    cols = [c for c in ("run_id", "method", x, "speedup_vs_ar", "batch", "k", "temperature", "preset", "study")
            if c in df.columns]
    out = df[list(dict.fromkeys(cols))].copy()
    out = out[out["speedup_vs_ar"].notna() & out[x].notna()] if "speedup_vs_ar" in out else out.iloc[0:0]
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
    fig.update_layout(xaxis_title=x_title, yaxis_title=y_title, margin=dict(t=40, b=40), height=380,
                      legend=dict(orientation="h", yanchor="top", y=-0.25, xanchor="left", x=0, title_text=""))
    if x in ("k", "batch"):
        fig.update_xaxes(dtick=1 if df[x].nunique() < 12 else None)
    if y_format:
        fig.update_layout(yaxis_tickformat=y_format)
    return fig


def speedup_vs_k(df: pd.DataFrame) -> go.Figure | None:
    data = _speedup_frame(df, "k")
    data = data[data["method"] != "ar"] if "method" in data else data
    return _mean_line(data, "k", "speedup_vs_ar", "method", "Speedup vs draft length, by method",
                      "draft length k", "speedup over autoregressive (x)")


def speedup_vs_batch(df: pd.DataFrame) -> go.Figure | None:
    data = _speedup_frame(df, "batch")
    return _mean_line(data, "batch", "speedup_vs_ar", "method", "Speedup vs batch size, by method",
                      "batch size", "speedup over autoregressive (x)")


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
