"""Native Llama-family decoder (Llama, Qwen2, Mistral) in plain PyTorch, loading HF safetensors or GGUF checkpoints.

    model = load_model(path, dtype=torch.float32, device="cpu")
    hidden = model(input_ids, position_ids, attn)     # attn: AttentionBackend, None = CausalAttention()
    logits = model.compute_logits(hidden)
"""
from .attention import AttentionBackend, CausalAttention
from .config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError, RopeScaling
from .llama import LlamaModel
from .loader import DTYPES, load_model, load_tokenizer, read_config, save_model, stored_dtype, tokenizer_fingerprint

__all__ = [
    "DTYPES",
    "AttentionBackend",
    "CausalAttention",
    "LlamaModel",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "SUPPORTED_ARCHITECTURES",
    "load_model",
    "load_tokenizer",
    "read_config",
    "save_model",
    "stored_dtype",
    "tokenizer_fingerprint",
]
