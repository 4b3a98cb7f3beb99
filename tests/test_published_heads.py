"""Published draft-head checkpoints (workbench/engine/drafters/published.py): folders written here tensor by tensor in
the EAGLE-1/2 and EAGLE-3 layouts (key names, shapes, dtypes as the published heads and vLLM's loaders have them)
load onto our heads, compute what the published model computes (a from-the-tensors reference), keep greedy output
equal to AR, are refused by name when they do not fit the target, and our heads exported in those layouts load back
drafting identically."""
import json

import pytest
import torch
import torch.nn.functional as F

from tests.test_engine import PROMPTS, random_model, reference_greedy
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DrafterError, Eagle3Drafter, Eagle3Head, EagleDrafter, EagleHead, engine_target
from workbench.engine.drafters.eagle3 import with_aux_hidden
from workbench.engine.drafters.published import (HeadCheckpointError, export_published_head, load_published_head,
                                                 read_checkpoint)

LAYERS = 6  # aux layers by the default rule: 1, 3, 5


@pytest.fixture(scope="module")
def target():
    return random_model(layers=LAYERS, seed=1)


def _rand(g, *shape, std=0.3):
    return torch.randn(*shape, generator=g) * std


def _attn_mlp(g, prefix, in_width, target):
    c = target.config
    h, heads, kv_heads, d, inter = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                    c.intermediate_size)
    return {f"{prefix}self_attn.q_proj.weight": _rand(g, heads * d, in_width),
            f"{prefix}self_attn.k_proj.weight": _rand(g, kv_heads * d, in_width),
            f"{prefix}self_attn.v_proj.weight": _rand(g, kv_heads * d, in_width),
            f"{prefix}self_attn.o_proj.weight": _rand(g, h, heads * d),
            f"{prefix}mlp.gate_proj.weight": _rand(g, inter, h), f"{prefix}mlp.up_proj.weight": _rand(g, inter, h),
            f"{prefix}mlp.down_proj.weight": _rand(g, h, inter),
            f"{prefix}post_attention_layernorm.weight": 1 + _rand(g, h, std=0.1)}


def llama_config(target, **extra):
    c = target.config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
            "vocab_size": c.vocab_size, "max_position_embeddings": 2048, "rope_theta": c.rope_theta,
            "torch_dtype": "float16", **extra}


def write_eagle1(folder, target, seed=0, dtype=torch.float16, bin_file=True, drop=(), **config):
    """An EAGLE-1/2 checkpoint as SafeAILab's code saves it: pytorch_model.bin in float16, fc with a bias, layer 0
    without input_layernorm, a copy of the target's embedding."""
    g = torch.Generator().manual_seed(seed)
    h = target.config.hidden_size
    w = {"fc.weight": _rand(g, h, 2 * h), "fc.bias": _rand(g, h, std=0.05),
         **_attn_mlp(g, "layers.0.", h, target), "embed_tokens.weight": target.model.embed_tokens.weight.detach().clone()}
    w = {k: v.to(dtype) for k, v in w.items() if k not in drop}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(llama_config(target, bias=True, **config)))
    if bin_file:
        torch.save(w, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file
        save_file(w, str(folder / "model.safetensors"))
    return w


def write_eagle3(folder, target, draft_ids, seed=0, dtype=torch.bfloat16, drop=(), **config):
    """An EAGLE-3 checkpoint as the published ones are: model.safetensors in bfloat16, midlayer.* with q/k/v over 2H,
    its own norm and lm_head over the draft vocabulary, d2t int64 offsets and t2d bool."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, v = target.config.hidden_size, target.config.vocab_size
    ids = torch.tensor(sorted(draft_ids))
    w = {"fc.weight": _rand(g, h, 3 * h), "midlayer.input_layernorm.weight": 1 + _rand(g, h, std=0.1),
         "midlayer.hidden_norm.weight": 1 + _rand(g, h, std=0.1), **_attn_mlp(g, "midlayer.", 2 * h, target),
         "norm.weight": 1 + _rand(g, h, std=0.1), "lm_head.weight": _rand(g, len(ids), h, std=1.0)}
    w = {k: x.to(dtype) for k, x in w.items()}
    w["d2t"] = ids - torch.arange(len(ids))
    w["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True)
    w = {k: x for k, x in w.items() if k not in drop}
    folder.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(ids),
                       torch_dtype="bfloat16")
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(folder / "model.safetensors"))
    return w


# ---- a from-the-tensors reference of the published heads (plain torch, causal over one sequence) ------------------
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [T, heads, D], HF rotate_half convention
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(w, p, u, pos, target):
    c = target.config
    t = u.shape[0]
    q = (u @ w[p + "self_attn.q_proj.weight"].T).view(t, c.num_attention_heads, c.head_dim)
    k = (u @ w[p + "self_attn.k_proj.weight"].T).view(t, c.num_key_value_heads, c.head_dim)
    v = (u @ w[p + "self_attn.v_proj.weight"].T).view(t, c.num_key_value_heads, c.head_dim)
    q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
    rep = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return o.transpose(0, 1).reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T


def _mlp(w, p, x):
    return (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ \
        w[p + "mlp.down_proj.weight"].T


def published_eagle1(w, target, hidden, tokens):
    """cnets.py's head: fc(cat(embed, hidden)), layer 0 without input norm, output straight to the LM head (the
    embedding is the target's, as vLLM shares it; the checkpoint's copy is a float16 rounding of it)."""
    w = {k: v.float() for k, v in w.items()}
    eps = target.config.rms_norm_eps
    x = torch.cat([target.model.embed_tokens.weight.detach()[tokens], hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
    x = x + _attention(w, "layers.0.", x, torch.arange(len(tokens)), target)
    return x + _mlp(w, "layers.0.", _rms(x, w["layers.0.post_attention_layernorm.weight"], eps))


def published_eagle3(w, target, aux, tokens, norm_before_residual=False):
    """vLLM's Eagle3 head: g = fc(aux); attention over [input_norm(embed); hidden_norm(g)] with residual g (or
    hidden_norm(g) with norm_before_residual); MLP; logits = lm_head(norm(.)) over the draft vocabulary, placed at
    draft id + d2t."""
    w = {k: (v.float() if v.is_floating_point() else v) for k, v in w.items()}
    eps = target.config.rms_norm_eps
    emb = target.model.embed_tokens.weight.detach()[tokens]
    g = aux @ w["fc.weight"].T
    u = torch.cat([_rms(emb, w["midlayer.input_layernorm.weight"], eps), _rms(g, w["midlayer.hidden_norm.weight"], eps)],
                  -1)
    residual = _rms(g, w["midlayer.hidden_norm.weight"], eps) if norm_before_residual else g
    y = residual + _attention(w, "midlayer.", u, torch.arange(len(tokens)), target)
    f = y + _mlp(w, "midlayer.", _rms(y, w["midlayer.post_attention_layernorm.weight"], eps))
    logits = _rms(f, w["norm.weight"], eps) @ w["lm_head.weight"].T
    full = torch.full((len(tokens), target.config.vocab_size), float("-inf"))
    full[:, torch.arange(len(w["d2t"])) + w["d2t"]] = logits
    return f, full


def aux_states(target, ids, layers):
    """The residual stream entering each of `layers`, layer by layer through the target's own modules."""
    from workbench.models import CausalAttention

    x = target.model.embed_tokens(ids)
    cos, sin = target.rope_tables(x.device, x.dtype)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    out = []
    for i, layer in enumerate(target.model.layers):
        if i in layers:
            out.append(x)
        x = layer(x, cos[pos].unsqueeze(2), sin[pos].unsqueeze(2), CausalAttention())
    return torch.cat(out, -1)


# ---- EAGLE-1/2 ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_eagle1_checkpoint_computes_the_published_head(target, tmp_path):
    w = write_eagle1(tmp_path / "e1", target, seed=3)
    loaded = load_published_head(tmp_path / "e1", target)
    head = loaded.head
    assert isinstance(head, EagleHead) and head.config.style == "eagle" and head.config.fc_bias
    assert (loaded.layout, loaded.stored_dtype) == ("eagle", "float16")
    assert loaded.num_parameters == sum(v.numel() for k, v in w.items() if k != "embed_tokens.weight")
    ids = torch.tensor([PROMPTS[2]])
    hidden = target(ids, torch.arange(ids.shape[1]).unsqueeze(0))
    tokens = torch.tensor(PROMPTS[2][1:] + [4])
    ours = head(target, hidden, tokens.unsqueeze(0), torch.arange(len(tokens)).unsqueeze(0))[0]
    torch.testing.assert_close(ours, published_eagle1(w, target, hidden[0], tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bin_file", [True, False], ids=["pytorch_model.bin", "safetensors"])
def test_eagle1_checkpoint_keeps_greedy_output_exact(bin_file, target, tmp_path):
    write_eagle1(tmp_path / "e1", target, seed=4, bin_file=bin_file, drop=("embed_tokens.weight",))
    head = load_published_head(tmp_path / "e1", target).head
    engine = SpecEngine(target, EagleDrafter(head, target, 3, 3, 8), EngineConfig(max_new_tokens=16, kv_block_size=4))
    assert engine.generate(PROMPTS).outputs == [reference_greedy(target, p, 16) for p in PROMPTS]


# ---- EAGLE-3 ------------------------------------------------------------------------------------------------------
DRAFT_IDS = [0, 2, 3, 5, 7, 9, 11, 13, 17, 19, 23, 29, 30, 31, 40, 63]


@pytest.mark.parametrize("norm_before_residual", [False, True])
@torch.no_grad()
def test_eagle3_checkpoint_computes_the_published_head(norm_before_residual, target, tmp_path):
    w = write_eagle3(tmp_path / "e3", target, DRAFT_IDS, seed=5, norm_before_residual=norm_before_residual)
    loaded = load_published_head(tmp_path / "e3", target)
    assert loaded.head.config.norm_before_residual is norm_before_residual
    head = loaded.head
    assert isinstance(head, Eagle3Head) and (loaded.layout, loaded.stored_dtype) == ("eagle3", "bfloat16")
    assert head.config.aux_layers == (1, 3, 5) and head.config.draft_vocab_size == len(DRAFT_IDS)
    ids = torch.tensor([PROMPTS[2]])
    view = with_aux_hidden(target, head.config.aux_layers)
    hidden = view(ids, torch.arange(ids.shape[1]).unsqueeze(0))  # [1, T, H + 3H]
    h = target.config.hidden_size
    torch.testing.assert_close(hidden[..., :h], target(ids, torch.arange(ids.shape[1]).unsqueeze(0)))
    torch.testing.assert_close(hidden[..., h:], aux_states(target, ids, (1, 3, 5)))
    tokens = torch.tensor(PROMPTS[2][1:] + [4])
    f = head(target, hidden, tokens.unsqueeze(0), torch.arange(len(tokens)).unsqueeze(0))[0]
    ref_f, ref_logits = published_eagle3(w, target, hidden[0, :, h:], tokens, norm_before_residual)
    torch.testing.assert_close(f, ref_f, rtol=1e-4, atol=1e-4)
    logp = head.draft_log_probs(f)
    torch.testing.assert_close(logp, torch.log_softmax(ref_logits, -1), rtol=1e-4, atol=1e-4)
    assert torch.isinf(logp[:, [i for i in range(64) if i not in DRAFT_IDS]]).all()


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "fixed-shape"])
def test_eagle3_checkpoint_keeps_greedy_output_exact_and_drafts_only_its_vocabulary(cuda_graphs, target, tmp_path):
    write_eagle3(tmp_path / "e3", target, DRAFT_IDS, seed=6)
    head = load_published_head(tmp_path / "e3", target).head
    drafted = []

    class Recording(Eagle3Drafter):
        def propose(self, state):
            tree = super().propose(state)
            drafted.extend(tree.token_ids.flatten().tolist())
            return tree

    drafter = Recording(head, target, 3, 3, 8)
    engine = SpecEngine(engine_target(target, drafter), drafter, EngineConfig(
        max_new_tokens=16, kv_block_size=4, cuda_graphs=cuda_graphs, graph_batch_sizes=(1, 2, 4)))
    assert engine.generate(PROMPTS).outputs == [reference_greedy(target, p, 16) for p in PROMPTS]
    assert drafted and set(drafted) <= set(DRAFT_IDS)


def test_d2t_maps_draft_ids_to_target_ids_by_offset(target):
    """Hand case: draft ids 0..3 with d2t [0, 0, 3, 5] are target ids 0, 1, 5, 8; set_draft_vocab builds the same
    d2t (and t2d) from the target ids in any order; a draft token's log-prob lands at its target id."""
    head = Eagle3Head.for_target(target, seed=1, draft_tokens=torch.tensor([8, 0, 5, 1]))
    assert head.d2t.tolist() == [0, 0, 3, 5] and head.draft_to_target.tolist() == [0, 1, 5, 8]
    assert head.t2d.nonzero().flatten().tolist() == [0, 1, 5, 8] and head.t2d.shape == (64,)
    with torch.no_grad():
        head.lm_head.weight.zero_()
        head.lm_head.weight[2, 0] = 50.0  # draft id 2 wins wherever feature 0 is large
        f = torch.zeros(1, 32)
        f[0, 0] = 1.0
        logp = head.draft_log_probs(f)
    assert int(logp.argmax()) == 5 and torch.isinf(logp[0, [2, 3, 4, 6, 7, 9]]).all()
    assert torch.isfinite(logp[0, [0, 1, 5, 8]]).all()
    with pytest.raises(ValueError, match="two draft ids map to the same target id"):
        head.set_draft_vocab(torch.tensor([1, 1, 5, 8]))
    with pytest.raises(ValueError, match="outside the target vocabulary 0..63"):
        head.set_draft_vocab(torch.tensor([1, 2, 5, 64]))


# ---- named errors -------------------------------------------------------------------------------------------------
def test_checkpoints_that_do_not_fit_the_target_are_refused_by_name(target, tmp_path):
    other = random_model(hidden=48, layers=LAYERS, heads=6, kv_heads=2, seed=2)
    write_eagle1(tmp_path / "wide", other)
    with pytest.raises(HeadCheckpointError, match="hidden_size is 48, the target's is 32; this head was trained for "
                                                  "another target"):
        load_published_head(tmp_path / "wide", target)
    write_eagle3(tmp_path / "vocab", target, DRAFT_IDS, vocab_size=128)
    with pytest.raises(HeadCheckpointError, match="vocab_size is 128, the target's is 64; the head was trained with "
                                                  "another tokenizer"):
        load_published_head(tmp_path / "vocab", target)
    write_eagle3(tmp_path / "nod2t", target, DRAFT_IDS, drop=("d2t",))
    with pytest.raises(HeadCheckpointError, match=r"missing d2t: the draft vocabulary \(16 tokens\) is smaller than "
                                                  r"the target's \(64\)"):
        load_published_head(tmp_path / "nod2t", target)
    w = write_eagle3(tmp_path / "t2d", target, DRAFT_IDS)
    from safetensors.torch import save_file
    w["t2d"] = w["t2d"].roll(1)
    save_file(w, str(tmp_path / "t2d" / "model.safetensors"))
    with pytest.raises(HeadCheckpointError, match="t2d disagrees with d2t"):
        load_published_head(tmp_path / "t2d", target)
    write_eagle3(tmp_path / "nohead", target, DRAFT_IDS, drop=("lm_head.weight",))
    with pytest.raises(HeadCheckpointError, match=r"missing tensor lm_head.weight \(shape \[16, 32\]\)"):
        load_published_head(tmp_path / "nohead", target)
    write_eagle3(tmp_path / "layers", target, DRAFT_IDS, eagle_aux_hidden_state_layer_ids=[1, 3, 9])
    with pytest.raises(ValueError, match="aux layers 1,3,9 must be three increasing layer indices in 0..5"):
        load_published_head(tmp_path / "layers", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadCheckpointError, match="missing config.json"):
        load_published_head(tmp_path / "empty", target)
    with pytest.raises(HeadCheckpointError, match="not a folder"):
        load_published_head(tmp_path / "nowhere", target)
    assert issubclass(HeadCheckpointError, DrafterError)


def test_eagle3_checkpoint_with_the_full_vocabulary_needs_no_d2t(target, tmp_path):
    write_eagle3(tmp_path / "full", target, list(range(64)), drop=("d2t", "t2d"))
    head = load_published_head(tmp_path / "full", target).head
    assert head.draft_to_target.tolist() == list(range(64))


# ---- ours, exported in the published layouts --------------------------------------------------------------------
def _drafts(drafter, target):
    trees = []
    engine = SpecEngine(engine_target(target, drafter), drafter, EngineConfig(max_new_tokens=12, kv_block_size=4))
    orig = drafter.propose

    def recording(state):
        tree = orig(state)
        trees.append((tree.token_ids.tolist(), tree.parents.tolist()))
        return tree

    drafter.propose = recording
    outputs = engine.generate(PROMPTS).outputs
    return outputs, trees


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_our_heads_exported_in_the_published_layout_load_back_drafting_identically(kind, target, tmp_path):
    if kind == "eagle":
        head = EagleHead.for_target(target, seed=5, std=0.3, style="eagle")
        make = lambda h: EagleDrafter(h, target, 3, 3, 8)  # noqa: E731
    else:
        head = Eagle3Head.for_target(target, seed=5, std=0.3, draft_tokens=torch.tensor(DRAFT_IDS))
        make = lambda h: Eagle3Drafter(h, target, 3, 3, 8)  # noqa: E731
    assert export_published_head(head, target, tmp_path / "out") == kind
    config, weights = read_checkpoint(tmp_path / "out")
    if kind == "eagle":
        assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
                "layers.0.post_attention_layernorm.weight"} <= set(weights)
        assert not any("input_layernorm" in k for k in weights) and config["architectures"] == ["LlamaForCausalLM"]
    else:
        assert weights["midlayer.self_attn.q_proj.weight"].shape == (32, 64) and weights["d2t"].dtype == torch.long
        assert weights["t2d"].dtype == torch.bool and config["draft_vocab_size"] == len(DRAFT_IDS)
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "embed_tokens.weight" not in weights
    back = load_published_head(tmp_path / "out", target).head
    ours, theirs = _drafts(make(head), target), _drafts(make(back), target)
    assert ours == theirs and len(ours[1]) > 3
    assert ours[0] == [reference_greedy(target, p, 12) for p in PROMPTS]


def test_workbench_style_heads_have_no_published_equivalent(target, tmp_path):
    with pytest.raises(HeadCheckpointError, match="cannot express: train one with `zoo train-head --kind eagle "
                                                  "--style eagle`"):
        export_published_head(EagleHead.for_target(target), target, tmp_path / "x")


# ---- the bench: --draft-head and the run row ------------------------------------------------------------------------
def test_bench_runs_a_published_eagle3_head_and_records_where_it_came_from(tmp_path):
    from workbench.harness.bench import BenchConfig, BenchError, BenchSession
    from workbench.harness.bench_cli import add_session_args
    import argparse

    session = BenchSession.load(preset="tiny", device="cpu", draft_head=str(tmp_path / "e3"))
    tiny = session.target
    ids = torch.randperm(tiny.config.vocab_size, generator=torch.Generator().manual_seed(0))[:512]
    w = write_eagle3(tmp_path / "e3", tiny, ids.tolist(), seed=1)
    cfg = BenchConfig(method="eagle3", batch=2, max_new_tokens=12, num_prompts=2, warmup=0, repeats=1,
                      tree_depth=3, tree_topk=2, tree_budget=6)
    rec = session.run(cfg).record
    assert rec["greedy_matches_ar"] is True and rec["status"] == "ok"
    assert (rec["draft_head"], rec["draft_head_layout"], rec["draft_head_dtype"]) == \
        (str(tmp_path / "e3"), "eagle3", "bfloat16")
    assert rec["draft_head_params"] == sum(v.numel() for v in w.values() if v.is_floating_point())
    assert rec["draft_vocab_size"] == 512 and rec["eagle3_layers"] == "auto"
    import shutil

    from workbench.zoo.presets import COMMITTED_DIR
    shutil.copytree(tmp_path / "e3", tmp_path / "e3tok")
    shutil.copy(COMMITTED_DIR / "tiny" / "target" / "tokenizer.json", tmp_path / "e3tok")
    assert load_published_head(tmp_path / "e3tok", tiny, tokenizer=session.tokenizer).layout == "eagle3"
    other_tok = json.loads((tmp_path / "e3tok" / "tokenizer.json").read_text())
    vocab = other_tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "e3tok" / "tokenizer.json").write_text(json.dumps(other_tok))
    with pytest.raises(HeadCheckpointError, match="its tokenizer.json differs from the target's"):
        load_published_head(tmp_path / "e3tok", tiny, tokenizer=session.tokenizer)
    with pytest.raises(BenchError, match="is an eagle3 head: run it with --method eagle3, not eagle"):
        session.run(BenchConfig(method="eagle", max_new_tokens=4, num_prompts=1, warmup=0, repeats=1))
    with pytest.raises(BenchError, match="method redrafter loads no published head"):
        session.run(BenchConfig(method="redrafter", max_new_tokens=4, num_prompts=1, warmup=0, repeats=1))
    untrained = BenchSession.load(preset="tiny", device="cpu").run(cfg).record
    assert untrained["draft_head"] == "untrained (seed 0)" and untrained["draft_head_layout"] == "eagle3"
    assert untrained["draft_vocab_size"] == tiny.config.vocab_size and untrained["greedy_matches_ar"] is True
    p = argparse.ArgumentParser()
    add_session_args(p, "prompts")
    assert p.parse_args(["--draft-head", "x"]).draft_head == "x"


def test_studies_carry_the_draft_head_into_their_sessions():
    """`python -m studies.run --draft-head DIR` puts the folder in the study's ModelSpec (and so into every trial's
    session); a ModelSpec stored before the field existed still loads."""
    from studies.objective import ModelSpec
    from studies.run import _models, build_parser

    args = build_parser().parse_args(["--study", "s", "--draft-head", "/heads/e3"])
    assert _models(args, None) == ModelSpec(preset="tiny", draft_head="/heads/e3")
    args = build_parser().parse_args(["--study", "s", "--preset", "tiny", "--draft-head", "/heads/e3"])
    assert _models(args, None).draft_head == "/heads/e3"
    assert ModelSpec(**{"preset": "tiny", "model": None, "draft": None, "prompts": None}).draft_head is None
