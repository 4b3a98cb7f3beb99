"""Calibration text for activation-aware quantization (AWQ): a few *training-split* files of the zoo corpus.

    texts, note = calibration_texts(max_chars=60_000)     # stdlib files outside the held-out split

The held-out split is where the quality cost is measured (the preset's prompts come from it), so calibration reads only
training files: standard-library .py files whose path is not held out (`corpus.is_heldout`, the presets' 5 %),
taken in the order of a path hash with its own salt, so the choice is fixed by the Python installation. A different
Python version on another machine reads different files; `note` names how many files and characters were used.
This module imports no torch.
"""
from __future__ import annotations

from workbench.zoo.corpus import CorpusSpec, _read, is_heldout, list_source_files, path_bucket, source_roots

DEFAULT_HOLDOUT = CorpusSpec().holdout_fraction


def calibration_texts(max_chars: int = 60_000, max_files: int = 16, holdout_fraction: float = DEFAULT_HOLDOUT
                      ) -> tuple[list[str], str]:
    """Up to `max_files` training-split stdlib sources, `max_chars` characters in all; (texts, note)."""
    (label, root), = source_roots(CorpusSpec(sources=("stdlib",)))
    files = [(rel, p) for rel, p in list_source_files(label, root) if not is_heldout(rel, holdout_fraction)]
    files.sort(key=lambda f: path_bucket(f[0], "calibration"))
    texts, used, skipped = [], 0, {}
    for rel, path in files:
        if len(texts) >= max_files or used >= max_chars:
            break
        data = _read(path, 64_000, skipped)
        if data is None:
            continue
        text = data.decode("utf-8")[: max_chars - used]
        texts.append(text)
        used += len(text)
    return texts, f"calibration: {len(texts)} training-split stdlib files, {used} characters"
