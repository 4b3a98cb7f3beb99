"""Draft heads in their authors' published layouts: a checkpoint folder loaded onto our heads (`--draft-head PATH`),
and our heads written in those layouts (`zoo export-head`), so a head trained here loads in vLLM, SGLang or the
EAGLE code, and a downloaded one runs here.

A folder holds config.json and the weights as model.safetensors or pytorch_model.bin. Two layouts, as SafeAILab's
EAGLE code saves them and vLLM's llama_eagle.py / llama_eagle3.py read them (H hidden size, V vocabulary):

EAGLE-1/2 ("eagle"): a Hugging Face Llama config (architectures LlamaForCausalLM; num_hidden_layers 1), weights
    fc.weight [H, 2H], fc.bias [H] (optional)            over [embed(x_{i+1}); h_i]
    layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
    layers.0.post_attention_layernorm.weight              (layer 0 has no input_layernorm; one present is unused)
    embed_tokens.weight [V, H] (optional)                 a copy of the target's; the target's own is used
  -> EagleHead with style "eagle" (no input norm, no final norm; the output goes to the target's LM head).
    hot_tokens_N.pt (optional): a token map, the N most frequent token ids (FR-Spec; SGLang's --speculative-token-map,
    as `zoo export-head --hot-vocab N` writes it), the head's hot_tokens for --hot-vocab <= N (the largest N is read)
EAGLE-3 ("eagle3"): config with draft_vocab_size and architectures LlamaForCausalLMEagle3 or Eagle3LlamaForCausalLM
(optionally eagle_aux_hidden_state_layer_ids, top level or under eagle_config, and norm_before_residual: the
attention's residual is then the normed fused feature, as vLLM reads that key), weights
    fc.weight [H, 3H]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight [H];
    midlayer.self_attn.{q,k,v}_proj.weight [rows, 2H], o_proj.weight [H, heads x D]; midlayer.mlp.*; norm.weight [H];
    lm_head.weight [Vd, H]; d2t [Vd] int64 (target id = draft id + d2t[draft id]); t2d [V] bool
    (no embed_tokens: the target's). d2t may be left out only where Vd = V.
  -> Eagle3Head (its own state_dict is this layout).

Every checkpoint is checked against the target before it is used (hidden size, vocabulary, heads, head dim, key
names and shapes); a mismatch is a `HeadCheckpointError` naming the value, the target's and what to do.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.engine.drafters.base import DrafterError
from workbench.engine.drafters.eagle import EagleHead, EagleHeadConfig
from workbench.engine.drafters.eagle3 import Eagle3Head, Eagle3HeadConfig, check_aux_layers, check_draft_vocab
from workbench.models.llama import full_config

CONFIG, SAFETENSORS, TORCH_BIN = "config.json", "model.safetensors", "pytorch_model.bin"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
LAYOUTS = ("eagle", "eagle3")


class HeadCheckpointError(DrafterError):
    """A draft-head checkpoint that cannot run on this target (missing file or tensor, wrong shape, another model's
    hidden size or vocabulary); the message names the mismatch and what to do."""


@dataclass
class LoadedHead:
    """A published checkpoint on our head class, and what the run row records about it."""

    head: EagleHead | Eagle3Head
    layout: str  # "eagle" | "eagle3"
    source: str  # the folder
    stored_dtype: str  # the dtype of its weights on disk
    num_parameters: int

    @property
    def method(self) -> str:
        return self.layout  # the decoding method that runs it: eagle or eagle3


def read_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, the weights by name) of a head folder; HeadCheckpointError naming a missing file."""
    src = Path(path)
    if not src.is_dir():
        raise HeadCheckpointError(f"draft head {src}: not a folder (give the folder that holds {CONFIG} and "
                                  f"{SAFETENSORS} or {TORCH_BIN})")
    if not (src / CONFIG).is_file():
        raise HeadCheckpointError(f"draft head {src}: missing {CONFIG}")
    try:
        config = json.loads((src / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise HeadCheckpointError(f"draft head {src / CONFIG}: not JSON ({e})") from None
    if (src / SAFETENSORS).is_file():
        from safetensors.torch import load_file

        weights = load_file(str(src / SAFETENSORS))
    elif (src / TORCH_BIN).is_file():
        weights = torch.load(src / TORCH_BIN, map_location="cpu", weights_only=True)
    else:
        shards = sorted(p.name for p in src.glob("*.safetensors")) + sorted(p.name for p in src.glob("*.bin"))
        raise HeadCheckpointError(f"draft head {src}: no {SAFETENSORS} or {TORCH_BIN}"
                                  + (f" (found {', '.join(shards)}: merge the shards into one file)" if shards else ""))
    return config, weights


def detect_layout(config: dict, weights: dict[str, torch.Tensor], source: str = "draft head") -> str:
    """ "eagle3" for an EAGLE-3 checkpoint (its architectures, draft_vocab_size or midlayer.* tensors), "eagle" for
    an EAGLE-1/2 one (layers.0.* and fc)."""
    arch = tuple(config.get("architectures") or ())
    if any(a in EAGLE3_ARCHITECTURES for a in arch) or any(k.startswith("midlayer.") for k in weights):
        return "eagle3"
    if "fc.weight" in weights and any(k.startswith("layers.0.") for k in weights):
        return "eagle"
    raise HeadCheckpointError(f"{source}: neither an EAGLE-1/2 checkpoint (fc.weight and layers.0.*) nor an EAGLE-3 "
                              f"one (midlayer.*, architectures {' or '.join(EAGLE3_ARCHITECTURES)}); architectures "
                              f"{list(arch)}, tensors {sorted(weights)[:6]}...")


def _stored_dtype(weights: dict[str, torch.Tensor]) -> str:
    floats = [w.dtype for w in weights.values() if w.is_floating_point()]
    return str(max(set(floats), key=floats.count)).removeprefix("torch.") if floats else "none"


def _same(source: str, what: str, theirs, ours, advice: str = "this head was trained for another target: use "
          "the head made for this target (or its target model)") -> None:
    if theirs != ours:
        raise HeadCheckpointError(f"{source}: {what} is {theirs}, the target's is {ours}; {advice}")


def _check_shared_shapes(src: str, config: dict, target) -> tuple[int, int]:
    """The checks both layouts share: hidden size, vocabulary, heads, KV heads, head dim, one layer. -> (H, head_dim)"""
    c = full_config(target)
    if "hidden_size" not in config:
        raise HeadCheckpointError(f"{src}/{CONFIG}: no hidden_size (a head's config is a Llama config)")
    _same(src, "hidden_size", config["hidden_size"], c.hidden_size)
    _same(src, "vocab_size", config.get("vocab_size", c.vocab_size), c.vocab_size,
          "the head was trained with another tokenizer: use a head made for this target's tokenizer")
    heads = config.get("num_attention_heads", c.num_attention_heads)
    _same(src, "num_attention_heads", heads, c.num_attention_heads)
    _same(src, "num_key_value_heads", config.get("num_key_value_heads", heads), c.num_key_value_heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    _same(src, "head_dim", head_dim, c.head_dim)
    if config.get("num_hidden_layers", 1) != 1:
        raise HeadCheckpointError(f"{src}: {config['num_hidden_layers']} decoder layers; the engine runs one-layer "
                                  "EAGLE heads (the published ones have one)")
    theta = config.get("rope_theta")
    if theta is not None and float(theta) != float(c.rope_theta):
        raise HeadCheckpointError(f"{src}: rope_theta is {theta}, the target's is {c.rope_theta}; the head runs "
                                  f"with the target's RoPE: use a head made for this target")
    return c.hidden_size, head_dim


def _take(src: str, weights: dict, name: str, shape: tuple[int, ...], optional: bool = False):
    w = weights.get(name)
    if w is None:
        if optional:
            return None
        raise HeadCheckpointError(f"{src}: missing tensor {name} (shape {list(shape)}); the checkpoint is incomplete "
                                  f"or of another layout")
    if tuple(w.shape) != tuple(shape):
        raise HeadCheckpointError(f"{src}: {name} has shape {list(w.shape)}, expected {list(shape)} for this target "
                                  f"(hidden size, heads and vocabulary must be the target's)")
    return w


def _layer_tensors(src: str, weights: dict, prefix: str, config: dict, h: int, d: int, in_width: int,
                   target) -> dict[str, torch.Tensor]:
    """The decoder layer's attention and MLP tensors under `prefix` (HF names), shape-checked."""
    c = full_config(target)
    inter = int(config.get("intermediate_size", c.intermediate_size))
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    out = {}
    for name, shape in (("self_attn.q_proj.weight", (q, in_width)), ("self_attn.k_proj.weight", (kv, in_width)),
                        ("self_attn.v_proj.weight", (kv, in_width)), ("self_attn.o_proj.weight", (h, q)),
                        ("mlp.gate_proj.weight", (inter, h)), ("mlp.up_proj.weight", (inter, h)),
                        ("mlp.down_proj.weight", (h, inter)), ("post_attention_layernorm.weight", (h,))):
        out[name] = _take(src, weights, prefix + name, shape)
    for name in ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias",
                 "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"):
        if prefix + name in weights:
            raise HeadCheckpointError(f"{src}: {prefix + name}: biased attention / MLP heads are not supported")
    return out


def _unexpected(src: str, weights: dict, used: set[str], ignored: set[str]) -> None:
    extra = sorted(set(weights) - used - ignored)
    if extra:
        raise HeadCheckpointError(f"{src}: unexpected tensors {extra[:8]}: not a head layout the loader knows "
                                  f"(EAGLE-1/2 or EAGLE-3 as SafeAILab's code and vLLM read them)")


TOKEN_MAP_GLOB = "hot_tokens_*.pt"  # SGLang's --speculative-token-map file, as `zoo export-head --hot-vocab N` names it


def _load_token_map(head: EagleHead, folder: Path, vocab_size: int, src: str) -> None:
    """The folder's token map (the largest hot_tokens_N.pt: the first N of the ranking) as the head's hot_tokens;
    none there leaves the head without one (hot_vocab then refuses it by name)."""
    found = sorted((f for f in folder.glob(TOKEN_MAP_GLOB) if f.stem.rsplit("_", 1)[-1].isdigit()),
                   key=lambda f: int(f.stem.rsplit("_", 1)[-1]))
    if not found:
        return
    try:
        ids = torch.as_tensor(torch.load(found[-1], weights_only=True))
        head.set_hot_tokens(ids, vocab_size=vocab_size)
    except (ValueError, RuntimeError, TypeError, EOFError) as e:
        raise HeadCheckpointError(f"{src}: {found[-1].name} is not a token map (the hot token ids, most frequent "
                                  f"first, as torch.save writes them): {e}") from None


def load_published_head(path: str | Path, target, *, device=None, dtype=None,
                        aux_layers: tuple[int, ...] | None = None, tokenizer=None) -> LoadedHead:
    """The checkpoint in `path` as our head, checked against `target`, on `device` in `dtype` (default: the
    target's). `aux_layers`: the EAGLE-3 layers to read where the checkpoint's config names none (default: the
    default rule); a checkpoint that names them and disagrees is refused. `tokenizer`: the target's; where the folder
    holds a tokenizer.json too, the two vocabularies must be the same."""
    config, weights = read_checkpoint(path)
    src = str(path)
    if tokenizer is not None and (Path(path) / "tokenizer.json").is_file():
        from workbench.models import tokenizer_fingerprint

        if tokenizer_fingerprint(Path(path)) != tokenizer_fingerprint(tokenizer):
            raise HeadCheckpointError(f"{src}: its tokenizer.json differs from the target's (token ids differ): the "
                                      f"head was trained with another tokenizer; use a head made for this target")
    layout = detect_layout(config, weights, src)
    h, d = _check_shared_shapes(src, config, target)
    c = full_config(target)
    inter = int(config.get("intermediate_size", c.intermediate_size))
    if layout == "eagle":
        fc = weights.get("fc.weight")
        if fc is not None and tuple(fc.shape) == (h, 3 * h):
            raise HeadCheckpointError(f"{src}: fc.weight is [H, 3H], an EAGLE-3 fusion, but the config names no EAGLE-3 "
                                      f"architecture; set architectures to {EAGLE3_ARCHITECTURES[0]}")
        state = {"fc.weight": _take(src, weights, "fc.weight", (h, 2 * h))}
        bias = _take(src, weights, "fc.bias", (h,), optional=True)
        if bias is not None:
            state["fc.bias"] = bias
        layer = _layer_tensors(src, weights, "layers.0.", config, h, d, h, target)
        state.update({"layer." + k: v for k, v in layer.items()})
        embed = _take(src, weights, "embed_tokens.weight", (c.vocab_size, h), optional=True)
        _unexpected(src, weights, {"fc.weight", "fc.bias", "embed_tokens.weight"} | {"layers.0." + k for k in layer},
                    {"layers.0.input_layernorm.weight", "lm_head.weight"})
        del embed  # shape-checked (its vocabulary must be the target's); the target's own embedding is used
        head = EagleHead(EagleHeadConfig(h, inter, c.num_attention_heads, c.num_key_value_heads, d,
                                         float(config.get("rms_norm_eps", c.rms_norm_eps)), style="eagle",
                                         fc_bias=bias is not None))
    else:
        vd = int(config.get("draft_vocab_size") or c.vocab_size)
        named = config.get("eagle_aux_hidden_state_layer_ids") or \
            (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        layers = tuple(named) if named else None
        if layers is not None and aux_layers is not None and tuple(aux_layers) != layers:
            raise HeadCheckpointError(f"{src}: the head reads layers {list(layers)}, eagle3_layers asks for "
                                      f"{list(aux_layers)}: set --eagle3-layers auto")
        cfg = Eagle3HeadConfig.of_target(c, layers or aux_layers, vd)
        check_aux_layers(cfg.aux_layers, c.num_hidden_layers)
        cfg = Eagle3HeadConfig(h, inter, c.num_attention_heads, c.num_key_value_heads, d,
                               float(config.get("rms_norm_eps", c.rms_norm_eps)), c.vocab_size, vd, cfg.aux_layers,
                               norm_before_residual=bool(config.get("norm_before_residual", False)))
        fc = weights.get("fc.weight")
        if fc is not None and fc.ndim == 2 and fc.shape[1] % 3 == 0 and fc.shape[1] != 3 * h:
            _same(src, "the fused features' width (fc.weight columns / 3)", fc.shape[1] // 3, h)
        state = {"fc.weight": _take(src, weights, "fc.weight", (h, 3 * h))}
        layer = _layer_tensors(src, weights, "midlayer.", config, h, d, 2 * h, target)
        state.update({"midlayer." + k: v for k, v in layer.items()})
        for name in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "norm.weight"):
            state[name] = _take(src, weights, name, (h,))
        state["lm_head.weight"] = _take(src, weights, "lm_head.weight", (vd, h))
        d2t = weights.get("d2t")
        if d2t is None:
            if vd != c.vocab_size:
                raise HeadCheckpointError(f"{src}: missing d2t: the draft vocabulary ({vd} tokens) is smaller than "
                                          f"the target's ({c.vocab_size}) and d2t maps it; the checkpoint is "
                                          f"incomplete (re-export it with its d2t)")
            d2t = torch.zeros(vd, dtype=torch.long)
        d2t = _take(src, {"d2t": d2t}, "d2t", (vd,))
        if d2t.is_floating_point():
            raise HeadCheckpointError(f"{src}: d2t is {d2t.dtype}; it holds integer offsets (int64)")
        ids = torch.arange(vd) + d2t.long()
        try:
            check_draft_vocab(ids, c.vocab_size, vd)
        except ValueError as e:
            raise HeadCheckpointError(f"{src}: {e}") from None
        t2d = _take(src, weights, "t2d", (c.vocab_size,), optional=True)
        state["d2t"] = d2t.long()
        state["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        if t2d is not None and not torch.equal(t2d.bool(), state["t2d"]):
            raise HeadCheckpointError(f"{src}: t2d disagrees with d2t (t2d must mark exactly the target ids d2t maps "
                                      f"to); the checkpoint is inconsistent")
        _unexpected(src, weights, set(state) | {"t2d"}, {"embed_tokens.weight"})
        head = Eagle3Head(cfg)
    head.load_state_dict(state)
    p = next(target.parameters())
    head = head.to(device=device or p.device, dtype=dtype or p.dtype).eval()
    head.check_target(target)
    if layout == "eagle":
        _load_token_map(head, Path(path), c.vocab_size, src)
    return LoadedHead(head, layout, src, _stored_dtype(weights), sum(p.numel() for p in head.parameters()))


def _llama_config(head, target, dtype: torch.dtype) -> dict:
    c, hc = full_config(target), head.config
    return {"model_type": "llama", "hidden_size": hc.hidden_size, "intermediate_size": hc.intermediate_size,
            "num_attention_heads": hc.num_attention_heads, "num_key_value_heads": hc.num_key_value_heads,
            "head_dim": hc.head_dim, "num_hidden_layers": 1, "rms_norm_eps": hc.rms_norm_eps,
            "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
            "rope_theta": c.rope_theta, "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def export_published_head(head: EagleHead | Eagle3Head, target, path: str | Path,
                          dtype: torch.dtype | None = None) -> str:
    """Write `head` (for `target`) in its published layout into folder `path` (config.json + model.safetensors, in
    `dtype`, default the head's); returns the layout. An EagleHead of style "workbench" has no published equivalent
    (its layer normalizes its input and its output goes through the final norm): HeadCheckpointError."""
    from safetensors.torch import save_file

    head.check_target(target)
    dtype = dtype or next(head.parameters()).dtype
    cast = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu()
            for k, v in head.state_dict().items()}
    config = _llama_config(head, target, dtype)
    if isinstance(head, Eagle3Head):
        layout = "eagle3"
        config.update(architectures=[EAGLE3_ARCHITECTURES[0]], draft_vocab_size=head.config.draft_vocab_size,
                      eagle_aux_hidden_state_layer_ids=list(head.config.aux_layers),
                      norm_before_residual=head.config.norm_before_residual)
        weights = cast
    elif isinstance(head, EagleHead) and head.config.style == "eagle":
        layout = "eagle"
        config.update(architectures=[EAGLE_ARCHITECTURES[0]], bias=head.config.fc_bias)
        weights = {k.replace("layer.", "layers.0.", 1) if k.startswith("layer.") else k: v for k, v in cast.items()}
    else:
        raise HeadCheckpointError("this EAGLE head has the workbench structure (an input norm on its layer and the "
                                  "target's final norm on its output), which the published EAGLE-1/2 layout cannot "
                                  "express: train one with `zoo train-head --kind eagle --style eagle`, or export an "
                                  "EAGLE-3 head")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(out / SAFETENSORS), metadata={"format": "pt"})
    return layout
