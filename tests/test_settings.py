"""workbench.settings: one declaration per knob, and every consumer generated from it (BenchConfig, the bench CLI, the
studies' space, flags and run settings, the result schema); named errors for bad values; no torch on import.

The dashboard forms are generated from the same registry: tests/test_app.py checks that the Run and Tune pages offer
a field for every knob.
"""
from __future__ import annotations

import argparse
import dataclasses
import doctest
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import workbench.settings
from results import schema
from workbench.settings import KNOBS, METHODS, RUN_KNOBS, SESSION_KNOBS, SettingError, check

ROOT = Path(__file__).resolve().parents[1]


def test_docstring_examples():
    assert doctest.testmod(workbench.settings).failed == 0


def test_importing_settings_does_not_import_torch():
    code = "import sys, workbench.settings\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def bench_parser() -> argparse.ArgumentParser:
    from workbench.harness import bench_cli

    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    return parser


# ---- every knob reaches every consumer ---------------------------------------------------------------------------
def test_bench_config_has_one_field_per_run_knob_with_its_default():
    from workbench.harness.bench import BenchConfig, BenchSession

    assert {f.name: f.default for f in dataclasses.fields(BenchConfig)} == {k.name: k.default for k in RUN_KNOBS}
    for knob in SESSION_KNOBS:  # session knobs pick the loaded models instead
        assert inspect.signature(BenchSession.load).parameters[knob.name].default == knob.default
    cfg = BenchConfig(method="ngram", k=3)
    assert dataclasses.replace(cfg, k=5).k == 5 and cfg.method == "ngram"
    assert BenchConfig(graph_batch_sizes=[1, 2]) == BenchConfig(graph_batch_sizes=(1, 2))  # lists stored as tuples


def test_bench_cli_has_one_flag_per_knob_with_its_default_and_choices():
    parser = bench_parser()
    defaults = parser.parse_args(["bench"])
    sub = parser._subparsers._group_actions[0].choices["bench"]
    actions = {a.dest: a for a in sub._actions}
    for knob in KNOBS.values():
        assert knob.flag in actions[knob.name].option_strings, knob.name
        assert getattr(defaults, knob.name) == knob.default, knob.name
        assert actions[knob.name].help == knob.help
        if knob.choices:
            assert tuple(actions[knob.name].choices) == knob.choices
    args = parser.parse_args(["bench", "--graph-batch-sizes", "1,2,4", "--cuda-graphs", "--compile", "max-autotune"])
    assert args.graph_batch_sizes == (1, 2, 4) and args.cuda_graphs is True and args.compile == "max-autotune"
    assert parser.parse_args(["bench", "--no-cuda-graphs"]).cuda_graphs is False


def test_bench_cli_refuses_unreadable_values(capsys):
    with pytest.raises(SystemExit):
        bench_parser().parse_args(["bench", "--graph-batch-sizes", "1,two"])
    assert "cannot read --graph-batch-sizes '1,two'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_parser().parse_args(["bench", "--compile", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def test_schema_declares_every_knob_as_a_config_column_of_its_kind():
    specs = schema.run_specs()
    for knob in KNOBS.values():
        assert knob.name in schema.RUN_COLUMNS, f"results.schema does not declare knob {knob.name!r}"
        assert (specs[knob.name].kind, specs[knob.name].group) == (knob.column_kind, "config"), knob.name


def test_config_columns_of_a_run_row():
    from workbench.harness.bench import BenchConfig, _config_columns

    cols = _config_columns(BenchConfig(graph_batch_sizes=(1, 2, 4, 8), cuda_graphs=True, compile="default"))
    assert {k.name for k in RUN_KNOBS} <= set(cols)
    assert (cols["graph_batch_sizes"], cols["cuda_graphs"], cols["compile"]) == ("1,2,4,8", True, "default")
    for name, value in cols.items():  # every value fits its declared column
        schema.coerce_value(schema.run_specs()[name], value)


def test_studies_space_settings_and_flags_come_from_the_registry():
    from studies.run import build_parser, build_spec
    from studies.space import LIMITS, SEARCH_KNOBS, SETTING_KNOBS, RunSettings, SearchSpace
    from studies.space import METHODS as STUDY_METHODS

    assert STUDY_METHODS is METHODS
    searchable = {k.name for k in KNOBS.values() if k.searchable}
    assert searchable <= set(LIMITS) and set(SEARCH_KNOBS) == searchable - {"method"}
    assert {f.name for f in dataclasses.fields(SearchSpace)} == {"methods", *SEARCH_KNOBS}
    # a run knob is either searched or a fixed run setting of every trial, with the quick default
    assert {f.name: f.default for f in dataclasses.fields(RunSettings)} == {n: KNOBS[n].quick for n in SETTING_KNOBS}
    assert set(SEARCH_KNOBS) | set(SETTING_KNOBS) | {"method"} == set(KNOBS)
    assert RunSettings().max_new_tokens == 32 and RunSettings().num_prompts == 4  # fast trials, declared once
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    assert {KNOBS[n].flag for n in (*SEARCH_KNOBS, *SETTING_KNOBS)} <= flags
    args = build_parser().parse_args(["--study", "s", "--cuda-graphs", "off,on", "--compile", "off,max-autotune",
                                      "--graph-batch-sizes", "1,2,4", "--batch", "1,4"])
    spec = build_spec(args, None)
    assert spec.space.cuda_graphs == (False, True) and spec.space.compile == ("off", "max-autotune")
    assert spec.settings.graph_batch_sizes == (1, 2, 4)
    spec.validate()


def test_methods_declare_the_knobs_they_read():
    assert {m: METHODS[m].knobs for m in METHODS} == {"ar": (), "draft": ("k", "draft_kv_quant", "draft_quant"), "ngram": ("k", "ngram_min",
                                                                                           "ngram_max"),
                                                      "redrafter": ("beam_width", "beam_length", "diversity_penalty",
                                                                    "hot_vocab"),
                                                      "eagle": ("tree_depth", "tree_topk", "tree_budget", "hot_vocab"),
                                                      "eagle3": ("tree_depth", "tree_topk", "tree_budget",
                                                                 "eagle3_layers")}
    assert KNOBS["method"].choices == tuple(METHODS)


# ---- named errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, message", [
    ({"compile": "fast"}, "compile='fast' is not supported by the engine; allowed: 'auto', 'off', 'default', 'max-autotune'"),
    ({"graph_batch_sizes": ()}, "graph_batch_sizes is empty: give at least one batch bucket, e.g. 1,2,4,8"),
    ({"graph_batch_sizes": (2, 1)}, "graph_batch_sizes=2,1 must be strictly increasing (sorted, no duplicates), "
                                    "e.g. 1,2"),
    ({"graph_batch_sizes": (1, 1, 2)}, "graph_batch_sizes=1,1,2 must be strictly increasing"),
    ({"graph_batch_sizes": (1, 2.5)}, "graph_batch_sizes=1,2.5 must hold whole numbers >= 1"),
    ({"batch": 32, "cuda_graphs": True, "graph_batch_sizes": (1, 2, 4, 8)},
     "batch 32 exceeds the largest graph bucket 8: add a bucket >= 32 to --graph-batch-sizes "
     "or turn --cuda-graphs off"),
    ({"cuda_graphs": "yes"}, "cuda_graphs='yes' is not supported by the engine; allowed: 'auto', False, True"),
    ({"k": 17}, "k=17 is outside what the engine supports: 1..16"),
    ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "n-gram sizes need 1 <= ngram_min <= ngram_max, got 3, 2"),
    ({"method": "redrafter", "beam_width": 0}, "beam_width=0 is outside what the engine supports: 1..8"),
    ({"method": "redrafter", "beam_length": 9}, "beam_length=9 is outside what the engine supports: 1..8"),
    ({"method": "redrafter", "diversity_penalty": -1.0},
     "diversity_penalty=-1.0 is outside what the engine supports: 0..5"),
    ({"method": "redrafter", "beam_width": 2.5}, "beam_width=2.5 must be a whole number in 1..8"),
])
def test_bad_values_give_named_errors(values, message):
    with pytest.raises(SettingError) as e:
        check(values)
    assert str(e.value).startswith(message)


def test_checks_follow_the_method_and_the_graph_switch():
    check({"method": "ar", "k": 0})  # ar reads no k
    check({"method": "draft", "beam_width": 0})  # only redrafter reads the beam knobs
    check({"batch": 32, "cuda_graphs": False, "graph_batch_sizes": (1, 2)})  # buckets only bound a graphed batch
    check({"batch": 64, "cuda_graphs": True})  # the default buckets reach 64


def test_text_round_trips_through_parse_and_format():
    for knob in KNOBS.values():
        assert knob.parse(knob.format(knob.default)) == knob.default, knob.name
    assert KNOBS["cuda_graphs"].parse("ON") is True and KNOBS["cuda_graphs"].parse("off") is False
    with pytest.raises(SettingError, match=r"cannot read --cuda-graphs 'maybe': use on or off"):
        KNOBS["cuda_graphs"].parse("maybe")
