"""Serving page: `serve-bench` runs (in-flight batching under a request load) from the result store, and a form that
starts one in the background.

Charts: goodput and p99 TPOT against request rate, one line per setting (off / fixed k / adaptive); the latency
percentiles of each run; acceptance by live batch size and by context length (the runs' JSON columns); the
per-request latency distribution (the per-request rows stored beside each run); a calibrated run's measured table
(tokens/s by batch size and draft length) with the schedule each shape makes of it; the run's draft-length schedule as
vLLM / TensorRT-LLM / SGLang snippets with a download. The form is generated from workbench.settings (SERVE_RUN_KNOBS
+ SERVE_KNOBS) like the Run page's (GPU-only knobs only where a GPU is visible), and starts
`python -m workbench serve-bench ... --json --store DIR` as a job. Its other source is an OpenAI-compatible server
(vLLM, SGLang, `workbench serve`): `serve-bench --endpoint URL` with the page's load settings, or, given a launch
template, `python -m studies.serving --launch TEMPLATE --search ...` (the server relaunched per trial); their rows show
beside ours, labelled by the server's engine.
"""
from __future__ import annotations

import json
from urllib.parse import urlsplit

import pandas as pd
import streamlit as st

from ui import catalog, gpu_page, jobs, serving_view as sv
from ui.common import (PYTHON, Errors, get_store, int_field, job_label, job_panel, knob_field, store_root,
                       study_storage_url)
from workbench.serving.config import SERVE_METHODS
from workbench.settings import (GPU_ONLY_KNOBS, KNOBS, SERVE_KNOBS, SERVE_RUN_KNOBS, SettingError,
                                check_serve, parse_k_by_batch)

P = "srv_"  # widget-key prefix of this page
DEVICES = ("auto", "cpu", "cuda")
GROUPS = {"method": None, "run": None, "sampling": "Sampling", "system": "System", "load": "Load",
          "serving": "Scheduler and cache", "adaptive": "Adaptive speculation"}
COLUMNS = 4
MAX_RUNS = 12  # per-run charts show at most this many runs
# the form's defaults where the registry's are for a GPU: a click on the CPU should take seconds
FORM_DEFAULTS = {"num_requests": 8, "max_new_tokens": 16, "rate": 20.0, "k": 3, "method": "ngram"}
HEADLINE = (("request_throughput", "Requests/s", "{:.2f}"), ("goodput", "Goodput (req/s)", "{:.2f}"),
            ("output_throughput", "Output tokens/s", "{:,.1f}"), ("ttft_ms_p99", "TTFT p99", "{:.1f} ms"),
            ("tpot_ms_p99", "TPOT p99", "{:.2f} ms"), ("acceptance_rate", "Acceptance", "{:.0%}"))


SOURCES = {"engine": "This workbench's engine", "endpoint": "An OpenAI-compatible endpoint"}
DEFAULT_URL = "http://127.0.0.1:8000"
BUILTIN_PROMPTS = "(built-in prompts)"
# what the endpoint bench reads of the run knobs (the server's own settings are its launch command's business)
ENDPOINT_RUN_KNOBS = ("max_new_tokens", "temperature", "seed")


# ---- the form --------------------------------------------------------------------------------------------------

def serve_knobs():
    """Every knob serve-bench reads, in form order (method first)."""
    return [KNOBS[n] for n in SERVE_RUN_KNOBS] + list(SERVE_KNOBS.values())


def _k_by_batch_field(errors: Errors) -> str:
    knob = SERVE_KNOBS["k_by_batch"]
    key = f"{P}k_by_batch"
    with st.container():
        text = st.text_input(knob.label, value="", key=key, help=knob.help, placeholder="e.g. 1-4:4,5-16:2")
        try:
            parse_k_by_batch(text)
        except SettingError as e:
            errors.add(key, str(e))
    return text.strip()


def form_section(errors: Errors) -> dict:
    """The preset, device and one field per serving knob the method reads; then the rules between knobs."""
    s: dict = {}
    cols = st.columns(COLUMNS)
    with cols[0]:
        s["method"] = st.selectbox(KNOBS["method"].label, SERVE_METHODS, key=f"{P}method",
                                   index=SERVE_METHODS.index(FORM_DEFAULTS["method"]), help=KNOBS["method"].help)
    with cols[1]:
        try:
            names = catalog.preset_names()
        except Exception as exc:  # noqa: BLE001
            errors.add(f"{P}preset", f"cannot list zoo presets: {exc}")
            names = []
        preset = st.selectbox("Preset", names, key=f"{P}preset", help="target/draft pair of the model zoo")
        if preset:
            _, err = catalog.resolve(preset)
            errors.add(f"{P}preset", err)
    gpu = gpu_page.gpu_state()
    with cols[2]:
        device = st.selectbox("Device", DEVICES, key=f"{P}device", help="auto: cuda when available, else cpu")
        if device == "cuda" and not gpu["cuda_available"]:
            errors.add(f"{P}device", f"no CUDA GPU here ({gpu.get('reason') or 'torch.cuda unavailable'})")
    method = s["method"]
    for group, heading in GROUPS.items():  # GPU-only knobs only where a GPU is visible; hidden, they keep defaults
        knobs = [k for k in serve_knobs() if k.group == group and k.name != "method" and k.reads(method)
                 and (gpu["cuda_available"] or k.name not in GPU_ONLY_KNOBS)]
        if not knobs:
            continue
        if heading:
            st.markdown(f"**{heading}**")
        for row in range(0, len(knobs), COLUMNS):
            for col, knob in zip(st.columns(COLUMNS), knobs[row:row + COLUMNS]):
                with col:
                    if knob.name == "k_by_batch":
                        s[knob.name] = _k_by_batch_field(errors)
                    else:
                        s[knob.name] = knob_field(knob, f"{P}{knob.name}", errors,
                                                  default=FORM_DEFAULTS.get(knob.name))
    if not errors:
        try:
            check_serve(s)
        except SettingError as e:
            errors.add(f"{P}{e.knob}", str(e))
    return {"settings": s, "preset": preset, "device": device}


def serve_argv(settings: dict, preset: str, device: str) -> list[str]:
    """The `python -m workbench serve-bench` command line for these (validated) settings."""
    argv = [PYTHON, "-m", "workbench", "serve-bench", "--preset", preset, "--device", device]
    knobs = {k.name: k for k in serve_knobs()}
    for name, value in settings.items():
        if value is None or (getattr(knobs.get(name), "auto", False) and value == "auto"):
            continue  # an auto knob left on auto: serve-bench's own default, resolved per device
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{'' if value else 'no-'}{name.replace('_', '-')}")
        elif name == "k_by_batch":
            if value:
                argv += [flag, value]
        else:
            argv += [flag, knobs[name].format(value)]
    return argv + ["--json", "--store", str(store_root())]


def endpoint_knobs():
    """The knobs an endpoint run reads: the load and the request's length, temperature and seed."""
    return [KNOBS[n] for n in ENDPOINT_RUN_KNOBS] + [k for k in SERVE_KNOBS.values() if k.group == "load"]


def check_url(url: str) -> str | None:
    """None for an http(s) URL naming a host, else the problem in words.

    >>> check_url("http://127.0.0.1:8000") is None, check_url("http://:8000")
    (True, "server URL 'http://:8000' names no host: write it as http://127.0.0.1:8000")
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        return f"server URL must start with http:// or https:// (e.g. {DEFAULT_URL}), got {url.strip()!r}"
    if not parts.hostname:
        return f"server URL {url.strip()!r} names no host: write it as {DEFAULT_URL}"
    return None


def search_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def check_launch(template: str, search: str) -> tuple[str | None, str | None]:
    """(error of the template, error of the search lines) with studies.serving's own parsers; (None, None) when the
    template is empty and no search is given."""
    from workbench.serving.launcher import LaunchError, LaunchTemplate  # torch-free, as studies.launch is

    if not template.strip():
        return None, ("search values need a launch template: give the server's command line with {name} "
                      "placeholders, or clear the search values" if search_lines(search) else None)
    try:
        parsed = LaunchTemplate(template.strip())
    except LaunchError as e:
        return str(e), None
    from studies.launch import LaunchStudyError, parse_search

    try:
        parse_search(search_lines(search), parsed)
    except LaunchStudyError as e:
        return None, str(e)
    return None, None


def endpoint_form(errors: Errors) -> dict:
    """The server (URL, model, prompts), optionally a launch template and its search, and the load."""
    # with a template the launcher serves on a free port of 127.0.0.1 it picks per trial: no URL to give
    templated = bool(str(st.session_state.get(f"{P}ep_template", "")).strip())
    cols = st.columns(3)
    with cols[0], st.container():
        url = st.text_input("Server URL", value=DEFAULT_URL, key=f"{P}ep_url", disabled=templated,
                            help="an OpenAI-compatible server: streamed /v1/completions, acceptance from /metrics "
                                 "(unused with a launch template: each launch gets a free port on 127.0.0.1)")
        if not templated:
            errors.add(f"{P}ep_url", check_url(url))
    with cols[1]:
        model = st.text_input("Model name", value="", key=f"{P}ep_model", placeholder="first of /v1/models",
                              help="the served model's name (empty: the first the server lists)")
    with cols[2]:
        try:
            names = catalog.preset_names()
        except Exception as exc:  # noqa: BLE001
            errors.add(f"{P}ep_prompts", f"cannot list zoo presets: {exc}")
            names = []
        prompts = st.selectbox("Prompts", [BUILTIN_PROMPTS, *names], key=f"{P}ep_prompts",
                               help="the prompt set of the load: a preset's (as its in-process runs use) or the "
                                    "built-in one (the tiny preset's held-out prompts)")
    st.markdown("**Launch template** (optional: relaunch the server per trial)")
    with st.container():
        template = st.text_area("Launch template", value="", key=f"{P}ep_template", height=80,
                                placeholder="vllm serve /models/llama --port {port} --speculative-config "
                                            "'{{\"method\": \"ngram\", \"num_speculative_tokens\": {k}}}'",
                                help="the server's command line: {name} is a searched setting, {port} the port the "
                                     "launcher picks, literal braces doubled; empty: benchmark the running server")
        t_err, s_err = check_launch(template, st.session_state.get(f"{P}ep_search", ""))
        errors.add(f"{P}ep_template", t_err)
    cols = st.columns(3)
    with cols[0], st.container():
        search = st.text_area("Search values", value="", key=f"{P}ep_search", height=80, placeholder="k=1,2,3,4",
                              help="one NAME=V1,V2 line per placeholder of the template (one value fixes it)")
        errors.add(f"{P}ep_search", s_err)
    study = trials = timeout = None
    if template.strip():
        with cols[1], st.container():
            study = st.text_input("Study name", value="endpoint-launch", key=f"{P}ep_study")
            if not study.strip():
                errors.add(f"{P}ep_study", "a launch study needs a name (studies.serving --study)")
        with cols[2]:
            trials = int_field("Trials", f"{P}ep_trials", 6, errors, 1, 1000,
                               help="launches (all settings when fewer exist)")
            timeout = int_field("Launch timeout (s)", f"{P}ep_launch_timeout", 300, errors, 1, 86400,
                                help="seconds to wait for the server's /health per launch")
    st.markdown("**Load**")
    knobs = endpoint_knobs()
    settings: dict = {}
    for row in range(0, len(knobs), COLUMNS):
        for col, knob in zip(st.columns(COLUMNS), knobs[row:row + COLUMNS]):
            with col:
                settings[knob.name] = knob_field(knob, f"{P}{knob.name}", errors,
                                                 default=FORM_DEFAULTS.get(knob.name))
    if not errors:
        try:
            check_serve(settings)
        except SettingError as e:
            errors.add(f"{P}{e.knob}", str(e))
    return {"settings": settings, "url": url.strip(), "model": model.strip(), "template": template.strip(),
            "search": search_lines(search), "study": (study or "").strip(), "trials": trials, "timeout": timeout,
            "prompts": None if prompts == BUILTIN_PROMPTS else prompts}


def _load_flags(settings: dict) -> list[str]:
    knobs = {k.name: k for k in endpoint_knobs()}
    argv = []
    for name, value in settings.items():
        if value is None:
            continue
        argv += [f"--{name.replace('_', '-')}", knobs[name].format(value)]
    return argv


def endpoint_argv(form: dict) -> list[str]:
    """The command line of a (validated) endpoint form: serve-bench --endpoint, or studies.serving --launch when a
    template is given."""
    model = ["--model", form["model"]] if form["model"] else []
    preset = ["--preset", form["prompts"]] if form["prompts"] else []
    if not form["template"]:
        return [PYTHON, "-m", "workbench", "serve-bench", "--endpoint", form["url"], *model, *preset,
                *_load_flags(form["settings"]), "--json", "--store", str(store_root())]
    storage = study_storage_url()
    argv = [PYTHON, "-m", "studies.serving", "--study", form["study"], "--launch", form["template"]]
    for line in form["search"]:
        argv += ["--search", line]
    return argv + ["--trials", str(form["trials"]), "--launch-timeout", str(form["timeout"]), *model, *preset,
                   "--storage", storage if "://" in storage else f"journal://{storage}", "--store", str(store_root()),
                   "--launch-logs", str(jobs.jobs_root() / "launch_logs"), *_load_flags(form["settings"])]


def start_endpoint_job(form: dict) -> jobs.Job:
    s = form["settings"]
    host = urlsplit(form["url"]).netloc
    if form["template"]:
        title = f"launch study {form['study']} · {form['trials']} trials · rate={s['rate']:g}"
    else:
        title = f"serve endpoint {host} rate={s['rate']:g}"
    params = {**s, "endpoint": form["url"], "served_model": form["model"] or None,
              "launch_template": form["template"] or None, "search": form["search"]}
    return jobs.start_job("serve", endpoint_argv(form), title, params=params)


def launch_section() -> None:
    runs_exist = bool(st.session_state.get(f"{P}has_runs"))
    with st.expander("Start a serving benchmark", expanded=not runs_exist, icon=":material/play_circle:"):
        source = st.radio("Source", list(SOURCES), key=f"{P}source", format_func=SOURCES.get, horizontal=True,
                          help="the in-process engine, or a running (or launched) OpenAI-compatible server")
        errors = Errors()
        if source == "endpoint":
            form = endpoint_form(errors)
            if errors:
                st.warning(f"Fix the {len(errors)} problem(s) above to start a run.", icon=":material/warning:")
            label = "Start launch study" if form["template"] else "Start serve-bench"
            if st.button(label, key=f"{P}ep_start", type="primary", disabled=bool(errors),
                         icon=":material/play_arrow:"):
                st.session_state[f"{P}pending_job"] = start_endpoint_job(form).id
                st.rerun()
            job_section()
            return
        form = form_section(errors)
        if errors:
            st.warning(f"Fix the {len(errors)} problem(s) above to start a run.", icon=":material/warning:")
        if st.button("Start serve-bench", key=f"{P}start", type="primary", disabled=bool(errors),
                     icon=":material/play_arrow:"):
            s = form["settings"]
            argv = serve_argv(s, form["preset"], form["device"])
            title = f"serve {sv.method_label(s)}" if s["method"] != "ar" else "serve ar"
            title += f" rate={s['rate']:g}"
            title += f" · {form['preset']}"
            job = jobs.start_job("serve", argv, title, params={**s, "preset": form["preset"],
                                                                "device": form["device"]})
            st.session_state[f"{P}pending_job"] = job.id
            st.rerun()
        job_section()


def job_section() -> None:
    serve_jobs = jobs.list_jobs(kind="serve")
    if not serve_jobs:
        return
    ids = [j.id for j in serve_jobs]
    pending = st.session_state.pop(f"{P}pending_job", None)
    if pending in ids:
        st.session_state[f"{P}job_pick"] = pending
    by_id = {j.id: j for j in serve_jobs}
    job_id = st.selectbox("Serving job", ids, key=f"{P}job_pick", format_func=lambda i: job_label(by_id[i]))
    job = by_id[job_id]
    running = job.status() == jobs.RUNNING

    @st.fragment(run_every=1.0 if running else None)
    def watch() -> None:
        status = job_panel(job, P)
        if running and status != jobs.RUNNING:
            st.rerun()  # the whole page: the new run joins the charts

    watch()
    if job.status() == jobs.DONE:
        rec = job.result()
        if isinstance(rec, dict):
            cols = st.columns(len(HEADLINE))
            for col, (key, label, fmt) in zip(cols, HEADLINE):
                v = rec.get(key)
                col.metric(label, "—" if v is None else fmt.format(float(v)))
            st.caption(sv.engine_label(rec) if sv.is_external(rec) else sv.fidelity_note(rec))


# ---- the runs ----------------------------------------------------------------------------------------------------

def _chart(fig, missing: str, key: str) -> None:
    if fig is None:
        st.info(missing)
    else:
        st.plotly_chart(fig, width="stretch", key=f"{P}chart_{key}")


def filter_runs(runs: pd.DataFrame) -> pd.DataFrame:
    present = [(n, label) for n, label in (("study", "Study"), ("method", "Method"), ("preset", "Preset"),
                                            ("device", "Device"), ("setting", "Setting"), ("arrival", "Arrivals"))
               if n in runs and runs[n].notna().any()]
    cols = st.columns(max(1, len(present)))
    for col, (name, label) in zip(cols, present):
        column = runs[name].astype("object").where(runs[name].notna(), "adhoc") if name == "study" else runs[name]
        with col:
            chosen = st.multiselect(label, sorted(column.dropna().unique().tolist(), key=str),
                                    key=f"{P}filter_{name}", placeholder="all")
        if chosen:
            runs = runs[column.isin(chosen)]
    return runs


def rate_section(view: pd.DataFrame) -> None:
    st.subheader("Goodput and tail latency against request rate")
    st.caption("One line per setting: off (no speculation), fixed k, adaptive (draft length by batch size, "
               "switch-off by acceptance, context limit), external (a server: engine version @ host:port, a launch "
               "trial's settings); the median of the runs at each rate, grey dots the single "
               "runs. Goodput = requests meeting the run's SLOs (TTFT, TPOT) per second; with no SLO set it equals "
               "the request throughput. Failed runs are left out.")
    cols = st.columns(2)
    with cols[0]:
        _chart(sv.rate_chart(view, "goodput", "Goodput vs request rate", "goodput (requests/s)"),
               "no serving run with a goodput", "goodput")
    with cols[1]:
        _chart(sv.rate_chart(view, "tpot_ms_p99", "p99 TPOT vs request rate", "p99 time per output token (ms)"),
               "no serving run with a p99 TPOT", "tpot")


def runs_section(view: pd.DataFrame) -> pd.DataFrame:
    """The picked runs (default: the newest few) for the per-run views."""
    labels = {r["run_id"]: sv.run_label(r) for _, r in view.iterrows()}
    default = [r for r in st.session_state.get(f"{P}runs", []) if r in labels] or list(labels)[:4]
    st.session_state[f"{P}runs"] = default
    picked = st.multiselect("Runs for the views below", list(labels), key=f"{P}runs", format_func=labels.get,
                            max_selections=MAX_RUNS, placeholder="pick serving runs")
    return view[view["run_id"].isin(picked)]


def latency_section(runs: pd.DataFrame) -> None:
    st.subheader("Latency percentiles")
    st.caption("TTFT = first token - arrival (queue included); TPOT = (last - first token) / (output tokens - 1); "
               "ITL = gaps between emissions (a speculative step emits several tokens at once); E2EL = done - "
               "arrival. Over the measured requests (warm-up ones left out), in ms. An external server's own means "
               "(\"at the server\", from its /metrics) leave out what happens before its clock starts: for "
               "`workbench serve`, the HTTP path.")
    table = sv.percentile_table(runs)
    if table.empty:
        st.info("no latency percentiles in the picked runs")
        return
    fmt = {s: st.column_config.NumberColumn(s, format="%.2f") for s in sv.STATS}
    st.dataframe(table, hide_index=True, width="stretch", key=f"{P}latency_table", column_config=fmt,
                 height=min(600, 38 + 35 * len(table)))


def acceptance_section(runs: pd.DataFrame) -> None:
    st.subheader("Acceptance under load")
    st.caption("Accepted / drafted draft tokens of the steps at each live batch size, and of the rows whose context "
               "falls in each 64-token bin (bin start on the axis). Off runs draft nothing and have no line.")
    cols = st.columns(2)
    with cols[0]:
        _chart(sv.acceptance_chart(runs, "acceptance_by_batch_size", "batch_size", "Acceptance by batch size",
                                   "live batch size"), "no acceptance by batch size in the picked runs", "acc_bs")
    with cols[1]:
        _chart(sv.acceptance_chart(runs, "acceptance_by_context", "context", "Acceptance by context length",
                                   "context length (bin start, tokens)"),
               "no acceptance by context length in the picked runs", "acc_ctx")


def requests_section(runs: pd.DataFrame) -> None:
    st.subheader("Per-request latency")
    metric = st.radio("Latency", list(sv.REQUEST_METRICS), key=f"{P}req_metric", horizontal=True,
                      format_func=sv.REQUEST_METRICS.get)
    try:
        requests = get_store().load_requests(runs["run_id"].tolist()) if len(runs) else None
    except Exception as exc:  # noqa: BLE001
        st.warning(f"cannot read the per-request rows: {exc}")
        return
    labels = {r["run_id"]: sv.run_label(r) for _, r in runs.iterrows()}
    _chart(sv.latency_distribution(requests, labels, metric), "no per-request rows stored for the picked runs",
           "requests")


def export_section(view: pd.DataFrame) -> None:
    st.subheader("Engine snippets")
    st.caption("The run's draft length by batch size (its k_by_batch ranges, k where they leave a size out, 0 for "
               "off; an EAGLE tree's depth where it is on) up to its max_num_seqs, in each engine's terms: vLLM "
               "num_speculative_tokens_per_batch_size, TensorRT-LLM draft_len_schedule or max_concurrency, SGLang's "
               "adaptive JSON for EAGLE chains (one setting per server otherwise). Each snippet passed the engine's "
               "mirrored validators at the commit it names, or says by name why that engine cannot take it.")
    ok = view[view["status"].eq("ok").fillna(False)] if "status" in view else view
    ok = ok[[not sv.is_external(r) for _, r in ok.iterrows()]] if len(ok) else ok  # a server's schedule is its own
    if ok.empty:
        st.info("no finished serving run to export")
        return
    labels = {r["run_id"]: sv.run_label(r) for _, r in ok.iterrows()}
    rid = st.selectbox("Run", list(labels), key=f"{P}export_run", format_func=labels.get)
    row = ok[ok["run_id"] == rid].iloc[0]
    snippets = sv.snippets_for(row)
    st.caption("schedule: " + ", ".join(f"{lo}-{hi}: k={k}" for lo, hi, k in sv.schedule_of(row)))
    tabs = st.tabs(["vLLM", "TensorRT-LLM", "SGLang"])
    for tab, name in zip(tabs, ("vllm", "trtllm", "sglang")):
        with tab:
            obj = json.loads(snippets[name])
            if obj.get("refused"):
                st.warning(obj["refused"])
            else:
                st.caption(f"checked against {obj['checked_against']}")
            st.code(snippets[name], language="json")
    bundle = json.dumps({"run_id": rid, **{n: json.loads(t) for n, t in snippets.items()}}, indent=2)
    st.download_button("Download snippets (JSON)", bundle, file_name=f"serving_snippets_{rid[-6:]}.json",
                       mime="application/json", key=f"{P}download_snippets", icon=":material/download:",
                       on_click="ignore")


def calibration_section(view: pd.DataFrame) -> None:
    st.subheader("Measured schedule")
    st.caption("Runs with `--calibration loop|step` measured their draft length per batch size before serving: the "
               "table behind the schedule they served (loop: output tokens/s of a short closed-loop serve at "
               "concurrency = batch size; step: tokens per ms of isolated decode steps). Each cell is one short "
               "run: differences of 10-20 % can be noise. For loop tables, the schedule each "
               "shape makes of the same cells (`calibration_shape`).")
    tables = {r["run_id"]: (r, table) for _, r in view.iterrows() if (table := sv.calibration_frame(r)) is not None}
    if not tables:
        st.info("no run with a calibration table (serve-bench --calibration loop or step)")
        return
    rid = st.selectbox("Run", list(tables), key=f"{P}calibration_run",
                       format_func=lambda r: sv.run_label(tables[r][0]))
    row, (frame, kind) = tables[rid]
    st.plotly_chart(sv.calibration_chart(frame, kind), width="stretch", key=f"{P}chart_calibration")
    served = row.get("k_by_batch") or "-"
    shape = row.get("calibration_shape")
    shape = shape if isinstance(shape, str) and shape else "free (a run from before calibration_shape)"
    uniform = " made uniform: one k for every batch size, a draft model keeps full overlap only so" \
        if kind == "loop" and sv.calibration_uniform(row) else ""
    lines = [f"served: `{served}`" + (f" ({shape}{uniform})" if kind == "loop" else " (step calibration)")]
    if kind == "loop":
        lines += [f"{name}: `{text}`" for name, text in sv.schedule_shapes(row, frame).items()]
    st.markdown("  \n".join(lines))


def render() -> None:
    st.title("Serving")
    st.caption(f"In-flight batching under a request load (`python -m workbench serve-bench`), ours or an "
               f"OpenAI-compatible server's (`--endpoint URL`, or relaunched per trial by `python -m studies.serving "
               f"--launch`). Store: "
               f"`{store_root()}`")
    try:
        df = get_store().load()
    except Exception as exc:  # noqa: BLE001
        st.error(f"cannot read the result store {store_root()}: {exc}")
        return
    runs = sv.serve_runs(df)
    st.session_state[f"{P}has_runs"] = not runs.empty
    launch_section()
    if runs.empty:
        st.info("No serving runs in the store yet: start one above or with `python -m workbench serve-bench`.")
        return
    runs = sv.with_setting(runs)
    view = filter_runs(runs)
    st.caption(f"{len(view)} of {len(runs)} serving runs")
    rate_section(view)
    picked = runs_section(view)
    latency_section(picked)
    acceptance_section(picked)
    requests_section(picked)
    calibration_section(view)
    export_section(view)


if __name__ == "__main__":
    render()
