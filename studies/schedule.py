"""Batch-size schedule: the best speculation setting per batch-size bucket, and the serving-engine configs it implies.

A bucket `b` covers batch sizes (previous bucket, b]. For each bucket the best reliable feasible trial (highest
speedup over autoregressive decoding measured in the same run) is chosen; a bucket whose best speedup is <= 1 (or
whose best method is autoregressive) is "off": speculation loses there. Trials whose run was noisy or implausible
are skipped and listed under "excluded" (`studies.objective.exclusion_notes`).

Exports (`export_schedule`): `schedule.json` (per bucket the winning drafter's shape, and the engine sources the
snippets were checked against) plus one snippet per engine, built by `workbench.serving.exports` from the
winning method's per-bucket draft lengths and checked by its engine's mirrored validator
(`workbench.serving.engine_schemas`), or {"refused": why} where that engine cannot say the schedule:
  - vLLM: `speculative_config.num_speculative_tokens_per_batch_size` [[start_bs, end_bs, k], ...], every range
    stated up to the serving limit (`max_num_seqs`; above the largest measured bucket: k = 0, not measured);
  - TensorRT-LLM: `speculative_config.draft_len_schedule` {end_bs: k} (above the largest key: off), or
    `max_concurrency` for one k then off, plus `acceptance_rate_window_size` / `acceptance_rate_threshold` from
    the measured acceptance-vs-speedup break-even (`workbench.serving.exports.acceptance_gate`);
  - SGLang: an EAGLE chain's schedule as the adaptive JSON (`sglang_adaptive_config.json`, one slot per range);
    other methods one setting per server (`speculative_num_steps` / `speculative_eagle_topk` /
    `speculative_num_draft_tokens`), with the measured ranges it does not match.
Draft and EAGLE exports carry the draft model's / head's folder the winning trials ran (`draft_head` overrides
it; an untrained head has no folder to hand over, so its exports keep a placeholder and say so).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import optuna

from studies.objective import exclusion_notes, reliable_complete
from studies.storage import SPEC_KEY
from workbench.serving.engine_schemas import ENGINE_VERSIONS

SCHEDULE_VERSION = 2  # 2: per-bucket drafter shape, engines_checked_against
MEASURED = ("acceptance_rate", "mean_accepted_tokens", "draft_path")  # per method and bucket: the gate's inputs


def _config(t: optuna.trial.FrozenTrial) -> dict[str, Any]:
    return t.user_attrs.get("config") or dict(t.params)


def _speedup(t: optuna.trial.FrozenTrial) -> float:
    v = t.user_attrs.get("speedup_vs_ar")
    return float(v) if v is not None else float("-inf")


def buckets_of(study: optuna.Study) -> list[int]:
    batch = study.user_attrs[SPEC_KEY]["space"]["batch"]
    values = batch["choices"] if isinstance(batch, dict) and "choices" in batch else [batch]
    return sorted(int(b) for b in values)


def _draft_len(c: dict[str, Any]) -> int:
    """Draft tokens per step as the engines count them: the tree depth for eagle, k otherwise."""
    return int(c["tree_depth"]) if c.get("method") in ("eagle", "eagle3") and c.get("tree_depth") else int(c["k"])


def _entry(batch: int, t: optuna.trial.FrozenTrial | None, n: int) -> dict[str, Any]:
    if t is None:
        return {"batch_size": batch, "trials": n, "speculate": None, "method": None, "draft_len": None,
                "note": "no reliable feasible completed trial in this bucket"}
    c = _config(t)
    on = c["method"] != "ar" and _speedup(t) > 1.0
    return {"batch_size": batch, "trials": n, "speculate": on, "method": c["method"] if on else "ar",
            "draft_len": _draft_len(c) if on else 0, "shape": _shape(c) if on else None,
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
                per_method[m][b] = (_speedup(t), _config(t), {k: t.user_attrs.get(k) for k in MEASURED})
    spec = study.user_attrs[SPEC_KEY]
    return {"schedule_version": SCHEDULE_VERSION, "study": study.study_name, "models": spec["models"],
            "settings": spec["settings"], "objective": "speedup_vs_ar (same prompts, same process)",
            "bucket_semantics": "bucket b covers batch sizes (previous bucket, b]",
            "buckets": entries, "excluded": exclusion_notes(study),
            "per_method": {m: {str(b): {"speedup_vs_ar": s, **_shape(c), "k": _draft_len(c), **measured}
                               for b, (s, c, measured) in sorted(v.items())} for m, v in per_method.items()},
            "engines_checked_against": dict(ENGINE_VERSIONS)}


def _head_path(per: dict[int, dict[str, Any]], draft_head: str | None) -> tuple[str | None, str | None]:
    """(the EAGLE head folder to hand over, a note when there is none): draft_head if given, else the folder the
    winning trials ran; an untrained head (the bench's "untrained (seed N)") has none."""
    if draft_head:
        return str(draft_head), None
    ran = sorted({str(v["draft_path"]) for v in per.values() if v["k"] > 0 and v.get("draft_path")})
    real = [p for p in ran if not p.startswith("untrained")]
    if len(real) == 1 and len(ran) == 1:
        return real[0], None
    if real:
        return None, f"the speculating buckets ran different heads ({', '.join(ran)}): give draft_head"
    return None, ("the study ran an untrained EAGLE head (" + (", ".join(ran) or "no head recorded") + "): train one "
                  "(python -m workbench zoo train-head --kind eagle) and give its folder as draft_head")


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


UNSERVED = frozenset({"redrafter"})  # methods no serving engine runs (beam drafting)


def chosen_method(schedule: dict[str, Any]) -> str | None:
    """The speculative method the engine snippets hand over: of those an engine serves, the one that wins the most
    buckets (ties: the one winning the smallest batch); where only an unserved method (redrafter) wins, the served
    method that beats AR in the most buckets; that unserved method where none does (its snippets are refused by
    name); None when no bucket speculates."""
    wins = [e["method"] for e in schedule["buckets"] if e.get("speculate")]
    if not wins:
        return None
    served = [m for m in wins if m not in UNSERVED]
    if served:
        counts = Counter(served)
        return max(counts, key=lambda m: (counts[m], -served.index(m)))
    paying = {m: [int(b) for b, v in table.items() if v["speedup_vs_ar"] > 1.0]
              for m, table in schedule["per_method"].items() if m not in UNSERVED}
    paying = {m: bs for m, bs in paying.items() if bs}
    if paying:
        return max(paying, key=lambda m: (len(paying[m]), -min(paying[m])))
    return wins[0]


def _method_schedule(schedule: dict[str, Any], method: str) -> dict[int, dict[str, Any]]:
    """Per bucket: that method's best k and n-gram sizes, k = 0 where it does not beat autoregressive decoding."""
    out = {}
    table = schedule["per_method"].get(method, {})
    for e in schedule["buckets"]:
        best = table.get(str(e["batch_size"]))
        on = best is not None and best["speedup_vs_ar"] > 1.0
        out[e["batch_size"]] = {**(best if on else {}), "k": int(best["k"]) if on else 0}
    return out


def _shape(c: dict[str, Any]) -> dict[str, Any]:
    """The drafter shape of a trial's config: method, k and the method's own knobs (n-gram sizes, tree, beams)."""
    keys = {"ngram": ("ngram_min", "ngram_max"), "eagle": ("tree_depth", "tree_topk", "tree_budget", "hot_vocab"),
            "eagle3": ("tree_depth", "tree_topk", "tree_budget", "eagle3_layers"),
            "redrafter": ("beam_width", "beam_length", "hot_vocab")}.get(c.get("method"), ())
    return {"method": c.get("method"), "k": c.get("k"), **{k: c.get(k) for k in keys}}


def _method_ranges(schedule: dict[str, Any]) -> tuple[str, list[list[int]], dict[str, Any]] | None:
    """(method, its inclusive ranges, the shape of its first speculating bucket) for the method that wins the most
    buckets; None when no bucket speculates."""
    method = chosen_method(schedule)
    if method is None:
        return None
    per = _method_schedule(schedule, method)
    first = next(v for _, v in sorted(per.items()) if v["k"] > 0)
    return method, batch_ranges(schedule, method), first


def measured_gate(schedule: dict[str, Any], method: str) -> tuple[int, float] | None:
    """TensorRT-LLM's acceptance switch-off from the method's measured buckets that speculate
    (`workbench.serving.exports.acceptance_gate`); None where the study recorded no acceptance."""
    from workbench.serving.exports import acceptance_gate

    return acceptance_gate([(v.get("acceptance_rate"), v.get("mean_accepted_tokens"), v.get("speedup_vs_ar"))
                            for v in _method_schedule(schedule, method).values() if v["k"] > 0])


def with_unmeasured_tail(ranges: list[list[int]], max_num_seqs: int | None) -> list[list[int]]:
    """The ranges stated up to the serving limit: above the largest measured bucket speculation is off (k = 0), since
    nothing was measured there. ServeError when max_num_seqs is below the largest bucket (its k would be cut)."""
    from workbench.serving.config import ServeError

    last = ranges[-1][1]
    if max_num_seqs is None or max_num_seqs == last:
        return ranges
    if max_num_seqs < last:
        raise ServeError(f"max_num_seqs {max_num_seqs} is below the largest measured bucket {last}: give at least "
                         f"{last}, or study smaller buckets")
    if ranges[-1][2] == 0:
        return [*ranges[:-1], [ranges[-1][0], int(max_num_seqs), 0]]
    return [*ranges, [last + 1, int(max_num_seqs), 0]]


def _engine_snippet(schedule: dict[str, Any], name: str, max_num_seqs: int | None = None,
                    draft_head: str | None = None) -> dict[str, Any]:
    """The checked snippet of one engine (`workbench.serving.exports`), or {"refused": why}. max_num_seqs: the
    serving limit every range is stated up to (default: the largest measured bucket); draft_head: the EAGLE head
    folder to hand over (default: the one the winning trials ran)."""
    from workbench.serving import exports

    largest = max(e["batch_size"] for e in schedule["buckets"])
    with_unmeasured_tail([[1, largest, 0]], max_num_seqs)  # a limit below the buckets is an error, even when off
    picked = _method_ranges(schedule)
    if picked is None:
        return {"refused": "off: speculation did not beat autoregressive decoding at any measured batch size; leave "
                           "speculative_config unset", "checked_against": exports.es.ENGINE_VERSIONS[name]}
    method, measured, first = picked
    ranges = with_unmeasured_tail(measured, max_num_seqs)
    ngram = (first.get("ngram_min") or 1, first.get("ngram_max") or 1) if method == "ngram" else None
    tree = ((first["tree_depth"], first["tree_topk"], first["tree_budget"])
            if method in ("eagle", "eagle3") and first.get("tree_depth") else None)
    path, path_note = (_head_path(_method_schedule(schedule, method), draft_head) if method in ("eagle", "eagle3")
                       else (_draft_path(schedule["models"]) if method == "draft" else None, None))
    make = dict(exports.MAKERS)[name]
    hot = int(first.get("hot_vocab") or 0) if method == "eagle" else 0
    extra = {"gate": measured_gate(schedule, method)} if name == "trtllm" else {"hot_vocab": hot} \
        if name == "sglang" else {}
    try:
        out = make(ranges, method, ngram, path, tree, None, **extra)
    except exports.ExportRefused as exc:
        return {"refused": str(exc), "checked_against": exports.es.ENGINE_VERSIONS[name]}
    out["note"] += exports.hot_vocab_note(name, method, hot)
    if path_note:
        out["note"] += f"; head path: {path_note}"
    unserved = [e["batch_size"] for e in schedule["buckets"] if e.get("speculate") and e["method"] in UNSERVED]
    if unserved and method not in UNSERVED:
        out["note"] += (f"; buckets {', '.join(map(str, unserved))} measured best with "
                        f"{'/'.join(sorted({e['method'] for e in schedule['buckets'] if e['method'] in UNSERVED}))}, "
                        f"which no engine serves: this is {method}'s schedule there (k = 0 where it lost to AR)")
    if max_num_seqs is not None and max_num_seqs > measured[-1][1]:
        out["note"] += (f"; batch sizes {measured[-1][1] + 1}..{max_num_seqs} were not measured (largest bucket "
                        f"{measured[-1][1]}): speculation is off there")
    if ngram is not None:  # one n-gram window per server: say where other buckets measured best with another
        other = {b: (v.get("ngram_min"), v.get("ngram_max")) for b, v in _method_schedule(schedule, method).items()
                 if v["k"] > 0 and (v.get("ngram_min") or 1, v.get("ngram_max") or 1) != ngram}
        if other:
            out["note"] += (f"; n-gram sizes {ngram[0]}..{ngram[1]} are the first speculating bucket's; buckets "
                            + ", ".join(f"{b}: {lo}..{hi}" for b, (lo, hi) in sorted(other.items()))
                            + " measured best with other sizes")
    return out


def trtllm_snippet(schedule: dict[str, Any], max_num_seqs: int | None = None,
                   draft_head: str | None = None) -> dict[str, Any]:
    out = _engine_snippet(schedule, "trtllm", max_num_seqs, draft_head)
    if "speculative_config" in out:
        out["note"] += ("; LLM API: LLM(model, speculative_config=...), or put it in extra_llm_api_options (JSON is "
                        "valid YAML)")
    return out


def vllm_snippet(schedule: dict[str, Any], max_num_seqs: int | None = None,
                 draft_head: str | None = None) -> dict[str, Any]:
    return _engine_snippet(schedule, "vllm", max_num_seqs, draft_head)


def sglang_snippet(schedule: dict[str, Any], max_num_seqs: int | None = None,
                   draft_head: str | None = None) -> dict[str, Any]:
    return _engine_snippet(schedule, "sglang", max_num_seqs, draft_head)


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


SNIPPET_FILES = {"vllm_speculative_config.json": vllm_snippet, "sglang_server_args.json": sglang_snippet,
                 "trtllm_speculative_config.json": trtllm_snippet}


def export_schedule(study: optuna.Study, out_dir: str | Path, max_num_seqs: int | None = None,
                    draft_head: str | None = None) -> dict[str, Path]:
    """Write schedule.json and the three engine snippets under out_dir (plus SGLang's adaptive JSON where its
    snippet has one, under the name its server args give); return {name: path}. max_num_seqs: the serving limit
    the snippets state every batch size up to; draft_head: the EAGLE head folder to hand over."""
    from workbench.serving.exports import SGLANG_ADAPTIVE_FILE

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schedule = build_schedule(study)
    written = {"schedule": out / "schedule.json"}
    written["schedule"].write_text(json.dumps(schedule, indent=2, default=str) + "\n")
    for name, make in SNIPPET_FILES.items():
        path = out / name
        snippet = make(schedule, max_num_seqs, draft_head)
        path.write_text(json.dumps(snippet, indent=2, default=str) + "\n")
        written[name.split("_")[0]] = path
        adaptive = snippet.get("adaptive_config")
        if isinstance(adaptive, dict) and "refused" not in adaptive:
            written["sglang_adaptive"] = out / SGLANG_ADAPTIVE_FILE
            written["sglang_adaptive"].write_text(json.dumps(adaptive, indent=2) + "\n")
    return written
