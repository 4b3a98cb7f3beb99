"""`python -m workbench serve`: the engine behind an OpenAI-compatible HTTP API (workbench/serving/server.py).

Every engine, method and serving flag is serve-bench's (workbench.settings: the run knobs and the scheduler, cache
and adaptive-speculation knobs; not the load generator's, which a server has no use for). --max-new-tokens is the
default max_tokens of a request that gives none; sampling (--temperature, --top-k, --top-p, --seed) is the server's.

    python -m workbench serve --preset tiny --method ngram --k 3 --port 8000
    curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"model": "tiny", "prompt": "def fib(n):", "max_tokens": 32}'

Exit status: 0 after a clean shutdown (Ctrl-C), 2 bad settings or models.
"""
from __future__ import annotations

import argparse
import gc
import sys

from workbench.harness.bench_cli import add_knob, add_session_args, set_threads
from workbench.serving.cli import GROUPS

# serve-bench knobs a server does not read: the load generator's, the greedy check's and the calibration's (a
# calibration needs a run's prompts)
NOT_SERVED = {"greedy_check_requests", "calibration", "calibration_shape", "calibration_budget_s",
              "calibration_repeats"}


def served_knobs():
    from workbench.serving.config import SERVE_CONFIG_KNOBS

    return [k for k in SERVE_CONFIG_KNOBS if k.group != "load" and k.name not in NOT_SERVED]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the engine behind an OpenAI-compatible HTTP API (completions, chat, "
                       "streaming, Prometheus /metrics)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_session_args(p, None)
    http = p.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only; 0.0.0.0 "
                      "exposes the server to the network, with no authentication)")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--served-model-name", help="the model name clients send (default: the preset name or the "
                      "model folder's name)")
    http.add_argument("--max-model-len", type=int, default=0, help="KV slots of a cache row: prompt + max_tokens "
                      "must fit (default 0: the target's context)")
    http.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                      help="uvicorn's log level")
    http.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                      help="run the engine in a process of its own, apart from the HTTP event loop (default; "
                      "--no-engine-process: one process, the engine on a thread that shares the interpreter lock "
                      "with the HTTP layer). /v1/models shows which (engine_process)")
    groups = {name: p.add_argument_group(title) for name, title in GROUPS.items() if name != "load"}
    for knob in served_knobs():
        add_knob(groups[knob.group], knob)
    p.set_defaults(func=main)


def config_from_args(args: argparse.Namespace):
    from workbench.serving.config import ServeConfig

    return ServeConfig(**{k.name: getattr(args, k.name) for k in served_knobs()})


def main(args: argparse.Namespace) -> int:
    from workbench.harness.bench import BenchError, BenchSession
    from workbench.harness.bench_cli import builtin_prompts
    from workbench.harness.telemetry import _git_commit
    from workbench.serving.config import ServeError, check_config
    from workbench.serving.engine_proc import EngineProcess
    from workbench.serving.server import build_server, create_app

    set_threads(args)
    if args.max_model_len < 0:
        print(f"error: --max-model-len must be >= 0 (0 = the target's context), got {args.max_model_len}",
              file=sys.stderr)
        return 2
    cfg = config_from_args(args)
    try:
        check_config(cfg)  # bad settings before any model loads
        preset = args.preset if args.preset or args.model else "tiny"
        load = dict(preset=preset, model=args.model, draft=args.draft, device=args.device, dtype=args.dtype,
                    prompts=builtin_prompts(),  # the loader wants a prompt set
                    draft_head=args.draft_head)
        built = dict(max_model_len=args.max_model_len, name=args.served_model_name, version=_git_commit())
        if args.engine_process:
            engine = EngineProcess({"session": load, "cfg": cfg, "threads": args.threads, **built})
            served = engine.launch()
            app = create_app(engine, served)
            if cfg.gc_freeze:  # the app's long-lived objects too (the child froze the engine's)
                gc.collect()
                gc.freeze()
        else:
            app, _, served = build_server(BenchSession.load(**load), cfg, **built)
            served.info["engine_process"] = False
    except (BenchError, ServeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    print(f"serving {served.name} ({cfg.method}) on http://{args.host}:{args.port}/v1 "
          f"(rows of {served.max_model_len} KV slots, {served.info['kv_blocks']} blocks)", file=sys.stderr, flush=True)
    # SIGINT / SIGTERM: open streams get 10 s to finish, then the engine stops and fails what is left
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10)
    finally:  # uvicorn re-raises the signal that stopped it: the frozen heap goes back to the collector first (a
        gc.unfreeze()  # frozen heap at exit made nanobind report triton's objects as leaked)
    return 0
