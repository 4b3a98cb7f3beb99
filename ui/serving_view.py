"""Serving runs (`serve-bench`, run_kind "serve") as frames and Plotly figures: pure functions, no Streamlit.

A serving run's *setting* is one of three, read from its row:
- **off**: method ar (no speculation);
- **fixed**: one draft length k at every batch size (no k_by_batch, no switch-off, no context limit);
- **adaptive**: a draft-length schedule by batch size, switch-off by acceptance, or a context-length limit;
- **external**: a run against an OpenAI-compatible server (`serve-bench --endpoint`, or a trial of a launch study),
  labelled by the server's engine, version and address (its method may be unknown), and a launch trial's settings.

Lines of the rate charts are one per (setting, method, k or schedule), so a sweep of off / fixed k / adaptive over
request rates reads as three lines per chart.

    >>> setting_of({"method": "ngram", "k": 3, "k_by_batch": "1-4:3,5-16:1"})
    'adaptive'
    >>> line_label({"method": "ngram", "k": 3, "k_by_batch": ""})
    'fixed · ngram k=3'
    >>> schedule_of({"method": "ngram", "k": 3, "k_by_batch": "", "max_num_seqs": 8})
    [(1, 8, 3)]
"""
from __future__ import annotations

import json
import math
from urllib.parse import urlsplit

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from workbench.settings import SettingError, parse_k_by_batch

SETTINGS = ("off", "fixed", "adaptive", "external")
LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL"), ("queue_ms", "queue"),
             # an external run's server, from its own /metrics (means only; `workbench serve`: TTFT = queue + prefill)
             ("server_ttft_ms", "TTFT at the server"), ("server_queue_ms", "queue at the server"),
             ("server_prefill_ms", "prefill at the server"))
STATS = ("mean", "p50", "p90", "p99")
BOTTOM_LEGEND = dict(orientation="h", yanchor="top", y=-0.25, xanchor="left", x=0)  # long names: below the plot
REQUEST_METRICS = {"ttft_ms": "TTFT (ms)", "tpot_ms": "TPOT (ms)", "e2el_ms": "E2E latency (ms)",
                   "queue_ms": "queue time (ms)", "itl_ms_mean": "mean ITL (ms)"}


def _missing(v) -> bool:
    if v is None or v is pd.NA or v is pd.NaT:
        return True
    return isinstance(v, float) and math.isnan(v)


def _num(v, default: float = 0.0) -> float:
    return default if _missing(v) else float(v)


def serve_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The serving rows of a store frame (run_kind "serve"), newest first."""
    if df is None or df.empty or "run_kind" not in df:
        return pd.DataFrame()
    out = df[df["run_kind"].eq("serve").fillna(False)]
    if "created_at" in out:
        out = out.sort_values("created_at", ascending=False, kind="stable")
    return out.reset_index(drop=True)


def is_external(row) -> bool:
    """A run against a server (its endpoint recorded), not the in-process engine."""
    endpoint = row.get("endpoint")
    return not _missing(endpoint) and bool(str(endpoint).strip())


def engine_label(row) -> str:
    """The server of an external run: engine, version and host:port; a launch trial's settings after it.

    >>> engine_label({"endpoint": "http://10.0.0.2:8000", "engine_name": "vllm", "engine_version": "0.11.0"})
    'vllm 0.11.0 @ 10.0.0.2:8000'
    >>> engine_label({"endpoint": "http://h:9001/", "engine_name": None, "launch_params": "k=4"})
    'server @ h:9001 · k=4'
    """
    name = row.get("engine_name")
    version = row.get("engine_version")
    engine = "server" if _missing(name) or not str(name) else str(name)
    if not _missing(version) and str(version):
        engine += f" {version}"
    address = urlsplit(str(row.get("endpoint"))).netloc or str(row.get("endpoint"))
    params = row.get("launch_params")
    return f"{engine} @ {address}" + ("" if _missing(params) or not str(params) else f" · {params}")


def setting_of(row) -> str:
    if is_external(row):
        return "external"
    if row.get("method") == "ar" or _num(row.get("k")) == 0:
        return "off"
    adaptive = (not _missing(row.get("k_by_batch")) and str(row.get("k_by_batch")).strip()) \
        or _num(row.get("spec_off_acceptance")) > 0 or _num(row.get("spec_max_context")) > 0 \
        or _num(row.get("spec_off_queue")) > 0
    return "adaptive" if adaptive else "fixed"


def method_label(row) -> str:
    """The method and its draft shape: a chain's k, an EAGLE tree's D / K / N, ReDrafter's beams W x L.

    >>> method_label({"method": "eagle", "k": 4, "tree_depth": 4, "tree_topk": 4, "tree_budget": 16})
    'eagle D4 K4 N16'
    >>> method_label({"method": "redrafter", "k": 4, "beam_width": 2, "beam_length": 4})
    'redrafter W2 L4'
    >>> method_label({"method": "eagle", "tree_depth": 4, "tree_topk": 4, "tree_budget": 16, "hot_vocab": 32768})
    'eagle D4 K4 N16 hot 32768'
    >>> method_label({"method": "redrafter", "beam_width": 4, "beam_length": 4, "hot_vocab": 32000})
    'redrafter W4 L4 hot 32000'
    """
    method = row.get("method")
    shape = {"eagle": (("D", "tree_depth"), ("K", "tree_topk"), ("N", "tree_budget")),
             "redrafter": (("W", "beam_width"), ("L", "beam_length"))}.get(method)
    if shape and not any(_missing(row.get(c)) for _, c in shape):
        hot = int(_num(row.get("hot_vocab"), 0))
        return f"{method} " + " ".join(f"{p}{int(_num(row.get(c)))}" for p, c in shape) + (f" hot {hot}" if hot else "")
    return f"{method} k={int(_num(row.get('k')))}"


def fidelity_note(row) -> str:
    """The run's greedy check in words (`greedy_matches_solo`, workbench/serving/fidelity.py).

    >>> fidelity_note({"greedy_matches_solo": True, "greedy_solo_compared": 8})
    'greedy outputs equal solo: yes (8 requests compared)'
    >>> fidelity_note({"greedy_matches_solo": False, "greedy_solo_compared": 8, "greedy_divergent_sequences": 1,
    ...                "greedy_near_tie": True})
    'greedy outputs equal solo: NO, 1 of 8 differ (near-ties of a low-precision dtype)'
    """
    match = row.get("greedy_matches_solo")
    if _missing(match):
        return "greedy outputs against solo: not checked (sampling, or greedy_check_requests 0)"
    n = int(_num(row.get("greedy_solo_compared")))
    if match:
        return f"greedy outputs equal solo: yes ({n} requests compared)"
    tie = " (near-ties of a low-precision dtype)" if row.get("greedy_near_tie") is True else ""
    return f"greedy outputs equal solo: NO, {int(_num(row.get('greedy_divergent_sequences')))} of {n} differ{tie}"


def line_label(row) -> str:
    setting = setting_of(row)
    if setting == "external":
        return f"external · {engine_label(row)}"
    if setting == "off":
        return "off"
    method = method_label(row)
    if setting == "fixed":
        return f"fixed · {method}"
    parts = []
    if not _missing(row.get("k_by_batch")) and str(row.get("k_by_batch")).strip():
        parts.append(str(row.get("k_by_batch")))
    if _num(row.get("spec_off_acceptance")) > 0:
        parts.append(f"off<{_num(row.get('spec_off_acceptance')):g}/{int(_num(row.get('spec_window'), 8))}")
    if _num(row.get("spec_max_context")) > 0:
        parts.append(f"ctx>{int(_num(row.get('spec_max_context')))}:k{int(_num(row.get('long_context_k')))}")
    if _num(row.get("spec_off_queue")) > 0:
        parts.append(f"off while queue>={int(_num(row.get('spec_off_queue')))}")
    return f"adaptive · {method} · " + " ".join(parts)


# the serving loop's base (loop_overlap, loop_batch_prefill): the prefill behind the step, forwards of up to 4 rows.
# Full overlap is the default too where it applies (greedy chains, fixed shapes, no_evict), but not everywhere, so a
# run label names it: rows of the two loops differ by 1.05-1.5x
DEFAULT_LOOP = ("prefill", 4)


def loop_note(row) -> str:
    """How the serving loop ran, where it differs from its base (DEFAULT_LOOP; "" where it does not, or where the run
    predates the record): the loop's switches move tokens/s by 1.06-1.35x.

    >>> loop_note({"loop_overlap": "full", "loop_batch_prefill": 4}), loop_note({"loop_overlap": "prefill"})
    ('loop full', '')
    >>> loop_note({"loop_overlap": "none", "loop_batch_prefill": 1})
    'loop none, prefill rows 1'
    """
    overlap, rows = row.get("loop_overlap"), row.get("loop_batch_prefill")
    parts = []
    if not _missing(overlap) and overlap != DEFAULT_LOOP[0]:
        parts.append(f"loop {overlap}")
    if not _missing(rows) and int(_num(rows)) != DEFAULT_LOOP[1]:
        parts.append(f"prefill rows {int(_num(rows))}")
    return ", ".join(parts)


def run_label(row) -> str:
    created = row.get("created_at")
    when = created.strftime("%m-%d %H:%M:%S") if hasattr(created, "strftime") else str(created)
    note = loop_note(row)
    return (f"{when} · {line_label(row)} · rate {_num(row.get('rate')):g}" + (f" · {note}" if note else "")
            + f" · {str(row.get('run_id'))[-6:]}")


def with_setting(runs: pd.DataFrame) -> pd.DataFrame:
    out = runs.copy()
    out["setting"] = [setting_of(r) for _, r in runs.iterrows()] if len(runs) else []
    out["line"] = [line_label(r) for _, r in runs.iterrows()] if len(runs) else []
    return out


def schedule_of(row) -> list[tuple[int, int, int]]:
    """The run's draft length by batch size as inclusive ranges [(start_bs, end_bs, k)], covering 1..max_num_seqs:
    its k_by_batch ranges (sizes they leave out get k), k everywhere for a fixed run, 0 for off."""
    top = max(1, int(_num(row.get("max_num_seqs"), 1)))
    k = 0 if setting_of(row) == "off" else int(_num(row.get("k")))
    try:
        ranges = parse_k_by_batch(row.get("k_by_batch") or "") if k else []
    except SettingError:
        ranges = []
    out, nxt = [], 1
    for lo, hi, rk in ranges:
        if lo > top:
            break
        if lo > nxt:
            out.append((nxt, lo - 1, k))
        out.append((lo, min(hi, top), min(rk, k)))
        nxt = min(hi, top) + 1
    if nxt <= top:
        out.append((nxt, top, k))
    return out


def _ok(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["status"].eq("ok").fillna(False)] if "status" in runs else runs


def rate_chart(runs: pd.DataFrame, metric: str, title: str, y_title: str) -> go.Figure | None:
    """One line per setting (off / fixed / adaptive, with method and k): the median of `metric` at each request rate;
    grey dots are the single runs."""
    if runs.empty or not {metric, "rate"} <= set(runs.columns):
        return None
    df = with_setting(_ok(runs))
    df = df[df[metric].notna() & df["rate"].notna()]
    if df.empty:
        return None
    df = df.assign(**{metric: df[metric].astype(float), "rate": df["rate"].astype(float)})
    agg = df.groupby(["line", "rate"], as_index=False).agg(**{metric: (metric, "median"), "runs": (metric, "size")})
    agg = agg.sort_values(["line", "rate"])
    fig = px.line(agg, x="rate", y=metric, color="line", markers=True, title=title, hover_data=["runs"])
    fig.add_trace(go.Scatter(x=df["rate"], y=df[metric], mode="markers", name="single runs",
                             marker=dict(size=5, color="rgba(120,120,120,0.35)"), hovertext=df["run_id"]))
    fig.update_layout(xaxis_title="request rate (requests/s; 0 = all at once)", yaxis_title=y_title,
                      legend_title_text="setting", margin=dict(t=40, b=40), height=440, legend=BOTTOM_LEGEND)
    return fig


def percentile_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, latency): mean / p50 / p90 / p99 in ms (what the run row holds; absent cells stay empty)."""
    rows = []
    for _, r in runs.iterrows():
        for col, name in LATENCIES:
            vals = {s: r.get(f"{col}_{s}") for s in STATS}
            if all(_missing(v) for v in vals.values()):
                continue
            rows.append({"run": run_label(r), "latency": name,
                         **{s: (None if _missing(v) else float(v)) for s, v in vals.items()}})
    return pd.DataFrame(rows, columns=["run", "latency", *STATS])


def json_frame(runs: pd.DataFrame, column: str, key_name: str) -> pd.DataFrame:
    """A JSON-text column {"key": acceptance} of each run -> long rows (run_id, label, key as int, acceptance)."""
    rows = []
    if column not in runs:
        return pd.DataFrame(columns=["run_id", "label", key_name, "acceptance"])
    for _, r in runs.iterrows():
        text = r.get(column)
        if _missing(text) or not str(text).strip():
            continue
        try:
            data = json.loads(text)
        except (TypeError, ValueError):
            continue
        for key, value in data.items():
            if value is None:
                continue
            rows.append({"run_id": r["run_id"], "label": run_label(r), key_name: int(key), "acceptance": float(value)})
    return pd.DataFrame(rows, columns=["run_id", "label", key_name, "acceptance"])


def acceptance_chart(runs: pd.DataFrame, column: str, key_name: str, title: str, x_title: str) -> go.Figure | None:
    data = json_frame(runs, column, key_name)
    if data.empty:
        return None
    data = data.sort_values(["label", key_name])
    fig = px.line(data, x=key_name, y="acceptance", color="label", markers=True, title=title)
    fig.update_layout(xaxis_title=x_title, yaxis_title="accepted / drafted", yaxis_range=[0, 1.05],
                      yaxis_tickformat=".0%", legend_title_text="run", margin=dict(t=40, b=40), height=440,
                      legend=BOTTOM_LEGEND)
    return fig


def latency_distribution(requests: pd.DataFrame, labels: dict[str, str], metric: str) -> go.Figure | None:
    """Box plot with every point of a per-request latency, one box per run (measured requests only)."""
    if requests is None or requests.empty or metric not in requests:
        return None
    df = requests
    if "measured" in df:
        df = df[df["measured"].fillna(True).astype(bool)]
    df = df[df[metric].notna() & df["run_id"].isin(list(labels))]
    if df.empty:
        return None
    short = {rid: label.split(" · ", 1)[-1] for rid, label in labels.items()}  # without the date
    df = df.assign(run=df["run_id"].map(short), **{metric: df[metric].astype(float)})
    fig = px.box(df, x="run", y=metric, points="all", hover_data=["request", "prompt_len", "output_len"],
                 title=f"Per-request {REQUEST_METRICS.get(metric, metric)}, {len(df)} requests")
    fig.update_layout(xaxis_title="", yaxis_title=REQUEST_METRICS.get(metric, metric), margin=dict(t=40, b=40),
                      height=400, showlegend=False)
    return fig


def snippets_for(row) -> dict[str, str]:
    """vLLM / TensorRT-LLM / SGLang snippets (JSON text) of the run's draft length by batch size."""
    from workbench.serving.exports import export_snippets  # torch-free (json only)

    ngram = (int(_num(row.get("ngram_min"), 1)), int(_num(row.get("ngram_max"), 3)))
    path = None if _missing(row.get("draft_path")) else str(row.get("draft_path"))
    draft = None if path is None or path.startswith("untrained") else path  # an untrained head has no folder
    tree = None
    if row.get("method") == "eagle" and not any(_missing(row.get(k)) for k in ("tree_depth", "tree_topk", "tree_budget")):
        tree = tuple(int(_num(row.get(k))) for k in ("tree_depth", "tree_topk", "tree_budget"))
    ranges = schedule_of(row)
    if tree and tree[1] > 1:  # a tree's schedule is on / off; the engines count its draft length as the depth
        ranges = [(lo, hi, tree[0] if k > 0 else 0) for lo, hi, k in ranges]
    hot = int(_num(row.get("hot_vocab"), 0)) if row.get("method") == "eagle" else 0
    return export_snippets(ranges, str(row.get("method")), ngram=ngram, draft_path=draft, tree=tree, hot_vocab=hot)


CALIBRATION_VALUES = {"loop": ("tokens_per_s", "output tokens/s of a closed-loop serve"),
                      "step": ("tokens_per_ms", "tokens per ms of an isolated decode step (all rows)")}


def calibration_frame(row) -> tuple[pd.DataFrame, str] | None:
    """The run's stored calibration (`calibration_table` JSON: {"measured": [...], "schedule": [...]}) as a frame
    with columns batch_size, k, value, chosen, skipped, and its kind: "loop" (value = output tokens/s) or "step"
    (tokens per ms). None when the run measured no schedule (or the table cannot be read)."""
    text = row.get("calibration_table")
    if _missing(text) or not text:
        return None
    try:
        measured = json.loads(text)["measured"]
    except (ValueError, KeyError, TypeError):
        return None
    if not measured:
        return None
    kind = "loop" if "tokens_per_s" in measured[0] else "step"  # loop rows, skipped ones too, carry tokens_per_s
    name = CALIBRATION_VALUES[kind][0]
    chosen = _chosen_cells(row, measured, kind)
    frame = pd.DataFrame([{"batch_size": int(m["batch_size"]), "k": int(m["k"]), "value": m.get(name),
                           "chosen": (int(m["batch_size"]), int(m["k"])) in chosen,
                           "skipped": bool(m.get("skipped", False))} for m in measured])
    return frame, kind


def _chosen_cells(row, measured: list[dict], kind: str) -> set[tuple[int, int]]:
    """(batch size, k) cells the served schedule used: loop tables mark them; step tables by the schedule's k at
    each measured size."""
    if kind == "loop":
        return {(int(m["batch_size"]), int(m["k"])) for m in measured if m.get("chosen")}
    sched = schedule_of(row)
    return {(int(m["batch_size"]), int(m["k"])) for m in measured
            if any(lo <= int(m["batch_size"]) <= hi and k == int(m["k"]) for lo, hi, k in sched)}


def calibration_chart(frame: pd.DataFrame, kind: str) -> go.Figure:
    """Heatmap of the calibration's value by batch size (rows) and draft length (columns); the chosen cells are
    starred, skipped ones left blank."""
    grid = frame.pivot_table(index="batch_size", columns="k", values="value", aggfunc="first",
                              dropna=False).sort_index()
    chosen = set(zip(frame.loc[frame["chosen"], "batch_size"], frame.loc[frame["chosen"], "k"]))
    text = [[("" if pd.isna(grid.at[b, k]) else f"{grid.at[b, k]:,.1f}") + (" *" if (b, k) in chosen else "")
             for k in grid.columns] for b in grid.index]
    fig = go.Figure(go.Heatmap(z=grid.values, x=[f"k={k}" for k in grid.columns], y=[str(b) for b in grid.index],
                               text=text, texttemplate="%{text}", colorscale="Blues",
                               colorbar=dict(title=CALIBRATION_VALUES[kind][0])))
    fig.update_layout(title=f"Calibration: {CALIBRATION_VALUES[kind][1]} (* = served)", xaxis_title="draft length",
                      yaxis_title="batch size", yaxis_type="category", margin=dict(t=50, b=40), height=360)
    return fig


def calibration_uniform(row) -> bool:
    """Whether the run's loop calibration gave one k to every batch size (a draft model under full overlap:
    schedules.uniform_choice), as its stored table says."""
    try:
        return bool(json.loads(row.get("calibration_table") or "{}").get("uniform", False))
    except (ValueError, TypeError, AttributeError):
        return False


def schedule_shapes(row, frame: pd.DataFrame) -> dict[str, str]:
    """A loop calibration's schedule under each shape (workbench/serving/schedules.py, serve-bench's default
    MIN_GAIN), recomputed from the stored table: {"sticky": "1-8:4,9-64:2", "monotone": ..., "free": ...}, each made
    uniform as the run's was (`calibration_uniform`). Empty for step tables."""
    from workbench.serving.adaptive import format_k_by_batch  # torch-free
    from workbench.serving.schedules import MIN_GAIN, SCHEDULE_SHAPES, loop_schedule

    tps = {(int(r.batch_size), int(r.k)): r.value for r in frame.itertuples() if not r.skipped and
           not _missing(r.value)}
    top = max(1, int(_num(row.get("max_num_seqs"), 1)))
    if not tps:
        return {}
    uniform = calibration_uniform(row)
    return {shape: format_k_by_batch(loop_schedule(tps, top, MIN_GAIN, shape, uniform)) for shape in SCHEDULE_SHAPES}
