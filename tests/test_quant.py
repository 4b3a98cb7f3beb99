"""Weight formats (workbench.engine.quant): each kernel against its dequantized reference with a stated bound, AWQ's
folding, greedy conformance of drafters over quantized targets (against the same quantized target's AR decode),
named errors before any work, and the quality columns of a run record."""
import copy

import pytest
import torch

from tests.test_engine import PROMPTS, random_model, reference_greedy
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DraftModelDrafter, NgramDrafter
from workbench.engine.quant import (Fp8Linear, Int4Linear, Int8Linear, QuantError, check_quant, dequantize_fp8,
                                    dequantize_int4, dequantize_int8, fold_norms, fp8_linear_reference, head_quantized,
                                    norms_folded, quantize_fp8, quantize_int4, quantize_int8, quantize_model,
                                    weight_bytes)
from workbench.engine.quant.awq import apply_awq, search_scale


def _linear(k=128, n=96, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin.requires_grad_(False)


def _x(m=5, k=128, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


# ---- round trips: |w - dequantize(quantize(w))| ------------------------------------------------------------------
def test_int8_round_trip_is_within_half_a_step():
    w = _linear().weight
    q, scale = quantize_int8(w, torch.float32)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (w - dequantize_int8(q, scale)).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()  # bound: half a quantization step per element


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_is_within_half_a_step_per_group(group):
    w = _linear().weight
    q, scale, zero = quantize_int4(w, group, torch.float32)
    assert 0 <= int(q.min()) and int(q.max()) <= 15 and scale.shape == (96, 128 // group)
    err = (w - dequantize_int4(q, scale, zero)).abs().reshape(96, -1, group)
    assert (err <= scale[..., None] / 2 + 1e-6).all()


def test_fp8_round_trip_has_e4m3_relative_error():
    w = _linear().weight
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn
    err = (w - dequantize_fp8(q, scale)).abs()
    # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4; below the smallest normal (2^-6) steps of 2^-9 scaled
    assert (err <= 2 ** -4 * w.abs() + 2 ** -10 * scale[:, None] + 1e-9).all()


# ---- each module against x @ dequantized.T ----------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["aten", "dequant"])
@pytest.mark.parametrize("make", [lambda lin, kernel: Int8Linear(lin, kernel),
                                  lambda lin, kernel: Int4Linear(lin, 32, kernel),
                                  lambda lin, kernel: Int4Linear(lin, 128, kernel)], ids=["int8", "int4-g32", "int4-g128"])
def test_weight_only_linear_equals_the_dequantized_reference(make, kernel):
    lin = _linear(bias=True)
    mod = make(lin, kernel)
    for m in (1, 5, 64):
        x = _x(m)
        ref = x @ mod.dequantized_weight().T + lin.bias
        # fp32 in, fp32 accumulate: only summation order differs (bound 1e-5 relative to the output scale)
        assert torch.allclose(mod(x), ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    x3 = _x(6).reshape(2, 3, 128)
    assert mod(x3).shape == (2, 3, 96)


def test_int4_dequantized_weight_is_the_quantizer_output():
    """The module's own unpacking (through the kernel) gives back exactly (q - 8) * scale + zero."""
    lin = _linear()
    q, scale, zero = quantize_int4(lin.weight, 32, torch.float32)
    for kernel in ("aten", "dequant"):
        assert torch.allclose(Int4Linear(lin, 32, kernel).dequantized_weight(), dequantize_int4(q, scale, zero),
                              atol=1e-7, rtol=0)


def test_int8_aten_kernel_in_bfloat16_follows_the_reference():
    lin = _linear().to(torch.bfloat16)
    mod = Int8Linear(lin, "aten")
    x = _x(4).to(torch.bfloat16)
    ref = x.float() @ mod.dequantized_weight().T
    assert torch.allclose(mod(x).float(), ref, atol=2 ** -7 * float(ref.abs().max()), rtol=0)  # bf16 output rounding


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="torch._scaled_mm missing")
def test_fp8_linear_equals_its_reference_math():
    """The module's _scaled_mm path, run through this torch's CPU _scaled_mm where it has one (the engine refuses fp8
    on a CPU; the GPU runs the same call on cuBLASLt: test_fp8_linear_on_a_gpu)."""
    lin = _linear(bias=True)
    mod = Fp8Linear(lin)
    x = _x(5)
    try:
        out = mod(x)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"no CPU _scaled_mm for these operands: {e}")
    ref = fp8_linear_reference(x, mod.weight, mod.scale[0], lin.bias)
    assert torch.allclose(out, ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    exact = x @ lin.weight.T + lin.bias  # and the fp8 error against the unquantized linear stays small
    assert float((out - exact).abs().max()) <= 0.1 * float(exact.abs().max())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU of compute capability >= 8.9 (fp8 _scaled_mm)")
def test_fp8_linear_on_a_gpu():
    lin = _linear(k=256, n=128).cuda().to(torch.bfloat16)
    mod = Fp8Linear(lin)
    x = _x(3, 256).cuda().to(torch.bfloat16)
    ref = fp8_linear_reference(x, mod.weight, mod.scale[0]).float()
    assert torch.allclose(mod(x).float(), ref, atol=2 ** -6 * float(ref.abs().max()), rtol=0)


# ---- AWQ -------------------------------------------------------------------------------------------------------
def test_awq_folding_leaves_the_float_model_unchanged():
    """Scales folded into norms / v rows / up rows are exact in float: outputs equal before any rounding."""
    model = random_model(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, std=0.1)
    folded = copy.deepcopy(model)
    calib = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    alphas = apply_awq(folded, calib, group_size=32)
    assert set(alphas) == {f"{i}.{n}" for i in range(2) for n in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                                   "mlp.gate_up_proj", "mlp.down_proj")}
    ids = torch.tensor([PROMPTS[2]])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        assert torch.allclose(folded(ids, pos), model(ids, pos), atol=1e-4)


def test_folding_the_norms_leaves_the_float_model_unchanged():
    """fold_norms: each layer's two RMSNorm weights (made far from ones here) multiplied into q/k/v's and gate/up's
    columns, the norms then all ones: the same function in float."""
    model = random_model(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, std=0.1)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.2, 3.0)
    folded = fold_norms(copy.deepcopy(model))
    for layer in folded.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    ids = torch.tensor([PROMPTS[2]])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        assert torch.allclose(folded(ids, pos), model(ids, pos), atol=1e-4)


@pytest.mark.parametrize("fmt, folded", [("int4", True), ("int4-awq", False), ("int8", False)])
def test_int4_quantizes_with_the_norms_folded_and_marks_the_linears_after_them(fmt, folded):
    """quantize_model("int4") folds: the norms are ones, q/k/v and gate/up say so (norm_unit, which the CUDA GEMV's
    norm prologue acts on) and the int4 weight is W diag(w)'s; int4-awq (whose scales live in the norms) and the
    other formats leave the norms as loaded."""
    model = random_model(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, std=0.1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 2.0)
    calib = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    q = quantize_model(model, fmt, group_size=32, kernel="dequant", calibration=calib if fmt == "int4-awq" else None)
    assert norms_folded(q) is folded
    layer, src = q.model.layers[0], model.model.layers[0]
    assert layer.self_attn.qkv_proj.norm_unit is folded and layer.mlp.gate_up_proj.norm_unit is folded
    assert not layer.self_attn.o_proj.norm_unit and not layer.mlp.down_proj.norm_unit
    assert torch.equal(layer.input_layernorm.weight, torch.ones(64)) is folded
    if fmt == "int4":
        w = src.self_attn.qkv_proj.weight * (src.input_layernorm.weight if folded else 1)
        assert torch.allclose(layer.self_attn.qkv_proj.dequantized_weight(),
                              dequantize_int4(*quantize_int4(w, 32, torch.float32)), atol=1e-7, rtol=0)
    assert not torch.equal(src.input_layernorm.weight, torch.ones(64))  # the copy was folded, not the model


def test_awq_scale_search_is_never_worse_than_plain_int4_on_its_calibration_rows():
    lin = _linear(k=128, n=64)
    x = _x(64) * torch.linspace(0.05, 4.0, 128)  # a few loud channels, as in real activations
    s, alpha = search_scale(lin.weight, x, x.abs().mean(0), 32)
    plain = dequantize_int4(*quantize_int4(lin.weight, 32, torch.float32))
    awq = dequantize_int4(*quantize_int4(lin.weight * s, 32, torch.float32))
    ref = x @ lin.weight.T
    err_plain = float(((x @ plain.T) - ref).pow(2).mean())
    err_awq = float(((x / s) @ awq.T - ref).pow(2).mean())
    assert err_awq <= err_plain and 0.0 <= alpha <= 1.0


# ---- conformance: drafters over a quantized target ---------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    target = random_model(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, seed=1, std=0.3)
    draft = random_model(vocab=64, hidden=32, layers=1, heads=2, kv_heads=1, seed=2)
    return target, draft


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("drafter", ["ar", "draft", "ngram", "quantized-draft"])
@pytest.mark.parametrize("fmt,kernel", [("int8", "aten"), ("int8", "dequant"), ("int4", "aten"), ("int4", "dequant")])
def test_greedy_output_equals_the_quantized_targets_own_decode(fmt, kernel, drafter, fixed, models):
    target, draft = models
    qtarget = quantize_model(target, fmt, group_size=32, kernel=kernel)
    assert qtarget is not target and isinstance(qtarget.model.layers[0].mlp.down_proj, (Int8Linear, Int4Linear))
    make = {"ar": lambda: None, "draft": lambda: DraftModelDrafter(draft, k=3),
            "ngram": lambda: NgramDrafter(k=3, min_n=1, max_n=3),
            "quantized-draft": lambda: DraftModelDrafter(quantize_model(draft, "int8", kernel=kernel), k=3)}[drafter]
    n = 12
    cfg = (EngineConfig(max_new_tokens=n, cuda_graphs=True, graph_batch_sizes=(1, 4), kv_block_size=4) if fixed
           else EngineConfig(max_new_tokens=n, kv_block_size=4))
    out = SpecEngine(qtarget, make(), cfg).generate(PROMPTS).outputs
    assert out == [reference_greedy(qtarget, p, n) for p in PROMPTS]


def test_compiled_step_over_an_int4_target_equals_its_decode(models):
    """torch.compile (inductor) over the fixed-shape step with the packed int4 op inside."""
    qtarget = quantize_model(models[0], "int4", group_size=32, kernel="aten")
    n = 6
    engine = SpecEngine(qtarget, NgramDrafter(k=3, min_n=1, max_n=3),
                        EngineConfig(max_new_tokens=n, compile="default", graph_batch_sizes=(4,), kv_block_size=4))
    assert engine.generate(PROMPTS).outputs == [reference_greedy(qtarget, p, n) for p in PROMPTS]


def test_quantized_models_are_smaller_and_keep_head_and_embeddings(models):
    target = models[0]
    full = weight_bytes(target)
    sizes = {fmt: weight_bytes(quantize_model(target, fmt, group_size=32, kernel="aten")) for fmt in ("int8", "int4")}
    assert sizes["int4"] < sizes["int8"] < full
    q = quantize_model(target, "int8")
    assert q.model.embed_tokens.weight.dtype == torch.float32 and q.model.embed_tokens is not target.model.embed_tokens
    assert isinstance(target.model.layers[0].self_attn.qkv_proj, torch.nn.Linear)  # the original is untouched


@pytest.mark.parametrize("fmt,kernel", [("int8", "dequant"), ("int4", "dequant"), ("int4", "aten")])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_quantized_head_computes_the_logits_of_its_dequantized_weight(fmt, kernel, tied):
    """head=True: logits come from the head in the format (against hidden @ dequantized.T, fp32: summation order
    only); a tied head gets its own module and the embedding stays the float one; without head the logits are the
    float head's exactly."""
    target = random_model(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, seed=1, std=0.3)
    if tied:  # the same weights with the head tied to the embedding
        from dataclasses import replace

        from workbench.models import LlamaModel

        tied_model = LlamaModel(replace(target.config, tie_word_embeddings=True), init_weights=False)
        tied_model.load_state_dict(target.state_dict(), strict=False)
        target = tied_model.eval()
    qmodel = quantize_model(target, fmt, group_size=32, kernel=kernel, head=True)
    head = qmodel.lm_head
    assert isinstance(head, (Int8Linear, Int4Linear)) and head_quantized(qmodel) is True
    assert torch.equal(qmodel.model.embed_tokens.weight, target.model.embed_tokens.weight)  # float, unchanged
    assert target.lm_head is None if tied else isinstance(target.lm_head, torch.nn.Linear)  # the original untouched
    hidden = _x(5, 64)
    ref = hidden @ head.dequantized_weight().T
    got = qmodel.compute_logits(hidden)
    assert torch.allclose(got, ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    float_logits = hidden @ target.lm_head_weight.T
    assert not torch.equal(got, float_logits)  # the head's rounding shows: the check above is not of the float head
    unquantized_head = quantize_model(target, fmt, group_size=32, kernel=kernel)
    assert unquantized_head.lm_head is target.lm_head or isinstance(unquantized_head.lm_head, torch.nn.Linear)
    assert torch.equal(unquantized_head.compute_logits(hidden), float_logits)
    assert weight_bytes(qmodel) < weight_bytes(unquantized_head) or tied  # tied: a copy beside the embedding


@pytest.mark.parametrize("drafter", ["ar", "ngram", "draft"])
def test_greedy_output_with_a_quantized_head_equals_that_models_own_decode(drafter, models):
    target, draft = models
    qtarget = quantize_model(target, "int4", group_size=32, kernel="dequant", head=True)
    make = {"ar": lambda: None, "ngram": lambda: NgramDrafter(k=3, min_n=1, max_n=3),
            "draft": lambda: DraftModelDrafter(quantize_model(draft, "int8", kernel="dequant", head=True), k=3)}
    n = 12
    out = SpecEngine(qtarget, make[drafter](), EngineConfig(max_new_tokens=n, kv_block_size=4)).generate(PROMPTS)
    assert out.outputs == [reference_greedy(qtarget, p, n) for p in PROMPTS]


def test_gguf_note_says_which_stored_types_map_to_ours():
    from workbench.engine.quant import gguf_note

    assert gguf_note(None, "int4") is None
    assert gguf_note({"F32": 3, "F16": 7}, "none") == "GGUF tensors F16 x7, F32 x3: float, loaded as they are"
    note = gguf_note({"Q4_0": 10, "F32": 3}, "int4")
    assert "dequantized to float on load, then weight format 'int4' applied" in note
    assert "Q4_0 -> int4 (group 32) would be exact: weight format 'gguf' keeps them packed" in note
    assert "has an exact counterpart" in gguf_note({"Q4_K": 10}, "int8")


# ---- named errors before any work --------------------------------------------------------------------------------
def test_bad_formats_are_named_errors(models):
    cfg = models[0].config
    with pytest.raises(QuantError, match="target_quant=fp8 needs a CUDA GPU with FP8 tensor cores.*use int8 or int4"):
        check_quant("fp8", cfg, "cpu", torch.float32)
    with pytest.raises(QuantError, match="'int3' is not a weight format the engine has; choose one of none, int8"):
        check_quant("int3", cfg, "cpu", torch.float32)
    with pytest.raises(QuantError, match=r"int4 group size 128 does not divide the draft model's .*input width 64.*"
                                         r"use --int4-group-size 64"):
        check_quant("int4", cfg, "cpu", torch.float32, group_size=128, role="draft")
    with pytest.raises(QuantError, match="int4_group_size=48 is not one the int4 kernels take"):
        check_quant("int4", cfg, "cpu", torch.float32, group_size=48)
    with pytest.raises(QuantError, match="unknown weight format 'int2'"):
        quantize_model(models[0], "int2")
    with pytest.raises(QuantError, match="int4-awq needs calibration token ids"):
        quantize_model(models[0], "int4-awq")
    with pytest.raises(QuantError, match="quant_head=True quantizes the LM head.*target_quant=gguf keeps a file's own"
                                         ".*set quant_head False"):
        check_quant("gguf", cfg, "cpu", torch.float32, head=True, source="m.gguf")
    from dataclasses import replace

    wide = replace(cfg, vocab_size=100)  # the head's output width: fine for int4 on a CPU; CUDA's int4 needs N % 8
    check_quant("int4", wide, "cpu", torch.float32, group_size=32, head=True)
    check_quant("none", wide, "cpu", torch.float32, head=True)  # no-op without a format


# ---- the harness: quality columns on the tiny preset -------------------------------------------------------------
@pytest.fixture(scope="module")
def session():
    from workbench.harness.bench import BenchSession

    return BenchSession.load(preset="tiny", device="cpu")


def _cfg(**kw):
    from workbench.harness.bench import BenchConfig

    base = dict(method="draft", k=3, batch=2, max_new_tokens=12, num_prompts=4, warmup=0, repeats=1,
                int4_group_size=32)
    base.update(kw)
    return BenchConfig(**base)


@pytest.mark.parametrize("change,message", [
    (dict(target_quant="fp8"), "target_quant=fp8 needs a CUDA GPU"),
    (dict(draft_quant="int4", int4_group_size=128), "int4 group size 128 does not divide the draft model's"),
    (dict(target_quant="int3"), "target_quant='int3' is not supported by the engine; allowed: 'none', 'int8'"),
    (dict(int4_group_size=100), "int4_group_size=100 is not supported by the engine; allowed: 32, 64, 128, 256"),
])
def test_bench_refuses_bad_formats_before_any_work(session, change, message):
    from workbench.harness.bench import BenchError

    with pytest.raises(BenchError, match=message):
        session.run(_cfg(**change))
    assert not session._quantized  # nothing was quantized (no work started)


def test_quality_columns_of_quantized_and_reference_runs(session):
    from results.schema import record_to_table, run_specs

    ref = session.run(_cfg()).record
    assert ref["quant_ppl_delta_pct"] == 0.0 and ref["quant_token_agreement"] == 1.0
    assert ref["quant_acceptance_ref"] == ref["acceptance_rate"] and ref["quant_acceptance_delta"] == 0.0
    assert 1.0 < ref["quant_ppl"] == ref["quant_ppl_ref"] < 100.0  # tiny: held-out perplexity 6-12 on its prompts
    rec = session.run(_cfg(target_quant="int4", draft_quant="int8")).record
    assert rec["target_quant"] == "int4" and rec["draft_quant"] == "int8" and rec["int4_group_size"] == 32
    assert rec["greedy_matches_ar"] is True  # fidelity against the same quantized target stays exact
    assert rec["quant_ppl_ref"] == ref["quant_ppl_ref"] and rec["quant_ppl"] != rec["quant_ppl_ref"]
    assert -5.0 < rec["quant_ppl_delta_pct"] < 25.0  # int4 g32 on a 5 M model: measured +2.5 % (+3.4 % folded)
    assert "int4 target: RMSNorm weights folded" in rec["quant_note"]  # int4 folds its norms, the int8 draft not
    assert 0.5 < rec["quant_token_agreement"] <= 1.0 and 0.0 <= rec["quant_sequences_identical"] <= 1.0
    assert rec["quant_acceptance_ref"] == pytest.approx(ref["acceptance_rate"])  # same settings, reference models
    assert rec["quant_acceptance_delta"] == pytest.approx(rec["acceptance_rate"] - ref["acceptance_rate"])
    assert rec["quant_within_bound"] is (rec["quant_ppl_delta_pct"] <= 2.0)
    assert rec["target_weight_mb"] < ref["target_weight_mb"] and rec["draft_weight_mb"] < ref["draft_weight_mb"]
    assert "perplexity over" in rec["quant_note"]
    kinds = run_specs()
    for name in [c for c in rec if c.startswith("quant_")] + ["target_weight_mb", "draft_weight_mb"]:
        assert name in kinds, name  # every quality column is declared in results.schema
    record_to_table(rec)  # and the row is storable


def test_gemv_fusion_reaches_every_quantized_linear_and_keeps_a_model_per_fusion(session):
    """The gemv_fusion knob sets `fusion` on every quantized linear of the run's model (target and draft); each fusion
    gets its own quantized copy, so an engine cached with another fusion keeps its modules; the record carries it."""
    from workbench.engine.quant import QuantLinear
    from workbench.harness.quality import quantized_model

    cfg = _cfg(target_quant="int8", draft_quant="int8", gemv_fusion="glu+residual+ores")
    target, draft = quantized_model(session, "target", cfg), quantized_model(session, "draft", cfg)
    for model in (target, draft):
        fused = [m.fusion for m in model.modules() if isinstance(m, QuantLinear)]
        assert fused and set(fused) == {"glu+residual+ores"}
    plain = quantized_model(session, "target", _cfg(target_quant="int8"))
    assert plain is not target and {m.fusion for m in plain.modules() if isinstance(m, QuantLinear)} == {"residual"}
    assert quantized_model(session, "target", cfg) is target  # kept, not made again
    rec = session.run(cfg).record
    assert rec["gemv_fusion"] == "glu+residual+ores" and rec["greedy_matches_ar"] is True


def test_quant_head_runs_record_it_and_measure_its_own_quality(session):
    """quant_head makes a distinct quantized model (cached apart from the float-head one), recorded in the row; its
    perplexity is measured on that model (not the float-head one's cached value), and greedy parity stays exact."""
    from workbench.harness.quality import quantized_model

    cfg = _cfg(target_quant="int4", draft_quant="int8", quant_head=True)
    with_head, plain = quantized_model(session, "target", cfg), quantized_model(session, "target", _cfg(
        target_quant="int4"))
    assert with_head is not plain and head_quantized(with_head) and not head_quantized(plain)
    assert head_quantized(quantized_model(session, "draft", cfg))  # the draft's head in its own format
    rec, ref = session.run(cfg).record, session.run(_cfg(target_quant="int4", draft_quant="int8")).record
    assert rec["quant_head"] is True and ref["quant_head"] is False
    assert rec["greedy_matches_ar"] is True and rec["quant_ppl"] != ref["quant_ppl"]
    assert rec["target_weight_mb"] > ref["target_weight_mb"]  # tiny's head is tied: its int4 copy adds bytes
    none = session.run(_cfg(quant_head=True)).record  # no format: nothing to quantize, the reference itself
    assert none["quant_ppl_delta_pct"] == 0.0


def test_awq_run_uses_training_split_calibration(session):
    rec = session.run(_cfg(method="ngram", target_quant="int4-awq")).record
    assert "calibration: " in rec["quant_note"] and "training-split stdlib files" in rec["quant_note"]
    plain = session.run(_cfg(method="ngram", target_quant="int4")).record
    assert rec["quant_ppl_ref"] == plain["quant_ppl_ref"]
    assert rec["greedy_matches_ar"] is True and plain["greedy_matches_ar"] is True


def test_auto_kernel_follows_the_measured_choice():
    """quant_kernel "auto": Triton GEMVs for int8 / fp8 and int4 in groups of 64+ on a GPU where Triton runs, tinygemm
    for int4 in groups of 32 (doctest)."""
    import doctest

    from workbench.engine import quant

    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(quant.auto_kernel, "auto_kernel", globs={"auto_kernel": quant.auto_kernel}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries == 3


def test_kernel_tuning_text_round_trips_and_names_a_bad_field_or_value():
    """KernelTuning (kernels/tuning.py) reads "field=value,..." ("" = the defaults), writes every field back, and a
    typo in a field or a value is a named error, not a silent fallback to another path."""
    from kernels.tuning import FIELDS, KernelTuning, KernelTuningError, format_tuning, parse_tuning

    assert parse_tuning("") == KernelTuning() and parse_tuning(" ") == KernelTuning()
    t = parse_tuning("int4_prefill_gemm_rows=128, int4_cuda=0, int4_half2=auto")
    assert (t.int4_prefill_gemm_rows, t.int4_cuda, t.int4_half2, t.int4_mma_rows) == (128, False, None, 16)
    text = format_tuning(t)
    assert [part.split("=")[0] for part in text.split(",")] == list(FIELDS) and parse_tuning(text) == t
    with pytest.raises(KernelTuningError, match="unknown kernel tuning field 'int4_mma_row'; the fields are"):
        parse_tuning("int4_mma_row=8")
    for bad, match in (("int4_mma_rows=17", "int4_mma_rows=17: give a whole number of rows from 0"),
                       ("int4_prefill_gemm_rows=-1", "int4_prefill_gemm_rows=-1"),
                       ("int4_prefill_gemm_rows=64.5", "int4_prefill_gemm_rows='64.5': give a whole number"),
                       ("int4_cuda=yes", "int4_cuda='yes': give 1 .on. or 0 .off."),
                       ("int4_half2=3", "int4_half2=3: give auto"),
                       ("int4_cuda", "write field=value"),
                       ("int4_cuda=1,int4_cuda=0", "given twice")):
        with pytest.raises(KernelTuningError, match=match):
            parse_tuning(bad)
