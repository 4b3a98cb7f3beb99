"""The capacity scheduler over the target's paged KV pool.

Each request has a *worst case*: the blocks it holds just before its last step, ceil((prompt + max_new_tokens + N
+ 2) / block_size) (N draft nodes verified per step; + 2 is the engine's own margin, `SpecEngine.required_len`).

- **no_evict**: admit a request only when its worst case fits beside the worst cases of everyone admitted; blocks
  then can never run out, so nothing is ever preempted (a step may still leave a request waiting in the queue).
- **max_util**: admit greedily (its prefill's blocks and one spare block free now); before each step, if the
  decoding rows' next blocks do not fit, preempt the most recently admitted request (free its row and blocks; it
  goes back to the front of the queue and is recomputed when readmitted), and repeat.

A request whose worst case exceeds the whole pool, or a cache row, can never run: `check` raises
`RequestTooLargeError` for it before any work starts.

    >>> s = CapacityScheduler("no_evict", num_blocks=10, block_size=4, num_nodes=2)
    >>> s.worst_case(prompt_len=10, max_new_tokens=8)   # ceil((10 + 8 + 2 + 2) / 4)
    6
"""
from __future__ import annotations

import math

from workbench.serving.config import RequestTooLargeError, ServeError
from workbench.serving.request import RequestState


class CapacityScheduler:
    def __init__(self, policy: str, num_blocks: int, block_size: int, num_nodes: int, max_len: int | None = None):
        if policy not in ("no_evict", "max_util"):
            raise ServeError(f"unknown scheduler policy {policy!r}; choose no_evict or max_util")
        self.policy, self.num_blocks, self.block_size = policy, num_blocks, block_size
        self.num_nodes, self.max_len = num_nodes, max_len
        self.reserved = 0  # no_evict: sum of admitted requests' worst cases
        self.preemptions = 0
        self._seq = 0

    def worst_case(self, prompt_len: int, max_new_tokens: int) -> int:
        return math.ceil(self.slots(prompt_len, max_new_tokens) / self.block_size)

    def slots(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens + self.num_nodes + 2

    def check(self, req) -> None:
        """RequestTooLargeError when the request could never be served (before any work)."""
        need = self.worst_case(len(req.prompt), req.max_new_tokens)
        if need > self.num_blocks:
            raise RequestTooLargeError(
                f"request {req.id} ({len(req.prompt)} prompt tokens + {req.max_new_tokens} new + {self.num_nodes} "
                f"draft nodes) needs up to {need} KV blocks of {self.block_size} tokens; the whole pool has "
                f"{self.num_blocks}: raise --kv-blocks to >= {need} (or --kv-block-size), or lower --max-new-tokens "
                f"or the prompt length")
        slots = self.slots(len(req.prompt), req.max_new_tokens)
        if self.max_len is not None and slots > self.max_len:
            raise RequestTooLargeError(f"request {req.id} needs {slots} KV slots; a cache row holds {self.max_len}: "
                                       f"lower --max-new-tokens or the prompt length")

    # -- admission ----------------------------------------------------------------------------------------------
    def can_admit(self, state: RequestState, free_blocks: int, cached_hit_blocks: int = 0) -> bool:
        if self.policy == "no_evict":
            return self.reserved + self._worst(state) <= self.num_blocks
        prefill = math.ceil(len(state.prefill_tokens) / self.block_size) - cached_hit_blocks
        return free_blocks >= prefill + 1

    def admitted(self, state: RequestState) -> None:
        state.admit_seq = self._seq
        self._seq += 1
        if self.policy == "no_evict":
            self.reserved += self._worst(state)

    def released(self, state: RequestState) -> None:
        """The request finished or was preempted: its reservation is given back."""
        if self.policy == "no_evict":
            self.reserved -= self._worst(state)

    def _worst(self, state: RequestState) -> int:
        return self.worst_case(len(state.req.prompt), state.req.max_new_tokens)

    # -- preemption (max_util) ------------------------------------------------------------------------------------
    def victim(self, running: list[RequestState], older_than: int | None = None) -> RequestState | None:
        """The most recently admitted running request (admitted after `older_than`, when given); None if none.
        no_evict never preempts: it returns None."""
        if self.policy == "no_evict":
            return None
        pool = [s for s in running if older_than is None or s.admit_seq > older_than]
        return max(pool, key=lambda s: s.admit_seq, default=None)
