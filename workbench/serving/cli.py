"""`python -m workbench serve-bench`: in-flight batching under a request load, printed and stored.

One result-store row per run (default `results/store`, `--store DIR`, `--no-store` to skip), its per-(request, step)
traces and its per-request rows beside it. Every flag comes from workbench.settings (SERVE_RUN_KNOBS + SERVE_KNOBS).
Exit status: 0 ok, 2 bad settings or a failed run (stored as a failed row), 3 the store could not be written.

    python -m workbench serve-bench --preset tiny --method ngram --k 3 --rate 20 --num-requests 12 \\
        --max-new-tokens 16 --json
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from workbench import settings
from workbench.harness.bench_cli import _store, _store_or_report, add_knob

HEADLINE = ["method", "k", "rate", "completed", "request_throughput", "output_throughput", "goodput", "ttft_ms_p50",
            "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p99", "e2el_ms_p99", "queue_ms_mean", "preemptions",
            "kv_cache_util_mean", "prefix_hit_rate", "mean_batch_size", "acceptance_rate", "acceptance_by_batch_size"]
GROUPS = {"method": "method", "run": "run settings", "sampling": "sampling", "system": "system", "load": "load",
          "serving": "scheduler and cache", "adaptive": "adaptive speculation"}


def register(sub: argparse._SubParsersAction) -> None:
    from workbench.serving.config import SERVE_CONFIG_KNOBS

    p = sub.add_parser("serve-bench", help="serve a request load with in-flight batching and report vLLM-style "
                       "serving metrics", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = p.add_argument_group("models and prompts")
    models.add_argument("--preset", help="a zoo preset (e.g. tiny); default tiny when --model is not given")
    models.add_argument("--model", help="target model: Hugging Face folder or .gguf file")
    models.add_argument("--draft", help="draft model folder (method draft)")
    models.add_argument("--prompts", help="prompt file (lengths file)")
    models.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    models.add_argument("--threads", type=int, help="torch CPU threads")
    for knob in settings.SESSION_KNOBS:
        add_knob(models, knob)
    groups = {name: p.add_argument_group(title) for name, title in GROUPS.items()}
    for knob in SERVE_CONFIG_KNOBS:
        add_knob(groups[knob.group], knob)
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the run record as one JSON object")
    out.add_argument("--store", help="result store folder (default: results/store or $WORKBENCH_STORE)")
    out.add_argument("--no-store", action="store_true", help="do not write to the result store")
    out.add_argument("--study", help="study name to file the row under")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from workbench.harness.bench import BenchError, BenchSession
    from workbench.serving.bench import ServeConfig, failed_record, serve_bench
    from workbench.serving.config import ServeError

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = ServeConfig(**{f.name: getattr(args, f.name) for f in fields(ServeConfig)})
    store = _store(args)
    preset = args.preset if args.preset or args.model else "tiny"
    try:
        session = BenchSession.load(preset=preset, model=args.model, draft=args.draft, device=args.device,
                                    dtype=args.dtype, prompts=args.prompts)
        out = serve_bench(session, cfg, study=args.study)
    except (BenchError, ServeError) as e:
        print(f"error: {e}", file=sys.stderr)
        if store is not None:
            _store_or_report(store, failed_record(cfg, str(e), args.study))
        return 2
    rec = out.record
    if args.json:
        print(json.dumps(rec, default=str), flush=True)
    else:
        for key in HEADLINE:
            print(f"{key:>26}: {rec.get(key)}")
        sys.stdout.flush()
    if store is not None:
        from results.store import StoreError

        try:
            store.append(rec, out.traces, requests=out.requests)
        except (StoreError, OSError) as e:
            print(f"error: the run was not stored: {e}", file=sys.stderr)
            return 3
    return 0
