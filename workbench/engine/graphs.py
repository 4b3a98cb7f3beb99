"""Fixed-shape model steps: batch buckets, padding, torch.compile and CUDA graphs.

A `ModelStep` runs one model over this step's tokens (`ids [B, T]` at explicit positions, KV written after
`base_len`) for the live rows of a batch. It has two modes:

- **eager** (`GraphSettings.fixed_shape` False): the KV cache plans and prepares the step for the live span and the model
  runs on exactly the live rows (the engine's original path).
- **fixed-shape** (`cuda_graphs` on, or `compile` not "off"): the live batch pads up to the next *bucket* of `batch_sizes`; padding rows point
  at the cache's scratch `pad_row`, so they never touch a real sequence. The host plans storage first (block
  allocation), then copies the step's inputs into persistent buffers and runs a function that reads only those
  buffers and fixed-size metadata (block table, lengths, a [B, T, T] mask) over the cache's whole `static_span`. On a
  GPU that function is captured once per (bucket, T) in a CUDA graph and replayed; on a CPU the same padded step runs
  eagerly (so tests exercise padding and buckets). A batch larger than every bucket is a *miss*: it falls back to the
  eager path and is counted. `compile` wraps the fixed-shape function in torch.compile (inductor, no cudagraphs of its
  own: the graph capture here is ours).

Statistics (`GraphStats`): capture time and memory, bucket hits and misses, padded rows over computed rows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

COMPILE_MODES = ("off", "default", "max-autotune")
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class GraphSettingsError(ValueError):
    """A bad CUDA-graph / compile setting; the message names it and what is allowed."""


@dataclass(frozen=True)
class GraphSettings:
    cuda_graphs: bool = False  # capture each fixed-shape (bucket, T) step in a CUDA graph (GPU only)
    batch_sizes: tuple[int, ...] = DEFAULT_BUCKETS  # the buckets, strictly increasing
    compile: str = "off"  # "off" | "default" | "max-autotune"

    def __post_init__(self) -> None:
        check_graph_settings(self.batch_sizes, self.compile)

    @property
    def fixed_shape(self) -> bool:
        """Bucketed, padded steps over persistent buffers (needed by graphs and by compile's static shapes)."""
        return self.cuda_graphs or self.compile != "off"

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket >= batch; None (a miss) if the batch exceeds them all.

        >>> GraphSettings(True, (1, 2, 4, 8)).bucket(3)
        4
        >>> GraphSettings(True, (1, 2, 4, 8)).bucket(9) is None
        True
        """
        return next((b for b in self.batch_sizes if b >= batch), None)


def check_graph_settings(batch_sizes, compile_mode: str) -> None:
    if compile_mode not in COMPILE_MODES:
        raise GraphSettingsError(f"unknown compile mode {compile_mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    sizes = tuple(batch_sizes)
    if not sizes:
        raise GraphSettingsError("graph_batch_sizes is empty: give at least one batch bucket, e.g. 1,2,4,8")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise GraphSettingsError(f"graph_batch_sizes {list(sizes)} must be integers >= 1")
    if any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise GraphSettingsError(f"graph_batch_sizes {list(sizes)} must be strictly increasing (sorted, no repeats)")


@dataclass
class GraphStats:
    capture_s: float = 0.0  # capture (and compile warm-up) wall time
    memory_bytes: int = 0  # device memory held by captured graphs (allocator growth during capture)
    hits: int = 0  # fixed-shape steps served by a bucket
    misses: int = 0  # steps whose batch exceeded every bucket (ran eagerly)
    real_rows: int = 0  # rows computed for live sequences in fixed-shape steps
    padded_rows: int = 0  # rows computed for padding
    captured: list[str] = field(default_factory=list)  # "model:bucket x T" per captured graph

    @property
    def padding_waste(self) -> float | None:
        total = self.real_rows + self.padded_rows
        return self.padded_rows / total if total else None

    def add(self, other: "GraphStats") -> "GraphStats":
        return GraphStats(self.capture_s + other.capture_s, self.memory_bytes + other.memory_bytes,
                          self.hits + other.hits, self.misses + other.misses, self.real_rows + other.real_rows,
                          self.padded_rows + other.padded_rows, self.captured + other.captured)


class _Bucket:
    """Persistent inputs, the fixed-shape function and (on CUDA) its captured graph, for one (bucket, T)."""

    def __init__(self, size: int, num_new: int, device: torch.device, pad_row: int):
        self.size, self.num_new = size, num_new
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        self.ids = z(size, num_new)  # [Bb, T]
        self.positions = z(size, num_new)  # [Bb, T]
        self.rows = torch.full((size,), pad_row, dtype=torch.long, device=device)  # [Bb]
        self.base = z(size)  # [Bb]
        self.mask = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril().repeat(size, 1, 1)  # [Bb, T, T]
        self.valid = torch.zeros(size, num_new - 1, dtype=torch.bool, device=device)  # [Bb, T - 1] real draft nodes
        self.causal = True  # mask holds the causal pattern in every row
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None  # the graph's output buffer
        self.pad_row = pad_row

    def args(self) -> tuple:
        return self.ids, self.positions, self.rows, self.base, self.mask, self.valid

    def load(self, ids, positions, rows, base, mask, valid) -> None:
        b = ids.shape[0]
        self.valid[:b].copy_(valid)
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(positions)
        self.rows[:b].copy_(rows)
        self.base[:b].copy_(base)
        if mask is not None:
            self.mask[:b].copy_(mask)
            self.causal = False
        elif not self.causal:  # a chain after a tree step: back to the causal mask
            self.mask.copy_(torch.ones_like(self.mask[0]).tril().expand_as(self.mask))
            self.causal = True
        if b < self.size:  # padding rows: scratch row, position 0.., causal (a bucket may shrink between steps)
            self.valid[b:].zero_()
            self.rows[b:].fill_(self.pad_row)
            self.base[b:].zero_()
            self.positions[b:].copy_(torch.arange(self.num_new, device=self.ids.device).expand(self.size - b, -1))
            if mask is not None:
                self.mask[b:].copy_(torch.ones_like(self.mask[0]).tril())


class ModelStep:
    """model + its KV cache as a step function: (rows, ids, positions, base_len, mask) -> logits.

    `last_only` returns the logits of each row's last token ([B, V], drafting) instead of all ([B, T, V], verify).
    """

    def __init__(self, model, cache, settings: GraphSettings, device: torch.device, name: str,
                 last_only: bool = False, post=None, pool=None):
        self.model, self.cache, self.settings, self.device = model, cache, settings, torch.device(device)
        self.name, self.last_only = name, last_only
        self.post = post  # optional (logits, ids, valid) -> Tensor run in the same graph (e.g. greedy acceptance)
        self.stats = GraphStats()
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._capture = settings.cuda_graphs and self.device.type == "cuda"
        self._pool = pool
        self._fn = self._fixed_shape
        if settings.compile != "off":
            mode = None if settings.compile == "default" else "max-autotune-no-cudagraphs"
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._fn = torch.compile(self._fixed_shape, mode=mode, dynamic=False)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden[:, -1] if self.last_only else hidden)

    def _fixed_shape(self, ids, positions, rows, base, mask, valid) -> torch.Tensor:
        """Reads only its arguments and the cache's persistent tensors: what a CUDA graph captures."""
        self.cache.prepare(rows, base, ids.shape[1], mask, self.cache.static_span)
        logits = self._logits(self.model(ids, positions, self.cache))
        return logits if self.post is None else self.post(logits, ids, valid)

    def __call__(self, rows: torch.Tensor, rows_host: list[int], ids: torch.Tensor, positions: torch.Tensor,
                 base: torch.Tensor, base_host: list[int], mask: torch.Tensor | None = None,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
        """rows [B], ids/positions [B, T], base [B] (+ host copies), mask [B, T, T] bool or None (causal),
        valid [B, T - 1] bool (draft nodes that are real; for `post`) -> logits, or post's output."""
        b, t = ids.shape
        if valid is None:
            valid = torch.ones(b, t - 1, dtype=torch.bool, device=ids.device)
        size = self.settings.bucket(b) if self.settings.fixed_shape else None
        if size is None:
            if self.settings.fixed_shape:
                self.stats.misses += 1
            self.cache.begin(rows, base, base_host, t, mask, rows_host=rows_host)
            logits = self._logits(self.model(ids, positions, self.cache))
            return logits if self.post is None else self.post(logits, ids, valid)
        self.cache.plan(rows_host, base_host, t)
        self.cache.plan_padding(t)
        bucket = self._buckets.get((size, t))
        if bucket is None:
            bucket = self._buckets[(size, t)] = _Bucket(size, t, self.device, self.cache.pad_row)
        bucket.load(ids, positions, rows, base, mask, valid)
        self.stats.hits += 1
        self.stats.real_rows += b
        self.stats.padded_rows += size - b
        args = bucket.args()
        if not self._capture:
            return self._fn(*args)[:b]
        if bucket.graph is None:
            self._record(bucket, args)
        bucket.graph.replay()
        return bucket.out[:b]

    def capture(self, size: int, num_new: int) -> None:
        """Capture (GPU) the (size, num_new) bucket ahead of use, with padding rows only, so that no capture lands in
        a timed step. A no-op for eager steps, on a CPU, or when already captured."""
        if not self._capture or size not in self.settings.batch_sizes:
            return
        self.cache.plan_padding(num_new)
        bucket = self._buckets.get((size, num_new))
        if bucket is None:
            bucket = self._buckets[(size, num_new)] = _Bucket(size, num_new, self.device, self.cache.pad_row)
        if bucket.graph is None:
            bucket.load(*(x[:0] for x in bucket.args()))
            self._record(bucket, bucket.args())

    def _record(self, bucket: _Bucket, args) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up off the capture (compiles, autotunes, allocates workspaces)
            for _ in range(2):
                self._fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.out = self._fn(*args)
        bucket.graph = graph
        torch.cuda.synchronize(self.device)
        self.stats.capture_s += time.perf_counter() - t0
        self.stats.memory_bytes += max(torch.cuda.memory_allocated(self.device) - before, 0)
        self.stats.captured.append(f"{self.name}:{bucket.size}x{bucket.num_new}")

    def replay_callables(self) -> dict[str, callable]:
        """name -> a zero-argument callable replaying one captured graph (for per-phase GPU profiling)."""
        return {f"{self.name}:{b.size}x{b.num_new}": b.graph.replay for b in self._buckets.values() if b.graph}
