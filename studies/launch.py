"""The launch study: tune a real server (vLLM, SGLang, TensorRT-LLM, `workbench serve`) by relaunching it per trial
with the trial's settings filled into a command template, then measuring it through its OpenAI-compatible API
(`serve-bench --endpoint`) on the same load every trial.

    python -m studies.serving --study vllm-k --rate 4 --num-requests 64 --max-new-tokens 128 \\
        --launch "vllm serve /models/llama --port {port} --speculative-config \\
                  '{{\\"method\\": \\"ngram\\", \\"num_speculative_tokens\\": {k}}}'" \\
        --search k=1,2,3,4,5,6 --trials 6

Each trial: a free port, the filled command started in its own process group (workbench/serving/launcher.py), /health
polled until it answers (--launch-timeout), the load sent, the server stopped (SIGTERM to its group, SIGKILL after a
grace period). A launch that fails (exits, never healthy, refused by the endpoint bench) is a FAILED trial carrying the
error and its log's tail; every launch keeps its log in --launch-logs. Objectives as the serving study's: goodput
(maximize) and p99 TPOT (minimize). With no more distinct settings than trials, every one is run (grid); else TPE
picks. After the study every server started is checked gone by its PID.
"""
from __future__ import annotations

import itertools
import shlex
from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from workbench.serving.launcher import LaunchError, LaunchTemplate, ServerProcess, alive, free_port

OBJECTIVES = ("goodput", "tpot_ms_p99")
DIRECTIONS = ("maximize", "minimize")
STUDY_KEY = "launch_study"


class LaunchStudyError(ValueError):
    """A launch-study setting that cannot work; the message names it and what to do."""


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_search(items: list[str], template: LaunchTemplate) -> dict[str, list]:
    """["k=1,2,4", "mode=a,b"] -> {"k": [1, 2, 4], "mode": ["a", "b"]}; every template field searched or fixed.

    >>> parse_search(["k=1,2", "w=4"], LaunchTemplate("serve --k {k} --w {w}"))
    {'k': [1, 2], 'w': [4]}
    """
    space: dict[str, list] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        vals = [_value(v.strip()) for v in values.split(",") if v.strip()]
        if not sep or not name or not vals:
            raise LaunchStudyError(f"--search {item!r}: write NAME=V1,V2,... (e.g. k=1,2,3,4)")
        if name in space:
            raise LaunchStudyError(f"--search names {name} twice: give its values once")
        if len(set(map(repr, vals))) != len(vals):
            raise LaunchStudyError(f"--search {item!r} repeats a value")
        space[name] = vals
    unknown = [n for n in space if n not in template.fields]
    if unknown:
        raise LaunchStudyError(f"--search {unknown[0]} is not a placeholder of --launch (its placeholders: "
                               f"{', '.join(template.fields) or 'none'}): add {{{unknown[0]}}} to the template")
    missing = [f for f in template.fields if f not in space]
    if missing:
        raise LaunchStudyError(f"--launch has {{{missing[0]}}} but no --search {missing[0]}=...: give its values "
                               "(one value fixes it)")
    return space


def grid_size(space: dict[str, list]) -> int:
    n = 1
    for vals in space.values():
        n *= len(vals)
    return n


def run_launch_study(template: LaunchTemplate, space: dict[str, list], cfg, prompts: list[str], *, study_name: str,
                     storage, trials: int, log_dir: Path, model: str | None = None, host: str = "127.0.0.1",
                     launch_timeout: float = 300.0, stop_grace: float = 10.0, store=None, seed: int = 0,
                     prompts_source: str | None = None, on_trial=None) -> tuple[optuna.Study, list[int]]:
    """Run `trials` launches (each: start, wait healthy, endpoint bench, stop); (the study, every started server's
    PID). `cfg` is the ServeConfig of the load (rate, arrivals, lengths, SLOs). RuntimeError if a server outlives
    the study."""
    from workbench.serving.config import ServeError
    from workbench.serving.endpoint import endpoint_bench

    if trials < 1:
        raise LaunchStudyError(f"--trials must be >= 1, got {trials}")
    dists = {name: CategoricalDistribution(vals) for name, vals in space.items()}
    grid = grid_size(space) <= trials
    study = optuna.create_study(study_name=study_name, storage=storage, directions=list(DIRECTIONS),
                                sampler=optuna.samplers.TPESampler(seed=seed, multivariate=True), load_if_exists=True)
    key = {"template": template.template, "rate": cfg.rate, "num_requests": cfg.num_requests,
           "max_new_tokens": cfg.max_new_tokens, "arrival": cfg.arrival}
    old = study.user_attrs.get(STUDY_KEY)
    if old is not None and old != key:
        raise LaunchStudyError(f"study {study_name!r} was run with other launch settings ({old}); give a new --study")
    study.set_user_attr(STUDY_KEY, key)
    runs = trials
    if grid:  # every setting once, those the study has not run yet (a resumed study goes on where it stopped)
        ran = {tuple(sorted(t.params.items())) for t in study.get_trials(deepcopy=False)}
        todo = [dict(zip(space, c)) for c in itertools.product(*space.values())]
        todo = [p for p in todo if tuple(sorted(p.items())) not in ran]
        for params in todo:
            study.enqueue_trial(params)
        runs = len(todo)
    log_dir = Path(log_dir)
    pids: list[int] = []
    for _ in range(runs):
        trial = study.ask(dists)
        params = dict(trial.params)
        port = free_port(host)
        log = log_dir / f"{study_name}_trial{trial.number:03d}.log"
        trial.set_user_attr("launch_log", str(log))
        try:
            argv = template.argv(params, port)
            trial.set_user_attr("launch_command", shlex.join(argv))
            server = ServerProcess.start(argv, log)
            pids.append(server.pid)
            try:
                trial.set_user_attr("launch_s", server.wait_healthy(f"http://{host}:{port}/health", launch_timeout))
                out = endpoint_bench(f"http://{host}:{port}", cfg, prompts, model=model, study=study_name,
                                     prompts_source=prompts_source)
            finally:
                server.stop(stop_grace)
        except (LaunchError, ServeError) as e:
            trial.set_user_attr("error", str(e).splitlines()[0])
            trial.set_user_attr("log_tail", getattr(e, "log_tail", ""))
            study.tell(trial, state=TrialState.FAIL)
            if on_trial:
                on_trial(trial.number, params, None, str(e).splitlines()[0])
            continue
        rec = {**out.record, "trial_id": trial.number, "launch_command": shlex.join(argv),
               "launch_params": ",".join(f"{k}={v}" for k, v in params.items())}
        if store is not None:
            store.append(rec, requests=out.requests)
        trial.set_user_attr("run_id", rec["run_id"])
        values = [rec.get(o) for o in OBJECTIVES]
        if rec["status"] != "ok" or any(v is None for v in values):
            trial.set_user_attr("error", rec.get("error") or "no completed request: no goodput / TPOT to score")
            study.tell(trial, state=TrialState.FAIL)
        else:
            for col in ("output_throughput", "request_throughput", "ttft_ms_p99", "acceptance_rate",
                        "mean_accepted_tokens"):
                trial.set_user_attr(col, rec.get(col))
            study.tell(trial, values)
        if on_trial:
            on_trial(trial.number, params, rec, rec.get("error"))
    survivors = [p for p in pids if alive(p)]
    if survivors:
        raise RuntimeError(f"servers still running after the study: pids {survivors}")
    return study, pids


def report(study: optuna.Study, pids: list[int]) -> str:
    """Trials by goodput (failed ones last, with their error), and the PID check."""
    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    failed = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.FAIL]
    lines = [f"{'trial':>5}  {'params':<28} {'goodput':>9} {'tpot p99 ms':>11} {'out tok/s':>10} {'accept':>7}"]
    for t in sorted(done, key=lambda t: -t.values[0]):
        p = ",".join(f"{k}={v}" for k, v in t.params.items())
        acc = t.user_attrs.get("acceptance_rate")
        lines.append(f"{t.number:>5}  {p:<28} {t.values[0]:>9.3f} {t.values[1]:>11.2f} "
                     f"{t.user_attrs.get('output_throughput') or 0:>10.1f} {'-' if acc is None else f'{acc:.3f}':>7}")
    for t in failed:
        p = ",".join(f"{k}={v}" for k, v in t.params.items())
        lines.append(f"{t.number:>5}  {p:<28} failed: {t.user_attrs.get('error')}")
    lines.append(f"servers started: {len(pids)}; still running: {sum(alive(p) for p in pids)}")
    return "\n".join(lines)
