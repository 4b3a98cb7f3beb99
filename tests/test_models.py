"""workbench.models: parity with transformers on random tiny models, loading (safetensors, GGUF), errors, CLI."""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers

from workbench.models import (
    CausalAttention,
    LlamaModel,
    ModelConfig,
    ModelLoadError,
    RopeScaling,
    load_model,
    load_tokenizer,
    read_config,
    save_model,
    tokenizer_fingerprint,
)


VOCAB = 96
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
CASES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "llama_tied_llama3": ("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": True,
                                                              "rope_scaling": LLAMA3_ROPE}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"num_key_value_heads": 1}),
}
MAX_REL_ERR = 1e-4


def make_hf_model(case: str, seed: int = 0):
    """A tiny HF model whose every parameter (biases and norm weights too) is random, so parity means something."""
    model_cls, config_cls, extra = CASES[case]
    config = getattr(transformers, config_cls)(**copy.deepcopy({**SIZES, **extra}))  # HF mutates rope dicts
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """case -> (HF model, directory it was saved to with save_pretrained)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for case in CASES:
        model = make_hf_model(case)
        model.save_pretrained(root / case)
        out[case] = (model, root / case)
    return out


def hf_logits(model, ids, positions):
    # an explicit all-ones mask stops transformers from reading jumps in position_ids as packed sequences
    with torch.no_grad():
        return model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids), use_cache=False).logits


def ours_logits(model, ids, positions, attn=None):
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, attn))


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_position_cases():
    """Guards the parity test: row 0 is a plain chain; the other rows really repeat and skip positions (like the
    depths of a flattened draft tree), or the "jumpy" parity case would prove nothing beyond the chain."""
    pos = positions_for(batch=3, length=12)
    assert pos[0].tolist() == list(range(12))
    for r in (1, 2):
        steps = pos[r].diff().tolist()
        assert pos[r, 0] == 40 * r and 0 in steps and any(s > 1 for s in steps) and min(steps) >= 0


def positions_for(batch: int, length: int) -> torch.Tensor:
    """Row 0: 0..T-1. Other rows: start at 40*row and repeat/skip depths like a flattened draft tree."""
    rows = [torch.arange(length)]
    for r in range(1, batch):
        steps = torch.tensor([0, 1] + [(i % 3 == 0) * 1 + (i % 5 == 0) * 2 for i in range(length - 2)])
        rows.append(40 * r + torch.cumsum(steps, 0))
    return torch.stack(rows)


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_transformers(hf_models, case):
    hf, path = hf_models[case]
    model = load_model(path)
    assert model.source_path == str(path)
    assert model.config.architecture == case.split("_")[0]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 12), generator=gen)
    contiguous = torch.arange(12).expand(3, 12)
    assert rel_err(ours_logits(model, ids, contiguous), hf_logits(hf, ids, contiguous)) < MAX_REL_ERR
    jumpy = positions_for(3, 12)  # per-row offsets, repeated and skipped positions (tree depths)
    assert rel_err(ours_logits(model, ids, jumpy), hf_logits(hf, ids, jumpy)) < MAX_REL_ERR


def test_llama3_rope_scaling_changes_the_result(hf_models):
    """Guards the parity test above: llama3 scaling must matter at these sizes, or parity would prove nothing."""
    hf, path = hf_models["llama_tied_llama3"]
    model = load_model(path)
    assert model.config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    plain = LlamaModel(dataclasses.replace(model.config, rope_scaling=None), init_weights=False)
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    pos = positions_for(2, 10)
    assert rel_err(ours_logits(plain, ids, pos), hf_logits(hf, ids, pos)) > 100 * MAX_REL_ERR


def test_state_dict_uses_hf_names_and_round_trips(hf_models, tmp_path):
    hf, path = hf_models["qwen2"]
    model = load_model(path)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        file_names = set(f.keys())
    assert set(model.state_dict()) == file_names
    assert "model.layers.0.self_attn.q_proj.bias" in file_names
    # save_model output is readable by transformers and by us, with the same logits
    save_model(model, tmp_path / "saved")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(7).expand(2, 7)
    assert rel_err(hf_logits(back, ids, pos), hf_logits(hf, ids, pos)) < MAX_REL_ERR
    assert rel_err(ours_logits(load_model(tmp_path / "saved"), ids, pos), hf_logits(hf, ids, pos)) < MAX_REL_ERR


def test_attention_backend_contract(hf_models):
    """The model hands each layer's q/k/v to the backend with the documented shapes, layer by layer."""
    model = load_model(hf_models["llama"][1])
    calls = []

    class Recording:
        def attend(self, layer_idx, q, k, v):
            calls.append((layer_idx, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
            return CausalAttention().attend(layer_idx, q, k, v)

    class Zeros:
        def attend(self, layer_idx, q, k, v):
            return torch.zeros_like(q)

    ids = torch.randint(0, VOCAB, (2, 5))
    pos = torch.arange(5).expand(2, 5)
    assert torch.equal(ours_logits(model, ids, pos, Recording()), ours_logits(model, ids, pos))
    assert calls == [(i, (2, 4, 5, 16), (2, 2, 5, 16), (2, 2, 5, 16)) for i in range(2)]
    # the backend's return value is what the layer uses (not a recomputation of its own)
    assert not torch.allclose(ours_logits(model, ids, pos, Zeros()), ours_logits(model, ids, pos))


def _one_launch_backend(one_call: bool, calls: list):
    """An attention backend class whose attend is one opaque kernel call (as the engine's fused K/V write + attention
    path is), recording the layer indices it sees in `calls`; `one_call`: what it answers `attends_in_one_call`."""
    @torch.compiler.disable
    def kernel(layer_idx, q, k, v):  # stands for the Triton launch: dynamo never traces it
        calls.append(layer_idx)
        return CausalAttention().attend(layer_idx, q, k, v)

    class OneLaunch:
        def attends_in_one_call(self):
            return one_call

        def attend(self, layer_idx, q, k, v):
            return kernel(layer_idx, q, k, v)
    return OneLaunch


def _compiled_frames(layers: int, one_call: bool) -> tuple[int, list[int], torch.Tensor]:
    """torch.compile (dynamo only, backend "eager") over a fresh `layers`-layer model whose backend calls an opaque
    kernel (as the engine's fused K/V write + attention path does); returns (frames dynamo compiled, the layer indices
    the backend saw, the output)."""
    from torch._dynamo.utils import counters

    calls = []
    OneLaunch = _one_launch_backend(one_call, calls)
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig(**{**SIZES, "num_hidden_layers": layers})).eval()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager", dynamic=False)
    ids = torch.randint(0, VOCAB, (1, 3), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(3)[None]
    with torch.no_grad():
        out = compiled(ids, pos, OneLaunch())
        compiled(ids, pos, OneLaunch())  # a second call reuses what the first compiled
    frames = counters["frames"]["total"]
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(out, model(ids, pos, OneLaunch()))  # compiled = eager
    return frames, calls[: 2 * layers], out


def test_one_compiled_graph_serves_every_layer():
    """With a backend whose attend is one opaque launch, the layer index is read outside the compiled frames, so the
    frames dynamo compiles do not grow with depth (reading it inside made one graph per layer and, past dynamo's
    recompile limit, silent eager fallbacks on the H200). The traced path still works."""
    shallow, calls, _ = _compiled_frames(2, one_call=True)
    deep, deep_calls, _ = _compiled_frames(6, one_call=True)
    assert deep == shallow, (shallow, deep)
    assert deep_calls == list(range(6)) * 2  # every layer's own index, in order, both calls
    traced_shallow, _, _ = _compiled_frames(2, one_call=False)
    traced_deep, traced_calls, _ = _compiled_frames(6, one_call=False)
    assert traced_deep > traced_shallow  # what the opaque call avoids: a frame per layer
    assert traced_calls == list(range(6)) * 2


def test_a_forward_runs_one_compiled_graph_per_layer():
    """Between two one-launch attentions the forward runs one graph (`LlamaModel._cross`: a layer's o_proj and MLP,
    the next layer's norm and q/k/v), so each residual add fuses with the norm after it; the layer's own frames made
    three per layer. A forward is the first graph (embeddings, layer 0's q/k/v), then one per layer."""
    runs = []

    def counting(gm, example_inputs):
        def run(*args):
            runs.append(1)
            return gm.forward(*args)
        return run

    OneLaunch = _one_launch_backend(True, [])
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig(**{**SIZES, "num_hidden_layers": 5})).eval()
    torch._dynamo.reset()
    ids, pos = torch.randint(0, VOCAB, (1, 3)), torch.arange(3)[None]
    compiled = torch.compile(model, backend=counting, dynamic=False)
    with torch.no_grad():
        compiled(ids, pos, OneLaunch())  # compiles
        runs.clear()
        out = compiled(ids, pos, OneLaunch())
    torch._dynamo.reset()
    assert len(runs) == 1 + 5
    with torch.no_grad():
        assert torch.equal(out, model(ids, pos, OneLaunch()))


def test_fresh_model_is_initialized_and_trainable():
    config = ModelConfig(**SIZES, architecture="llama")
    model = LlamaModel(config)
    assert model.num_parameters() == config.num_parameters()
    # initialized as documented (normal(0, 0.02) matrices, unit norms), not left as whatever memory held
    assert abs(model.model.embed_tokens.weight.std().item() - 0.02) < 0.002
    assert abs(model.model.layers[0].self_attn.qkv_proj.weight.std().item() - 0.02) < 0.002
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    ids = torch.randint(0, VOCAB, (2, 6))
    logits = model.compute_logits(model(ids, torch.arange(6).expand(2, 6)))
    assert torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    assert model.model.layers[0].self_attn.qkv_proj.weight.grad is not None


def test_bfloat16_load_is_close_to_float32(hf_models):
    path = hf_models["llama"][1]
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(8).expand(2, 8)
    low = load_model(path, dtype="bfloat16")
    assert low.model.embed_tokens.weight.dtype == torch.bfloat16
    got = ours_logits(low, ids, pos)
    assert got.dtype == torch.bfloat16
    assert rel_err(got.float(), ours_logits(load_model(path), ids, pos)) < 5e-2


def test_load_does_not_run_random_init(hf_models, monkeypatch):
    """Loading builds the model without initializing weights that the file overwrites anyway (what makes a load
    slow for large models); speed itself is measured by benchmark scripts, not asserted here."""
    def no_init(self, *args, **kwargs):
        raise AssertionError("load_model ran LlamaModel.reset_parameters")

    monkeypatch.setattr(LlamaModel, "reset_parameters", no_init)
    hf, path = hf_models["mistral"]
    model = load_model(path)
    assert all(p.device.type == "cpu" for p in model.parameters())
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(6)[None]
    assert rel_err(ours_logits(model, ids, pos), hf_logits(hf, ids, pos)) < MAX_REL_ERR


# --- config ----------------------------------------------------------------------------------------------------------

def test_config_reads_both_rope_spellings():
    base = {"architectures": ["LlamaForCausalLM"], **SIZES}
    legacy = ModelConfig.from_hf_dict({**base, "rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE}})
    v5 = ModelConfig.from_hf_dict({**base, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}})
    assert legacy == v5
    assert v5.rope_theta == 500000.0 and v5.rope_scaling.original_max_position_embeddings == 16
    assert v5.head_dim == 16 and v5.num_kv_groups == 2
    assert ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "default"}}).rope_scaling is None
    assert ModelConfig.from_hf_dict({**base, "rope_scaling": None}).rope_theta == 10000.0


def test_config_round_trips_through_hf_dict():
    cfg = ModelConfig(**SIZES, architecture="llama", tie_word_embeddings=True, eos_token_id=[2, 5],
                      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))
    assert cfg.eos_token_id == (2, 5)
    d = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(d))) == cfg
    hf = transformers.AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})
    assert ModelConfig.from_hf_dict(hf.to_dict()) == cfg
    qwen = ModelConfig(**SIZES, architecture="qwen2")
    assert qwen.qkv_bias and not qwen.o_bias
    assert ModelConfig.from_hf_dict(qwen.to_hf_dict()) == qwen


@pytest.mark.parametrize("bad, words", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_config_rejects_what_we_cannot_run(bad, words):
    with pytest.raises(ModelLoadError, match=words):
        ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **SIZES, **bad}, source="x/config.json")


# --- loading errors --------------------------------------------------------------------------------------------------

def copy_model_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_path_and_missing_files(hf_models, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json") as err:
        load_model(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    (only_config / "config.json").write_text((hf_models["llama"][1] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(only_config)
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_tokenizer(only_config)


def test_truncated_safetensors(hf_models, tmp_path):
    broken = copy_model_dir(hf_models["llama"][1], tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated") as err:
        load_model(broken)
    assert "model.safetensors" in str(err.value)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                      "vocab_size": 50257, "n_embd": 768}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel") as err:
        load_model(tmp_path)
    assert "config.json" in str(err.value)


def test_shape_mismatch_and_missing_tensors(hf_models, tmp_path):
    wrong = copy_model_dir(hf_models["llama"][1], tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(ModelLoadError, match="shape mismatch: model.layers.0.mlp.down_proj.weight has \\(64, 96\\)"):
        load_model(wrong)
    (wrong / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="missing tensors model.layers.2"):
        load_model(wrong)
    (wrong / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(ModelLoadError, match="unexpected tensors model.layers.1"):
        load_model(wrong)


def test_sharded_checkpoint(hf_models, tmp_path):
    hf, _ = hf_models["llama"]
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, VOCAB, (1, 6))
    pos = torch.arange(6)[None]
    assert rel_err(ours_logits(load_model(tmp_path / "sharded"), ids, pos), hf_logits(hf, ids, pos)) < MAX_REL_ERR


# --- tokenizer -------------------------------------------------------------------------------------------------------

def word_tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_tokenizer_and_fingerprint(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    word_tokenizer(["<unk>", "hello", "world"]).save(str(a / "tokenizer.json"))
    word_tokenizer(["<unk>", "world", "hello"]).save(str(b / "tokenizer.json"))
    tok = load_tokenizer(a)
    assert tok.encode("hello world").ids == [1, 2]
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(tok) == tokenizer_fingerprint(a / "tokenizer.json")
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)
    (b / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot parse tokenizer.json"):
        load_tokenizer(b)


# --- GGUF ------------------------------------------------------------------------------------------------------------

def write_gguf(path, hf_model, arch: str, rope_freqs: np.ndarray | None = None) -> None:
    """An HF model as llama.cpp would write it, all F32 (tests/gguf_files.py; imported here, not at the top, so this
    module loads without the gguf package)."""
    from tests.gguf_files import write_gguf as write

    write(path, hf_model, arch, rope_freqs=rope_freqs)


@pytest.mark.parametrize("case, arch", [("llama_tied_llama3", "llama"), ("qwen2", "qwen2")])
def test_gguf_parity(hf_models, tmp_path, case, arch):
    hf, _ = hf_models[case]
    rope_freqs = None
    if case == "llama_tied_llama3":
        # llama.cpp stores Llama-3 scaling as per-frequency divisors: plain inv_freq / scaled inv_freq
        plain = load_model(hf_models["llama"][1]).inv_freq  # same head_dim and theta, no scaling
        rope_freqs = (plain / load_model(hf_models[case][1]).inv_freq).numpy()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, arch, rope_freqs)
    model = load_model(path)
    assert model.source_path == str(path)
    assert set(model.gguf_tensor_types) <= {"F32", "F16", "BF16"}  # what the file stored, for the run record
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert read_config(path).architecture == case.split("_")[0]
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    pos = positions_for(2, 9)
    assert rel_err(ours_logits(model, ids, pos), hf_logits(hf, ids, pos)) < MAX_REL_ERR
    if arch == "llama":
        tok = load_tokenizer(path)
        assert tok.token_to_id("aa") == 26


def test_corrupt_gguf(hf_models, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ModelLoadError, match="bad.gguf.*(corrupt|truncated)"):
        load_model(bad)
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_model(bad)
    write_gguf(bad, hf_models["llama"][0], "llama")
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size * 9 // 10])  # header intact, tensor data cut short
    with pytest.raises(ModelLoadError, match="bad.gguf.*(corrupt|truncated)"):
        load_model(bad)


# --- CLI -------------------------------------------------------------------------------------------------------------

def test_cli_info_json(hf_models, capsys):
    from workbench.__main__ import main

    path = hf_models["qwen2"][1]
    assert main(["models", "info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "qwen2" and info["layers"] == 2 and info["kv_heads"] == 2
    assert info["parameters"] == sum(p.numel() for p in hf_models["qwen2"][0].parameters())
    assert info["dtype_on_disk"] == "F32" and info["tokenizer_present"] is False
    assert main(["models", "info", str(path)]) == 0
    assert "architecture" in capsys.readouterr().out
    assert main(["models", "info", str(path / "missing")]) == 1
    out, err = capsys.readouterr()
    assert "does not exist" in err and out == ""
