"""Models page: zoo presets with their sizes and held-out perplexity, registered local models, training a preset.

Training is `python -m workbench zoo train PRESET` started as a job; its progress is read from the step lines it logs
against the preset's time budget (the trainer stops on time).
"""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import streamlit as st

from ui import catalog, heads, jobs
from ui.common import PYTHON, Errors, check_model_path, int_field, job_panel
from workbench.zoo.cli import SIZE_UNIT

P = "models_"
STEP_RE = re.compile(r"^\[(target|draft)\] step\s+\d+.*?([\d.]+) s\s*$")


def presets_frame() -> pd.DataFrame:
    from workbench.zoo import PRESETS

    rows = []
    for name, preset in PRESETS.items():
        paths, err = catalog.resolve(name)
        row = {"preset": name, "trained": paths is not None,
               "target params": catalog.fmt_params(preset.target.param_count(preset.vocab_size)),
               "draft params": catalog.fmt_params(preset.draft.param_count(preset.vocab_size)),
               "target ppl (held-out)": None, "draft ppl (held-out)": None, "vocab": preset.vocab_size,
               f"size {SIZE_UNIT}": None, "trained on": None, "description": preset.description, "where": None}
        if paths is not None:
            m = catalog.manifest_of(paths)
            for role in ("target", "draft"):
                sec = m.get(role) or {}
                if sec.get("params"):
                    row[f"{role} params"] = catalog.fmt_params(sec["params"])
                if isinstance(sec.get("heldout_ppl"), (int, float)):
                    row[f"{role} ppl (held-out)"] = round(float(sec["heldout_ppl"]), 2)
            row[f"size {SIZE_UNIT}"] = catalog.disk_mib(Path(paths.root))
            row["trained on"] = m.get("device_name") or m.get("device")
            row["where"] = str(paths.root)
        else:
            row["where"] = f"not trained: {err}"
        rows.append(row)
    return pd.DataFrame(rows)


def curves_section() -> None:
    """Training loss curves from the trained presets' manifests."""
    import plotly.graph_objects as go
    from workbench.zoo import PRESETS

    fig = go.Figure()
    for name in PRESETS:
        paths, _ = catalog.resolve(name)
        if paths is None:
            continue
        manifest = catalog.manifest_of(paths)
        for role in ("target", "draft"):
            curve = (manifest.get(role) or {}).get("train_curve") or []
            if curve:
                fig.add_trace(go.Scatter(x=[c.get("tokens", c.get("step")) for c in curve],
                                         y=[c.get("train_ce") for c in curve], mode="lines", name=f"{name} {role}"))
    if not fig.data:
        return
    with st.expander("Training curves"):
        fig.update_layout(xaxis_title="training tokens", yaxis_title="train cross-entropy (nats/token)", height=320,
                          margin=dict(t=10, b=40))
        st.plotly_chart(fig, width="stretch", key=f"{P}curves")


def train_fraction(job: jobs.Job) -> float | None:
    """Share of the preset's training time budget used so far, from the trainer's `[role] step ... S s` lines."""
    from workbench.zoo import PRESETS

    preset = PRESETS.get(job.params.get("preset"))
    if preset is None:
        return None
    budget = job.params.get("max_seconds")
    t_target = preset.target_train.max_seconds
    t_draft = preset.draft_train.max_seconds
    if budget:  # the trainer splits an explicit budget in the preset's proportions
        scale = float(budget) / (t_target + t_draft)
        t_target, t_draft = t_target * scale, t_draft * scale
    fraction = 0.0
    for line in job.log_tail(20000).splitlines():
        m = STEP_RE.match(line.strip())
        if m:
            seconds = float(m.group(2))
            fraction = (min(seconds, t_target) / (t_target + t_draft) if m.group(1) == "target"
                        else (t_target + min(seconds, t_draft)) / (t_target + t_draft))
    return min(0.99, fraction)


def train_section() -> None:
    from workbench.zoo import PRESETS

    st.subheader("Train a preset")
    errors = Errors()
    cols = st.columns([1, 1, 1, 1])
    with cols[0]:
        name = st.selectbox("Preset", list(PRESETS), key=f"{P}train_preset")
    with cols[1]:
        device = st.selectbox("Device", ("auto", "cuda", "cpu"), key=f"{P}train_device",
                              help="auto: cuda when available, else cpu")
    with cols[2]:
        budget = int_field("Time budget (s, 0 = the preset's)", f"{P}train_seconds", 0, errors, 0, 86_400,
                           name="time budget")
    trained = catalog.resolve(name)[0] is not None
    with cols[3]:
        retrain = True
        if trained:
            retrain = st.checkbox("Retrain (overwrites its files)", key=f"{P}train_overwrite")
    st.caption(f"{PRESETS[name].description}. Runs `python -m workbench zoo train {name}` in the background.")
    if st.button("Train", key=f"{P}train_start", disabled=bool(errors) or not retrain,
                 icon=":material/model_training:"):
        argv = [PYTHON, "-m", "workbench", "zoo", "train", name]
        if device != "auto":
            argv += ["--device", device]
        if budget:
            argv += ["--max-seconds", str(budget)]
        jobs.start_job("train", argv, f"train {name}", params={"preset": name, "max_seconds": budget or None})
        st.rerun()

    train_jobs = jobs.list_jobs(kind="train")[:3]
    if not train_jobs:
        return
    running = any(j.status() == jobs.RUNNING for j in train_jobs)

    @st.fragment(run_every=2.0 if running else None)
    def watch() -> None:
        for job in train_jobs:
            with st.container(border=True):
                status = job_panel(job, P)
                if status == jobs.RUNNING:
                    frac = train_fraction(job)
                    if frac:
                        st.caption(f"about {frac:.0%} of the training time budget used")
        if running and all(j.status() != jobs.RUNNING for j in train_jobs):
            st.rerun()

    watch()


HEAD_COLUMNS = ("preset", "kind", "layout", "params", "saved dtype", "draft vocab", "steps", "tokens trained",
                "train s", "stopped by", "came from", "folder")


def heads_frame(rows: list[dict]) -> pd.DataFrame:
    """Head rows (ui.heads.summary) as a table: identity, held-out agreement per depth, then training and origin."""
    table = pd.DataFrame(heads.agreement_table(rows))
    depths = [c for c in table.columns if c.startswith("depth ")]
    table["params"] = [catalog.fmt_params(n) if n else None for n in table["params"]]
    cols = ["preset", "kind", "layout", *depths, *(c for c in HEAD_COLUMNS[3:] if c in table.columns)]
    return table[[c for c in cols if c in table.columns]]


def agreement_chart(rows: list[dict], key: str) -> None:
    """Held-out top-1 agreement with the target by draft depth, one line per head (untrained dotted where known)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for row in rows:
        name = f"{row.get('preset') or ''} {row['kind'] or ''}".strip() or row["folder"]
        for series, dash in (("agreement by depth", None), ("untrained agreement by depth", "dot")):
            values = row[series]
            if values:
                fig.add_trace(go.Scatter(x=list(range(1, len(values) + 1)), y=values, mode="lines+markers",
                                         name=name + (" (untrained)" if dash else ""), line=dict(dash=dash)))
    if fig.data:
        fig.update_layout(xaxis_title="draft depth", yaxis_title="held-out top-1 agreement", yaxis_range=[0, 1],
                          xaxis_dtick=1, height=300, margin=dict(t=10, b=40))
        st.plotly_chart(fig, width="stretch", key=key)


def heads_section() -> None:
    """Draft heads: those trained beside each preset's target, and any head folder the user types."""
    st.subheader("Draft heads")
    try:
        rows = heads.trained_heads()
    except Exception as exc:  # noqa: BLE001
        st.error(f"cannot list the trained heads: {exc}")
        rows = []
    if rows:
        st.dataframe(heads_frame(rows), hide_index=True, width="stretch")
        st.caption("Held-out top-1 agreement with the target at each draft depth (the share of held-out positions "
                   "where the head's greedy token at that depth is the target's), from each head's manifest; tokens "
                   "trained: the manifest's count, else its steps x batch x window length. "
                   "`zoo train-head --kind eagle|eagle3|redrafter --preset P` trains one beside the preset's target; "
                   "the Run page uses it by default.")
        agreement_chart(rows, f"{P}head_chart")
    else:
        st.caption("No trained head found beside a preset's target (train one with `python -m workbench zoo "
                   "train-head --kind eagle3 --preset P`).")
    text = st.text_input("Inspect a head folder", key=f"{P}head_path",
                         placeholder="a published EAGLE / EAGLE-3 checkpoint or a head folder (config.json, "
                                     "manifest.json)")
    row, err = heads.inspect_folder(text)
    if err:
        st.error(err, icon=":material/error:")
    elif row is not None:
        st.dataframe(heads_frame([row]), hide_index=True, width="stretch")
        if row["agreement by depth"]:
            agreement_chart([row], f"{P}head_path_chart")
        else:
            st.caption("No held-out agreement recorded for this head (no manifest.json with heldout."
                       "agreement_by_depth): benchmark it on the Run page to see its acceptance.")


def local_models_section() -> None:
    st.subheader("Local models")
    models = catalog.registered_models()
    if models:
        rows = []
        for m in models:
            row = {"name": m["name"], "target": m["target"], "draft": m.get("draft") or "—",
                   "note": m.get("note", "")}
            for role in ("target", "draft"):
                p = m.get(role)
                if not p:
                    continue
                path = Path(p)
                ok = path.exists()
                row[f"{role} params"] = catalog.fmt_params(catalog.safetensors_params(path)) if ok else "missing"
                row[f"{role} {SIZE_UNIT}"] = catalog.disk_mib(path) if ok else None
            rows.append(row)
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
        st.caption("Held-out quality of a local model is unknown until it is benchmarked (see acceptance on the "
                   "Results page). Use them on the Run page under *Local model paths*.")
        cols = st.columns([2, 1, 3])
        with cols[0]:
            drop = st.selectbox("Remove", [m["name"] for m in models], key=f"{P}remove_pick")
        with cols[1]:
            st.write("")
            if st.button("Remove from list", key=f"{P}remove"):
                catalog.unregister_model(drop)
                st.rerun()
    else:
        st.caption("No local model registered yet.")
    with st.container(border=True):
        st.markdown("**Register a local model** (a folder with config.json + *.safetensors, or a .gguf file)")
        cols = st.columns(4)
        fields = {}
        for col, (key, label) in zip(cols, (("reg_name", "Name"), ("reg_target", "Target model path"),
                                            ("reg_draft", "Draft model path (optional)"),
                                            ("reg_note", "Note (optional)"))):
            with col:
                fields[key] = (st.text_input(label, key=f"{P}{key}").strip(), st.container())
        clicked = st.button("Register", key=f"{P}reg_submit", icon=":material/add:")
    if not clicked:
        return
    errors = Errors()
    name, target, draft, note = (fields[k][0] for k in ("reg_name", "reg_target", "reg_draft", "reg_note"))
    with fields["reg_name"][1]:
        if not re.fullmatch(r"[\w.-]{1,64}", name):
            errors.add(f"{P}reg_name", "name: 1-64 letters, digits, '_', '.', '-'")
    with fields["reg_target"][1]:
        tpath, terr = check_model_path(target, "target")
        errors.add(f"{P}reg_target", terr)
    dpath = None
    if draft:
        with fields["reg_draft"][1]:
            dpath, derr = check_model_path(draft, "draft")
            errors.add(f"{P}reg_draft", derr)
    if not errors:
        catalog.register_model(name, tpath, dpath, note)
        st.toast(f"registered {name}")
        st.rerun()


def render() -> None:
    st.title("Models")
    st.subheader("Zoo presets")
    try:
        df = presets_frame()
    except Exception as exc:  # noqa: BLE001
        st.error(f"cannot read the model zoo: {exc}")
    else:
        st.dataframe(df, hide_index=True, width="stretch",
                     column_config={"trained": st.column_config.CheckboxColumn("trained")})
        st.caption("Perplexity on held-out Python files the models never saw (lower is better); sizes from each "
                   "preset's manifest. The draft's quality shows up as acceptance rate on the Run page.")
        curves_section()
        train_section()
    local_models_section()
    heads_section()


if __name__ == "__main__":
    render()
