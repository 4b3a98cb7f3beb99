"""The mirrored engine checks (workbench.serving.engine_schemas) and the exports that must pass them.

Each case names the MIRRORS entry it restates: the engine, the commit and the validator in the source file it was read
from. Positive cases are configs the engine's own validators take; negative ones are the refusals they raise.
"""
from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings as hyp_settings, strategies as st

from tests.test_engine import draft, target  # noqa: F401 (fixtures)
from workbench.serving import engine_schemas as es
from workbench.serving.exports import (GATE_Z, ExportRefused, acceptance_gate, break_even_acceptance, export_snippets,
                                       normalize, sglang_adaptive_config, sglang_snippet, trtllm_snippet, vllm_snippet)


def problems_about(problems: list[str], key: str) -> list[str]:
    return [p for p in problems if key in p]


# ---- vLLM (vllm/config/speculative.py) -----------------------------------------------------------------------------
VLLM_OK = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
           "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 16, 0]]}


def test_vllm_accepts_a_schedule_it_has_fields_for():
    assert es.check_vllm(VLLM_OK, max_num_seqs=16) == []
    assert es.check_vllm({"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4}) == []


@pytest.mark.parametrize("mirror, edit, key", [
    ("vllm.fields", {"disable_by_batch_size": 16}, "disable_by_batch_size"),  # the key is gone from the field list
    ("vllm.method", {"method": "redrafter"}, "method"),
    ("vllm.method", {"method": "draft"}, "method"),  # the literal is draft_model
    ("vllm.num_speculative_tokens", {"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ("vllm.num_speculative_tokens", {"num_speculative_tokens": None}, "num_speculative_tokens"),
    ("vllm.prompt_lookup", {"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ("vllm.prompt_lookup", {"prompt_lookup_min": 0}, "prompt_lookup_min"),
    ("vllm.per_batch_size", {"num_speculative_tokens_per_batch_size": [[1, 4]]}, "per_batch_size"),
])
def test_vllm_refuses_what_its_validators_refuse(mirror, edit, key):
    assert mirror in es.MIRRORS and es.VLLM.commit in es.MIRRORS[mirror]
    cfg = {k: v for k, v in {**VLLM_OK, **edit}.items() if v is not None}
    got = es.check_vllm(cfg, max_num_seqs=16)
    assert problems_about(got, key), got


def test_vllm_draft_model_needs_its_model():  # MIRRORS["vllm.model"]
    got = es.check_vllm({"method": "draft_model", "num_speculative_tokens": 4})
    assert got == ["model: method 'draft_model' needs the draft / head path in 'model'"]


def test_vllm_schedule_must_state_every_batch_size_up_to_the_server_limit():
    cfg = {**VLLM_OK, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [6, 8, 1]]}
    got = es.check_vllm(cfg, max_num_seqs=16)
    assert any("should start at 5" in p for p in got) and any("must end at max_num_seqs (16)" in p for p in got)
    assert all(p.startswith("meaning:") for p in got)  # ours, not vLLM's: told apart by the prefix


# ---- TensorRT-LLM (tensorrt_llm/llmapi/llm_args.py) ----------------------------------------------------------------
TRT_OK = {"decoding_type": "Draft_Target", "speculative_model": "/m/draft", "max_draft_len": 4,
          "draft_len_schedule": {"4": 4, "16": 2}}


def test_trtllm_accepts_its_tags_and_schedule():
    assert es.check_trtllm(TRT_OK) == []
    assert es.check_trtllm({"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2}) == []
    assert es.check_trtllm({"decoding_type": "Eagle3", "speculative_model": "/h", "max_draft_len": 4,
                            "use_dynamic_tree": True, "dynamic_tree_max_topK": 4, "max_total_draft_tokens": 16}) == []
    assert es.check_trtllm({**TRT_OK, "draft_len_schedule": None, "max_concurrency": 32,
                            "acceptance_rate_window_size": 64, "acceptance_rate_threshold": 0.3}) == []


@pytest.mark.parametrize("mirror, edit, key", [
    ("trtllm.decoding_type", {"decoding_type": "DraftTarget"}, "decoding_type"),  # the tag has an underscore
    ("trtllm.decoding_type", {"decoding_type": None}, "decoding_type"),
    ("trtllm.strict", {"max_matching_ngram_size": 3}, "max_matching_ngram_size"),  # an NGram field on Draft_Target
    ("trtllm.max_draft_len", {"max_draft_len": 0, "draft_len_schedule": None}, "max_draft_len"),
    ("trtllm.speculative_model", {"speculative_model": None}, "speculative_model"),
    ("trtllm.draft_len_schedule", {"draft_len_schedule": {"1": 2, "8": 4}}, "smallest key"),
    ("trtllm.draft_len_schedule", {"draft_len_schedule": {"4": 4, "8": 6}}, "exceeds max_draft_len"),
    ("trtllm.draft_len_schedule", {"draft_len_schedule": {"0": 4}}, "must be >= 1"),
    ("trtllm.max_concurrency", {"max_concurrency": 8}, "mutually exclusive"),
    ("trtllm.acceptance", {"acceptance_rate_threshold": 1.5}, "acceptance_rate_threshold"),
])
def test_trtllm_refuses_what_its_validators_refuse(mirror, edit, key):
    assert mirror in es.MIRRORS and es.TRTLLM.commit[:12] in es.MIRRORS[mirror]
    cfg = {k: v for k, v in {**TRT_OK, **edit}.items() if v is not None}
    got = es.check_trtllm(cfg)
    assert problems_about(got, key), got


def test_trtllm_schedule_keys_are_upper_bounds_and_off_above_the_largest():  # MIRRORS["trtllm.draft_len_schedule"]
    assert [es.trtllm_k_at(TRT_OK, b) for b in (1, 4, 5, 16, 17)] == [4, 4, 2, 2, 0]
    assert [es.trtllm_k_at({"max_draft_len": 3, "max_concurrency": 8}, b) for b in (8, 9)] == [3, 0]


# ---- SGLang (python/sglang/srt/server_args.py) ---------------------------------------------------------------------
def test_sglang_accepts_a_chain_and_a_tree():
    assert es.check_sglang({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d",
                            "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                            "speculative_num_draft_tokens": 4}) == []
    assert es.check_sglang({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/h",
                            "speculative_num_steps": 4, "speculative_eagle_topk": 4,
                            "speculative_num_draft_tokens": 17}) == []


def test_sglang_ngram_becomes_a_breadth_10_tree_unless_the_breadth_is_set():  # MIRRORS["sglang.ngram_breadth"]
    args = {"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 5}
    got = es.check_sglang(args)
    assert len(got) == 1 and "speculative_ngram_max_bfs_breadth (10)" in got[0] and got[0].startswith("meaning:")
    assert es.sglang_chain(args)[1] == 10
    fixed = {**args, "speculative_ngram_max_bfs_breadth": 1}
    assert es.check_sglang(fixed) == [] and es.sglang_chain(fixed) == (4, 1, 5)


@pytest.mark.parametrize("mirror, args, key", [
    ("sglang.algorithm", {"speculative_algorithm": "DRAFT"}, "speculative_algorithm"),
    ("sglang.eagle_params", {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/h",
                             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}, "speculative_num_steps"),
    ("sglang.eagle_params", {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d",
                             "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                             "speculative_num_draft_tokens": 8}, "resets it to speculative_num_steps + 1"),
])
def test_sglang_refuses_or_rewrites_what_its_server_args_do(mirror, args, key):
    assert mirror in es.MIRRORS
    got = es.check_sglang(args)
    assert problems_about(got, key), got


def test_trtllm_acceptance_switch_off_fields_as_its_validators_take_them():  # MIRRORS["trtllm.acceptance"]
    ok = {**TRT_OK, "acceptance_rate_window_size": 30, "acceptance_rate_threshold": 0.3}
    assert es.check_trtllm(ok) == [] and es.trtllm_gate(ok) == (30, 0.3)
    assert problems_about(es.check_trtllm({**ok, "acceptance_rate_window_size": -1}), "acceptance_rate_window_size")
    assert problems_about(es.check_trtllm({**ok, "acceptance_rate_threshold": -0.1}), "acceptance_rate_threshold")
    off = {**ok, "acceptance_rate_window_size": 0}  # "If not set or set to 0, the feature is disabled"
    assert es.trtllm_gate(off) is None
    got = es.check_trtllm(off)
    assert len(got) == 1 and got[0].startswith("meaning: acceptance_rate_threshold is set")
    assert "trtllm.acceptance_gate" in es.MIRRORS and "trtllm.max_concurrency_translation" in es.MIRRORS


def test_break_even_acceptance_is_where_the_measured_step_cost_meets_autoregressive():
    a, m, s = 0.6, 2.8, 1.5  # 1.8 accepted of 3 drafted per step, 2.8 tokens per step, 1.5x AR
    t = break_even_acceptance(a, m, s)
    drafted = (m - 1) / a
    assert (1 + drafted * t) / (m / s) == pytest.approx(1.0)  # tokens per step over its cost in AR steps: 1x
    assert 0 < t < a
    assert break_even_acceptance(a, m, 1.0) == pytest.approx(a)  # measured at exactly 1x: breaks even right there
    assert break_even_acceptance(0.9, 1.9, 3.0) == 0.0  # so cheap a step that no acceptance loses (clipped)


def test_acceptance_gate_takes_the_lowest_break_even_and_a_window_that_holds_the_measured_acceptance():
    points = [(0.7, 3.1, 1.4), (0.65, 2.9, 1.1), (0.2, 1.6, 0.8)]  # the last bucket measured slower than AR
    window, threshold = acceptance_gate(points)
    assert threshold == math.floor(min(break_even_acceptance(*p) for p in points[:2]) * 1e4) / 1e4
    z = lambda n: (0.65 - threshold) / math.sqrt(0.65 * 0.35 / n)  # noqa: E731 - the lowest measured acceptance
    assert z(window) >= GATE_Z > z(window - 1)  # the fewest iterations that keep it GATE_Z sigmas above
    assert acceptance_gate([(0.2, 1.6, 0.8)]) is None and acceptance_gate([(None, None, 1.3), (0.0, 1.0, 1.2)]) is None


def test_trtllm_export_says_one_k_then_off_as_max_concurrency_and_carries_the_gate():
    cfg = trtllm_snippet([(1, 8, 3), (9, 64, 0)], "draft", draft_path="/d", gate=(40, 0.35))["speculative_config"]
    assert cfg["max_concurrency"] == 8 and "draft_len_schedule" not in cfg  # mutually exclusive: one of them
    assert es.check_trtllm(cfg) == [] and es.trtllm_gate(cfg) == (40, 0.35)
    assert [es.trtllm_k_at(cfg, b) for b in range(1, 65)] == [3] * 8 + [0] * 56
    always = trtllm_snippet([(1, 64, 3)], "ngram", (1, 3))["speculative_config"]
    assert "max_concurrency" not in always and "draft_len_schedule" not in always and es.check_trtllm(always) == []
    tree = trtllm_snippet([(1, 8, 4)], "eagle", draft_path="/h", tree=(4, 4, 16), gate=(40, 0.35))
    assert es.trtllm_gate(tree["speculative_config"]) is None and "no acceptance switch-off for a tree" in tree["note"]


# ---- SGLang's adaptive JSON (python/sglang/srt/speculative/adaptive_spec_params.py) ----------------------------------
ADAPTIVE_OK = {"1": {"candidate_steps": [4]}, "3": {"candidate_steps": [2]}, "9": {"candidate_steps": [0]}}
EAGLE_ADAPTIVE = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/h", "speculative_num_steps": 4,
                  "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 5, "speculative_adaptive": True,
                  "speculative_adaptive_config": "adaptive.json"}


def test_sglang_adaptive_config_takes_batch_size_slots_and_shared_knobs():
    assert es.check_sglang_adaptive(ADAPTIVE_OK) == []
    assert es.check_sglang_adaptive({"ema_alpha": 0.3, "strategy": "ema",
                                     "1": {"candidate_steps": [1, 3, 7], "up_hysteresis": 0.1}}) == []
    assert es.check_sglang(EAGLE_ADAPTIVE, ADAPTIVE_OK) == []


@pytest.mark.parametrize("mirror, cfg, key", [
    ("sglang.adaptive_file", [1, 3], "must hold a JSON object"),
    ("sglang.adaptive_file", {"ema_alpha": 0.2}, "at least one integer-string batch-size key"),
    ("sglang.adaptive_file", {"1": {"candidate_steps": []}}, "1: candidate_steps"),
    ("sglang.adaptive_file", {"1": {"candidate_steps": [-1]}}, "1: candidate_steps"),
    ("sglang.adaptive_file", {"1": {"candidate_steps": ["2"]}}, "1: candidate_steps"),
    ("sglang.adaptive_knobs", {"1": {"candidate_steps": [1], "ema": 0.1}}, "meaning: 1.ema"),
    ("sglang.adaptive_knobs", {"warmup": 3, "1": {"candidate_steps": [1]}}, "meaning: warmup"),
    ("sglang.adaptive_knobs", {"strategy": "greedy", "1": {"candidate_steps": [1]}}, "strategy: 'greedy'"),
])
def test_sglang_adaptive_config_refuses_what_its_loader_refuses(mirror, cfg, key):
    assert mirror in es.MIRRORS and es.SGLANG_ADAPTIVE.commit[:12] in es.MIRRORS[mirror]
    got = es.check_sglang_adaptive(cfg)
    assert problems_about(got, key), got


@pytest.mark.parametrize("mirror, edit, key", [
    ("sglang.adaptive_supported", {"speculative_algorithm": "STANDALONE"}, "adapts steps only for EAGLE"),
    ("sglang.adaptive_supported", {"speculative_eagle_topk": 4, "speculative_num_draft_tokens": 9},
     "adapts steps only for EAGLE"),
    ("sglang.adaptive_steps", {"speculative_num_steps": 3, "speculative_num_draft_tokens": 4},
     "not one of the adaptive config's candidate_steps [0, 2, 4]"),
    ("sglang.adaptive_steps", {"speculative_num_draft_tokens": 9}, "sets it to speculative_num_steps + 1"),
    ("sglang.adaptive_file", {"speculative_adaptive_config": None}, "built-in per-batch-size steps"),
    ("sglang.adaptive_file", {"speculative_adaptive": None}, "without speculative_adaptive true"),
])
def test_sglang_server_args_with_the_adaptive_file(mirror, edit, key):
    assert mirror in es.MIRRORS
    args = {k: v for k, v in {**EAGLE_ADAPTIVE, **edit}.items() if v is not None}
    got = es.check_sglang(args, ADAPTIVE_OK)
    assert problems_about(got, key), got


def test_sglang_routes_a_batch_to_its_slot_after_cuda_graph_padding():  # MIRRORS["sglang.adaptive_route"]
    ranges = [(1, 3, 4), (4, 8, 2), (9, 16, 0)]
    cfg = sglang_adaptive_config(ranges)
    assert cfg == {"1": {"candidate_steps": [4]}, "4": {"candidate_steps": [2]}, "9": {"candidate_steps": [0]}}
    assert [es.sglang_steps_at(cfg, b) for b in (1, 3, 4, 8, 9, 100)] == [[4], [4], [2], [2], [0], [0]]
    assert es.sglang_steps_at(cfg, 3, cuda_graph_bs=[1, 2, 4, 8, 16]) == [2]  # 3 padded to 4 runs the next slot
    assert es.sglang_steps_at(cfg, 3, cuda_graph_bs=[1, 2, 3, 4, 8, 16]) == [4]
    snippet = sglang_snippet(ranges, "eagle", draft_path="/h")
    assert snippet["cuda_graph_bs_must_include"] == [3, 8] and snippet["adaptive_config"] == cfg
    assert snippet["server_args"]["speculative_adaptive_config"] == "sglang_adaptive_config.json"
    assert "--speculative-adaptive --speculative-adaptive-config" in snippet["cli"]
    assert sglang_adaptive_config([(1, 2, 3), (3, 4, 3), (5, 8, 1)]) == {"1": {"candidate_steps": [3]},
                                                                         "5": {"candidate_steps": [1]}}


# ---- the exports --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, ranges, why", [
    ("redrafter", [(1, 8, 3)], "redrafter: no engine serves beam drafting"),
    ("ar", [(1, 8, 0)], "off: speculation did not pay"),
    ("draft", [(1, 8, 0)], "off: speculation did not pay"),
])
def test_undeployable_exports_are_refused_by_name(method, ranges, why):
    for make in (vllm_snippet, trtllm_snippet, sglang_snippet):
        with pytest.raises(ExportRefused, match=why):
            make(ranges, method)
    snippets = {k: json.loads(v) for k, v in export_snippets(ranges, method).items()}
    assert all(s["refused"].startswith(why) and s["checked_against"] for s in snippets.values())


def test_trtllm_refuses_a_schedule_whose_longest_draft_is_not_at_batch_size_1():
    with pytest.raises(ExportRefused, match="needs its longest draft at batch size 1"):
        trtllm_snippet([(1, 2, 2), (3, 8, 4)], "draft", draft_path="/d")
    assert es.check_vllm(vllm_snippet([(1, 2, 2), (3, 8, 4)], "draft", draft_path="/d")["speculative_config"],
                         max_num_seqs=8) == []  # vLLM's ranges can say it


def test_the_last_range_holds_up_to_max_num_seqs_in_every_engine():
    ranges = [(1, 4, 3), (5, 16, 1)]
    v = vllm_snippet(ranges, "ngram", (1, 3), max_num_seqs=64)["speculative_config"]
    t = trtllm_snippet(ranges, "ngram", (1, 3), max_num_seqs=64)["speculative_config"]
    assert v["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 64, 1]]
    assert t["draft_len_schedule"] == {"4": 3, "64": 1}
    assert [es.vllm_k_at(v, b) for b in (1, 5, 64)] == [es.trtllm_k_at(t, b) for b in (1, 5, 64)] == [3, 1, 1]


def test_each_method_maps_to_the_engines_names():
    d = {k: json.loads(v) for k, v in export_snippets([(1, 8, 3)], "draft", draft_path="/d").items()}
    assert d["vllm"]["speculative_config"]["method"] == "draft_model"
    assert d["trtllm"]["speculative_config"]["decoding_type"] == "Draft_Target"
    assert d["sglang"]["server_args"]["speculative_algorithm"] == "STANDALONE"
    e = {k: json.loads(v) for k, v in export_snippets([(1, 8, 4)], "eagle", draft_path="/h", tree=(4, 4, 16)).items()}
    assert (e["vllm"]["speculative_config"]["method"], e["vllm"]["speculative_config"]["model"]) == ("eagle", "/h")
    t = e["trtllm"]["speculative_config"]
    assert (t["decoding_type"], t["dynamic_tree_max_topK"], t["max_total_draft_tokens"]) == ("Eagle", 4, 16)
    assert es.sglang_chain(e["sglang"]["server_args"]) == (4, 4, 17)  # steps D, top-k K, N + 1 with the root
    e3 = {k: json.loads(v) for k, v in export_snippets([(1, 8, 3)], "eagle3", draft_path="/h3",
                                                          tree=(3, 2, 6)).items()}
    assert (e3["vllm"]["speculative_config"]["method"], e3["vllm"]["speculative_config"]["model"]) == ("eagle3", "/h3")
    assert e3["trtllm"]["speculative_config"]["decoding_type"] == "Eagle3"
    assert e3["sglang"]["server_args"]["speculative_algorithm"] == "EAGLE3"
    n = json.loads(export_snippets([(1, 8, 4)], "ngram", ngram=(2, 3))["sglang"])["server_args"]
    assert es.sglang_chain(n) == (4, 1, 5)  # the measured chain, not SGLang's default breadth-10 tree


def test_an_eagle_hot_vocabulary_goes_to_sglang_as_its_token_map():  # MIRRORS["sglang.token_map"]
    """SGLang gets --speculative-token-map (the file export-head --hot-vocab writes), tree and chain alike; vLLM and
    TensorRT-LLM have no such setting and their notes say they draft over the whole vocabulary; EAGLE3 and other
    algorithms do not read a token map (a meaning problem)."""
    for tree, ranges in (((4, 4, 16), [(1, 8, 4)]), (None, [(1, 4, 3), (5, 8, 0)])):
        e = {k: json.loads(v) for k, v in export_snippets(ranges, "eagle", draft_path="/h", tree=tree,
                                                          hot_vocab=32768).items()}
        args = e["sglang"]["server_args"]
        assert args["speculative_token_map"] == "/h/hot_tokens_32768.pt"
        assert "--speculative-token-map /h/hot_tokens_32768.pt" in e["sglang"]["cli"]
        assert "zoo export-head --kind eagle --hot-vocab 32768" in e["sglang"]["note"]
        for name in ("vllm", "trtllm"):
            assert "hot vocabulary of 32768 tokens" in e[name]["note"], name
    plain = {k: json.loads(v)
             for k, v in export_snippets([(1, 8, 4)], "eagle", draft_path="/h", tree=(4, 4, 16)).items()}
    assert "speculative_token_map" not in plain["sglang"]["server_args"] and "hot" not in plain["vllm"]["note"]
    e3 = json.loads(export_snippets([(1, 8, 3)], "eagle3", draft_path="/h3", tree=(3, 2, 6), hot_vocab=100)["sglang"])
    assert "speculative_token_map" not in e3["server_args"]  # EAGLE-3's draft vocabulary is its head's
    assert "sglang.token_map" in es.MIRRORS
    got = es.check_sglang({**e3["server_args"], "speculative_token_map": "/x.pt"})
    assert len(got) == 1 and got[0].startswith("meaning:") and "ignores it" in got[0]


def monotone_ranges(rng: random.Random, top: int) -> list[tuple[int, int, int]]:
    """Random contiguous ranges over 1..top with k never growing (0 allowed, at least one k > 0 first)."""
    cuts = sorted(rng.sample(range(1, top), rng.randint(0, min(5, top - 1))))
    ks = sorted((rng.randint(0, 6) for _ in range(len(cuts) + 1)), reverse=True)
    ks[0] = max(ks[0], 1)
    out, lo = [], 1
    for hi, k in zip([*cuts, top], ks):
        out.append((lo, hi, k))
        lo = hi + 1
    return out


def free_ranges(rng: random.Random, top: int) -> list[tuple[int, int, int]]:
    """Random contiguous ranges over 1..top with any k in 0..6 (k may grow with the batch size; at least one k > 0)."""
    cuts = sorted(rng.sample(range(1, top), rng.randint(0, min(5, top - 1))))
    ks = [rng.randint(0, 6) for _ in range(len(cuts) + 1)]
    ks[rng.randrange(len(ks))] = rng.randint(1, 6)
    out, lo = [], 1
    for hi, k in zip([*cuts, top], ks):
        out.append((lo, hi, k))
        lo = hi + 1
    return out


REFUSALS = ("off: ", "redrafter: ", "trtllm: draft_len_schedule needs its longest draft at batch size 1",
            "trtllm: the EAGLE tree's")


def assert_expands_to(snippets: dict[str, dict], ranges, top: int) -> None:
    """Each engine's snippet is accepted by its mirrored check and runs, at every batch size 1..top, the k the ranges
    state (SGLang: the adaptive JSON's slot, with and without CUDA-graph padding over the sizes the snippet names;
    one setting per server otherwise, with the ranges it does not match listed), or is refused by name."""
    want = {b: k for lo, hi, k in normalize(ranges, top) for b in range(lo, hi + 1)}
    for name, snippet in snippets.items():
        if "refused" in snippet:
            assert snippet["refused"].startswith(REFUSALS), (name, snippet)
            assert name == "trtllm" or snippet["refused"].startswith(("off: ", "redrafter: ")), (name, snippet)
            continue
        if name == "vllm":
            cfg = snippet["speculative_config"]
            assert es.check_vllm(cfg, max_num_seqs=top) == []
            assert {b: es.vllm_k_at(cfg, b) for b in want} == want
        elif name == "trtllm":
            cfg = snippet["speculative_config"]
            assert es.check_trtllm(cfg) == []
            assert {b: es.trtllm_k_at(cfg, b) for b in want} == want
        else:
            args, adaptive = snippet["server_args"], snippet["adaptive_config"]
            if "refused" in adaptive:
                assert es.check_sglang(args) == [] and adaptive["refused"].startswith("sglang adaptive: ")
                k = es.sglang_chain(args)[0]
                assert snippet["differs_from_schedule"] == [list(r) for r in normalize(ranges, top) if r[2] != k]
                continue
            assert es.check_sglang(args, adaptive) == [] and snippet["differs_from_schedule"] == []
            graphs = sorted({*snippet["cuda_graph_bs_must_include"], 1, 2, 4, 8, top})
            for sizes in (None, graphs):
                assert {b: es.sglang_steps_at(adaptive, b, sizes) for b in want} == {b: [k] for b, k in want.items()}


@hyp_settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), top=st.integers(1, 256), method=st.sampled_from(["draft", "ngram", "eagle"]),
       monotone=st.booleans())
def test_exports_expand_back_to_the_schedule_at_every_batch_size(seed, top, method, monotone):
    rng = random.Random(seed)
    ranges = monotone_ranges(rng, top) if monotone else free_ranges(rng, top)
    snippets = {"vllm": vllm_snippet(ranges, method, (1, 3), "/d"),  # each maker runs its engine's check
                "sglang": sglang_snippet(ranges, method, (1, 3), "/d")}
    try:
        snippets["trtllm"] = trtllm_snippet(ranges, method, (1, 3), "/d", gate=(30, 0.25))
        assert es.trtllm_gate(snippets["trtllm"]["speculative_config"]) == (30, 0.25)
    except ExportRefused as exc:  # only a schedule whose longest draft is not at batch size 1
        assert not monotone and "longest draft at batch size 1" in str(exc)
        snippets["trtllm"] = {"refused": str(exc)}
    assert_expands_to(snippets, ranges, top)
    assert ("refused" in snippets["sglang"]["adaptive_config"]) == (method != "eagle")  # only EAGLE chains adapt


# ---- exports of a real measured schedule (tiny models, CPU) --------------------------------------------------------
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_exports_of_a_real_loop_calibration_pass_their_checks(target, draft, kind):
    """serve-bench's loop calibration run for real on the tiny models; each shape's schedule is exported as the
    serving page does (max_num_seqs past the largest measured size) and checked: a config the engine accepts that
    expands back to the schedule at every batch size, or a refusal by name."""
    from tests.test_serving_adaptive import engine_with
    from tests.test_serving_calibration import prompts
    from workbench.engine.drafters import DraftModelDrafter
    from workbench.engine.drafters.ngram import NgramDrafter
    from workbench.serving.calibrate import calibrate_loop

    drafter = NgramDrafter(3, 1, 3) if kind == "ngram" else DraftModelDrafter(draft, 3)
    cal = calibrate_loop(engine_with(drafter, target), prompts(), (1, 2, 4), max_new_tokens=4, max_num_seqs=4,
                         budget_s=60.0)
    for shape in ("sticky", "monotone", "free"):
        ranges = cal.schedule(6, shape)
        got = {name: json.loads(text) for name, text in
               export_snippets(ranges, kind, ngram=(1, 3), draft_path="/d", max_num_seqs=6).items()}
        if all(k == 0 for _, _, k in ranges):
            assert all(s["refused"].startswith("off: ") for s in got.values()), got
        assert_expands_to(got, ranges, 6)


# ---- exports of a real batch_schedule study (tiny, CPU) -------------------------------------------------------------
@pytest.fixture(scope="module")
def real_studies(tmp_path_factory):
    """{method: a batch_schedule study of that method run for real on tiny over buckets 1 and 2}: draft, n-gram and
    an EAGLE chain (the preset's trained head), one study each so that every method is measured."""
    import dataclasses

    from results.store import ResultStore
    from studies.objective import ModelSpec
    from studies.scripts import get_script
    from studies.space import IntRange, RunSettings
    from studies.storage import open_storage
    from studies.study import StudySpec, create_or_resume, run_trials
    from workbench.harness.bench import BenchSession

    tmp = tmp_path_factory.mktemp("study")
    script = get_script("batch_schedule")
    session = BenchSession.load(preset="tiny", device="cpu", dtype="float32")
    storage = open_storage(f"sqlite:///{tmp}/s.db")
    out = {}
    for method in ("draft", "ngram", "eagle"):
        space = dataclasses.replace(script.space, methods=(method,), batch=(1, 2), k=IntRange(1, 3), tree_topk=1,
                                    tree_depth=IntRange(2, 3), tree_budget=IntRange(2, 3))
        spec = StudySpec(script=script.name, objective=script.objective, space=space, models=ModelSpec(preset="tiny"),
                         settings=RunSettings(max_new_tokens=8, num_prompts=2, repeats=1, warmup=0))
        study, spec = create_or_resume(storage, f"exports-{method}", spec, target_trials=2)
        run_trials(study, spec, store=ResultStore(tmp / "store"), device="cpu", session_for=lambda dtype: session)
        out[method] = study
    return out


@pytest.mark.parametrize("method", ["draft", "ngram", "eagle"])
def test_every_method_a_real_study_measured_exports_what_it_measured(real_studies, method):
    """The best measured trial of each bucket (whether or not it beat AR, noisy or not) as a schedule up to
    max_num_seqs 8, with the head / draft folder it ran and the acceptance switch-off from the measurements: every
    engine takes it and runs those k at every batch size, or refuses it by name."""
    best = {}
    for t in real_studies[method].trials:
        if t.state.name == "COMPLETE" and t.user_attrs.get("speedup_vs_ar") is not None:
            b = int(t.user_attrs["config"]["batch"])
            if b not in best or t.user_attrs["speedup_vs_ar"] > best[b].user_attrs["speedup_vs_ar"]:
                best[b] = t
    assert best, "the study measured nothing"
    ranges, lo = [], 1
    for b in (1, 2):
        cfg = best[b].user_attrs["config"] if b in best else None
        ranges.append((lo, b, 0 if cfg is None else int(cfg["tree_depth"] if method == "eagle" else cfg["k"])))
        lo = b + 1
    first = best[min(best)]
    cfg = first.user_attrs["config"]
    tree = (cfg["tree_depth"], cfg["tree_topk"], cfg["tree_budget"]) if method == "eagle" else None
    path = first.user_attrs.get("draft_path")
    gate = acceptance_gate([(t.user_attrs["acceptance_rate"], t.user_attrs["mean_accepted_tokens"],
                             t.user_attrs["speedup_vs_ar"]) for t in best.values()])
    ngram = (cfg["ngram_min"], cfg["ngram_max"]) if method == "ngram" else None
    got = {name: json.loads(text) for name, text in
           export_snippets(ranges, method, ngram=ngram, draft_path=path, tree=tree, max_num_seqs=8, gate=gate).items()}
    assert_expands_to(got, ranges, 8)
    if method == "eagle":  # the zoo head the bench loaded, handed to every engine that takes the schedule
        assert path.endswith("tiny/eagle") and "refused" not in got["sglang"]["adaptive_config"]
        assert got["sglang"]["server_args"]["speculative_draft_model_path"] == path
        assert got["vllm"]["speculative_config"]["model"] == path
    if method == "draft":
        assert got["vllm"]["speculative_config"]["model"] == path and path.endswith("tiny/draft")
    if "speculative_config" in got["trtllm"]:
        assert es.trtllm_gate(got["trtllm"]["speculative_config"]) == gate


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_a_real_study_export_writes_checked_files_up_to_the_serving_limit(real_studies, method, tmp_path):
    from studies.schedule import batch_ranges, chosen_method, export_schedule, with_unmeasured_tail

    files = export_schedule(real_studies[method], tmp_path, max_num_seqs=8)
    data = {name: json.loads(path.read_text()) for name, path in files.items()}
    assert data["schedule"]["engines_checked_against"] == es.ENGINE_VERSIONS
    picked = [b for b in data["schedule"]["buckets"] if b["speculate"]]
    if not picked:  # nothing beat AR on this run: every engine is told so by name
        assert all(data[n]["refused"].startswith("off: ") for n in ("vllm", "trtllm", "sglang"))
        return
    method = chosen_method(data["schedule"])
    ranges = with_unmeasured_tail(batch_ranges(data["schedule"], method), 8)
    assert_expands_to({n: data[n] for n in ("vllm", "trtllm", "sglang")}, ranges, 8)
    adaptive = data["sglang"].get("adaptive_config", {})
    assert ("sglang_adaptive" in files) == ("refused" not in adaptive)
    if "sglang_adaptive" in files:
        assert data["sglang_adaptive"] == adaptive and files["sglang_adaptive"].name == \
            data["sglang"]["server_args"]["speculative_adaptive_config"]
    if ranges[-1][1] > data["schedule"]["buckets"][-1]["batch_size"] and "speculative_config" in data["vllm"]:
        assert "were not measured" in data["vllm"]["note"]


def test_study_exports_state_batch_sizes_above_the_largest_bucket_as_off():
    from studies.schedule import with_unmeasured_tail
    from workbench.serving.config import ServeError

    assert with_unmeasured_tail([[1, 2, 4], [3, 8, 2]], 32) == [[1, 2, 4], [3, 8, 2], [9, 32, 0]]
    assert with_unmeasured_tail([[1, 2, 4], [3, 8, 0]], 32) == [[1, 2, 4], [3, 32, 0]]
    assert with_unmeasured_tail([[1, 8, 2]], None) == with_unmeasured_tail([[1, 8, 2]], 8) == [[1, 8, 2]]
    with pytest.raises(ServeError, match="max_num_seqs 4 is below the largest measured bucket 8"):
        with_unmeasured_tail([[1, 8, 2]], 4)


def hand_built_study(rows):
    """A batch_schedule study over buckets (1, 4, 16) from (batch, config, user attrs) rows, without running."""
    import dataclasses

    import optuna

    from studies.objective import ModelSpec
    from studies.scripts import get_script
    from studies.space import RunSettings
    from studies.study import SPEC_KEY, StudySpec

    script = get_script("batch_schedule")
    study = optuna.create_study(direction="maximize")
    spec = StudySpec(script=script.name, objective=script.objective, models=ModelSpec(preset="tiny"),
                     space=dataclasses.replace(script.space, batch=(1, 4, 16)), settings=RunSettings())
    study.set_user_attr(SPEC_KEY, spec.to_dict())
    dist = {"batch": optuna.distributions.CategoricalDistribution((1, 4, 16))}
    for batch, cfg, attrs in rows:
        study.add_trial(optuna.trial.create_trial(
            params={"batch": batch}, distributions=dist, value=attrs["speedup_vs_ar"],
            user_attrs={"config": {"batch": batch, "temperature": 0.0, "dtype": "float32", **cfg}, "feasible": True,
                        **attrs}, constraints={"fidelity": 0.0}))
    return study


def test_a_study_hands_trtllm_the_gate_its_speculating_buckets_measured_and_the_head_it_ran():
    from studies.schedule import build_schedule, sglang_snippet as study_sglang, trtllm_snippet as study_trtllm

    eagle = {"method": "eagle", "k": 4, "tree_depth": 3, "tree_topk": 1, "tree_budget": 3}
    head = "untrained (seed 7)"
    study = hand_built_study([
        (1, eagle, {"speedup_vs_ar": 1.6, "acceptance_rate": 0.7, "mean_accepted_tokens": 3.1, "draft_path": head}),
        (4, eagle, {"speedup_vs_ar": 1.1, "acceptance_rate": 0.66, "mean_accepted_tokens": 2.98, "draft_path": head}),
        (16, eagle, {"speedup_vs_ar": 0.7, "acceptance_rate": 0.6, "mean_accepted_tokens": 2.8, "draft_path": head})])
    schedule = build_schedule(study)
    trt = study_trtllm(schedule)
    cfg = trt["speculative_config"]
    assert cfg["max_concurrency"] == 4 and es.check_trtllm(cfg) == []  # k 3 up to bucket 4, off at 16
    assert es.trtllm_gate(cfg) == acceptance_gate([(0.7, 3.1, 1.6), (0.66, 2.98, 1.1)])  # bucket 16 lost to AR
    # the study ran an untrained head: no folder to hand over, and the note says how to get one
    assert cfg["speculative_model"] == "<path to the EAGLE head>" and "zoo train-head --kind eagle" in trt["note"]
    sg = study_sglang(schedule, max_num_seqs=32, draft_head="/heads/eagle")
    assert sg["server_args"]["speculative_draft_model_path"] == "/heads/eagle"
    assert sg["adaptive_config"] == {"1": {"candidate_steps": [3]}, "5": {"candidate_steps": [0]}}
    assert es.check_sglang(sg["server_args"], sg["adaptive_config"]) == [] and "17..32 were not measured" in sg["note"]


def test_the_serving_page_exports_an_eagle_row_with_its_head_and_tree():
    import ui.serving_view as sv

    row = {"method": "eagle", "k": 4, "max_num_seqs": 8, "k_by_batch": "1-4:1,5-8:0", "tree_depth": 3,
           "tree_topk": 2, "tree_budget": 5, "draft_path": "/zoo/tiny/eagle"}
    got = {name: json.loads(text) for name, text in sv.snippets_for(row).items()}
    trt = got["trtllm"]["speculative_config"]  # a tree's on / off schedule, its draft length the depth
    assert (trt["speculative_model"], trt["max_draft_len"], trt["dynamic_tree_max_topK"],
            trt["max_total_draft_tokens"], trt["max_concurrency"]) == ("/zoo/tiny/eagle", 3, 2, 5, 4)
    assert got["vllm"]["speculative_config"]["model"] == "/zoo/tiny/eagle"
    assert es.sglang_chain(got["sglang"]["server_args"]) == (3, 2, 6)  # steps D, top-k K, budget N + 1
    assert got["sglang"]["adaptive_config"]["refused"].startswith("sglang adaptive: ")
    assert_expands_to(got, [(1, 4, 3), (5, 8, 0)], 8)
    untrained = json.loads(sv.snippets_for({**row, "draft_path": "untrained (seed 7)"})["vllm"])
    assert untrained["speculative_config"]["model"] == "<path to the EAGLE head>"


def test_a_study_won_by_redrafter_hands_over_the_best_served_method_or_refuses_by_name():
    from studies.schedule import build_schedule, trtllm_snippet as study_trtllm, vllm_snippet as study_vllm

    beams = {"method": "redrafter", "k": 4, "beam_width": 2, "beam_length": 4}
    rows = [(1, beams, {"speedup_vs_ar": 1.8}), (4, beams, {"speedup_vs_ar": 1.3}),
            (1, {"method": "draft", "k": 3}, {"speedup_vs_ar": 1.5}), (4, {"method": "draft", "k": 2},
                                                                        {"speedup_vs_ar": 0.9})]
    schedule = build_schedule(hand_built_study(rows))
    assert [e["method"] for e in schedule["buckets"]] == ["redrafter", "redrafter", None]
    v = study_vllm(schedule)
    assert v["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 4, 0], [5, 16, 0]]
    assert "buckets 1, 4 measured best with redrafter, which no engine serves: this is draft's schedule" in v["note"]
    assert es.check_trtllm(study_trtllm(schedule)["speculative_config"]) == []
    only = build_schedule(hand_built_study(rows[:2] + [(1, {"method": "draft", "k": 3}, {"speedup_vs_ar": 0.9})]))
    assert study_vllm(only)["refused"].startswith("redrafter: no engine serves beam drafting")


def test_the_study_cli_states_the_serving_limit_or_names_a_limit_below_the_buckets(tmp_path, capsys):
    from studies.run import main as run_main

    args = ["--preset", "tiny", "--study", "lim", "--script", "batch_schedule", "--trials", "2", "--storage",
            f"sqlite:///{tmp_path}/s.db", "--store", str(tmp_path / "store"), "--batch", "1,2", "--methods", "ngram",
            "--export-dir", str(tmp_path / "out"), "--max-new-tokens", "8", "--num-prompts", "2", "--repeats", "1",
            "--warmup", "0"]
    assert run_main([*args, "--max-num-seqs", "1"]) == 2
    assert "max_num_seqs 1 is below the largest measured bucket 2" in capsys.readouterr().err
    assert run_main([*args, "--max-num-seqs", "16"]) == 0  # resumes the finished study, writes its files
    vllm = json.loads((tmp_path / "out" / "vllm_speculative_config.json").read_text())
    if "speculative_config" in vllm:
        assert vllm["speculative_config"]["num_speculative_tokens_per_batch_size"][-1][1:] == [16, 0]
        assert es.check_vllm(vllm["speculative_config"], max_num_seqs=16) == []
    else:
        assert vllm["refused"].startswith("off: ")
