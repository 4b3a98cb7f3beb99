"""A draft-length schedule by batch size, in the terms each serving engine takes.

The schedule is a list of inclusive ranges [(start_bs, end_bs, k), ...] (what `k_by_batch` reads and what
studies/schedule.py's batch buckets give: bucket b covers (previous bucket, b]). Written from memory of each
engine's documentation; no engine could be checked from this machine (no network), so each snippet names the
version it assumes and the lead should confirm the key names against that version before deploying:

- vLLM (assumed >= 0.11, `--speculative-config` JSON): `num_speculative_tokens_per_batch_size`
  [[start_bs, end_bs, k], ...], inclusive ranges, k = 0 turns speculation off for that range;
  `num_speculative_tokens` is the largest k (the proposer's allocation).
- TensorRT-LLM (assumed 1.1, LLM API `speculative_config.draft_len_schedule`): {batch_size: draft_len} where each key
  is an inclusive *upper* bound: batch sizes up to the key (and above the previous key) use its length; above the
  largest key speculation is off. Our ranges' end_bs become the keys.
- SGLang (assumed 0.5.x): no static per-batch-size schedule; the snippet gives the server args for the smallest
  batch range's k (`speculative_num_steps` = k, `speculative_eagle_topk` 1, `speculative_num_draft_tokens` k + 1)
  and lists the per-range values as a note for an adaptive setting.
"""
from __future__ import annotations

import json

VLLM_VERSION = "vllm >= 0.11 (assumed; key num_speculative_tokens_per_batch_size not checked online)"
TRTLLM_VERSION = "tensorrt_llm 1.1 (assumed; draft_len_schedule keys = inclusive upper batch-size bounds; not " \
                 "checked online)"
SGLANG_VERSION = "sglang 0.5.x (assumed; no static per-batch-size schedule there; not checked online)"


def _method_fields(method: str, ngram: tuple[int, int] | None, draft_path: str | None) -> dict:
    if method == "ngram":
        lo, hi = ngram or (1, 3)
        return {"method": "ngram", "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    if method == "draft":
        return {"method": "draft_model", "model": draft_path or "<path to draft model>"}
    return {"method": method}


def vllm_snippet(ranges, method: str, ngram=None, draft_path=None) -> dict:
    k_max = max((k for _, _, k in ranges), default=0)
    return {"engine_version": VLLM_VERSION,
            "speculative_config": {**_method_fields(method, ngram, draft_path), "num_speculative_tokens": k_max,
                                   "num_speculative_tokens_per_batch_size": [list(r) for r in ranges]},
            "note": "inclusive batch-size ranges; k = 0: no speculation in that range. "
                    "vllm serve MODEL --speculative-config '<speculative_config as JSON>'"}


def trtllm_snippet(ranges, method: str, ngram=None, draft_path=None) -> dict:
    schedule = {str(hi): k for _, hi, k in ranges}
    cfg = {"max_draft_len": max(schedule.values(), default=0), "draft_len_schedule": schedule}
    if method == "ngram":
        cfg = {"decoding_type": "NGram", "max_matching_ngram_size": (ngram or (1, 3))[1], **cfg}
    elif method == "draft":
        cfg = {"decoding_type": "DraftTarget", "speculative_model": draft_path or "<path to draft model>", **cfg}
    gaps = [lo for (lo, _, _), (_, prev_hi, _) in zip(ranges[1:], ranges) if lo != prev_hi + 1]
    note = ("keys are inclusive upper bounds: a batch size uses the smallest key >= it; above the largest key "
            "speculation is off")
    if ranges and ranges[0][0] != 1 or gaps:
        note += "; our ranges have gaps, which upper-bound keys fill with the next range's length"
    return {"engine_version": TRTLLM_VERSION, "speculative_config": cfg, "note": note}


def sglang_snippet(ranges, method: str, ngram=None, draft_path=None) -> dict:
    on = [r for r in ranges if r[2] > 0]
    if not on:
        return {"engine_version": SGLANG_VERSION, "server_args": None,
                "note": "speculation off at every measured batch size: leave speculative_algorithm unset"}
    k = on[0][2]
    args = {"speculative_algorithm": {"draft": "STANDALONE", "ngram": "NGRAM"}.get(method, method.upper()),
            "speculative_num_steps": k, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1}
    if method == "draft":
        args["speculative_draft_model_path"] = draft_path or "<path to draft model>"
    return {"engine_version": SGLANG_VERSION, "server_args": args,
            "cli": " ".join(f"--{a.replace('_', '-')} {v}" for a, v in args.items()),
            "per_batch_size": [list(r) for r in ranges],
            "note": "one setting per server: the smallest batch range's k; per_batch_size lists the measured "
                    "schedule for an adaptive deployment"}


def export_snippets(ranges, method: str, ngram=None, draft_path=None) -> dict[str, str]:
    """{"vllm" | "trtllm" | "sglang": JSON text} for a schedule [(start_bs, end_bs, k), ...]."""
    ranges = [tuple(int(x) for x in r) for r in ranges]
    return {name: json.dumps(make(ranges, method, ngram, draft_path), indent=2)
            for name, make in (("vllm", vllm_snippet), ("trtllm", trtllm_snippet), ("sglang", sglang_snippet))}
