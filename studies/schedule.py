"""Batch-size schedule: the best speculation setting per batch-size bucket, and the serving-engine configs it implies.

A bucket `b` covers batch sizes (previous bucket, b]. For each bucket the best reliable feasible trial (highest
speedup over autoregressive decoding measured in the same run) is chosen; a bucket whose best speedup is <= 1 (or
whose best method is autoregressive) is "off": speculation loses there. Trials whose run was noisy or implausible
are skipped and listed under "excluded" (`studies.objective.exclusion_notes`).

Exports (`export_schedule`): `schedule.json` plus config snippets in the shape each engine takes:
  - TensorRT-LLM: `speculative_config.draft_len_schedule` {batch_size: draft_len} (batch sizes up to the key use that
    length; above the largest key speculation is off), with `max_draft_len`;
  - vLLM: `speculative_config` (`num_speculative_tokens`, n-gram `prompt_lookup_min/max`) per bucket, and one to
    deploy with `disable_by_batch_size` where speculation stops paying;
  - SGLang: server args `speculative_num_steps` / `speculative_eagle_topk` / `speculative_num_draft_tokens` per
    bucket (a chain of k tokens: k steps, top-k 1, k + 1 draft tokens including the root).
vLLM and SGLang take one setting per server: their snippets name the per-bucket values and a recommended one.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import optuna

from studies.objective import exclusion_notes, reliable_complete
from studies.storage import SPEC_KEY

SCHEDULE_VERSION = 1


def _config(t: optuna.trial.FrozenTrial) -> dict[str, Any]:
    return t.user_attrs.get("config") or dict(t.params)


def _speedup(t: optuna.trial.FrozenTrial) -> float:
    v = t.user_attrs.get("speedup_vs_ar")
    return float(v) if v is not None else float("-inf")


def buckets_of(study: optuna.Study) -> list[int]:
    batch = study.user_attrs[SPEC_KEY]["space"]["batch"]
    values = batch["choices"] if isinstance(batch, dict) and "choices" in batch else [batch]
    return sorted(int(b) for b in values)


def _entry(batch: int, t: optuna.trial.FrozenTrial | None, n: int) -> dict[str, Any]:
    if t is None:
        return {"batch_size": batch, "trials": n, "speculate": None, "method": None, "draft_len": None,
                "note": "no reliable feasible completed trial in this bucket"}
    c = _config(t)
    on = c["method"] != "ar" and _speedup(t) > 1.0
    return {"batch_size": batch, "trials": n, "speculate": on, "method": c["method"] if on else "ar",
            "draft_len": int(c["k"]) if on else 0,
            "ngram_min": int(c["ngram_min"]) if on and c["method"] == "ngram" else None,
            "ngram_max": int(c["ngram_max"]) if on and c["method"] == "ngram" else None,
            "speedup_vs_ar": t.user_attrs.get("speedup_vs_ar"), "tokens_per_s": t.user_attrs.get("tokens_per_s"),
            "acceptance_rate": t.user_attrs.get("acceptance_rate"), "trial": t.number,
            "best_setting": {k: c.get(k) for k in ("method", "k", "ngram_min", "ngram_max", "temperature", "dtype")}}


def build_schedule(study: optuna.Study) -> dict[str, Any]:
    """Best feasible setting per batch bucket, plus per-method best draft length (for single-method engines)."""
    trials = reliable_complete(study)
    buckets = buckets_of(study)
    entries, per_method = [], {}
    for b in buckets:
        in_bucket = [t for t in trials if int(_config(t).get("batch", -1)) == b]
        best = max(in_bucket, key=_speedup, default=None)
        entries.append(_entry(b, best, len(in_bucket)))
        for t in in_bucket:
            m = _config(t)["method"]
            if m != "ar" and _speedup(t) > per_method.setdefault(m, {}).get(b, (float("-inf"),))[0]:
                per_method[m][b] = (_speedup(t), _config(t))
    spec = study.user_attrs[SPEC_KEY]
    return {"schedule_version": SCHEDULE_VERSION, "study": study.study_name, "models": spec["models"],
            "settings": spec["settings"], "objective": "speedup_vs_ar (same prompts, same process)",
            "bucket_semantics": "bucket b covers batch sizes (previous bucket, b]",
            "buckets": entries, "excluded": exclusion_notes(study),
            "per_method": {m: {str(b): {"speedup_vs_ar": s, "k": c["k"], "ngram_min": c.get("ngram_min"),
                                        "ngram_max": c.get("ngram_max")} for b, (s, c) in sorted(v.items())}
                           for m, v in per_method.items()}}


def _draft_path(models: dict[str, Any]) -> str:
    if models.get("draft"):
        return str(models["draft"])
    if models.get("preset"):
        try:
            from workbench.zoo import resolve_preset

            return str(resolve_preset(models["preset"]).draft_dir)
        except Exception:  # noqa: BLE001 - the snippet stays usable with a placeholder
            pass
    return "<path to draft model>"


def _chosen_method(schedule: dict[str, Any]) -> str | None:
    """The speculative method that wins the most buckets (ties: the one winning the smallest batch)."""
    wins = [e["method"] for e in schedule["buckets"] if e.get("speculate")]
    if not wins:
        return None
    counts = Counter(wins)
    return max(counts, key=lambda m: (counts[m], -wins.index(m)))


def _method_schedule(schedule: dict[str, Any], method: str) -> dict[int, dict[str, Any]]:
    """Per bucket: that method's best k and n-gram sizes, k = 0 where it does not beat autoregressive decoding."""
    out = {}
    table = schedule["per_method"].get(method, {})
    for e in schedule["buckets"]:
        best = table.get(str(e["batch_size"]))
        on = best is not None and best["speedup_vs_ar"] > 1.0
        out[e["batch_size"]] = {"k": int(best["k"]) if on else 0, **({"ngram_min": best["ngram_min"],
                                                                         "ngram_max": best["ngram_max"]} if on else {})}
    return out


def trtllm_snippet(schedule: dict[str, Any]) -> dict[str, Any]:
    method = _chosen_method(schedule)
    if method is None:
        return {"note": "speculation did not beat autoregressive decoding at any measured batch size: leave "
                        "speculative_config unset"}
    per = _method_schedule(schedule, method)
    lengths = {b: v["k"] for b, v in sorted(per.items())}
    while lengths and list(lengths.values())[-1] == 0:  # above the largest key TensorRT-LLM turns speculation off
        lengths.popitem()
    cfg: dict[str, Any] = {"max_draft_len": max(lengths.values(), default=0),
                           "draft_len_schedule": {str(b): k for b, k in lengths.items()}}
    if method == "draft":
        cfg = {"decoding_type": "DraftTarget", "speculative_model": _draft_path(schedule["models"]), **cfg}
    elif method == "ngram":
        ngram_max = max((v.get("ngram_max") or 0) for v in per.values()) or 2
        cfg = {"decoding_type": "NGram", "max_matching_ngram_size": ngram_max, **cfg}
    else:
        cfg = {"decoding_type": method, **cfg}
    return {"speculative_config": cfg,
            "note": "LLM API: LLM(model, speculative_config=...); or put this in extra_llm_api_options (JSON is "
                    "valid YAML). Batch sizes up to each key use its draft length; above the largest key: off."}


def _vllm_config(method: str, k: int, entry: dict[str, Any], models: dict[str, Any]) -> dict[str, Any]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": entry.get("ngram_min") or 1,
                "prompt_lookup_max": entry.get("ngram_max") or 1}
    if method == "draft":
        return {"method": "draft_model", "model": _draft_path(models), "num_speculative_tokens": k}
    return {"method": method, "num_speculative_tokens": k}


def vllm_snippet(schedule: dict[str, Any]) -> dict[str, Any]:
    per_bucket = {str(e["batch_size"]): (_vllm_config(e["method"], e["draft_len"], e, schedule["models"])
                                         if e.get("speculate") else None) for e in schedule["buckets"]}
    on = [e for e in schedule["buckets"] if e.get("speculate")]
    if not on:
        return {"per_batch_size": per_bucket, "speculative_config": None,
                "note": "speculation did not pay at any measured batch size: leave speculative_config unset"}
    first = on[0]
    recommended = _vllm_config(first["method"], first["draft_len"], first, schedule["models"])
    ranges = batch_ranges(schedule, first["method"])
    if ranges:  # vLLM's per-batch-size key (workbench/serving/exports.py says which version it assumes)
        recommended["num_speculative_tokens"] = max(k for _, _, k in ranges)
        recommended["num_speculative_tokens_per_batch_size"] = ranges
    off_after = [e["batch_size"] for e in schedule["buckets"] if e.get("speculate") is False
                 and e["batch_size"] > first["batch_size"]]
    if off_after:
        recommended["disable_by_batch_size"] = off_after[0]
    return {"speculative_config": recommended, "per_batch_size": per_bucket,
            "note": "vLLM takes one num_speculative_tokens per server: speculative_config is the smallest batch "
                    "bucket's best setting (null entries: speculation off). --speculative-config '<json>'"}


def batch_ranges(schedule: dict[str, Any], method: str) -> list[list[int]]:
    """The method's best k per bucket as inclusive ranges [[start_bs, end_bs, k], ...] (bucket b covers
    (previous bucket, b]); `python -m workbench serve-bench --k-by-batch` reads the same ranges as text."""
    per, out, lo = _method_schedule(schedule, method), [], 1
    for b in sorted(per):
        out.append([lo, b, int(per[b]["k"])])
        lo = b + 1
    return out


def k_by_batch_text(ranges: list[list[int]]) -> str:
    """[[1, 2, 4], [3, 8, 0]] -> '1-2:4,3-8:0' (the serve-bench --k-by-batch form)."""
    return ",".join(f"{lo}-{hi}:{k}" for lo, hi, k in ranges)


def _sglang_args(e: dict[str, Any], models: dict[str, Any]) -> dict[str, Any]:
    k = int(e["draft_len"])
    args: dict[str, Any] = {"speculative_algorithm": {"draft": "STANDALONE", "ngram": "NGRAM"}.get(e["method"],
                                                                                                    e["method"].upper()),
                            "speculative_num_steps": k, "speculative_eagle_topk": 1,
                            "speculative_num_draft_tokens": k + 1}
    if e["method"] == "draft":
        args["speculative_draft_model_path"] = _draft_path(models)
    return args


def sglang_snippet(schedule: dict[str, Any]) -> dict[str, Any]:
    per_bucket = {str(e["batch_size"]): (_sglang_args(e, schedule["models"]) if e.get("speculate") else None)
                  for e in schedule["buckets"]}
    on = [e for e in schedule["buckets"] if e.get("speculate")]
    recommended = _sglang_args(on[0], schedule["models"]) if on else None
    cli = (" ".join(f"--{k.replace('_', '-')} {v}" for k, v in recommended.items()) if recommended else "")
    return {"server_args": recommended, "cli": cli, "per_batch_size": per_bucket,
            "note": "a chain of k draft tokens: num_steps k, eagle_topk 1, num_draft_tokens k + 1 (root included); "
                    "one setting per server: server_args is the smallest batch bucket's best"}


SNIPPET_FILES = {"vllm_speculative_config.json": vllm_snippet, "sglang_server_args.json": sglang_snippet,
                 "trtllm_speculative_config.json": trtllm_snippet}


def export_schedule(study: optuna.Study, out_dir: str | Path) -> dict[str, Path]:
    """Write schedule.json and the three engine snippets under out_dir; return {name: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schedule = build_schedule(study)
    written = {"schedule": out / "schedule.json"}
    written["schedule"].write_text(json.dumps(schedule, indent=2, default=str) + "\n")
    for name, make in SNIPPET_FILES.items():
        path = out / name
        path.write_text(json.dumps(make(schedule), indent=2, default=str) + "\n")
        written[name.split("_")[0]] = path
    return written
