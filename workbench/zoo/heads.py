"""Where trained draft heads live and which target they belong to (no torch import).

A head trained by `python -m workbench zoo train-head --kind redrafter --preset P` sits beside the target it was
distilled from:

    <preset folder>/target/          the target (config.json, model.safetensors, tokenizer.json)
    <preset folder>/redrafter/       config.json + model.safetensors (RedrafterHead.save) + manifest.json
    <preset folder>/eagle/           the same files for an EAGLE head (EagleHead.save, `--kind eagle`)
    <preset folder>/eagle3/          the same files for an EAGLE-3 head (Eagle3Head.save, `--kind eagle3`)

The manifest carries the target's fingerprint (a hash of its config.json and of its weights file) and the
tokenizer's (`workbench.models.tokenizer_fingerprint`); `check_head` refuses a head whose fingerprints name another
target or tokenizer, so a retrained target never runs with a stale head.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from workbench.zoo.presets import ZooError

HEAD_MANIFEST = "manifest.json"
HEAD_KINDS = ("redrafter", "eagle", "eagle3")


class HeadMismatchError(ZooError):
    """A trained head's manifest names another target or tokenizer than the one it is asked to draft for."""


def head_dir_for_target(target_path: str | Path, kind: str = "redrafter") -> Path:
    """The head folder that belongs to a target folder: its sibling `<kind>/` (a preset folder's layout)."""
    return Path(target_path).resolve().parent / kind


def has_head(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", HEAD_MANIFEST))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def target_fingerprint(target_path: str | Path) -> dict:
    """{"config_sha256", "weights_sha256", "id"} of a Hugging Face target folder (or a single weights file).

    The config hash is over the canonical JSON (sorted keys) minus `transformers_version`, so re-saving with another
    library version keeps the id; the weights hash is over the bytes of every *.safetensors file in name order.
    """
    p = Path(target_path)
    if p.is_dir():
        config = json.loads((p / "config.json").read_text())
        config.pop("transformers_version", None)
        config_sha = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        weights = hashlib.sha256("".join(_sha256_file(f) for f in sorted(p.glob("*.safetensors"))).encode()).hexdigest()
    else:
        config_sha, weights = "", _sha256_file(p)
    return {"config_sha256": config_sha, "weights_sha256": weights,
            "id": hashlib.sha256(f"{config_sha}:{weights}".encode()).hexdigest()[:16]}


def read_head_manifest(folder: Path) -> dict:
    try:
        return json.loads((folder / HEAD_MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ZooError(f"head {folder}: unreadable {HEAD_MANIFEST} ({e}); retrain with zoo train-head") from None


def check_head(folder: Path, target_path: str | Path, tokenizer_sha256: str,
               target_id: str | None = None) -> dict:
    """The head's manifest if it was trained for this target and tokenizer; HeadMismatchError otherwise."""
    manifest = read_head_manifest(folder)
    trained_for = manifest.get("target", {}).get("id")
    this = target_id or target_fingerprint(target_path)["id"]
    if trained_for != this:
        raise HeadMismatchError(f"head {folder} was trained for target {trained_for}, not {this} ({target_path}): "
                                f"retrain with zoo train-head")
    trained_tok = manifest.get("tokenizer", {}).get("sha256")
    if trained_tok != tokenizer_sha256:
        raise HeadMismatchError(f"head {folder} was trained for tokenizer {str(trained_tok)[:16]}, not "
                                f"{tokenizer_sha256[:16]} ({target_path}): retrain with zoo train-head")
    return manifest
