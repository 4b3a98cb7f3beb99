"""One bridge from settings to engine: EngineConfig's knob fields take the registry's defaults, one mapping
(`engine_config`) serves the harness and serving, and one drafter registry builds every method's drafter."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.test_engine import draft, target  # noqa: F401 (fixtures)
from workbench import choices, settings
from workbench.engine import EngineConfig
from workbench.engine.drafters import (DRAFTERS, DraftModelDrafter, DrafterError, EagleDrafter, NgramDrafter,
                                       RedrafterDrafter, make_drafter)
from workbench.engine.sampling import SamplingParams
from workbench.engine.step import KNOB_OF_FIELD, engine_config
from workbench.harness.bench import BenchConfig
from workbench.serving.config import ServeConfig

KNOB_FIELDS = [f.name for f in dataclasses.fields(EngineConfig) if KNOB_OF_FIELD.get(f.name, f.name) in settings.KNOBS]


def test_every_engine_knob_field_defaults_to_the_registry():
    assert {"max_new_tokens", "paged", "kv_block_size", "seed", "cuda_graphs", "graph_batch_sizes", "compile",
            "attention", "overlap", "kv_quant", "prefill_graphs", "compile_prefill", "pdl"} <= set(KNOB_FIELDS)
    cfg = EngineConfig()
    for name in KNOB_FIELDS:
        assert getattr(cfg, name) == settings.engine_default(KNOB_OF_FIELD.get(name, name)), name
    assert cfg.overlap is settings.KNOBS["overlap"].default is True
    assert (cfg.cuda_graphs, cfg.compile) == (settings.CPU_AUTO["cuda_graphs"], settings.CPU_AUTO["compile"])


def test_an_unresolved_auto_is_refused_by_the_engine():
    with pytest.raises(ValueError, match=r"cuda_graphs='auto' reached the engine: resolve"):
        EngineConfig(cuda_graphs="auto")
    with pytest.raises(ValueError, match="resolve a run config for its device first"):
        engine_config(BenchConfig())


def test_the_mapping_copies_every_field_of_the_same_name():
    cfg = BenchConfig(max_new_tokens=9, paged=False, kv_block_size=8, seed=5, cuda_graphs=True,
                      graph_batch_sizes=(1, 2), compile="default", attention="sdpa", overlap=False,
                      target_kv_quant="int8", prefill_graphs=False, compile_prefill=True, pdl=False,
                      temperature=0.7, top_k=5, top_p=0.9)
    ecfg = engine_config(cfg, timing=True)
    for name in KNOB_FIELDS:
        assert getattr(ecfg, name) == getattr(cfg, KNOB_OF_FIELD.get(name, name)), name
    assert ecfg.sampling == SamplingParams(0.7, 5, 0.9) and ecfg.timing is True and ecfg.kv_quant == "int8"


def test_the_mapping_carries_a_new_field_without_an_edit(monkeypatch):
    """A field added to EngineConfig and a knob of the same name travel with no mapping edit (kernel_tuning did)."""
    resolved = BenchConfig(cuda_graphs=False, compile="off", kernel_tuning="int4_mma_rows=0")
    assert engine_config(resolved).kernel_tuning == "int4_mma_rows=0"
    Extended = dataclasses.make_dataclass("Extended", [("future_field", str, dataclasses.field(default="x"))],
                                          bases=(EngineConfig,), frozen=True)
    monkeypatch.setattr("workbench.engine.step.EngineConfig", Extended)
    run = SimpleNamespace(**{f.name: getattr(resolved, f.name) for f in dataclasses.fields(BenchConfig)},
                          future_field="measured")
    assert engine_config(run).future_field == "measured"


def test_harness_and_serving_map_equal_values_to_equal_engine_configs():
    shared = dict(method="ngram", k=3, max_new_tokens=11, kv_block_size=8, seed=2, cuda_graphs=True,
                  graph_batch_sizes=(1, 4), compile="off", attention="sdpa", prefill_graphs=False, pdl=False,
                  temperature=0.5, top_k=3, top_p=0.8)
    assert engine_config(BenchConfig(**shared), timing=True) == engine_config(ServeConfig(**shared), timing=True)


def test_harness_and_serving_build_engines_through_the_mapping(target, draft, monkeypatch):  # noqa: F811
    from workbench.engine import step
    from workbench.harness.bench import BenchSession
    from workbench.serving import bench as serving_bench

    seen = []
    real = step.engine_config

    def spy(cfg, **kw):
        seen.append(real(cfg, **kw))
        return seen[-1]

    monkeypatch.setattr("workbench.harness.bench.engine_config", spy)
    monkeypatch.setattr(serving_bench, "engine_config", spy)
    session = BenchSession(target, draft, None, [], device=torch.device("cpu"), dtype="float32", preset=None,
                           target_path="random", draft_path="random", prompts_source="random")
    shared = dict(method="draft", k=2, max_new_tokens=5, kv_block_size=8, graph_batch_sizes=(1, 2))
    session._engine(BenchConfig(**shared, cuda_graphs=False, compile="off"), drafter=True)
    serving_bench.engine_for(session, ServeConfig(**shared))  # auto -> the CPU's choice, as the harness resolved
    assert len(seen) == 2 and seen[0] == seen[1]


def test_every_method_with_a_drafter_is_registered():
    assert set(DRAFTERS) == set(settings.METHODS)
    speculative = {m.name for m in settings.METHODS.values() if m.speculative}
    assert make_drafter("ar") is None and "ar" not in speculative


def test_the_registry_builds_each_method_from_its_knobs(target, draft):  # noqa: F811
    d = make_drafter("draft", BenchConfig(k=5, draft_kv_quant="int8"), draft=draft)
    assert isinstance(d, DraftModelDrafter) and d.settings["k"] == 5
    n = make_drafter("ngram", {"k": 2, "ngram_min": 2, "ngram_max": 3})
    assert isinstance(n, NgramDrafter) and (n.settings["ngram_min"], n.settings["ngram_max"]) == (2, 3)
    r = make_drafter("redrafter", {"beam_width": 3}, target=target)  # untrained head from the fixed seed
    assert isinstance(r, RedrafterDrafter) and r.settings["beam_width"] == 3
    e = make_drafter("eagle", ServeConfig(), target=lambda: target)
    assert isinstance(e, EagleDrafter) and e.settings["tree_budget"] == settings.KNOBS["tree_budget"].default
    made = []
    make_drafter("ngram", {}, draft=lambda: made.append(1), target=lambda: made.append(1))
    assert made == []  # models are made only for a method that reads them


def test_unknown_methods_and_missing_models_are_named():
    with pytest.raises(DrafterError, match="unknown method 'medusa'; choose one of ar, draft, ngram"):
        make_drafter("medusa", {})
    with pytest.raises(DrafterError, match="method 'draft' needs a draft model"):
        make_drafter("draft", {"k": 2})


def test_the_engine_takes_its_choice_lists_from_the_torch_free_module():
    from workbench.engine import graphs, kv_cache, kv_quant, quant
    from workbench.engine.drafters import eagle

    assert graphs.COMPILE_MODES is choices.COMPILE_MODES
    assert kv_cache.ATTENTION_BACKENDS is choices.ATTENTION_BACKENDS
    assert quant.FORMATS is choices.WEIGHT_FORMATS and quant.KERNELS is choices.QUANT_KERNELS
    assert quant.INT4_GROUP_SIZES is choices.INT4_GROUP_SIZES
    assert tuple(kv_quant.KV_FORMATS) == choices.KV_FORMATS
    assert eagle.tree_capacity is settings.tree_capacity is choices.tree_capacity
    assert settings.KNOBS["compile"].choices == (settings.AUTO, *choices.COMPILE_MODES)
    assert settings.KNOBS["tree_budget"].high == choices.MAX_TREE_NODES
