"""Fixed-shape steps: batch buckets, padding, torch.compile and CUDA graphs.

`FixedShapeStep(name, body, pads, settings, device, state=)` runs `body(**buffers)` over persistent per-row buffers:
the live batch pads up to the next *bucket* of `batch_sizes`, padding rows hold the values `pads(key)` gives (for model
steps: the cache's scratch `pad_row`, so they never touch a real sequence). On a GPU with `cuda_graphs` each
(bucket, key) is captured once and replayed; on a CPU, or with only `compile`, the same padded step runs eagerly (so
tests exercise padding and buckets). A batch above every bucket is a *miss*: the body runs on the unpadded batch
without a graph, and is counted. `compile` wraps the body in torch.compile (inductor without cudagraphs of its own:
the capture here is ours). A body that advances persistent state (lengths, tokens) names it in `state`, so that the
warm-up runs before a capture leave it as it was.

`ModelStep` is one model + its KV cache as a step, (rows, ids, positions, base_len, mask) -> logits:
- **eager** (`GraphSettings.fixed_shape` False): the cache plans and prepares the live span and the model runs on
  exactly the live rows (the engine's original path);
- **fixed-shape** (`cuda_graphs` on, or `compile` not "off"): the host plans storage (block allocation), then a
  `FixedShapeStep` reads only its buffers and fixed-size metadata (block table, lengths, a [B, T, T] mask) over the
  cache's whole `static_span`.

`PrefillStep` is a prompt forward from position 0 (the target's, or a draft model's own), ids [B, L] -> hidden
[B, L, H]: with `cuda_graphs` and `prefill` on, the prompts right-pad to the next multiple of PREFILL_LEN_MULTIPLE
(capped at the cache's length) and each (batch, padded length) is captured once (GPU; eager on the padded buffers on
a CPU); otherwise the cache plans and prepares the prompt's span and the model runs eagerly (gather + SDPA).

Statistics (`GraphStats`): capture time and memory, bucket hits and misses, padded rows over computed rows.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from kernels.pdl import warming_for_capture

from workbench.choices import COMPILE_MODES  # noqa: E402 - declared once, torch-free
PREFILL_LEN_MULTIPLE = 32  # a captured prefill pads its prompts' length up to a multiple of this (within the cache)
PAD_LEN = 1  # padding rows act as a sequence of one committed token in the cache's scratch row
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class GraphSettingsError(ValueError):
    """A bad CUDA-graph / compile setting; the message names it and what is allowed."""


@dataclass(frozen=True)
class GraphSettings:
    cuda_graphs: bool = False  # capture each fixed-shape (bucket, T) step in a CUDA graph (GPU only)
    batch_sizes: tuple[int, ...] = DEFAULT_BUCKETS  # the buckets, strictly increasing
    compile: str = "off"  # "off" | "default" | "max-autotune"
    prefill: bool = True  # with cuda_graphs: prompt forwards captured too, per (batch, padded length) (PrefillStep)
    compile_prefill: bool = False  # those prompt forwards compiled with `compile` too (each new shape compiles)
    # torch._inductor options of every compiled step, (name, value) pairs (kernels.tuning.inductor_options of the
    # engine's kernel_tuning: PDL and combo kernels); () = inductor's defaults
    inductor: tuple[tuple[str, bool], ...] = ()

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

    def since(self, before: "GraphStats") -> "GraphStats":
        """What was added after `before` (an earlier snapshot of the same counters): captures, hits, misses, rows."""
        return GraphStats(self.capture_s - before.capture_s, self.memory_bytes - before.memory_bytes,
                          self.hits - before.hits, self.misses - before.misses, self.real_rows - before.real_rows,
                          self.padded_rows - before.padded_rows, self.captured[len(before.captured):])


class _Buffers:
    """Persistent inputs of one (bucket, key): each [Bb, ...], rows past the live batch hold their padding value."""

    def __init__(self, size: int, pads: dict[str, torch.Tensor]):
        self.size, self.pads = size, pads
        self.buf = {n: pad.unsqueeze(0).repeat(size, *([1] * pad.dim())) for n, pad in pads.items()}
        self.real = 0  # rows [0, real) may hold a live row's values
        self.rows_host: list[int] | None = None  # what buf["rows"] holds for the live rows (skips equal copies)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | tuple | None = None  # the graph's output (a tensor or a tuple of tensors)

    def load(self, b: int, inputs: dict[str, torch.Tensor | None], rows_host: list[int] | None) -> None:
        """inputs name -> [b, ...] (None: keep what the buffer holds, e.g. a constant); rows past b padded."""
        for name, x in inputs.items():
            if x is None or (name == "rows" and rows_host is not None and rows_host == self.rows_host):
                continue
            self.buf[name][:b].copy_(x)
        self.rows_host = list(rows_host) if rows_host is not None else None
        if b < self.real:  # rows that were live last time become padding again
            for name, pad in self.pads.items():
                self.buf[name][b:self.real].copy_(pad.expand(self.real - b, *pad.shape))
        self.real = b


# Without capture (a CPU) the fixed-shape path runs its body eagerly; its output is then written into one tensor per
# (bucket, key), as a replayed graph's is on a GPU, so that code holding a view of an earlier call's output sees it
# overwritten on a CPU too and the CPU tests catch such aliasing (two serving bugs hid behind fresh tensors).
# False (a test's baseline only): a fresh tensor per call.
STATIC_CPU_OUTPUTS = True


def _keep(bufs: _Buffers, out):
    """`out` written into the bucket's kept output (the first call's tensors are kept as it), which is returned."""
    kept = bufs.out
    same = kept is not None and type(kept) is type(out) and (
        all(k.shape == o.shape and k.dtype == o.dtype for k, o in zip(kept, out)) if isinstance(out, tuple)
        else kept.shape == out.shape and kept.dtype == out.dtype)
    if not same:
        bufs.out = out
        return out
    if isinstance(out, tuple):
        for k, o in zip(kept, out):
            k.copy_(o)
    else:
        kept.copy_(out)
    return kept


def _rows(out, b: int):
    """The first b rows of a step's output: a tensor, or each tensor of a tuple (e.g. (logits, hidden))."""
    return tuple(o[:b] for o in out) if isinstance(out, tuple) else out[:b]


RECOMPILE_LIMIT = 1024  # graphs per compiled frame (torch's default: 8)
ACCUMULATED_RECOMPILE_LIMIT = 16384  # graphs over all frames (torch's default: 256)


def raise_recompile_limits() -> None:
    """Let torch._dynamo keep enough graphs that a compiled step never falls back to eager without a word: past its
    recompile limit dynamo runs the frame's new variants eagerly and only logs a warning. The model keeps one graph per
    frame for every layer on the fused attention path (llama.attend_uncompiled), but a backend traced by dynamo (the
    quantized-KV and non-kernel paths) reads the layer index in the trace: one graph per layer, per batch bucket and
    per step width, which passed the old limit of 64."""
    cfg = torch._dynamo.config
    for names, value in ((("recompile_limit", "cache_size_limit"), RECOMPILE_LIMIT),
                         (("accumulated_recompile_limit", "accumulated_cache_size_limit"), ACCUMULATED_RECOMPILE_LIMIT)):
        name = next((n for n in names if hasattr(cfg, n)), None)  # the newer name first (torch >= 2.6)
        if name is not None:
            setattr(cfg, name, max(getattr(cfg, name), value))


class RecompileWatch(logging.Handler):
    """Counts torch._dynamo's "hit config.recompile_limit" warnings in this process: each names a compiled frame
    whose new variants run eagerly from then on, which a run's figures should say."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not ours to count
            return
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.hits.append(message.splitlines()[0][:200])


_WATCH: RecompileWatch | None = None


def recompile_limit_hits() -> int:
    """How many compiled frames of this process have hit dynamo's recompile limit so far (the watch is installed on
    first use, so call it once before compiling: FixedShapeStep does); dynamo warns once per frame."""
    global _WATCH
    if _WATCH is None:
        _WATCH = RecompileWatch()
        logging.getLogger("torch._dynamo").addHandler(_WATCH)
    return len(_WATCH.hits)


def compile_fallback_columns(hits_before: int) -> dict:
    """A run record's `compile_fallbacks` (frames that hit dynamo's recompile limit since `hits_before`, a
    `recompile_limit_hits()` taken when the run began) and `compile_fallbacks_in_process`."""
    now = recompile_limit_hits()
    return {"compile_fallbacks": now - hits_before, "compile_fallbacks_in_process": now}


def compile_options(settings: GraphSettings) -> dict:
    """torch.compile's options for a compiled step: the compile mode's own (max-autotune without inductor's CUDA
    graphs: the steps capture their own) with the settings' inductor options over them.

    >>> compile_options(GraphSettings(compile="default", inductor=(("combo_kernels", True),)))
    {'combo_kernels': True}
    """
    mode = "max-autotune-no-cudagraphs" if settings.compile == "max-autotune" else None
    return {**(torch._inductor.list_mode_options(mode) if mode else {}), **dict(settings.inductor)}


class FixedShapeStep:
    """`body(**buffers) -> Tensor` (or a tuple of tensors) over persistent per-row buffers padded to a batch bucket.

    `pads(key)` gives, per input name, the value a padding row holds (one row's shape; `key` names what else fixes the
    shapes, e.g. T). On a GPU with `cuda_graphs` each (bucket, key) is captured once and replayed; otherwise the body
    runs eagerly on the padded buffers. A batch above every bucket is a miss: the body runs on the unpadded inputs.
    """

    def __init__(self, name: str, body, pads, settings: GraphSettings, device: torch.device, pool=None,
                 state=None):
        self.name, self.body, self.pads, self.settings = name, body, pads, settings
        # state() -> the persistent tensors body advances (e.g. lengths); the warm-up runs before a capture restore
        # them, so a step captured on first use still advances them exactly once
        self.state = state or (lambda: [])
        self.device = torch.device(device)
        self.stats = GraphStats()
        self._buffers: dict[tuple, _Buffers] = {}
        self._capture = settings.cuda_graphs and self.device.type == "cuda"
        self._pool = pool
        self._fn = body
        if settings.compile != "off":
            raise_recompile_limits()
            recompile_limit_hits()  # the watch listens from here on
            self._fn = torch.compile(body, dynamic=False, options=compile_options(settings))

    def _get(self, size: int, key) -> _Buffers:
        bufs = self._buffers.get((size, key))
        if bufs is None:
            bufs = self._buffers[(size, key)] = _Buffers(size, self.pads(key))
        return bufs

    def __call__(self, key, b: int, inputs: dict[str, torch.Tensor | None],
                 rows_host: list[int] | None = None) -> torch.Tensor:
        size = self.settings.bucket(b)
        if size is None:
            self.stats.misses += 1
            pads = self.pads(key)
            full = {n: x if x is not None else pads[n].expand(b, *pads[n].shape) for n, x in inputs.items()}
            return self.body(**full)
        bufs = self._get(size, key)
        bufs.load(b, inputs, rows_host)
        self.stats.hits += 1
        self.stats.real_rows += b
        self.stats.padded_rows += size - b
        if not self._capture:
            out = self._fn(**bufs.buf)
            return _rows(_keep(bufs, out) if STATIC_CPU_OUTPUTS else out, b)
        if bufs.graph is None:
            self._record(bufs, key)
        bufs.graph.replay()
        return _rows(bufs.out, b)

    def capture(self, size: int, key) -> None:
        """Capture (GPU) the (size, key) bucket ahead of use, with padding rows only, so that no capture lands in a
        timed step. A no-op for eager steps, on a CPU, or when already captured."""
        if self._capture and size in self.settings.batch_sizes:
            bufs = self._get(size, key)
            if bufs.graph is None:
                bufs.load(0, {}, None)
                self._record(bufs, key)

    def warm_up(self, bufs: _Buffers, times: int = 2) -> None:
        """Run the body `times` times (compiles, autotunes, allocates workspaces), each from the state as it was, and
        put it back: a second run from the state the first one left would verify the next step, writing K/V past the
        blocks planned for this one (into other rows' blocks)."""
        saved = [t.clone() for t in self.state()]
        for _ in range(times):
            self._fn(**bufs.buf)
            for t, s in zip(self.state(), saved):
                t.copy_(s)

    def _record(self, bufs: _Buffers, key) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), warming_for_capture():  # warm-up off the capture, launching as it will
            self.warm_up(bufs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bufs.out = self._fn(**bufs.buf)
        bufs.graph = graph
        torch.cuda.synchronize(self.device)
        self.stats.capture_s += time.perf_counter() - t0
        self.stats.memory_bytes += max(torch.cuda.memory_allocated(self.device) - before, 0)
        self.stats.captured.append(f"{self.name}:{bufs.size}x{key}")

    def replay_callables(self) -> dict:
        """name -> a zero-argument callable replaying one captured graph (for per-phase GPU profiling)."""
        return {f"{self.name}:{size}x{key}": b.graph.replay for (size, key), b in self._buffers.items() if b.graph}


def model_step_pads(num_new: int, pad_row: int, device) -> dict[str, torch.Tensor]:
    """Padding rows of a model step: scratch cache row, committed length PAD_LEN, causal mask."""
    z = torch.zeros(num_new, dtype=torch.long, device=device)
    return {"ids": z, "positions": PAD_LEN + torch.arange(num_new, device=device),
            "rows": torch.tensor(pad_row, device=device), "base": torch.tensor(PAD_LEN, device=device),
            "mask": torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()}


class ModelStep:
    """model + its KV cache as a step function: (rows, ids, positions, base_len, mask) -> logits.

    Eager when the settings are not fixed-shape (the cache plans and prepares the live span), else a
    `FixedShapeStep` over the cache's `static_span`. `last_only` returns each row's last-token logits ([B, V],
    drafting) instead of all ([B, T, V], verify). `with_hidden` returns (logits, hidden [B, T, H]) (or [B, H] with
    last_only): the final hidden states that feature-based drafters read.
    """

    def __init__(self, model, cache, settings: GraphSettings, device: torch.device, name: str,
                 last_only: bool = False, with_hidden: bool = False):
        self.model, self.cache, self.settings, self.device = model, cache, settings, torch.device(device)
        self.last_only, self.with_hidden = last_only, with_hidden
        self.fixed = FixedShapeStep(name, self._fixed_shape, self._pads, settings, device)

    @property
    def stats(self) -> GraphStats:
        return self.fixed.stats

    @property
    def name(self) -> str:
        return self.fixed.name

    def _pads(self, num_new: int) -> dict[str, torch.Tensor]:
        return model_step_pads(num_new, self.cache.pad_row, self.device)

    def logits(self, ids, positions) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The model over the prepared cache -> logits [B, T, V] (or [B, V] with last_only); with `with_hidden`,
        (logits, hidden) with hidden [B, T, H] (or [B, H])."""
        hidden = self.model(ids, positions, self.cache)
        if self.last_only:
            hidden = hidden[:, -1]
        logits = self.model.compute_logits(hidden)
        return (logits, hidden) if self.with_hidden else logits

    def _fixed_shape(self, ids, positions, rows, base, mask) -> torch.Tensor:
        """Reads only its arguments and the cache's persistent tensors: what a CUDA graph captures."""
        self.cache.prepare(rows, base, ids.shape[1], mask, self.cache.static_span)
        return self.logits(ids, positions)

    def __call__(self, rows: torch.Tensor, rows_host: list[int], ids: torch.Tensor, positions: torch.Tensor,
                 base: torch.Tensor, base_host: list[int], mask: torch.Tensor | None = None) -> torch.Tensor:
        """rows [B], ids/positions [B, T], base [B] (+ host copies), mask [B, T, T] bool or None (causal)."""
        b, t = ids.shape
        if not self.settings.fixed_shape:
            self.cache.begin(rows, base, base_host, t, mask, rows_host=rows_host)
            return self.logits(ids, positions)
        self.cache.plan(rows_host, base_host, t)
        return self.fixed(t, b, {"ids": ids, "positions": positions, "rows": rows, "base": base, "mask": mask},
                          rows_host)

    def capture(self, size: int, num_new: int) -> None:
        self.fixed.capture(size, num_new)

    def replay_callables(self) -> dict:
        return self.fixed.replay_callables()


def prefill_len(length: int, max_len: int) -> int:
    """The length a captured prefill of `length` tokens runs at: the next multiple of PREFILL_LEN_MULTIPLE, or
    `length` itself where that would not fit a cache of `max_len` slots per row.

    >>> prefill_len(17, 256), prefill_len(64, 256), prefill_len(250, 256), prefill_len(250, 255)
    (32, 64, 256, 250)
    """
    padded = -(-length // PREFILL_LEN_MULTIPLE) * PREFILL_LEN_MULTIPLE
    return padded if padded <= max_len else length


class PrefillStep:
    """A prompt forward of `model` over `cache`: (rows, ids [B, L]) from position 0 -> hidden [B, L, H] (`__call__`,
    a batch's prefill), or one row's chunk of T tokens at any start -> hidden [1, T, H] (`chunk`, serving).

    Captured (settings.cuda_graphs and settings.prefill, GPU): the host allocates blocks for the padded length, the
    ids right-pad with zeros to `prefill_len` (their KV past the real tokens is written and then dropped by a
    truncate, like a batch's right padding), and one graph per (batch, padded length) replays the cache's prepare
    and the model. The batch is never padded (a padding row would need a whole prompt's blocks in the scratch row):
    every batch size is its own key. A chunk reads the cache's whole static span (its start varies); a batch from
    position 0 only its padded length. Compiled with the decode steps' mode only when settings.compile_prefill (the
    `compile_prefill` knob) says so. Graphs of one step share one memory pool (they never run
    concurrently; each keeps its output alive). On a CPU the same padded forward runs eagerly (compiled so too).
    Otherwise (or where a chunk's padded length passes the row's slots or needs blocks the pool has not got free:
    counted in `eager_chunks`): eager, over exactly the tokens' span.
    """

    def __init__(self, model, cache, settings: GraphSettings, device: torch.device, name: str):
        self.model, self.cache, self.settings, self.device = model, cache, settings, torch.device(device)
        self.fixed_shape = settings.cuda_graphs and settings.prefill
        compiled = settings.compile_prefill
        exact = GraphSettings(settings.cuda_graphs, tuple(range(1, cache.max_rows + 1)),
                              settings.compile if compiled else "off", settings.prefill, inductor=settings.inductor)
        pool = torch.cuda.graph_pool_handle() if self.fixed_shape and self.device.type == "cuda" else None
        self.fixed = FixedShapeStep(f"{name}-prefill", functools.partial(self._fixed_shape, anywhere=False),
                                    self._pads, exact, device, pool=pool)
        self.eager_chunks = 0  # captured mode: chunks whose padded length did not fit the row or the pool
        self.fixed_at = FixedShapeStep(f"{name}-prefill-chunk", functools.partial(self._fixed_shape, anywhere=True),
                                       self._pads, exact, device, pool=pool)

    @property
    def stats(self) -> GraphStats:
        return self.fixed.stats.add(self.fixed_at.stats)

    def _pads(self, length: int) -> dict[str, torch.Tensor]:
        return {"ids": torch.zeros(length, dtype=torch.long, device=self.device),
                "rows": torch.tensor(self.cache.pad_row, device=self.device),
                "base": torch.tensor(0, device=self.device)}

    def _fixed_shape(self, ids, rows, base, anywhere: bool) -> torch.Tensor:
        length = ids.shape[1]
        positions = base.unsqueeze(1) + torch.arange(length, device=ids.device)  # [B, T]
        span = self.cache.static_span if anywhere else self.cache._read_span(length)
        self.cache.prepare(rows, base, length, None, span, kernel=False)
        return self.model(ids, positions, self.cache)

    def padded_len(self, length: int) -> int:
        return prefill_len(length, self.cache.max_len) if self.fixed_shape else length

    def __call__(self, rows: torch.Tensor, rows_host: list[int], ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """rows [B] (+ host copy), ids / positions [B, L] (right-padded prompts, positions 0..L-1) -> [B, L, H]."""
        b, length = ids.shape
        if not self.fixed_shape:
            self.cache.begin(rows, torch.zeros_like(rows), [0] * b, length, rows_host=rows_host, prefill=True)
            return self.model(ids, positions, self.cache)
        padded = self.padded_len(length)
        self.cache.plan(rows_host, [0] * b, padded)
        ids = torch.nn.functional.pad(ids, (0, padded - length))
        return self.fixed(padded, b, {"ids": ids, "rows": rows, "base": None}, rows_host)[:, :length]

    def chunk(self, row: int, ids: torch.Tensor, start: int) -> torch.Tensor:
        """One row's tokens ids [1, T] at positions start.. (its KV below `start` already written) -> hidden [1, T, H].
        Captured, the padding's blocks go back to the pool before it returns."""
        t = ids.shape[1]
        rows = upload([row], self.device)
        base = upload([start], self.device)
        padded = -(-t // PREFILL_LEN_MULTIPLE) * PREFILL_LEN_MULTIPLE
        if not self.fixed_shape or not self._room_rows([row], [start + padded]):
            if self.fixed_shape:  # no graph per exact length (unbounded keys): this chunk runs eagerly
                self.eager_chunks += 1
            self.cache.begin(rows, base, [start], t, rows_host=[row], prefill=True)
            return self.model(ids, base.unsqueeze(1) + torch.arange(t, device=self.device), self.cache)
        self.cache.plan([row], [start], padded)
        out = self.fixed_at(padded, 1, {"ids": torch.nn.functional.pad(ids, (0, padded - t)), "rows": rows,
                                        "base": base}, [row])[:, :t]
        self.cache.truncate(row, start + t)
        return out

    def chunks(self, rows_host: list[int], ids: torch.Tensor, lengths: list[int], starts: list[int]) -> torch.Tensor:
        """Several rows' chunks in one forward (serving's batched prefill): row i's first lengths[i] tokens of
        ids [B, T] (right-padded) at positions starts[i].. (its KV below starts[i] already written) -> hidden
        [B, T, H] (row i's first lengths[i] positions are its chunk's). The padding's KV is written, then dropped by a
        truncate to each row's end, as one row's chunk padding is. Captured per (B, padded length) where every row has
        the slots and the pool the free blocks for the padding; else eager, padded to T only when every row has room
        for that (else a forward per row: `chunk`)."""
        b, t = ids.shape
        ends = [s + n for s, n in zip(starts, lengths)]
        padded = -(-t // PREFILL_LEN_MULTIPLE) * PREFILL_LEN_MULTIPLE
        rows = upload(rows_host, self.device)
        base = upload(starts, self.device)
        if self.fixed_shape and self._room_rows(rows_host, [s + padded for s in starts]):
            self.cache.plan(rows_host, starts, padded)
            out = self.fixed_at(padded, b, {"ids": torch.nn.functional.pad(ids, (0, padded - t)), "rows": rows,
                                            "base": base}, rows_host)[:, :t]
        elif self._room_rows(rows_host, [s + t for s in starts]):
            if self.fixed_shape:
                self.eager_chunks += 1
            self.cache.begin(rows, base, starts, t, rows_host=rows_host, prefill=True)
            out = self.model(ids, base.unsqueeze(1) + torch.arange(t, device=self.device), self.cache)
        else:  # the padding does not fit: each row on its own, padded (or not) as `chunk` decides
            parts = [self.chunk(row, ids[i:i + 1, :n], start)[0]
                     for i, (row, n, start) in enumerate(zip(rows_host, lengths, starts))]  # [T_i, H] each
            return torch.stack([torch.nn.functional.pad(h, (0, 0, 0, t - h.shape[0])) for h in parts])
        for row, end in zip(rows_host, ends):
            self.cache.truncate(row, end)
        return out

    def _room_rows(self, rows_host: list[int], ends: list[int]) -> bool:
        """Whether every row has slots below its end and the pool never-used free blocks for all of them at once
        (padding never evicts a prefix-cached block); a contiguous cache has room wherever the rows have slots."""
        if max(ends) > self.cache.max_len:
            return False
        if not hasattr(self.cache, "_host_table"):
            return True
        bs = self.cache.block_size
        need = sum(max(0, -(-end // bs) - len(self.cache._host_table[row])) for row, end in zip(rows_host, ends))
        return need <= len(self.cache._free)

    def capture(self, rows_host: list[int], length: int) -> None:
        """Capture (GPU) the prefill of len(rows_host) prompts of up to `length` tokens in these cache rows ahead of
        use (it allocates their blocks; the caller resets the cache before the next batch)."""
        if not (self.fixed_shape and self.fixed._capture):
            return
        padded, b = self.padded_len(length), len(rows_host)
        self.cache.plan(rows_host, [0] * b, padded)
        bufs = self.fixed._get(b, padded)
        if bufs.graph is None:
            bufs.load(b, {"rows": torch.tensor(rows_host, device=self.device)}, rows_host)
            self.fixed._record(bufs, padded)

    def capture_chunks(self, row: int, max_tokens: int, rows: int = 1) -> None:
        """Capture (GPU) every padded chunk length up to `max_tokens` for 1..`rows` rows at once (cache rows row,
        row + 1, ...; allocating and then releasing their blocks), so that serving replays prefill chunks only
        (`chunk`, and `chunks` for a batched prefill)."""
        if not (self.fixed_shape and self.fixed_at._capture):
            return
        for b in range(1, rows + 1):
            rows_host = list(range(row, row + b))
            for padded in range(PREFILL_LEN_MULTIPLE, prefill_len(max_tokens, self.cache.max_len) + 1,
                                PREFILL_LEN_MULTIPLE):
                if not self._room_rows(rows_host, [padded] * b):
                    break
                self.cache.plan(rows_host, [0] * b, padded)
                bufs = self.fixed_at._get(b, padded)
                if bufs.graph is None:
                    bufs.load(b, {"rows": torch.tensor(rows_host, device=self.device)}, rows_host)
                    self.fixed_at._record(bufs, padded)
                for r in rows_host:
                    self.cache.truncate(r, 0)

    def replay_callables(self) -> dict:
        return {**self.fixed.replay_callables(), **self.fixed_at.replay_callables()}


def on_device(t: torch.Tensor, device: torch.device | str) -> bool:
    """Whether `t` lives on `device`, where "cuda" names the current card: `torch.device("cuda")` never equals a
    tensor's `cuda:0`, and a buffer compared that way is reallocated (and every graph over it recaptured) each time."""
    d = torch.device(device)
    if t.device.type != d.type:
        return False
    if d.index is None and d.type == "cuda":
        return t.device.index == torch.cuda.current_device()
    return d.index is None or t.device.index == d.index


def upload(values: list, device: torch.device) -> torch.Tensor:
    """A small host list (or list of lists) as a long tensor on `device` without waiting for the GPU:
    `torch.tensor(values, device=cuda)` synchronizes the stream after its copy, which made every shortened serving
    step wait for the GPU; a pinned copy is queued on the stream instead (the caching host
    allocator keeps the pinned block until the copy has run)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
