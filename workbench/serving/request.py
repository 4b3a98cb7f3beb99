"""What arrives (`Request`) and where it stands (`RequestState`).

A request's *context* is its prompt plus the tokens it emitted so far; the last of them is the *root* (the engine's
word: the token whose KV the next verify pass writes). A fresh request prefills its prompt and samples its first
token from the prefill's last logits; a preempted one prefills its context minus the root and keeps the root it had,
so recomputation never re-samples a token.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0  # seconds after the run's start (concurrency mode: when it was sent)
    measured: bool = True  # False: a warm-up request, left out of every metric


@dataclass
class RequestState:
    req: Request
    # pending -> waiting -> prefill -> decode -> done (preemption: back to waiting; `ServingLoop.abort`: aborted)
    phase: str = "pending"
    row: int | None = None
    admit_seq: int = -1  # admission order; the scheduler preempts the largest
    output: list[int] = field(default_factory=list)  # emitted tokens, capped at max_new_tokens
    prefilled: int = 0  # positions of prefill_tokens whose KV is written
    t_arrival: float | None = None
    t_admitted: float | None = None  # first admission (queue time = t_admitted - t_arrival)
    t_first_token: float | None = None
    t_done: float | None = None
    emit_times: list[float] = field(default_factory=list)  # one entry per emission event (prefill or step)
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    aborted: bool = False  # dropped by its client (open-ended serving): it leaves at the next iteration boundary
    spec_off: bool = False  # switched off by its acceptance window (for the rest of the request)
    window: deque = field(default_factory=lambda: deque(maxlen=1))  # (accepted, drafted) of its last steps
    hidden: list = field(default_factory=list)  # prefill chunks' hidden states (drafters that want them)

    @property
    def context(self) -> list[int]:
        return self.req.prompt + self.output

    @property
    def prefill_tokens(self) -> list[int]:
        """What the target must prefill: the prompt (fresh), or the context minus its root (after a preemption)."""
        return self.req.prompt + self.output[:-1] if self.output else self.req.prompt

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.req.max_new_tokens
