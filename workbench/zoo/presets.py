"""Named zoo presets (frozen dataclasses, the one source of defaults) and where their trained files live.

A preset fixes everything needed to rebuild a target/draft pair from the local Python sources: corpus, tokenizer
size, both Llama architectures, training budget, seed and distillation. `resolve_preset(name)` finds a trained one:

    tiny   -> workbench/zoo/weights/tiny/          (committed to git)
    others -> $WORKBENCH_ZOO_DIR/<name>/ or <repo>/zoo_cache/<name>/   (git-ignored)

Each preset folder holds target/ and draft/ (Hugging Face format: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), manifest.json and prompts.jsonl. This module imports neither torch nor transformers.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.zoo.corpus import CorpusSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMITTED_DIR = Path(__file__).resolve().parent / "weights"


class ZooError(Exception):
    """A preset is unknown, untrained, or its files are broken; the message says what to do."""


@dataclass(frozen=True)
class ModelSpec:
    """A Llama decoder; field names are Hugging Face LlamaConfig's."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"heads do not divide evenly: {self}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def param_count(self, vocab_size: int) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = 2 * h * self.num_attention_heads * hd + 2 * h * self.num_key_value_heads * hd
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else vocab_size * h
        return vocab_size * h + self.num_hidden_layers * layer + h + head

    def hf_config(self, vocab_size: int, eot_id: int) -> dict:
        """Keyword arguments for transformers.LlamaConfig (same on transformers 5.17 and 5.24)."""
        return {
            "vocab_size": vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "bos_token_id": eot_id,
            "eos_token_id": eot_id,
            "pad_token_id": eot_id,
        }


@dataclass(frozen=True)
class TrainSpec:
    """AdamW with linear warmup then cosine decay to min_lr_ratio * lr.

    Training stops at max_steps or after max_seconds of steady-state training (the first step, which includes
    torch.compile, is timed separately), whichever comes first; the cosine follows whichever is further along, so a
    time-limited run still ends at the low learning rate.
    """

    lr: float
    max_seconds: float
    max_steps: int = 1_000_000
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0


@dataclass(frozen=True)
class DistillSpec:
    """Draft loss = (1 - alpha) * CE(data) + alpha * T^2 * KL(target_T || draft_T), softmax at temperature T."""

    alpha: float = 0.5
    temperature: float = 2.0


@dataclass(frozen=True)
class ZooPreset:
    name: str
    description: str
    vocab_size: int
    corpus: CorpusSpec
    target: ModelSpec
    draft: ModelSpec
    target_train: TrainSpec
    draft_train: TrainSpec
    distill: DistillSpec = field(default_factory=DistillSpec)
    seq_len: int = 512
    batch_size: int = 64
    seed: int = 1234
    tokenizer_train_bytes: int = 24_000_000  # BPE merges learnt from this many bytes of training files
    compile: bool = False  # torch.compile on CUDA (never on CPU)
    save_dtype: str = "bfloat16"  # weights on disk; held-out metrics are measured on these rounded weights
    eval_tokens: int = 1_000_000  # held-out tokens scored (at most)
    num_prompts: int = 64
    prompt_max_tokens: int = 256
    committed: bool = False  # lives in git under workbench/zoo/weights/<name>/

    def __post_init__(self) -> None:
        if self.save_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"save_dtype must be bfloat16 or float32, got {self.save_dtype!r}")

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ZooPreset] = {
    "tiny": ZooPreset(
        name="tiny",
        description="5.2M target / 0.6M draft, 4k BPE; stdlib + 150 MB of site-packages; ~2 min on one H200",
        vocab_size=4096,
        corpus=CorpusSpec(sources=("stdlib", "site-packages"), site_packages_max_bytes=150_000_000),
        target=ModelSpec(hidden_size=256, intermediate_size=640, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4),
        draft=ModelSpec(hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=3, num_key_value_heads=1),
        target_train=TrainSpec(lr=2e-3, max_seconds=75.0, warmup_steps=100),
        draft_train=TrainSpec(lr=3e-3, max_seconds=30.0, warmup_steps=100),
        compile=False,  # launch-bound at this size either way; eager avoids ~1 min of compilation per model
        committed=True,
    ),
    "small": ZooPreset(
        name="small",
        description="82M target (12 x 768, GQA 12/4) / 5.2M draft (4 x 256), 8k BPE; stdlib + site-packages; "
                    "~5 min on one H200",
        vocab_size=8192,
        corpus=CorpusSpec(sources=("stdlib", "site-packages")),
        target=ModelSpec(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4),
        draft=ModelSpec(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2),
        target_train=TrainSpec(lr=1e-3, max_seconds=200.0, warmup_steps=200),
        draft_train=TrainSpec(lr=3e-3, max_seconds=70.0, warmup_steps=200),
        tokenizer_train_bytes=40_000_000,
        compile=True,
    ),
}


def get_preset(name: str) -> ZooPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ZooError(f"unknown zoo preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None


def cache_root() -> Path:
    """Where presets that are not committed live: $WORKBENCH_ZOO_DIR, else <repo>/zoo_cache."""
    env = os.environ.get("WORKBENCH_ZOO_DIR")
    return Path(env) if env else REPO_ROOT / "zoo_cache"


def preset_home(name: str) -> Path:
    """The folder `zoo train NAME` writes by default and `resolve_preset(NAME)` reads."""
    preset = get_preset(name)
    return COMMITTED_DIR / name if preset.committed else cache_root() / name


@dataclass(frozen=True)
class PresetPaths:
    root: Path
    target_dir: Path
    draft_dir: Path
    tokenizer_path: Path  # tokenizer.json (target and draft share it)
    prompts_path: Path  # prompts.jsonl cut from held-out files
    manifest: dict


def train_command(name: str) -> str:
    return f"python -m workbench zoo train {name}"


def resolve_dir(root: str | Path, name: str | None = None) -> PresetPaths:
    """PresetPaths for a trained preset folder; ZooError naming what is missing otherwise."""
    root = Path(root)
    how = f"train it with: {train_command(name)}" if name else "train it with: python -m workbench zoo train PRESET --out DIR"
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        label = f"zoo preset {name!r}" if name else f"zoo folder {str(root)!r}"
        raise ZooError(f"{label} is not trained: no {manifest_path}; {how}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ZooError(f"{manifest_path} is unreadable ({e}); {how}") from None
    paths = PresetPaths(
        root=root,
        target_dir=root / "target",
        draft_dir=root / "draft",
        tokenizer_path=root / "target" / "tokenizer.json",
        prompts_path=root / "prompts.jsonl",
        manifest=manifest,
    )
    for need in (paths.target_dir / "config.json", paths.target_dir / "model.safetensors",
                 paths.draft_dir / "config.json", paths.draft_dir / "model.safetensors",
                 paths.tokenizer_path, paths.prompts_path):
        if not need.is_file():
            raise ZooError(f"zoo folder {root} is incomplete: {need} is missing; {how}")
    return paths


def resolve_preset(name: str) -> PresetPaths:
    """Paths and manifest of a trained preset. Unknown name or untrained preset -> ZooError saying what to do."""
    return resolve_dir(preset_home(name), name)
