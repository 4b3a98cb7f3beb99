"""Tree and beam drafters against chains and AR on one GPU: one process, the same prompts for every row (issue 9).

    python scripts/bench_trees.py --preset small --device cuda --out $OUT
    # CPU smoke run (what tests/test_bench_trees.py runs, smaller):
    python scripts/bench_trees.py --preset tiny --device cpu --num-prompts 2 --max-new-tokens 8 --repeats 1 \
        --batches 1 --category-prompts 1 --out out/trees

Rows, per batch size (default 1 and 8), through the harness (`BenchSession.run`: engines reused across runs, CUDA
graphs captured in the warm-up, AR and candidate interleaved per repeat):
  ar; draft k; ngram k; eagle at each --tree-budgets (depth --tree-depth, top-k --tree-topk; skipped with a note
  while method "eagle" or its knobs are not in workbench.settings); eagle3 at each --eagle3-trees depth:topk:budget
  (none by default; the preset's trained eagle3 head, else an untrained one, named in the table); redrafter at each
  --beam-widths (length --beam-length).
Each row: mean accepted tokens, acceptance rate, beam diversity, pairwise beam disagreement, acceptance by node rank,
draft/target cost ratio, tokens/s (median over --repeats, with min / max / CV), speedup vs our AR of the same run
(paired, with its 95 % interval), greedy parity.
Per prompt category (the prompt file's: Spec-Bench / MT-bench question.jsonl with --prompts, else the preset's
prompts.jsonl, whose categories are code-completion anchors): redrafter at every beam width on that category's
prompts only (batch 1, --category-prompts of them), and the best width by tokens/s and by mean accepted tokens; a
best by tokens/s whose [min, max] over repeats overlaps the runner-up's is marked a tie.

The main rows use --num-prompts prompts taken round-robin over the categories (so every category is in them), the
same list for every row. Runs go in priority order (batch 1 rows, then the other batches, then the categories) and
stop at --budget-s, listing what was skipped. Output in --out: results.json (everything, every row's full record
fields named in ROW_FIELDS) and table.md (the readable tables). Settings are checked before any model is loaded
(a bad one is a named error, exit 2).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import settings  # noqa: E402
from workbench.harness.bench import BenchConfig, BenchError, BenchSession  # noqa: E402

EAGLE_KNOBS = ("tree_budget", "tree_depth", "tree_topk")  # issue 9's names for the eagle drafter's settings
ROW_FIELDS = ("mean_accepted_tokens", "acceptance_rate", "beam_diversity_mean", "beam_disagreement_mean",
              "acceptance_by_rank", "acceptance_by_position", "tree_size_mean", "draft_target_cost_ratio",
              "tokens_per_s", "tokens_per_s_repeats", "tokens_per_s_cv", "ar_tokens_per_s", "ar_tokens_per_s_repeats",
              "speedup_vs_ar", "speedup_ci_low", "speedup_ci_high", "noisy", "noisy_reason", "plausible",
              "implausible_reason", "greedy_matches_ar", "greedy_near_tie", "target_steps", "total_new_tokens",
              "time_draft_ms", "time_verify_ms", "graph_capture_s", "draft_path", "wall_s", "run_id")


class PlanError(ValueError):
    """A benchmark setting that cannot run; the message names it and what to use instead."""


def ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers "
                                         "(e.g. 1,8)") from None
    if not values:
        raise argparse.ArgumentTypeError("an empty list: give at least one number (e.g. 1,8)")
    return values


def trees(text: str) -> tuple[tuple[int, int, int], ...]:
    """ "5:8:32,4:4:16" -> ((5, 8, 32), (4, 4, 16)): eagle3 rows as depth:topk:budget."""
    out = []
    for spec in (x.strip() for x in text.split(",") if x.strip()):
        parts = spec.split(":")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"{spec!r} is not depth:topk:budget with whole numbers > 0 (e.g. 5:8:32)")
        out.append(tuple(int(p) for p in parts))
    return tuple(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", help="zoo preset (default small)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--dtype", default=None, choices=settings.KNOBS["dtype"].choices,
                    help="model dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--prompts", default=None, help="prompt file (question.jsonl with categories); default: the "
                                                    "preset's prompts.jsonl")
    ap.add_argument("--out", required=True, help="folder for results.json and table.md")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts of the main rows (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per run (default 3; >= 3 for a spread)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up passes per run (default 1)")
    ap.add_argument("--batches", type=ints, default=(1, 8), help="batch sizes of the main rows (default 1,8)")
    ap.add_argument("--k", type=int, default=4, help="draft length of the draft and ngram rows (default 4)")
    ap.add_argument("--tree-budgets", type=ints, default=(8, 24), help="eagle node budgets (default 8,24)")
    ap.add_argument("--tree-depth", type=int, default=5, help="eagle tree depth (default 5)")
    ap.add_argument("--tree-topk", type=int, default=4, help="eagle children per expanded node (default 4)")
    ap.add_argument("--eagle3-trees", type=trees, default=(),
                    help="eagle3 rows, each depth:topk:budget, comma-separated (e.g. 5:8:32,4:4:16; default none): "
                         "the head `zoo train-head --kind eagle3` put beside the target")
    ap.add_argument("--beam-widths", type=ints, default=(1, 2, 4), help="redrafter beam widths W (default 1,2,4)")
    ap.add_argument("--beam-length", type=int, default=4, help="redrafter beam length L (default 4)")
    ap.add_argument("--category-prompts", type=int, default=4,
                    help="prompts per category for the per-category redrafter runs (default 4; 0 = skip them)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="CUDA graphs (default: on for a GPU device, off on the CPU)")
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="stop starting runs after this many seconds (default 170); skipped runs are listed")
    args = ap.parse_args(argv)
    on_gpu = str(args.device).startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    args.cuda_graphs = on_gpu if args.cuda_graphs is None else args.cuda_graphs
    if args.cuda_graphs and not on_gpu:
        ap.error("--cuda-graphs needs --device cuda (graphs are captured on a GPU only)")
    for name in ("num_prompts", "max_new_tokens", "repeats", "tree_depth", "tree_topk", "beam_length"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.category_prompts < 0 or args.budget_s <= 0:
        ap.error("--warmup and --category-prompts must be >= 0 and --budget-s > 0")
    return args


def eagle_note() -> str | None:
    """None when eagle rows can run here, else why they are skipped."""
    if "eagle" not in settings.METHODS:
        return ("eagle rows skipped: method 'eagle' is not registered in workbench.settings.METHODS yet (it is being "
                "built on branch eagle); rerun this script after that branch is merged")
    missing = [k for k in EAGLE_KNOBS if k not in settings.KNOBS]
    if missing:
        return (f"eagle rows skipped: method 'eagle' exists but knob(s) {', '.join(missing)} do not "
                f"(this script sets {', '.join(EAGLE_KNOBS)}); adjust EAGLE_KNOBS in scripts/bench_trees.py")
    return None


def plan(args: argparse.Namespace) -> tuple[list[tuple[str, BenchConfig]], list[str]]:
    """(label, config) of the main rows, batch by batch in the order given, and notes on what is left out."""
    base = BenchConfig(method="ar", batch=1, max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts,
                       repeats=args.repeats, warmup=args.warmup, cuda_graphs=args.cuda_graphs,
                       k=args.k, beam_length=args.beam_length)
    notes, rows = [], []
    short = [b for b in args.batches if b > args.num_prompts]
    if short:  # a batch above the prompt count would run the prompts as one smaller batch, under the bigger label
        raise PlanError(f"batch {max(short)} needs at least {max(short)} prompts: give --num-prompts >= "
                        f"{max(short)} (now {args.num_prompts})")
    eagle = eagle_note()
    if eagle:
        notes.append(eagle)
    for batch in args.batches:
        b = replace(base, batch=batch)
        rows += [("ar", b), (f"draft k={args.k}", replace(b, method="draft")),
                 (f"ngram k={args.k}", replace(b, method="ngram"))]
        if not eagle:
            rows += [(f"eagle budget={n} depth={args.tree_depth} topk={args.tree_topk}",
                      replace(b, method="eagle", **dict(zip(EAGLE_KNOBS, (n, args.tree_depth, args.tree_topk)))))
                     for n in args.tree_budgets]
            rows += [(f"eagle3 budget={n} depth={d} topk={k}",
                      replace(b, method="eagle3", **dict(zip(EAGLE_KNOBS, (n, d, k)))))
                     for d, k, n in args.eagle3_trees]
        rows += [(f"redrafter W={w} L={args.beam_length}", replace(b, method="redrafter", beam_width=w))
                 for w in args.beam_widths]
    for label, cfg in rows:  # bounds, choices and the rules between knobs: before any model is loaded
        try:
            settings.check({k.name: getattr(cfg, k.name) for k in settings.RUN_KNOBS})
        except ValueError as e:
            raise PlanError(f"{label} at batch {cfg.batch}: {e}") from None
    return rows, notes


def balanced(prompts: list, n: int) -> list[int]:
    """Indices of n prompts taken round-robin over the categories (in order of first appearance), cycling.

    >>> from types import SimpleNamespace as P
    >>> balanced([P(category=c) for c in "aabbbc"], 5)
    [0, 2, 5, 1, 3]
    """
    by_cat: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_cat.setdefault(p.category, []).append(i)
    order, depth = [], 0
    while len(order) < len(prompts):
        order += [idx[depth] for idx in by_cat.values() if depth < len(idx)]
        depth += 1
    return [order[i % len(order)] for i in range(n)]


def row_of(label: str, cfg: BenchConfig, rec: dict | None, error: str | None = None) -> dict:
    row = {"label": label, "method": cfg.method, "batch": cfg.batch, "beam_width": cfg.beam_width
           if cfg.method == "redrafter" else None, "error": error}
    for f in ROW_FIELDS:
        row[f] = None if rec is None else rec.get(f)
    reps = row["tokens_per_s_repeats"] or []
    row["tokens_per_s_min"], row["tokens_per_s_max"] = (min(reps), max(reps)) if reps else (None, None)
    return row


def best_widths(rows: list[dict]) -> dict:
    """Best beam width of one category's redrafter rows, by tokens/s and by mean accepted tokens.

    >>> r = lambda w, t, lo, hi, m: {"beam_width": w, "tokens_per_s": t, "tokens_per_s_min": lo,
    ...                              "tokens_per_s_max": hi, "mean_accepted_tokens": m, "error": None}
    >>> best = best_widths([r(1, 100, 95, 105, 1.5), r(2, 120, 118, 122, 1.9), r(4, 110, 100, 117, 2.1)])
    >>> best["best_w_by_tokens_per_s"], best["tie_by_tokens_per_s"], best["best_w_by_mean_accepted"]
    (2, False, 4)
    >>> best_widths([r(1, 100, 95, 105, 1.5), r(2, 120, 118, 122, 1.5)])["tie_by_tokens_per_s"]  # 118 <= 105? no
    False
    >>> best = best_widths([r(1, 100, 95, 119, 1.5), r(2, 120, 118, 122, 1.5)])  # 118 <= 119: within the spread
    >>> [best[k] for k in ("best_w_by_tokens_per_s", "tie_by_tokens_per_s", "best_w_by_mean_accepted",
    ...                    "tie_by_mean_accepted")]
    [2, True, 1, True]

    A tie by tokens/s: the best's slowest repeat is not faster than the runner-up's fastest; a tie by mean accepted:
    equal means (the smaller width is named).
    """
    ok = [r for r in rows if r["error"] is None and r["tokens_per_s"] is not None]
    if not ok:
        return {"best_w_by_tokens_per_s": None, "tie_by_tokens_per_s": None, "best_w_by_mean_accepted": None,
                "tie_by_mean_accepted": None}
    by_tps = sorted(ok, key=lambda r: -r["tokens_per_s"])
    tie = len(by_tps) > 1 and None not in (by_tps[0]["tokens_per_s_min"], by_tps[1]["tokens_per_s_max"]) \
        and by_tps[0]["tokens_per_s_min"] <= by_tps[1]["tokens_per_s_max"]
    by_acc = sorted(ok, key=lambda r: (-(r["mean_accepted_tokens"] or 0.0), r["beam_width"]))
    acc_tie = len(by_acc) > 1 and by_acc[0]["mean_accepted_tokens"] == by_acc[1]["mean_accepted_tokens"]
    return {"best_w_by_tokens_per_s": by_tps[0]["beam_width"], "tie_by_tokens_per_s": bool(tie),
            "best_w_by_mean_accepted": by_acc[0]["beam_width"], "tie_by_mean_accepted": bool(acc_tie)}


def fmt(v, spec: str = ".3g") -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return format(v, spec)
    if isinstance(v, list):
        return "[" + ", ".join(format(x, ".2f") for x in v) + "]"
    return str(v)


def table_md(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Tree and beam drafters · {m['preset']} · {m['device_name']} · {m['dtype']}", "",
             f"{m['num_prompts']} prompts ({', '.join(f'{c}: {n}' for c, n in m['main_categories'].items())}) x "
             f"{m['max_new_tokens']} new tokens, {m['repeats']} repeats, CUDA graphs {fmt(m['cuda_graphs'])}; "
             f"redrafter head: {m['redrafter_head'] or '—'}; eagle head: {m.get('eagle_head') or '—'}; "
             f"eagle3 head: {m.get('eagle3_head') or '—'}; {m['elapsed_s']:.0f} s in all.", ""]
    cols = ["label", "batch", "mean_accepted_tokens", "acceptance_rate", "beam_diversity_mean",
            "beam_disagreement_mean", "acceptance_by_rank", "draft_target_cost_ratio", "tokens_per_s",
            "speedup_vs_ar", "greedy_matches_ar"]
    head = ["method", "batch", "mean accepted", "acceptance", "beam diversity", "beam disagreement",
            "accepted nodes per step by rank", "draft/target cost", "tokens/s median [min, max]",
            "speedup vs AR [95 % CI]", "greedy = AR"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"| {r['label']} | {r['batch']} | error: {r['error']} |" + " — |" * (len(cols) - 3))
            continue
        cells = []
        for c in cols:
            if c == "tokens_per_s":
                cells.append(f"{fmt(r[c], '.1f')} [{fmt(r['tokens_per_s_min'], '.1f')}, "
                             f"{fmt(r['tokens_per_s_max'], '.1f')}]")
            elif c == "speedup_vs_ar":
                ci = f" [{fmt(r['speedup_ci_low'], '.2f')}, {fmt(r['speedup_ci_high'], '.2f')}]" \
                    if r["speedup_ci_low"] is not None else " (no interval)"
                flag = (" noisy" if r["noisy"] else "") + (" implausible" if r["plausible"] is False else "")
                cells.append(f"{fmt(r[c], '.2f')}x{ci}{flag}" if r[c] is not None else "—")
            elif c == "greedy_matches_ar" and r[c] is False:
                cells.append("no (bf16/fp16 near-tie)" if r["greedy_near_tie"] else "no")
            else:
                cells.append(fmt(r[c]))
        lines.append("| " + " | ".join(cells) + " |")
    if result["categories"]:
        lines += ["", "## Best ReDrafter beam width per prompt category (batch 1, that category's prompts only)", "",
                  "| category | prompts | W: tokens/s median [min, max] · mean accepted | best W by tokens/s | "
                  "best W by mean accepted |", "|---|---|---|---|---|"]
        for c in result["categories"]:
            per_w = "; ".join(
                f"W={r['beam_width']}: " + (f"error {r['error']}" if r["error"] else
                                            f"{fmt(r['tokens_per_s'], '.1f')} [{fmt(r['tokens_per_s_min'], '.1f')}, "
                                            f"{fmt(r['tokens_per_s_max'], '.1f')}] · "
                                            f"{fmt(r['mean_accepted_tokens'], '.2f')}") for r in c["rows"])
            tie = " (tie within the repeats' spread)" if c["tie_by_tokens_per_s"] else ""
            acc_tie = " (tie)" if c["tie_by_mean_accepted"] else ""
            lines.append(f"| {c['category']} | {c['prompts']} | {per_w} | {fmt(c['best_w_by_tokens_per_s'])}{tie} | "
                         f"{fmt(c['best_w_by_mean_accepted'])}{acc_tie} |")
    if result["notes"]:
        lines += ["", "Notes:"] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out)
    try:
        rows_plan, notes = plan(args)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        session = BenchSession.load(preset=args.preset, device=args.device, dtype=args.dtype, prompts=args.prompts)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = session.prompts
    chosen = balanced(prompts, args.num_prompts)
    encode = lambda idx: [session.tokenizer.encode(prompts[i].text).ids for i in idx]  # noqa: E731
    main_ids = encode(chosen)
    categories = list(dict.fromkeys(p.category for p in prompts))
    cat_plan = []  # (category, prompt indices, [(label, cfg)])
    redrafter = next(cfg for _, cfg in rows_plan if cfg.method == "redrafter")
    if args.category_prompts:
        if len(categories) < 2:
            notes.append(f"per-category runs skipped: the prompt file has one category ({categories[0]})")
        else:
            for cat in categories:
                idx = [i for i, p in enumerate(prompts) if p.category == cat][:args.category_prompts]
                cfgs = [(f"redrafter W={w}", replace(redrafter, batch=1, num_prompts=len(idx), beam_width=w))
                        for w in args.beam_widths]
                cat_plan.append((cat, idx, cfgs))
    try:  # every run's settings against the loaded models and prompts, before the first run
        for label, cfg in rows_plan:
            session.check(cfg, main_ids)
        for cat, idx, cfgs in cat_plan:
            for label, cfg in cfgs:
                session.check(cfg, encode(idx))
    except BenchError as e:
        print(f"error: {label}: {e}", file=sys.stderr)
        return 2

    def run(label: str, cfg: BenchConfig, ids: list[list[int]]) -> dict:
        if time.perf_counter() - t0 > args.budget_s:
            notes.append(f"skipped (budget {args.budget_s:.0f} s spent): {label} batch {cfg.batch}")
            return row_of(label, cfg, None, "skipped: time budget spent")
        try:
            rec = session.run(cfg, prompts=ids).record
            row = row_of(label, cfg, rec)
        except BenchError as e:
            row = row_of(label, cfg, None, str(e))
        except Exception as e:  # noqa: BLE001 - one failing drafter must not cost the lease the other rows
            traceback.print_exc()
            row = row_of(label, cfg, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        print(f"{time.perf_counter() - t0:6.1f}s  {label:<40} b={cfg.batch} "
              f"mean_acc={fmt(row['mean_accepted_tokens'])} "
              f"tok/s={fmt(row['tokens_per_s'])} speedup={fmt(row['speedup_vs_ar'])} {row['error'] or ''}", flush=True)
        return row

    from workbench.harness.telemetry import environment_info

    env = environment_info(str(session.device) if session.device.type == "cuda" else None)
    rows, cat_results = [], []
    try:
        session.redrafter_head()  # the trained head beside the target, or a seeded untrained one: say which
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if session.redrafter_head_source.startswith("untrained"):
        notes.append(f"the ReDrafter head is {session.redrafter_head_source}: train one first (python -m workbench "
                     f"zoo train-head --kind redrafter --preset {args.preset}) or its rows mean little")
    first_batch = args.batches[0]
    for label, cfg in [x for x in rows_plan if x[1].batch == first_batch] + \
            [x for x in rows_plan if x[1].batch != first_batch]:
        rows.append(run(label, cfg, main_ids))
        write(out, result_of(args, session, prompts, chosen, categories, env, t0, rows, cat_results, notes))
    for cat, idx, cfgs in cat_plan:
        ids = encode(idx)
        cat_rows = []
        for label, cfg in cfgs:
            cat_rows.append(run(f"{label} · {cat}", cfg, ids))
            write(out, result_of(args, session, prompts, chosen, categories, env, t0, rows,
                                 cat_results + [{"category": cat, "prompts": len(idx), "rows": cat_rows,
                                                 **best_widths(cat_rows)}], notes))
        cat_results.append({"category": cat, "prompts": len(idx), "rows": cat_rows, **best_widths(cat_rows)})
    result = result_of(args, session, prompts, chosen, categories, env, t0, rows, cat_results, notes)
    print("\n" + write(out, result))
    return 0


def result_of(args, session, prompts, chosen, categories, env, t0, rows, cat_results, notes) -> dict:
    return {
        "meta": {"preset": args.preset, "device": str(session.device), "device_name": env.get("device_name") or "cpu",
                 "dtype": args.dtype, "cuda_graphs": args.cuda_graphs, "num_prompts": args.num_prompts,
                 "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "warmup": args.warmup,
                 "prompts_source": session.prompts_source, "main_prompt_ids": [prompts[i].id for i in chosen],
                 "main_categories": {c: sum(prompts[i].category == c for i in chosen) for c in categories
                                     if any(prompts[i].category == c for i in chosen)},
                 "redrafter_head": session.redrafter_head_source, "eagle_head": session.eagle_head_source,
                 "eagle3_head": session.eagle3_head_source, "elapsed_s": time.perf_counter() - t0,
                 "args": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()}, "env": env},
        "rows": rows, "categories": cat_results, "notes": list(notes),
    }


def write(out: Path, result: dict) -> str:
    """results.json and table.md, rewritten after every run (a run cut short still leaves what it measured)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = table_md(result)
    (out / "table.md").write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
