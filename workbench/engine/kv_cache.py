"""KV caches owned by the engine: a contiguous one and a paged one (fixed-size blocks, per-sequence block tables).

Both are the model's `AttentionBackend`: a step calls `begin(...)` once, then every layer calls `attend(...)`,
which writes this step's K/V at positions `base_len[b] + t` and attends over everything before plus the step's own
tokens under the step's mask. Positions here are cache slots, not RoPE positions: a tree node at depth d sits in
slot base + 1 + node_index while its RoPE position is base + d. `move` copies the accepted path's KV down to the
slots the positions say (a no-op for chains), and `truncate` rewinds rejected tokens (the paged cache frees whole
blocks past the new length).

A cache has `max_rows` rows (sequence slots); the engine maps each live sequence to a row and passes the rows of the
live sequences each step, so finished sequences leave the batch without moving any data. One extra row, `pad_row`,
is scratch space for the padding rows of a fixed-shape (graph-bucketed) step: they write and read only there.

A step has two halves, so that the device half can be captured in a CUDA graph:
    plan(rows_host, base_host, num_new)           host: capacity checks, block allocation (block table updated in place)
    prepare(rows, base_len, num_new, mask, span)  device only: write slots, read slots and the [B, 1, T, S] mask,
                                                  for a read span S that is either the live need (eager) or fixed
                                                  (`static_span`, the whole reserved length: fixed-shape steps)
`begin` is both, with the live span.

Formats (`kv_quant`, workbench/engine/kv_quant.py): "none" keeps K and V in the model's dtype; "int8" and "fp8" store
quantized values plus a float32 scale per (slot, KV head) in `k_scale` / `v_scale`, quantized in `_write` and
dequantized in `_read` (gather + SDPA) or inside the Triton kernel. Moves copy the scales with the values.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

import torch
import torch.nn.functional as F

from kernels.paged_attention import MASK_WINDOW, bit_weights, mask_bits
from workbench.engine.kv_quant import SCALE_DTYPE, KVFormatError, kv_format




class CacheFullError(RuntimeError):
    """No free KV blocks (or slots) left for the requested length."""


class KVCache(ABC):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_rows: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str, kv_quant: str = "none"):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_rows, self.max_len = max_rows, max_len
        self.dtype, self.device = dtype, torch.device(device)  # dtype: the model's (what reads return)
        self.kv_quant, self.format = kv_quant, kv_format(kv_quant)
        self.k = self.v = None  # [..., Hkv, D] pools in the format's storage dtype (set by each implementation)
        self.k_scale = self.v_scale = None  # [..., Hkv] float32 per slot and KV head (quantized formats), else None
        self._rows: torch.Tensor | None = None  # [B] this step's rows
        self._write_pos: torch.Tensor | None = None  # [B, T] slot positions written this step
        self._mask: torch.Tensor | None = None  # [B, 1, T, S] bool
        self._span = 0  # S: key positions read this step
        self._base: torch.Tensor | None = None  # [B] committed length before this step
        self._intra_mask: torch.Tensor | None = None  # [B, T, T] bool or None (causal)
        self._prefix_mask: torch.Tensor | None = None  # [B, T, M] bool (M > 0) or None: the kernel path's prefix mask
        # the kernel path's mask bit-words (kernels.paged_attention.mask_bits) of a tree- or prefix-masked step, built
        # once in `prepare` for every layer; None: a causal step
        self._bits: tuple[torch.Tensor, int] | None = None
        self.kernel = None  # gather + SDPA until `set_kernels`
        self._use_kernel = False  # this step uses it (never for prefill)
        self.write_kernel = None
        self._bit_weights = bit_weights(MASK_WINDOW, self.device)  # what `mask_bits` sums, made once

    # torch.compile guards a compiled frame on the plain bools below, which it compares, and not reliably on whether a
    # disabled function attribute is None: a step compiled over a kernel-path cache was reused for a gather + SDPA
    # cache of another engine on the same model, and passed it unrotated q / k. So the traced code reads the bools.
    @property
    def kernel(self):
        """The attention kernel over the pool (paged caches, "triton" backend); None = gather + SDPA."""
        return self._kernel

    @kernel.setter
    def kernel(self, fn) -> None:
        self._kernel, self._has_kernel = fn, fn is not None

    @property
    def write_kernel(self):
        """Paged caches on the kernel path: K/V write + attention in one call (unquantized pools); None = write,
        then `kernel`."""
        return self._write_kernel

    @write_kernel.setter
    def write_kernel(self, fn) -> None:
        self._write_kernel, self._has_write_kernel = fn, fn is not None

    @property
    def pad_row(self) -> int:
        """The scratch row that padding rows of a fixed-shape step use."""
        return self.max_rows

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes: K and V of every layer and KV head, scales included."""
        return self.format.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def _alloc(self, shape: tuple[int, ...]) -> None:
        """Pools of `shape` [..., Hkv, D] in the format's storage dtype, and its scales [..., Hkv]."""
        store = self.format.storage_dtype(self.dtype)
        self.k = torch.zeros(shape, dtype=store, device=self.device)
        self.v = torch.zeros(shape, dtype=store, device=self.device)
        if self.format.quantized:
            self.k_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=self.device)
            self.v_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=self.device)

    def _planes(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """((k pool, k scales), (v pool, v scales)); scales None for "none"."""
        return (self.k, self.k_scale), (self.v, self.v_scale)

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by slot (pools, then scales): what a move copies."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    @property
    def static_span(self) -> int:
        """The read span S of a fixed-shape step: every slot a row can hold."""
        return self._read_span(self.max_len)

    # -- step -----------------------------------------------------------------------------------------------------
    def begin(self, rows: torch.Tensor, base_len: torch.Tensor, base_len_host: list[int], num_new: int,
              intra_mask: torch.Tensor | None = None, rows_host: list[int] | None = None,
              prefill: bool = False) -> None:
        """Prepare a step that writes `num_new` tokens per row after `base_len` (eager: plan, then prepare).

        rows [B] long; base_len [B] long (device) and the same values on the host; intra_mask [B, T, T] bool among
        the step's tokens (None = causal); rows_host = rows as a list (saves a device->host read when given);
        prefill: a prompt-length step, which always uses gather + SDPA (the kernel specializes on T: one compile per
        prompt length, seen on the H200 as an 8.7x slower first timed repeat).
        Everything the layers need (write slots, read slots, mask) is computed here once per step.
        """
        need = self.plan(rows.tolist() if rows_host is None else rows_host, base_len_host, num_new)
        self.prepare(rows, base_len, num_new, intra_mask, self._read_span(need), kernel=not prefill)

    def plan(self, rows_host: list[int], base_len_host: list[int], num_new: int) -> int:
        """Host half of a step: check room and allocate storage for positions < base + num_new. Returns the need."""
        need = max(base_len_host) + num_new
        if need > self.max_len:
            raise CacheFullError(f"step needs {need} KV slots, cache holds {self.max_len} per sequence")
        self._ensure_capacity(rows_host, base_len_host, num_new)
        return need

    def prepare(self, rows: torch.Tensor, base_len: torch.Tensor, num_new: int, intra_mask: torch.Tensor | None,
                span: int, kernel: bool = True, prefix_mask: torch.Tensor | None = None,
                write_pos: torch.Tensor | None = None) -> None:
        """Device half of a step: index tensors and mask shared by all layers; no host reads (graph-capturable).

        rows [B], base_len [B] long; intra_mask [B, T, T] bool or None (causal); span: key slots read per row;
        prefix_mask [B, T, M] bool or None: which of the M slots just before base_len each new token sees (None: all;
        a drafter's own tree levels written by earlier forwards of the same step: EAGLE sees only its ancestors).
        The kernel path takes a prefix mask as it takes the intra mask (one bit-word per query token); a step whose
        M + T exceeds the kernel's MASK_WINDOW bits goes through gather + SDPA instead. write_pos [B, T] long: the
        positions written, base_len + 0 .. T-1, where the caller has them already (None: made here).
        """
        m = 0 if prefix_mask is None else prefix_mask.shape[-1]
        self._rows = rows
        self._base = base_len
        self._intra_mask = intra_mask
        self._prefix_mask = prefix_mask if m else None
        self._use_kernel = kernel and self._has_kernel and (not m or m + num_new <= MASK_WINDOW)
        if write_pos is None:
            write_pos = base_len.unsqueeze(1) + torch.arange(num_new, device=self.device)
        self._write_pos = write_pos  # [B, T]
        self._span = span
        self._prepare_slots()
        self._bits = None
        if self._use_kernel:  # the kernel masks from lengths and the intra / prefix masks itself: no [B, 1, T, S] mask
            if intra_mask is not None or m:
                self._bits = mask_bits(intra_mask, self._prefix_mask, rows.shape[0], num_new, self.device,
                                       weights=self._bit_weights)
            return
        key_pos = torch.arange(self._span, device=self.device)  # [S]
        before = key_pos.view(1, 1, -1) < base_len.view(-1, 1, 1)  # [B, 1, S]
        if m:
            rel_prefix = key_pos.view(1, -1) - (base_len.view(-1, 1) - m)  # [B, S]: index among the M prefix slots
            in_prefix = (rel_prefix >= 0) & (rel_prefix < m)
            seen = prefix_mask.gather(2, rel_prefix.clamp(0, m - 1).unsqueeze(1).expand(-1, num_new, -1))  # [B, T, S]
            before = before & (~in_prefix.unsqueeze(1) | seen)  # [B, T, S]
        rel = key_pos.view(1, -1) - base_len.view(-1, 1)  # [B, S]
        in_step = (rel >= 0) & (rel < num_new)
        if intra_mask is None:
            intra_mask = torch.ones(num_new, num_new, dtype=torch.bool, device=self.device).tril().expand(
                rows.shape[0], num_new, num_new)
        rel_idx = rel.clamp(0, max(num_new - 1, 0)).unsqueeze(1).expand(-1, num_new, -1)  # [B, T, S]
        visible = intra_mask.gather(2, rel_idx) & in_step.unsqueeze(1)
        self._mask = (before | visible).unsqueeze(1)  # [B, 1, T, S]

    def attends_in_one_call(self) -> bool:
        """Whether this step's `attend` is the fused K/V write + attention launch (an unquantized cache on the kernel
        path), which torch.compile never traces: the model then calls `attend` from outside its compiled frames, so one
        compiled graph serves every layer (llama.attend_uncompiled says why that matters)."""
        return self._use_kernel and self._has_write_kernel and not self.format.quantized

    def fuses_rope(self) -> bool:
        """Whether this step's `attend` takes q and k before RoPE with rope=(cos, sin_signed) [B, T, D]: on the fused
        K/V write + attention path (an unquantized paged cache on the kernel path), where the kernels rotate them as
        they load them and no RoPE kernel runs per layer (measured faster than rotating in the model)."""
        return self.attends_in_one_call()

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [B, Hq, T, D]; k, v [B, Hkv, T, D] -> [B, Hq, T, D]. rope: only where `fuses_rope()` (q, k unrotated)."""
        if self.attends_in_one_call():
            # one call, outside torch.compile: K/V into the pool (one launch) and attention over it
            extra = {} if rope is None else {"rope": rope}
            if self._bits is not None:  # a tree or prefix mask: its bit-words, built once for every layer
                extra.update(prefix_mask=self._prefix_mask, bits=self._bits)
            return self.write_kernel(q, k, v, self._write_slots, self.k[layer_idx], self.v[layer_idx],
                                     self.block_table, self._rows, self._base, self._intra_mask, self.block_size,
                                     **extra)
        if rope is not None:
            raise ValueError("attend(rope=...) is for the fused K/V write + attention path only (see fuses_rope)")
        self._write(layer_idx, k.transpose(1, 2), v.transpose(1, 2))
        if self._use_kernel:  # reads the pool in place through the block table: no gather, no mask tensor
            fmt, quant = self.format, self.format.quantized
            extra = {} if self._bits is None else {"prefix_mask": self._prefix_mask, "bits": self._bits}
            return self.kernel(q, fmt.kernel_view(self.k[layer_idx]), fmt.kernel_view(self.v[layer_idx]),
                               self.block_table, self._rows, self._base, self._intra_mask, self.block_size,
                               k_scales=self.k_scale[layer_idx] if quant else None,
                               v_scales=self.v_scale[layer_idx] if quant else None, **extra)
        keys, values = self._read(layer_idx)  # [B, Hkv, S, D]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self._mask,
                                              enable_gqa=q.shape[1] != keys.shape[1])

    # -- bookkeeping ----------------------------------------------------------------------------------------------
    def move(self, rows: torch.Tensor, src_pos: torch.Tensor, dst_pos: torch.Tensor) -> None:
        """Copy KV at slot src_pos[b, j] to dst_pos[b, j] in every layer (rows [B]; -1 src = skip)."""
        keep = src_pos >= 0
        r = rows.unsqueeze(1).expand_as(src_pos)[keep]
        src, dst = src_pos[keep], dst_pos[keep]
        if r.numel():
            self._copy_slots(r, src, dst)

    def move_path(self, rows: torch.Tensor, src_pos: torch.Tensor, dst_pos: torch.Tensor) -> None:
        """`move` without a skip: every src_pos[b, j] [B, D] is copied to dst_pos[b, j] (a slot that stays put has
        src = dst), so no host read decides what moves (graph-capturable). All reads happen before the writes."""
        self._copy_slots(rows.unsqueeze(1), src_pos, dst_pos)  # rows broadcast over each row's slots

    def truncate(self, row: int, new_len: int) -> None:
        """Rewind: positions >= new_len of `row` are dropped (their storage may be reused)."""

    def free(self, row: int) -> None:
        """The sequence in `row` finished: release its storage."""
        self.truncate(row, 0)

    def reset(self) -> None:
        """Every sequence row released (the padding row keeps its storage): ready for the next generation."""
        for row in range(self.max_rows):
            self.free(row)

    def fits(self, max_rows: int, max_len: int, num_blocks: int | None = None) -> bool:
        """Whether this cache can serve a generation of max_rows sequences of up to max_len slots each
        (and, paged, num_blocks blocks in all)."""
        return max_rows <= self.max_rows and max_len <= self.max_len

    # -- storage (per implementation) -----------------------------------------------------------------------------
    @abstractmethod
    def _ensure_capacity(self, rows: list[int], base_len_host: list[int], num_new: int) -> None: ...

    def _prepare_slots(self) -> None:
        """Per-step index tensors shared by all layers (after _rows, _write_pos, _span, _use_kernel are set)."""

    @abstractmethod
    def _read_span(self, need: int) -> int: ...

    @abstractmethod
    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, T, Hkv, D] at self._rows / self._write_pos."""

    @abstractmethod
    def _read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def _copy_slots(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's KV (and scales) at slot src of row `rows` copied to slot dst; rows broadcast to src / dst."""

    @property
    @abstractmethod
    def nbytes(self) -> int: ...


class ContiguousKVCache(KVCache):
    """One [max_rows, max_len] slab per layer; rows never share storage."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # k, v [L, R + 1, S, Hkv, D] (+1: pad_row); k_scale, v_scale [L, R + 1, S, Hkv] when quantized
        self._alloc((self.num_layers, self.max_rows + 1, self.max_len, self.num_kv_heads, self.head_dim))

    def _ensure_capacity(self, rows, base_len_host, num_new):
        pass

    def _read_span(self, need: int) -> int:
        return need

    def _prepare_slots(self) -> None:
        self._write_idx = (self._rows.unsqueeze(1).expand_as(self._write_pos), self._write_pos)

    def _write(self, layer, k, v):
        for (pool, scales), x in zip(self._planes(), (k, v)):
            values, scale = self.format.quantize(x)  # [B, T, Hkv, D], [B, T, Hkv] or None
            pool[layer].index_put_(self._write_idx, values)
            if scale is not None:
                scales[layer].index_put_(self._write_idx, scale)

    def _read(self, layer):
        s, rows = self._span, self._rows
        return tuple(self.format.dequantize(pool[layer, rows, :s], None if scales is None else scales[layer, rows, :s],
                                            self.dtype).transpose(1, 2) for pool, scales in self._planes())

    def _copy_slots(self, rows, src, dst):
        for t in self._tensors():
            t[:, rows, dst] = t[:, rows, src]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())


class PagedKVCache(KVCache):
    """A pool of fixed-size blocks shared by all rows; a block table maps each row's logical blocks to physical ones.

    Blocks are allocated as a sequence grows and returned on `truncate`/`free`. Reads gather only the blocks this
    step needs (the longest row's), so memory traffic follows the live context, not the reserved maximum.
    """

    def __init__(self, *args, block_size: int = 16, num_blocks: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if block_size < 1:
            raise ValueError(f"kv block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blocks_per_row = math.ceil(self.max_len / block_size)
        self.num_blocks = num_blocks or self.max_rows * self.blocks_per_row  # blocks shared by the sequences
        # the pool also holds the padding row's own blocks, after the shared ones (never handed to sequences)
        # k, v [L, blocks * block_size, Hkv, D]; k_scale, v_scale [L, blocks * block_size, Hkv] when quantized
        self._alloc((self.num_layers, (self.num_blocks + self.blocks_per_row) * block_size, self.num_kv_heads,
                     self.head_dim))
        # [R + 1, blocks per row]: row R is pad_row; unused entries point at block 0 (read only under a False mask)
        self.block_table = torch.zeros(self.max_rows + 1, self.blocks_per_row, dtype=torch.long, device=self.device)
        self._host_table: list[list[int]] = [[] for _ in range(self.max_rows)]
        self._host_table.append(list(range(self.num_blocks, self.num_blocks + self.blocks_per_row)))
        # the device table's host image, refreshed per changed row (`_stale`) and uploaded whole by `_sync_table`
        self._table_image = np.zeros((self.max_rows + 1, self.blocks_per_row), dtype=np.int64)
        self._table_image[self.pad_row] = self._host_table[-1]
        self._stale: set[int] = set()
        self.block_table[self.pad_row] = torch.from_numpy(self._table_image[self.pad_row])
        # [R + 1, blocks per row * block size]: the block table spelled out per position (each position's slot), kept
        # in step with it on the device, so a step finds its slots with one lookup
        self.slot_table = torch.zeros(self.max_rows + 1, self.blocks_per_row * block_size, dtype=torch.long,
                                      device=self.device)
        self._block_offsets = torch.arange(block_size, device=self.device)
        self._refresh_slots()
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def fits(self, max_rows: int, max_len: int, num_blocks: int | None = None) -> bool:
        need = num_blocks if num_blocks is not None else max_rows * math.ceil(max_len / self.block_size)
        return super().fits(max_rows, max_len) and need <= self.num_blocks

    def _ensure_capacity(self, rows, base_len_host, num_new):
        changed = False
        for row, base in zip(rows, base_len_host):
            have = self._host_table[row]
            want = math.ceil((base + num_new) / self.block_size)
            while len(have) < want:
                have.append(self._take())
                changed = True
                self._stale.add(row)
        if changed:
            self._sync_table()

    def truncate(self, row: int, new_len: int) -> None:
        keep = math.ceil(new_len / self.block_size)
        blocks = self._host_table[row]
        if len(blocks) > keep:
            self._stale.add(row)  # the device table keeps the dropped entries (never read) until the next upload
        while len(blocks) > keep:
            self._drop(blocks.pop())

    # block ownership: a subclass that shares blocks (serving/prefix_cache.py) overrides these two
    def _take(self) -> int:
        """A free block for a row's table."""
        if not self._free:
            raise CacheFullError(f"paged KV cache out of blocks ({self.num_blocks} of {self.block_size})")
        return self._free.pop()

    def _drop(self, block: int) -> None:
        """A row's table let go of `block`."""
        self._free.append(block)

    def _sync_table(self) -> None:
        """The device block table from the host tables, in place: a captured graph reads this very tensor. Rows in
        `_stale` (whose host table changed: blocks taken, dropped or attached) are rewritten in the host image
        first; unused entries are 0 (read only under a False mask).

        One copy of the whole image, enqueued in stream order without waiting for the device: a blocking upload waits
        for every step already in flight (an overlapped step's pipeline drained each time a row crosses a block). On
        a GPU the image goes through a pinned copy of its own (the caching host allocator keeps it until the copy has
        run), so the image can change right after. The table was built row by row with a tensor per row before:
        about 5 host ops per cache row per upload (190 per serving iteration on tiny at 64 rows). Nothing is uploaded
        when the stale rows came back to what the device holds (blocks given back are taken again last-in first-out,
        so a row whose step's draft blocks were truncated usually gets the very same ones)."""
        image = self._table_image
        changed = False
        for r in self._stale:
            blocks = self._host_table[r]
            row = np.zeros(self.blocks_per_row, dtype=np.int64)
            row[:len(blocks)] = blocks
            if not np.array_equal(row, image[r]):
                image[r] = row
                changed = True
        self._stale.clear()
        if not changed:  # e.g. a tree step's draft blocks given back and taken again: the device holds this table
            return
        host = torch.from_numpy(image)  # (on a CPU the copy below is done when it returns)
        self.block_table.copy_(host.pin_memory() if self.block_table.is_cuda else host, non_blocking=True)
        self._refresh_slots()

    def _refresh_slots(self) -> None:
        """`slot_table` from the device block table, in place (one launch, in stream order): a captured graph reads
        this very tensor."""
        torch.add(self._block_offsets, self.block_table.unsqueeze(-1), alpha=self.block_size,
                  out=self.slot_table.view(self.max_rows + 1, self.blocks_per_row, self.block_size))

    def _slots(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """rows broadcastable to pos; pos [...] -> physical slot [...]."""
        return self.slot_table[rows, pos]

    def _read_span(self, need: int) -> int:
        return math.ceil(need / self.block_size) * self.block_size

    def _prepare_slots(self) -> None:
        self._write_slots = self._slots(self._rows.unsqueeze(1), self._write_pos).reshape(-1)  # [B * T]
        if self._use_kernel:  # the kernel reads the pool through the block table: no gather indices
            return
        self._read_slots = self.slot_table[self._rows, :self._span]  # [B, S]

    def _write(self, layer, k, v):
        for (pool, scales), x in zip(self._planes(), (k, v)):
            values, scale = self.format.quantize(x.reshape(-1, *x.shape[2:]))  # [B * T, Hkv, D], [B * T, Hkv]
            pool[layer].index_copy_(0, self._write_slots, values)
            if scale is not None:
                scales[layer].index_copy_(0, self._write_slots, scale)

    def _read(self, layer):
        slots = self._read_slots
        return tuple(self.format.dequantize(pool[layer][slots], None if scales is None else scales[layer][slots],
                                            self.dtype).transpose(1, 2) for pool, scales in self._planes())

    def _copy_slots(self, rows, src, dst):
        s, d = self._slots(rows, torch.stack([src, dst]))  # both slot lists in one lookup
        for t in self._tensors():
            t[:, d] = t[:, s]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())


from workbench.choices import ATTENTION_BACKENDS  # noqa: E402 - declared once, torch-free


def resolve_attention(name: str, paged: bool, device: torch.device | str, kv_quant: str = "none") -> str:
    """"auto" -> "triton" for paged caches on a GPU where the kernel imports and can load the KV format, else "sdpa"
    (gather + SDPA, which dequantizes any format in PyTorch). "triton" where it cannot run raises a named error."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    fmt = kv_format(kv_quant)
    if name == "sdpa":
        return name
    from kernels import paged_attention as kernel

    dev = torch.device(device)
    usable = paged and dev.type == "cuda" and kernel.TRITON_AVAILABLE
    if name == "triton" and not usable:
        raise ValueError("attention backend 'triton' needs a paged KV cache on a CUDA GPU with triton installed; "
                         "use 'sdpa' (or 'auto') here")
    problem = None
    if usable and fmt.quantized:
        problem = kernel.kv_dtype_problem(fmt.value_dtype(torch.float32), torch.cuda.get_device_capability(dev))
    if name == "triton" and problem:
        raise KVFormatError(f"attention backend 'triton' cannot read kv_quant={kv_quant!r} here: {problem}; use "
                            "attention 'sdpa' or 'auto' (gather + SDPA dequantizes every format) or kv_quant 'int8'")
    return "triton" if usable and problem is None else "sdpa"


def make_cache(paged: bool, *, num_layers: int, num_kv_heads: int, head_dim: int, max_rows: int, max_len: int,
               dtype: torch.dtype, device, block_size: int = 16, num_blocks: int | None = None,
               attention: str = "sdpa", kv_quant: str = "none") -> KVCache:
    """A paged or contiguous cache in the KV format `kv_quant` ("none" | "int8" | "fp8"), with its attention backend
    (KVFormatError for an unknown format or one the asked backend cannot read, before anything is allocated)."""
    backend = resolve_attention(attention, paged, device, kv_quant)
    if paged:
        cache = PagedKVCache(num_layers, num_kv_heads, head_dim, max_rows, max_len, dtype, device,
                             block_size=block_size, num_blocks=num_blocks, kv_quant=kv_quant)
    else:
        cache = ContiguousKVCache(num_layers, num_kv_heads, head_dim, max_rows, max_len, dtype, device,
                                  kv_quant=kv_quant)
    if backend == "triton":
        set_kernels(cache)
    return cache


def set_kernels(cache: KVCache) -> None:
    """The Triton attention kernel (and, paged, the fused K/V write + attention) as the cache's kernel path."""
    from kernels.paged_attention import paged_attention_triton, paged_write_attention_triton

    # launched as is, never traced by torch.compile (inductor re-types user kernels' scalar arguments); inside a
    # captured step the graph boundary costs nothing at replay
    cache.kernel = torch.compiler.disable(paged_attention_triton)
    if isinstance(cache, PagedKVCache):
        cache.write_kernel = torch.compiler.disable(paged_write_attention_triton)
