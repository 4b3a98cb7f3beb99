"""The run-record and trace schemas: one declaration per column, from which the Arrow and pandas types follow.

A column is declared once in `RUN_COLUMNS` (or, for later features, with `register_column`) as a `ColumnSpec` with a
*kind*; each kind maps to one Arrow type (what Parquet files hold) and one pandas dtype (what `ResultStore.load`
returns):

    kind          Arrow                      pandas                 Python value in a record
    "string"      string                     "string" (pd.NA)       str (dict/list values are stored as JSON text)
    "int"         int64                      "Int64"                int (bool and integral floats accepted)
    "float"       float64                    "Float64"              float (NaN is stored as null)
    "bool"        bool                       "boolean"              bool (0/1 accepted)
    "timestamp"   timestamp[us, tz=UTC]      datetime64[us, UTC]    datetime / pd.Timestamp / ISO string (naive = UTC)
    "list_float"  list<double>               object (list | None)   list of floats

Keys of a record that no declaration names are kept: their Arrow type is inferred per file, and `load` unifies
them across files (see `results.store`). Declaring a column later (with `register_column`) only fixes its type.
Adding nullable columns is backward compatible and does not bump `SCHEMA_VERSION`; bump it (and add an entry to
`MIGRATIONS`) when the meaning or type of an existing column changes.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pyarrow as pa

SCHEMA_VERSION = 1

KINDS = ("string", "int", "float", "bool", "timestamp", "list_float")

_ARROW_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "bool": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "list_float": pa.list_(pa.float64()),
}


def _pandas_dtype(kind: str) -> Any:
    return {
        "string": pd.StringDtype(),
        "int": pd.Int64Dtype(),
        "float": pd.Float64Dtype(),
        "bool": pd.BooleanDtype(),
        "timestamp": pd.DatetimeTZDtype("us", "UTC"),
        "list_float": object,
    }[kind]


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    kind: str      # one of KINDS
    group: str     # identity | config | metrics | quality | trust | graphs | trial_time | profile | telemetry | environment | trace | extension
    doc: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"column {self.name!r}: unknown kind {self.kind!r}; expected one of {KINDS}")

    @property
    def arrow_type(self) -> pa.DataType:
        return _ARROW_TYPES[self.kind]

    @property
    def pandas_dtype(self) -> Any:
        return _pandas_dtype(self.kind)


def _cols(group: str, kind: str, names: str) -> list[ColumnSpec]:
    return [ColumnSpec(n, kind, group) for n in names.split()]


# The run record, in display order (docs/INTERFACES.md "The run record").
_RUN_SPECS: list[ColumnSpec] = [
    ColumnSpec("run_id", "string", "identity", "time-sortable hex id, filled by ResultStore.append"),
    ColumnSpec("created_at", "timestamp", "identity", "UTC, filled by ResultStore.append"),
    ColumnSpec("schema_version", "int", "identity", "SCHEMA_VERSION of the writer"),
    ColumnSpec("study", "string", "identity", "None = ad hoc run"),
    ColumnSpec("trial_id", "int", "identity"),
    ColumnSpec("status", "string", "identity", '"ok" | "failed"'),
    ColumnSpec("error", "string", "identity"),
    ColumnSpec("method", "string", "config", '"ar" | "draft" | "ngram" | ...'),
    *_cols("config", "int", "k ngram_min ngram_max beam_width beam_length batch max_new_tokens"),
    *_cols("config", "int", "tree_depth tree_topk tree_budget hot_vocab"),
    ColumnSpec("eagle3_layers", "string", "config", "EAGLE-3: the target layers its head reads, 'i,j,k' or 'auto'"),
    ColumnSpec("diversity_penalty", "float", "config", "ReDrafter beam-search diversity penalty"),
    ColumnSpec("temperature", "float", "config"),
    ColumnSpec("top_k", "int", "config", "0 = off"),
    ColumnSpec("top_p", "float", "config", "1.0 = off"),
    ColumnSpec("seed", "int", "config"),
    *_cols("config", "string", "dtype device"),
    ColumnSpec("paged", "bool", "config"),
    *_cols("config", "int", "kv_block_size num_prompts repeats warmup"),
    ColumnSpec("cuda_graphs", "bool", "config", "target verify and draft forwards captured in CUDA graphs"),
    ColumnSpec("graph_batch_sizes", "string", "config", 'captured batch buckets as text, e.g. "1,2,4,8"'),
    ColumnSpec("compile", "string", "config", '"off" | "default" | "max-autotune" (torch.compile mode)'),
    ColumnSpec("attention", "string", "config", '"auto" | "sdpa" | "triton" (attention backend of the KV cache)'),
    ColumnSpec("prefill_graphs", "bool", "config", "prompt forwards captured in CUDA graphs per (batch, padded length) "
               "(with cuda_graphs)"),
    ColumnSpec("compile_prefill", "bool", "config", "captured prompt forwards compiled too (with compile and "
               "prefill_graphs)"),
    ColumnSpec("overlap", "bool", "config", "overlapped steps asked for (step t+1 launched before step t is read)"),
    ColumnSpec("pdl", "bool", "config", "programmatic dependent launch of our Triton kernels asked for"),
    ColumnSpec("gemv_fusion", "string", "config", "what the Triton GEMVs fold in at their edges: off | residual | "
               "glu+residual | glu+residual+ores | norm+glu+residual"),
    ColumnSpec("target_kv_quant", "string", "config", '"none" | "int8" | "fp8": the target\'s KV-cache format'),
    ColumnSpec("draft_kv_quant", "string", "config", '"none" | "int8" | "fp8": the draft model\'s KV-cache format'),
    *_cols("config", "string", "target_quant draft_quant"),
    ColumnSpec("int4_group_size", "int", "config", "input channels per int4 scale group"),
    ColumnSpec("quant_head", "bool", "config", "the LM head quantized too, in each model's weight format (no-op for "
               "none)"),
    ColumnSpec("quant_kernel", "string", "config", '"auto" | "aten" | "dequant" | "triton": quantized matmul kernel'),
    ColumnSpec("max_ppl_increase_pct", "float", "config", "quality bound of studies: max perplexity increase, %"),
    ColumnSpec("phase_profile", "bool", "config", "per-phase GPU profile asked for (phase_* columns)"),
    ColumnSpec("compare_hf", "bool", "config", "Hugging Face generate() timed too (hf_* columns)"),
    ColumnSpec("tp_size", "int", "config", "tensor-parallel ranks of the target (1 = one device)"),
    ColumnSpec("kernel_tuning", "string", "config", "the kernel variants the run ran with, resolved: every "
               "KernelTuning field as field=value,... (kernels/tuning.py)"),
    ColumnSpec("auto_knobs", "string", "config", "the knobs given as auto and resolved for the device before the run, "
               "comma-separated (their columns hold the resolved values)"),
    *_cols("config", "string", "preset target_path draft_path prompts_source"),
    ColumnSpec("draft_head", "string", "config", "feature methods: where the head came from (a --draft-head "
               "checkpoint folder, the zoo head folder beside the target, or 'untrained (seed N)')"),
    ColumnSpec("draft_head_layout", "string", "config", "the head's layout: workbench (our eagle / redrafter "
               "format), eagle (published EAGLE-1/2), eagle3 (published EAGLE-3)"),
    ColumnSpec("draft_head_dtype", "string", "config", "the dtype the head's weights were stored in (it runs in the "
               "run's dtype)"),
    ColumnSpec("draft_head_params", "int", "config", "the head's parameter count (shared target modules excluded)"),
    ColumnSpec("draft_vocab_size", "int", "config", "EAGLE-3: tokens of the head's draft vocabulary"),
    ColumnSpec("config_json", "string", "config", "the full engine config as JSON"),
    *_cols("metrics", "float", "acceptance_rate mean_accepted_tokens"),
    ColumnSpec("acceptance_by_position", "list_float", "metrics",
               "fraction of steps whose path reached depth d (per tree depth for trees)"),
    ColumnSpec("tree_size_mean", "float", "metrics", "valid draft nodes verified per sequence per step"),
    ColumnSpec("wasted_node_fraction", "float", "metrics",
               "1 - accepted / verified draft nodes (= 1 - acceptance_rate)"),
    ColumnSpec("accepted_path_length_mean", "float", "metrics",
               "accepted draft tokens per sequence per step, bonus excluded (= mean_accepted_tokens - 1)"),
    ColumnSpec("beam_diversity_mean", "float", "metrics",
               "beam drafters: distinct valid prefix-tree nodes / (W x L), mean over steps and sequences"),
    ColumnSpec("beam_disagreement_mean", "float", "metrics",
               "beam drafters, W >= 2: fraction of depths where two beams' tokens differ, mean over beam pairs, "
               "steps and sequences"),
    ColumnSpec("acceptance_by_rank", "list_float", "metrics",
               "entry r: accepted path nodes that were their parent's rank-r child (by draft score) per step; "
               "sums to accepted_path_length_mean"),
    ColumnSpec("acceptance_by_depth_rank", "string", "metrics",
               "JSON [depth][rank]: fraction of steps whose accepted path went through a rank-r child at depth d+1"),
    *_cols("metrics", "float", "tokens_per_s ar_tokens_per_s speedup_vs_ar ttft_ms "
                               "tpot_ms_p50 tpot_ms_p90 tpot_ms_p99 itl_ms_p50 itl_ms_p90 itl_ms_p99 "
                               "time_draft_ms time_verify_ms time_accept_ms time_kv_ms peak_mem_mb "
                               "draft_target_cost_ratio"),
    ColumnSpec("speedup_per_token_per_step", "float", "metrics",
               "speedup_vs_ar / mean_accepted_tokens: the AR step's time over the speculative step's (1 = no "
               "speculation overhead; None for ar)"),
    ColumnSpec("decode_speedup_vs_ar", "float", "metrics",
               "the AR run's median TPOT over this run's: the speedup of the decode window alone (first token -> "
               "done; prefill and call setup left out)"),
    ColumnSpec("decode_speedup_per_token_per_step", "float", "metrics",
               "decode_speedup_vs_ar / mean_accepted_tokens (None for ar)"),
    *_cols("metrics", "int", "total_new_tokens target_steps"),
    ColumnSpec("wall_s", "float", "metrics"),
    ColumnSpec("greedy_matches_ar", "bool", "metrics", "None when not checked"),
    ColumnSpec("quant_ppl", "float", "quality", "held-out perplexity of the run's target (quantized or not)"),
    ColumnSpec("quant_ppl_ref", "float", "quality", "held-out perplexity of the unquantized target (same text)"),
    ColumnSpec("quant_ppl_delta_pct", "float", "quality", "100 x (quant_ppl / quant_ppl_ref - 1); 0 unquantized"),
    ColumnSpec("quant_token_agreement", "float", "quality",
               "teacher-forced top-1 agreement with the unquantized target's greedy continuation of the run's prompts"),
    ColumnSpec("quant_sequences_identical", "float", "quality",
               "fraction of prompts whose greedy output equals the unquantized target's (temperature 0 runs)"),
    ColumnSpec("quant_acceptance_ref", "float", "quality", "acceptance of the same method with unquantized models"),
    ColumnSpec("quant_acceptance_delta", "float", "quality", "acceptance_rate - quant_acceptance_ref"),
    ColumnSpec("quant_within_bound", "bool", "quality", "quant_ppl_delta_pct <= max_ppl_increase_pct"),
    *_cols("quality", "float", "target_weight_mb draft_weight_mb"),
    ColumnSpec("quant_note", "string", "quality", "calibration text (int4-awq), GGUF types, how quality was measured"),
    ColumnSpec("ar_tokens_per_s_repeats", "list_float", "trust", "AR tokens/s of each timed repeat, in order"),
    ColumnSpec("tokens_per_s_repeats", "list_float", "trust", "candidate tokens/s of each timed repeat, in order"),
    ColumnSpec("ar_tokens_per_s_cv", "float", "trust", "coefficient of variation over repeats; None with 1 repeat"),
    ColumnSpec("tokens_per_s_cv", "float", "trust", "coefficient of variation over repeats; None with 1 repeat"),
    ColumnSpec("speedup_ci_low", "float", "trust", "Student-t 95% interval of the paired speedup (geometric mean of per-repeat ratios), low"),
    ColumnSpec("speedup_ci_high", "float", "trust", "... and high; None with 1 repeat"),
    ColumnSpec("noisy", "bool", "trust", "spread too wide for the headline; None with 1 repeat"),
    ColumnSpec("noisy_reason", "string", "trust", "why noisy (or \"1 repeat: no spread\")"),
    ColumnSpec("plausible", "bool", "trust", "speedup, acceptance and AR drift within physical bounds"),
    ColumnSpec("implausible_reason", "string", "trust", "which bound failed, with the numbers"),
    ColumnSpec("overlap_applied", "bool", "graphs", "the candidate ran overlapped steps (overlap on, greedy chains "
               "with fixed shapes); None with overlap off"),
    ColumnSpec("pdl_applied", "bool", "graphs", "our Triton kernels were launched with programmatic dependent launch "
               "(pdl on, a Hopper or newer GPU, a triton that has it); False otherwise"),
    ColumnSpec("int4_cuda_gemv", "bool", "graphs", "one-row int4 calls of the 'triton' quant kernel ran on the CUDA C++ "
               "GEMV (kernels/int4_cuda.py: on by default where a CUDA GPU and nvcc are present) instead of the Triton "
               "GEMV; says nothing about whether the run had int4 weights"),
    ColumnSpec("compile_fallbacks", "int", "graphs", "compiled frames that hit torch._dynamo's recompile limit during "
               "this run, warm-up, captures and (serving) calibration included (their new variants then run eagerly: "
               "the figures understate the compiled engine); None with compile off"),
    ColumnSpec("compile_fallbacks_in_process", "int", "graphs", "the same, over the whole process so far (dynamo "
               "warns once per frame, and a frame past its limit stays so)"),
    ColumnSpec("graph_capture_s", "float", "graphs", "time spent capturing CUDA graphs"),
    ColumnSpec("graph_memory_mb", "float", "graphs", "GPU memory held by the captured graphs' pools"),
    *_cols("graphs", "int", "graph_bucket_hits graph_bucket_misses"),
    ColumnSpec("graph_padding_waste", "float", "graphs", "fraction of computed rows that were batch padding"),
    ColumnSpec("graph_buckets_captured", "string", "graphs", 'buckets actually captured, e.g. "1,2,4"'),
    # Where a run's (a study trial's) wall time goes, beside `wall_s` (the timed, interleaved passes). A row cannot time
    # its own store write, so each trial row carries the previous one's (trial_prev_store_s): sum a worker's rows.
    ColumnSpec("trial_engine_s", "float", "trial_time", "engines looked up or built, caches sized, and every graph "
               "capture (ahead of time or on first use in a warm-up pass); both engines"),
    ColumnSpec("trial_warmup_s", "float", "trial_time", "warm-up passes, less the graph captures made inside them"),
    # wall_s split by where each engine.generate call of the timed passes (both sides, every repeat) spent it:
    # wall_s = prefill + decode + setup + finish + other. tokens/s's window per call is prefill + decode.
    ColumnSpec("wall_prefill_s", "float", "trial_time", "timed passes: each generate call's start of prefill to its "
               "first tokens read (prefill, the drafter's prefill, the first host read); inside tokens/s"),
    ColumnSpec("wall_decode_s", "float", "trial_time", "timed passes: each call's first tokens to its last (the "
               "decode steps); inside tokens/s"),
    ColumnSpec("wall_setup_s", "float", "trial_time", "timed passes: each call's entry to its prefill start (cache "
               "and state resets, prompt upload); outside tokens/s"),
    ColumnSpec("wall_finish_s", "float", "trial_time", "timed passes: each call's last tokens to its return (the last "
               "step's bookkeeping, phase-timer resolve, graph statistics); outside tokens/s"),
    ColumnSpec("wall_other_s", "float", "trial_time", "wall_s less the four above: between calls (the passes' loop, "
               "the device sync ending each pass)"),
    ColumnSpec("trial_quality_s", "float", "trial_time", "untimed quality work: KV-format and quantization quality "
               "columns, greedy divergence margins"),
    ColumnSpec("trial_s", "float", "trial_time", "studies: seconds from the end of this worker's previous store write "
               "(or its trial loop's start) to the start of this row's store write"),
    ColumnSpec("trial_other_s", "float", "trial_time", "trial_s less engine, warm-up, wall_s and quality: Optuna "
               "(ask, tell, user attrs, the sampler), prompts, checks, telemetry start/stop, the record; None on failure"),
    ColumnSpec("trial_prev_store_s", "float", "trial_time", "the store write of this worker's previous row (None for "
               "its first): a row cannot time its own write"),
    ColumnSpec("kv_bytes_per_token", "int", "kv", "target KV bytes per token: K and V, all layers and KV heads, "
               "scales included"),
    ColumnSpec("kv_cache_mb", "float", "kv", "target KV cache as allocated for the run (pool + scales)"),
    ColumnSpec("draft_kv_bytes_per_token", "int", "kv", "the draft model's KV bytes per token; None without one"),
    ColumnSpec("draft_kv_cache_mb", "float", "kv", "the draft model's KV cache as allocated; None without one"),
    ColumnSpec("kv_token_agreement", "float", "kv", "greedy AR tokens with the run's target KV format that equal "
               "those with model-dtype KV (none), up to each sequence's first difference, over all tokens; 1 for none"),
    ColumnSpec("kv_divergent_sequences", "int", "kv", "sequences whose greedy AR output differs from none's"),
    *_cols("profile", "float", "phase_sm_util_draft phase_sm_util_verify phase_sm_util_accept "
                               "phase_bw_gbps_draft phase_bw_gbps_verify phase_bw_gbps_accept "
                               "phase_ms_draft phase_ms_verify phase_ms_accept"),
    ColumnSpec("phase_profile_note", "string", "profile", "how the phase profile was measured, or why it was not"),
    ColumnSpec("sm_util_pct", "float", "telemetry", "NVML GPM SM_UTIL (% of SMs busy); None without GPM"),
    ColumnSpec("sm_occupancy_pct", "float", "telemetry", "NVML GPM SM_OCCUPANCY"),
    ColumnSpec("gpu_busy_pct", "float", "telemetry", "NVML utilization rate: % of time any kernel ran"),
    *_cols("telemetry", "float", "gpu_mem_used_mb gpu_power_w sm_clock_mhz"),
    ColumnSpec("telemetry_reason", "string", "telemetry", "why telemetry is missing, None when sampled"),
    ColumnSpec("telemetry_timeline", "string", "telemetry", "JSON list of samples"),
    *_cols("environment", "string", "device_name torch_version cuda_version driver_version git_commit hostname "
                                    "python_version platform"),
]

TRACE_SPECS: list[ColumnSpec] = [
    ColumnSpec("run_id", "string", "trace"),
    *_cols("trace", "int", "seq step drafted accepted emitted"),
    ColumnSpec("path_ranks", "string", "trace", "JSON list: sibling rank of the accepted node at each depth"),
    ColumnSpec("beam_disagreement", "float", "trace", "the step's pairwise token disagreement of the beams"),
]

# Serving runs (`python -m workbench serve-bench`, workbench/serving): their own settings, then metrics named as
# `vllm bench serve` names them (`ttft_ms_p99` here is vLLM's `p99_ttft_ms`, `goodput` its `request_goodput`).
# Bench rows leave these null; serving rows fill the shared columns they mean the same way (method, k, tpot_ms_p99).
SERVING_SPECS: list[ColumnSpec] = [
    ColumnSpec("run_kind", "string", "identity", '"serve" for serving runs (None = a bench run)'),
    ColumnSpec("rate", "float", "config", "request arrival rate, requests/s (0 = all at once)"),
    *_cols("config", "string", "arrival lengths sched_policy k_by_batch calibration calibration_shape"),
    *_cols("config", "float", "burstiness range_ratio slo_ttft_ms slo_tpot_ms spec_off_acceptance "
                              "calibration_budget_s"),
    *_cols("config", "int", "max_concurrency num_requests warmup_requests input_len shared_prefix_len kv_blocks "
                            "max_num_seqs prefill_chunk spec_window spec_max_context long_context_k spec_catch_up_max "
                            "spec_off_queue calibration_repeats greedy_check_requests"),
    ColumnSpec("prefix_caching", "bool", "config", "full prompt blocks shared between requests"),
    ColumnSpec("gc_freeze", "bool", "config", "Python's heap collected and frozen (gc.freeze) before the measured run"),
    ColumnSpec("serve_tuning", "string", "config", "how the serving loop ran, resolved: every ServeTuning field as "
               "field=value,... (workbench/serving/tuning.py)"),
    *_cols("serving", "int", "completed preemptions"),
    *_cols("serving", "float", "duration_s request_throughput output_throughput total_token_throughput goodput "
                               "ttft_ms_mean ttft_ms_p50 ttft_ms_p90 ttft_ms_p99 tpot_ms_mean "
                               "itl_ms_mean e2el_ms_mean e2el_ms_p50 e2el_ms_p90 e2el_ms_p99 "
                               "queue_ms_mean queue_ms_p50 queue_ms_p99 kv_cache_util_mean kv_cache_util_max "
                               "prefix_hit_rate mean_batch_size"),
    ColumnSpec("acceptance_by_batch_size", "string", "serving", 'JSON {"batch size": acceptance rate}'),
    ColumnSpec("acceptance_by_context", "string", "serving", 'JSON {"context bin start": acceptance rate}'),
    ColumnSpec("graph_captures_in_run", "int", "serving", "CUDA graphs captured while the run served (stalls "
               "inside the measured window; 0 when every bucket and draft length was captured first)"),
    ColumnSpec("graph_misses_in_run", "int", "serving", "steps that ran eagerly while the run served (a batch "
               "above every graph bucket)"),
    ColumnSpec("loop_batch_prefill", "int", "serving", "the most prefill chunks per forward in the run (the "
               "serve_tuning field batch_prefill; 1 = a forward per request)"),
    ColumnSpec("loop_overlap", "string", "serving", "what the serving loop overlapped with a step in flight: none "
               "(the step read first: serve_tuning overlap_prefill=0), prefill (the iteration's prefill behind its "
               "step: overlap_prefill, the default where full overlap does not apply), full (each step launched "
               "before the previous one was read: serve_tuning full_overlap, the default where it applies: greedy "
               "chains with fixed shapes under no_evict)"),
    ColumnSpec("loop_steps_ahead", "int", "serving", "steps launched while another was in flight (full overlap)"),
    ColumnSpec("prefill_eager_chunks", "int", "serving", "prefill chunks of the target that ran eagerly with "
               "captured prefill (prefill_graphs) on: a padded length past the row's slots or the pool's free blocks"),
    ColumnSpec("draft_catch_up_tokens", "int", "serving", "draft-model KV positions written to catch up after "
               "steps that did not draft (adaptive speculation)"),
    ColumnSpec("calibration_s", "float", "serving", "seconds the schedule's calibration took (graph captures "
               "included), before the run"),
    ColumnSpec("calibration_table", "string", "serving", "JSON list: the calibration's measurements per (batch_size, "
               "k) (step: step_ms, tokens_per_ms; loop: tokens_per_s, or skipped) and the chosen k per batch size"),
    ColumnSpec("draft_catch_up_forwards", "int", "serving", "draft-model forwards those catch-ups took (rows grouped "
               "by gap)"),
    ColumnSpec("draft_catch_up_slots", "int", "serving", "rows x T of the catch-up forwards, padding included "
               "(>= draft_catch_up_tokens)"),
    ColumnSpec("draft_prefill_tokens", "int", "serving", "draft-model KV positions prefilled when requests joined "
               "(only where every step drafts; else catch-up before a row's first draft)"),
    ColumnSpec("draft_catch_up_skips", "int", "serving", "row-steps that did not draft at a drafting batch size "
               "because the row was further behind than spec_catch_up_max"),
    ColumnSpec("adaptive_granularity", "string", "serving", "what the adaptive rules chose per row and step: "
               "draft_length (chains: any 0..k) or tree_on_off (trees and beams, eagle / redrafter: 0 or the whole "
               "tree, which the engine cannot verify shorter); None for ar"),
    ColumnSpec("greedy_matches_solo", "bool", "serving", "temperature 0: every compared served output equals that "
               "request's solo greedy output (alone, batch 1, autoregressive, the run's engine settings; "
               "workbench/serving/fidelity.py); None when not checked (sampling, greedy_check_requests 0)"),
    ColumnSpec("greedy_solo_compared", "int", "serving", "requests compared for greedy_matches_solo (the first "
               "greedy_check_requests by id)"),
    ColumnSpec("greedy_solo_s", "float", "serving", "seconds the solo greedy decodes took, after the timed run"),
    ColumnSpec("drain_s", "float", "serving", "seconds from the last measured arrival to the last completion (the "
               "tail of shrinking batches once nothing arrives)"),
    ColumnSpec("drain_output_share", "float", "serving", "share of the measured output tokens emitted in that tail "
               "(above saturation output_throughput mixes the full-batch and the draining regime)"),
    ColumnSpec("endpoint", "string", "serving", "serve-bench --endpoint: the server's URL (None: the in-process "
               "engine)"),
    ColumnSpec("served_model", "string", "serving", "--endpoint: the model name the server was asked for"),
    ColumnSpec("engine_name", "string", "serving", "--endpoint: the server's engine (/version, else /v1/models' "
               "owned_by: vllm, sglang, workbench, ...)"),
    ColumnSpec("engine_version", "string", "serving", "--endpoint: the server's version as it reports it"),
    ColumnSpec("acceptance_source", "string", "serving", "--endpoint: where acceptance came from: vllm_counters "
               "(exact over the run, from /metrics before and after), sglang_gauges (the server's recent averages), "
               "None (the server exposes neither)"),
    ColumnSpec("spec_num_drafts", "int", "serving", "--endpoint: steps that verified drafts during the run "
               "(vllm:spec_decode_num_drafts)"),
    ColumnSpec("server_ttft_ms_mean", "float", "serving", "--endpoint: the server's own mean TTFT over the run (its "
               "vllm:time_to_first_token_seconds histogram, read before and after; `workbench serve` clocks it from "
               "the engine's arrival, vLLM from its API server's): against ttft_ms_mean it shows what lies outside the "
               "server's clock (for `workbench serve`, the HTTP path); None if the server lacks it"),
    ColumnSpec("server_queue_ms_mean", "float", "serving", "--endpoint: of that, the mean wait for a cache row "
               "(vllm:request_queue_time_seconds); None if the server lacks it"),
    ColumnSpec("server_prefill_ms_mean", "float", "serving", "--endpoint: of that, the mean admission-to-first-token "
               "time (vllm:request_prefill_time_seconds); None if the server lacks it"),
    ColumnSpec("failed_requests", "int", "serving", "--endpoint: measured requests that failed (HTTP error, dropped "
               "stream); left out of every metric"),
    ColumnSpec("launch_command", "string", "serving", "studies.serving --launch: the command line that started the "
               "server this row measured (the template filled with the trial's settings and port)"),
    ColumnSpec("launch_params", "string", "serving", "studies.serving --launch: the trial's template settings, "
               "name=value,..."),
    ColumnSpec("arrival_window_output_throughput", "float", "serving", "output tokens/s while requests still arrive "
               "(emitted before the last measured arrival / first to last measured arrival): the drain left out"),
]

# One row per request of a serving run (`ResultStore.append(..., requests=)`, requests/<run_id>.parquet).
REQUEST_SPECS: list[ColumnSpec] = [
    ColumnSpec("run_id", "string", "request"),
    *_cols("request", "int", "request prompt_len output_len preemptions prefix_hit_tokens steps"),
    ColumnSpec("measured", "bool", "request", "False for warm-up requests"),
    *_cols("request", "float", "arrival_s queue_ms ttft_ms tpot_ms e2el_ms itl_ms_mean acceptance_rate"),
]

# name -> spec for every known run column (RUN_COLUMNS plus registered extensions), in display order.
_REGISTRY: dict[str, ColumnSpec] = {}


def register_column(name: str, kind: str, group: str = "extension", doc: str = "") -> ColumnSpec:
    """Declare a run-record column (e.g. a later feature's `beam_width`, "int") so every load types it the same.

    Re-declaring with the same kind is a no-op; with another kind it raises ValueError (files already written
    would disagree with the new type).
    """
    spec = ColumnSpec(name, kind, group, doc)
    old = _REGISTRY.get(name)
    if old is not None:
        if old.kind != kind:
            raise ValueError(f"column {name!r} is already declared as {old.kind!r}, not {kind!r}")
        return old
    _REGISTRY[name] = spec
    return spec


for _spec in _RUN_SPECS + SERVING_SPECS:
    _REGISTRY[_spec.name] = _spec

RUN_COLUMNS: tuple[str, ...] = tuple(s.name for s in _RUN_SPECS)   # the INTERFACES.md record, fixed
TRACE_COLUMNS: tuple[str, ...] = tuple(s.name for s in TRACE_SPECS)
_TRACE_REGISTRY: dict[str, ColumnSpec] = {s.name: s for s in TRACE_SPECS}


def run_specs() -> dict[str, ColumnSpec]:
    """Every declared run column (the record plus registered extensions), in display order."""
    return dict(_REGISTRY)


def trace_specs() -> dict[str, ColumnSpec]:
    return dict(_TRACE_REGISTRY)


def request_specs() -> dict[str, ColumnSpec]:
    return {s.name: s for s in REQUEST_SPECS}


def arrow_schema(specs: Mapping[str, ColumnSpec] | None = None) -> pa.Schema:
    specs = run_specs() if specs is None else specs
    return pa.schema([pa.field(s.name, s.arrow_type) for s in specs.values()])


def pandas_dtypes(specs: Mapping[str, ColumnSpec] | None = None) -> dict[str, Any]:
    specs = run_specs() if specs is None else specs
    return {s.name: s.pandas_dtype for s in specs.values()}


# from_version -> function upgrading an Arrow table written at that version to from_version + 1.
# Version 0 (files written before the store existed) differs only by missing columns, which load fills.
MIGRATIONS: dict[int, Callable[[pa.Table], pa.Table]] = {0: lambda table: table}


# ---------------------------------------------------------------------------------------------- value coercion

class SchemaError(ValueError):
    """A value cannot be stored in its declared column."""


def _is_missing(value: Any) -> bool:
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    return isinstance(value, float) and math.isnan(value)


def coerce_value(spec: ColumnSpec, value: Any) -> Any:
    """The Python value to store for `value` in column `spec`, or SchemaError. Missing values become None."""
    if _is_missing(value):
        return None
    if not isinstance(value, (str, bytes)) and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()   # numpy / torch scalars
        if _is_missing(value):
            return None
    kind = spec.kind
    try:
        if kind == "string":
            if isinstance(value, str):
                return value
            if isinstance(value, (dict, list, tuple)):
                return json.dumps(value, default=str)
            return str(value)
        if kind == "int":
            if isinstance(value, bool):
                return int(value)
            if isinstance(value, numbers.Integral):
                return int(value)
            if isinstance(value, numbers.Real) and float(value).is_integer():
                return int(value)
            raise SchemaError("not an integer")
        if kind == "float":
            if isinstance(value, numbers.Real):
                f = float(value)
                return None if math.isnan(f) else f
            raise SchemaError("not a number")
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, numbers.Integral) and int(value) in (0, 1):
                return bool(value)
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            raise SchemaError("not a bool")
        if kind == "timestamp":
            if isinstance(value, (numbers.Real, bool)):
                raise SchemaError("numbers are ambiguous as timestamps")
            ts = pd.Timestamp(value)
            ts = ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")
            return ts.to_pydatetime()
        if kind == "list_float":
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, Iterable):
                raise SchemaError("not a list")
            out = []
            for x in value:
                if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
                    x = x.item()
                out.append(None if _is_missing(x) else float(x))
            return out
    except SchemaError as exc:
        raise SchemaError(f"column {spec.name!r} ({kind}): cannot store {value!r}: {exc}") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise SchemaError(f"column {spec.name!r} ({kind}): cannot store {value!r}: {exc}") from None
    raise AssertionError(kind)


def _infer_array(name: str, values: list[Any]) -> pa.Array:
    """Arrow array for an undeclared column; nested dicts (and anything Arrow cannot type) are stored as JSON."""
    values = [None if _is_missing(v) else v for v in values]
    values = [v.item() if (hasattr(v, "item") and getattr(v, "ndim", 1) == 0) else v for v in values]
    values = [v.isoformat() if isinstance(v, (_dt.date, _dt.time)) and not isinstance(v, _dt.datetime) else v
              for v in values]
    try:
        arr = pa.array(values, from_pandas=True)
        if not pa.types.is_struct(arr.type) and not pa.types.is_map(arr.type):
            return arr
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
        pass
    return pa.array([None if v is None else (v if isinstance(v, str) else json.dumps(v, default=str))
                     for v in values], type=pa.string())


def record_to_table(record: Mapping[str, Any], specs: Mapping[str, ColumnSpec] | None = None) -> pa.Table:
    """One-row Arrow table: declared columns in display order with their declared types (all of them, missing
    ones null), then undeclared keys with inferred types."""
    specs = run_specs() if specs is None else specs
    arrays, fields = [], []
    for name, spec in specs.items():
        arrays.append(pa.array([coerce_value(spec, record.get(name))], type=spec.arrow_type))
        fields.append(pa.field(name, spec.arrow_type))
    for name, value in record.items():
        if name in specs:
            continue
        if not isinstance(name, str):
            raise SchemaError(f"record keys must be strings, got {name!r}")
        arr = _infer_array(name, [value])
        arrays.append(arr)
        fields.append(pa.field(name, arr.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


# ---------------------------------------------------------------------------------------------- tables and frames

def _plain_type(t: pa.DataType) -> pa.DataType:
    """The type undeclared columns are kept in: large/dictionary/view variants folded to their plain form."""
    if pa.types.is_dictionary(t):
        return _plain_type(t.value_type)
    if pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t):
        return pa.string()
    if pa.types.is_large_list(t) or getattr(pa.types, "is_list_view", lambda _: False)(t):
        return pa.list_(_plain_type(t.value_type))
    return t


def _cast_column(name: str, col: pa.ChunkedArray, target: pa.DataType,
                 spec: ColumnSpec | None, on_problem: Callable[[str], None] | None) -> pa.ChunkedArray:
    if col.type == target:
        return col
    try:
        return col.cast(target, safe=not pa.types.is_timestamp(col.type))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        pass
    if spec is None:
        raise SchemaError(f"column {name!r}: cannot cast {col.type} to {target}")
    values, bad = [], 0
    for v in col.to_pylist():
        try:
            values.append(coerce_value(spec, v))
        except SchemaError:
            values.append(None)
            bad += 1
    if bad and on_problem is not None:
        on_problem(f"column {name!r}: {bad} value(s) of type {col.type} are not {spec.kind}; stored as null")
    return pa.chunked_array([pa.array(values, type=target)], type=target)


def conform_table(table: pa.Table, specs: Mapping[str, ColumnSpec] | None = None,
                  on_problem: Callable[[str], None] | None = None) -> pa.Table:
    """Cast declared columns present in `table` to their declared types; fold undeclared columns' types to plain
    forms. Values that cannot be cast become null and are reported through `on_problem(message)`."""
    specs = run_specs() if specs is None else specs
    cols, fields = [], []
    for field, col in zip(table.schema, table.columns):
        spec = specs.get(field.name)
        target = spec.arrow_type if spec is not None else _plain_type(field.type)
        cols.append(_cast_column(field.name, col, target, spec, on_problem))
        fields.append(pa.field(field.name, target))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def concat_tables(tables: list[pa.Table]) -> pa.Table:
    """Concatenate conformed tables whose column sets differ (missing columns become null). Undeclared columns
    whose types conflict across tables (say int in one file, str in another) are stored as strings."""
    if not tables:
        return pa.table({})
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        pass
    types: dict[str, set[pa.DataType]] = {}
    for t in tables:
        for f in t.schema:
            if not pa.types.is_null(f.type):
                types.setdefault(f.name, set()).add(f.type)
    conflicted = {name for name, ts in types.items() if len(ts) > 1}
    fixed = []
    for t in tables:
        for name in conflicted & set(t.column_names):
            i = t.column_names.index(name)
            values = [None if v is None else (v if isinstance(v, str) else json.dumps(v, default=str))
                      for v in t.column(i).to_pylist()]
            t = t.set_column(i, pa.field(name, pa.string()), pa.array(values, type=pa.string()))
        fixed.append(t)
    return pa.concat_tables(fixed, promote_options="permissive")


def complete_table(table: pa.Table, specs: Mapping[str, ColumnSpec] | None = None) -> pa.Table:
    """Add declared columns missing from `table` as nulls; order declared columns first, then the rest."""
    specs = run_specs() if specs is None else specs
    names = table.column_names
    cols, fields = [], []
    for name, spec in specs.items():
        if name in names:
            cols.append(table.column(name))
        else:
            cols.append(pa.nulls(table.num_rows, type=spec.arrow_type))
        fields.append(pa.field(name, spec.arrow_type))
    for field in table.schema:
        if field.name not in specs:
            cols.append(table.column(field.name))
            fields.append(field)
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def _types_mapper(t: pa.DataType) -> Any:
    if pa.types.is_integer(t):
        return pd.Int64Dtype()
    if pa.types.is_floating(t):
        return pd.Float64Dtype()
    if pa.types.is_boolean(t):
        return pd.BooleanDtype()
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pd.StringDtype()
    return None


def _listify(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, dict):
        return value
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [None if (isinstance(x, float) and math.isnan(x)) else x for x in value]
    return value


def table_to_frame(table: pa.Table, specs: Mapping[str, ColumnSpec] | None = None) -> pd.DataFrame:
    """pandas frame with the declared dtypes; list cells are Python lists (None for null, not NaN)."""
    specs = run_specs() if specs is None else specs
    df = table.to_pandas(types_mapper=_types_mapper)
    for field in table.schema:
        name = field.name
        if pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
            df[name] = pd.Series([_listify(v) for v in df[name]], index=df.index, dtype=object)
        elif pa.types.is_null(field.type):
            df[name] = pd.Series([None] * len(df), index=df.index, dtype=object)
        spec = specs.get(name)
        if spec is not None and spec.kind != "list_float" and df[name].dtype != spec.pandas_dtype:
            df[name] = df[name].astype(spec.pandas_dtype)
    return df


def frame_to_table(df: pd.DataFrame, specs: Mapping[str, ColumnSpec] | None = None) -> pa.Table:
    """Arrow table from a frame: declared columns in their declared types (SchemaError if a value does not fit),
    undeclared ones inferred (JSON text where Arrow cannot type them)."""
    specs = run_specs() if specs is None else specs
    cols, fields = [], []
    for name in df.columns:
        if not isinstance(name, str):
            raise SchemaError(f"column names must be strings, got {name!r}")
        series = df[name]
        spec = specs.get(name)
        try:
            arr = pa.chunked_array([pa.Array.from_pandas(series)])
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
            arr = None
        if spec is not None:
            if arr is not None:
                try:
                    arr = arr.cast(spec.arrow_type, safe=not pa.types.is_timestamp(arr.type))
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                    arr = None
            if arr is None:
                arr = pa.chunked_array([pa.array([coerce_value(spec, v) for v in series], type=spec.arrow_type)])
            target = spec.arrow_type
        else:
            if arr is None or pa.types.is_struct(arr.type) or pa.types.is_map(arr.type):
                arr = pa.chunked_array([_infer_array(name, list(series))])
            target = _plain_type(arr.type)
            arr = arr.cast(target) if arr.type != target else arr
        cols.append(arr)
        fields.append(pa.field(name, target))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))
