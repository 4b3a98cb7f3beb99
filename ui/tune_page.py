"""Tune page: launch Optuna studies as background workers, watch trials arrive, read the best settings.

A study is `python -m studies.run --study NAME --script SCRIPT --trials N --storage journal:///... ` started as a job;
several can run at once (the journal storage is safe for several processes). The page reads the study back from the
same storage for the live trial table, Optuna's Plotly figures, the best settings and the batch-size schedule.
The launch form has one field per searchable knob and per run setting of workbench.settings: the basic ones
(workbench.settings.BASIC_KNOBS) first, the rest under "Advanced", the GPU-only ones only where a GPU is visible.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pandas as pd
import streamlit as st

from ui import catalog, charts, gpu_page, heads, jobs
from ui.common import (GPU_ONLY_CHOICES, PYTHON, REPO_ROOT, Errors, check_model_path, int_field, job_panel, knob_field,
                       store_root, study_storage_url)
from workbench.settings import BASIC_KNOBS, GPU_ONLY_KNOBS, KNOBS, METHODS

P = "tune_"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def storage_url() -> str:
    url = study_storage_url()
    return url if "://" in url else f"journal://{url}"


def open_storage():
    from studies.storage import open_storage as _open

    return _open(storage_url())


def cli_storage_url() -> str | None:
    """The storage `python -m studies.run` uses when given no --storage (studies.storage.DEFAULT_STORAGE, a SQLite
    file relative to the repo root), or `$WORKBENCH_CLI_STUDY_STORAGE`; None when that file does not exist or it is
    the dashboard's own storage. The Tune page lists its studies read-only beside the dashboard's."""
    import os

    from studies.storage import DEFAULT_STORAGE

    url = os.environ.get("WORKBENCH_CLI_STUDY_STORAGE") or DEFAULT_STORAGE
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        path = path if path.is_absolute() else REPO_ROOT / path
        if not path.is_file():
            return None
        url = f"sqlite:///{path}"
    return None if url == storage_url() else url


@st.cache_resource(show_spinner=False)
def _open_cli_storage(url: str):
    from studies.storage import open_storage as _open

    return _open(url)


def local_models_section(errors: Errors) -> dict:
    """Target (+ draft) paths and the prompt file a study over local models needs; errors under each input."""
    out: dict = {}
    target = st.text_input("Target model", key=f"{P}target_path", placeholder="HF folder or .gguf file")
    path, err = check_model_path(target, "target")
    errors.add(f"{P}target_path", err)
    if path:
        out["model"] = path
    draft = st.text_input("Draft model (for method draft)", key=f"{P}draft_path", placeholder="HF folder")
    if draft.strip():
        dpath, derr = check_model_path(draft, "draft")
        errors.add(f"{P}draft_path", derr)
        if dpath:
            out["draft"] = dpath
    prompts = st.text_input("Prompt file", key=f"{P}prompt_path",
                            placeholder="prompts.jsonl or MT-bench / Spec-Bench question.jsonl")
    loaded, perr = catalog.load_prompt_file(prompts)
    errors.add(f"{P}prompt_path", perr)
    if loaded:
        out["prompts"] = catalog.prompt_path(prompts)
    return out


def head_field(errors: Errors, methods: list[str], script_name: str):
    """An optional draft-head folder for the study's eagle / eagle3 trials (`--draft-head`), checked like the Run
    page's; a head of one layout with the other EAGLE method in the space is refused (those trials could only fail)."""
    text = st.text_input("Draft head folder (optional; eagle / eagle3 trials)", key=f"{P}head_path_{script_name}",
                         placeholder="empty: the head trained beside the target",
                         help="a published EAGLE-1/2 (method eagle) or EAGLE-3 (method eagle3) checkpoint folder, "
                              "passed as --draft-head; stored with the study")
    if not text.strip():
        return None
    path, err = heads.check_head_path(text, None)
    if path is not None:
        layout = heads.layout_of(heads.read_json(path / "config.json") or {})
        other = {"eagle": "eagle3", "eagle3": "eagle"}.get(layout)
        if layout in heads.PATH_METHODS and layout not in methods:
            err = f"{path} is a method-{layout} head: add {layout} to Methods"
        elif other in methods:
            err = f"{path} is a method-{layout} head: drop {other} from Methods (its trials would refuse the head)"
    errors.add(f"{P}head_path", err)
    return path if err is None else None


def dim_text(name: str, dim) -> str:
    """A search-space dimension as the CLI writes it: 4, 1-8, 1,2,4, off,on."""
    from studies.space import IntRange

    if isinstance(dim, IntRange):
        return f"{dim.low}-{dim.high}"
    return ",".join(KNOBS[name].format(v) for v in (dim if isinstance(dim, tuple) else (dim,)))


def dim_field(name: str, dim, key: str, errors: Errors, allowed: tuple | None = None) -> str | None:
    """A search-space dimension of a study: a multiselect of the choices for a knob that has them (one = fixed,
    several = searched; `allowed`: a subset of the knob's), else a text input (a value, a list a,b,c, or a range
    lo-hi); each value checked against the knob (workbench.settings), the error under the field. Returns the
    dimension as the CLI writes it, or None."""
    from studies.space import SpaceError, check_value, dim_values, parse_dim

    knob = KNOBS[name]
    if knob.allowed is not None:
        options = tuple(allowed or knob.allowed)
        picked = st.multiselect(knob.label, options, default=[v for v in dim_values(name, dim) if v in options],
                                key=key, help=knob.help, format_func=knob.format)
        if not picked:
            errors.add(key, f"{name}: pick at least one value")
            return None
        return dim_text(name, tuple(picked))
    grammar = "a value, a list a,b,c" + (", or a range lo-hi" if knob.kind == "int" else "")
    text = st.text_input(knob.label, value=dim_text(name, dim), key=key, help=f"{knob.help}. {grammar}")
    try:
        for value in dim_values(name, parse_dim(name, text)):
            check_value(name, value)
    except SpaceError as exc:
        errors.add(key, str(exc))
        return None
    return text.strip()


def stored_spec(storage, name: str) -> dict | None:
    from studies.study import SPEC_KEY

    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None
    return storage.get_study_user_attrs(study_id).get(SPEC_KEY, {})


def spec_problems(cli_args: list[str], storage, name: str) -> tuple[list[str], dict | None]:
    """What differs between an existing study `name` and the spec these studies.run flags would give it.

    Uses studies.run's own parser and spec builder, so the check is the one the worker applies when it starts.
    """
    from studies.run import build_parser, build_spec
    from studies.study import StudySpec

    stored = stored_spec(storage, name)
    if stored is None:
        return [], None
    if not stored:
        return [f"study {name!r} exists but was not created by studies.run: pick another name"], {}
    args = build_parser().parse_args(cli_args)
    base = StudySpec.from_dict(stored)  # knobs the study predates read back as the defaults its trials ran
    return _diff(base.to_dict(), build_spec(args, base).to_dict()), stored


def _diff(stored, given, path: str = "") -> list[str]:
    if isinstance(stored, dict) and isinstance(given, dict):
        out: list[str] = []
        for key in sorted(set(stored) | set(given)):
            out += _diff(stored.get(key), given.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if stored == given else [f"{path}: the study has {json.dumps(stored)}, this form asks for "
                                       f"{json.dumps(given)}"]


def free_name(script_name: str) -> str:
    """`<script>-<n>` with the smallest n that no study in the storage uses yet."""
    import optuna

    try:
        taken = set(optuna.get_all_study_names(open_storage()))
    except Exception:  # noqa: BLE001 - the storage problem is reported below the form
        taken = set()
    n = 1
    while f"{script_name}-{n}" in taken:
        n += 1
    return f"{script_name}-{n}"


# ---- launch form --------------------------------------------------------------------------------------------------

def _name_follows_script(script_names: list[str]) -> None:
    """A new script gets a fresh default name, unless the user typed a name of their own."""
    name = str(st.session_state.get(f"{P}study_name", "")).strip()
    default = re.fullmatch(r"(" + "|".join(re.escape(n) for n in script_names) + r")-\d+", name)
    if not name or default:
        st.session_state[f"{P}study_name"] = free_name(st.session_state[f"{P}script"])


def launch_form() -> None:
    from studies.scripts import SCRIPTS
    from studies.space import SEARCH_KNOBS, SETTING_KNOBS, SpaceError

    errors = Errors()
    with st.container(border=True):
        cols = st.columns([1, 2])
        with cols[0]:
            names = list(SCRIPTS)
            script_name = st.selectbox("Study script", names, index=names.index("pareto") if "pareto" in names else 0,
                                       key=f"{P}script", on_change=_name_follows_script, args=(names,))
        script = SCRIPTS[script_name]
        with cols[1]:
            st.markdown(f"**{script.question}**  \nobjective: " + ", ".join(
                f"{d} {m}" for m, d in zip(script.objective.metrics, script.objective.directions)))
        cols = st.columns(3)
        with cols[0]:
            name = st.text_input("Study name", value=free_name(script_name), key=f"{P}study_name",
                                 help="a new name creates a study; an existing one resumes it (same settings only)")
            name_box = st.container()
        with cols[1]:
            trials = int_field("Trials (total budget)", f"{P}trials", 10, errors, 1, 1000, name="trials")
        with cols[2]:
            try:
                presets = catalog.preset_names()
            except Exception as exc:  # noqa: BLE001
                presets = []
                errors.add(f"{P}preset", f"cannot list zoo presets: {exc}")
            source = st.radio("Models", ("Zoo preset", "Local model paths"), key=f"{P}model_source",
                              horizontal=True)
            preset, local = None, {}
            if source == "Zoo preset":
                preset = st.selectbox("Models (zoo preset)", presets, key=f"{P}preset")
                if preset:
                    errors.add(f"{P}preset", catalog.resolve(preset)[1])
            else:
                local = local_models_section(errors)
        space = script.space
        gpu = gpu_page.gpu_state()
        shown = [k for k in (*SEARCH_KNOBS, *SETTING_KNOBS) if gpu["cuda_available"] or k not in GPU_ONLY_KNOBS]
        basic = [k for k in shown if k in BASIC_KNOBS]
        dims, run_settings = {}, {}

        def fields(knobs: list[str]) -> None:
            searched = [k for k in knobs if k in SEARCH_KNOBS]
            for row in range(0, len(searched), 4):
                for col, knob in zip(st.columns(4), searched[row:row + 4]):
                    with col:
                        allowed = None if gpu["cuda_available"] else tuple(
                            v for v in KNOBS[knob].allowed or () if v not in GPU_ONLY_CHOICES.get(knob, ()))
                        dims[knob] = dim_field(knob, getattr(space, knob), f"{P}{knob}_{script_name}", errors,
                                               allowed or None)
            fixed = [k for k in knobs if k in SETTING_KNOBS]
            if fixed:
                st.markdown("**Run settings, the same for every trial**")
            for row in range(0, len(fixed), 4):
                for col, knob in zip(st.columns(4), fixed[row:row + 4]):
                    with col:
                        run_settings[knob] = knob_field(KNOBS[knob], f"{P}{knob}", errors)

        with st.expander("Search space and run settings (defaults: the script's)"):
            methods = st.multiselect("Methods", list(METHODS), default=list(space.methods),
                                     key=f"{P}methods_{script_name}", help=KNOBS["method"].help)
            if not methods:
                errors.add(f"{P}methods", "pick at least one method")
            draft_head = head_field(errors, methods, script_name)
            fields(basic)
        with st.expander("Advanced"):
            fields([k for k in shown if k not in BASIC_KNOBS])
            if not gpu["cuda_available"]:
                st.caption("No GPU visible: the GPU-only settings (CUDA graphs, torch.compile, PDL, GEMV fusions, "
                           "...; fp8 weights) are hidden and keep the script's values.")
            cols = st.columns(4)
            with cols[0]:
                workers = int_field("Worker processes", f"{P}workers", 1, errors, 1, 16, name="workers",
                                    help="processes sharing this study's trials (journal storage allows several)")
            with cols[1]:
                device = st.text_input("Device", value="cpu", key=f"{P}device", help="cpu, cuda, cuda:0, ...")
                if device.strip().startswith("cuda"):
                    if not gpu["cuda_available"]:
                        errors.add(f"{P}device", f"no CUDA GPU here ({gpu.get('reason') or 'no CUDA'})")
                elif device.strip() != "cpu":
                    errors.add(f"{P}device", f"device must be cpu, cuda or cuda:N, got {device.strip()!r}")
        st.caption(f"Optuna storage: `{storage_url()}` · result store: `{store_root()}`")

        cli = ["--study", name.strip(), "--script", script_name, "--trials", str(trials or 1),
               "--storage", storage_url(), "--store", str(store_root()), "--device", device.strip() or "cpu"]
        if preset:
            cli += ["--preset", preset]
        for flag, value in local.items():
            cli += [f"--{flag}", str(value)]
        if methods:
            cli += ["--methods", ",".join(methods)]
        if draft_head is not None:
            cli += ["--draft-head", str(draft_head)]
        cli += [item for knob, text in dims.items() if text is not None for item in (KNOBS[knob].flag, text)]
        cli += [item for knob, value in run_settings.items() if value is not None
                for item in (KNOBS[knob].flag, KNOBS[knob].format(value))]
        if not errors:  # rules between knobs (batch vs the largest CUDA-graph bucket, ...), as the study applies them
            try:
                from studies.run import build_parser, build_spec

                build_spec(build_parser().parse_args(cli), None).validate()
            except SpaceError as exc:
                errors.add(f"{P}space", str(exc))
        with name_box:
            if not NAME_RE.fullmatch(name.strip()):
                errors.add(f"{P}study_name", "study name: 1-64 letters, digits, '_', '.', '-' (starting with a "
                                             "letter or digit)")
            elif not errors:
                try:
                    problems, stored = spec_problems(cli, open_storage(), name.strip())
                except Exception as exc:  # noqa: BLE001 - a broken storage is an error here, not a crash
                    problems, stored = [f"cannot check the study in {storage_url()}: {exc}"], None
                if problems:
                    errors.add(f"{P}study_name", f"study {name.strip()!r} already exists with another search space "
                                                 f"or objective:\n\n- " + "\n- ".join(problems)
                               + "\n\nPick another name, or the same settings to resume it.")
                elif stored is not None:
                    st.info("this study exists with the same settings: launching resumes it up to the budget")
        if errors:
            st.warning(f"Fix the {len(errors)} problem(s) above to launch.", icon=":material/warning:")
        if st.button("Launch study", key=f"{P}launch", type="primary", disabled=bool(errors),
                     icon=":material/rocket_launch:"):
            export_dir = jobs.jobs_root() / "schedules" / name.strip()
            argv = [PYTHON, "-m", "studies.run", *cli, "--workers", str(workers), "--export-dir", str(export_dir)]
            jobs.start_job("study", argv, f"{name.strip()} ({script_name}, {trials} trials)",
                                 params={"study": name.strip(), "script": script_name, "trials": trials,
                                         "storage": storage_url(), "export_dir": str(export_dir)})
            st.session_state[f"{P}pending_watch"] = name.strip()
            st.rerun()


# ---- watching -----------------------------------------------------------------------------------------------------

def study_progress(storage, name: str) -> tuple[int, int | None]:
    from studies.study import TARGET_KEY, load_study, counted_trials

    study = load_study(storage, name)
    return counted_trials(study)[0], study.user_attrs.get(TARGET_KEY)


def jobs_section(storage) -> None:
    study_jobs = jobs.list_jobs(kind="study")
    if not study_jobs:
        return
    running = [j for j in study_jobs if j.status() == jobs.RUNNING]
    recent = running + [j for j in study_jobs if j not in running][: max(0, 3 - len(running))]
    st.subheader("Study jobs")

    @st.fragment(run_every=2.0 if running else None)
    def watch() -> None:
        for job in recent:
            with st.container(border=True):
                status = job_panel(job, P)
                name = job.params.get("study")
                if status == jobs.RUNNING and name:
                    try:
                        done, target = study_progress(storage, name)
                        st.caption(f"{done} of {target or '?'} trials counted in the storage")
                    except Exception:  # noqa: BLE001 - the study may not exist yet (worker starting)
                        pass
        if running and any(j.status() != jobs.RUNNING for j in running):
            st.rerun()

    watch()


def _figures(study, metrics: list[str]) -> dict:
    """Optuna's Plotly figures; a figure that cannot be drawn yet maps to the reason (str)."""
    import optuna.visualization as vis

    multi = len(study.directions) > 1
    tkw = [{"target": (lambda t, i=i: t.values[i]), "target_name": m} for i, m in enumerate(metrics)] if multi \
        else [{"target_name": metrics[0]}]
    out: dict = {}

    def attempt(label, fn):
        try:
            with warnings.catch_warnings():  # e.g. "few trials in a regime": the figure says enough
                warnings.simplefilter("ignore")
                out[label] = fn()
        except Exception as exc:  # noqa: BLE001 - e.g. too few trials for importances
            out[label] = f"{type(exc).__name__}: {exc}"

    if multi:  # one history per objective, no best line (a Pareto study has no single best)
        for kw in tkw:
            attempt(f"History · {kw['target_name']}", lambda kw=kw: vis.plot_optimization_history(study, **kw))
    else:  # the best-value line runs through the trials the report trusts only
        attempt(f"History · {metrics[0]}", lambda: _history(study, metrics[0]))
    if multi:
        # infeasible trials (greedy output differed from autoregressive) carry an Optuna constraint > 0: the plot
        # greys them out by itself
        attempt("Pareto front", lambda: vis.plot_pareto_front(study, target_names=metrics).update_layout(height=640))
        for j in range(1, len(metrics) if len(metrics) > 2 else 1):  # 2-D projections of the full front
            attempt(f"Pareto · {metrics[0]} vs {metrics[j]}",
                    lambda j=j: vis.plot_pareto_front(study, targets=lambda t: (t.values[0], t.values[j]),
                                                      target_names=[metrics[0], metrics[j]])
                    .update_layout(height=520, title=f"{metrics[0]} vs {metrics[j]}: red = Pareto-optimal "
                                                     f"over all {len(metrics)} objectives"))
    else:
        out["Pareto front"] = "single-objective study: no Pareto front (use the pareto script)"
    attempt("Importances", lambda: vis.plot_param_importances(study, **tkw[0]))
    attempt("Parallel coordinates", lambda: vis.plot_parallel_coordinate(study, **tkw[0]))
    attempt("Slice", lambda: vis.plot_slice(study, **tkw[0]))
    return out


def _history(study, metric: str):
    import optuna

    from studies.objective import reliable_complete, unreliable_reason

    trusted = {t.number for t in reliable_complete(study)}
    points = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        why = None if t.number in trusted else (
            unreliable_reason(t) or f"infeasible: {t.user_attrs.get('infeasible_reason') or 'a constraint > 0'}")
        points.append((t.number, t.value, why))
    fig = charts.optimization_history(points, study.direction.name == "MAXIMIZE", metric)
    if fig is None:
        raise ValueError("no completed trial yet")
    return fig


def best_section(study, spec: dict) -> None:
    from studies.objective import exclusion_notes, pareto_front, reliable_complete

    notes = exclusion_notes(study)
    if notes:  # noisy or implausible runs: measured, but not trusted enough to recommend
        st.caption("Left out of the best settings: " + "; ".join(n.removeprefix("excluded: ") for n in notes))
    ok = reliable_complete(study)
    if not ok:
        st.info("no reliable feasible completed trial yet")
        return
    if len(study.directions) > 1:
        front = pareto_front(study)
        st.markdown(f"**Pareto front**: {len(front)} trial(s), none better on every objective")
        st.dataframe(front, hide_index=True, width="stretch")
        return
    maximize = study.directions[0].name == "MAXIMIZE"
    best = (max if maximize else min)(ok, key=lambda t: t.value)
    cfg = best.user_attrs.get("config") or best.params
    cols = st.columns(4)
    cols[0].metric(study.metric_names[0] if study.metric_names else "value", f"{best.value:,.4g}")
    for col, key, fmt in ((cols[1], "speedup_vs_ar", "{:.2f}x"), (cols[2], "acceptance_rate", "{:.1%}"),
                          (cols[3], "tokens_per_s", "{:,.1f}")):
        v = best.user_attrs.get(key)
        col.metric(key.replace("_", " "), "—" if v is None else fmt.format(v))
    st.markdown(f"**Best settings** (trial {best.number}):")
    st.json({k: v for k, v in cfg.items()}, expanded=True)


def schedule_section(study) -> None:
    from studies.schedule import build_schedule, sglang_snippet, trtllm_snippet, vllm_snippet

    try:
        schedule = build_schedule(study)
    except Exception as exc:  # noqa: BLE001
        st.info(f"no schedule yet: {exc}")
        return
    rows = [{k: e.get(k) for k in ("batch_size", "trials", "speculate", "method", "draft_len", "ngram_min",
                                   "ngram_max", "speedup_vs_ar", "tokens_per_s", "trial")} for e in schedule["buckets"]]
    st.markdown("**Best setting per batch-size bucket** "
                "(bucket b covers batch sizes above the previous bucket, up to b)")
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    if schedule.get("excluded"):
        st.caption("Left out (noisy or implausible runs): "
                   + "; ".join(n.removeprefix("excluded: ") for n in schedule["excluded"]))
    tabs = st.tabs(["vLLM", "SGLang", "TensorRT-LLM", "schedule.json"])
    for tab, (make, lang) in zip(tabs, ((vllm_snippet, "json"), (sglang_snippet, "json"), (trtllm_snippet, "json"),
                                        (None, "json"))):
        with tab:
            try:
                obj = schedule if make is None else make(schedule)
            except Exception as exc:  # noqa: BLE001
                st.warning(f"cannot build this snippet: {exc}")
                continue
            if isinstance(obj, dict) and obj.get("refused"):
                st.warning(obj["refused"])
            elif isinstance(obj, dict) and obj.get("checked_against"):
                st.caption(f"checked against {obj['checked_against']}")
            if isinstance(obj, dict) and obj.get("cli"):
                st.code(obj["cli"], language="bash")
            st.code(json.dumps(obj, indent=2, default=str), language=lang)
            adaptive = obj.get("adaptive_config") if isinstance(obj, dict) else None
            if isinstance(adaptive, dict) and "refused" not in adaptive:  # the file --speculative-adaptive-config names
                name = obj["server_args"]["speculative_adaptive_config"]
                st.download_button(f"Download {name}", json.dumps(adaptive, indent=2), file_name=name,
                                   mime="application/json", key=f"{P}adaptive_download", on_click="ignore")
    st.download_button("Download schedule.json", json.dumps(schedule, indent=2, default=str),
                       file_name=f"{study.study_name}-schedule.json", mime="application/json",
                       key=f"{P}schedule_download", on_click="ignore")


def study_view(storage, name: str, live: bool, cache_id: str | None = None) -> None:
    from studies.objective import importance_caveat, trials_frame
    from studies.study import SPEC_KEY, TARGET_KEY, counted_trials, load_study

    study = load_study(storage, name)
    spec = study.user_attrs.get(SPEC_KEY, {})
    metrics = study.metric_names or [f"value{i}" for i in range(len(study.directions))]
    done, waiting = counted_trials(study)
    target = study.user_attrs.get(TARGET_KEY)
    df = trials_frame(study)
    states = df["state"].value_counts().to_dict() if len(df) else {}
    st.markdown(f"**{name}** · script `{spec.get('script')}` · {done} of {target or '?'} trials · "
                + ", ".join(f"{n} {s.lower()}" for s, n in states.items())
                + (" · live" if live else ""))
    if target:
        st.progress(min(1.0, done / target))
    n_finished = int(sum(n for s, n in states.items() if s in ("COMPLETE", "FAIL", "PRUNED")))
    cache_key = f"{P}figs_{cache_id or name}"
    cached = st.session_state.get(cache_key)
    if cached is None or cached[0] != n_finished:  # recompute the figures only when a trial finished
        cached = (n_finished, _figures(study, metrics) if n_finished else {})
        st.session_state[cache_key] = cached
    figs = cached[1]
    labels = list(figs) + ["Trials", "Best settings"] + (["Schedule"] if spec.get("script") == "batch_schedule" else [])
    tabs = st.tabs(labels)
    for tab, label in zip(tabs, labels):
        with tab:
            if label == "Trials":
                st.dataframe(df.sort_values("trial", ascending=False) if len(df) else df, hide_index=True,
                             width="stretch")
            elif label == "Best settings":
                best_section(study, spec)
            elif label == "Schedule":
                schedule_section(study)
            elif isinstance(figs[label], str):
                st.info(f"not available yet: {figs[label]}")
            else:
                if label == "Importances" and (caveat := importance_caveat(study)):
                    st.warning(caveat)
                st.plotly_chart(figs[label], width="stretch", key=f"{P}fig_{name}_{label}")
    if not figs:
        st.info("no finished trial yet: figures appear when the first trial completes")


CLI_SUFFIX = " · CLI storage"


def watch_section(storage) -> None:
    import optuna

    st.subheader("Watch a study")
    any_running = bool(jobs.list_jobs(kind="study", status=jobs.RUNNING))

    @st.fragment(run_every=3.0 if any_running else None)
    def body() -> None:
        try:
            names = sorted(optuna.get_all_study_names(storage))
        except Exception as exc:  # noqa: BLE001
            st.error(f"cannot list studies in {storage_url()}: {exc}")
            return
        where = {n: storage for n in names}  # option shown -> (its storage); CLI studies carry a suffix
        cli_url = cli_storage_url()
        if cli_url:
            try:
                cli = _open_cli_storage(cli_url)
                for n in sorted(optuna.get_all_study_names(cli)):
                    where[n + CLI_SUFFIX] = cli
            except Exception as exc:  # noqa: BLE001 - the dashboard's own studies still show
                st.warning(f"cannot list the studies started from the CLI in {cli_url}: {exc}")
        options = list(where)
        pending = st.session_state.get(f"{P}pending_watch")
        if pending in names:  # a study launched from this page: show it as soon as its worker created it
            st.session_state[f"{P}watch"] = st.session_state.pop(f"{P}pending_watch")
        elif pending is not None:
            st.caption(f"waiting for study {pending!r} to appear in the storage ...")
        if not options:
            st.info("No study in the storage yet: launch one above.")
            return
        if st.session_state.get(f"{P}watch") not in options:  # first visit (or a refresh): the latest job's study
            latest = [j.params.get("study") for j in jobs.list_jobs(kind="study") if j.params.get("study") in names]
            st.session_state[f"{P}watch"] = latest[0] if latest else options[0]
        choice = st.selectbox("Study", options, key=f"{P}watch",
                              help=f"studies of this dashboard ({storage_url()})"
                                   + (f" and, marked 'CLI storage', those in {cli_url} (the default storage of "
                                      "`python -m studies.run`)" if cli_url else ""))
        name = choice[:-len(CLI_SUFFIX)] if choice.endswith(CLI_SUFFIX) and where[choice] is not storage else choice
        live = any(j.params.get("study") == name for j in jobs.list_jobs(kind="study", status=jobs.RUNNING)) \
            and where[choice] is storage
        try:
            study_view(where[choice], name, live, cache_id=choice)
        except Exception as exc:  # noqa: BLE001 - a study being created, or one not made by studies.run
            st.warning(f"cannot show study {name!r}: {exc}")

    body()


def render() -> None:
    st.title("Tune")
    st.caption("Search method, draft length and batch size with Optuna; every trial is a benchmark run stored in the "
               "result store. Studies run as background processes: leave the page, come back, they keep going.")
    try:
        launch_form()
        storage = open_storage()
    except Exception as exc:  # noqa: BLE001
        st.error(f"cannot set up studies: {exc}")
        return
    jobs_section(storage)
    watch_section(storage)


if __name__ == "__main__":
    render()
