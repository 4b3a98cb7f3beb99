"""Prefix block reuse: a paged KV cache whose full prompt blocks are hashed and shared between requests.

A block is identified by the hash of its tokens chained to its parent's hash (block i covers positions
[i * block_size, (i + 1) * block_size), so equal chains mean equal tokens at equal positions, hence equal KV). Each
physical block has a reference count (the rows whose block table holds it). When the count drops to 0 a hashed block
is not freed at once: it stays *cached* (evictable, least recently released first), so a later request with the same
prefix still finds it; allocation takes never-hashed free blocks first, then evicts cached ones.

    hits = cache.match(tokens, max_blocks)   # physical blocks holding tokens' leading full blocks, longest chain
    cache.attach(row, hits)                  # the row's table starts with them (ref += 1); prefill starts after them
    cache.register(row, tokens, upto)        # after a prefill wrote positions < upto: hash its full blocks

A row never writes into a shared block: shared blocks lie below its committed length, and a step writes only at and
after it. A request whose whole context is cached still recomputes its last block's tail (at least one token), since
its first token needs the target's logits there (`match` is given `max_blocks`).

Example (block size 2): request A prefills [5, 6, 7, 8, 9] -> blocks [5, 6], [7, 8] are registered; request B with
prompt [5, 6, 7, 8, 1] matches both (4 of its 5 tokens) and prefills only [1].
"""
from __future__ import annotations

from collections import OrderedDict

from workbench.engine.kv_cache import CacheFullError, PagedKVCache


def block_hashes(tokens: list[int], block_size: int, num_blocks: int) -> list[int]:
    """Chained hashes of the first num_blocks full blocks of tokens.

    >>> a, b = block_hashes([1, 2, 3, 4], 2, 2), block_hashes([9, 2, 3, 4], 2, 2)
    >>> a[0] != b[0] and a[1] != b[1]   # same second block, different parent: different hash
    True
    """
    out, parent = [], None
    for i in range(num_blocks):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


class PrefixCachingKVCache(PagedKVCache):
    """`PagedKVCache` with shared, reference-counted, hashed prompt blocks (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ref = [0] * self.num_blocks
        self._hash_of: dict[int, int] = {}  # physical block -> chained hash (registered blocks only)
        self._by_hash: dict[int, int] = {}  # chained hash -> physical block
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0 but hashed: evictable, oldest first
        self.queried_tokens = 0  # tokens looked up by `match` (prompt tokens of admitted requests)
        self.hit_tokens = 0  # of those, found in cached blocks

    # -- capacity ----------------------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take now: never-hashed free ones plus cached (evictable) ones."""
        return len(self._free) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        """Blocks some live row references (each counted once, however many rows share it)."""
        return self.num_blocks - self.free_blocks

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)  # evict the least recently released cached block
            del self._by_hash[self._hash_of.pop(block)]
        else:
            raise CacheFullError(f"paged KV cache out of blocks ({self.num_blocks} of {self.block_size})")
        self._ref[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def reset(self) -> None:
        super().reset()
        self._free.extend(self._cached)  # a fresh pool: forget every cached prefix too
        self._cached.clear()
        self._hash_of.clear()
        self._by_hash.clear()

    # -- sharing -----------------------------------------------------------------------------------------------
    def match(self, tokens: list[int], max_blocks: int) -> list[int]:
        """Physical blocks holding the longest cached chain of tokens' leading full blocks (at most max_blocks);
        counts the lookup towards the hit rate (queried = len(tokens))."""
        hits = []
        for h in block_hashes(tokens, self.block_size, min(max_blocks, len(tokens) // self.block_size)):
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        self.queried_tokens += len(tokens)
        self.hit_tokens += len(hits) * self.block_size
        return hits

    def attach(self, row: int, blocks: list[int]) -> None:
        """Start the (empty) row's block table with these shared blocks."""
        if self._host_table[row]:
            raise ValueError(f"row {row} still holds {len(self._host_table[row])} blocks: free it before attaching")
        for block in blocks:
            if self._ref[block] == 0:
                self._cached.pop(block)
            self._ref[block] += 1
        self._host_table[row] = list(blocks)
        if blocks:
            self._stale.add(row)
            self._sync_table()

    def register(self, row: int, tokens: list[int], upto: int) -> None:
        """The row's KV at positions < upto is final and holds `tokens[:upto]`: hash its full blocks so that later
        requests can share them (a block whose hash another block already holds stays private)."""
        blocks = self._host_table[row]
        n = min(upto // self.block_size, len(blocks))
        for block, h in zip(blocks[:n], block_hashes(tokens, self.block_size, n)):
            if block not in self._hash_of and h not in self._by_hash:
                self._hash_of[block] = h
                self._by_hash[h] = block

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None
