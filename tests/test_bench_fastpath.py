"""scripts/bench_fastpath.py on the CPU: weight conversion, prompts, floor, arguments, and a run of ours alone.

gpt-fast itself is not in the repository (CI has no copy); the tests that import it skip when .anchors/gpt-fast is
absent. The conversion is checked without it too: permuted q/k rows turn HF rotate-half RoPE into interleaved pairs.
"""
import doctest
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from workbench.models import LlamaModel, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
GPT_FAST = ROOT / ".anchors" / "gpt-fast"
_spec = importlib.util.spec_from_file_location("bench_fastpath", ROOT / "scripts" / "bench_fastpath.py")
bf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bf)
needs_gpt_fast = pytest.mark.skipif(not (GPT_FAST / "generate.py").is_file(),
                                    reason=f"gpt-fast is not checked out at {GPT_FAST} (see scripts/bench_fastpath.py)")


def small_model(tied: bool, seed: int = 0) -> LlamaModel:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=256)
    model = LlamaModel(cfg)
    model.reset_parameters(std=0.3, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def test_docstring_examples():
    assert doctest.testmod(bf).failed == 0


def rotate_half_rope(x, angles):  # x [..., D]; angles [D/2]: HF's pairs (i, i + D/2)
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], -1)


def interleaved_rope(x, angles):  # pairs (2i, 2i + 1) rotated as complex numbers
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def test_interleaved_rows_give_the_same_attention_scores():
    n_heads, d, hidden = 3, 8, 16
    g = torch.Generator().manual_seed(0)
    wq, wk = torch.randn(n_heads * d, hidden, generator=g), torch.randn(n_heads * d, hidden, generator=g)
    x = torch.randn(5, hidden, generator=g)
    angles_q, angles_k = torch.rand(d // 2, generator=g) * 6, torch.rand(d // 2, generator=g) * 6

    def scores(rope, wq, wk):  # [5, heads, 5] q.k per head with q and k at different positions
        q = rope((x @ wq.T).view(5, n_heads, d), angles_q)
        k = rope((x @ wk.T).view(5, n_heads, d), angles_k)
        return torch.einsum("shd,thd->hst", q, k)

    ours = scores(rotate_half_rope, wq, wk)
    theirs = scores(interleaved_rope, bf.interleave_rope_rows(wq, n_heads), bf.interleave_rope_rows(wk, n_heads))
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    wrong = scores(interleaved_rope, wq, wk)  # without the permutation the scores differ
    assert (wrong - ours).abs().max() > 1e-2


@pytest.mark.parametrize("tied", [True, False])
def test_state_dict_names_shapes_and_tied_head(tied):
    model = small_model(tied)
    sd = bf.gpt_fast_state_dict(model)
    layer = {k.split(".", 2)[2] for k in sd if k.startswith("layers.0.")}
    assert layer == {"attention.wqkv.weight", "attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
                     "feed_forward.w3.weight", "attention_norm.weight", "ffn_norm.weight"}
    assert set(sd) - {k for k in sd if k.startswith("layers.")} == {"tok_embeddings.weight", "norm.weight",
                                                                    "output.weight"}
    assert sd["layers.1.attention.wqkv.weight"].shape == (4 * 8 + 2 * 2 * 8, 32)
    assert torch.equal(sd["output.weight"], model.lm_head_weight)
    gate, up = model.model.layers[1].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(sd["layers.1.feed_forward.w1.weight"], gate)
    assert torch.equal(sd["layers.1.feed_forward.w3.weight"], up)
    v = model.model.layers[0].self_attn.qkv_proj.weight[-16:]
    assert torch.equal(sd["layers.0.attention.wqkv.weight"][-16:], v)  # v rows are not permuted
    args = bf.gpt_fast_args(model.config, block_size=300)
    assert (args["n_head"], args["n_local_heads"], args["head_dim"], args["block_size"]) == (4, 2, 8, 300)


def test_gpt_fast_args_refuses_what_it_cannot_represent():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      head_dim=16)
    with pytest.raises(ValueError, match="head_dim"):
        bf.gpt_fast_args(cfg, 64)


def test_prompts_and_floor():
    assert bf.equal_length_prompts([[1, 2, 3], [4], [5, 6, 7]], 3, 5) == [[1, 2, 3], [5, 6, 7]]
    with pytest.raises(ValueError, match="prompt-len"):
        bf.equal_length_prompts([[1, 2]], 3, 1)
    floor = bf.hbm_floor_ms(ModelConfig(**bf.RANDOM_CONFIGS["6.7b"]), 2, 64, 128)
    assert floor["mean_context"] == 128
    assert 3.1 < floor["floor_ms"] < 3.3  # 6.74 G params * 2 bytes + 64 MiB of KV, / 4.3 TB/s


@pytest.mark.parametrize("argv, problem", [
    (["--random-config", "1.45b", "--methods", "draft"], "no draft model"),
    (["--preset", "tiny", "--methods", "ar,tree"], "choose from"),
    (["--preset", "tiny", "--max-new-tokens", "1"], "max-new-tokens"),
    (["--preset", "tiny", "--k", "0"], "--k"),
    (["--preset", "tiny", "--random-config", "6.7b"], "not allowed"),
])
def test_bad_arguments_are_refused(argv, problem, capsys):
    with pytest.raises(SystemExit):
        bf.parse_args(argv)
    assert problem in capsys.readouterr().err


def test_fast_settings_pass_only_fields_engine_config_has():
    applied, missing = bf.fast_settings(bf.parse_args(["--preset", "tiny", "--cuda-graphs", "--compile", "default"]))
    fields = {f.name for f in bf.dataclasses.fields(bf.EngineConfig)}
    assert set(applied) <= fields and not set(missing) & fields
    assert {**applied, **missing} == {"cuda_graphs": True, "graph_batch_sizes": (1,), "compile": "default",
                                      "overlap": False}  # the engine defaults overlap on: off unless --overlap


def test_random_model_is_built_in_the_requested_dtype(monkeypatch):
    toy = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    monkeypatch.setitem(bf.RANDOM_CONFIGS, "toy", toy)
    model = bf.random_model("toy", torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    assert 0.01 < model.model.layers[0].mlp.down_proj.weight.float().std() < 0.03


def test_without_gpt_fast_ours_is_still_timed(tmp_path):
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "4", "--num-prompts", "1",
            "--repeats", "1", "--prompt-len", "16", "--gpt-fast", str(tmp_path / "none"), "--out", str(tmp_path)]
    assert bf.main(argv) == 0
    (path,) = tmp_path.glob("fastpath-tiny-*.json")
    report = json.loads(path.read_text())
    assert "no gpt-fast checkout" in report["gpt_fast"]["error"]
    for method in ("ar", "draft"):
        r = report["results"][method]["ours"]
        assert r["tok_s"]["median"] > 0 and set(report["results"][method]) == {"ours"}
    assert report["results"]["draft"]["ours"]["mean_accepted_tokens"] is not None
    assert 0 < report["results"]["ar"]["ours"]["floor_fraction"]


@needs_gpt_fast
@pytest.mark.parametrize("tied", [True, False])
def test_gpt_fast_logits_equal_ours(tied):
    model_mod, _, fixes, _ = bf.load_gpt_fast(GPT_FAST)
    assert all(f["applied"] for f in fixes)
    model = small_model(tied)
    gf = bf.to_gpt_fast(model_mod, model, block_size=64)
    gf.setup_caches(max_batch_size=1, max_seq_length=64)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = gf(ids, torch.arange(20))
        ours = model.compute_logits(model(ids, torch.arange(20)[None]))
    assert ((theirs - ours).norm() / ours.norm()) < 1e-5


@needs_gpt_fast
def test_gpt_fast_greedy_tokens_equal_ours_on_tiny(tmp_path):
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "12", "--num-prompts", "2",
            "--repeats", "1", "--gpt-fast", str(GPT_FAST), "--out", str(tmp_path)]
    assert bf.main(argv) == 0
    report = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert "error" not in report["gpt_fast"]
    for method in ("ar", "draft"):
        assert report["parity"][f"{method}: ours vs gpt_fast"]["equal"] == 2
    ours, theirs = report["results"]["draft"]["ours"], report["results"]["draft"]["gpt_fast"]
    assert ours["mean_accepted_tokens"] == pytest.approx(theirs["mean_accepted_tokens"])
