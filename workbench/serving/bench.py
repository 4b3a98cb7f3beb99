"""One serving benchmark: load the requests, serve them in flight, summarize; one result-store row per run.

    session = BenchSession.load(preset="tiny", device="cpu")       # the same loader as `bench`
    out = serve_bench(session, ServeConfig(method="ngram", k=3, rate=20.0, num_requests=12, max_new_tokens=16))
    out.record     # flat dict: the run row (config columns, vLLM-named serving metrics, environment)
    out.traces     # DataFrame: one row per (request, decode step): batch size, k, context length, drafted, accepted
    out.requests   # DataFrame: one row per request: prompt/output length, queue, TTFT, TPOT, E2EL, preemptions

Every method serves, trees and beams too (eagle, redrafter: their knobs are serving knobs, passed to `make_drafter`
as `bench` passes them). At temperature 0 the row records whether the served outputs equal each request's solo greedy
output (`greedy_matches_solo`, workbench/serving/fidelity.py), checked after the timed run.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, fields

import pandas as pd
import torch

from kernels.tuning import format_tuning, parse_tuning
from workbench import settings
from workbench.engine import SpecEngine
from workbench.engine.drafters import DrafterError, engine_target, make_drafter
from workbench.engine.step import engine_config
from workbench.engine.graphs import compile_fallback_columns, recompile_limit_hits
from workbench.engine.sampling import SamplingParams
from workbench.serving import metrics
from workbench.serving.adaptive import AdaptiveSpeculation, format_k_by_batch
from workbench.serving.config import SERVE_CONFIG_KNOBS, ServeConfig, ServeError, check_config
from workbench.serving.fidelity import solo_columns
from workbench.serving.loadgen import make_requests
from workbench.serving.loop import RealClock, ServeResult, ServingLoop, frozen_gc, verifies_shorter
from workbench.serving.tuning import format_serve_tuning, parse_serve_tuning

TRACE_COLUMNS = ["run_id", "seq", "step", "drafted", "accepted", "emitted", "batch_size", "k", "num_nodes",
                 "context_len", "step_ms"]


@dataclass
class ServeBenchResult:
    record: dict
    traces: pd.DataFrame
    requests: pd.DataFrame
    result: ServeResult


def engine_for(session, cfg) -> SpecEngine:
    """The engine a serving run uses: the one settings -> engine mapping (`engine_config`) and the drafter
    registry (`make_drafter`), over the session's models in the run's weight formats and its heads."""
    cfg = settings.resolve_config(cfg, session.device.type)[0]  # "auto" knobs for the session's device
    ecfg = engine_config(cfg, timing=True)
    if cfg.method == "draft" and session.draft is None:
        raise ServeError("method 'draft' needs a draft model: give --draft PATH or use a --preset")
    heads = {m: getattr(session, f"{m}_head") for m in settings.FEATURE_METHODS if hasattr(session, f"{m}_head")}
    try:
        drafter = make_drafter(cfg.method, cfg, draft=lambda: session.model_for("draft", cfg),
                               target=lambda: session.model_for("target", cfg), heads=heads)
    except DrafterError as e:  # a missing model; a tree the vocabulary cannot fill
        raise ServeError(str(e)) from None
    return SpecEngine(engine_target(session.target, drafter), drafter, ecfg, session.device)


def adaptive_for(cfg, num_nodes: int, k_by_batch: list[tuple[int, int, int]] | None = None, *,
                 tree: bool = False) -> AdaptiveSpeculation:
    """The adaptive rules of cfg; k_by_batch (ranges) replaces cfg.k_by_batch (a calibrated schedule). tree: the
    engine drafts trees or beams (`is_tree`): every rule then turns the whole tree on or off."""
    ranges = settings.parse_k_by_batch(cfg.k_by_batch) if k_by_batch is None else k_by_batch
    return AdaptiveSpeculation(num_nodes, ranges, cfg.spec_off_acceptance, cfg.spec_window, cfg.spec_max_context,
                               cfg.long_context_k, cfg.spec_off_queue, tree=tree)


def is_tree(engine: SpecEngine) -> bool:
    """Whether the engine's drafter is verified whole or not at all (trees, beams; `loop.verifies_shorter`)."""
    return not verifies_shorter(engine.drafter)


def calibration_sizes(cfg) -> tuple[int, ...]:
    """The batch sizes a calibration measures: the graph buckets below max_num_seqs, and max_num_seqs."""
    return tuple(b for b in cfg.graph_batch_sizes if b < cfg.max_num_seqs) + (cfg.max_num_seqs,)


def calibrate_schedule(engine: SpecEngine, cfg, requests, loop: ServingLoop) -> tuple[list, dict]:
    """cfg.calibration "step" or "loop" on the engine that will serve, with the run's prompts: (the schedule as
    k_by_batch ranges, the record's calibration columns). `loop`: the run's loop (its cache shape and its tuning are
    reused, so the calibration serves as the run will)."""
    from workbench.serving.calibrate import calibrate, calibrate_loop

    prompts = list({tuple(r.prompt): r.prompt for r in requests}.values())  # distinct, in order
    sizes = calibration_sizes(cfg)
    t0 = time.perf_counter()
    if cfg.calibration == "step":
        try:
            cal = calibrate(engine, prompts, sizes, max_len=loop.cache.max_len)
        except ServeError:  # the run's rows are too short for the calibration's steps: its own cache
            cal = calibrate(engine, prompts, sizes)
        ranges, table = cal.schedule(cfg.max_num_seqs), cal.table()
    else:
        cal = calibrate_loop(engine, prompts, sizes, max_new_tokens=cfg.max_new_tokens, max_num_seqs=cfg.max_num_seqs,
                             budget_s=cfg.calibration_budget_s, policy=cfg.sched_policy, num_blocks=loop.num_blocks,
                             prefill_chunk=cfg.prefill_chunk, prefix_caching=cfg.prefix_caching,
                             max_len=loop.cache.max_len, gc_freeze=cfg.gc_freeze, shape=cfg.calibration_shape,
                             repeats=cfg.calibration_repeats, tuning=loop.tuning)
        ranges, table = cal.schedule(cfg.max_num_seqs), cal.table()
    chosen = [{"batch_start": lo, "batch_end": hi, "k": k} for lo, hi, k in ranges]
    return ranges, {"calibration_s": time.perf_counter() - t0,
                    "calibration_table": json.dumps({"measured": table, "schedule": chosen,
                                                     **({"uniform": True} if getattr(cal, "uniform", False) else {})})}


def serve_bench(session, cfg, *, study: str | None = None, clock=None, engine: SpecEngine | None = None,
                requests=None) -> ServeBenchResult:
    """Serve cfg's load on the session's models; ServeError for bad settings or requests (before any work)."""
    from workbench.harness.telemetry import environment_info

    cfg, auto_knobs = settings.resolve_config(cfg, session.device.type,
                                              dtype_auto=getattr(session, "dtype_auto", False))
    check_config(cfg)
    try:
        SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    except ValueError as e:
        raise ServeError(str(e)) from None
    if requests is None:
        prompt_ids = session.encode(len(session.prompts)) if cfg.lengths == "file" else []
        requests = make_requests(cfg, prompt_ids, int(session.target.config.vocab_size))
    fallbacks_before = recompile_limit_hits()  # from here: the engine, its calibration and captures compile too
    engine = engine or engine_for(session, cfg)

    # the loop's own variants: the knob's record ("": ServeTuning's defaults); the calibration serves with it too
    tuning = parse_serve_tuning(cfg.serve_tuning)

    def make_loop(adaptive):
        return ServingLoop(engine, requests, policy=cfg.sched_policy, num_blocks=cfg.kv_blocks,
                           max_num_seqs=cfg.max_num_seqs, prefill_chunk=cfg.prefill_chunk,
                           prefix_caching=cfg.prefix_caching, adaptive=adaptive,
                           max_concurrency=cfg.max_concurrency, clock=clock or RealClock(), timing=True,
                           catch_up_max=cfg.spec_catch_up_max, tuning=tuning)

    adaptive = adaptive_for(cfg, engine.num_nodes, tree=is_tree(engine))
    loop = make_loop(adaptive)
    calibrated = {}
    if cfg.calibration != "off":  # the schedule measured now, on this engine; the run's loop afresh after it
        ranges, calibrated = calibrate_schedule(engine, cfg, requests, loop)
        adaptive = adaptive_for(cfg, engine.num_nodes, ranges, tree=is_tree(engine))
        loop = make_loop(adaptive)
    if cfg.cuda_graphs:  # before the clock starts, every (bucket, draft length) the adaptive rules can ask for
        engine.capture_graphs(cfg.max_num_seqs, node_counts=adaptive.node_counts(cfg.max_num_seqs),
                              max_prefill_tokens=max((len(r.prompt) for r in requests), default=0),
                              prefill_rows=max(1, min(tuning.batch_prefill, cfg.max_num_seqs)))
    graphs_before, eager_before = engine.graph_stats(), getattr(engine.prefill_step, "eager_chunks", 0)
    t0 = time.perf_counter()
    try:
        with frozen_gc(cfg.gc_freeze):  # gen-2 passes over everything alive would stall the run at random
            result = loop.run()
    except torch.cuda.OutOfMemoryError as e:
        raise ServeError(f"GPU out of memory serving max_num_seqs={cfg.max_num_seqs} kv_blocks={loop.num_blocks}: "
                         f"lower them ({str(e).splitlines()[0]})") from None
    if session.device.type == "cuda":
        torch.cuda.synchronize(session.device)
    wall = time.perf_counter() - t0
    in_run = engine.graph_stats().since(graphs_before)
    run_id = uuid.uuid4().hex
    rec = {"run_id": run_id, "study": study, "trial_id": None, "status": "ok", "error": None, "run_kind": "serve",
           **config_columns(cfg), "k": cfg.k if cfg.method != "ar" else 0,
           "kv_blocks": loop.num_blocks,  # the pool actually used (0 asks for the automatic size)
           "dtype": session.dtype, "device": str(session.device), "preset": session.preset,
           "target_path": session.target_path, "draft_path": session.draft_path if cfg.method == "draft"
           else session.eagle_head_source if cfg.method == "eagle"
           else session.eagle3_head_source if cfg.method == "eagle3" else None,  # the head's folder or "untrained"
           **(session.head_columns(cfg, engine.drafter) if hasattr(session, "head_columns") else {}),
           "prompts_source": session.prompts_source if cfg.lengths == "file" else "random", "paged": True,
           # batch stays empty: a serving run has no fixed batch; its row cap is the max_num_seqs column, the batch
           # it really ran is mean_batch_size (rows written before this change hold max_num_seqs in batch)
           "num_prompts": len(requests), "batch": None, "wall_s": wall, "auto_knobs": ",".join(auto_knobs),
           **metrics.summarize(result, cfg.slo_ttft_ms, cfg.slo_tpot_ms), **calibrated,
           **environment_info(str(session.device) if session.device.type == "cuda" else None)}
    # how the loop itself ran: stored, so that runs of different loops are never compared unawares (each variant
    # moves output tok/s by 1.06-1.35x); the tuning records resolved, every field
    rec["adaptive_granularity"] = adaptive.granularity if cfg.method != "ar" else None
    rec.update(loop_batch_prefill=result.batch_prefill, loop_overlap=result.overlap,
               loop_steps_ahead=result.steps_ahead, serve_tuning=format_serve_tuning(result.tuning),
               kernel_tuning=format_tuning(parse_tuning(cfg.kernel_tuning)))
    if calibrated:  # the schedule the run served with (config_json keeps the settings as given); a tree's on / off
        # as 1 / 0, as the knob reads it (its N nodes may exceed what the knob's k allows)
        rec["k_by_batch"] = format_k_by_batch([(lo, hi, int(k > 0)) for lo, hi, k in ranges] if is_tree(engine)
                                              else ranges)
    if cfg.method == "ar":
        for key in ("acceptance_rate", "mean_accepted_tokens", "tree_size_mean", "accepted_path_length_mean"):
            rec[key] = None
    for key in ("draft_catch_up_tokens", "draft_catch_up_forwards", "draft_catch_up_slots", "draft_prefill_tokens",
                "draft_catch_up_skips"):
        rec[key] = getattr(result, key) if engine.drafter is not None else None
    if cfg.cuda_graphs or cfg.compile != "off":
        # captures and eager fallbacks (a batch above every bucket) inside the served run: each one is a stall
        rec.update(graph_captures_in_run=len(in_run.captured), graph_misses_in_run=in_run.misses)
        if cfg.prefill_graphs:
            rec["prefill_eager_chunks"] = getattr(engine.prefill_step, "eager_chunks", 0) - eager_before
        g = engine.graph_stats()
        rec.update(graph_capture_s=g.capture_s, graph_memory_mb=g.memory_bytes / 2**20, graph_bucket_hits=g.hits,
                   graph_bucket_misses=g.misses, graph_padding_waste=g.padding_waste)
    if cfg.compile != "off":  # frames past dynamo's recompile limit run eagerly
        rec.update(compile_fallback_columns(fallbacks_before))
    traces = pd.DataFrame([{"run_id": run_id, "seq": t.request, **{k: getattr(t, k) for k in (
        "step", "drafted", "accepted", "emitted", "batch_size", "k", "num_nodes", "context_len", "step_ms")}}
        for t in result.traces], columns=TRACE_COLUMNS)
    requests_df = metrics.request_rows(result)
    requests_df.insert(0, "run_id", run_id)
    # last, after every engine statistic was read: the solo decodes run on an engine of their own, untimed
    rec.update(solo_columns(engine, cfg, requests, result.outputs, getattr(session, "divergence_margins", None),
                            str(session.dtype)))
    return ServeBenchResult(rec, traces, requests_df, result)


def config_columns(cfg) -> dict:
    cols = {k.name: k.column(getattr(cfg, k.name)) for k in SERVE_CONFIG_KNOBS}
    cols["config_json"] = json.dumps(asdict(cfg), sort_keys=True)
    return cols


def failed_record(cfg, error: str, study: str | None = None) -> dict:
    from workbench.harness.telemetry import environment_info

    rec = {f.name: (getattr(cfg, f.name) if not isinstance(getattr(cfg, f.name), tuple)
                    else ",".join(map(str, getattr(cfg, f.name)))) for f in fields(cfg)}
    for knob in SERVE_CONFIG_KNOBS:  # an unresolved "auto" cannot sit in a bool column: config_json keeps it
        if knob.kind == "bool" and not isinstance(rec.get(knob.name), bool):
            rec[knob.name] = None
    return {**rec, "run_id": uuid.uuid4().hex, "study": study, "status": "failed", "error": error,
            "run_kind": "serve", "config_json": json.dumps(asdict(cfg), sort_keys=True, default=repr),
            **environment_info()}


__all__ = ["ServeBenchResult", "ServeConfig", "serve_bench", "engine_for", "adaptive_for", "is_tree",
           "calibrate_schedule", "calibration_sizes", "config_columns"]
