"""KV-cache formats: how a KV cache stores keys and values; quantized on write, dequantized on read.

    none  the model's dtype (bf16 on the GPU, float32 in CPU tests): the reference, no scales
    int8  symmetric int8, one float32 scale per (token, KV head):  s = max_d |x_d| / 127,  q = round(x / s)
    fp8   float8 e4m3 (kept as its bit pattern in uint8), the same scales with 448 (e4m3's largest finite value)
          in place of 127:  s = max_d |x_d| / 448,  q = e4m3(x / s)  (round to nearest even)
A read is q * s in float32, cast to the model's dtype (gather + SDPA), or the same product inside the Triton kernel.

Why one scale per token and head (not per block): a write then depends on nothing already in the cache. A block-wide
scale must cover tokens that are not written yet: either every write re-quantizes its whole block (a read-modify-write
of up to block_size tokens per layer and step, inside the captured step) or the scale is fixed by the block's first
token and later outliers clip. Per-token scales also make the cache's other operations format-blind: moving an
accepted tree node's KV copies its scale with it, a rewind leaves stale slots that the next write overwrites whole.
The price is 4 bytes per (token, KV head) for K and V each: at head_dim 64 an int8 head vector takes 68 bytes against
bf16's 128 (1.88x smaller, not 2x); at 128, 132 against 256 (1.94x).

Error bounds, per element x of one head vector whose largest magnitude is a (tests/test_kv_quant.py checks them):
    int8  |x - x'| <= a / 254                          (half a step; no clipping since |x / s| <= 127)
    fp8   |x - x'| <= |x| / 16 + a / (448 * 1024)      (3 mantissa bits: half an ulp is <= 2^-4 relative for normal
                                                        numbers; below 2^-6 the subnormal step is 2^-9, half 2^-10)
plus the final cast to the model's dtype (bf16: 2^-9 relative). Scales are floored at float32's smallest normal number,
so an all-zero vector stores zeros and reads back zeros.

Everything here is tensor ops without host reads: a write inside a captured CUDA graph quantizes on the device.
fp8 values are stored as uint8 because CPU torch lacks `index_copy_` for float8_e4m3fn (NotImplementedError
"index_copy_cpu" not implemented for 'Float8_e4m3fn', torch 2.13); the bits are viewed as e4m3 to read them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_TINY = torch.finfo(torch.float32).tiny
SCALE_DTYPE = torch.float32


class KVFormatError(ValueError):
    """An unknown KV-cache format, or one a backend cannot read; the message names it and what to use instead."""


@dataclass(frozen=True)
class KVFormat:
    """One way of storing K and V. `qmax` None = the model's dtype as is (no scales)."""

    name: str
    qmax: float | None = None  # largest stored magnitude (127 for int8, 448 for e4m3)
    storage: torch.dtype | None = None  # the pool's dtype (None = the model's)
    values: torch.dtype | None = None  # what the stored bits mean, where not the storage dtype (fp8 kept as uint8)

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.storage or model_dtype

    def value_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype a kernel loads the pool as (fp8 -> float8_e4m3fn)."""
        return self.values or self.storage_dtype(model_dtype)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
        """KV bytes one token takes in the cache: K and V of every layer and KV head, scales included.

        >>> KV_FORMATS["int8"].bytes_per_token(22, 4, 64, torch.bfloat16), KV_FORMATS["none"].bytes_per_token(
        ...     22, 4, 64, torch.bfloat16)
        (11968, 22528)
        """
        element = torch.empty((), dtype=self.storage_dtype(model_dtype)).element_size()
        scale = SCALE_DTYPE.itemsize if self.quantized else 0
        return 2 * num_layers * num_kv_heads * (head_dim * element + scale)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [..., D] -> (stored values [..., D] in the storage dtype, scales [...] float32 or None)."""
        if not self.quantized:
            return x, None
        scale = (x.abs().amax(-1).float() / self.qmax).clamp_min(_TINY)  # [...]
        y = (x.float() / scale.unsqueeze(-1)).clamp(-self.qmax, self.qmax)  # |y| <= qmax: no NaN from e4m3 overflow
        if self.values is None:
            return y.round().to(self.storage), scale
        return y.to(self.values).view(self.storage), scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Stored values [..., D] and scales [...] -> [..., D] in `dtype` (the stored tensor itself for "none")."""
        if not self.quantized:
            return q
        return ((q.view(self.values) if self.values is not None else q).float() * scale.unsqueeze(-1)).to(dtype)

    def kernel_view(self, pool: torch.Tensor) -> torch.Tensor:
        """The pool as the kernel reads it (fp8 bits viewed as float8_e4m3fn; a view, no copy)."""
        return pool.view(self.values) if self.values is not None else pool


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("none"),
    KVFormat("int8", qmax=127.0, storage=torch.int8),
    KVFormat("fp8", qmax=448.0, storage=torch.uint8, values=torch.float8_e4m3fn),
)}


def kv_format(name: str) -> KVFormat:
    """The format called `name`; KVFormatError names the choices for anything else.

    >>> kv_format("int4")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    workbench.engine.kv_quant.KVFormatError: unknown KV-cache format 'int4'; choose one of none, int8, fp8 ...
    """
    if name not in KV_FORMATS:
        raise KVFormatError(f"unknown KV-cache format {name!r}; choose one of {', '.join(KV_FORMATS)} (none = the "
                            "model's dtype)")
    return KV_FORMATS[name]
