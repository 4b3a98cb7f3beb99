"""The hot vocabulary (hot_vocab, FR-Spec) of EAGLE-2 and ReDrafter: the head drafts from a slice of the LM head's
rows; the output stays the target's, the drafted tokens stay in the hot set, the ranking saves and loads with the
head, bad settings are named."""
from __future__ import annotations

import pytest
import torch

from tests.test_engine import PROMPTS, random_model, reference_greedy, target  # noqa: F401 (fixture)
from tests.test_published_heads import _drafts
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DrafterError, EagleDrafter, EagleHead, make_drafter
from workbench.engine.drafters.eagle import EagleSettingsError
from workbench.engine.drafters.head_io import HOT_TOKENS
from workbench.engine.drafters.base import DraftContext
from workbench.engine.sampling import SamplingParams
from workbench.zoo.head_training import token_ranking


def head_with_ranking(target, seed=4):
    head = EagleHead.for_target(target, seed=seed, std=0.3)
    v = target.config.vocab_size
    head.set_hot_tokens(torch.randperm(v, generator=torch.Generator().manual_seed(seed)))  # not id order
    return head


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_greedy_output_equals_autoregressive_and_drafts_stay_hot(paged, cuda_graphs, target):
    n, hot = 16, 40
    head = head_with_ranking(target)
    drafter = EagleDrafter(head, target, 3, 3, 8, hot_vocab=hot)
    engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=n, paged=paged, kv_block_size=4,
                                                      cuda_graphs=cuda_graphs, graph_batch_sizes=(1, 2, 4)))
    res = engine.generate(PROMPTS)
    assert res.outputs == [reference_greedy(target, p, n) for p in PROMPTS]
    allowed = set(head.hot_tokens[:hot].tolist())
    _, seen = _drafts(EagleDrafter(head, target, 3, 3, 8, hot_vocab=hot), target)
    drafted = {t for toks, _ in seen for row in toks for t in row}
    assert drafted and drafted <= allowed
    assert drafter.settings["hot_vocab"] == hot


def test_the_whole_vocabulary_as_hot_set_drafts_the_same_trees(target):
    """hot_vocab = V permutes the LM head's rows: the same candidates and scores as the full head, so the same
    trees step for step (the slice changes which rows are read, not what is drafted)."""
    head = head_with_ranking(target)
    out_full, full = _drafts(EagleDrafter(head, target, 4, 3, 10), target)
    out_hot, hot = _drafts(EagleDrafter(head, target, 4, 3, 10, hot_vocab=target.config.vocab_size), target)
    assert out_full == out_hot and full == hot and len(full) > 3


def test_hot_draft_is_the_full_drafts_best_hot_tokens(target):
    """The top-K of the hot slice are the K best-scored hot tokens of the full LM head's distribution."""
    head = head_with_ranking(target)
    hot = 25
    drafter = EagleDrafter(head, target, 2, 4, 6, hot_vocab=hot)
    drafter.setup(DraftContext(max_rows=2, max_len=64, device=torch.device("cpu"), sampling=SamplingParams(),
                               generator=None, paged=False, kv_block_size=4))
    feats = torch.randn(3, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    score, tok = drafter._top(feats, 4)
    logits = target.compute_logits(feats).float()
    ids = head.hot_tokens[:hot]
    want = logits[:, ids].topk(4, -1)
    assert torch.equal(tok, ids[want.indices])
    torch.testing.assert_close(score, torch.log_softmax(logits[:, ids], -1).gather(1, want.indices))


def test_ranking_saves_and_loads_with_the_head(target, tmp_path):
    head = head_with_ranking(target)
    head.save(tmp_path / "h")
    assert (tmp_path / "h" / HOT_TOKENS).is_file()
    back = EagleHead.load(tmp_path / "h")
    assert torch.equal(back.hot_tokens, head.hot_tokens)
    head.hot_tokens = None
    head.save(tmp_path / "bare")
    assert EagleHead.load(tmp_path / "bare").hot_tokens is None


def test_bad_hot_settings_are_named(target, tmp_path):
    v = target.config.vocab_size
    head = head_with_ranking(target)
    with pytest.raises(EagleSettingsError, match=f"hot_vocab must be 0 .* or 1..{v}"):
        EagleDrafter(head, target, hot_vocab=v + 1)
    with pytest.raises(EagleSettingsError, match="tree_topk=4 exceeds the vocabulary \\(3 tokens\\)"):
        EagleDrafter(head, target, 2, 4, 6, hot_vocab=3)
    head.hot_tokens = None  # a folder without hot_tokens.safetensors (a published head)
    with pytest.raises(EagleSettingsError, match="needs the head's token ranking"):
        EagleDrafter(head, target, hot_vocab=10)
    head.hot_tokens = torch.tensor([v, 0, 1])
    with pytest.raises(EagleSettingsError, match="counted for another tokenizer"):
        EagleDrafter(head, target, hot_vocab=2)
    head.set_hot_tokens(torch.tensor([7, 3, 9, 1, 0]), vocab_size=v)  # a token map: the first 5 of a ranking
    assert EagleDrafter(head, target, 2, 2, 3, hot_vocab=5).hot_vocab == 5
    with pytest.raises(EagleSettingsError, match="exceeds the head's token map \\(5 ids\\)"):
        EagleDrafter(head, target, hot_vocab=6)
    with pytest.raises(ValueError, match="distinct token ids below"):
        head.set_hot_tokens(torch.tensor([7, 7]), vocab_size=v)
    with pytest.raises(ValueError, match="every token id 0..V-1 once"):
        head.set_hot_tokens(torch.tensor([0, 1, 1, 3]))
    with pytest.raises(DrafterError, match="hot_vocab"):
        make_drafter("eagle", {"hot_vocab": v + 5}, target=target, heads={"eagle": head_with_ranking(target)})


def test_untrained_head_ranks_by_id_and_training_ranks_by_count(target):
    head = EagleHead.for_target(target, seed=1)
    assert head.hot_tokens.tolist() == list(range(target.config.vocab_size))
    from workbench.zoo.head_training import rank_tokens

    windows = torch.tensor([[5, 5, 5, 2, 2, 7]])
    rank_tokens(head, windows)
    assert head.hot_tokens[:3].tolist() == [5, 2, 7] and head.hot_tokens[3:6].tolist() == [0, 1, 3]
    assert token_ranking(windows, 8).tolist() == [5, 2, 7, 0, 1, 3, 4, 6]


def test_quantized_lm_head_gives_its_dequantized_rows(target):
    """A target whose LM head is quantized (int8 here): the hot slice is the dequantized weight's rows, and the
    output is still the target's greedy output."""
    from workbench.engine.quant import quantize_model

    q = quantize_model(target, "int8", head=True)
    assert hasattr(q.lm_head, "dequantized_weight")
    head = head_with_ranking(q)
    drafter = EagleDrafter(head, q, 3, 2, 5, hot_vocab=30)
    engine = SpecEngine(q, drafter, EngineConfig(max_new_tokens=10))
    assert engine.generate(PROMPTS).outputs == [reference_greedy(q, p, 10) for p in PROMPTS]
    w = drafter._hot.weight
    torch.testing.assert_close(w, q.lm_head.dequantized_weight()[head.hot_tokens[:30]].to(w))


def test_eagle3_top_k_over_its_draft_vocabulary_equals_the_scattered_full_one():
    """EAGLE-3 takes its K best over the Vd draft logits and maps them to target ids; the same as the top-K of the
    [.., V] log-probabilities with -inf outside the draft vocabulary (what it computed before)."""
    from workbench.engine.drafters.eagle3 import Eagle3Drafter, Eagle3Head

    vocab = torch.tensor([1, 4, 6, 9, 12, 20, 33, 40])
    target = random_model(layers=6, seed=1)
    head = Eagle3Head.for_target(target, seed=3, std=0.3, draft_tokens=vocab)
    drafter = Eagle3Drafter(head, target, 2, 3, 5)
    feats = torch.randn(2, 3, target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    score, tok = drafter._top(feats, 3)
    want_score, want_tok = head.draft_log_probs(feats).topk(3, -1)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(score, want_score)
    assert "hot_vocab" not in drafter.settings


# -- ReDrafter ----------------------------------------------------------------------------------------------------
def redrafter_with_ranking(target, seed=4):
    from workbench.engine.drafters import RedrafterHead

    head = RedrafterHead.for_target(target, seed=seed, std=0.3)
    head.set_hot_tokens(torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed)))
    return head


def redrafter(target, head, w=3, length=3, hot=0, **kw):
    from workbench.engine.drafters import RedrafterDrafter

    return RedrafterDrafter(head, target, beam_width=w, beam_length=length, hot_vocab=hot, **kw)


def _beams(d, target, seed=0):
    d.setup(DraftContext(max_rows=4, max_len=64, device=torch.device("cpu"), sampling=SamplingParams(),
                         generator=None))
    d.last_hidden.copy_(torch.randn(d.last_hidden.shape, generator=torch.Generator().manual_seed(seed)))
    with torch.no_grad():
        return d._search(torch.tensor([0, 2]), torch.tensor([5, 9]))


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "fixed-shape"])
def test_redrafter_hot_output_equals_autoregressive_and_beams_stay_hot(cuda_graphs, target):
    n, hot = 16, 30
    head = redrafter_with_ranking(target)
    engine = SpecEngine(target, redrafter(target, head, hot=hot), EngineConfig(
        max_new_tokens=n, paged=True, kv_block_size=4, cuda_graphs=cuda_graphs, graph_batch_sizes=(1, 2, 4)))
    assert engine.generate(PROMPTS).outputs == [reference_greedy(target, p, n) for p in PROMPTS]
    beams = _beams(redrafter(target, head, hot=hot), target)
    assert set(beams.flatten().tolist()) <= set(head.hot_tokens[:hot].tolist())


def test_redrafter_whole_vocabulary_as_hot_set_searches_the_same_beams(target):
    """hot_vocab = V permutes the LM head's rows: the same scores, so the same beams (the penalty's per-token counts
    too, kept per hot index)."""
    head = redrafter_with_ranking(target)
    v = target.config.vocab_size
    for kw in ({}, {"diversity_penalty": 0.7}):
        full = _beams(redrafter(target, head, **kw), target)
        hot = _beams(redrafter(target, head, hot=v, **kw), target)
        assert torch.equal(full, hot)


def test_redrafter_hot_beams_are_the_full_searchs_over_hot_tokens(target):
    """W = 2, L = 1: depth 1 keeps the 2 best hot tokens of the full LM head's distribution."""
    head = redrafter_with_ranking(target)
    hot = 20
    d = redrafter(target, head, w=2, length=1, hot=hot)
    beams = _beams(d, target)
    ids = head.hot_tokens[:hot]
    for i, (row, root) in enumerate(((0, 5), (2, 9))):
        h = d.last_hidden[row].unsqueeze(0)
        with torch.no_grad():
            _, f = d.head(h, target.model.embed_tokens(torch.tensor([root])), h)
            logits = target.compute_logits(f)[0].float()
        assert beams[i, :, 0].tolist() == ids[logits[ids].topk(2).indices].tolist()


def test_redrafter_ranking_saves_and_bad_hot_settings_are_named(target, tmp_path):
    from workbench.engine.drafters import RedrafterHead

    head = redrafter_with_ranking(target)
    head.save(tmp_path / "r")
    assert (tmp_path / "r" / HOT_TOKENS).is_file()
    assert torch.equal(RedrafterHead.load(tmp_path / "r").hot_tokens, head.hot_tokens)
    v = target.config.vocab_size
    with pytest.raises(ValueError, match=f"hot_vocab must be 0 .* or 1..{v}"):
        redrafter(target, head, hot=v + 1)
    with pytest.raises(ValueError, match="beam_width=3 exceeds hot_vocab=2"):
        redrafter(target, head, hot=2)
    head.hot_tokens = None
    with pytest.raises(ValueError, match="needs the head's token ranking .*zoo train-head --kind redrafter"):
        redrafter(target, head, hot=10)
    d = make_drafter("redrafter", {"beam_width": 2, "beam_length": 2, "hot_vocab": 12}, target=target,
                     heads={"redrafter": redrafter_with_ranking(target)})
    assert d.settings["hot_vocab"] == 12
