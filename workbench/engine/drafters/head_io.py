"""Draft heads on disk, for every head kind: a folder holding

    config.json         {"type": <kind>, **the head's config dataclass}
    model.safetensors   the head's state dict, in the dtype it was saved in (no float32 copy is made)

A head class derives from `SavedHead` and names its `kind`, its `label` (for messages) and its `config_class`;
`save(path)` writes the folder and `load(path, device, dtype)` rebuilds the head from it. A folder of another kind is
refused by name (ValueError), a folder missing a file with FileNotFoundError naming the file. The manifest beside a
trained head (which target and tokenizer it belongs to) is the zoo's business: workbench/zoo/heads.py.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, fields
from pathlib import Path

import torch
from torch import nn

HEAD_CONFIG, HEAD_WEIGHTS = "config.json", "model.safetensors"


class SavedHead(nn.Module):
    """A draft head with `config` (a frozen dataclass of `config_class`) that saves to and loads from a folder."""

    kind: str = "head"  # config.json "type"
    label: str = "head"  # in messages: "EAGLE head <path>: missing ...", "... not an EAGLE head"
    config_class: type = type(None)

    def save(self, path: str | Path) -> None:
        """<path>/config.json + <path>/model.safetensors (the dtype is kept)."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / HEAD_CONFIG).write_text(json.dumps({"type": self.kind, **asdict(self.config)}, indent=2) + "\n")
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(out / HEAD_WEIGHTS))

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        """The head saved in `path`, on `device` in `dtype` (None: as saved), in eval mode."""
        from safetensors.torch import load_file

        src = Path(path)
        for name in (HEAD_CONFIG, HEAD_WEIGHTS):
            if not (src / name).is_file():
                raise FileNotFoundError(f"{cls.label} {src}: missing {name} (a head folder holds {HEAD_CONFIG} and "
                                        f"{HEAD_WEIGHTS}, as {cls.__name__}.save writes them)")
        raw = json.loads((src / HEAD_CONFIG).read_text())
        if raw.get("type") != cls.kind:
            article = "an" if cls.label[0] in "AEIOU" else "a"
            raise ValueError(f"{src / HEAD_CONFIG} describes a {raw.get('type')!r} head, not {article} {cls.label}")
        head = cls(cls.config_class(**{f.name: raw[f.name] for f in fields(cls.config_class)
                                       if f.name in raw or f.default is MISSING}))  # later fields: their defaults
        head.load_state_dict(load_file(str(src / HEAD_WEIGHTS)))
        return head.to(device=device, dtype=dtype).eval()
