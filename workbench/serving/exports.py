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
  draft is not at batch size 1 cannot be said and is refused. One k then off is said as `max_concurrency` (the
  switch-off batch size); given the measured break-even (`acceptance_gate`), `acceptance_rate_window_size` /
  `acceptance_rate_threshold` switch speculation off for good when the served acceptance falls below it.
- SGLang (server args): EAGLE chains carry the whole schedule in the adaptive JSON (`adaptive_config`, the file
  `--speculative-adaptive-config` names): one slot per range, keyed by its first batch size, with the measured k as
  its only candidate step, so no slot moves at runtime. Other methods and trees get one setting for every batch size
  (SGLang adapts only EAGLE chains) and the snippet says which measured ranges it does not match.
"""
from __future__ import annotations

import json
import math

from workbench.serving import engine_schemas as es
from workbench.serving.config import ServeError


class ExportRefused(ServeError):
    """A schedule that an engine's config cannot say; the message names why and what to deploy instead."""


class ExportError(ServeError):
    """An export failed its engine's mirrored check (a workbench bug: the message lists the problems)."""


DRAFT_PLACEHOLDER = "<path to draft model>"
HEAD_PLACEHOLDER = "<path to the EAGLE head>"
SGLANG_ADAPTIVE_FILE = "sglang_adaptive_config.json"  # written beside the SGLang snippet; its server args name it
# one-sided normal tail of ~1e-6: the acceptance switch-off is permanent, and a rolling window is tested every step
GATE_Z = 4.75


def break_even_acceptance(acceptance: float, mean_tokens: float, speedup: float) -> float:
    """The acceptance rate (accepted / drafted) at which a step of the measured cost emits just AR's tokens per unit
    of time: a step drafts d = (mean_tokens - 1) / acceptance tokens and costs mean_tokens / speedup AR steps, so it
    breaks even at 1 + d * a = mean_tokens / speedup, i.e. a = (mean_tokens / speedup - 1) / d (clipped to [0, 1])."""
    drafted = (mean_tokens - 1.0) / acceptance
    return min(1.0, max(0.0, (mean_tokens / speedup - 1.0) / drafted))


def acceptance_gate(points) -> tuple[int, float] | None:
    """(acceptance_rate_window_size, acceptance_rate_threshold) from the chosen method's measured buckets where it
    speculates, each (acceptance rate, mean tokens per step with the bonus, speedup over AR); None without a usable
    point (nothing accepted, or no speedup > 1).

    Threshold: the smallest break-even acceptance over those buckets (`break_even_acceptance`): below it every
    batch size the schedule speculates at runs slower than AR, so a permanent switch-off loses nothing there.
    Window: the fewest iterations whose mean acceptance, at the lowest measured acceptance a, stays above the
    threshold t by GATE_Z standard deviations: ceil(GATE_Z^2 * a(1 - a) / (a - t)^2), a(1 - a) bounding the variance
    of any per-iteration rate in [0, 1] with mean a."""
    usable = [(float(a), float(m), float(s)) for a, m, s in points
              if a is not None and m is not None and s is not None and a > 0 and m > 1 and s > 1]
    if not usable:
        return None
    threshold = math.floor(min(break_even_acceptance(*p) for p in usable) * 1e4) / 1e4  # rounded down: never higher
    low = min(a for a, _, _ in usable)
    window = max(1, math.ceil(GATE_Z ** 2 * low * (1 - low) / (low - threshold) ** 2))
    return window, threshold


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


HEAD_NOTE = ("the EAGLE head path is the folder the run loaded, saved in the workbench's own layout, which the "
             "engines' EAGLE loaders were not checked against")


def _checked(problems: list[str], engine: str, snippet: dict) -> dict:
    if problems:
        raise ExportError(f"{engine} export failed its mirrored check: " + "; ".join(problems))
    cfg = snippet.get("speculative_config") or snippet.get("server_args") or {}
    if cfg.get("method") == "eagle" or cfg.get("decoding_type") == "Eagle" or \
            cfg.get("speculative_algorithm") == "EAGLE":
        snippet["note"] += "; " + HEAD_NOTE
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


def trtllm_snippet(ranges, method: str, ngram=None, draft_path=None, tree=None, max_num_seqs=None,
                   gate: tuple[int, float] | None = None) -> dict:
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
    cfg: dict = {"max_draft_len": first}
    if any(k != first for _, _, k in kept):
        cfg["draft_len_schedule"] = {str(hi): k for _, hi, k in kept}
    elif len(kept) < len(ranges):  # one k, then off: the switch-off batch size is max_concurrency
        cfg["max_concurrency"] = kept[-1][1]
    if method == "ngram":
        cfg = {"decoding_type": "NGram", "max_matching_ngram_size": int((ngram or (1, 3))[1]), **cfg}
    elif method == "draft":
        cfg = {"decoding_type": "Draft_Target", "speculative_model": draft_path or DRAFT_PLACEHOLDER, **cfg}
    elif method in ("eagle", "eagle3"):
        cfg = {"decoding_type": "Eagle" if method == "eagle" else "Eagle3",
               "speculative_model": draft_path or HEAD_PLACEHOLDER, **cfg}
        if tree and int(tree[1]) > 1:  # top-k 1 is a chain: TensorRT-LLM's linear EAGLE of max_draft_len
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
    if "draft_len_schedule" in cfg:
        note = ("draft_len_schedule keys are inclusive upper bounds: a batch size uses the smallest key >= it; above "
                "the largest key speculation is off")
    elif "max_concurrency" in cfg:
        note = f"max_draft_len {first} up to max_concurrency {cfg['max_concurrency']}; above it speculation is off"
    else:
        note = f"max_draft_len {first} at every batch size up to {ranges[-1][1]}"
    if gate is not None and not cfg.get("use_dynamic_tree"):
        window, threshold = gate
        cfg.update(acceptance_rate_window_size=int(window), acceptance_rate_threshold=float(threshold))
        note += (f"; speculation switches off for good once the mean acceptance (accepted / drafted) of the last "
                 f"{window} speculating iterations falls below {threshold}, where the measured speedup would drop "
                 f"below 1 at every speculating batch size")
    elif gate is not None:
        note += ("; no acceptance switch-off for a tree: the workbench's tree acceptance was not checked against "
                 "TensorRT-LLM's count of drafted tokens")
    return _checked(es.check_trtllm(cfg), "TensorRT-LLM",
                    {"checked_against": es.ENGINE_VERSIONS["trtllm"], "speculative_config": cfg, "note": note})


def sglang_adaptive_config(ranges) -> dict:
    """SGLang's adaptive JSON for inclusive ranges: a slot per range of equal k, keyed by its first batch size, whose
    only candidate step is that k (0: no drafting), so each batch size runs its measured k whatever the acceptance."""
    out: dict = {}
    for lo, _, k in ranges:
        if not out or list(out.values())[-1]["candidate_steps"] != [k]:
            out[str(lo)] = {"candidate_steps": [int(k)]}
    return out


def token_map_file(hot_vocab: int) -> str:
    """The file `zoo export-head --hot-vocab N` writes beside the exported head: SGLang's --speculative-token-map."""
    return f"hot_tokens_{int(hot_vocab)}.pt"


def _token_map(args: dict, method: str, draft_path, hot_vocab: int) -> str:
    """Adds SGLang's FR-Spec token map for an EAGLE-2 run with a hot vocabulary; returns the note it needs."""
    if not hot_vocab or method != "eagle":
        return ""
    args["speculative_token_map"] = f"{draft_path or HEAD_PLACEHOLDER}/{token_map_file(hot_vocab)}"
    return (f"; speculative_token_map: the head's {hot_vocab} most frequent token ids (the run's hot_vocab, FR-Spec), "
            f"written beside the exported head by python -m workbench zoo export-head --kind eagle --hot-vocab "
            f"{hot_vocab}")


def sglang_snippet(ranges, method: str, ngram=None, draft_path=None, tree=None, max_num_seqs=None,
                   hot_vocab: int = 0) -> dict:
    ranges = normalize(ranges, max_num_seqs)
    if (why := refusal(ranges, method)) is not None:
        raise ExportRefused(why)
    k = next(k for _, _, k in ranges if k > 0)
    if method == "eagle" and (not tree or int(tree[1]) == 1):
        return _sglang_adaptive_snippet(ranges, k, draft_path, hot_vocab)
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
    note = (f"one setting per server: k = {k} at every batch size (SGLang adapts its steps by batch size only for "
            f"EAGLE chains); num_draft_tokens counts the root") + _token_map(args, method, draft_path, hot_vocab)
    if differs:
        note += "; the measured schedule differs in the ranges listed under differs_from_schedule"
    return _checked(es.check_sglang(args), "SGLang",
                    {"checked_against": es.ENGINE_VERSIONS["sglang"], "server_args": args, "cli": _cli(args),
                     "adaptive_config": {"refused": f"sglang adaptive: SGLang adapts steps only for EAGLE / EAGLE3 "
                                                    f"chains (top-k 1), not {args['speculative_algorithm']} with "
                                                    f"top-k {args.get('speculative_eagle_topk')}"},
                     "per_batch_size": [list(r) for r in ranges], "differs_from_schedule": differs, "note": note})


def _cli(args: dict) -> str:
    return " ".join(f"--{a.replace('_', '-')}" if v is True else f"--{a.replace('_', '-')} {v}"
                    for a, v in args.items())


def _sglang_adaptive_snippet(ranges, k: int, draft_path, hot_vocab: int = 0) -> dict:
    adaptive = sglang_adaptive_config(ranges)
    args = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": draft_path or HEAD_PLACEHOLDER,
            "speculative_num_steps": k, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1,
            "speculative_adaptive": True, "speculative_adaptive_config": SGLANG_ADAPTIVE_FILE}
    graph_sizes = [hi for _, hi, _ in ranges[:-1]]
    differs = [[lo, hi, k_r] for lo, hi, k_r in ranges
               if any(es.sglang_steps_at(adaptive, b) != [k_r] for b in range(lo, hi + 1))]
    note = (f"per batch size through the adaptive JSON ({SGLANG_ADAPTIVE_FILE}, under adaptive_config): a slot per "
            f"range keyed by its first batch size, one candidate step each (0: no drafting), so no slot moves; "
            f"SGLang pads a batch to its next CUDA-graph size before picking a slot, so the range ends "
            f"{graph_sizes} must be CUDA-graph batch sizes of the server (or graphs off)")
    note += _token_map(args, "eagle", draft_path, hot_vocab)
    return _checked(es.check_sglang(args, adaptive), "SGLang",
                    {"checked_against": es.ENGINE_VERSIONS["sglang"], "server_args": args, "cli": _cli(args),
                     "adaptive_config": adaptive, "cuda_graph_bs_must_include": graph_sizes,
                     "per_batch_size": [list(r) for r in ranges], "differs_from_schedule": differs, "note": note})


MAKERS = (("vllm", vllm_snippet), ("trtllm", trtllm_snippet), ("sglang", sglang_snippet))
ENGINE_NAMES = {"vllm": "vLLM", "trtllm": "TensorRT-LLM", "sglang": "SGLang"}


def hot_vocab_note(name: str, method: str, hot_vocab: int) -> str:
    """What vLLM's and TensorRT-LLM's notes say about an EAGLE-2 run's hot vocabulary (SGLang gets its token map)."""
    if not hot_vocab or method != "eagle" or name == "sglang":
        return ""
    return (f"; the run drafted from a hot vocabulary of {hot_vocab} tokens (FR-Spec), which {ENGINE_NAMES[name]} "
            f"has no setting for: it drafts over the whole vocabulary, so its draft step reads more of the LM head "
            f"than the measured one")


def export_snippets(ranges, method: str, ngram=None, draft_path=None, tree=None, max_num_seqs=None,
                    gate: tuple[int, float] | None = None, hot_vocab: int = 0) -> dict[str, str]:
    """{"vllm" | "trtllm" | "sglang": JSON text} for a schedule [(start_bs, end_bs, k), ...]: each the checked
    snippet, or {"refused": why} where that engine cannot be handed this schedule. gate: TensorRT-LLM's acceptance
    switch-off (`acceptance_gate`), where the run measured it; hot_vocab: the EAGLE-2 run's hot vocabulary (SGLang
    gets its token map; vLLM and TensorRT-LLM have no such setting, and their notes say so)."""
    out = {}
    for name, make in MAKERS:
        try:
            extra = {"gate": gate} if name == "trtllm" else {"hot_vocab": hot_vocab} if name == "sglang" else {}
            obj = make(ranges, method, ngram, draft_path, tree, max_num_seqs, **extra)
            obj["note"] += hot_vocab_note(name, method, hot_vocab)
        except ExportRefused as exc:
            obj = {"refused": str(exc), "checked_against": es.ENGINE_VERSIONS[name]}
        out[name] = json.dumps(obj, indent=2)
    return out
