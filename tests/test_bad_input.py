"""Bad input never gets a traceback: every bad setting, device, model file or prompt file becomes a named error that
says what was asked for and what to do, and a failed bench run is stored as a row that carries what was asked.

Property-based (hypothesis) over every knob of workbench.settings.KNOBS and over prompt files; example-based for the
reproductions of issue 12 (--device foo/meta, a huge --seed, --temperature nan, --trials -1, truncated or
garbage-length safetensors); shell tests for scripts/start.sh (listens on 127.0.0.1 unless asked) and
scripts/venv.sh (sourcing it leaves the caller's shell options alone).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings as hsettings, strategies as st

from workbench import settings
from workbench.harness.bench import BenchConfig, BenchError, BenchSession, failed_record
from workbench.harness.prompts import PromptFileError, load_prompts

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "workbench" / "zoo" / "weights" / "tiny" / "target"
EXAMPLES = hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- settings: random values for every knob -----------------------------------------------------------------------

WILD = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([math.inf, -math.inf, math.nan, 2**31, 2**63, -1, 0, 10_000, 1e308, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.lists(st.one_of(st.integers(-3, 300), st.floats(), st.text(max_size=2)), max_size=4),
    st.tuples(st.integers(-3, 100), st.integers(-3, 100)),
)


def valid(knob: settings.Knob):
    if knob.allowed is not None:
        return st.sampled_from(knob.allowed)
    if knob.kind == "ints":
        return st.lists(st.integers(1, 64), min_size=1, max_size=4).map(lambda v: tuple(sorted(set(v))))
    if knob.kind == "int":
        return st.integers(int(knob.low), int(knob.high))
    return st.floats(knob.low, knob.high)


KNOB_VALUES = st.fixed_dictionaries({}, optional={name: st.one_of(valid(k), WILD) for name, k in settings.KNOBS.items()})


@EXAMPLES
@given(KNOB_VALUES)
@example({"temperature": math.inf})
@example({"temperature": math.nan})
@example({"top_p": math.nan})
@example({"seed": 10**20})
@example({"temperature": 10**400, "top_p": -10**400})  # math.isfinite of such an int raises OverflowError
@example({"k": 10_000})
@example({"graph_batch_sizes": 5, "cuda_graphs": True})
def test_settings_check_accepts_or_names_the_knob(values):
    try:
        settings.check(values)
    except settings.SettingError as e:
        assert e.knob in settings.KNOBS, e
        return
    for name, value in values.items():  # accepted: every value the method reads is in range and finite
        knob = settings.KNOBS[name]
        if knob.reads(values.get("method", "draft")) and knob.kind in ("int", "float"):
            if knob.choices is not None:  # e.g. int4_group_size: a number from a list, not a range
                assert value in knob.choices, (name, value)
            else:
                assert math.isfinite(value) and knob.low <= value <= knob.high, (name, value)


@pytest.fixture(scope="module")
def session():
    return BenchSession.load(preset="tiny", device="cpu")


COLUMN_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "ints": str}


@EXAMPLES
@given(KNOB_VALUES, st.integers(1, 3000))
@example({"k": 16, "max_new_tokens": 8192}, 2040)  # no max_new_tokens fits: advice must not be "<= -N"
@example({"seed": 10**20}, 3)
@example({"temperature": 10**400}, 3)
def test_bench_check_accepts_or_raises_bench_error_and_the_failed_row_is_storable(session, values, prompt_len):
    cfg = BenchConfig(**{k: v for k, v in values.items() if settings.KNOBS[k].scope == "run"})
    try:
        session.check(cfg, [[1] * prompt_len])
    except BenchError as e:
        assert "<= -" not in str(e) and "<= 0" not in str(e), e
        row = failed_record(cfg, str(e), session=session)
        for knob in settings.RUN_KNOBS:  # a column holds its kind or nothing (the value stays in config_json)
            value = row[knob.name]
            assert value is None or (isinstance(value, COLUMN_TYPES[knob.kind]) and
                                     (not isinstance(value, int) or -2**63 <= value < 2**63)), (knob.name, value)
        assert json.loads(row["config_json"]).keys() == {k.name for k in settings.RUN_KNOBS}
        assert row["device"] == "cpu" and row["preset"] == "tiny" and row["status"] == "failed"


# ---- prompt files: random bytes and random JSONL lines ------------------------------------------------------------

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                      max_size=3), max_leaves=6)
PROMPT_ROWS = st.fixed_dictionaries({}, optional={"prompt": JSON_VALUES, "turns": JSON_VALUES, "id": JSON_VALUES,
                                                  "question_id": JSON_VALUES, "category": JSON_VALUES})
LINES = st.lists(st.one_of(PROMPT_ROWS.map(json.dumps), JSON_VALUES.map(json.dumps), st.text(max_size=12),
                           st.just('{"prompt": "def f():"}'), st.just("9" * 5000), st.just("[" * 5000)),
                 min_size=0, max_size=5)
FILE_LEVEL = ("file is empty", "duplicate id", "not UTF-8")  # problems of the whole file, not of one line


@pytest.fixture(scope="module")
def prompt_dir():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def _load(path: Path, data: bytes):
    path.write_bytes(data)
    try:
        prompts = load_prompts(path)
    except PromptFileError as e:
        assert str(e).startswith(f"{path}:" if e.line is None else f"{path}:{e.line}: "), e
        return e
    assert prompts and all(p.text.strip() and p.id for p in prompts)
    return prompts


@EXAMPLES
@given(st.binary(max_size=300), st.sampled_from([".jsonl", ".txt", ".json"]))
@example(b"\xef\xbb\xbf", ".jsonl")
@example(b"\xff\xfe{", ".jsonl")
def test_prompt_loader_on_random_bytes(prompt_dir, data, suffix):
    _load(prompt_dir / f"p{suffix}", data)


@EXAMPLES
@given(LINES)
@example(["9" * 5000])           # json.loads: ValueError (int digits limit), not JSONDecodeError
@example(["[" * 5000])           # RecursionError inside json
@example(['{"prompt": "a\u2028b"}'])  # a JSON string may hold U+2028, which str.splitlines splits on
def test_prompt_loader_on_random_jsonl_lines(prompt_dir, lines):
    out = _load(prompt_dir / "p.jsonl", "\n".join(lines).encode())
    if isinstance(out, PromptFileError) and not any(s in out.problem for s in FILE_LEVEL):
        assert out.line is not None, out  # a problem of one line names it


# ---- the reproductions of issue 12 --------------------------------------------------------------------------------

def _bench(tmp_path, *args, preset=("--preset", "tiny")):
    from results.store import ResultStore
    from workbench.__main__ import main

    code = main(["bench", *preset, "--max-new-tokens", "4", "--num-prompts", "1", "--store", str(tmp_path), *args])
    return code, ResultStore(tmp_path).load()


@pytest.mark.parametrize("device", ["foo", "meta", "cuda:x", "mps"])
def test_bad_device_is_named_and_the_row_says_what_was_asked(tmp_path, capsys, device):
    code, df = _bench(tmp_path, "--device", device, "--dtype", "bfloat16")
    err = capsys.readouterr().err
    assert code == 2 and f"device={device!r} is not a device the engine runs on" in err and "--device" in err
    assert "corrupt" not in err and "Traceback" not in err
    row = df.iloc[0]
    assert (row["status"], row["device"], row["dtype"], row["preset"]) == ("failed", device, "bfloat16", "tiny")


def test_missing_model_row_carries_its_path(tmp_path, capsys):
    code, df = _bench(tmp_path, "--model", str(tmp_path / "nope"), "--method", "ngram", preset=())
    assert code == 2 and "does not exist" in capsys.readouterr().err
    row = df.iloc[0]
    assert row["target_path"] == str(tmp_path / "nope") and row["dtype"] == "auto" and row["device"] == "auto"


def test_bench_model_without_prompts_uses_the_built_in_set(tmp_path, capsys):
    code, df = _bench(tmp_path, "--model", str(TINY), "--method", "ngram", "--repeats", "1", "--warmup", "0",
                      preset=())
    builtin = str(ROOT / "workbench" / "zoo" / "weights" / "tiny" / "prompts.jsonl")
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert f"using the built-in set {builtin}" in err
    row = df.iloc[0]
    assert row["status"] == "ok" and row["prompts_source"] == builtin and row["target_path"] == str(TINY)


def test_serve_bench_model_without_prompts_uses_the_built_in_set(tmp_path, capsys):
    from results.store import ResultStore
    from workbench.__main__ import main

    code = main(["serve-bench", "--model", str(TINY), "--method", "ngram", "--k", "2", "--num-requests", "2",
                 "--max-new-tokens", "4", "--rate", "50", "--device", "cpu", "--store", str(tmp_path)])
    builtin = str(ROOT / "workbench" / "zoo" / "weights" / "tiny" / "prompts.jsonl")
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert f"using the built-in set {builtin}" in err
    row = ResultStore(tmp_path).load().iloc[0]
    assert row["status"] == "ok" and row["prompts_source"] == builtin


@pytest.mark.parametrize("args, message", [
    (("--seed", str(10**20)), "seed=100000000000000000000 is outside what the engine supports: 0..2147483647"),
    (("--temperature", "inf"), "temperature=inf must be a finite number in 0..2"),
    (("--temperature", "nan"), "temperature=nan must be a finite number in 0..2"),
    (("--k", "10000"), "k=10000 is outside what the engine supports: 1..16"),
])
def test_bad_run_setting_is_a_stored_failed_row(tmp_path, capsys, args, message):
    code, df = _bench(tmp_path, "--method", "ngram", *args)
    assert code == 2 and message in capsys.readouterr().err
    row = df.iloc[0]
    assert row["status"] == "failed" and message in row["error"] and row["target_path"]
    knob = args[0][2:].replace("-", "_")
    assert str(json.loads(row["config_json"])[knob]) == str(json.loads(args[1].replace("inf", "Infinity")
                                                                       .replace("nan", "NaN")))


@pytest.mark.parametrize("flag, value", [("--trials", "-1"), ("--trials", "0"), ("--workers", "-2"),
                                         ("--threads", "0"), ("--sampler-seed", str(2**40))])
def test_studies_run_rejects_bad_counts(capsys, flag, value):
    from studies.run import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--study", "x", flag, value])
    assert exc.value.code == 2 and f"{flag} '{value}': give a whole number" in capsys.readouterr().err


def test_studies_run_with_unwritable_store_prints_the_record_then_fails(tmp_path):
    """As bench does: the trial's measurement is printed, the store problem named, exit status 3, no traceback."""
    not_a_dir = tmp_path / "store-file"
    not_a_dir.write_text("I am a file")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "studies.run", "--study", "s", "--storage",
                        f"sqlite:///{tmp_path / 's.db'}", "--trials", "1", "--store", str(not_a_dir), "--methods",
                        "ngram", "--max-new-tokens", "4", "--num-prompts", "1", "--repeats", "1", "--warmup", "0",
                        "--threads", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "the run of trial 0 was not stored" in r.stderr and str(not_a_dir) in r.stderr
    record = json.loads(r.stdout.strip().splitlines()[-1])
    assert record["status"] == "ok" and record["method"] == "ngram" and record["tokens_per_s"] > 0
    assert not_a_dir.read_text() == "I am a file"


def _model_dir(tmp_path, weights: bytes) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(TINY / "config.json", d)
    (d / "model.safetensors").write_bytes(weights)
    return d


@pytest.mark.parametrize("cut", ["header", "tensors", "garbage length", "empty"])
def test_models_info_on_a_broken_safetensors_is_one_named_line(tmp_path, capsys, cut):
    from workbench.__main__ import main
    from workbench.models import ModelLoadError, load_model
    from workbench.models.loader import safetensors_header

    good = (TINY / "model.safetensors").read_bytes()
    weights = {"header": good[:5000], "tensors": good[:-100], "garbage length": struct.pack("<Q", 2**62) + b"{}",
               "empty": b""}[cut]
    d = _model_dir(tmp_path, weights)
    assert main(["models", "info", str(d)]) == 1
    out, err = capsys.readouterr()
    assert out == ""  # the error goes to stderr, stdout carries only an answer
    assert err.count("\n") == 1 and err.startswith(f"error: {d / 'model.safetensors'}: ") and "Traceback" not in err
    assert "truncated" in err or "corrupt" in err
    assert main(["models", "info", str(d), "--json"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ")
    with pytest.raises(ModelLoadError):
        load_model(d)
    if cut != "tensors":
        with pytest.raises(ModelLoadError, match="header length"):
            safetensors_header(d / "model.safetensors")


def test_models_page_reads_no_garbage_header_length(tmp_path):
    from ui.catalog import safetensors_params

    assert safetensors_params(TINY) == 5_180_672  # a good file: the tiny target's parameter count
    d = _model_dir(tmp_path, struct.pack("<Q", 2**62) + b"{}")
    assert safetensors_params(d) is None
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")
    assert safetensors_params(d) is None


# ---- scripts: start.sh listens on loopback, venv.sh keeps the caller's shell options ------------------------------

@pytest.fixture()
def fake_venv(tmp_path):
    """A venv folder venv.sh takes as installed (python + matching requirements stamp): sourcing it installs nothing.
    Its python refuses pip, so a stale stamp fails the test instead of installing into the interpreter it wraps."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\ncase " $* " in *" pip "*) echo "fake venv: no installs" >&2; exit 1;; esac\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (venv / ".requirements.sha").write_text(hashlib.sha256((ROOT / "requirements.txt").read_bytes()).hexdigest()
                                            + "\n")
    return venv


def _bash(script: str, venv: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, "WORKBENCH_VENV": str(venv), **env})


def test_start_listens_on_localhost_unless_asked(fake_venv):
    dry = dict(WORKBENCH_DRY_RUN="1")
    default = _bash("bash scripts/start.sh", fake_venv, **dry)
    assert default.returncode == 0, default.stderr
    assert "streamlit run app.py" in default.stdout and "--server.address 127.0.0.1" in default.stdout
    exposed = _bash("bash scripts/start.sh --server.port 8600", fake_venv, WORKBENCH_LISTEN="0.0.0.0", **dry)
    assert "--server.address 0.0.0.0" in exposed.stdout and "--server.port 8600" in exposed.stdout
    passed = _bash("bash scripts/start.sh --server.address 10.1.2.3", fake_venv, **dry)
    assert passed.stdout.count("--server.address") == 1 and "--server.address 10.1.2.3" in passed.stdout
    config = (ROOT / ".streamlit" / "config.toml").read_text()
    assert 'address = "127.0.0.1"' in config  # `streamlit run app.py` by hand is on loopback too


def test_sourcing_venv_keeps_the_shell_options(fake_venv):
    proc = _bash('before="$(set +o; shopt -p)"; source scripts/venv.sh || echo source-failed; '
                 '[ "$before" = "$(set +o; shopt -p)" ] && echo same-options; '
                 'command -v python; false; echo still-here', fake_venv)
    assert proc.stdout.splitlines() == ["same-options", str(fake_venv / "bin" / "python"), "still-here"], proc


@pytest.mark.parametrize("command", [["-m", "workbench", "bench"], ["-m", "workbench", "serve-bench"],
                                     ["-m", "workbench", "zoo", "train"], ["-m", "studies.run"]])
def test_every_command_prints_its_help(command):
    """--help formats every knob's help (argparse reads % there as a format: "within 2 %" once crashed it)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout
