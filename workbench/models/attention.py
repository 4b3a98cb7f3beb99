"""The attention extension point: the model computes q/k/v and RoPE, a backend owns the KV and the masking.

The engine injects its own backend (KV cache, tree masks, paged blocks; see workbench/engine/kv_cache.py). `CausalAttention`
is the cache-free reference used when no backend is given: parity tests and one-shot scoring.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor


@runtime_checkable
class AttentionBackend(Protocol):
    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, Hq, T, D]; k, v [B, Hkv, T, D] (RoPE already applied to q and k; may be strided views).
        Stores k, v for this step's tokens and returns attention output [B, Hq, T, D]. A backend that also has
        `fuses_rope() -> bool` may take q and k before RoPE, with `rope=(cos, sin_signed)` [B, T, D], in the calls
        where it returns True (the engine's paged cache on its fused kernel path: the kernels rotate q and k as they
        load them, so no RoPE kernel runs per layer)."""
        ...


def expand_kv(x: Tensor, num_groups: int) -> Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * num_groups, S, D]: query head h reads kv head h // num_groups (HF `repeat_kv`)."""
    if num_groups == 1:
        return x
    b, h_kv, s, d = x.shape
    return x[:, :, None].expand(b, h_kv, num_groups, s, d).reshape(b, h_kv * num_groups, s, d)


class CausalAttention:
    """Causal self-attention over the T given tokens only: no cache, token t sees tokens 0..t of its row.

    >>> q = torch.randn(1, 4, 3, 8); kv = torch.randn(1, 2, 3, 8)
    >>> CausalAttention().attend(0, q, kv, kv).shape
    torch.Size([1, 4, 3, 8])
    """

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        groups = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, expand_kv(k, groups), expand_kv(v, groups), is_causal=True)
