"""`python -m workbench serve-bench`: in-flight batching under a request load, printed and stored.

One result-store row per run (default `results/store`, `--store DIR`, `--no-store` to skip), its per-(request, step)
traces and its per-request rows beside it. Every flag comes from workbench.settings (SERVE_RUN_KNOBS + SERVE_KNOBS).
Exit status: 0 ok, 2 bad settings or a failed run (stored as a failed row), 3 the store could not be written.

    python -m workbench serve-bench --preset tiny --method ngram --k 3 --rate 20 --num-requests 12 \\
        --max-new-tokens 16 --json

With --endpoint URL the same load goes to an OpenAI-compatible server (vLLM, SGLang, `workbench serve`) instead of
the in-process engine (workbench/serving/endpoint.py); --model then names the served model (default: the first of
its /v1/models), and the row records the endpoint, the engine's name and version:

    python -m workbench serve-bench --endpoint http://127.0.0.1:8000 --prompts question.jsonl --rate 4
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from workbench.harness.bench_cli import (_store, _store_or_report, add_knob, add_output_args, add_session_args,
                                         print_record, prompts_for, set_threads)

HEADLINE = ["method", "k", "rate", "completed", "request_throughput", "output_throughput", "goodput", "ttft_ms_p50",
            "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p99", "e2el_ms_p99", "queue_ms_mean", "preemptions",
            "kv_cache_util_mean", "prefix_hit_rate", "mean_batch_size", "acceptance_rate", "acceptance_by_batch_size",
            "tree_size_mean", "greedy_matches_solo", "greedy_solo_compared"]
GROUPS = {"method": "method", "run": "run settings", "sampling": "sampling", "system": "system", "load": "load",
          "serving": "scheduler and cache", "adaptive": "adaptive speculation"}


def register(sub: argparse._SubParsersAction) -> None:
    from workbench.serving.config import SERVE_CONFIG_KNOBS

    p = sub.add_parser("serve-bench", help="serve a request load with in-flight batching and report vLLM-style "
                       "serving metrics", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_session_args(p, "prompt file (lengths file)")
    groups = {name: p.add_argument_group(title) for name, title in GROUPS.items()}
    for knob in SERVE_CONFIG_KNOBS:
        add_knob(groups[knob.group], knob)
    p.add_argument("--endpoint", metavar="URL", help="benchmark the OpenAI-compatible server at URL (streamed "
                   "/v1/completions; acceptance from its /metrics) instead of the in-process engine; --model is then "
                   "the served model's name")
    add_output_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from workbench.harness.bench import BenchError, BenchSession
    from workbench.serving.bench import ServeConfig, failed_record, serve_bench
    from workbench.serving.config import ServeError, check_config

    set_threads(args)
    cfg = ServeConfig(**{f.name: getattr(args, f.name) for f in fields(ServeConfig)})
    store = _store(args)
    try:
        check_config(cfg)  # bad settings (a tree that cannot be built, ...) before any model loads
    except ServeError as e:
        print(f"error: {e}", file=sys.stderr)
        if store is not None:
            _store_or_report(store, failed_record(cfg, str(e), args.study))
        return 2
    if args.endpoint:
        return endpoint_main(args, cfg, store)
    preset = args.preset if args.preset or args.model else "tiny"
    prompts = prompts_for(args)  # --model without --prompts: the built-in set, as bench does
    try:
        session = BenchSession.load(preset=preset, model=args.model, draft=args.draft, device=args.device,
                                    dtype=args.dtype, prompts=prompts, draft_head=args.draft_head)
        out = serve_bench(session, cfg, study=args.study)
    except (BenchError, ServeError) as e:
        print(f"error: {e}", file=sys.stderr)
        if store is not None:
            _store_or_report(store, failed_record(cfg, str(e), args.study))
        return 2
    rec = out.record
    print_record(rec, args, HEADLINE, 26)
    if store is not None and not _store_or_report(store, rec, out.traces, requests=out.requests):
        return 3
    return 0


def endpoint_main(args: argparse.Namespace, cfg, store) -> int:
    """serve-bench --endpoint: the load against a running server; its row stored as in-process rows are."""
    from workbench.harness.bench_cli import builtin_prompts
    from workbench.harness.prompts import PromptFileError, load_prompts
    from workbench.serving.bench import failed_record
    from workbench.serving.config import ServeError
    from workbench.serving.endpoint import endpoint_bench
    from workbench.zoo import ZooError, resolve_preset

    try:
        path = args.prompts or (str(resolve_preset(args.preset).prompts_path) if args.preset else builtin_prompts())
        prompts = [p.text for p in load_prompts(path)]
        out = endpoint_bench(args.endpoint, cfg, prompts, model=args.model, study=args.study, prompts_source=path)
    except (ServeError, PromptFileError, ZooError) as e:
        print(f"error: {e}", file=sys.stderr)
        if store is not None:
            _store_or_report(store, {**failed_record(cfg, str(e), args.study), "endpoint": args.endpoint})
        return 2
    rec = out.record
    print_record(rec, args, ENDPOINT_HEADLINE, 26)
    if store is not None and not _store_or_report(store, rec, requests=out.requests):
        return 3
    return 0 if rec["status"] == "ok" else 2


ENDPOINT_HEADLINE = ["endpoint", "engine_name", "engine_version", "served_model", "rate", "completed",
                     "failed_requests", "request_throughput", "output_throughput", "ttft_ms_p50", "ttft_ms_p99",
                     "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p99", "e2el_ms_p99", "server_ttft_ms_mean",
                     "server_queue_ms_mean", "server_prefill_ms_mean", "acceptance_rate", "mean_accepted_tokens",
                     "acceptance_source"]
