"""studies/launch.py (`studies.serving --launch`): a real server relaunched per trial from a command template —
`workbench serve` on tiny here — measured through its HTTP API, a failed launch recorded as a failed trial with its
log's tail, and no server left running afterwards (checked by PID)."""
import doctest
import json
import sys

import optuna
import pytest

import studies.launch as launch
from results.store import ResultStore
from studies.launch import LaunchStudyError, parse_search, run_launch_study
from studies.serving import main as serving_main
from workbench.serving.config import ServeConfig
from workbench.serving.launcher import LaunchTemplate, alive, group_pids

SERVE = (f"{sys.executable} -m workbench serve --preset tiny --device cpu --dtype float32 --port {{port}} "
         "--method {method} --k {k} --max-num-seqs 2")


def test_docstrings():
    assert doctest.testmod(launch).failed == 0


@pytest.mark.parametrize("items, message", [
    (["k"], "write NAME=V1,V2"),
    (["k=1,2", "k=3"], "names k twice"),
    (["k=1,1", "method=ngram"], "repeats a value"),
    (["k=1", "method=ngram", "w=2"], "w is not a placeholder of --launch"),
    (["k=1,2"], "--launch has {method} but no --search method"),
])
def test_bad_search_settings_are_named(items, message):
    with pytest.raises(LaunchStudyError, match=message.replace("{", r"\{").replace("}", r"\}")):
        parse_search(items, LaunchTemplate(SERVE))


def test_a_launch_study_of_workbench_serve_ranks_trials_and_leaves_no_server(tmp_path):
    """Four trials (the whole grid): n-gram at k = 1 and 2 served and measured, an unknown method refused by the
    server at launch (failed trials with the server's own error in their log tail); every server stopped, checked by
    PID."""
    template = LaunchTemplate(SERVE)
    space = parse_search(["method=ngram,nosuch", "k=1,2"], template)
    cfg = ServeConfig(rate=0.0, num_requests=3, max_new_tokens=6, max_num_seqs=2)
    store = ResultStore(tmp_path / "store")
    seen = []
    study, pids = run_launch_study(template, space, cfg, ["def add(a, b):", "class Stack:", "import os"],
                                   study_name="launch-test", storage=f"sqlite:///{tmp_path}/s.db", trials=4,
                                   log_dir=tmp_path / "logs", launch_timeout=120, store=store, seed=0,
                                   on_trial=lambda *a: seen.append(a))
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 4 and len(seen) == 4
    assert pids and not any(alive(p) for p in pids) and all(group_pids(p) == [] for p in pids)
    ok = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    bad = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    assert sorted(t.params["k"] for t in ok) == [1, 2] and all(t.params["method"] == "ngram" for t in ok)
    assert all(t.params["method"] == "nosuch" for t in bad)
    for t in bad:  # the server's own refusal, read from its log
        assert "exited with status" in t.user_attrs["error"] and "nosuch" in t.user_attrs["log_tail"]
    rows = store.load("launch-test")
    assert len(rows) == len(ok)
    for _, row in rows.iterrows():
        assert row["engine_name"] == "workbench" and row["status"] == "ok" and row["completed"] == 3
        assert f"--k {row['launch_params'].split('k=')[1]}" in row["launch_command"]
        assert row["method"] == "ngram" and row["k"] in (1, 2)  # the server's own settings, from /v1/models
    for t in ok:
        assert t.values[0] > 0 and t.user_attrs["run_id"] in set(rows["run_id"])
    report = launch.report(study, pids)
    assert "still running: 0" in report and "failed: the server exited" in report


def test_the_cli_refuses_a_search_without_a_template_before_launching(tmp_path, capsys):
    rc = serving_main(["--study", "x", "--storage", f"sqlite:///{tmp_path}/s.db", "--search", "k=1,2", "--no-store"])
    assert rc == 2 and "--search needs --launch TEMPLATE" in capsys.readouterr().err
    rc = serving_main(["--study", "x", "--storage", f"sqlite:///{tmp_path}/s.db", "--launch", "serve --k {k",
                       "--no-store"])
    assert rc == 2 and "literal braces" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_the_cli_runs_a_launch_study_and_writes_its_report(tmp_path, capsys):
    rc = serving_main(["--study", "cli", "--storage", f"sqlite:///{tmp_path}/s.db", "--launch",
                       f"{sys.executable} -c \"import sys; print('bad flag {{k}}'.format(k={{k}}), file=sys.stderr); "
                       "sys.exit(2)\" --port {port}",
                       "--search", "k=5", "--trials", "1", "--launch-logs", str(tmp_path / "logs"), "--no-store",
                       "--out", str(tmp_path / "out"), "--preset", "tiny", "--num-requests", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "failed: the server exited with status 2" in out and "still running: 0" in out
    trials = json.loads((tmp_path / "out" / "trials.json").read_text())
    assert trials[0]["state"] == "FAIL" and "bad flag 5" in trials[0]["log_tail"]
    assert len(list((tmp_path / "logs").glob("cli_trial*.log"))) == 1
