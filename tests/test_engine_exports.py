"""The mirrored engine checks (workbench.serving.engine_schemas) and the exports that must pass them.

Each case names the MIRRORS entry it restates: the engine, the commit and the validator in the source file it was read
from. Positive cases are configs the engine's own validators take; negative ones are the refusals they raise.
"""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings as hyp_settings, strategies as st

from tests.test_engine import draft, target  # noqa: F401 (fixtures)
from workbench.serving import engine_schemas as es
from workbench.serving.exports import ExportRefused, export_snippets, sglang_snippet, trtllm_snippet, vllm_snippet


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


@hyp_settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), top=st.integers(1, 256), method=st.sampled_from(["draft", "ngram"]))
def test_exports_expand_back_to_the_schedule_at_every_batch_size(seed, top, method):
    ranges = monotone_ranges(random.Random(seed), top)
    want = {b: k for lo, hi, k in ranges for b in range(lo, hi + 1)}
    v = vllm_snippet(ranges, method, (1, 3), "/d")["speculative_config"]  # each maker runs its engine's check
    t = trtllm_snippet(ranges, method, (1, 3), "/d")["speculative_config"]
    assert {b: es.vllm_k_at(v, b) for b in want} == want
    assert {b: es.trtllm_k_at(t, b) for b in want} == want
    s = sglang_snippet(ranges, method, (1, 3), "/d")
    assert s["differs_from_schedule"] == [list(r) for r in ranges if r[2] != ranges[0][2]]


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
        want = {b: k for lo, hi, k in ranges for b in range(lo, hi + 1)}
        got = {name: json.loads(text) for name, text in
               export_snippets(ranges, kind, ngram=(1, 3), draft_path="/d", max_num_seqs=6).items()}
        for name, snippet in got.items():
            if "refused" in snippet:
                off = all(k == 0 for k in want.values())
                assert snippet["refused"].startswith("off: ") if off else (
                    name == "trtllm" and "longest draft at batch size 1" in snippet["refused"]), (shape, snippet)
                continue
            if name == "vllm":
                assert es.check_vllm(snippet["speculative_config"], max_num_seqs=6) == []
                assert {b: es.vllm_k_at(snippet["speculative_config"], b) for b in want} == want
            elif name == "trtllm":
                assert es.check_trtllm(snippet["speculative_config"]) == []
                assert {b: es.trtllm_k_at(snippet["speculative_config"], b) for b in want} == want
            else:
                assert es.check_sglang(snippet["server_args"]) == []
                k = es.sglang_chain(snippet["server_args"])[0]
                assert snippet["differs_from_schedule"] == [list(r) for r in ranges if r[2] != k]
