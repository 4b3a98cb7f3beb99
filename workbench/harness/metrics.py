"""Metrics with one meaning everywhere (see DESIGN.md "Metrics that must mean the same everywhere").

- acceptance rate = accepted draft tokens / drafted tokens (drafted = valid draft nodes proposed for a sequence);
- mean accepted tokens per target step = mean over (sequence, step) of accepted + 1 (the bonus/recovered token);
- acceptance by position d = fraction of (sequence, step) pairs whose accepted path reached depth d (for trees too:
  it counts accepted path lengths, so it is acceptance per tree depth);
- tree size = mean over (sequence, step) of drafted (valid draft nodes verified; a chain's drafted tokens);
- wasted node fraction = 1 - accepted / drafted: verified nodes off the accepted path (identical to 1 - acceptance
  rate, named for trees);
- accepted path length = mean over (sequence, step) of accepted (bonus excluded) = mean accepted tokens - 1;
- beam diversity (beam drafters only) = mean over (sequence, step) of drafted / (W x L): distinct valid prefix-tree
  nodes of the merged beams (engine/tree.py `beam_diversity`), read from the drafted counts the step records already;
- beam disagreement (beam drafters with W >= 2) = mean over (sequence, step) of the mean pairwise token disagreement
  of its beams (engine/tree.py `beam_disagreement`: fraction of depths where two beams hold different tokens,
  averaged over beam pairs), from the (differing, compared) counts the step's one host read carries;
- acceptance by depth and rank: entry [d][r] = fraction of (sequence, step) pairs whose accepted path went through
  a rank-r child (engine/tree.py `sibling_rank`: r-th best sibling by draft score) at depth d + 1; its row sums are
  acceptance by position, and acceptance by rank [r] = its column sums = rank-r nodes on the accepted path per
  (sequence, step), which sum to the accepted path length (chains: rank 0 only);
- TTFT = prefill end - batch start; TPOT = (last token time - first token time) / (tokens - 1), per sequence;
- ITL = gaps between successive emissions to a sequence (a speculative step emits several tokens at once);
- tokens/s = generated tokens / wall time of the batches that produced them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pandas as pd

from results.schema import TRACE_COLUMNS
from workbench.engine import GenerationResult


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no values.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50)
    2.5
    """
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: list[float]) -> float | None:
    return percentile(values, 50)


@dataclass
class RunSummary:
    """Aggregate of one method's pass over all prompts (one or more batches)."""
    total_new_tokens: int
    wall_s: float
    tokens_per_s: float
    target_steps: int
    drafted: int
    accepted: int
    acceptance_rate: float | None
    mean_accepted_tokens: float | None
    acceptance_by_position: list[float]
    tree_size_mean: float | None  # valid draft nodes per (sequence, step)
    wasted_node_fraction: float | None  # 1 - accepted / drafted; None when nothing was drafted
    accepted_path_length_mean: float | None  # accepted draft tokens per (sequence, step), bonus excluded
    beam_diversity_mean: float | None  # drafted / (W x L) per (sequence, step); None unless every result is beams
    ttft_ms: list[float]
    tpot_ms: list[float]
    itl_ms: list[float]
    phase_ms: dict[str, float]
    draft_forwards: int
    # pairwise token disagreement of the beams per (sequence, step); None unless beams with W >= 2 were recorded
    beam_disagreement_mean: float | None = None
    acceptance_by_rank: list[float] = field(default_factory=list)  # [R]: rank-r accepted nodes per (sequence, step)
    acceptance_by_depth_rank: list[list[float]] = field(default_factory=list)  # [D][R] fraction of (sequence, step)

    @property
    def ms_per_target_step(self) -> float | None:
        verify = self.phase_ms.get("verify", 0.0)
        return verify / self.target_steps if self.target_steps and verify else None


def summarize(results: list[GenerationResult]) -> RunSummary:
    total = wall = 0.0
    steps = drafted = accepted = 0
    max_depth = max((r.num_nodes for r in results), default=0)
    reached = [0] * max_depth
    pairs = 0
    acc_plus_one = 0
    diversity, beam_pairs = 0.0, 0
    disagreement, disagree_pairs = 0.0, 0
    through: dict[tuple[int, int], int] = {}  # (depth index, sibling rank) -> (sequence, step) pairs
    ttft, tpot, itl = [], [], []
    phase: dict[str, float] = {}
    draft_forwards = 0
    for r in results:
        total += sum(len(o) for o in r.outputs)
        wall += max(r.t_done) - r.t_start
        steps += len(r.steps)
        draft_forwards += len(r.steps) * r.draft_forwards_per_step
        last_emit = {i: r.t_first_token for i in range(len(r.outputs))}
        for s in r.steps:
            for j, (row, d, a, e) in enumerate(zip(s.rows, s.drafted, s.accepted, s.emitted)):
                for depth, rank in enumerate(s.path_ranks[j] if s.path_ranks else [0] * a):
                    through[depth, rank] = through.get((depth, rank), 0) + 1
                if s.beam_pairs and s.beam_pairs[j][1]:
                    disagreement += s.beam_pairs[j][0] / s.beam_pairs[j][1]
                    disagree_pairs += 1
                drafted += d
                accepted += a
                pairs += 1
                acc_plus_one += a + 1
                if r.beams and r.num_nodes:
                    diversity += d / r.num_nodes
                    beam_pairs += 1
                for depth in range(min(a, max_depth)):
                    reached[depth] += 1
                if e:
                    itl.append((s.t_emit - last_emit[row]) * 1e3)
                    last_emit[row] = s.t_emit
        for i, out in enumerate(r.outputs):
            ttft.append((r.t_first_token - r.t_start) * 1e3)
            if len(out) > 1:
                tpot.append((r.t_done[i] - r.t_first_token) * 1e3 / (len(out) - 1))
        for k, v in r.phase_ms.items():
            phase[k] = phase.get(k, 0.0) + v
    depths = 1 + max((d for d, _ in through), default=-1)
    ranks = max(1 + max((r for _, r in through), default=-1), 1 if drafted else 0)  # a chain: [rank 0]
    by_depth_rank = [[through.get((d, r), 0) / pairs for r in range(ranks)] for d in range(depths)]
    return RunSummary(
        total_new_tokens=int(total), wall_s=wall, tokens_per_s=total / wall if wall > 0 else 0.0,
        target_steps=steps, drafted=drafted, accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else None,
        mean_accepted_tokens=acc_plus_one / pairs if pairs else None,
        acceptance_by_position=[c / pairs for c in reached] if pairs else [],
        tree_size_mean=drafted / pairs if pairs else None,
        wasted_node_fraction=1 - accepted / drafted if drafted else None,
        accepted_path_length_mean=accepted / pairs if pairs else None,
        beam_diversity_mean=diversity / beam_pairs if beam_pairs and all(r.beams for r in results) else None,
        ttft_ms=ttft, tpot_ms=tpot, itl_ms=itl, phase_ms=phase, draft_forwards=draft_forwards,
        beam_disagreement_mean=disagreement / disagree_pairs if disagree_pairs else None,
        acceptance_by_rank=[sum(row[r] for row in by_depth_rank) for r in range(ranks)],
        acceptance_by_depth_rank=by_depth_rank)


def traces_frame(results: list[GenerationResult], run_id: str | None = None) -> pd.DataFrame:
    """One row per (sequence, target step): the per-step trace kept beside the summary row. `path_ranks` is the JSON
    list of the accepted nodes' sibling ranks (depth 1 first; "[]" when nothing was accepted), `beam_disagreement`
    the step's pairwise token disagreement of the beams (None without beams or with one beam)."""
    rows = []
    offset = 0
    for r in results:
        for s in r.steps:
            for j, (row, d, a, e) in enumerate(zip(s.rows, s.drafted, s.accepted, s.emitted)):
                ranks = s.path_ranks[j] if s.path_ranks else [0] * a
                pair = s.beam_pairs[j] if s.beam_pairs else (0, 0)
                rows.append({"run_id": run_id, "seq": offset + row, "step": s.step, "drafted": d, "accepted": a,
                             "emitted": e, "path_ranks": json.dumps(ranks),
                             "beam_disagreement": pair[0] / pair[1] if pair[1] else None})
        offset += len(r.outputs)
    return pd.DataFrame(rows, columns=list(TRACE_COLUMNS))


def greedy_agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, int]:
    """(tokens equal to the reference up to each sequence's first difference / reference tokens, sequences that
    differ): how far a changed target (quantized KV) decodes exactly like the reference before it first departs.

    >>> greedy_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    (0.6666666666666666, 1)
    """
    same, total, differ = 0, 0, 0
    for ours, ref in zip(outputs, reference, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
        same += first
        total += len(ref)
        differ += ours != ref
    return (same / total if total else 1.0), differ
