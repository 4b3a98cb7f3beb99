"""ServeTuning: how the serving loop itself runs (not what it serves), as one frozen record.

Each field is a loop variant kept because serving runs compare it (scripts/gpu_serving.py's control runs); the
defaults are the measured fastest. A run chooses it with the serve knob `serve_tuning` (text "field=value,...", ""
= the defaults), the loop takes it as an argument, and the serve-bench row records it resolved, every field.

Torch-free (settings checks the knob's text with it).

>>> t = parse_serve_tuning("full_overlap=0")
>>> t.batch_prefill, t.overlap_prefill, t.full_overlap
(4, True, False)
>>> format_serve_tuning(t)
'batch_prefill=4,overlap_prefill=1,full_overlap=0'
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from kernels.tuning import record_from_text, record_text


class ServeTuningError(ValueError):
    """A bad serve tuning text or value; the message names the field and what it takes."""


DEFAULT_BATCH_PREFILL = 4


@dataclass(frozen=True)
class ServeTuning:
    # prefill chunks of one iteration share forwards of up to this many rows (0 or 1: a forward per request); a
    # forward per request served 0.75-0.80x the output tokens/s of forwards of up to 4 rows
    batch_prefill: int = DEFAULT_BATCH_PREFILL
    # an iteration's prefill is planned before its step is launched and enqueued behind it, one wait covering both
    # (off: the step is read first, then the prefill planned with the blocks it gave back)
    overlap_prefill: bool = True
    # step t + 1 launched before step t is read where that applies (greedy chains with the fused accept, no_evict);
    # measured faster in most paired runs
    full_overlap: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.batch_prefill, bool) or not isinstance(self.batch_prefill, int) or self.batch_prefill < 0:
            raise ServeTuningError(f"batch_prefill={self.batch_prefill!r}: give the most rows per prefill forward as "
                                   f"a whole number (0 or 1: a forward per request; {DEFAULT_BATCH_PREFILL}, the "
                                   "default)")
        for name in ("overlap_prefill", "full_overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ServeTuningError(f"{name}={getattr(self, name)!r}: give 1 (on) or 0 (off)")


FIELDS = tuple(f.name for f in dataclasses.fields(ServeTuning))


@functools.lru_cache(maxsize=64)
def parse_serve_tuning(text: str | None) -> ServeTuning:
    """"field=value,..." ("": the defaults) -> ServeTuning; an unknown field or a bad value is a ServeTuningError."""
    return record_from_text(ServeTuning, text, ServeTuningError, "serve tuning")


def format_serve_tuning(tuning: ServeTuning) -> str:
    """Every field as "field=value", comma-separated in field order (what the serve-bench row records)."""
    return record_text(tuning)
