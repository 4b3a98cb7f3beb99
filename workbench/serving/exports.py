"""A draft-length schedule by batch size, in the terms each serving engine takes, checked before it is handed over.

The schedule is a list of inclusive ranges [(start_bs, end_bs, k), ...] starting at 1, in order, without gaps (what
`k_by_batch` reads, what studies/schedule.py's batch buckets give); the last range's k holds up to max_num_seqs
when that is larger. Every snippet is checked by its engine's mirrored validator (`engine_schemas`) before it is
returned, and names the source it was checked against; a hand-over that no engine config can say is refused by
name (`ExportRefused`):

- vLLM (`--speculative-config` JSON): `num_speculative_tokens_per_batch_size` [[start_bs, end_bs, k], ...]
  (inclusive, k = 0 off), `num_speculative_tokens` the largest k; every range stated up to max_num_seqs.
- TensorRT-LLM (`speculative_config`): `draft_len_schedule` {end_bs: k}: a batch size uses the smallest key >= it,
  above the largest key speculation is off. The smallest key must carry max_draft_len, so a schedule whose longest
  draft is not at batch size 1 cannot be said and is refused.
- SGLang (server args): one setting for every batch size (no per-batch-size key in its server args); the snippet
  says which measured ranges it does not match.
"""
from __future__ import annotations

import json

from workbench.serving import engine_schemas as es
from workbench.serving.config import ServeError


class ExportRefused(ServeError):
    """A schedule that an engine's config cannot say; the message names why and what to deploy instead."""


class ExportError(ServeError):
    """An export failed its engine's mirrored check (a workbench bug: the message lists the problems)."""


DRAFT_PLACEHOLDER = "<path to draft model>"
HEAD_PLACEHOLDER = "<path to the EAGLE head>"


def normalize(ranges, max_num_seqs: int | None = None) -> list[tuple[int, int, int]]:
    """Ranges as int triples from 1 up to max(last end, max_num_seqs), the last range's k holding to the end.
    Raises ServeError naming the first range out of order, with a gap, or with a negative k."""
    out = [tuple(int(x) for x in r) for r in ranges]
    if not out:
        raise ServeError("empty schedule: give at least one range (start_bs, end_bs, k)")
    expect = 1
    for lo, hi, k in out:
        if lo != expect or hi < lo or k < 0:
            raise ServeError(f"schedule range {(lo, hi, k)}: ranges must start at 1, follow each other without gaps "
                             f"(this one should start at {expect}), end at or after their start, and have k >= 0")
        expect = hi + 1
    if max_num_seqs is not None and max_num_seqs > out[-1][1]:
        out[-1] = (out[-1][0], int(max_num_seqs), out[-1][2])
    return out


def refusal(ranges, method: str) -> str | None:
    """Why no engine can be handed this schedule (None when one can)."""
    if method == "redrafter":
        return "redrafter: no engine serves beam drafting (ReDrafter); deploy a draft, ngram or eagle schedule"
    if method == "ar" or all(k == 0 for _, _, k in ranges):
        return "off: speculation did not pay at any batch size; leave speculative_config unset"
    return None


def _checked(problems: list[str], engine: str, snippet: dict) -> dict:
    if problems:
        raise ExportError(f"{engine} export failed its mirrored check: " + "; ".join(problems))
    return snippet


def vllm_snippet(ranges, method: str, ngram=None, draft_path=None, tree=None, max_num_seqs=None) -> dict:
    ranges = normalize(ranges, max_num_seqs)
    if (why := refusal(ranges, method)) is not None:
        raise ExportRefused(why)
    k_max = max(k for _, _, k in ranges)
    if method == "ngram":
        lo, hi = ngram or (1, 3)
        fields = {"method": "ngram", "prompt_lookup_min": int(lo), "prompt_lookup_max": int(hi)}
    elif method == "draft":
        fields = {"method": "draft_model", "model": draft_path or DRAFT_PLACEHOLDER}
    elif method in ("eagle", "eagle3"):
        fields = {"method": method, "model": draft_path or HEAD_PLACEHOLDER}
    else:
        raise ExportRefused(f"{method}: no vLLM speculative method for this workbench method")
    cfg = {**fields, "num_speculative_tokens": k_max,
           "num_speculative_tokens_per_batch_size": [list(r) for r in ranges]}
    note = "inclusive batch-size ranges up to max_num_seqs; k = 0: no speculation in that range. " \
           "vllm serve MODEL --max-num-seqs %d --speculative-config '<speculative_config as JSON>'" % ranges[-1][1]
    if method in ("eagle", "eagle3") and tree:
        note += f"; vLLM drafts an EAGLE chain of k here: the measured tree (depth {tree[0]}, top-k {tree[1]}, " \
                f"budget {tree[2]}) has no key in vLLM's SpeculativeConfig"
    return _checked(es.check_vllm(cfg, max_num_seqs=ranges[-1][1]), "vLLM",
                    {"checked_against": es.ENGINE_VERSIONS["vllm"], "speculative_config": cfg, "note": note})


def trtllm_snippet(ranges, method: str, ngram=None, draft_path=None, tree=None, max_num_seqs=None) -> dict:
    ranges = normalize(ranges, max_num_seqs)
    if (why := refusal(ranges, method)) is not None:
        raise ExportRefused(why)
    first = ranges[0][2]
    longer = [r for r in ranges if r[2] > first]
    if longer:
        lo, hi, k = longer[0]
        raise ExportRefused(f"trtllm: draft_len_schedule needs its longest draft at batch size 1 (its smallest key "
                            f"carries max_draft_len); this schedule drafts {first} at 1..{ranges[0][1]} but {k} at "
                            f"{lo}..{hi}: use a monotone schedule (calibration_shape monotone or sticky)")
    kept = list(ranges)
    while kept and kept[-1][2] == 0:  # above the largest key TensorRT-LLM turns speculation off by itself
        kept.pop()
    schedule = {str(hi): k for _, hi, k in kept}
    cfg: dict = {"max_draft_len": first, "draft_len_schedule": schedule}
    if method == "ngram":
        cfg = {"decoding_type": "NGram", "max_matching_ngram_size": int((ngram or (1, 3))[1]), **cfg}
    elif method == "draft":
        cfg = {"decoding_type": "Draft_Target", "speculative_model": draft_path or DRAFT_PLACEHOLDER, **cfg}
    elif method in ("eagle", "eagle3"):
        cfg = {"decoding_type": "Eagle" if method == "eagle" else "Eagle3",
               "speculative_model": draft_path or HEAD_PLACEHOLDER, **cfg}
        if tree:
            depth, topk, budget = (int(x) for x in tree)
            if not depth <= budget <= topk * depth:
                raise ExportRefused(f"trtllm: the EAGLE tree's budget {budget} is outside what TensorRT-LLM's dynamic "
                                    f"tree holds (depth {depth} .. top-k x depth {topk * depth})")
            if depth != first:
                raise ExportRefused(f"trtllm: the EAGLE tree's depth {depth} differs from the schedule's draft "
                                    f"length {first} at batch size 1")
            cfg.update(use_dynamic_tree=True, dynamic_tree_max_topK=topk, max_total_draft_tokens=budget)
    else:
        raise ExportRefused(f"{method}: no TensorRT-LLM decoding_type for this workbench method")
    note = ("keys are inclusive upper bounds: a batch size uses the smallest key >= it; above the largest key "
            "speculation is off")
    return _checked(es.check_trtllm(cfg), "TensorRT-LLM",
                    {"checked_against": es.ENGINE_VERSIONS["trtllm"], "speculative_config": cfg, "note": note})


def sglang_snippet(ranges, method: str, ngram=None, draft_path=None, tree=None, max_num_seqs=None) -> dict:
    ranges = normalize(ranges, max_num_seqs)
    if (why := refusal(ranges, method)) is not None:
        raise ExportRefused(why)
    k = next(k for _, _, k in ranges if k > 0)
    if method == "ngram":
        lo, hi = ngram or (1, 3)
        # breadth 1 keeps the measured chain: SGLang sets speculative_eagle_topk from the bfs breadth for NGRAM
        args = {"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1,
                "speculative_ngram_max_bfs_breadth": 1, "speculative_ngram_min_match_window_size": int(lo),
                "speculative_ngram_max_match_window_size": int(hi)}
    elif method == "draft":
        args = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": draft_path or DRAFT_PLACEHOLDER,
                "speculative_num_steps": k, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1}
    elif method in ("eagle", "eagle3"):
        depth, topk, budget = (int(x) for x in tree) if tree else (k, 1, k)
        args = {"speculative_algorithm": "EAGLE" if method == "eagle" else "EAGLE3", "speculative_draft_model_path": draft_path or HEAD_PLACEHOLDER,
                "speculative_num_steps": depth, "speculative_eagle_topk": topk,
                "speculative_num_draft_tokens": budget + 1 if topk > 1 else depth + 1}
    else:
        raise ExportRefused(f"{method}: no SGLang speculative_algorithm for this workbench method")
    differs = [list(r) for r in ranges if r[2] != k]
    note = (f"one setting per server: k = {k} at every batch size (SGLang's server args have no per-batch-size "
            f"key); num_draft_tokens counts the root")
    if differs:
        note += "; the measured schedule differs in the ranges listed under differs_from_schedule"
    return _checked(es.check_sglang(args), "SGLang",
                    {"checked_against": es.ENGINE_VERSIONS["sglang"], "server_args": args,
                     "cli": " ".join(f"--{a.replace('_', '-')} {v}" for a, v in args.items()),
                     "per_batch_size": [list(r) for r in ranges], "differs_from_schedule": differs, "note": note})


MAKERS = (("vllm", vllm_snippet), ("trtllm", trtllm_snippet), ("sglang", sglang_snippet))


def export_snippets(ranges, method: str, ngram=None, draft_path=None, tree=None, max_num_seqs=None) -> dict[str, str]:
    """{"vllm" | "trtllm" | "sglang": JSON text} for a schedule [(start_bs, end_bs, k), ...]: each the checked
    snippet, or {"refused": why} where that engine cannot be handed this schedule."""
    out = {}
    for name, make in MAKERS:
        try:
            obj = make(ranges, method, ngram, draft_path, tree, max_num_seqs)
        except ExportRefused as exc:
            obj = {"refused": str(exc), "checked_against": es.ENGINE_VERSIONS[name]}
        out[name] = json.dumps(obj, indent=2)
    return out
