"""Study scripts: one per question a user asks. The name -> script registry lives here (an edge, like the CLI).

  best_k          "What draft length and method are best for my models?"  maximize tokens/s at batch 1.
  batch_schedule  "How does speedup change with batch size?"  maximize speedup vs autoregressive, trials spread
                  evenly over batch-size buckets; exports a schedule (JSON) + vLLM / SGLang / TensorRT-LLM snippets.
  pareto          "What do I trade for speed?"  maximize tokens/s, minimize peak memory, minimize p99 TPOT;
                  reports the Pareto front.
  precision       "Which weight precision for target and draft, with which drafter?"  maximize tokens/s, minimize the
                  quantized target's held-out perplexity increase; trials above max_ppl_increase_pct are infeasible.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from studies.objective import (PARETO, QUALITY_FRONT, REPORT_KNOBS, SPEEDUP, THROUGHPUT, ObjectiveSpec,
                               exclusion_notes, pareto_front, reliable_complete, trials_frame)
from studies.schedule import build_schedule, export_schedule as _export
from studies.space import GLOBAL_KNOBS, METHODS, IntRange, SearchSpace


class UnknownScriptError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class StudyScript:
    name: str
    question: str
    objective: ObjectiveSpec
    space: SearchSpace  # default search space; CLI flags override single knobs
    report: Callable[[optuna.Study], str]
    # fixed params for the next trial (enqueued before it), e.g. the least-covered batch bucket; None: sampler only
    next_params: Callable[[optuna.Study, Any], dict[str, Any] | None] | None = None
    export: Callable[..., dict[str, Path]] | None = None  # (study, out_dir, max_num_seqs=None)


def _table(df: pd.DataFrame, columns: list[str] | None = None) -> str:
    if df is None or df.empty:
        return "  (none)"
    if columns:
        df = df[[c for c in columns if c in df.columns]]
    return df.to_string(index=False, float_format=lambda v: f"{v:.4g}")


def _counts(study: optuna.Study) -> str:
    c = Counter(t.state.name for t in study.get_trials(deepcopy=False))
    infeasible = sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("feasible") is False)
    return (f"{len(study.trials)} trials: {c.get('COMPLETE', 0)} complete ({infeasible} infeasible), "
            f"{c.get('FAIL', 0)} failed, {c.get('RUNNING', 0)} running, {c.get('WAITING', 0)} waiting")


COLS = ["trial", *REPORT_KNOBS]


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The best reliable feasible trial of a single-objective study (flagged trials skipped), or None."""
    ok = reliable_complete(study)
    if not ok:
        return None
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    return (max if maximize else min)(ok, key=lambda t: t.value)


def report_best_k(study: optuna.Study) -> str:
    lines = [f"study {study.study_name!r}: {_counts(study)}", *exclusion_notes(study)]
    ok = reliable_complete(study)
    best = best_trial(study)
    if best is None:
        return "\n".join(lines + ["no reliable feasible completed trial: nothing to recommend"])
    df = trials_frame(study)
    df = df[df["trial"].isin({t.number for t in ok})]
    cfg = best.user_attrs["config"]
    knobs = ("method", *_used(best), *GLOBAL_KNOBS)
    lines.append(f"best setting (trial {best.number}): " + ", ".join(f"{k}={cfg.get(k)}" for k in knobs))
    lines.append(f"  tokens/s {best.value:.4g}, speedup vs autoregressive "
                 f"{_fmt(best.user_attrs.get('speedup_vs_ar'))}x, acceptance {_fmt(best.user_attrs.get('acceptance_rate'))}")
    per_method = df.sort_values("tokens_per_s", ascending=False).groupby("method", as_index=False).head(1)
    lines += ["best per method:", _table(per_method, COLS + ["tokens_per_s", "speedup_vs_ar", "acceptance_rate"])]
    if "k" in df and df["k"].notna().any():
        by_k = (df.dropna(subset=["k"]).groupby(["method", "k"], as_index=False)
                .agg(trials=("trial", "count"), best_tokens_per_s=("tokens_per_s", "max"),
                     best_speedup=("speedup_vs_ar", "max")))
        lines += ["by draft length:", _table(by_k)]
    return "\n".join(lines)


def _used(t: optuna.trial.FrozenTrial) -> tuple[str, ...]:
    m = t.user_attrs.get("config", {}).get("method")
    return METHODS[m].knobs if m in METHODS else ()


def _fmt(v: Any) -> str:
    return "n/a" if v is None else f"{float(v):.3g}"


def next_batch_bucket(study: optuna.Study, spec: Any) -> dict[str, Any] | None:
    """The batch bucket with the fewest trials so far (ties: the smallest), so every bucket gets its share."""
    batch = spec.space.batch
    if not isinstance(batch, tuple):
        return None
    seen = Counter()
    for t in study.get_trials(deepcopy=False):
        if "batch" in t.params:
            seen[t.params["batch"]] += 1
    return {"batch": min(batch, key=lambda b: (seen[b], b))}


def report_schedule(study: optuna.Study) -> str:
    sched = build_schedule(study)
    rows = pd.DataFrame([{k: e.get(k) for k in ("batch_size", "trials", "speculate", "method", "draft_len",
                                                   "ngram_min", "ngram_max", "speedup_vs_ar", "tokens_per_s", "trial")}
                         for e in sched["buckets"]])
    return "\n".join([f"study {study.study_name!r}: {_counts(study)}", *sched.get("excluded", []),
                      "best setting per batch-size bucket:", _table(rows)])


def export_schedule(study: optuna.Study, out_dir: Path, max_num_seqs: int | None = None) -> dict[str, Path]:
    return _export(study, out_dir, max_num_seqs=max_num_seqs)


def report_pareto(study: optuna.Study) -> str:
    front = pareto_front(study)
    if not front.empty:
        front = front.sort_values("tokens_per_s", ascending=False)
    lines = [f"study {study.study_name!r}: {_counts(study)}", *exclusion_notes(study),
             f"Pareto front ({len(front)} reliable feasible trials; maximize tokens/s, minimize peak_mem_mb and tpot_ms_p99):",
             _table(front, COLS + list(PARETO.metrics) + ["speedup_vs_ar"])]
    if any(str(t.user_attrs.get("device", "")).startswith("cpu") for t in study.get_trials(deepcopy=False)):
        # the engine reports the process's peak resident set on CPU: it only grows over a worker's trials
        lines.append("note: on CPU peak_mem_mb is the worker process's peak RSS so far, not the trial's own peak; "
                     "the memory objective is meaningful on GPU only")
    return "\n".join(lines)


def report_precision(study: optuna.Study) -> str:
    front = pareto_front(study)
    if not front.empty:
        front = front.sort_values("tokens_per_s", ascending=False)
    df = trials_frame(study)
    over = [f"trial {t.number}: {t.user_attrs.get('infeasible_reason')}" for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("feasible") is False]
    lines = [f"study {study.study_name!r}: {_counts(study)}", *exclusion_notes(study),
             f"Pareto front ({len(front)} reliable feasible trials; maximize tokens/s, minimize held-out perplexity "
             "increase of the quantized target, %):",
             _table(front, COLS + list(QUALITY_FRONT.metrics) + ["speedup_vs_ar", "acceptance_rate"]),
             *(["infeasible (fidelity or quality bound):", *[f"  {o}" for o in over]] if over else [])]
    if "target_quant" in df and len(df):
        by = (df.groupby(["target_quant"], as_index=False)
              .agg(trials=("trial", "count"), best_tokens_per_s=("tokens_per_s", "max"),
                   ppl_delta_pct=("quant_ppl_delta_pct", "min")))
        lines += ["by target weight format:", _table(by)]
    return "\n".join(lines)


SCRIPTS: dict[str, StudyScript] = {s.name: s for s in (
    StudyScript("best_k", "best draft length and method for my models", THROUGHPUT,
                SearchSpace(methods=("draft", "ngram"), k=IntRange(1, 8), ngram_min=IntRange(1, 3),
                            ngram_max=IntRange(1, 4), batch=1, temperature=0.0),
                report_best_k),
    StudyScript("batch_schedule", "speedup vs batch size: best setting per batch-size bucket", SPEEDUP,
                SearchSpace(methods=("draft", "ngram"), k=IntRange(1, 8), ngram_min=IntRange(1, 3),
                            ngram_max=IntRange(1, 4), batch=(1, 2, 4, 8), temperature=0.0),
                report_schedule, next_params=next_batch_bucket, export=export_schedule),
    StudyScript("pareto", "tokens/s vs peak memory vs p99 time per output token", PARETO,
                SearchSpace(methods=("ar", "draft", "ngram"), k=IntRange(1, 8), ngram_min=IntRange(1, 3),
                            ngram_max=IntRange(1, 4), batch=(1, 2, 4), temperature=0.0),
                report_pareto),
    StudyScript("precision", "weight precision of target and draft: tokens/s vs held-out perplexity cost",
                QUALITY_FRONT,
                SearchSpace(methods=("ar", "draft", "ngram"), k=IntRange(2, 6), ngram_min=IntRange(1, 3),
                            ngram_max=IntRange(1, 4), batch=1, temperature=0.0,
                            target_quant=("none", "int8", "int4", "int4-awq"), draft_quant=("none", "int8")),
                report_precision),
)}


def get_script(name: str) -> StudyScript:
    if name not in SCRIPTS:
        raise UnknownScriptError(f"unknown study script {name!r}; known: {', '.join(SCRIPTS)}")
    return SCRIPTS[name]
