"""Mirrored config checks of the serving engines the workbench exports to (vLLM, TensorRT-LLM, SGLang).

The engines cannot be installed here (no GPU in CI, wheels too large), so each check restates in our own words the
fields and validators of one engine's speculative-decoding config, read from that engine's source at the commit named
in its `Source`; each rule names where it was read (`MIRRORS`). A check takes the config an export hands over and
returns its problems, each naming the key and what the engine accepts; an empty list means the engine would accept it.

A second kind of rule is ours, not the engine's: a hand-over that the engine would take but that would not mean
what was measured (an n-gram chain that SGLang turns into a breadth-10 tree, a batch range that leaves sizes to an
unstated default). Those problems start with "meaning:" so a reader can tell them from the engine's own refusals.

    check_vllm(speculative_config)       vllm serve --speculative-config JSON
    check_trtllm(speculative_config)     LLM(..., speculative_config=...) / extra_llm_api_options
    check_sglang(server_args, adaptive)  sglang.launch_server --speculative-* arguments (+ the adaptive JSON file)
    check_sglang_adaptive(adaptive)      the JSON file --speculative-adaptive-config names
    trtllm_k_at(cfg, b), vllm_k_at(cfg, b), sglang_chain(args), sglang_steps_at(adaptive, b)
                                         what each engine runs at batch size b
    trtllm_gate(cfg)                     TensorRT-LLM's acceptance switch-off: (window, threshold) or None
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Source:
    """Where a mirrored rule was read: engine, repository, commit and file (the index gave no commit for the
    SGLang snapshot that was read: `commit` says so)."""
    engine: str
    repo: str
    commit: str
    path: str

    def at(self, anchor: str) -> str:
        return f"{self.engine} {self.repo}@{self.commit} {self.path}: {anchor}"


VLLM = Source("vLLM", "vllm-project/vllm", "002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443", "vllm/config/speculative.py")
TRTLLM = Source("TensorRT-LLM", "NVIDIA/TensorRT-LLM", "0004396720054fd8e205cbf616f21f0b57c6b412",
                "tensorrt_llm/llmapi/llm_args.py")
SGLANG = Source("SGLang", "sgl-project/sglang", "unreported (stored snapshot 8356329, 177122 chars)",
                "python/sglang/srt/server_args.py")
SGLANG_ADAPTIVE = Source("SGLang", "sgl-project/sglang", "015c872628e328b530880bcf95ae91222604b225",
                         "python/sglang/srt/speculative/adaptive_spec_params.py")
SGLANG_ROUTER = Source("SGLang", "sgl-project/sglang", "a12239f6ac74d804d169ee5d3cfed3c49fa7162c",
                       "python/sglang/srt/speculative/adaptive_step_router.py")
SGLANG_EAGLE = Source("SGLang", "sgl-project/sglang", "unreported (stored snapshot)",
                      "python/sglang/srt/speculative/eagle_worker.py")
SGLANG_HOOK = Source("SGLang", "sgl-project/sglang", "004c82e07d876f6e4a0ad6e15325706b0f478f1a",
                     "python/sglang/srt/arg_groups/speculative_hook.py")

ENGINE_VERSIONS = {  # what schedule.json and each snippet name as "checked against"
    "vllm": f"{VLLM.repo}@{VLLM.commit[:12]} ({VLLM.path})",
    "trtllm": f"{TRTLLM.repo}@{TRTLLM.commit[:12]} ({TRTLLM.path})",
    "sglang": f"{SGLANG.repo} snapshot with _handle_speculative_decoding NGRAM override ({SGLANG.path}); "
              f"adaptive config @{SGLANG_ADAPTIVE.commit[:12]} ({SGLANG_ADAPTIVE.path})",
}

# ---- vLLM ------------------------------------------------------------------------------------------------------
VLLM_METHODS = frozenset({  # SpeculativeMethod literal (the MTP model types fold into "mtp" in __post_init__)
    "ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle", "eagle3",
    "extract_hidden_states", "mtp", "dflash", "ngram_gpu", "dspark"})
VLLM_FIELDS = frozenset({  # SpeculativeConfig's user fields; @config forbids any other key
    "enforce_eager", "num_speculative_tokens", "model", "method", "draft_tensor_parallel_size", "tensor_parallel_size",
    "quantization", "moe_backend", "attention_backend", "kv_cache_dtype", "max_model_len", "revision",
    "code_revision", "index_share_for_mtp_iteration", "disable_padded_drafter_batch", "disable_eagle_block_drop",
    "use_local_argmax_reduction", "use_heterogeneous_vocab", "prompt_lookup_max", "prompt_lookup_min",
    "parallel_drafting", "num_speculative_tokens_per_batch_size", "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
    "draft_load_config", "rejection_sample_method", "synthetic_acceptance_rates", "synthetic_acceptance_length",
    "enable_adaptive_verification", "draft_sample_method", "dspark_draft_topk"})
VLLM_MODEL_METHODS = frozenset({"draft_model", "eagle", "eagle3", "medusa", "mlp_speculator"})  # no model: refused

MIRRORS: dict[str, str] = {
    "vllm.fields": VLLM.at("class SpeculativeConfig field list under @config (extra keys refused)"),
    "vllm.method": VLLM.at("SpeculativeMethod = Literal[...] / EagleModelTypes / MTPModelTypes"),
    "vllm.num_speculative_tokens": VLLM.at("num_speculative_tokens: int = Field(gt=0); _verify_args: "
                                           "'Expected num_speculative_tokens to be greater than zero'"),
    "vllm.model": VLLM.at("__post_init__: 'num_speculative_tokens was provided but without speculative model'"),
    "vllm.prompt_lookup": VLLM.at("prompt_lookup_min/max Field(ge=1); __post_init__: "
                                  "'prompt_lookup_min=... must be <= prompt_lookup_max'"),
    "vllm.per_batch_size": VLLM.at("num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None "
                                   "(inclusive (range_start, range_end, k))"),
    "trtllm.strict": TRTLLM.at("class DecodingBaseConfig(StrictBaseModel) (extra keys refused)"),
    "trtllm.decoding_type": TRTLLM.at("decoding_type: Literal[...] of each *DecodingConfig subclass"),
    "trtllm.max_draft_len": TRTLLM.at("max_draft_len: Optional[NonNegativeInt]; validate_ngram_config / "
                                      "validate_draft_target_config / validate_eagle_config: 'must be > 0'"),
    "trtllm.speculative_model": TRTLLM.at("validate_draft_target_config / EagleDecodingConfig."
                                          "validate_speculative_model: speculative_model required"),
    "trtllm.draft_len_schedule": TRTLLM.at("DecodingBaseConfig.validate_draft_len_schedule_and_sort (keys >= 1, "
                                           "lengths >= 0, smallest key == max_draft_len, all <= max_draft_len); "
                                           "field description: a batch size uses the smallest key >= it, above "
                                           "the largest key 0"),
    "trtllm.max_concurrency": TRTLLM.at("max_concurrency: Optional[PositiveInt]; validate_max_concurrency_and_"
                                        "draft_len_schedule_mutually_exclusive"),
    "trtllm.acceptance": TRTLLM.at("DecodingBaseConfig.acceptance_rate_window_size: Optional[NonNegativeInt] "
                                   "(unset or 0: feature off); acceptance_rate_threshold: Optional[float] = "
                                   "Field(ge=0.0, le=1.0)"),
    "trtllm.acceptance_gate": TRTLLM.at("acceptance_rate_threshold description: speculation is disabled "
                                        "permanently once the rolling mean of the true acceptance rate "
                                        "(accepted_draft_tokens / drafted_tokens) over the last "
                                        "acceptance_rate_window_size speculation-enabled iterations drops below it"),
    "trtllm.max_concurrency_translation": TRTLLM.at("validate_max_concurrency_and_draft_len_schedule_mutually_"
                                                    "exclusive: max_concurrency alone becomes draft_len_schedule "
                                                    "{max_concurrency: max_draft_len} (off above it)"),
    "trtllm.ngram": TRTLLM.at("NGramDecodingConfig.max_matching_ngram_size: PositiveInt"),
    "trtllm.eagle_tree": TRTLLM.at("EagleDecodingConfig.validate_eagle_config dynamic tree: dynamic_tree_max_topK "
                                   "> 0, max_draft_len <= max_total_draft_tokens <= topK * max_draft_len"),
    "sglang.algorithm": SGLANG.at("_handle_speculative_decoding: NEXTN -> EAGLE; EAGLE/EAGLE3/STANDALONE; NGRAM"),
    "sglang.eagle_params": SGLANG.at("_handle_speculative_decoding: num_steps None => topk and num_draft_tokens "
                                     "None (assert); topk == 1 => num_draft_tokens reset to num_steps + 1"),
    "sglang.ngram_breadth": SGLANG.at("_handle_speculative_decoding NGRAM: speculative_eagle_topk = "
                                      "speculative_ngram_max_bfs_breadth (default 10); num_draft_tokens unset = "
                                      "speculative_ngram_max_match_window_size (default 12)"),
    "sglang.token_map": SGLANG_EAGLE.at("EAGLEWorker: hot token ids from speculative_token_map (torch.load of the "
                                        "ids) for EAGLE; EAGLE3 warns and ignores it (its head has its own); other "
                                        "algorithms do not read it"),
    "sglang.adaptive_file": SGLANG_ADAPTIVE.at("_load_adaptive_config: a JSON object; integer-string keys are "
                                               "batch-size slots, each with candidate_steps a non-empty list of "
                                               "ints >= 0; at least one slot; other top-level keys are shared "
                                               "defaults merged under each slot"),
    "sglang.adaptive_knobs": SGLANG_ADAPTIVE.at("AdaptiveStepSlot.__init__: ema_alpha 0.2, update_interval 5, "
                                                "warmup_batches 10, down_hysteresis -0.25, up_hysteresis 0.0, "
                                                "ceiling_coeff 0 (read with .get: other keys are ignored); "
                                                "resolve_adaptive_strategy: strategy 'ema' | 'throughput_aware'"),
    "sglang.adaptive_supported": SGLANG_ADAPTIVE.at("adaptive_unsupported_reason: only EAGLE / EAGLE3, "
                                                    "speculative_eagle_topk unset or 1 (else SGLang warns and "
                                                    "serves the static settings)"),
    "sglang.adaptive_steps": SGLANG_HOOK.at("_init_adaptive_speculative_params: speculative_num_steps must be "
                                            "one of the slots' candidate_steps (ValueError); unset = the middle "
                                            "one; speculative_num_draft_tokens = steps + 1"),
    "sglang.adaptive_route": SGLANG_ROUTER.at("batch_size_key_for_batch: pad the batch size to the next CUDA-graph "
                                              "size, then the largest slot key <= it (the smallest key below "
                                              "all); a one-candidate slot never moves (AdaptiveStepSlot."
                                              "_recompute_params)"),
}

# ---- TensorRT-LLM ----------------------------------------------------------------------------------------------
TRTLLM_BASE_FIELDS = frozenset({
    "decoding_type", "max_draft_len", "max_total_draft_tokens", "speculative_model", "speculative_model_dir",
    "max_concurrency", "draft_len_schedule", "load_format", "acceptance_rate_window_size", "acceptance_rate_threshold",
    "use_rejection_sampling", "allow_advanced_sampling", "advanced_sampling_mode", "enable_penalty"})
TRTLLM_TYPE_FIELDS = {  # decoding_type tag -> the fields its subclass adds
    "Draft_Target": frozenset(),
    "NGram": frozenset({"max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool"}),
    "Eagle": frozenset({"eagle_choices", "greedy_sampling", "posterior_threshold", "use_dynamic_tree",
                        "dynamic_tree_max_topK", "num_eagle_layers", "max_non_leaves_per_layer", "eagle3_one_model",
                        "eagle3_layers_to_capture", "eagle3_model_arch"}),
    "MTP": frozenset({"use_relaxed_acceptance_for_thinking", "relaxed_topk", "relaxed_delta", "use_mtp_vanilla",
                      "mtp_eagle_one_model", "sa_config", "begin_thinking_phase_token", "end_thinking_phase_token"}),
    "Medusa": frozenset({"medusa_choices", "num_medusa_heads"}),
    "SA": frozenset({"max_matching_ngram_size", "enable_global_pool", "global_pool_size"}),
}
TRTLLM_TYPE_FIELDS["Eagle3"] = TRTLLM_TYPE_FIELDS["Eagle"] | {"sa_config"}
TRTLLM_NEEDS_MODEL = frozenset({"Draft_Target", "Eagle", "Eagle3"})
TRTLLM_NEEDS_DRAFT_LEN = frozenset({"Draft_Target", "NGram", "Eagle", "Eagle3", "SA"})

# ---- SGLang ----------------------------------------------------------------------------------------------------
SGLANG_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"})
SGLANG_NGRAM_MAX_BFS_BREADTH_DEFAULT = 10
SGLANG_NGRAM_MAX_MATCH_WINDOW_DEFAULT = 12  # NGRAM's num_draft_tokens when unset
SGLANG_ADAPTIVE_ALGORITHMS = frozenset({"EAGLE", "EAGLE3"})
SGLANG_ADAPTIVE_KNOBS = {"ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10, "down_hysteresis": -0.25,
                         "up_hysteresis": 0.0, "ceiling_coeff": 0}  # each slot's defaults
SGLANG_ADAPTIVE_STRATEGIES = frozenset({"ema", "throughput_aware"})


def _int(v: Any) -> int | None:
    """An int the engines' pydantic / argparse would take (bools are not counts), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    return None


def check_vllm(cfg: dict[str, Any] | None, max_num_seqs: int | None = None) -> list[str]:
    """Problems vLLM would raise on `--speculative-config cfg` (see MIRRORS["vllm.*"]), plus "meaning:" problems: a
    per-batch schedule that does not cover 1..max_num_seqs in order, or asks for more than num_speculative_tokens."""
    if not isinstance(cfg, dict):
        return ["speculative_config: must be a JSON object (leave it unset to serve without speculation)"]
    out = [f"{key}: not a SpeculativeConfig field (vLLM refuses unknown keys; it has e.g. method, model, "
           f"num_speculative_tokens, num_speculative_tokens_per_batch_size)" for key in sorted(set(cfg) - VLLM_FIELDS)]
    method = cfg.get("method")
    if method is not None and method not in VLLM_METHODS:
        out.append(f"method: {method!r} is not a vLLM method; it accepts {', '.join(sorted(VLLM_METHODS))}")
    n = cfg.get("num_speculative_tokens")
    if n is None:
        out.append("num_speculative_tokens: required (vLLM reads it from the draft's config only when that has "
                   "n_predict)")
    elif _int(n) is None or _int(n) <= 0:
        out.append(f"num_speculative_tokens: {n!r}; vLLM accepts an integer > 0 (to serve without speculation, "
                   f"leave speculative_config unset)")
    if method in VLLM_MODEL_METHODS and not cfg.get("model"):
        out.append(f"model: method {method!r} needs the draft / head path in 'model'")
    if method in ("ngram", "ngram_gpu"):
        lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
        for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (_int(v) is None or _int(v) < 1):
                out.append(f"{key}: {v!r}; vLLM accepts an integer >= 1")
        if _int(lo) is not None and _int(hi) is not None and _int(lo) > _int(hi):
            out.append(f"prompt_lookup_min: {lo} must be <= prompt_lookup_max {hi}")
    sched = cfg.get("num_speculative_tokens_per_batch_size")
    if sched is not None:
        out += _vllm_schedule_problems(sched, _int(n), max_num_seqs)
    return out


def _vllm_schedule_problems(sched: Any, k_max: int | None, max_num_seqs: int | None) -> list[str]:
    key = "num_speculative_tokens_per_batch_size"
    if not isinstance(sched, list) or not all(isinstance(r, (list, tuple)) and len(r) == 3
                                              and all(_int(x) is not None for x in r) for r in sched):
        return [f"{key}: vLLM accepts a list of [range_start, range_end, k] integer triples"]
    out, expect = [], 1
    for lo, hi, k in sched:
        if lo != expect or hi < lo:
            out.append(f"meaning: {key}: range [{lo}, {hi}] should start at {expect} (ranges in order, no gaps, "
                       f"start <= end), so no batch size is left to vLLM's default")
        if k < 0 or (k_max is not None and k > k_max):
            out.append(f"meaning: {key}: k = {k} in [{lo}, {hi}] must be in 0..num_speculative_tokens ({k_max})")
        expect = hi + 1
    if max_num_seqs is not None and expect - 1 != max_num_seqs:
        out.append(f"meaning: {key}: the last range ends at {expect - 1}; it must end at max_num_seqs "
                   f"({max_num_seqs}) so every batch size the server runs has a stated k")
    return out


def vllm_k_at(cfg: dict[str, Any], batch_size: int) -> int:
    """The k a checked vLLM config states for a batch size: its inclusive range's k, else num_speculative_tokens."""
    for lo, hi, k in cfg.get("num_speculative_tokens_per_batch_size") or ():
        if lo <= batch_size <= hi:
            return int(k)
    return int(cfg["num_speculative_tokens"])


def check_trtllm(cfg: dict[str, Any] | None) -> list[str]:
    """Problems TensorRT-LLM's DecodingBaseConfig subclasses would raise on cfg (see MIRRORS["trtllm.*"])."""
    if not isinstance(cfg, dict):
        return ["speculative_config: must be a JSON object (leave it unset to serve without speculation)"]
    tag = cfg.get("decoding_type")
    if tag not in TRTLLM_TYPE_FIELDS:
        return [f"decoding_type: {tag!r}; TensorRT-LLM selects the config class by this tag and accepts "
                f"{', '.join(sorted(TRTLLM_TYPE_FIELDS))} (the draft-model tag is 'Draft_Target')"]
    out = [f"{key}: not a field of the {tag} decoding config (TensorRT-LLM refuses unknown keys)"
           for key in sorted(set(cfg) - TRTLLM_BASE_FIELDS - TRTLLM_TYPE_FIELDS[tag])]
    n = cfg.get("max_draft_len")
    if n is not None and (_int(n) is None or _int(n) < 0):
        out.append(f"max_draft_len: {n!r}; TensorRT-LLM accepts a non-negative integer")
    elif tag in TRTLLM_NEEDS_DRAFT_LEN and (n is None or _int(n) == 0):
        out.append(f"max_draft_len: {tag} needs max_draft_len > 0 (to serve without speculation, leave "
                   f"speculative_config unset)")
    if tag in TRTLLM_NEEDS_MODEL and not (cfg.get("speculative_model") or cfg.get("speculative_model_dir")):
        out.append(f"speculative_model: {tag} needs the draft / head path")
    sched = cfg.get("draft_len_schedule")
    if sched is not None:
        out += _trtllm_schedule_problems(sched, _int(n))
        if cfg.get("max_concurrency") is not None:
            out.append("max_concurrency: mutually exclusive with draft_len_schedule (a schedule's largest key "
                       "already turns speculation off above it)")
    mc = cfg.get("max_concurrency")
    if mc is not None and (_int(mc) is None or _int(mc) < 1):
        out.append(f"max_concurrency: {mc!r}; TensorRT-LLM accepts a positive integer")
    win, thr = cfg.get("acceptance_rate_window_size"), cfg.get("acceptance_rate_threshold")
    if win is not None and (_int(win) is None or _int(win) < 0):
        out.append(f"acceptance_rate_window_size: {win!r}; TensorRT-LLM accepts a non-negative integer")
    if thr is not None and not (isinstance(thr, (int, float)) and not isinstance(thr, bool) and 0.0 <= thr <= 1.0):
        out.append(f"acceptance_rate_threshold: {thr!r}; TensorRT-LLM accepts a number in [0, 1]")
    if thr is not None and not _int(win):
        out.append("meaning: acceptance_rate_threshold is set but acceptance_rate_window_size is unset or 0, which "
                   "turns the acceptance switch-off off; give a window > 0")
    if tag == "NGram" and "max_matching_ngram_size" in cfg:
        m = _int(cfg["max_matching_ngram_size"])
        if m is None or m < 1:
            out.append(f"max_matching_ngram_size: {cfg['max_matching_ngram_size']!r}; NGram accepts an integer > 0")
    if tag in ("Eagle", "Eagle3") and (cfg.get("use_dynamic_tree") or cfg.get("dynamic_tree_max_topK") is not None):
        topk, total = _int(cfg.get("dynamic_tree_max_topK")), cfg.get("max_total_draft_tokens")
        if topk is None or topk <= 0:
            out.append("dynamic_tree_max_topK: a dynamic tree needs an integer > 0")
        elif total is not None and _int(n) and not (_int(n) <= _int(total) <= topk * _int(n)):
            out.append(f"max_total_draft_tokens: {total} must lie in max_draft_len..dynamic_tree_max_topK * "
                       f"max_draft_len ({_int(n)}..{topk * _int(n)})")
    return out


def _trtllm_schedule_problems(sched: Any, max_draft_len: int | None) -> list[str]:
    if not isinstance(sched, dict) or not sched or not all(_int(b) is not None and _int(k) is not None
                                                           for b, k in sched.items()):
        return ["draft_len_schedule: TensorRT-LLM accepts a non-empty {batch_size: draft_len} map of integers"]
    items = {_int(b): _int(k) for b, k in sched.items()}
    out = [f"draft_len_schedule: batch size key {b} must be >= 1" for b in items if b < 1]
    out += [f"draft_len_schedule: draft length {k} (key {b}) must be >= 0" for b, k in items.items() if k < 0]
    smallest = min(items)
    if max_draft_len is not None and items[smallest] != max_draft_len:
        out.append(f"draft_len_schedule: the smallest key ({smallest}) must carry max_draft_len ({max_draft_len}), "
                   f"got {items[smallest]}")
    if max_draft_len is not None:
        out += [f"draft_len_schedule: draft length {k} (key {b}) exceeds max_draft_len {max_draft_len}"
                for b, k in items.items() if k > max_draft_len]
    return out


def trtllm_k_at(cfg: dict[str, Any], batch_size: int) -> int:
    """The draft length TensorRT-LLM runs at a batch size: the smallest schedule key >= it, 0 above the largest;
    without a schedule max_draft_len, or 0 above max_concurrency."""
    sched = cfg.get("draft_len_schedule")
    if sched:
        keys = sorted((int(b), int(k)) for b, k in sched.items())
        return next((k for b, k in keys if b >= batch_size), 0)
    mc = cfg.get("max_concurrency")
    return 0 if mc is not None and batch_size > int(mc) else int(cfg["max_draft_len"])


def trtllm_gate(cfg: dict[str, Any]) -> tuple[int, float] | None:
    """(window, threshold) of TensorRT-LLM's permanent acceptance switch-off, None where it is off (no window > 0 or
    no threshold; MIRRORS["trtllm.acceptance_gate"])."""
    win, thr = _int(cfg.get("acceptance_rate_window_size")), cfg.get("acceptance_rate_threshold")
    return (win, float(thr)) if win and thr is not None else None


def check_sglang(args: dict[str, Any] | None, adaptive: Any = None) -> list[str]:
    """Problems SGLang's server-args handling would raise on args (see MIRRORS["sglang.*"]), plus "meaning:" problems
    where SGLang would silently run something other than the args say. adaptive: the JSON object the file named by
    speculative_adaptive_config holds (checked with check_sglang_adaptive; required when that key is set)."""
    if not isinstance(args, dict):
        return ["server_args: must be a JSON object (leave speculative_algorithm unset to serve without "
                "speculation)"]
    algo = args.get("speculative_algorithm")
    if algo not in SGLANG_ALGORITHMS:
        return [f"speculative_algorithm: {algo!r}; SGLang accepts {', '.join(sorted(SGLANG_ALGORITHMS))}"]
    steps, topk, ntok = (args.get(k) for k in ("speculative_num_steps", "speculative_eagle_topk",
                                               "speculative_num_draft_tokens"))
    out = [f"{key}: {v!r}; SGLang accepts a positive integer" for key, v in
           (("speculative_num_steps", steps), ("speculative_eagle_topk", topk),
            ("speculative_num_draft_tokens", ntok)) if v is not None and (_int(v) is None or _int(v) < 1)]
    if algo in ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE"):
        if steps is None and (topk is not None or ntok is not None):
            out.append("speculative_num_steps: unset while speculative_eagle_topk / speculative_num_draft_tokens "
                       "are set; SGLang fills all three itself only when none is given")
        if _int(topk) == 1 and _int(steps) is not None and _int(ntok) != _int(steps) + 1:
            out.append(f"meaning: speculative_num_draft_tokens: {ntok}; with speculative_eagle_topk 1 SGLang resets "
                       f"it to speculative_num_steps + 1 = {_int(steps) + 1}")
        if algo in ("EAGLE", "EAGLE3", "STANDALONE") and not args.get("speculative_draft_model_path"):
            out.append(f"speculative_draft_model_path: {algo} loads its draft / head from this path (SGLang fills "
                       f"it itself only for targets with built-in MTP layers)")
    if args.get("speculative_adaptive"):
        out += _sglang_adaptive_args_problems(args, algo, topk, steps, adaptive)
    elif args.get("speculative_adaptive_config") is not None:
        out.append("meaning: speculative_adaptive_config is set without speculative_adaptive true; SGLang reads the "
                   "file only when speculative_adaptive is on")
    if args.get("speculative_token_map") is not None and algo != "EAGLE":
        out.append(f"meaning: speculative_token_map is read only by EAGLE (FR-Spec); {algo} "
                   + ("ignores it with a warning (its head has its own draft vocabulary)" if algo == "EAGLE3" else
                      "does not read it"))
    if algo == "NGRAM":
        breadth = _int(args.get("speculative_ngram_max_bfs_breadth", SGLANG_NGRAM_MAX_BFS_BREADTH_DEFAULT))
        if topk is not None and _int(topk) != breadth:
            out.append(f"meaning: speculative_eagle_topk: {topk}; for NGRAM SGLang replaces it with "
                       f"speculative_ngram_max_bfs_breadth ({breadth}): set speculative_ngram_max_bfs_breadth "
                       f"{topk} to keep it")
    return out


def sglang_chain(args: dict[str, Any]) -> tuple[int, int, int]:
    """(depth, top-k, draft tokens with the root) SGLang runs for checked args, at every batch size (one setting per
    server); for NGRAM the depth is draft tokens - 1 (a chain when the breadth is 1)."""
    if args["speculative_algorithm"] == "NGRAM":
        topk = int(args.get("speculative_ngram_max_bfs_breadth", SGLANG_NGRAM_MAX_BFS_BREADTH_DEFAULT))
        ntok = int(args.get("speculative_num_draft_tokens", SGLANG_NGRAM_MAX_MATCH_WINDOW_DEFAULT))
        return ntok - 1, topk, ntok
    steps, topk, ntok = (int(args[k]) for k in ("speculative_num_steps", "speculative_eagle_topk",
                                                "speculative_num_draft_tokens"))
    return steps, topk, steps + 1 if topk == 1 else ntok


def _sglang_adaptive_args_problems(args: dict[str, Any], algo: str, topk: Any, steps: Any, adaptive: Any) -> list[str]:
    if algo not in SGLANG_ADAPTIVE_ALGORITHMS or (topk is not None and _int(topk) != 1):
        return [f"meaning: speculative_adaptive: SGLang adapts steps only for EAGLE / EAGLE3 with "
                f"speculative_eagle_topk 1; with {algo} and top-k {topk} it warns and serves the static settings"]
    if not args.get("speculative_adaptive_config"):
        return ["meaning: speculative_adaptive_config: unset, so SGLang runs its built-in per-batch-size steps "
                "instead of the measured ones; name the exported adaptive JSON file"]
    if adaptive is None:
        return ["speculative_adaptive_config: give the JSON object the file holds to check it"]
    out = check_sglang_adaptive(adaptive)
    if out:
        return out
    union = sorted({int(s) for k, e in adaptive.items() if k.isdigit() for s in e["candidate_steps"]})
    if steps is not None and _int(steps) not in union:
        out.append(f"speculative_num_steps: {steps} is not one of the adaptive config's candidate_steps {union}; "
                   f"SGLang refuses it")
    ntok = args.get("speculative_num_draft_tokens")
    if steps is not None and ntok is not None and _int(ntok) != _int(steps) + 1:
        out.append(f"meaning: speculative_num_draft_tokens: {ntok}; with speculative_adaptive SGLang sets it to "
                   f"speculative_num_steps + 1 = {_int(steps) + 1}")
    return out


def check_sglang_adaptive(cfg: Any) -> list[str]:
    """Problems SGLang's adaptive-config loader would raise on the JSON object cfg (MIRRORS["sglang.adaptive_*"]),
    plus "meaning:" problems for keys SGLang reads with a default and so ignores when misspelt."""
    if not isinstance(cfg, dict):
        return ["speculative_adaptive_config: the file must hold a JSON object"]
    out = []
    slots = {k: v for k, v in cfg.items() if isinstance(k, str) and k.isdigit()}
    if not slots:
        out.append('speculative_adaptive_config: needs at least one integer-string batch-size key, e.g. '
                   '{"1": {"candidate_steps": [1, 3]}}')
    for key, entry in slots.items():
        steps = entry.get("candidate_steps") if isinstance(entry, dict) else None
        if not (isinstance(steps, list) and steps and all(_int(s) is not None and not isinstance(s, str)
                                                          and _int(s) >= 0 for s in steps)):
            out.append(f"{key}: candidate_steps must be a non-empty list of integers >= 0, got {steps!r}")
            continue
        out += [f"meaning: {key}.{name}: not an adaptive knob SGLang reads (it has candidate_steps, "
                f"{', '.join(SGLANG_ADAPTIVE_KNOBS)})" for name in sorted(set(entry) - set(SGLANG_ADAPTIVE_KNOBS)
                                                                          - {"candidate_steps"})]
    shared = set(cfg) - set(slots)
    out += [f"meaning: {name}: not an adaptive key SGLang reads (it has strategy, {', '.join(SGLANG_ADAPTIVE_KNOBS)} "
            f"and integer batch-size keys)" for name in sorted(shared - set(SGLANG_ADAPTIVE_KNOBS) - {"strategy"})]
    strategy = cfg.get("strategy", "ema")
    if strategy not in SGLANG_ADAPTIVE_STRATEGIES:
        out.append(f"strategy: {strategy!r}; SGLang accepts 'ema' or 'throughput_aware'")
    elif strategy != "ema":
        out.append("meaning: strategy: 'throughput_aware' hands the steps to another controller than the EMA slots "
                   "this check mirrors; leave strategy unset or 'ema'")
    return out


def sglang_steps_at(cfg: dict[str, Any], batch_size: int, cuda_graph_bs: list[int] | None = None) -> list[int]:
    """The candidate steps SGLang's adaptive config gives a batch size: pad it to the next CUDA-graph size (when
    given), then the slot with the largest key <= it (the smallest slot below all keys). One candidate: the steps
    run at that size whatever the acceptance (MIRRORS["sglang.adaptive_route"]); more: chosen at runtime by the
    EMA of accepted drafts."""
    keys = sorted(int(k) for k in cfg if k.isdigit())
    b = batch_size
    if cuda_graph_bs:
        b = next((g for g in sorted(cuda_graph_bs) if g >= batch_size), batch_size)
    key = max((k for k in keys if k <= b), default=keys[0])
    return sorted({int(s) for s in cfg[str(key)]["candidate_steps"]})
