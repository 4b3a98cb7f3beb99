"""Load a `LlamaModel` and its tokenizer from a HF directory (config.json + safetensors) or a GGUF file.

Safetensors loading builds the module on the meta device and assigns the file's tensors (no random init, no copy
beyond the dtype cast), so a small model loads in milliseconds. A GGUF's config comes from transformers' GGUF
metadata mapping and its tensors from the gguf package (dequantized to float), then the same name/shape checks.
Every failure is a `ModelLoadError` naming the file.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import Tensor

from .config import ModelConfig, ModelLoadError
from .llama import LlamaModel
from workbench.choices import DTYPES as DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the dtypes a model loads in, by knob value

_INDEX_FILE = "model.safetensors.index.json"
_SHOW = 5  # names listed in an error message before "... (N more)"


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32 or "float32"/"bfloat16"/"fp16"/... -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}
    resolved = getattr(torch, aliases.get(dtype, dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unknown floating dtype {dtype!r}")
    return resolved


def read_config(path: str | Path) -> ModelConfig:
    """ModelConfig of a model directory (its config.json) or of a .gguf file, without loading weights."""
    p = _existing(path)
    if _is_gguf(p):
        return _gguf_config(p)
    if p.is_file():
        raise ModelLoadError(p, "expected a model directory (config.json + *.safetensors) or a .gguf file; "
                                "pass the directory that holds this file")
    config_file = p / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(config_file, "no config.json; a model directory needs config.json + *.safetensors "
                                          "(as written by save_pretrained), or pass a .gguf file")
    try:
        d = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(config_file, f"not valid JSON ({e}); fix or re-export the config") from None
    if not isinstance(d, dict):
        raise ModelLoadError(config_file, "expected a JSON object")
    return ModelConfig.from_hf_dict(d, source=config_file)


def stored_dtype(path: str | Path) -> str | None:
    """The dtype a model folder's config.json names ("dtype", or the older "torch_dtype"), e.g. "bfloat16"; None for
    a GGUF file, a config that names none, or one that cannot be read (loading then names the problem)."""
    p = Path(path)
    try:
        d = json.loads((p / "config.json").read_text()) if p.is_dir() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    value = (d.get("dtype") or d.get("torch_dtype")) if isinstance(d, dict) else None
    return str(value).removeprefix("torch.") if isinstance(value, str) else None


def load_model(path: str | Path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"
               ) -> LlamaModel:
    """Model in eval mode with requires_grad off, weights cast to `dtype` on `device`; `model.source_path` is set."""
    p = _existing(path)
    dtype = as_dtype(dtype)
    rope_freqs = gguf_types = None
    if _is_gguf(p):
        config, tensors, origin, rope_freqs, gguf_types = _read_gguf(p)
    else:
        config = read_config(p)
        tensors, origin = _read_safetensors_dir(p, device)
    model = _assemble(config, tensors, origin, dtype, torch.device(device))
    if rope_freqs is not None:
        if rope_freqs.shape != model.inv_freq.shape:
            raise ModelLoadError(p, f"rope_freqs has shape {tuple(rope_freqs.shape)}, expected "
                                    f"{tuple(model.inv_freq.shape)}; the GGUF is inconsistent")
        model.set_rope_inv_freq(model.inv_freq / rope_freqs)  # ggml divides each frequency by its factor
    model.source_path = str(p)
    if gguf_types is not None:
        model.gguf_tensor_types = gguf_types  # {"Q4_K": 120, "F32": 45, ...}: what the file stored (dequantized here)
    return model


def save_model(model: LlamaModel, directory: str | Path) -> Path:
    """Write `directory/config.json` + `model.safetensors` in HF layout (loadable by load_model and transformers)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    dtypes = {t.dtype for t in state.values()}
    config = model.config.to_hf_dict()
    config["dtype"] = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    config["torch_dtype"] = config["dtype"]  # the transformers 4.x spelling
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_tokenizer(path: str | Path):
    """tokenizers.Tokenizer from `<dir>/tokenizer.json` (or a tokenizer.json path), or built from a .gguf's vocab."""
    from tokenizers import Tokenizer

    p = _existing(path)
    if _is_gguf(p):
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name).backend_tokenizer
        except Exception as e:  # transformers raises many types for a bad or vocab-less GGUF
            raise ModelLoadError(p, f"cannot build a tokenizer from this GGUF ({type(e).__name__}: {e}); "
                                    "pass a directory with tokenizer.json instead") from None
    tokenizer_file = p if p.is_file() else p / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(tokenizer_file, "no tokenizer.json; copy the model's tokenizer.json next to config.json")
    try:
        return Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise ModelLoadError(tokenizer_file, f"cannot parse tokenizer.json ({e}); re-export it") from None


def tokenizer_fingerprint(tokenizer_or_path) -> str:
    """sha256 of the vocabulary (token -> id, added tokens included): equal iff two models share token ids."""
    tok = load_tokenizer(tokenizer_or_path) if isinstance(tokenizer_or_path, (str, Path)) else tokenizer_or_path
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


# --- safetensors ---------------------------------------------------------------------------------------------------

def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a model directory: the shards named by the index, else every *.safetensors."""
    index = directory / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(index, f"unreadable shard index ({e}); re-export the checkpoint") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(index, f"names shard(s) that are missing: {', '.join(absent)}; "
                                        "download the complete checkpoint")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(directory, "no *.safetensors weight files; export the model with "
                                        "save_pretrained(safe_serialization=True) or pass a .gguf file")
    return files


def safetensors_header(file: Path) -> dict:
    """The JSON header of a .safetensors file (tensor name -> dtype, shape, offsets; "__metadata__"), read without
    its tensors. The file starts with the header's length (8 bytes, little-endian), checked against the file size
    before anything is read: a garbage length must not become a read of exabytes. Raises ModelLoadError."""
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            head = fh.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else None
            if length is None or not 2 <= length <= size - 8:
                raise ModelLoadError(file, f"not a safetensors file: {size} bytes, header length "
                                           f"{'missing' if length is None else length}; the file is truncated or "
                                           "corrupt, re-download or re-export it")
            header = json.loads(fh.read(length))
    except OSError as e:
        raise ModelLoadError(file, f"cannot read ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(file, f"safetensors header is not valid JSON ({e}); the file is corrupt, "
                                   "re-download or re-export it") from None
    if not isinstance(header, dict):
        raise ModelLoadError(file, "safetensors header is not a JSON object; the file is corrupt")
    return header


def _read_safetensors_dir(directory: Path, device) -> tuple[dict[str, Tensor], dict[str, Path]]:
    from safetensors.torch import load_file

    tensors: dict[str, Tensor] = {}
    origin: dict[str, Path] = {}  # tensor name -> file it came from, for error messages
    for file in safetensors_files(directory):
        safetensors_header(file)  # a named error for a truncated file or a garbage header length
        try:
            loaded = load_file(str(file), device=str(device))
        except Exception as e:  # SafetensorError, OSError, or a header JSON error
            raise ModelLoadError(file, f"cannot read safetensors ({e}); the file is corrupt or truncated, "
                                       "re-download or re-export it") from None
        tensors.update(loaded)
        origin.update(dict.fromkeys(loaded, file))
    return tensors, origin


# --- GGUF ----------------------------------------------------------------------------------------------------------

def _gguf_config(p: Path) -> ModelConfig:
    try:
        import gguf  # noqa: F401  (transformers needs it; fail with our message, not theirs)
        from transformers import AutoConfig
    except ImportError as e:
        raise ModelLoadError(p, f"GGUF loading needs the gguf and transformers packages ({e}); pip install gguf") \
            from None
    try:
        hf_config = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    except Exception as e:  # corrupt header, unknown architecture, ... surface as one clear error
        raise ModelLoadError(p, f"cannot read GGUF metadata ({type(e).__name__}: {e}); the file is corrupt, "
                                "truncated, or of an architecture transformers cannot read") from None
    return ModelConfig.from_hf_dict(hf_config.to_dict(), source=p)


def open_gguf(p: Path, config: ModelConfig):
    """(gguf.GGUFReader, GGUF architecture name, {GGUF tensor name: HF name}) of a .gguf file whose config is
    `config`. Names map through gguf-py's tensor-name table (blk.N.attn_q.weight -> model.layers.N.self_attn.
    q_proj.weight). Raises ModelLoadError for an unreadable file or an architecture gguf-py does not know."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(p))
        field = reader.fields["general.architecture"]
        gguf_arch = bytes(field.parts[field.data[0]]).decode()
    except Exception as e:
        raise ModelLoadError(p, f"cannot read GGUF ({type(e).__name__}: {e}); the file is corrupt or truncated, "
                                "re-download it") from None
    arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == gguf_arch), None)
    if arch_id is None:
        raise ModelLoadError(p, f"GGUF architecture {gguf_arch!r} is unknown to the gguf package")
    name_map = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    with torch.device("meta"):
        hf_names = list(LlamaModel(config, init_weights=False).state_dict())
    to_hf = {}
    for hf_name in hf_names:
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            to_hf[f"{gguf_name}.{suffix}"] = hf_name
    return reader, gguf_arch, to_hf


def rope_permuted_heads(gguf_name: str, gguf_arch: str, config: ModelConfig) -> int | None:
    """The head count whose rows llama.cpp permuted in this tensor (q and k of GGUF arch "llama"), else None."""
    if gguf_arch != "llama":
        return None
    if ".attn_q." in gguf_name:
        return config.num_attention_heads
    if ".attn_k." in gguf_name:
        return config.num_key_value_heads
    return None


def _read_gguf(p: Path) -> tuple[ModelConfig, dict[str, Tensor], dict[str, Path], Tensor | None, dict[str, int]]:
    """(config, HF-named float32 tensors, origin, llama.cpp rope_freqs or None, stored tensor type -> count).

    The config comes from transformers' GGUF metadata mapping. The tensors are read with the gguf package directly:
    transformers' AutoModelForCausalLM GGUF path needs `accelerate`, which this project does not pin. Names map
    through gguf-py's tensor-name table; q/k rows are un-permuted for GGUF arch "llama" as transformers does.
    """
    config = _gguf_config(p)
    import gguf
    import numpy as np

    reader, gguf_arch, to_hf = open_gguf(p, config)
    tensors: dict[str, Tensor] = {}
    types: dict[str, int] = {}
    rope_freqs = None
    try:
        for t in reader.tensors:
            kind = getattr(t.tensor_type, "name", str(t.tensor_type))
            types[kind] = types.get(kind, 0) + 1
            weights = np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
            if t.name == "rope_freqs.weight":  # llama.cpp's Llama-3 scaling: per-frequency divisors
                rope_freqs = torch.from_numpy(weights.reshape(-1))
                continue
            n_head = rope_permuted_heads(t.name, gguf_arch, config)
            if n_head is not None:
                weights = unpermute_rope_rows(weights, n_head)
            tensors[to_hf.get(t.name, t.name)] = torch.from_numpy(weights)
    except Exception as e:
        raise ModelLoadError(p, f"cannot read GGUF tensors ({type(e).__name__}: {e}); the file is corrupt or "
                                "truncated, re-download it") from None
    return config, tensors, dict.fromkeys(tensors, p), rope_freqs, types


def unpermute_rope_rows(weights, n_head: int):
    """Undo llama.cpp's convert_hf_to_gguf q/k row permutation (interleaved -> half-split RoPE layout). It moves
    whole rows, so it applies as well to a packed weight [N, K/2] or its per-group scales [N, K/g]."""
    rows_per_half = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, rows_per_half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


# --- assembly ------------------------------------------------------------------------------------------------------

def _assemble(config: ModelConfig, tensors: dict[str, Tensor], origin: dict[str, Path], dtype: torch.dtype,
              device: torch.device) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(config, init_weights=False)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name in list(tensors):
        if name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight"):
            del tensors[name]  # derived buffers of old checkpoints; duplicate tied head
    source = _common_source(origin)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing tensors {_names(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors {_names(unexpected)}")
        raise ModelLoadError(source, "; ".join(problems) + f". The weights do not match the config "
                             f"({config.architecture}, {config.num_hidden_layers} layers, tie_word_embeddings="
                             f"{config.tie_word_embeddings}); check that config.json belongs to these weights")
    wrong = [(n, tuple(tensors[n].shape), shape) for n, shape in sorted(expected.items())
             if tuple(tensors[n].shape) != shape]
    if wrong:
        detail = ", ".join(f"{n} has {got}, config implies {want}" for n, got, want in wrong[:_SHOW])
        more = f" (+{len(wrong) - _SHOW} more)" if len(wrong) > _SHOW else ""
        raise ModelLoadError(origin[wrong[0][0]], f"shape mismatch: {detail}{more}; check that config.json "
                                                  "belongs to these weights")
    state = {}
    for name in list(tensors):  # pop as we go: peak memory stays near one copy of the weights
        t = tensors.pop(name)
        state[name] = t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
    model.fuse_state_dict_(state)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _names(names: list[str]) -> str:
    more = f" (+{len(names) - _SHOW} more)" if len(names) > _SHOW else ""
    return ", ".join(names[:_SHOW]) + more


def _common_source(origin: dict[str, Path]) -> Path:
    files = set(origin.values())
    if len(files) == 1:
        return next(iter(files))
    return next(iter(files)).parent if files else Path("<no tensors>")


def _existing(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(p, "does not exist; pass a model directory (config.json + *.safetensors) or a .gguf "
                                "file, e.g. workbench/zoo/weights/tiny/target")
    return p


def _is_gguf(p: Path) -> bool:
    return p.is_file() and p.suffix.lower() == ".gguf"
