"""AWQ-style int4 (Lin et al. 2023, arXiv 2306.00978): per-input-channel scales from calibration activations, folded
into the layer before, so the quantized model runs exactly the int4 kernels and costs nothing extra per token.

For a linear y = x W^T and a positive scale s [K]: y = (x / s) (W diag(s))^T exactly. Channels where |x| is large
matter most; scaling their weight columns up before rounding gives them finer int4 steps. AWQ sets
s = mean|x|^alpha (normalized to a geometric mean of 1) and picks alpha on a grid by the output error of the int4
weight on calibration inputs; alpha = 0 is plain int4, so the chosen scales never do worse on the calibration set.

Where the division by s goes (all exact in float before any rounding), per decoder layer:
    o_proj     the rows of v in qkv_proj (attention output channel (h, d) is a weighted sum of v head kv(h), dim d;
               with grouped-query attention the q heads of one group share the scale, so s is tied per kv head)
    qkv_proj   input_layernorm.weight
    down_proj  the up rows of gate_up_proj (down's input is silu(gate) * up)
    gate_up    post_attention_layernorm.weight
In that order, so each search sees the rows the previous fold changed. Activations are recorded once, from the
unquantized model (the paper's per-layer sequential pass and its clipping search are left out).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .linears import dequantize_int4, quantize_int4

ALPHA_GRID = tuple(i / 10 for i in range(11))


@torch.no_grad()
def record_inputs(model, calibration: Tensor, rows: int = 128) -> dict[str, tuple[Tensor, Tensor]]:
    """Run the model over calibration token ids [S, L]; per decoder linear (by module name): (mean |x| [K] fp32,
    up to `rows` input rows [R, K] fp32, spread over the calibration tokens)."""
    stats: dict[str, list] = {}
    hooks = []
    names = {m: n for n, m in model.model.layers.named_modules() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj",
                                                                                 "down_proj"))}
    step = max(1, calibration.numel() // rows)  # keep every step-th token's input row

    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).float()  # [T, K]
        entry = stats.setdefault(names[module], [torch.zeros(x.shape[-1], device=x.device), 0, []])
        entry[0] += x.abs().sum(0)
        entry[1] += x.shape[0]
        entry[2].append(x[::step])

    for module in names:
        hooks.append(module.register_forward_pre_hook(hook))
    try:
        ids = calibration.to(model.model.embed_tokens.weight.device)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        for i in range(ids.shape[0]):
            model(ids[i:i + 1], positions[i:i + 1])
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, (total, count, xs) in stats.items():
        out[name] = (total / count, torch.cat(xs)[:rows].contiguous())
    return out


@torch.no_grad()
def search_scale(weight: Tensor, x: Tensor, mean_abs: Tensor, group_size: int, tie: tuple[int, int] | None = None
                 ) -> tuple[Tensor, float]:
    """The AWQ scale s [K] (fp32) for weight [N, K] given calibration inputs x [R, K], and the alpha chosen.
    `tie=(groups, size)`: channels are [kv_heads, q_per_kv, head_dim]-shaped and share s across the middle axis."""
    w = weight.float()
    ref = x @ w.T
    mean_abs = mean_abs.clamp(min=1e-4)
    if tie is not None:
        kv, per = tie
        mean_abs = mean_abs.reshape(kv, per, -1).mean(dim=1, keepdim=True).expand(kv, per, -1).reshape(-1)
    best = (float("inf"), None, 0.0)
    for alpha in ALPHA_GRID:
        s = mean_abs.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        wq = dequantize_int4(*quantize_int4(w * s, group_size, weight.dtype))
        err = float(((x / s) @ wq.T - ref).pow(2).mean())
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


@torch.no_grad()
def apply_awq(model, calibration: Tensor, group_size: int, rows: int = 128) -> dict[str, float]:
    """Fold AWQ scales into `model` in place (float weights; quantize afterwards). Returns alpha per linear."""
    stats = record_inputs(model, calibration, rows)
    cfg = model.config
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
    inter = cfg.intermediate_size
    alphas = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp

        def scale_for(name, linear, tie=None):
            mean_abs, x = stats[f"{i}.{name}"]
            s, alphas[f"{i}.{name}"] = search_scale(linear.weight, x, mean_abs, group_size, tie)
            linear.weight.mul_(s.to(linear.weight.dtype))  # W diag(s)
            return s

        s = scale_for("self_attn.o_proj", attn.o_proj, tie=(cfg.num_key_value_heads, per_kv))
        s_kv = s.reshape(cfg.num_key_value_heads, per_kv, cfg.head_dim)[:, 0].reshape(-1)  # [kv_rows]
        _divide_rows(attn.qkv_proj, slice(q_rows + kv_rows, q_rows + 2 * kv_rows), s_kv)
        s = scale_for("self_attn.qkv_proj", attn.qkv_proj)
        layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
        s = scale_for("mlp.down_proj", mlp.down_proj)
        _divide_rows(mlp.gate_up_proj, slice(inter, 2 * inter), s)
        s = scale_for("mlp.gate_up_proj", mlp.gate_up_proj)
        layer.post_attention_layernorm.weight.div_(s.to(layer.post_attention_layernorm.weight.dtype))
    return alphas


def _divide_rows(linear, rows: slice, s: Tensor) -> None:
    linear.weight[rows].div_(s.to(linear.weight.dtype)[:, None])
    if linear.bias is not None:
        linear.bias[rows].div_(s.to(linear.bias.dtype))
