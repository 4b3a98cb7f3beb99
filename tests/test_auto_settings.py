"""Fast by default: dtype, cuda_graphs and compile default to "auto", resolved per device before a run; the result
row holds the resolved values (bool columns stay bool) and names the knobs that were auto."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from workbench import settings
from workbench.settings import AUTO, KNOBS, SettingError, check, resolve_auto

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "workbench/zoo/weights/tiny"


def test_the_speed_knobs_default_to_auto():
    assert settings.AUTO_KNOBS == ("dtype", "cuda_graphs", "compile")
    for name in settings.AUTO_KNOBS:
        assert KNOBS[name].default == AUTO and AUTO in KNOBS[name].allowed
        KNOBS[name].check(AUTO)
        assert KNOBS[name].parse("auto") == AUTO and KNOBS[name].format(AUTO) == "auto"
    assert KNOBS["overlap"].default is True and KNOBS["cuda_graphs"].column_kind == "bool"


def test_cpu_resolves_to_the_cpu_choice():
    values, names = resolve_auto({"dtype": AUTO, "cuda_graphs": AUTO, "compile": AUTO, "batch": 4}, "cpu")
    assert values == {"dtype": "float32", "cuda_graphs": False, "compile": "off", "batch": 4}
    assert names == ("dtype", "cuda_graphs", "compile")


@pytest.mark.parametrize("model_dtype, bf16, expected", [
    ("bfloat16", True, "bfloat16"), ("float16", True, "float16"), ("float32", True, "bfloat16"),
    (None, True, "bfloat16"), ("float32", False, "float16"), ("bfloat16", False, "bfloat16"),
])
def test_cuda_resolves_to_the_models_half_dtype_graphs_and_compile(model_dtype, bf16, expected):
    values, names = resolve_auto({"dtype": AUTO, "cuda_graphs": AUTO, "compile": AUTO}, "cuda",
                                 model_dtype=model_dtype, bf16_supported=bf16)
    assert values == {"dtype": expected, "cuda_graphs": True, "compile": "default"}
    assert names == ("dtype", "cuda_graphs", "compile")


def test_auto_graphs_stay_off_for_a_batch_above_every_bucket():
    assert settings.auto_value("cuda_graphs", "cuda", {"batch": 9, "graph_batch_sizes": (1, 2, 4, 8)}) is False
    assert settings.auto_value("cuda_graphs", "cuda", {"max_num_seqs": 8, "graph_batch_sizes": (1, 8)}) is True
    check({"batch": 200, "cuda_graphs": AUTO})  # auto never trips the bucket rule; an explicit on does
    with pytest.raises(SettingError, match="batch 200 exceeds the largest graph bucket"):
        check({"batch": 200, "cuda_graphs": True})


def test_explicit_values_win():
    values, names = resolve_auto({"dtype": "float16", "cuda_graphs": False, "compile": "max-autotune"}, "cuda")
    assert values == {"dtype": "float16", "cuda_graphs": False, "compile": "max-autotune"} and names == ()
    values, names = resolve_auto({"cuda_graphs": True, "compile": AUTO}, "cpu")
    assert values == {"cuda_graphs": True, "compile": "off"} and names == ("compile",)


def test_bad_values_still_give_named_errors():
    with pytest.raises(SettingError, match="compile='fast' is not supported by the engine; allowed: 'auto', 'off'"):
        check({"compile": "fast"})
    with pytest.raises(SettingError, match=r"cuda_graphs='Auto' is not supported"):
        check({"cuda_graphs": "Auto"})
    with pytest.raises(SettingError, match="cannot read --cuda-graphs 'maybe'"):
        KNOBS["cuda_graphs"].parse("maybe")
    with pytest.raises(SettingError, match="batch has no auto value"):
        settings.auto_value("batch", "cuda", {})


def test_resolve_config_resolves_a_bench_config_and_names_the_session_dtype():
    from workbench.harness.bench import BenchConfig

    cfg, names = settings.resolve_config(BenchConfig(batch=2), "cuda", dtype_auto=True)
    assert (cfg.cuda_graphs, cfg.compile, cfg.overlap, cfg.batch) == (True, "default", True, 2)
    assert names == ("dtype", "cuda_graphs", "compile")
    again, names = settings.resolve_config(cfg, "cuda")
    assert again == cfg and names == ()


def test_a_faked_cuda_device_loads_the_models_own_dtype(monkeypatch, tmp_path):
    from workbench.harness.bench import auto_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    cuda = torch.device("cuda")
    assert json.loads((TINY / "target/config.json").read_text())["dtype"] == "bfloat16"
    assert auto_dtype(AUTO, cuda, str(TINY / "target")) == "bfloat16"
    assert auto_dtype(AUTO, torch.device("cpu"), str(TINY / "target")) == "float32"
    assert auto_dtype("float16", cuda, str(TINY / "target")) == "float16"  # explicit wins
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert auto_dtype(AUTO, cuda, str(tmp_path)) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert auto_dtype(AUTO, cuda, str(tmp_path)) == "float16"


@pytest.fixture(scope="module")
def session():
    from workbench.harness.bench import BenchSession

    return BenchSession.load(preset="tiny", device="cpu")


def test_a_cpu_run_records_the_resolved_values(session, tmp_path):
    from results.store import ResultStore
    from workbench.harness.bench import BenchConfig

    assert session.dtype == "float32" and session.dtype_auto
    small = dict(k=2, batch=2, max_new_tokens=6, num_prompts=2, warmup=0, repeats=1)
    rec = session.run(BenchConfig(**small)).record
    assert rec["cuda_graphs"] is False and rec["compile"] == "off" and rec["dtype"] == "float32"
    assert rec["auto_knobs"] == "dtype,cuda_graphs,compile"
    assert json.loads(rec["config_json"])["cuda_graphs"] is False  # the config as it ran
    explicit = session.run(BenchConfig(**small, cuda_graphs=True, graph_batch_sizes=(1, 2))).record
    assert explicit["cuda_graphs"] is True and explicit["auto_knobs"] == "dtype,compile"
    store = ResultStore(tmp_path)
    store.append(rec)
    store.append(explicit)
    df = store.load()
    assert str(df["cuda_graphs"].dtype) == "boolean" and list(df["cuda_graphs"]) == [False, True]
    assert list(df["auto_knobs"]) == ["dtype,cuda_graphs,compile", "dtype,compile"]


def test_a_failed_row_after_loading_holds_resolved_values(session):
    from workbench.harness.bench import BenchConfig, failed_record

    rec = failed_record(BenchConfig(k=0), "k=0 is outside", session=session)
    assert rec["cuda_graphs"] is False and rec["compile"] == "off" and rec["auto_knobs"] == "dtype,cuda_graphs,compile"
    unloaded = failed_record(BenchConfig(k=0), "no model", asked={"dtype": AUTO})
    assert unloaded["cuda_graphs"] is None and unloaded["compile"] == AUTO  # nothing resolved it: config_json has it


def test_serve_bench_resolves_auto_the_same_way(session):
    from workbench.serving.bench import serve_bench
    from workbench.serving.config import ServeConfig

    cfg = ServeConfig(method="ngram", k=2, num_requests=2, max_new_tokens=4, max_num_seqs=2)
    assert cfg.cuda_graphs == AUTO and cfg.compile == AUTO
    rec = serve_bench(session, cfg).record
    assert rec["cuda_graphs"] is False and rec["compile"] == "off" and rec["auto_knobs"] == "dtype,cuda_graphs,compile"
    fake = SimpleNamespace(device=torch.device("cuda"), dtype_auto=False)
    resolved, names = settings.resolve_config(cfg, fake.device.type, dtype_auto=fake.dtype_auto)
    assert (resolved.cuda_graphs, resolved.compile, names) == (True, "default", ("cuda_graphs", "compile"))
