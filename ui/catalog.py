"""What the pages can offer: zoo presets, prompt files, registered local models. No Streamlit here.

Engine modules are imported lazily inside the functions so a page that does not need them does not pay for them,
and an engine module that fails to import is reported as a message on the page instead of a crash.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ui.jobs import REPO_ROOT, jobs_root, write_json_atomic


# ---- zoo presets ------------------------------------------------------------------------------------------------

def preset_names() -> list[str]:
    from workbench.zoo import PRESETS

    return list(PRESETS)


def resolve(name: str):
    """`workbench.zoo.resolve_preset(name)` -> (PresetPaths | None, error | None); an untrained preset is an error."""
    try:
        from workbench.zoo import resolve_preset

        return resolve_preset(name), None
    except Exception as exc:  # noqa: BLE001 - any failure becomes a message next to the preset picker
        return None, f"preset {name!r} is not available: {exc}"


def manifest_of(paths) -> dict:
    manifest = getattr(paths, "manifest", None)
    if isinstance(manifest, dict):
        return manifest
    candidates = [manifest] if manifest is not None else []
    candidates.append(Path(paths.root) / "manifest.json")
    for cand in candidates:
        try:
            return json.loads(Path(cand).read_text())
        except (OSError, TypeError, ValueError):
            continue
    return {}


# ---- prompts ----------------------------------------------------------------------------------------------------

def prompt_path(text: str | os.PathLike) -> Path:
    """A prompt file path as typed: ~ expanded; a relative path is taken from the repository root if it exists there."""
    path = Path(str(text).strip()).expanduser()
    if not path.is_absolute() and (REPO_ROOT / path).exists():
        path = REPO_ROOT / path
    return path.resolve()


def load_prompt_file(path: str | os.PathLike) -> tuple[list | None, str | None]:
    """`workbench.harness.prompts.load_prompts(path)` -> (prompts, None) or (None, the PromptFileError message)."""
    if not str(path).strip():
        return None, "prompt file path is empty"
    path = prompt_path(path)
    if not path.is_file():
        return None, f"prompt file does not exist: {path}"
    from workbench.harness.prompts import PromptFileError, load_prompts

    try:
        prompts = load_prompts(path)
    except PromptFileError as exc:
        return None, str(exc)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"cannot read prompt file {path}: {exc}"
    if not prompts:
        return None, f"prompt file {path} holds no prompts"
    return prompts, None


def save_upload(name: str, data: bytes) -> Path:
    """Keep an uploaded prompt file under the jobs folder (content-addressed) so a job can read it later."""
    import hashlib

    folder = jobs_root() / "uploads"
    folder.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in Path(name).name) or "prompts.jsonl"
    path = folder / f"{hashlib.sha256(data).hexdigest()[:12]}-{safe}"
    if not path.exists():
        path.write_bytes(data)
    return path


# ---- model sizes (read from files, no torch) --------------------------------------------------------------------

def safetensors_params(path: Path) -> int | None:
    """Parameter count from the JSON headers of a model's *.safetensors files (no tensor is read, no torch); None
    when a file is not a readable safetensors file. A header's 8-byte length is checked against the file's size
    before it is read: a garbage length (a truncated or foreign file) must not become a read of exabytes."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    total = 0
    for f in files:
        if f.suffix != ".safetensors":
            return None
        try:
            size = f.stat().st_size
            with f.open("rb") as fh:
                head = fh.read(8)
                length = int.from_bytes(head, "little")
                if len(head) < 8 or not 2 <= length <= size - 8:
                    return None
                header = json.loads(fh.read(length))
            for name, info in header.items():
                if name != "__metadata__":
                    count = 1
                    for dim in info.get("shape", []):
                        count *= int(dim)
                    total += count
        except (OSError, ValueError, TypeError, AttributeError):  # unreadable, not JSON, or not a tensor table
            return None
    return total or None


def disk_mib(path: Path) -> float | None:
    """A file's or folder's size on disk in MiB, one decimal, as `zoo list` counts it (workbench.zoo.cli.disk_mib);
    a number, so the table sorts by it; None when it cannot be read."""
    from workbench.zoo.cli import disk_mib as _disk_mib

    mib = _disk_mib(path)
    return None if mib is None else round(mib, 1)


def fmt_params(n: int | None) -> str:
    if not n:
        return "?"
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


# ---- local model registry (a small JSON file beside the jobs) ----------------------------------------------------

def registry_path() -> Path:
    return jobs_root() / "models.json"


def registered_models() -> list[dict]:
    try:
        data = json.loads(registry_path().read_text())
    except (OSError, ValueError):
        return []
    return data.get("models", []) if isinstance(data, dict) else []


def register_model(name: str, target: Path, draft: Path | None, note: str = "") -> None:
    models = [m for m in registered_models() if m.get("name") != name]
    models.append({"name": name, "target": str(target), "draft": str(draft) if draft else None, "note": note,
                   "registered_at": time.time()})
    write_json_atomic(registry_path(), {"models": models})


def unregister_model(name: str) -> None:
    write_json_atomic(registry_path(), {"models": [m for m in registered_models() if m.get("name") != name]})
