"""`ModelConfig`: the one description of a Llama-family decoder (Llama, Qwen2, Mistral), read from HF config.json.

Reads both spellings of the RoPE settings: transformers <= 4.x writes `rope_theta` + `rope_scaling`, transformers 5.x
writes `rope_parameters = {"rope_type", "rope_theta", ...}`. Only default RoPE and Llama-3 scaling are supported.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")

# HF `architectures[0]` -> our architecture name
_ARCHITECTURE_CLASSES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
_HF_CLASS = {arch: cls for cls, arch in _ARCHITECTURE_CLASSES.items()}


class ModelLoadError(Exception):
    """A model, config or tokenizer could not be loaded. `path` is the offending file, `problem` says what to do."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (HF `rope_type: "llama3"`), as in Llama 3.1+."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder. `None` fields are filled in `__post_init__`.

    Bias conventions follow HF: Llama's `attention_bias` puts a bias on q/k/v/o; Qwen2 always has a q/k/v bias and
    no o bias (see `qkv_bias`, `o_bias`). `sliding_window` is recorded (Mistral v0.1) but not applied by the model.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None -> num_attention_heads (no GQA)
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} not in {SUPPORTED_ARCHITECTURES}")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.architecture == "qwen2"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.architecture != "qwen2"

    @property
    def num_kv_groups(self) -> int:
        """Query heads per key/value head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str | Path = "<config dict>") -> ModelConfig:
        """Build from a HF config.json dict. Raises ModelLoadError(source, ...) for what we cannot run.

        >>> ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
        ...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}).head_dim
        16
        """
        architecture = _architecture(d, source)
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelLoadError(source, f"hidden_act={act!r} is not supported (only silu/SwiGLU models run here)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if d.get(k) is None]
        if missing:
            raise ModelLoadError(source, f"config is missing {', '.join(missing)}; is this a decoder config.json?")
        max_pos = int(d.get("max_position_embeddings") or 2048)
        rope_theta, rope_scaling = _rope(d, max_pos, source)
        sliding = d.get("sliding_window")
        if architecture == "qwen2" and not d.get("use_sliding_window", False):
            sliding = None  # Qwen2 stores a window but only uses it when use_sliding_window is set
        eos = d.get("eos_token_id")
        try:
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=_opt_int(d.get("num_key_value_heads")),
                head_dim=_opt_int(d.get("head_dim")),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                architecture=architecture,
                bos_token_id=_opt_int(d.get("bos_token_id")),
                eos_token_id=tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else _opt_int(eos),
                sliding_window=_opt_int(sliding),
            )
        except ValueError as e:
            raise ModelLoadError(source, f"inconsistent config: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers (4.x and 5.x) and `from_hf_dict` both read back to this config."""
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        rope_scaling = None
        if self.rope_scaling is not None:
            rope_scaling = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
            rope_parameters.update(rope_scaling)
        d: dict[str, Any] = {
            "architectures": [_HF_CLASS[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,  # legacy spelling (transformers 4.x, llama.cpp converters)
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters,  # transformers 5.x spelling
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }
        if self.architecture == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = self.mlp_bias
        if self.architecture == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.architecture == "qwen2":
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
        return d

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)


def _architecture(d: dict[str, Any], source: str | Path) -> str:
    for cls_name in d.get("architectures") or []:
        if cls_name in _ARCHITECTURE_CLASSES:
            return _ARCHITECTURE_CLASSES[cls_name]
    model_type = d.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES:
        return model_type
    named = ", ".join(d.get("architectures") or []) or "none listed"
    raise ModelLoadError(
        source,
        f"unsupported architecture (architectures: {named}; model_type: {model_type!r}); "
        f"only {', '.join(_ARCHITECTURE_CLASSES)} checkpoints can be loaded",
    )


def _rope(d: dict[str, Any], max_pos: int, source: str | Path) -> tuple[float, RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from either the 4.x or the 5.x spelling."""
    params = d.get("rope_parameters") or {}
    legacy = d.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(source, "per-layer-type rope_parameters are not supported")
    theta = params.get("rope_theta", legacy.get("rope_theta", d.get("rope_theta")))
    theta = 10000.0 if theta is None else float(theta)
    scaling = legacy or params  # transformers gives a legacy rope_scaling priority too
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    partial = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ModelLoadError(source, f"partial_rotary_factor={partial} is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(
            source, f"rope type {rope_type!r} is not supported (supported: default, llama3); "
            "use a checkpoint without that rope scaling"
        )
    try:
        return theta, RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings") or max_pos),
        )
    except KeyError as e:
        raise ModelLoadError(source, f"llama3 rope scaling is missing {e.args[0]!r}") from None
