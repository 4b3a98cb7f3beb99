"""`LlamaModel`: a plain-PyTorch Llama-family decoder (Llama 2/3, Qwen2, Mistral) whose state_dict uses HF names.

    hidden = model(input_ids, position_ids, attn)     # [B, T] ids and positions -> [B, T, H] after the final norm
    logits = model.compute_logits(hidden)             # [B, T, V]

One forward: embed -> per layer (RMSNorm -> fused q/k/v projection -> RoPE on q and k at the given positions ->
`attn.attend(layer_idx, q, k, v)` -> o_proj -> residual; RMSNorm -> fused gate/up -> SwiGLU -> down_proj -> residual)
-> final RMSNorm. Positions are explicit per token (tree drafts put siblings at the same depth), and cos/sin come from
a table indexed by them, so a step costs no host sync and no Python loop over tokens.

Fused storage: each layer keeps one `qkv_proj` ([q; k; v] rows) and one `gate_up_proj` ([gate; up] rows) Linear so a
step launches one GEMM for each. State-dict hooks translate at the edges: `load_state_dict` takes HF names
(`self_attn.q_proj.weight`, ...), `state_dict()` returns HF names. `named_parameters()` shows the fused names.
With tied embeddings there is no `lm_head` module: logits use `model.embed_tokens.weight`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import AttentionBackend, CausalAttention
from .config import ModelConfig

_DEFAULT_ATTENTION = CausalAttention()


class Linear(nn.Linear):
    """nn.Linear without its own init: parameters are set by LlamaModel.reset_parameters or loaded."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: normalize in fp32, cast back to the input dtype, then scale by the weight."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [H]
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """RoPE inverse frequencies [D/2] in fp32 on the CPU, computed exactly as transformers does (incl. llama3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated smoothly
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / scaling.factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x [B, T, H, D]; cos, sin_signed [B, T, 1, D]. Equals HF's x*cos + rotate_half(x)*sin, where
    rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * cat(-1, +1); the sign is folded into `sin_signed`."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def _fuse_entries(state_dict: dict, prefix: str, fused: str, parts: list[tuple[str, int]]) -> None:
    """In place: `prefix<part>.weight/bias` entries (HF names) -> one `prefix<fused>.weight/bias` row concatenation."""
    for suffix in ("weight", "bias"):
        names = [f"{prefix}{name}.{suffix}" for name, _ in parts]
        if all(n in state_dict for n in names):
            state_dict[f"{prefix}{fused}.{suffix}"] = torch.cat([state_dict.pop(n) for n in names], dim=0)


def _register_fused(module: nn.Module, fused: str, parts: list[tuple[str, int]]) -> None:
    """Let `module.<fused>` (a Linear whose rows are the concatenated `parts`) load and save as the HF parts."""
    sizes = [rows for _, rows in parts]
    module.fused_spec = (fused, parts)

    def fuse_on_load(mod, state_dict, prefix, *_):
        _fuse_entries(state_dict, prefix, fused, parts)

    def split_on_save(mod, state_dict, prefix, local_metadata):
        for suffix in ("weight", "bias"):
            key = f"{prefix}{fused}.{suffix}"
            if key in state_dict:
                for (name, _), piece in zip(parts, state_dict.pop(key).split(sizes, dim=0)):
                    state_dict[f"{prefix}{name}.{suffix}"] = piece.clone()  # own storage: safetensors refuses views

    module.register_load_state_dict_pre_hook(fuse_on_load)
    module.register_state_dict_post_hook(split_on_save)


def norm_linear(linear: nn.Module, norm: "RMSNorm", x: Tensor) -> Tensor:
    """linear(norm(x)); one GEMV launch where the linear folds the RMSNorm into its prologue (`norm_linear` of a
    Triton-GEMV linear whose fusion has "norm", for the call shapes its kernel takes)."""
    fused = getattr(linear, "norm_linear", None)
    if fused is not None:
        y = fused(x, norm.weight, norm.eps)
        if y is not None:
            return y
    return linear(norm(x))


def linear_residual(linear: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """residual + linear(x); one GEMV launch where the linear adds the residual in its epilogue (`residual_linear`)."""
    fused = getattr(linear, "residual_linear", None)
    if fused is not None:
        y = fused(x, residual)
        if y is not None:
            return y
    return residual + linear(x)


@torch.compiler.disable
def attend_uncompiled(attn: AttentionBackend, layer: "Attention", q: Tensor, k: Tensor, v: Tensor,
                      rope: dict) -> Tensor:
    """`attn.attend(layer.layer_idx, q, k, v, **rope)`, called from outside torch.compile, for a backend whose attend
    is one launch that torch.compile does not trace anyway (`attends_in_one_call`). The layer's index is then read
    here, not in a compiled frame: dynamo treats an nn.Module's int attributes as constants, so reading `layer_idx`
    inside the compiled layer made one graph per layer, and past torch._dynamo's recompile limit (64 graphs per frame)
    later layers, steps and shapes silently ran eager (seen on the H200). One graph now
    serves every layer."""
    return attn.attend(layer.layer_idx, q, k, v, **rope)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = Linear(config.hidden_size, q_rows + 2 * kv_rows, bias=config.qkv_bias)
        self.o_proj = Linear(q_rows, config.hidden_size, bias=config.o_bias)
        _register_fused(self, "qkv_proj", [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)])

    # An attention in three parts, output(attend(project(x))), called one by one: the model and the EAGLE heads call
    # the attention itself between compiled methods, so torch.compile traces what comes before and after it into one
    # graph each (with the caller's own work), where a graph break inside this module's frame split them into more.
    def project(self, x: Tensor, cos: Tensor, sin_signed: Tensor, attn: AttentionBackend,
                norm: "RMSNorm | None" = None) -> tuple[Tensor, Tensor, Tensor, dict]:
        """x [B, T, H] -> (q [B, Hq, T, D], k, v [B, Hkv, T, D], rope: what `attend` passes the backend)."""
        b, t, _ = x.shape
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x) if norm is None else norm_linear(self.qkv_proj, norm, x)
        qkv = qkv.view(b, t, hq + 2 * hkv, self.head_dim)  # [B, T, Hq + 2 Hkv, D]
        fuses_rope = getattr(attn, "fuses_rope", None)
        rope = {}
        if fuses_rope is not None and fuses_rope():  # the backend's kernels rotate q and k as they read them
            rope = {"rope": (cos[:, :, 0], sin_signed[:, :, 0])}  # [B, T, D] each
            qk = qkv[:, :, : hq + hkv]
        else:
            qk = apply_rope(qkv[:, :, : hq + hkv], cos, sin_signed)  # q and k heads rotated in one pass
        q = qk[:, :, :hq].transpose(1, 2)  # [B, Hq, T, D]
        k = qk[:, :, hq:].transpose(1, 2)  # [B, Hkv, T, D]
        v = qkv[:, :, hq + hkv :].transpose(1, 2)  # [B, Hkv, T, D]
        return q, k, v, rope

    def attend(self, attn: AttentionBackend, q: Tensor, k: Tensor, v: Tensor, rope: dict) -> Tensor:
        """The backend's attention over `project`'s q, k, v -> [B, Hq, T, D] (a one-launch backend's from outside
        torch.compile: `attend_uncompiled`)."""
        one_call = getattr(attn, "attends_in_one_call", None)
        if torch.compiler.is_compiling() and one_call is not None and one_call():  # eager: no wrapper to pass
            return attend_uncompiled(attn, self, q, k, v, rope)
        return attn.attend(self.layer_idx, q, k, v, **rope)

    def output(self, out: Tensor, residual: Tensor | None = None) -> Tensor:
        """`attend`'s [B, Hq, T, D] -> o_proj of it [B, T, H] (+ residual, inside o_proj's GEMV where it can be)."""
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out) if residual is None else linear_residual(self.o_proj, out, residual)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * i, bias=config.mlp_bias)
        self.down_proj = Linear(i, config.hidden_size, bias=config.mlp_bias)
        _register_fused(self, "gate_up_proj", [("gate_proj", i), ("up_proj", i)])

    def forward(self, x: Tensor, residual: Tensor | None = None, norm: "RMSNorm | None" = None) -> Tensor:
        """down(silu(gate) * up) of x (normalized by `norm` first when given), plus `residual` when given; Triton-GEMV
        linears fuse the norm (gate/up's `norm_linear`) and SwiGLU + residual (down's `glu_residual`) into their
        launches where the call's shape takes the kernel."""
        swiglu = getattr(self.gate_up_proj, "swiglu_linear", None)  # SwiGLU in gate/up's epilogue: h [B, T, I]
        h = swiglu(x, None if norm is None else norm.weight, 1e-6 if norm is None else norm.eps) \
            if swiglu is not None else None
        done = h is not None  # h = silu(gate) * up already
        if not done:
            h = self.gate_up_proj(x) if norm is None else norm_linear(self.gate_up_proj, norm, x)  # [B, T, 2I]
        fused = getattr(self.down_proj, "glu_residual", None)
        if fused is not None and residual is not None:
            out = fused(h, residual, swiglu_done=True) if done else fused(h, residual)
            if out is not None:
                return out
        if not done:
            gate, up = h.chunk(2, dim=-1)  # [B, T, I] each
            h = F.silu(gate) * up
        y = self.down_proj(h)
        return y if residual is None else residual + y


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin_signed: Tensor, attn: AttentionBackend) -> Tensor:
        return self.post(x, self.self_attn.attend(attn, *self.pre(x, cos, sin_signed, attn)))

    # `forward` in two halves around the attention call, for callers that call the attention themselves
    # (`LlamaModel._cross`, the EAGLE head's draft)
    def pre(self, x: Tensor, cos: Tensor, sin_signed: Tensor, attn: AttentionBackend) -> tuple:
        """x [B, T, H] -> the attention's arguments (`Attention.project` of the normalized x)."""
        return self.self_attn.project(x, cos, sin_signed, attn, self.input_layernorm)

    def post(self, x: Tensor, attended: Tensor) -> Tensor:
        """The residual stream x and the attention's output -> the layer's output (o_proj and MLP, each with its
        residual add)."""
        x = self.self_attn.output(attended, residual=x)
        return self.mlp(x, residual=x, norm=self.post_attention_layernorm)


class DecoderStack(nn.Module):
    """HF's inner `model.` module: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """Llama-family causal LM. `forward` returns final-norm hidden states; `compute_logits` applies the LM head.

    `init_weights=False` leaves the parameters uninitialized (for loading: build under `torch.device("meta")`,
    then `load_state_dict(state, assign=True)`).
    """

    # the residual streams entering these layers are returned after the final-norm hidden ([.., H + n H]); set only
    # on a shallow-copy view of the model (workbench.engine.drafters.eagle3.with_aux_hidden), never on the model
    aux_hidden_layers: tuple[int, ...] = ()

    def __init__(self, config: ModelConfig, init_weights: bool = True):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        # tied: logits reuse the embedding matrix; no lm_head parameter exists (HF files omit it too)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self.source_path: str | None = None
        self.inv_freq = rope_inv_freq(config)  # [D/2] fp32, CPU; a plain attribute so meta/`.to()` leave it alone
        self.rope_table_len = config.max_position_embeddings
        self._rope_tables: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}
        if config.tie_word_embeddings:
            self.register_load_state_dict_pre_hook(_drop_tied_lm_head)
        if init_weights:
            self.reset_parameters()

    @property
    def lm_head_weight(self) -> Tensor:
        """[V, H] output projection (the embedding matrix when tied); a float head only (a quantized head's `weight`
        is its packed buffer)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_rope_inv_freq(self, inv_freq: Tensor) -> None:
        """Replace the RoPE frequencies [D/2] (e.g. with a GGUF's rope_freqs applied); cached tables are rebuilt."""
        self.inv_freq = inv_freq.float().cpu()
        self._rope_tables.clear()

    def set_rope_table_len(self, n: int) -> None:
        """Positions must be < rope_table_len (default max_position_embeddings); raise it before running longer."""
        self.rope_table_len = n
        self._rope_tables.clear()

    def rope_tables(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin_signed), each [rope_table_len, D] in `dtype` on `device`; built once per (device, dtype)."""
        key = (device, dtype)
        if key not in self._rope_tables:
            positions = torch.arange(self.rope_table_len, device=device, dtype=torch.float32)
            freqs = positions[:, None] * self.inv_freq.to(device)[None, :]  # [P, D/2], same products as HF
            cos, sin = freqs.cos(), freqs.sin()
            self._rope_tables[key] = (torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype))
        return self._rope_tables[key]

    def forward(self, input_ids: Tensor, position_ids: Tensor, attn: AttentionBackend | None = None) -> Tensor:
        """input_ids, position_ids [B, T] (positions arbitrary per token) -> hidden [B, T, H] after the final norm."""
        attn = _DEFAULT_ATTENTION if attn is None else attn
        layers = self.model.layers
        x, cos, sin_signed, qkv = self._enter(input_ids, position_ids, layers[0], attn)
        aux = [x] if 0 in self.aux_hidden_layers else []
        for i, layer in enumerate(layers):
            last = i + 1 == len(layers)
            x, qkv = self._cross(layer, None if last else layers[i + 1], x, layer.self_attn.attend(attn, *qkv),
                                 cos, sin_signed, attn, aux if last else ())
            if not last and i + 1 in self.aux_hidden_layers:
                aux.append(x)
        return x

    # The forward calls each layer's attention itself and, between two attentions, one method: a layer's o_proj and
    # MLP with their residual adds, then the next layer's input norm and q/k/v (`_cross`). A one-launch attention
    # breaks torch.compile's graph, so each `_cross` is one graph, where the layer's own frames made three per layer
    # (the residual adds and the norms after them in different graphs, two launches where one fuses them).
    def _enter(self, input_ids: Tensor, position_ids: Tensor, first: DecoderLayer,
               attn: AttentionBackend) -> tuple[Tensor, Tensor, Tensor, tuple]:
        """The embeddings, the RoPE rows and the first layer's q, k, v (`DecoderLayer.pre`)."""
        x, cos, sin_signed = self._inputs(input_ids, position_ids)
        return x, cos, sin_signed, first.pre(x, cos, sin_signed, attn)

    def _cross(self, layer: DecoderLayer, nxt: DecoderLayer | None, x: Tensor, attended: Tensor, cos: Tensor,
               sin_signed: Tensor, attn: AttentionBackend, aux) -> tuple[Tensor, tuple | None]:
        """`layer`'s rest after its attention -> (the residual stream, `nxt`'s q, k, v); after the last layer
        (nxt None): (the final-norm hidden states, with the aux residual streams after them where asked, None)."""
        x = layer.post(x, attended)
        if nxt is None:
            return (torch.cat([self.model.norm(x), *aux], -1) if aux else self.model.norm(x)), None
        return x, nxt.pre(x, cos, sin_signed, attn)

    def _inputs(self, input_ids: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The embeddings [B, T, H] and the RoPE rows (cos, sin_signed) [B, T, 1, D] of the positions. A method of its
        own so that torch.compile traces it: the layer loop's attention breaks the graph, and dynamo runs a frame with
        a graph break inside a loop eagerly (the lookups were three eager kernels per forward)."""
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        cos_table, sin_table = self.rope_tables(x.device, x.dtype)
        return x, cos_table[position_ids].unsqueeze(2), sin_table[position_ids].unsqueeze(2)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> logits [..., V] in the model dtype (through the head module: a quantized one too,
        `quantize_model(head=True)`, where a tied head gets its own module). An aux view's wider hidden states
        [..., H + n H] are read by their first H (the final-norm hidden)."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = hidden[..., :self.config.hidden_size].contiguous()
        return F.linear(hidden, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)

    def fuse_state_dict_(self, state_dict: dict[str, Tensor]) -> None:
        """In place: HF q/k/v and gate/up entries -> the fused ones, module by module, so each original can be freed
        as soon as it is concatenated (load_state_dict would fuse too, but only while holding every original)."""
        for name, module in self.named_modules():
            spec = getattr(module, "fused_spec", None)
            if spec is not None:
                _fuse_entries(state_dict, f"{name}.", *spec)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """HF-style init for training from scratch: normal(0, std) matrices, zero biases, unit norms."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    module.weight.normal_(0.0, std, generator=generator)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)


def full_config(model: nn.Module) -> ModelConfig:
    """The whole model's config: a tensor-parallel shard (workbench/engine/tp.py) keeps it as `full_config`, its own
    `config` holding this rank's head counts and intermediate size; a replicated head is sized from this one."""
    return getattr(model, "full_config", model.config)


def _drop_tied_lm_head(module, state_dict, prefix, *_):
    state_dict.pop(f"{prefix}lm_head.weight", None)  # some tied checkpoints store the copy anyway
