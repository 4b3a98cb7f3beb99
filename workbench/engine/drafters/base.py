"""The drafter plug-in contract.

A drafter proposes a draft tree for every live sequence of a step and keeps whatever state it needs (its own KV cache,
a token history, recurrent state) in step with what the verifier accepted. The engine never asks which drafter it
runs: it calls these methods in this order, for one generation:

    setup(ctx)                    once per generation: sizes, device, sampling settings, random generator, graph
                                  settings; a drafter keeps what it allocated (its KV cache, captured graphs) across
                                  generations when the new sizes fit
    prefill(state, ids, pos)      once: the prompts (right-padded ids [B, P], positions [B, P]); state.kv_len = lengths
                                  (a drafter with `wants_hidden` also gets hidden= the target's [B, P, H], right-padded)
    repeat until every sequence is done:
        tree = propose(state)     -> DraftTree over state.rows (same order); no host sync expected (ngram excepted)
        ...target verifies...
        commit(state, acc, old)   after the engine moved state.kv_len forward; `old` is the kv_len before the step
                                  (with `wants_hidden` also hidden= [B, 1 + D, H]: the target's final hidden states
                                  of the tokens the step committed, the root then the accepted nodes; entry
                                  acc.num_accepted is the last committed token's, entries past it are padding)
    release(row)                  a sequence finished: free its storage

A drafter with `splits_commit` (EAGLE, ReDrafter) splits commit into `commit_device` (device writes only, run inside
the engine's captured tree step, padding rows included) and `commit_host` (host bookkeeping after the step's read);
`device_state()` names the tensors commit_device advances, `depth_bound` the deepest path a tree can hold.

Rules every drafter must keep (the conformance tests check them):
- propose must not change committed tokens or the target's cache; it reads `state.tokens` / `state.tokens_host`;
- drafted tokens must come from `sampling.probs_from_logits` with `ctx.sampling` when the drafter samples, and then
  `DraftTree.draft_probs` holds those distributions; deterministic candidates leave it None;
- with greedy settings, whatever the drafter proposes, the engine's output equals plain autoregressive decoding.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from workbench.engine.graphs import GraphSettings
from workbench.engine.sampling import SamplingParams
from workbench.engine.tree import DraftTree


class DrafterError(ValueError):
    """A method with no drafter, or a drafter that lacks a model it needs; the message names what to do."""


@dataclass
class DraftContext:
    max_rows: int
    max_len: int  # KV slots per sequence the engine reserves
    device: torch.device
    sampling: SamplingParams
    generator: torch.Generator | None
    paged: bool = True
    kv_block_size: int = 16
    graphs: GraphSettings = GraphSettings()  # fixed-shape buckets / CUDA graphs / compile for the drafter's forwards
    attention: str = "sdpa"  # the attention backend of the drafter's KV cache (workbench/engine/kv_cache.py)
    # the engine's persistent buffers (what BatchState.tokens / kv_len_all will be), so that graphs reading them can
    # be captured before the first propose; None where a caller sets a drafter up without an engine
    tokens: torch.Tensor | None = None  # [R + 1, S] long
    kv_len_all: torch.Tensor | None = None  # [R + 1] long


@dataclass
class BatchState:
    """What a step knows about its live sequences. Row r's token t_i is tokens[r, i]; the root is tokens[r, kv_len[r]]."""
    rows: torch.Tensor  # [B] long: cache rows of the live sequences
    rows_host: list[int]
    tokens: torch.Tensor  # [R, S] long, device: every sequence's tokens (prompt + emitted); beyond the root: garbage
    tokens_host: list[list[int]]  # per row, the same tokens up to and including the root
    # [B] long: tokens whose target KV is written (= the root's index); not refreshed for drafters with reads_kv_len
    kv_len: torch.Tensor
    kv_len_host: list[int] = field(default_factory=list)
    kv_len_all: torch.Tensor | None = None  # [R + 1] long, persistent: kv_len of every row (the engine's own buffer)
    # draft nodes this step verifies (None = the drafter's N): a chain drafter may draft only this many (its forwards
    # past them would be thrown away); others may ignore it (the engine cuts their chain to it)
    num_nodes: int | None = None

    @property
    def root(self) -> torch.Tensor:  # [B]
        return self.tokens[self.rows, self.kv_len]


class Drafter(ABC):
    name: str = "drafter"
    num_nodes: int = 0  # N: draft nodes per sequence per step (static)
    model_forwards_per_step: int = 0  # drafter model passes per step (for the draft/target cost ratio)
    proposes_chains: bool = True  # every DraftTree it returns is a chain (lets greedy acceptance fuse into verify)
    # W beams of L tokens merged by DraftTree.from_beams (num_nodes = W x L, all beams valid): a step's drafted count
    # is then its distinct prefix-tree nodes, so drafted / num_nodes is its beam diversity (no extra device read)
    proposes_beams: bool = False
    # no two valid siblings of its trees hold the same token (top-K children, deduplicated beams): acceptance then
    # skips its duplicate-sibling rule (DraftTree.distinct_siblings), which would change nothing
    distinct_siblings: bool = False
    reads_kv_len: bool = True  # propose reads state.kv_len (else the engine skips gathering it)
    # feature-based drafters (ReDrafter, EAGLE): prefill and commit receive the target's final hidden states (hidden=);
    # the engine then verifies through its unfused path (the fused greedy chain step returns no hidden states)
    wants_hidden: bool = False
    # overlapped steps (EngineConfig.overlap): propose reads roots and lengths from the device only (state.kv_len_host
    # are then upper bounds, for storage planning) and commit does nothing but free storage (it is not called)
    overlaps: bool = False

    prefill_step = None  # graphs.PrefillStep of a drafter with a model and KV of its own (its `prefill` runs it)

    def setup(self, ctx: DraftContext) -> None:
        self.ctx = ctx

    def prefill(self, state: BatchState, prompt_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None = None) -> None:
        """prompt_ids, positions [B, P] right-padded; the true lengths are state.kv_len. With `wants_hidden`: also
        hidden= [B, P, H], the target's final hidden states of the prompts (right-padded like the ids)."""

    @abstractmethod
    def propose(self, state: BatchState) -> DraftTree: ...

    def commit(self, state: BatchState, acc, old_kv_len_host: list[int],
               hidden: torch.Tensor | None = None) -> None:
        """state already reflects the accepted tokens; acc is the verifier's Acceptance for state.rows. With
        `wants_hidden`: also hidden= [B, 1 + D, H], the committed tokens' target hidden states (root, accepted
        nodes)."""

    # the captured tree step (engine/step.py): a drafter whose commit splits into `commit_device` (device writes only,
    # run inside the target's captured verify + accept step) and `commit_host` (host bookkeeping after the read)
    splits_commit: bool = False

    def commit_device(self, rows: torch.Tensor, acc, hidden: torch.Tensor | None, pad_row: int | None) -> None:
        """The device half of `commit` for rows [B] (padding rows hold `pad_row`, whose state must stay as
        `setup` left it; None: the step has no padding rows): no host reads or host->device copies (it is captured
        in the step's CUDA graph)."""
        raise NotImplementedError(f"drafter {self.name!r} does not split its commit (splits_commit is False)")

    def commit_host(self, state: BatchState, old_kv_len_host: list[int]) -> None:
        """The host half of `commit`, after the step's read (storage bookkeeping)."""

    def device_state(self) -> list[torch.Tensor]:
        """The persistent tensors `commit_device` advances (a captured step's warm-up puts them back after it)."""
        return []

    @property
    def depth_bound(self) -> int:
        """The deepest path a proposed tree can hold (static): N for chains; a tree drafter's depth."""
        return self.num_nodes

    def release(self, row: int) -> None:
        pass

    def capture_graphs(self, sizes: list[int], node_counts: tuple[int, ...] | None = None) -> None:
        """Capture the drafter's forwards for these batch buckets ahead of use (after a first `setup`); node_counts:
        the draft lengths (`BatchState.num_nodes`) steps will ask for (None = only N)."""

    def catch_up(self, state: BatchState, ids: torch.Tensor, positions: torch.Tensor, start_host: list[int]) -> None:
        """A drafter with its own KV cache whose KV is valid below `start_host[i]` for row state.rows_host[i] (e.g.
        after autoregressive steps that did not draft): write it for ids [B, T] at positions [B, T] (right-padded;
        positions[i, 0] = start_host[i]). Only drafters that keep their own KV implement it."""
        raise NotImplementedError(f"drafter {self.name!r} keeps no KV of its own to catch up")

    def model_steps(self) -> list:
        """The drafter's `ModelStep`s (for graph statistics and per-phase profiling); none for model-free drafters."""
        return []

    def kv_caches(self) -> list:
        """The drafter's own KV caches (for their bytes per token and memory in the run record); none by default."""
        return []

    @property
    def settings(self) -> dict:
        return {}


class OneStepDrafter(Drafter):
    """A drafter whose whole propose is one fixed-shape step, `self.step` (None when it runs eagerly): its graphs are
    captured per batch bucket with the one shape key 0, and it is the drafter's only model step (ReDrafter, EAGLE; the
    n-gram drafter's device lookup)."""

    step = None  # FixedShapeStep | None, built by setup

    def capture_graphs(self, sizes: list[int], node_counts: tuple[int, ...] | None = None) -> None:
        if self.step is not None:
            for size in sizes:
                self.step.capture(size, 0)

    def model_steps(self) -> list:
        return [self.step] if self.step is not None else []
