"""Draft heads as the pages show them: a head folder typed by the user checked before a run, and what a head's
config.json and manifest.json say (kind, layout, size, held-out agreement by depth, where it came from).

JSON and safetensors headers only: no torch import, so the pages stay light; the engine checks the head against the
target when the run loads it (workbench.engine.drafters.published).
"""
from __future__ import annotations

import json
from pathlib import Path

from ui import catalog
from ui.jobs import REPO_ROOT

HEAD_KINDS = ("eagle", "eagle3", "redrafter")  # the folders a trained head sits in beside a preset's target
PATH_METHODS = ("eagle", "eagle3")  # the methods `--draft-head` feeds (published EAGLE-1/2 and EAGLE-3 layouts)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM")


def head_folder(text: str) -> Path:
    """A folder as typed: ~ expanded; a relative path is taken from the repository root if it exists there."""
    path = Path(str(text).strip()).expanduser()
    if not path.is_absolute():
        path = (REPO_ROOT / path) if (REPO_ROOT / path).exists() else path.resolve()
    return path


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def layout_of(config: dict) -> str | None:
    """The layout a head's config.json names: "eagle3" (an EAGLE-3 architecture or a draft vocabulary), "eagle" (an
    EAGLE-1/2 Llama architecture), our own kind (its "type"), or None when the config does not say."""
    arch = tuple(config.get("architectures") or ())
    if any(a in EAGLE3_ARCHITECTURES for a in arch) or "draft_vocab_size" in config:
        return "eagle3"
    if any(a in EAGLE_ARCHITECTURES for a in arch):
        return "eagle"
    kind = config.get("type")
    return kind if kind in HEAD_KINDS else None


def run_layout(config: dict) -> str | None:
    """The layout a run row records for this head (results column draft_head_layout): workbench for our own eagle
    and redrafter format, eagle (EAGLE-1/2) or eagle3 (EAGLE-3, which our eagle3 heads are saved in)."""
    kind = config.get("type")
    if kind == "eagle3" or (kind is None and layout_of(config) == "eagle3"):
        return "eagle3"
    if kind == "eagle":
        return "eagle" if config.get("style") == "eagle" else "workbench"
    if kind == "redrafter":
        return "workbench"
    return layout_of(config)


def check_head_path(text: str, method: str | None) -> tuple[Path | None, str | None]:
    """A draft-head folder for `--draft-head` with `method` (None: any of PATH_METHODS): (path, None), or (None, a
    message naming the problem): empty, missing, not a folder, no config.json, config.json not JSON, no weights
    file, or a head of the other method's layout."""
    text = str(text).strip()
    if not text:
        return None, "draft head path is empty: type the head's folder (config.json + model.safetensors or " \
                     "pytorch_model.bin), or choose the built-in / trained head"
    if method is not None and method not in PATH_METHODS:
        return None, f"method {method} takes no draft-head path: it runs the head trained beside the target " \
                     f"(zoo train-head --kind {method}); pick {' or '.join(PATH_METHODS)} for a published head"
    path = head_folder(text)
    if not path.exists():
        return None, f"draft head folder does not exist: {path}"
    if not path.is_dir():
        return None, f"draft head must be a folder (config.json + weights), not a file: {path}"
    if not (path / "config.json").is_file():
        return None, f"draft head folder has no config.json: {path}"
    config = read_json(path / "config.json")
    if config is None:
        return None, f"draft head config is not a JSON object: {path / 'config.json'}"
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        return None, f"draft head folder has no {' or '.join(WEIGHT_FILES)}: {path}"
    layout = layout_of(config)
    if layout == "redrafter":
        return None, f"{path} is a ReDrafter head: method redrafter runs the head trained beside the target, not " \
                     f"one given as a path"
    if config.get("type") == "eagle":  # our own saved format: its tensor names are not the published ones
        return None, f"{path} is an EAGLE head in the workbench's own format: choose the built-in / trained head " \
                     f"to run it beside its target, or write it in the published layout with `python -m workbench " \
                     f"zoo export-head --kind eagle --preset P --out DIR` and give DIR"
    if method is not None and layout in PATH_METHODS and layout != method:
        return None, f"{path} is an {'EAGLE-3' if layout == 'eagle3' else 'EAGLE-1/2'} head: run it with method " \
                     f"{layout}, not {method}"
    return path, None


def _first(d: dict, *keys):
    for key in keys:
        if d.get(key) is not None:
            return d[key]
    return None


def tokens_trained(manifest: dict) -> int | None:
    """Training tokens a head's manifest records (train.tokens / tokens_seen), else steps x batch x window length
    from its recipe; None when neither is there."""
    train, recipe = manifest.get("train") or {}, manifest.get("recipe") or {}
    given = _first(train, "tokens", "tokens_seen")
    if isinstance(given, (int, float)):
        return int(given)
    try:
        return int(train["steps"]) * int(recipe["batch_size"]) * int(recipe["seq_len"])
    except (KeyError, TypeError, ValueError):
        return None


def origin(manifest: dict, config: dict) -> str:
    """Where a head came from, in words: the manifest's source / trainer fields where it has them, else what it
    records of its training (preset, device, date, corpus)."""
    parts = []
    for key in ("source", "trainer", "training_data", "data"):
        value = manifest.get(key)
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items() if not isinstance(v, (dict, list)))
        if value:
            parts.append(f"{key}: {value}")
    if not parts and manifest:
        if manifest.get("preset"):
            parts.append(f"trained here for preset {manifest['preset']}")
        if manifest.get("device"):
            parts.append(f"on {manifest['device']}")
        if manifest.get("created_at"):
            parts.append(f"at {manifest['created_at']}")
        sources = (manifest.get("corpus") or {}).get("sources")
        if sources:
            parts.append(f"corpus {'+'.join(map(str, sources))}")
    if not parts:
        name = config.get("_name_or_path") or config.get("name_or_path")
        parts.append(f"no manifest (a published checkpoint{': ' + str(name) if name else ''})")
    return "; ".join(parts)


def summary(folder: Path, kind: str | None = None, preset: str | None = None) -> dict:
    """One head folder as a row: kind, layout, parameters (from the safetensors header), dtype as saved, steps and
    tokens trained, held-out top-1 agreement by depth (a list; [] when unrecorded), where it came from."""
    config = read_json(folder / "config.json") or {}
    manifest = read_json(folder / "manifest.json") or {}
    heldout, train = manifest.get("heldout") or {}, manifest.get("train") or {}
    agreement = [float(a) for a in heldout.get("agreement_by_depth") or [] if isinstance(a, (int, float))]
    return {"preset": preset or manifest.get("preset"), "kind": kind or manifest.get("kind") or layout_of(config),
            "layout": run_layout(config),
            "params": catalog.safetensors_params(folder / "model.safetensors")
            if (folder / "model.safetensors").is_file() else None,
            "saved dtype": manifest.get("saved_dtype") or config.get("torch_dtype"),
            "draft vocab": config.get("draft_vocab_size"),
            "steps": train.get("steps"), "tokens trained": tokens_trained(manifest),
            "train s": train.get("train_seconds"), "stopped by": train.get("stopped_by"),
            "agreement by depth": agreement,
            "untrained agreement by depth": [float(a) for a in heldout.get("untrained_agreement_by_depth") or []
                                             if isinstance(a, (int, float))],
            "came from": origin(manifest, config), "folder": str(folder), "has manifest": bool(manifest)}


def trained_heads() -> list[dict]:
    """Every head found beside a trained preset's target (<preset folder>/<kind>/ with config.json), as `summary`
    rows."""
    rows = []
    for name in catalog.preset_names():
        paths, _ = catalog.resolve(name)
        if paths is None:
            continue
        for kind in HEAD_KINDS:
            folder = Path(paths.root) / kind
            if (folder / "config.json").is_file():
                rows.append(summary(folder, kind, name))
    return rows


def inspect_folder(text: str) -> tuple[dict | None, str | None]:
    """A head folder typed on the Models page as a `summary` row, or (None, a message naming what is missing)."""
    if not str(text).strip():
        return None, None
    path = head_folder(text)
    if not path.is_dir():
        return None, f"draft head folder does not exist: {path}" if not path.exists() else \
            f"draft head must be a folder (config.json + weights), not a file: {path}"
    if not (path / "config.json").is_file() and not (path / "manifest.json").is_file():
        return None, f"draft head folder has neither config.json nor manifest.json: {path}"
    return summary(path), None


def agreement_table(rows: list[dict]) -> list[dict]:
    """The rows with their agreement by depth spread over columns "depth 1", "depth 2", ... (one per depth)."""
    out = []
    for row in rows:
        flat = {k: v for k, v in row.items() if k not in ("agreement by depth", "untrained agreement by depth")}
        flat.update({f"depth {d}": round(a, 4) for d, a in enumerate(row["agreement by depth"], 1)})
        out.append(flat)
    return out
