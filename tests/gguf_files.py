"""Write a `LlamaModel` (or a Hugging Face Llama / Qwen2 model) as llama.cpp's converter would, each decoder linear in a
chosen GGUF type (the gguf package's own writer and quantizers), for tests/test_quant_gguf.py, tests/test_models.py
and scripts/gpu_gguf.py. Independent of the loader: the q/k row permutation here is llama.cpp's, written out again,
not the loader's inverse."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
PARTS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row permutation (half-split -> interleaved RoPE layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model, arch: str, tensor_type: Callable[[int, str], Q] = lambda i, part: Q.F32,
               embedding: Q = Q.F32, rope_freqs: np.ndarray | None = None) -> None:
    """`model` (a LlamaModel, or a Hugging Face Llama / Qwen2 model: the same state-dict names) -> a GGUF of
    architecture `arch` ("llama": q/k rows permuted) whose decoder linear `part` (q_proj, ..., down_proj) of layer i
    is stored as `tensor_type(i, part)` (default F32); norms and biases F32, the token embedding (and an untied head)
    as `embedding`; `rope_freqs` (llama.cpp's per-frequency divisors, e.g. Llama-3 scaling) as a tensor. A gpt2-style
    vocabulary of letter strings ("a", ..., "aa", ...)."""
    cfg = model.config
    rope_theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]  # ours, or transformers 5's
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("test-model")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_merges(["a a", "b b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name: str, t: np.ndarray, kind: Q = Q.F32) -> None:
        if kind == Q.F32:
            w.add_tensor(name, t.astype(np.float32))
        elif kind == Q.F16:
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(t.astype(np.float32), kind), raw_dtype=kind)

    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    add("token_embd.weight", sd.pop("model.embed_tokens.weight"), embedding)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd.pop(p + "input_layernorm.weight"))
        add(f"blk.{i}.ffn_norm.weight", sd.pop(p + "post_attention_layernorm.weight"))
        for parent, parts in PARTS.items():
            for part in parts:
                for suffix in ("weight", "bias"):
                    t = sd.pop(f"{p}{parent}.{part}.{suffix}", None)
                    if t is None:
                        continue
                    if arch == "llama" and part in heads:
                        t = permute_for_gguf(t, heads[part])
                    kind = tensor_type(i, part) if suffix == "weight" else Q.F32
                    add(f"blk.{i}.{GGUF_NAMES[part]}.{suffix}", t, kind)
    add("output_norm.weight", sd.pop("model.norm.weight"))
    if not cfg.tie_word_embeddings:
        add("output.weight", sd.pop("lm_head.weight"), embedding)
    if rope_freqs is not None:
        add("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
