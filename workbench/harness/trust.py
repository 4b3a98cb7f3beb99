"""Numbers a user can trust: the spread of a run's repeats and physical plausibility checks, as pure functions.

Vocabulary (the columns they fill, docs/INTERFACES.md "Trust"):
- *per-repeat tokens/s*: one value per timed repeat for each side, the baseline (AR) and the candidate; a repeat runs
  AR then the candidate (ABAB...), so slow drift of the machine hits both sides of a pair alike;
- *CV* (coefficient of variation) = sample standard deviation / mean of one side's per-repeat tokens/s;
- *speedup interval*: a Student-t 95 % interval of the mean paired log speedup, log(candidate_i / AR_i) over the
  repeats, exponentiated. With 2-3 repeats a bootstrap can only reshuffle the same few pairs (2 repeats give 3
  distinct resamples), so its interval is far too narrow: measured on this 2-core machine, five identical runs gave
  non-overlapping bootstrap intervals ([0.95, 0.97] beside [0.69, 0.80]); the t interval widens with few repeats as
  it should (t = 12.7 at 2 repeats, 4.3 at 3, 2.8 at 5);
- *noisy*: the spread is too wide to support the headline (None with a single repeat: no spread to judge);
- *plausible*: the headline does not break a bound the run's own counts impose.

Torch-free (studies and the dashboard may import it).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# A CV of 15 % means a typical repeat is off the mean by ~1/7; medians of 3 repeats then move by several percent,
# the size of the effects a study ranks settings by.
CV_LIMIT = 0.15
# Headline speedups within 5 % of 1.0 claim "no clear difference"; an interval straddling 1.0 only contradicts a
# headline outside that band.
CLEAR_EFFECT = 0.05
# Allowance over the accepted-tokens bound: timer granularity and machine noise move one side by a few percent.
SPEEDUP_SLACK = 0.10
# The baseline ran the same work in every repeat: a 1.5x gap between its fastest and slowest repeat means the
# machine changed under the run (throttling, another job), beyond what median-of-repeats can absorb.
AR_DRIFT_LIMIT = 1.5
CI_LEVEL = 0.95
# Student-t 97.5 % quantiles by degrees of freedom (a two-sided 95 % interval); between listed df the next lower one
# is used (wider: conservative), above 30 the normal 1.96.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t_quantile(df: int) -> float:
    """The two-sided 95 % Student-t quantile for `df` degrees of freedom.

    >>> t_quantile(1), t_quantile(11), t_quantile(100)
    (12.706, 2.228, 1.96)
    """
    if df > 30:
        return 1.96
    return T_975[max(d for d in T_975 if d <= df)]


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def cv(values: list[float]) -> float | None:
    """Sample standard deviation / mean; None with fewer than 2 values or a zero mean.

    >>> round(cv([90.0, 100.0, 110.0]), 3)
    0.1
    >>> cv([100.0]) is None
    True
    """
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    return statistics.stdev(values) / mean if mean else None


def speedup_interval(ar_tps: list[float], cand_tps: list[float]) -> tuple[float, float] | None:
    """Student-t 95 % interval of the paired speedup (geometric mean of candidate_i / AR_i); None with < 2 repeats.

    Pairs stay together (repeat i's AR and candidate passes ran back to back), so drift common to both cancels.

    >>> speedup_interval([100.0, 100.0, 100.0], [200.0, 200.0, 200.0])
    (2.0, 2.0)
    >>> lo, hi = speedup_interval([100.0, 80.0, 120.0], [150.0, 90.0, 210.0]); lo < 1.5 < hi
    True
    >>> lo, hi = speedup_interval([100.0, 100.0], [95.0, 97.0]); round(lo, 2), round(hi, 2)  # 2 repeats: wide
    (0.84, 1.1)
    >>> speedup_interval([100.0], [150.0]) is None
    True
    """
    if len(ar_tps) != len(cand_tps):
        raise ValueError(f"paired repeats needed: {len(ar_tps)} AR vs {len(cand_tps)} candidate values")
    logs = [math.log(c / a) for a, c in zip(ar_tps, cand_tps) if a > 0 and c > 0]
    if len(logs) < 2:
        return None
    half = t_quantile(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


@dataclass(frozen=True)
class Spread:
    """The spread columns of one run (None where one repeat gives no spread)."""
    ar_tokens_per_s_cv: float | None
    tokens_per_s_cv: float | None
    speedup_ci_low: float | None
    speedup_ci_high: float | None
    noisy: bool | None
    noisy_reason: str | None

    def columns(self) -> dict:
        return dict(vars(self))


def spread(ar_tps: list[float], cand_tps: list[float], speedup: float | None) -> Spread:
    """CVs, the speedup interval and the noisy flag for paired per-repeat tokens/s and the headline speedup.

    >>> spread([100.0], [150.0], 1.5).noisy_reason
    '1 repeat: no spread'
    >>> spread([100.0, 101.0, 99.0], [150.0, 152.0, 149.0], 1.5).noisy
    False
    >>> spread([100.0, 100.0, 100.0], [100.0, 150.0, 200.0], 1.5).noisy_reason
    'candidate tokens/s CV 0.33 > 0.15; speedup 1.50x but its 95% interval [0.61, 3.43] includes 1.0'
    """
    a_cv, c_cv = cv(ar_tps), cv(cand_tps)
    ci = speedup_interval(ar_tps, cand_tps)
    if ci is None:
        return Spread(a_cv, c_cv, None, None, None, f"{len(ar_tps)} repeat: no spread")
    reasons = [f"{side} tokens/s CV {v:.2f} > {CV_LIMIT:g}" for side, v in (("AR", a_cv), ("candidate", c_cv))
               if v is not None and v > CV_LIMIT]
    lo, hi = ci
    if speedup is not None and lo < 1.0 < hi and abs(speedup - 1.0) > CLEAR_EFFECT:
        reasons.append(f"speedup {speedup:.2f}x but its {CI_LEVEL:.0%} interval [{lo:.2f}, {hi:.2f}] includes 1.0")
    return Spread(a_cv, c_cv, lo, hi, bool(reasons), "; ".join(reasons) or None)


def speedup_bound(mean_accepted_tokens: float, cost_ratio: float | None = None,
                  draft_forwards_per_step: float | None = None) -> tuple[float, str]:
    """The largest speedup the accepted tokens allow, before slack, and how it was derived.

    A step emits mean_accepted_tokens tokens (bonus included) and costs at least one target step, plus, with a
    measured draft/target cost ratio c, the drafter's k forwards at c target steps each: mean_accepted / (1 + c*k).
    Without c (e.g. n-gram drafting, whose draft cost is not a model pass) only mean_accepted holds.

    >>> speedup_bound(2.0)
    (2.0, 'mean accepted tokens 2')
    >>> speedup_bound(3.0, cost_ratio=0.1, draft_forwards_per_step=5)
    (2.0, 'mean accepted tokens 3 / (1 + cost ratio 0.1 x 5 draft forwards)')
    """
    if cost_ratio is not None and draft_forwards_per_step and cost_ratio > 0:
        bound = mean_accepted_tokens / (1 + cost_ratio * draft_forwards_per_step)
        return bound, (f"mean accepted tokens {mean_accepted_tokens:.3g} / (1 + cost ratio {cost_ratio:.3g} x "
                       f"{draft_forwards_per_step:.3g} draft forwards)")
    return mean_accepted_tokens, f"mean accepted tokens {mean_accepted_tokens:.3g}"


def plausibility(speedup: float | None, mean_accepted_tokens: float | None, acceptance_rate: float | None,
                 ar_tps: list[float], *, cost_ratio: float | None = None,
                 draft_forwards_per_step: float | None = None) -> tuple[bool, str | None]:
    """(plausible, reason when not): speedup within what the accepted tokens allow (+ SPEEDUP_SLACK), acceptance
    rate in [0, 1], and the baseline's per-repeat tokens/s within AR_DRIFT_LIMIT of each other.

    "ngram k=1 with 3.19x": one draft token per step emits at most 2 tokens, so 3.19x cannot be a real speedup.

    >>> plausibility(3.19, 1.9, 0.9, [100.0, 101.0, 99.0])
    (False, 'speedup 3.19x > bound 2.09x (mean accepted tokens 1.9, +10% slack)')
    >>> plausibility(1.6, 1.9, 0.9, [100.0, 101.0, 99.0])
    (True, None)
    >>> plausibility(1.0, 1.0, 1.2, [100.0, 160.0])
    (False, 'acceptance rate 1.2 outside [0, 1]; AR baseline drifted: fastest repeat 1.6x the slowest (limit 1.5x)')
    """
    reasons = []
    if speedup is not None and mean_accepted_tokens is not None and mean_accepted_tokens > 0:
        bound, how = speedup_bound(mean_accepted_tokens, cost_ratio, draft_forwards_per_step)
        if speedup > bound * (1 + SPEEDUP_SLACK):
            reasons.append(f"speedup {speedup:.3g}x > bound {bound * (1 + SPEEDUP_SLACK):.3g}x ({how}, "
                           f"+{SPEEDUP_SLACK:.0%} slack)")
    if acceptance_rate is not None and not 0.0 <= acceptance_rate <= 1.0:
        reasons.append(f"acceptance rate {acceptance_rate:.3g} outside [0, 1]")
    if len(ar_tps) >= 2 and min(ar_tps) > 0 and max(ar_tps) / min(ar_tps) > AR_DRIFT_LIMIT:
        reasons.append(f"AR baseline drifted: fastest repeat {max(ar_tps) / min(ar_tps):.2g}x the slowest "
                       f"(limit {AR_DRIFT_LIMIT:g}x)")
    return not reasons, "; ".join(reasons) or None


def trust_columns(ar_tps: list[float], cand_tps: list[float], speedup: float | None,
                  mean_accepted_tokens: float | None, acceptance_rate: float | None, *,
                  cost_ratio: float | None = None, draft_forwards_per_step: float | None = None) -> dict:
    """Every trust column of a run record, from its per-repeat tokens/s and headline figures."""
    ok, why = plausibility(speedup, mean_accepted_tokens, acceptance_rate, ar_tps, cost_ratio=cost_ratio,
                           draft_forwards_per_step=draft_forwards_per_step)
    return {"ar_tokens_per_s_repeats": list(ar_tps), "tokens_per_s_repeats": list(cand_tps),
            **spread(ar_tps, cand_tps, speedup).columns(), "plausible": ok, "implausible_reason": why}
