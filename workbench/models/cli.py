"""`python -m workbench models info PATH [--json]`: what a checkpoint is and whether it loads."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser("models", help="inspect model checkpoints")
    sub = parser.add_subparsers(dest="models_command", required=True)
    info = sub.add_parser("info", help="architecture, sizes and load time of a model directory or .gguf file")
    info.add_argument("path", help="model directory (config.json + *.safetensors) or .gguf file")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    info.set_defaults(func=_info)


def model_info(path: str | Path) -> dict:
    """Facts about a checkpoint; loads it (CPU, float32) to time the load. Raises ModelLoadError."""
    from .loader import load_model, read_config, safetensors_files

    p = Path(path)
    config = read_config(p)
    if p.is_file():  # .gguf
        weight_files, disk_dtypes = [p], _gguf_dtypes(p)
        tokenizer_present = _gguf_has_vocab(p)
    else:
        weight_files = safetensors_files(p)
        disk_dtypes = _safetensors_dtypes(weight_files)
        tokenizer_present = (p / "tokenizer.json").is_file()
    start = time.perf_counter()
    model = load_model(p)
    load_s = time.perf_counter() - start
    return {
        "path": str(p),
        "architecture": config.architecture,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_scaling": "llama3" if config.rope_scaling else None,
        "parameters": model.num_parameters(),
        "dtype_on_disk": ",".join(disk_dtypes),
        "file_bytes": sum(f.stat().st_size for f in weight_files),
        "tokenizer_present": tokenizer_present,
        "load_s": round(load_s, 4),
    }


def _info(args: argparse.Namespace) -> int:
    from .config import ModelLoadError

    try:
        info = model_info(args.path)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)  # stdout stays for the answer: empty when there is none
        return 1
    if args.json:
        print(json.dumps(info))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            if key == "parameters":
                value = f"{value:,}"
            elif key == "file_bytes":
                value = f"{value:,} ({value / 2**20:.1f} MiB)"
            print(f"{key:<{width}}  {value}")
    return 0


def _safetensors_dtypes(files: list[Path]) -> list[str]:
    from .loader import safetensors_header

    dtypes: set[str] = set()
    for file in files:
        header = safetensors_header(file)  # ModelLoadError for a truncated file or a garbage header length
        dtypes.update(str(info.get("dtype")) for name, info in header.items()
                      if name != "__metadata__" and isinstance(info, dict))
    return sorted(dtypes)


def _gguf_reader(p: Path):
    from .config import ModelLoadError

    try:
        import gguf

        return gguf.GGUFReader(str(p))
    except Exception as e:  # gguf raises ValueError, struct errors, ... for a truncated or corrupt file
        raise ModelLoadError(p, f"cannot read GGUF ({type(e).__name__}: {e}); the file is corrupt or truncated, "
                                "re-download it") from None


def _gguf_dtypes(p: Path) -> list[str]:
    return sorted({t.tensor_type.name for t in _gguf_reader(p).tensors})


def _gguf_has_vocab(p: Path) -> bool:
    return "tokenizer.ggml.tokens" in _gguf_reader(p).fields
