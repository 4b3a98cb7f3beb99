"""`python -m workbench zoo list | train PRESET [--out DIR] [--max-seconds S] ... | prompts PRESET [--dir DIR]
| train-head --kind redrafter|eagle --preset PRESET [--max-seconds S] [--max-tokens N] [--eval-every N]
[--patience K] [--resume] [--data corpus|self] [--device cpu] [--seed N] [--out DIR]`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workbench.zoo.presets import PRESETS, ZooError, preset_home, resolve_dir, resolve_preset, train_command


def register(subparsers) -> None:
    zoo = subparsers.add_parser("zoo", help="offline target/draft model presets", description=__doc__)
    sub = zoo.add_subparsers(dest="zoo_command", required=True)

    ls = sub.add_parser("list", help="presets, whether trained, sizes, held-out perplexities")
    ls.set_defaults(func=cmd_list)

    train = sub.add_parser("train", help="train a preset (corpus -> tokenizer -> target -> draft)")
    train.add_argument("preset", choices=sorted(PRESETS))
    train.add_argument("--out", default=None, help="output folder (default: the preset's home, see `zoo list`)")
    train.add_argument("--max-seconds", type=float, default=None,
                       help="total training budget, split target/draft as the preset does (default: the preset's)")
    train.add_argument("--max-steps", type=int, default=None, help="cap on optimizer steps per model (smoke runs)")
    train.add_argument("--device", choices=["cuda", "cpu"], default=None,
                       help="default: cuda when available, else cpu")
    train.set_defaults(func=cmd_train)

    prompts = sub.add_parser("prompts", help="re-cut prompts.jsonl of a trained preset from its held-out files")
    prompts.add_argument("preset", choices=sorted(PRESETS))
    prompts.add_argument("--dir", default=None, help="the trained preset folder (default: the preset's home)")
    prompts.set_defaults(func=cmd_prompts)

    head = sub.add_parser("train-head", help="distil a draft head (ReDrafter, EAGLE or EAGLE-3) from a trained "
                          "preset's frozen target")
    head.add_argument("--kind", choices=["redrafter", "eagle", "eagle3"], default="redrafter")
    head.add_argument("--preset", choices=sorted(PRESETS), required=True)
    head.add_argument("--dir", default=None, help="the trained preset folder (default: the preset's home)")
    head.add_argument("--out", default=None, help="head folder (default: <preset folder>/<kind>)")
    head.add_argument("--max-seconds", type=float, default=None,
                      help="wall-time budget of the training loop (default: the recipe's)")
    head.add_argument("--max-steps", type=int, default=None, help="cap on optimizer steps")
    head.add_argument("--max-tokens", type=int, default=None,
                      help="training tokens seen (steps x batch x seq len); the first budget reached stops")
    head.add_argument("--eval-every", type=int, default=None,
                      help="steps between held-out evaluations (curve, progress line, best weights; 0 = only at "
                           "the end; default: the recipe's)")
    head.add_argument("--patience", type=int, default=None,
                      help="stop after K evaluations without a better held-out expected accepted tokens (0 = never)")
    head.add_argument("--resume", action="store_true",
                      help="continue from the head folder's checkpoint (train_state.pt); the recipe must match")
    head.add_argument("--data", choices=["corpus", "self"], default=None,
                      help="corpus: the preset's text; self: the target's greedy continuations of corpus prompts "
                           "(generated once, cached in the head folder). Default: corpus")
    head.add_argument("--self-tokens", type=int, default=None,
                      help="with --data self: training tokens to generate (default: train windows x seq len)")
    head.add_argument("--batch-size", type=int, default=None, help="windows per step (default: the recipe's)")
    head.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    head.add_argument("--train-windows", type=int, default=None, help="training windows (default: the recipe's)")
    head.add_argument("--eval-windows", type=int, default=None, help="held-out windows (default: the recipe's)")
    head.add_argument("--seed", type=int, default=None, help="initialisation and batch order (default: the recipe's)")
    head.add_argument("--device", choices=["cuda", "cpu"], default="cpu")
    head.add_argument("--style", choices=["workbench", "eagle"], default=None,
                      help="--kind eagle: the head's structure; eagle = the published EAGLE-1/2 one (exportable with "
                      "export-head), workbench = ours (an input norm on the layer, the target's final norm after it)")
    head.add_argument("--draft-vocab", type=int, default=None,
                      help="--kind eagle3: tokens of the draft vocabulary, the most frequent in the training windows "
                      "(default: the whole vocabulary)")
    head.add_argument("--eagle3-layers", default=None, help="--kind eagle3: the three target layers, 'i,j,k' or auto")
    head.set_defaults(func=cmd_train_head)

    export = sub.add_parser("export-head", help="write a trained head in its published layout (EAGLE-1/2 or EAGLE-3), "
                            "for vLLM, SGLang, TensorRT-LLM or the EAGLE code; load it back with --draft-head")
    export.add_argument("--kind", choices=["eagle", "eagle3"], required=True)
    export.add_argument("--preset", choices=sorted(PRESETS), required=True)
    export.add_argument("--dir", default=None, help="the trained preset folder (default: the preset's home)")
    export.add_argument("--head", default=None, help="the head folder (default: <preset folder>/<kind>)")
    export.add_argument("--out", required=True, help="the folder to write (config.json + model.safetensors)")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                        help="the dtype of the written weights")
    export.add_argument("--hot-vocab", type=int, default=0,
                        help="eagle: also write hot_tokens_N.pt, the head's N most frequent token ids (SGLang's "
                             "--speculative-token-map, FR-Spec; the engine's hot_vocab knob)")
    export.set_defaults(func=cmd_export_head)


def _fmt_ppl(section: dict | None) -> str:
    ppl = (section or {}).get("heldout_ppl")
    return f"{ppl:.2f}" if isinstance(ppl, (int, float)) else "-"


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.1f}M"


SIZE_UNIT = "MiB"  # model sizes on disk, in `zoo list` and on the dashboard's Models page alike


def disk_mib(path: Path) -> float | None:
    """Bytes on disk of a file or a folder (all files under it) in MiB (2**20 bytes); None when it cannot be read."""
    path = Path(path)
    try:
        if path.is_file():
            return path.stat().st_size / 2**20
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20
    except OSError:
        return None


def fmt_mib(mib: float | None) -> str:
    """A size from `disk_mib` as `zoo list` prints it: '12.3' (MiB), '-' when unknown.

    >>> fmt_mib(1536 / 1024), fmt_mib(None)
    ('1.5', '-')
    """
    return "-" if mib is None else f"{mib:,.1f}"


def cmd_list(args: argparse.Namespace) -> int:
    rows = [("preset", "trained", "target", "draft", "vocab", "ppl target", "ppl draft", SIZE_UNIT, "where / how")]
    for name, preset in PRESETS.items():
        target = _fmt_params(preset.target.param_count(preset.vocab_size))
        draft = _fmt_params(preset.draft.param_count(preset.vocab_size))
        try:
            paths = resolve_preset(name)
        except ZooError:
            rows.append((name, "no", target, draft, str(preset.vocab_size), "-", "-", "-", train_command(name)))
            continue
        m = paths.manifest
        rows.append((name, f"yes ({m.get('device', '?')})", _fmt_params(m["target"]["params"]),
                     _fmt_params(m["draft"]["params"]), str(m.get("tokenizer", {}).get("vocab_size", "?")),
                     _fmt_ppl(m.get("target")), _fmt_ppl(m.get("draft")), fmt_mib(disk_mib(paths.root)),
                     str(preset_home(name))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


def cmd_prompts(args: argparse.Namespace) -> int:
    from workbench.zoo.heldout_prompts import regenerate

    try:
        paths = resolve_dir(args.dir, args.preset) if args.dir else resolve_preset(args.preset)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    regenerate(paths.root)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from workbench.zoo.train import train_preset

    try:
        paths = train_preset(args.preset, out=args.out, device=args.device, max_seconds=args.max_seconds,
                             max_steps=args.max_steps)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = paths.manifest
    print(f"trained {args.preset} -> {paths.root}: target ppl {_fmt_ppl(m['target'])}, draft ppl {_fmt_ppl(m['draft'])}")
    return 0


def cmd_train_head(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from workbench.zoo.train_eagle import EagleTrainSpec, train_eagle_head
    from workbench.zoo.train_eagle3 import Eagle3TrainSpec, train_eagle3_head
    from workbench.zoo.train_head import HeadTrainSpec, train_redrafter_head

    recipe, train = {"redrafter": (HeadTrainSpec, train_redrafter_head),
                     "eagle": (EagleTrainSpec, train_eagle_head),
                     "eagle3": (Eagle3TrainSpec, train_eagle3_head)}[args.kind]
    for flag, value, kinds in (("--style", args.style, ("eagle",)), ("--draft-vocab", args.draft_vocab, ("eagle3",)),
                               ("--eagle3-layers", args.eagle3_layers, ("eagle3",))):
        if value is not None and args.kind not in kinds:
            print(f"error: {flag} applies to --kind {' / '.join(kinds)}, not {args.kind}", file=sys.stderr)
            return 2
    if args.eagle3_layers is not None:
        from workbench.settings import parse_aux_layers

        try:
            parse_aux_layers(args.eagle3_layers)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    overrides = {"max_seconds": args.max_seconds, "max_steps": args.max_steps, "max_tokens": args.max_tokens,
                 "eval_every": args.eval_every, "patience": args.patience, "data": args.data,
                 "self_tokens": args.self_tokens, "batch_size": args.batch_size, "lr": args.lr,
                 "train_windows": args.train_windows, "eval_windows": args.eval_windows, "seed": args.seed}
    extra = {"style": args.style, "draft_vocab_size": args.draft_vocab, "eagle3_layers": args.eagle3_layers}
    at_least_zero = ("seed", "eval_every", "patience", "lr")
    for name, value in overrides.items():  # before any work: a budget or count that cannot train
        if isinstance(value, (int, float)) and (value < 0 if name in at_least_zero else value <= 0):
            print(f"error: --{name.replace('_', '-')} must be {'>= 0' if name in at_least_zero else '> 0'}, "
                  f"got {value}", file=sys.stderr)
            return 2
    if args.self_tokens is not None and (args.data or "corpus") != "self":
        print("error: --self-tokens is the size of self-distillation data: use it with --data self", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda asked for, but no CUDA GPU is visible; use --device cpu", file=sys.stderr)
            return 2
    try:
        spec = replace(recipe(), **{k: v for k, v in {**overrides, **extra}.items() if v is not None})
        out = train(args.preset, out=args.out, preset_dir=args.dir, device=args.device, spec=spec,
                    resume=args.resume)
    except (ZooError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"trained a {args.kind} head for {args.preset} -> {out}")
    return 0


def cmd_export_head(args: argparse.Namespace) -> int:
    """Load the preset's target and the trained head beside it (checked against the target's fingerprints), write it
    in the published layout, and print what was written."""
    import torch

    from workbench.engine.drafters import Eagle3Head, EagleHead
    from workbench.engine.drafters.published import export_published_head
    from workbench.models import load_model, tokenizer_fingerprint
    from workbench.zoo.heads import check_head, has_head

    try:
        paths = resolve_dir(args.dir, args.preset) if args.dir else resolve_preset(args.preset)
        folder = Path(args.head) if args.head else paths.root / args.kind
        if not has_head(folder):
            raise ZooError(f"no trained {args.kind} head in {folder}: train one with zoo train-head --kind {args.kind} "
                           f"--preset {args.preset}" + (" --style eagle" if args.kind == "eagle" else ""))
        check_head(folder, paths.target_dir, tokenizer_fingerprint(paths.target_dir))
        target = load_model(paths.target_dir, dtype=torch.float32, device="cpu").eval()
        head = (EagleHead if args.kind == "eagle" else Eagle3Head).load(folder)
        hot = _hot_tokens(head, args, target.config.vocab_size)
        layout = export_published_head(head, target, args.out, dtype=getattr(torch, args.dtype))
        if hot is not None:
            from workbench.serving.exports import token_map_file
            token_map = Path(args.out) / token_map_file(args.hot_vocab)
            torch.save(hot, token_map)
    except (ZooError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the {args.kind} head of {args.preset} in the published {layout} layout ({args.dtype}) -> {args.out}")
    if hot is not None:
        print(f"wrote its {args.hot_vocab} most frequent token ids -> {token_map} (SGLang: --speculative-token-map)")
    return 0


def _hot_tokens(head, args: argparse.Namespace, vocab_size: int):
    """The head's --hot-vocab most frequent token ids (int64), None without the flag; ZooError when it cannot be."""
    if not args.hot_vocab:
        return None
    if args.kind != "eagle":
        raise ZooError("--hot-vocab is EAGLE-2's (FR-Spec): an EAGLE-3 head has its own draft vocabulary")
    if not 0 < args.hot_vocab <= vocab_size:
        raise ZooError(f"--hot-vocab {args.hot_vocab}: give 1..{vocab_size} (the target's vocabulary)")
    if head.hot_tokens is None:
        raise ZooError("this EAGLE head has no token ranking (hot_tokens.safetensors): retrain it with zoo train-head "
                       "--kind eagle, which counts one")
    return head.hot_tokens[:args.hot_vocab].long().clone()
