"""Draft heads on disk, for every head kind: a folder holding

    config.json             {"type": <kind>, **the head's config dataclass}
    model.safetensors       the head's state dict, in the dtype it was saved in (no float32 copy is made)
    hot_tokens.safetensors  (optional) its token ranking, most frequent first: what `hot_vocab` drafts from (EAGLE-2,
                            ReDrafter; `zoo train-head` counts it on the training text)

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
HOT_TOKENS = "hot_tokens.safetensors"  # beside a head's config.json: its token ranking, most frequent first


class SavedHead(nn.Module):
    """A draft head with `config` (a frozen dataclass of `config_class`) that saves to and loads from a folder."""

    kind: str = "head"  # config.json "type"
    label: str = "head"  # in messages: "EAGLE head <path>: missing ...", "... not an EAGLE head"
    config_class: type = type(None)
    hot_tokens: torch.Tensor | None = None  # [<= V] long: token ids, most frequent first (hot_vocab)

    def save(self, path: str | Path) -> None:
        """<path>/config.json + <path>/model.safetensors (the dtype is kept), + hot_tokens.safetensors if ranked."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / HEAD_CONFIG).write_text(json.dumps({"type": self.kind, **asdict(self.config)}, indent=2) + "\n")
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(out / HEAD_WEIGHTS))
        if self.hot_tokens is not None:
            save_file({"hot_tokens": self.hot_tokens.to("cpu", torch.int32).contiguous()}, str(out / HOT_TOKENS))

    def set_hot_tokens(self, ranking: torch.Tensor, vocab_size: int | None = None) -> None:
        """The token ranking, most frequent first: every id 0..V-1 once, or (given `vocab_size`) the first N of one,
        distinct ids below it; ValueError otherwise."""
        ids = torch.as_tensor(ranking).flatten().long().cpu()
        n = ids.numel()
        top = n if vocab_size is None else vocab_size
        if n == 0 or int(ids.min()) < 0 or int(ids.max()) >= top or torch.bincount(ids).max() > 1:
            what = "every token id 0..V-1 once" if vocab_size is None else f"distinct token ids below {vocab_size}"
            raise ValueError(f"hot_tokens must hold {what} (a ranking, most frequent first); got {n} ids in "
                             f"{int(ids.min()) if n else '-'}..{int(ids.max()) if n else '-'}")
        self.hot_tokens = ids

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
        if (src / HOT_TOKENS).is_file():
            head.set_hot_tokens(load_file(str(src / HOT_TOKENS))["hot_tokens"])
        return head.to(device=device, dtype=dtype).eval()


class HotVocab:
    """The LM-head rows of a head's `hot_vocab` most frequent tokens (FR-Spec): a drafter scores only those.

    `check(head, vocab_size, hot_vocab, error, retrain)` raises `error` naming what cannot be drafted (no ranking: the
    message names the `retrain` command; one counted for another tokenizer; more tokens asked for than ranked);
    `setup(head, target, device)` takes the [V', H] slice of the target's LM head once; `logits(features)` ->
    [..., V'] and `ids[i]` the target id of hot index i.
    """

    def __init__(self, hot_vocab: int):
        self.n = hot_vocab
        self.ids = self.weight = None  # [V'] long target ids, [V', H] the LM head's rows (setup)

    @staticmethod
    def check(head, vocab_size: int, hot_vocab, error: type, retrain: str) -> None:
        if isinstance(hot_vocab, bool) or not isinstance(hot_vocab, int) or not 0 <= hot_vocab <= vocab_size:
            raise error(f"hot_vocab must be 0 (the whole vocabulary) or 1..{vocab_size}, got {hot_vocab!r}")
        if not hot_vocab:
            return
        ranking = getattr(head, "hot_tokens", None)
        if ranking is None:
            raise error(f"hot_vocab={hot_vocab} needs the head's token ranking ({HOT_TOKENS} in its folder, which "
                        f"`{retrain}` writes); this head has none: set hot_vocab=0 or retrain the head")
        if int(ranking.max()) >= vocab_size:
            raise error(f"the head's token ranking names token {int(ranking.max())}, the target has {vocab_size} "
                        f"tokens: it was counted for another tokenizer; set hot_vocab=0")
        if hot_vocab > ranking.numel():
            raise error(f"hot_vocab={hot_vocab} exceeds the head's token map ({ranking.numel()} ids): lower "
                        f"hot_vocab to <= {ranking.numel()}")

    def setup(self, head, target, device) -> None:
        self.ids = head.hot_tokens[:self.n].to(device)
        self.weight = dense_lm_head(target)[self.ids].contiguous()

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(features, self.weight)


def dense_lm_head(target) -> torch.Tensor:
    """[V, H] the target's LM head as a float matrix in its dtype (a quantized head dequantized)."""
    head = target.lm_head
    if head is not None and hasattr(head, "dequantized_weight"):
        return head.dequantized_weight().to(next(target.parameters()).dtype)
    return target.lm_head_weight
