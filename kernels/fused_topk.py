"""Top-k of log-probabilities (or of plain scores) in one or two launches: what the tree and beam drafters rank with.

A drafter level scores its candidates as log_softmax(logits) over the vocabulary and keeps the k best. In PyTorch
ops that is a log-softmax kernel, then `torch.topk`, two more launches (a radix select and a sort) that hold a few
thread blocks for microseconds each: on an H100 (scripts/gpu_topk.py, CUDA graphs) an EAGLE level's ranking took
29-63 us per call at the presets' vocabularies, 101 us at 128,256, and tiny's EAGLE step made six such calls.
`fused_topk_triton` reads the logits once and leaves only the k winners, in 4-8 us at batch 1 (5-15x faster):

    values, indices = fused_topk_triton(logits, k, log_softmax=True)             # [..., k] each, best first
    values, indices = fused_topk_triton(scores, k, log_softmax=False)            # scores.topk(k, -1)
    values, indices = fused_topk_triton(logits, w, group=w, bias=beam_scores)    # a beam search's top-W

`group` = G consecutive input rows form one output row (indices in [0, G * V)), each scored by its own log-softmax
plus `bias[input row]`: a beam search's W beams times the vocabulary, ranked together (ReDrafter). Log-probabilities
are clamped at 0 (only rounding can lift them above).

The kernel: each element is packed with its index into one int64 key whose order is (value, then lower index), so
`tl.topk` of keys is top-k with its arguments. One program per (input row, chunk of BLOCK elements) keeps its chunk's
KP best keys (KP: k rounded up to a power of two) and, for log-probabilities, the chunk's max and sum of exp; where a
row is one chunk and no group is asked for, that program finishes the row itself. Otherwise a second launch, one
program per output row, merges the chunks' log-sum-exp per input row and takes the k best of all their survivors
(each chunk's winners stay winners after the shift by its row's log-sum-exp and bias). Values equal the reference's
within float rounding (the log-sum-exp is summed in another order); among exactly equal values the lower index wins.

`fused_topk_reference` is the PyTorch ops it replaces; tests/test_fused_topk.py checks the kernel against it under the
Triton interpreter; `scripts/gpu_topk.py` times both on a GPU.
"""
from __future__ import annotations

import torch

from .common import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

BLOCKS = (1024, 2048, 4096, 8192)  # first-pass chunks tried, smallest first
MAX_MERGED = 128  # chunks per output row the merge may take (group x chunks)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_args(x: torch.Tensor, k: int, group: int, bias: torch.Tensor | None) -> None:
    """ValueError naming the problem unless (x, k, group, bias) describe a top-k fused_topk can take."""
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"fused_topk: x must have a last dimension of at least 1 element, got shape {tuple(x.shape)}")
    rows = x.numel() // x.shape[-1]
    if group < 1 or rows % group:
        raise ValueError(f"fused_topk: group={group} must be >= 1 and divide the {rows} input rows")
    if not 1 <= k <= group * x.shape[-1]:
        raise ValueError(f"fused_topk: k={k} must be in 1..{group * x.shape[-1]} (group x row length)")
    if group * x.shape[-1] >= 2 ** 31:
        raise ValueError(f"fused_topk: rows of {group * x.shape[-1]} candidates exceed the kernel's int32 indices")
    if bias is not None and bias.numel() != rows:
        raise ValueError(f"fused_topk: bias has {bias.numel()} elements, want one per input row ({rows})")


def _shaped(values: torch.Tensor, idx: torch.Tensor, lead: torch.Size, group: int):
    """[output rows, k] results -> [..., k]: x's leading shape `lead` with its last dimension divided by `group`."""
    out = (*lead[:-1], lead[-1] // group) if group > 1 else lead
    k = values.shape[-1]
    return values.reshape(*out, k), idx.reshape(*out, k)


def fused_topk_reference(x: torch.Tensor, k: int, log_softmax: bool = True, group: int = 1,
                         bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch ops: float32 scores (log_softmax clamped at 0, + bias per input row), group rows side by side,
    then torch.topk -> (values float32, indices long) [..., k] with ... = x's leading shape with its rows / group."""
    check_args(x, k, group, bias)
    v = x.shape[-1]
    lead = x.shape[:-1]
    y = x.float().reshape(-1, v)
    if log_softmax:
        y = torch.log_softmax(y, -1).clamp(max=0.0)
    if bias is not None:
        y = y + bias.reshape(-1, 1).float()
    values, idx = y.reshape(-1, group * v).topk(k, -1)
    return _shaped(values, idx, lead, group)


if TRITON_AVAILABLE:
    @triton.jit
    def _pack(value, idx):
        """float32 value and int32 index -> int64 key ordered by value, then by lower index."""
        bits = value.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # a signed int in the floats' order
        return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)

    @triton.jit
    def _unpack(key):
        ordered = (key >> 32).to(tl.int32)
        value = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        return value, 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)

    @triton.jit
    def _chunk_kernel(x_ptr, bias_ptr, keys_ptr, m_ptr, s_ptr, val_ptr, idx_ptr, V, C, GROUP, K,
                      BLOCK: tl.constexpr, KP: tl.constexpr, LOGSM: tl.constexpr, HAS_BIAS: tl.constexpr,
                      FINAL: tl.constexpr):
        """Program (input row r, chunk c): the chunk's KP best keys (and its max and sum of exp); FINAL (one chunk,
        group 1): the row's k best values and indices."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(x_ptr + r.to(tl.int64) * V + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if FINAL:
            if LOGSM:
                m = tl.max(x, 0)
                lse = m + tl.log(tl.sum(tl.exp(x - m), 0))
                x = tl.minimum(x - lse, 0.0)
            if HAS_BIAS:
                x = x + tl.load(bias_ptr + r).to(tl.float32)
            value, idx = _unpack(tl.topk(_pack(x, offs), KP))
            out = tl.arange(0, KP)
            tl.store(val_ptr + r * K + out, value, mask=out < K)
            tl.store(idx_ptr + r * K + out, idx.to(tl.int64), mask=out < K)
        else:
            if LOGSM:
                m = tl.max(x, 0)
                tl.store(m_ptr + r * C + c, m)
                tl.store(s_ptr + r * C + c, tl.sum(tl.exp(x - m), 0))
            top = tl.topk(_pack(x, offs + (r % GROUP) * V), KP)  # indices within the output row
            tl.store(keys_ptr + (r * C + c) * KP + tl.arange(0, KP), top)

    @triton.jit
    def _merge_kernel(keys_ptr, m_ptr, s_ptr, bias_ptr, val_ptr, idx_ptr, C, GROUP, K,
                      GP: tl.constexpr, CP: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr,
                      LOGSM: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Program (output row o): its GROUP input rows' C chunks of KP survivors -> the k best, shifted by their
        row's log-sum-exp (and bias)."""
        o = tl.program_id(0)
        g = tl.arange(0, GP)
        rows = o * GROUP + g  # [GP] input rows
        live = g < GROUP
        j = tl.arange(0, NP)  # survivor j of an input row (chunk j // KP)
        keep = live[:, None] & (j < C * KP)[None, :]
        key = tl.load(keys_ptr + rows[:, None] * (C * KP) + j[None, :], mask=keep, other=0)
        value, idx = _unpack(key)
        if LOGSM:
            c = tl.arange(0, CP)
            both = live[:, None] & (c < C)[None, :]
            m = tl.load(m_ptr + rows[:, None] * C + c[None, :], mask=both, other=float("-inf"))
            s = tl.load(s_ptr + rows[:, None] * C + c[None, :], mask=both, other=0.0)
            top = tl.max(m, 1)  # [GP]
            top = tl.where(live, top, 0.0)
            lse = top + tl.log(tl.where(live, tl.sum(s * tl.exp(m - top[:, None]), 1), 1.0))
            value = tl.minimum(value - lse[:, None], 0.0)
        if HAS_BIAS:
            value = value + tl.load(bias_ptr + rows, mask=live, other=0.0).to(tl.float32)[:, None]
        value = tl.where(keep, value, float("-inf"))
        flat = tl.reshape(_pack(value, tl.where(keep, idx, 0x7FFFFFFF)), [GP * NP])
        best, best_idx = _unpack(tl.topk(flat, KP))
        out = tl.arange(0, KP)
        tl.store(val_ptr + o * K + out, best, mask=out < K)
        tl.store(idx_ptr + o * K + out, best_idx.to(tl.int64), mask=out < K)


def launch_plan(v: int, k: int, group: int = 1, max_block: int | None = None) -> tuple[int, int, int]:
    """(BLOCK, chunks per input row, KP) for rows of v elements, `group` input rows per output row.

    BLOCK: the smallest of BLOCKS that leaves the merge at most MAX_MERGED chunks per output row (or a row shorter
    than 1,024 in one chunk). Measured on an H100 (scripts/gpu_topk.py, EAGLE levels and ReDrafter depths at 4k-128k
    vocabularies, batch 1-16): 1,024-element chunks were fastest or within 8 % of the fastest everywhere but where a
    row's merge would take more than 128 chunks (ReDrafter's 4 x 128,256 candidates: 10.8 us against 7.6 us with
    4,096); one program per 4,096-element row took 5.0 us against 4.1 us in 1,024-element chunks.
    `max_block` (tests): chunks of at most this many elements (a power of two), whatever the merge."""
    kp = max(2, _pow2(k))
    if max_block is not None:
        block = _pow2(max_block)
    else:
        block = next((b for b in BLOCKS if group * -(-v // b) <= MAX_MERGED), BLOCKS[-1])
    block = max(kp, min(_pow2(v), block))
    return block, -(-v // block), kp


def fused_topk_triton(x: torch.Tensor, k: int, log_softmax: bool = True, group: int = 1,
                      bias: torch.Tensor | None = None,
                      max_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_topk_reference` by the kernel (through the custom op `torch.ops.workbench.fused_topk`, so torch.compile
    keeps it as one opaque call); `max_block`: the first pass's chunk in place of `launch_plan`'s (tests and
    scripts/gpu_topk.py vary it); 0 or None: launch_plan's."""
    check_args(x, k, group, bias)
    lead = x.shape[:-1]
    values, idx = torch.ops.workbench.fused_topk(x.reshape(-1, x.shape[-1]), k, log_softmax, group,
                                                 None if bias is None else bias.reshape(-1), max_block or 0)
    return _shaped(values, idx, lead, group)


@torch.library.custom_op("workbench::fused_topk", mutates_args=())
def _fused_topk_op(x: torch.Tensor, k: int, log_softmax: bool, group: int, bias: torch.Tensor | None,
                   max_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not TRITON_AVAILABLE:
        raise RuntimeError("fused_topk_triton needs the triton package (a CUDA build of torch ships it): install it, "
                           "or call fused_topk_reference")
    x = x.contiguous()
    rows, v = x.shape
    out_rows = rows // group
    block, chunks, kp = launch_plan(v, k, group, max_block or None)
    values = torch.empty(out_rows, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(out_rows, k, dtype=torch.long, device=x.device)
    bias_arg = bias.contiguous() if bias is not None else values
    warps = 8 if block >= 2048 else 4
    if chunks == 1 and group == 1:
        _chunk_kernel[(rows, 1)](x, bias_arg, values, values, values, values, idx, v, 1, 1, k, BLOCK=block, KP=kp,
                                 LOGSM=log_softmax, HAS_BIAS=bias is not None, FINAL=True, num_warps=warps)
        return values, idx
    keys = torch.empty(rows, chunks, kp, dtype=torch.long, device=x.device)
    m = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    s = torch.empty_like(m)
    _chunk_kernel[(rows, chunks)](x, bias_arg, keys, m, s, values, idx, v, chunks, group, k, BLOCK=block, KP=kp,
                                  LOGSM=log_softmax, HAS_BIAS=False, FINAL=False, num_warps=warps)
    _merge_kernel[(out_rows,)](keys, m, s, bias_arg, values, idx, chunks, group, k, GP=_pow2(group),
                               CP=_pow2(chunks), NP=_pow2(chunks * kp), KP=kp, LOGSM=log_softmax,
                               HAS_BIAS=bias is not None, num_warps=4)
    return values, idx


@_fused_topk_op.register_fake
def _(x, k, log_softmax, group, bias, max_block):
    return x.new_empty(x.shape[0] // group, k, dtype=torch.float32), x.new_empty(x.shape[0] // group, k,
                                                                                 dtype=torch.long)
