"""Run page: choose models, a method and its settings, start a benchmark in the background, read its metrics.

The benchmark is `python -m workbench bench ... --json --store DIR`, started as a job (ui.jobs): this page only builds
its command line, polls it and reads the stored result back. The form has one field per knob the method reads
(workbench.settings: label, widget kind, bounds, default and help come from there): the few a user sets first, the
rest under "Advanced", and the GPU-only ones only where a GPU is visible (otherwise the run keeps their defaults).
Every setting is validated here first, with the error shown under its input, and nothing is started while any input
is wrong.
"""
from __future__ import annotations

import math
from pathlib import Path

import streamlit as st

from ui import catalog, charts, gpu_page, heads, jobs
from ui.common import GPU_ONLY_CHOICES, PYTHON, Errors, check_model_path, job_label, job_panel, knob_field, store_root
from workbench.settings import BASIC_KNOBS, FEATURE_METHODS, GPU_ONLY_KNOBS, KNOBS, SettingError, check

P = "run_"  # widget-key prefix of this page
PRESET, LOCAL = "Built-in preset", "Local model paths"
HEAD_BESIDE, HEAD_PATH = "Built-in / trained (beside the target)", "Path (a head folder)"
PROMPTS_PRESET, PROMPTS_UPLOAD, PROMPTS_PATH = "Preset prompts", "Upload a file", "File on disk"
DEVICES = ("auto", "cpu", "cuda")
GROUPS = {"method": "Method", "run": "Run", "sampling": "Sampling", "system": "System"}  # knob group -> heading
COLUMNS = 4


def model_section(errors: Errors, method: str) -> dict:
    out: dict = {}
    source = st.radio("Models", (PRESET, LOCAL), key=f"{P}model_source", horizontal=True)
    if source == PRESET:
        try:
            names = catalog.preset_names()
        except Exception as exc:  # noqa: BLE001
            errors.add(f"{P}preset", f"cannot list zoo presets: {exc}")
            return out
        preset = st.selectbox("Preset", names, key=f"{P}preset",
                              help="Target/draft pairs of the built-in model zoo (trained on the Models page).")
        paths, err = catalog.resolve(preset)
        errors.add(f"{P}preset", err)
        out["preset"] = preset
        out["preset_paths"] = paths
    else:
        registered = catalog.registered_models()
        if registered:
            by_name = {m["name"]: m for m in registered}

            def fill() -> None:
                m = by_name.get(st.session_state.get(f"{P}registered"))
                if m:
                    st.session_state[f"{P}target_path"] = m["target"]
                    st.session_state[f"{P}draft_path"] = m.get("draft") or ""

            st.selectbox("Registered model (fills the paths)", list(by_name), index=None, key=f"{P}registered",
                         on_change=fill, placeholder="registered on the Models page")
        target = st.text_input("Target model", key=f"{P}target_path",
                               placeholder="folder with config.json + model.safetensors, or a .gguf file")
        path, err = check_model_path(target, "target")
        errors.add(f"{P}target_path", err)
        out["model"] = path
        draft = st.text_input("Draft model" + ("" if method == "draft" else " (only used by method 'draft')"),
                              key=f"{P}draft_path", placeholder="folder or .gguf file")
        if method == "draft" or draft.strip():
            dpath, derr = check_model_path(draft, "draft")
            errors.add(f"{P}draft_path", derr)
            out["draft"] = dpath
    return out


def _agreement_text(agreement: list[float]) -> str:
    return " / ".join(f"{a:.2f}" for a in agreement) if agreement else "not recorded"


def head_section(errors: Errors, method: str, models: dict, preset_paths) -> dict:
    """The draft head of a feature method: the one beside the target (trained by zoo train-head; an untrained one
    when none is there), or a head folder given as `--draft-head DIR` (published EAGLE-1/2 or EAGLE-3 layout, or one
    `zoo export-head` wrote), checked here for config.json and weights before anything starts."""
    if method not in FEATURE_METHODS:
        return {}
    target_root = Path(preset_paths.root) if preset_paths is not None else \
        (Path(models["model"]).parent if models.get("model") else None)
    beside = target_root / method if target_root is not None else None
    if method not in heads.PATH_METHODS:
        choice = HEAD_BESIDE
        st.caption(f"Draft head: method {method} runs the head trained beside the target "
                   f"(`zoo train-head --kind {method}`); it has no published layout to load from a path.")
    else:
        choice = st.radio("Draft head", (HEAD_BESIDE, HEAD_PATH), key=f"{P}head_source", horizontal=True,
                          help="beside the target: the head `zoo train-head` put in <preset folder>/" + method
                               + " (an untrained one when there is none); path: a head folder (config.json + "
                               "model.safetensors or pytorch_model.bin), passed as --draft-head")
    if choice == HEAD_BESIDE:
        if beside is not None and (beside / "config.json").is_file():
            row = heads.summary(beside, method)
            st.caption(f"Trained head: `{beside}` · held-out top-1 agreement by depth "
                       f"{_agreement_text(row['agreement by depth'])} · {row['came from']}")
        elif beside is not None:
            st.caption(f"No trained {method} head at `{beside}`: the run uses an untrained head (train one with "
                       f"`python -m workbench zoo train-head --kind {method}`).")
        return {}
    path, err = heads.check_head_path(st.text_input("Draft head folder", key=f"{P}head_path",
                                                    placeholder="folder with config.json + model.safetensors"),
                                      method)
    errors.add(f"{P}head_path", err)
    if path is not None:
        row = heads.summary(path)
        st.caption(f"{row['layout'] or 'unknown'} layout · {catalog.fmt_params(row['params'])} parameters"
                   + (f" · draft vocabulary {row['draft vocab']}" if row["draft vocab"] else "")
                   + (f" · held-out agreement by depth {_agreement_text(row['agreement by depth'])}"
                      if row["agreement by depth"] else "") + f" · {row['came from']}")
        return {"draft_head": path}
    return {}


def prompt_section(errors: Errors, preset_paths, local_models: bool) -> dict:
    choice = st.radio("Prompts", (PROMPTS_PRESET, PROMPTS_UPLOAD, PROMPTS_PATH), key=f"{P}prompt_source",
                      horizontal=True)
    path = None
    if choice == PROMPTS_PRESET:
        if local_models:  # local models have no prompts of their own: use the tiny preset's held-out prompts
            preset_paths, err = catalog.resolve("tiny")
            errors.add(f"{P}prompt_source", err and f"local models need a prompt file ({err})")
            if preset_paths is None:
                return {}
        if preset_paths is not None:
            st.caption(f"held-out prompts of the preset: `{preset_paths.prompts_path}`")
            return {"prompts": str(preset_paths.prompts_path)} if local_models else {}
        return {}
    if choice == PROMPTS_UPLOAD:
        up = st.file_uploader("Prompt file (JSONL {\"prompt\": ...}, MT-bench question.jsonl, or .txt)",
                              type=["jsonl", "json", "txt"], key=f"{P}prompt_upload")
        if up is None:
            errors.add(f"{P}prompt_upload", "choose a prompt file to upload")
            return {}
        path = catalog.save_upload(up.name, up.getvalue())
    else:
        text = st.text_input("Prompt file path", key=f"{P}prompt_path",
                             placeholder="prompts.jsonl or MT-bench / Spec-Bench question.jsonl")
        path = text
    prompts, err = catalog.load_prompt_file(path)
    errors.add(f"{P}prompt_file", err)
    if prompts:
        cats = sorted({getattr(p, "category", "") or "-" for p in prompts})
        st.caption(f"{len(prompts)} prompts; categories: {', '.join(cats[:8])}{' ...' if len(cats) > 8 else ''}")
        return {"prompts": str(catalog.prompt_path(path))}
    return {}


def visible_knobs(method: str, gpu: bool) -> tuple[list, list]:
    """(basic, advanced) knobs of the form for `method`: the basic ones (workbench.settings.BASIC_KNOBS) shown first,
    every other knob the method reads under "Advanced"; the GPU-only ones only where a GPU is visible."""
    knobs = [k for k in KNOBS.values() if k.name != "method" and k.reads(method)
             and (gpu or k.name not in GPU_ONLY_KNOBS)]
    return [k for k in knobs if k.name in BASIC_KNOBS], [k for k in knobs if k.name not in BASIC_KNOBS]


def _grid(knobs: list, s: dict, errors: Errors, gpu: bool) -> None:
    for row in range(0, len(knobs), COLUMNS):
        for col, knob in zip(st.columns(COLUMNS), knobs[row:row + COLUMNS]):
            with col:
                choices = None if gpu or not knob.choices else \
                    tuple(c for c in knob.choices if c not in GPU_ONLY_CHOICES.get(knob.name, ()))
                s[knob.name] = knob_field(knob, f"{P}{knob.name}", errors, choices=choices)


def settings_section(errors: Errors, method: str) -> dict:
    """The knobs the method reads (workbench.settings): the few a user sets first, then an "Advanced" expander
    grouped as the registry groups them; then the rules between knobs. GPU-only knobs are left out where no GPU is
    visible, so the run gets their defaults."""
    s: dict = {"method": method}
    gpu = gpu_page.gpu_state()
    basic, advanced = visible_knobs(method, gpu["cuda_available"])
    _grid(basic, s, errors, gpu["cuda_available"])
    with st.expander("Advanced", expanded=False):
        with st.columns(COLUMNS)[0]:
            s["device"] = st.selectbox("Device", DEVICES, key=f"{P}device", help="auto: cuda when available, else cpu")
            if s["device"] == "cuda" and not gpu["cuda_available"]:
                reason = gpu.get("reason") or "torch.cuda.is_available() is False"
                errors.add(f"{P}device", f"no CUDA GPU here ({reason})")
        for group, heading in GROUPS.items():
            knobs = [k for k in advanced if k.group == group]
            if heading and knobs:
                st.markdown(f"**{heading}**")
            _grid(knobs, s, errors, gpu["cuda_available"])
        if not gpu["cuda_available"]:
            hidden = [KNOBS[n].label for n in GPU_ONLY_KNOBS if n in KNOBS and KNOBS[n].reads(method)]
            st.caption(f"No GPU visible: the GPU-only settings ({', '.join(hidden)}; fp8 weights) are hidden and "
                       "keep their defaults.")
    if not errors:
        try:
            check(s)
        except SettingError as e:
            errors.add(f"{P}{e.knob}", str(e))
    return s


def bench_argv(settings: dict, models: dict, prompts: dict) -> list[str]:
    """The `python -m workbench bench` command line for these (validated) settings."""
    argv = [PYTHON, "-m", "workbench", "bench"]
    if models.get("preset"):
        argv += ["--preset", models["preset"]]
    if models.get("model"):
        argv += ["--model", str(models["model"])]
    if models.get("draft"):
        argv += ["--draft", str(models["draft"])]
    if models.get("draft_head"):
        argv += ["--draft-head", str(models["draft_head"])]
    if prompts.get("prompts"):
        argv += ["--prompts", prompts["prompts"]]
    for name, value in settings.items():
        if value is None or (name in KNOBS and KNOBS[name].auto and value == KNOBS[name].format("auto")):
            continue  # an auto knob left on auto: the command's own default, resolved per device
        if isinstance(value, bool):
            argv.append(f"--{'' if value else 'no-'}{name.replace('_', '-')}")
            continue
        argv += [f"--{name.replace('_', '-')}", KNOBS[name].format(value) if name in KNOBS else str(value)]
    return argv + ["--json", "--store", str(store_root())]


# ---- results -----------------------------------------------------------------------------------------------------

def _flag(value) -> bool | None:
    """A record's bool column as True / False / None (a store row holds numpy bools or pd.NA)."""
    import pandas as pd

    return None if value is None or value is pd.NA else bool(value)


def _fmt(value, fmt: str, suffix: str = "") -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "—"
    return "—" if math.isnan(v) else f"{v:{fmt}}{suffix}"


def _int(value) -> int | None:
    """A store cell as an int, None where it is missing (pd.NA, NaN, None)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else int(v)


def _ms(value) -> str:
    """Milliseconds with a precision that fits a metric tile: 1,234 ms, 56.7 ms, 3.21 ms."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "—"
    if math.isnan(v):
        return "—"
    return f"{v:,.0f} ms" if v >= 100 else f"{v:.1f} ms" if v >= 10 else f"{v:.2f} ms"


SLOWDOWN_NOTE = (
    "Slower than autoregressive decoding. Speculation pays only when a draft token is much cheaper than a target "
    "step and most drafts are accepted: each step runs the draft k times plus one target pass over k+1 tokens. "
    "The default settings use tiny models on the CPU, where a step is bound by per-call latency (Python, kernel "
    "launches), not by the target's size, so the draft costs almost as much as the target and the extra work "
    "shows as a slowdown. Try a larger target with a small draft (or the ngram method, whose draft is nearly free), "
    "a GPU, and a smaller k when the acceptance rate is low.")


def job_record(job: jobs.Job) -> tuple[dict | None, object]:
    """(run record, traces frame) of a finished bench job: from the store, else from the job's JSON output."""
    out = job.result()
    if isinstance(out, dict) and isinstance(out.get("record"), dict):
        out = out["record"]
    if isinstance(out, list) and out:
        out = out[-1]
    record = out if isinstance(out, dict) else None
    traces = None
    run_id = record.get("run_id") if record else None
    if run_id:
        try:
            store = _store()
            df = store.load(filters={"run_id": run_id})
            if len(df):
                record = df.iloc[-1].to_dict()
            traces = store.load_traces([run_id])
        except Exception as exc:  # noqa: BLE001 - show what the job printed even if the store cannot be read
            st.warning(f"could not read run {run_id} from the store {store_root()}: {exc}")
    return record, traces


def _store():
    from results.store import ResultStore

    return ResultStore(store_root())


def show_metrics(record: dict, traces) -> None:
    if record.get("status") == "failed":
        st.error(f"The run failed: {record.get('error')}", icon=":material/error:")
        return
    cols = st.columns(6)
    lo, hi = _fmt(record.get("speedup_ci_low"), ".2f", "x"), _fmt(record.get("speedup_ci_high"), ".2f", "x")
    interval = f"; 95% interval over repeats {lo} to {hi}" if lo != "—" else "; no interval (1 repeat)"
    cols[0].metric("Speedup vs AR", _fmt(record.get("speedup_vs_ar"), ".2f", "x"),
                   help="tokens/s of this method / tokens/s of autoregressive decoding, measured in the same run"
                        + interval)
    cols[1].metric("Acceptance rate", _fmt(record.get("acceptance_rate"), ".0%"),
                   help="accepted draft tokens / drafted tokens")
    cols[2].metric("Mean accepted tokens", _fmt(record.get("mean_accepted_tokens"), ".2f"),
                   help="tokens emitted per target step (accepted + 1)")
    cols[3].metric("Tokens/s", _fmt(record.get("tokens_per_s"), ",.1f"),
                   help=f"autoregressive in the same run: {_fmt(record.get('ar_tokens_per_s'), ',.1f')} tokens/s")
    cols[4].metric("TTFT", _ms(record.get("ttft_ms")), help="time to first token")
    cols[5].metric("TPOT p50", _ms(record.get("tpot_ms_p50")),
                   help=f"time per output token; p90 {_ms(record.get('tpot_ms_p90'))}, "
                        f"p99 {_ms(record.get('tpot_ms_p99'))}")
    greedy = _flag(record.get("greedy_matches_ar"))
    greedy_text = {True: "greedy output identical to autoregressive: **yes**",
                   False: "greedy output identical to autoregressive: **NO** (a correctness problem, or a near tie "
                          "in reduced precision)",
                   None: "greedy match to autoregressive: not checked (sampling, or method ar)"}[greedy]
    st.markdown(f"Autoregressive baseline in the same run: **{_fmt(record.get('ar_tokens_per_s'), ',.1f')} "
                f"tokens/s** · {greedy_text}")
    head = record.get("draft_head")
    if isinstance(head, str) and head:
        vocab = record.get("draft_vocab_size")
        params = catalog.fmt_params(_int(record.get("draft_head_params")))
        st.markdown(f"Draft head: `{head}` · layout **{record.get('draft_head_layout') or '?'}** · stored "
                    f"{record.get('draft_head_dtype') or '?'} · {params} parameters" + (f" · draft vocabulary {_int(vocab)}" if _int(vocab) else ""))
    if greedy is False:
        st.error("The speculative output differs from plain autoregressive decoding at temperature 0.",
                 icon=":material/error:")
    speedup = record.get("speedup_vs_ar")
    if _fmt(speedup, ".2f") != "—" and float(speedup) < 1.0 and record.get("method") != "ar":
        st.info(SLOWDOWN_NOTE, icon=":material/lightbulb:")
    if _flag(record.get("plausible")) is False:
        st.error(f"Implausible numbers: {record.get('implausible_reason')}", icon=":material/error:")
    if _flag(record.get("noisy")):
        st.warning(f"Noisy run, the headline is not supported by its repeats: {record.get('noisy_reason')}",
                   icon=":material/warning:")
    figs = [charts.acceptance_by_position(record), charts.accepted_per_step_histogram(traces),
            charts.time_split(record)]
    cols = st.columns(3)
    for col, fig, missing in zip(cols, figs, ("no acceptance-by-position data (autoregressive run?)",
                                              "no per-step traces stored for this run",
                                              "no phase timings in this run")):
        with col:
            if fig is None:
                st.info(missing)
            else:
                st.plotly_chart(fig, width="stretch", key=f"{P}chart_{missing[:12]}")
    with st.expander("Full record"):
        st.json({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()
                 if k != "telemetry_timeline"}, expanded=False)


def job_section() -> None:
    bench_jobs = jobs.list_jobs(kind="bench")
    if not bench_jobs:
        st.info("No benchmark started yet: set it up above and press **Start benchmark**.")
        return
    ids = [j.id for j in bench_jobs]
    pending = st.session_state.pop(f"{P}pending_job", None)
    if pending in ids:
        st.session_state[f"{P}job_pick"] = pending
    elif f"{P}job_pick" not in st.session_state and st.query_params.get("job") in ids:
        st.session_state[f"{P}job_pick"] = st.query_params["job"]
    by_id = {j.id: j for j in bench_jobs}
    job_id = st.selectbox("Benchmark job", ids, key=f"{P}job_pick", format_func=lambda i: job_label(by_id[i]))
    if st.query_params.get("job") != job_id:
        st.query_params["job"] = job_id
    job = by_id[job_id]
    running = job.status() == jobs.RUNNING
    others = sum(1 for j in bench_jobs if j.id != job_id and j.status() == jobs.RUNNING)
    if others:
        st.caption(f"{others} other benchmark job(s) running")

    @st.fragment(run_every=1.0 if running else None)
    def watch() -> None:
        status = job_panel(job, P)
        if running and status != jobs.RUNNING:
            st.rerun()  # the whole page: render the finished run's metrics

    watch()
    if job.status() == jobs.DONE:
        record, traces = job_record(job)
        if record is None:
            st.warning("The job finished but printed no run record; see its log.")
        else:
            show_metrics(record, traces)


def render() -> None:
    st.title("Run a benchmark")
    st.caption("Speculative decoding against plain autoregressive decoding, measured in the same run. "
               "The run goes to the result store; see it on the Results page.")
    errors = Errors()
    with st.container(border=True):
        method = knob_field(KNOBS["method"], f"{P}method", errors)
        models = model_section(errors, method)
        preset_paths = models.pop("preset_paths", None)
        models.update(head_section(errors, method, models, preset_paths))
        prompts = prompt_section(errors, preset_paths, local_models="model" in models)
        settings = settings_section(errors, method)
    if errors:
        st.warning(f"Fix the {len(errors)} problem(s) above to start a run.", icon=":material/warning:")
    if st.button("Start benchmark", key=f"{P}start", type="primary", disabled=bool(errors),
                 icon=":material/play_arrow:"):
        argv = bench_argv(settings, models, prompts)
        title = f"{method}" + (f" k={settings['k']}" if "k" in settings else "") + f" batch={settings['batch']}"
        title += f" · {models.get('preset') or models.get('model').name}"
        if models.get("draft_head"):
            title += f" · head {Path(models['draft_head']).name}"
        job = jobs.start_job("bench", argv, title, params={**settings, **{k: str(v) for k, v in models.items()},
                                                           **prompts})
        st.session_state[f"{P}pending_job"] = job.id
        st.rerun()
    st.divider()
    job_section()


if __name__ == "__main__":
    render()
