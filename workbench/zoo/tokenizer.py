"""Byte-level BPE tokenizer for the zoo, trained with the `tokenizers` library.

One special token, `<|endoftext|>` (id 0), serves as bos, eos and pad. Encoding adds it in front (a post-processor),
so a training document and a prompt both start the way the model saw documents start. Byte-level means every
string round-trips exactly (worked example)::

    >>> tok = train_tokenizer(["def add(a, b):\\n    return a + b\\n"], vocab_size=300)
    >>> ids = tok.encode("x = 'héllo'\\n").ids
    >>> ids[0] == tok.token_to_id(EOT)
    True
    >>> tok.decode(ids)
    "x = 'héllo'\\n"

`save_tokenizer(tok, folder)` writes tokenizer.json and a tokenizer_config.json so that
`transformers.AutoTokenizer.from_pretrained(folder)` loads it as a fast tokenizer.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT = "<|endoftext|>"
MAX_VOCAB = 65_536  # token ids are stored as uint16


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    if not 257 < vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be in (257, {MAX_VOCAB}], got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eot_id = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, folder: str | Path, model_max_length: int) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """From tokenizer.json or a folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def encode_documents(tok: Tokenizer, texts: Sequence[str], chunk: int = 256) -> np.ndarray:
    """One uint16 token stream: <|endoftext|> doc1 <|endoftext|> doc2 ... (the bos comes from the post-processor)."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets (tokenizers >= 0.21)
    parts: list[np.ndarray] = []
    for start in range(0, len(texts), chunk):
        for enc in encode(list(texts[start : start + chunk])):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
    if not parts:
        return np.zeros(0, dtype=np.uint16)
    return np.concatenate(parts)
