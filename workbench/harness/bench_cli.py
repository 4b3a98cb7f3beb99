"""`python -m workbench bench`: one benchmark (baseline + candidate in one process), printed and stored.

Every run lands as a row in the result store (default `results/store`, `--store DIR`, `--no-store` to skip);
a run that fails (bad settings, out of memory) is stored as a failed row with its reason and exits with status 2.
The record is printed before it is stored: a store that cannot be written (a file, read-only, full) is named on
stderr after the printed record and the exit status is 3, so the measurement is not lost.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from workbench import settings
from workbench.harness.bench import BenchConfig

HEADLINE = ["method", "k", "batch", "acceptance_rate", "mean_accepted_tokens", "tokens_per_s", "ar_tokens_per_s",
            "speedup_vs_ar", "speedup_ci_low", "speedup_ci_high", "noisy_reason", "implausible_reason", "ttft_ms", "tpot_ms_p50", "tpot_ms_p99", "greedy_matches_ar", "sm_util_pct",
            "gpu_busy_pct", "device_name"]
GROUPS = {"method": "method", "run": "run settings", "sampling": "sampling", "system": "system"}


def _escaped(help_text: str) -> str:
    """argparse formats help strings with %: a literal percent sign (e.g. "within 2 %") must be doubled."""
    return help_text.replace("%", "%%")


def add_knob(group: argparse._ArgumentGroup, knob: settings.Knob) -> None:
    """One flag per knob (workbench.settings): a boolean is a --x / --no-x pair, a list is comma-separated."""
    if knob.kind == "bool":
        group.add_argument(knob.flag, default=knob.default, action=argparse.BooleanOptionalAction,
                           help=_escaped(knob.help))
        return

    def parse(text: str):
        try:
            return knob.parse(text)
        except settings.SettingError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    metavar = "N,N,..." if knob.kind == "ints" else None
    # a string default goes through `parse` like a typed value, and --help shows it as it would be typed
    group.add_argument(knob.flag, dest=knob.name, type=parse, default=knob.format(knob.default), choices=knob.choices,
                       metavar=metavar, help=_escaped(knob.help))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark a drafting method against our autoregressive baseline",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_session_args(p, "prompt file: JSONL {\"prompt\": ...} or MT-bench/Spec-Bench question.jsonl (default: "
                        "the preset's held-out prompts; with --model, the built-in set of the tiny preset)")
    groups = {name: p.add_argument_group(title) for name, title in GROUPS.items()}
    for knob in settings.RUN_KNOBS:
        add_knob(groups[knob.group], knob)
    add_output_args(p)
    p.set_defaults(func=main)


def add_session_args(p: argparse.ArgumentParser, prompts_help: str | None) -> None:
    """The "models and prompts" flags of every run command (bench, serve-bench, serve): what BenchSession.load
    reads; prompts_help None: no --prompts (a server has no prompt set)."""
    models = p.add_argument_group("models and prompts" if prompts_help else "models")
    models.add_argument("--preset", help="a zoo preset (e.g. tiny); default tiny when --model is not given")
    models.add_argument("--model", help="target model: Hugging Face folder or .gguf file")
    models.add_argument("--draft", help="draft model folder (method draft)")
    models.add_argument("--draft-head", help="a published draft-head checkpoint folder (config.json + "
                        "model.safetensors or pytorch_model.bin) in the EAGLE-1/2 layout (run with --method eagle) or "
                        "the EAGLE-3 layout (--method eagle3); checked against the target; default: the head beside "
                        "the target (zoo train-head), else an untrained one")
    if prompts_help:
        models.add_argument("--prompts", help=prompts_help)
    models.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    models.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; fewer threads "
                        "than cores keeps CPU timings steadier when other work shares the machine)")
    for knob in settings.SESSION_KNOBS:
        add_knob(models, knob)


def add_output_args(p: argparse.ArgumentParser) -> None:
    """The "output" flags of every run command: --json, --store DIR, --no-store, --study."""
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the run record as one JSON object")
    out.add_argument("--store", help="result store folder (default: results/store or $WORKBENCH_STORE)")
    out.add_argument("--no-store", action="store_true", help="do not write to the result store")
    out.add_argument("--study", help="study name to file the row under")


def set_threads(args: argparse.Namespace) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def _store(args):
    if args.no_store:
        return None
    from results.store import ResultStore
    return ResultStore(args.store) if args.store else ResultStore()


def _store_or_report(store, record, traces=None, **parts) -> bool:
    """Append to the store (`parts`: further tables, e.g. requests=); on failure name the store problem on stderr and
    return False (no traceback)."""
    from results.store import StoreError
    try:
        store.append(record, traces, **parts)
    except (StoreError, OSError) as e:
        print(f"error: the run was not stored: {e}", file=sys.stderr)
        return False
    return True


def print_record(rec: dict, args: argparse.Namespace, headline: list[str], width: int) -> None:
    """The record on stdout: one JSON object (--json; without the telemetry timeline) or its headline keys."""
    if args.json:
        print(json.dumps({k: v for k, v in rec.items() if k != "telemetry_timeline"}, default=str), flush=True)
        return
    for key in headline:
        print(f"{key:>{width}}: {rec.get(key)}")
    sys.stdout.flush()


def builtin_prompts() -> str:
    """The prompt set of a `--model` run given no --prompts: the held-out prompts shipped with the tiny preset (64 code
    snippets, plain text, so any model's tokenizer reads them)."""
    from workbench.zoo.presets import preset_home

    return str(preset_home("tiny") / "prompts.jsonl")


def prompts_for(args: argparse.Namespace) -> str | None:
    """--prompts, else for --model the built-in set (named on stderr), else None (a preset brings its own)."""
    if args.prompts is not None or args.model is None or args.preset is not None:
        return args.prompts
    path = builtin_prompts()
    print(f"prompts: none given, using the built-in set {path} (held-out code prompts of the tiny preset); "
          "--prompts FILE to choose", file=sys.stderr, flush=True)
    return path


def main(args: argparse.Namespace) -> int:
    if args.tp_size > 1:  # one process per rank, started here; rank 0 prints and stores
        from workbench.harness.tp_launch import launch

        def failed(message: str) -> None:
            print(f"error: {message}", file=sys.stderr)
            store = _store(args)
            if store is not None:
                _store_or_report(store, _failed_row(args, message, None))

        return launch(args, run_rank, failed)
    return run_rank(args, 0, 1, None)


def _preset(args: argparse.Namespace) -> str | None:
    return args.preset if args.preset or args.model else "tiny"


def _failed_row(args: argparse.Namespace, message: str, session) -> dict:
    from workbench.harness.bench import failed_record

    asked = dict(preset=_preset(args), target_path=args.model, draft_path=args.draft, draft_head=args.draft_head,
                 dtype=args.dtype, device=args.device, prompts_source=_quiet_prompts(args))  # what failed to load
    return failed_record(_config(args), message, study=args.study, session=session, asked=asked)


def _config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(**{f.name: getattr(args, f.name) for f in fields(BenchConfig)})


def run_rank(args: argparse.Namespace, rank: int, world: int, port: int | None) -> int:
    """One process's run: the whole run when world is 1; else rank `rank` of a tensor-parallel run (its process
    group joined, its target sharded), where a BenchError is raised for the launcher to report and rank 0 alone
    prints and stores."""
    import torch

    from workbench.harness.bench import BenchError, BenchSession

    set_threads(args)
    cfg = _config(args)
    lead = rank == 0
    store = _store(args) if lead else None
    preset = _preset(args)
    prompts = prompts_for(args) if lead else _quiet_prompts(args)
    session = None

    def progress(frac: float, msg: str) -> None:
        if lead:
            print(json.dumps({"progress": round(frac, 3), "message": msg}), file=sys.stderr, flush=True)

    try:
        device = args.device
        if world > 1:
            from workbench.engine.tp import TensorParallelError, init_tp, shard_llama_
            from workbench.harness.tp_launch import rank_device

            device = rank_device(args.device, rank, world)
            group = init_tp(rank, world, port, torch.device(device))
        session = BenchSession.load(preset=preset, model=args.model, draft=args.draft, device=device,
                                    dtype=args.dtype, prompts=prompts, draft_head=args.draft_head)
        if world > 1:
            try:
                shard_llama_(session.target, rank, world, group)
            except TensorParallelError as e:
                raise BenchError(f"{session.target_path}: {e}") from None
        result = session.run(cfg, study=args.study, progress=progress)
    except BenchError as e:
        if world > 1:
            raise  # the launcher names it and stores the failed row once
        print(f"error: {e}", file=sys.stderr)
        if store is not None:
            _store_or_report(store, _failed_row(args, str(e), session))
        return 2
    finally:
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if not lead:
        return 0
    rec = result.record
    print_record(rec, args, HEADLINE, 22)
    if store is not None and not _store_or_report(store, rec, result.traces):
        return 3
    return 0


def _quiet_prompts(args: argparse.Namespace) -> str | None:
    """prompts_for without its note on stderr (rank 0 prints it once)."""
    if args.prompts is not None or args.model is None or args.preset is not None:
        return args.prompts
    return builtin_prompts()
