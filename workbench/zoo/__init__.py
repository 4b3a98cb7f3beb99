"""The offline model zoo: target/draft Llama pairs trained on the local Python sources (see presets.py).

    from workbench.zoo import PRESETS, ZooPreset, resolve_preset, train_preset
    paths = resolve_preset("tiny")   # PresetPaths(root, target_dir, draft_dir, tokenizer_path, prompts_path, manifest)

Importing this package does not import torch; `train_preset` imports the trainer on first call.
"""
from __future__ import annotations

from workbench.zoo.presets import (PRESETS, DistillSpec, ModelSpec, PresetPaths, TrainSpec, ZooError, ZooPreset,
                                   get_preset, preset_home, resolve_dir, resolve_preset)


def train_preset(*args, **kwargs) -> PresetPaths:
    """See workbench.zoo.train.train_preset (imported lazily: it needs torch and transformers)."""
    from workbench.zoo.train import train_preset as _train_preset

    return _train_preset(*args, **kwargs)


__all__ = ["PRESETS", "DistillSpec", "ModelSpec", "PresetPaths", "TrainSpec", "ZooError", "ZooPreset",
           "get_preset", "preset_home", "resolve_dir", "resolve_preset", "train_preset"]
