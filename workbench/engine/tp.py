"""Tensor parallelism of a `LlamaModel` target over torch.distributed (gloo on CPU, NCCL on GPUs).

    group = init_tp(rank, world, port, device)          # one process per rank, loopback rendezvous, timeouts on
    shard_llama_(model, rank, world, group)             # in place: every rank keeps 1/world of each layer

Layout (Megatron-style): the fused q/k/v rows are split by heads (each rank keeps num_heads / world query heads and
num_kv_heads / world KV heads, so GQA groups stay whole on one rank) and the fused gate/up rows by the intermediate
dimension (column-parallel, no communication); o_proj and down_proj keep the matching input columns (row-parallel)
and sum their partial outputs with one all-reduce each, their bias added once after it. The LM head is
vocabulary-parallel: each rank computes ceil(V / world) logits and one all-gather per `compute_logits` call
assembles [.., V] on every rank, so every rank samples and accepts from the same logits. Embeddings and norms stay
replicated. `model.config` is replaced by one with the local head counts and intermediate size, so the engine's KV
cache (built from the config) holds only this rank's KV heads; `model.full_config` keeps the original.

Collectives are eager `torch.distributed` calls: the step is not yet captured in CUDA graphs or compiled with them
(the bench resolves cuda_graphs / compile "auto" to off at tp_size > 1 and refuses them when asked explicitly).
"""
from __future__ import annotations

import dataclasses
import datetime
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from workbench.models.config import ModelConfig

TP_SIZES = (1, 2, 4, 8)
# a collective waiting this long means a rank is gone or stuck: the run ends with the process group's error
TP_TIMEOUT_S = 300.0


class TensorParallelError(ValueError):
    """A model or setting tensor parallelism cannot run; the message names the dimension and what divides it."""


def check_divides(config: ModelConfig, world: int) -> None:
    """Raise TensorParallelError unless `world` divides the query heads, the KV heads and the intermediate size."""
    if world not in TP_SIZES:
        raise TensorParallelError(f"tp_size={world} is not supported; allowed: {', '.join(map(str, TP_SIZES))}")
    bad = [f"{name}={value}" for name, value in (("num_attention_heads", config.num_attention_heads),
                                                  ("num_key_value_heads", config.num_key_value_heads),
                                                  ("intermediate_size", config.intermediate_size)) if value % world]
    if bad:
        raise TensorParallelError(f"tp_size={world} does not divide the model's {', '.join(bad)}: every rank must hold "
                                  "whole heads and an equal share of the MLP; choose a tp_size that divides them")


class RowParallelLinear(nn.Module):
    """y = all_reduce(x @ W_local^T) + b: the input columns of one rank; the bias (if any) is added once, after."""

    def __init__(self, weight: Tensor, bias: Tensor | None, group):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)  # [H_out, I / world]
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelHead(nn.Module):
    """logits [.., V] = all_gather of each rank's [.., ceil(V / world)] slice (the last slice zero-padded)."""

    def __init__(self, full_weight: Tensor, rank: int, world: int, group):
        super().__init__()
        vocab, hidden = full_weight.shape
        self.vocab_size, self.world, self.group = vocab, world, group
        rows = math.ceil(vocab / world)
        local = full_weight.new_zeros(rows, hidden)
        piece = full_weight[rank * rows: min((rank + 1) * rows, vocab)]
        local[: piece.shape[0]] = piece
        self.weight = nn.Parameter(local, requires_grad=False)  # [ceil(V / world), H]

    def forward(self, hidden: Tensor) -> Tensor:
        local = F.linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, -1)[..., : self.vocab_size]


def _rows(t: Tensor | None, spans: list[tuple[int, int]]) -> Tensor | None:
    return None if t is None else torch.cat([t[a:b] for a, b in spans], 0).clone()


def _keep_rows_(lin: nn.Linear, spans: list[tuple[int, int]]) -> None:
    """Column-parallel in place: `lin` keeps only its output rows in `spans` (weight and bias)."""
    lin.weight = nn.Parameter(_rows(lin.weight, spans), requires_grad=False)
    if lin.bias is not None:
        lin.bias = nn.Parameter(_rows(lin.bias, spans), requires_grad=False)
    lin.out_features = lin.weight.shape[0]


def shard_llama_(model: nn.Module, rank: int, world: int, group=None) -> nn.Module:
    """Shard `model` (a float `LlamaModel`, on this rank's device) in place for rank `rank` of `world`; returns it.
    Every rank must call it with the same model. TensorParallelError for a world that does not divide the model,
    a quantized model or an already sharded one."""
    if getattr(model, "tp_world", 1) != 1:
        raise TensorParallelError(f"the model is already sharded for tp_size={model.tp_world}")
    config: ModelConfig = model.config
    check_divides(config, world)
    if not 0 <= rank < world:
        raise TensorParallelError(f"rank {rank} is outside 0..{world - 1}")
    if world == 1:
        return model
    d = config.head_dim
    hq, hkv, inter = config.num_attention_heads // world, config.num_key_value_heads // world, config.intermediate_size
    il = inter // world
    q_all, kv_all = config.num_attention_heads * d, config.num_key_value_heads * d
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if type(lin.weight) is not nn.Parameter or not lin.weight.is_floating_point() \
                        or type(lin).__name__ != "Linear":
                    raise TensorParallelError("tensor parallelism shards float linears only; quantize after "
                                              "sharding is not supported yet: run with target_quant none")
            q0, k0, v0 = rank * hq * d, q_all + rank * hkv * d, q_all + kv_all + rank * hkv * d
            spans = [(q0, q0 + hq * d), (k0, k0 + hkv * d), (v0, v0 + hkv * d)]
            _keep_rows_(attn.qkv_proj, spans)
            o = attn.o_proj
            attn.o_proj = RowParallelLinear(o.weight[:, rank * hq * d:(rank + 1) * hq * d], o.bias, group)
            attn.num_heads, attn.num_kv_heads = hq, hkv
            spans = [(rank * il, (rank + 1) * il), (inter + rank * il, inter + (rank + 1) * il)]
            _keep_rows_(mlp.gate_up_proj, spans)
            down = mlp.down_proj
            mlp.down_proj = RowParallelLinear(down.weight[:, rank * il:(rank + 1) * il], down.bias, group)
        model.lm_head = VocabParallelHead(model.lm_head_weight.detach(), rank, world, group)
    model.full_config = config
    model.config = dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world,
                                       num_key_value_heads=config.num_key_value_heads // world,
                                       intermediate_size=il)
    model.tp_rank, model.tp_world = rank, world
    return model


def init_tp(rank: int, world: int, port: int, device: torch.device, timeout_s: float = TP_TIMEOUT_S):
    """Join the loopback process group of `world` ranks (NCCL on a CUDA device, gloo on a CPU) and return it;
    a collective that waits `timeout_s` raises instead of hanging."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return dist.group.WORLD


def free_port() -> int:
    """A TCP port free on the loopback interface now (the rendezvous of one run's ranks)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["RowParallelLinear", "TP_SIZES", "TP_TIMEOUT_S", "TensorParallelError", "VocabParallelHead",
           "check_divides", "free_port", "init_tp", "shard_llama_"]
