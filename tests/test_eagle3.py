"""EAGLE-3 (workbench/engine/drafters/eagle3.py): greedy output equals AR through every cache and step mode, the
drafted trees equal a cache-free EAGLE-3 at every step, sampled verification stays target-distributed (chi-square),
the target's aux view, the layer rule and the named errors."""
import pytest
import torch

from tests.test_eagle import check_valid_tree
from tests.test_engine import PROMPTS, random_model, reference_greedy
from tests.test_verify import chi_square_pvalue
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DrafterError, Eagle3Drafter, Eagle3Head, EagleHead, engine_target, make_drafter
from workbench.engine.drafters.eagle import EagleSettingsError
from workbench.engine.drafters.eagle3 import default_aux_layers, with_aux_hidden
from workbench.engine.sampling import SamplingParams, probs_from_logits
from workbench.models import CausalAttention
from workbench.settings import SettingError, check

TREES = [(4, 4, 16), (3, 1, 3), (3, 3, 8)]
DRAFT_IDS = torch.tensor([0, 1, 3, 4, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61])


@pytest.fixture(scope="module")
def target():
    return random_model(layers=6, seed=1)


def head_for(target, seed=4, vocab=DRAFT_IDS):
    return Eagle3Head.for_target(target, seed=seed, std=0.3, draft_tokens=vocab)


def engine(target, drafter, **kw):
    return SpecEngine(engine_target(target, drafter), drafter, EngineConfig(**kw))


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("tree", TREES, ids=lambda t: "D{}K{}N{}".format(*t))
def test_greedy_output_equals_autoregressive(tree, paged, cuda_graphs, target):
    n = 16
    expected = [reference_greedy(target, p, n) for p in PROMPTS]
    e = engine(target, Eagle3Drafter(head_for(target), target, *tree), max_new_tokens=n, paged=paged, kv_block_size=4,
               cuda_graphs=cuda_graphs, graph_batch_sizes=(1, 2, 4))
    assert e.generate([PROMPTS[0]]).outputs == [expected[0]]
    res = e.generate(PROMPTS)
    assert res.outputs == expected
    assert all(d == tree[2] for s in res.steps for d in s.drafted)


@torch.no_grad()
def reference_tree3(head, target, seq, depth, topk, budget):
    """Cache-free EAGLE-3: the committed pairs' fused features, then each node's path of predicted features, run
    through the head from scratch (causal); children are the top-K of the head's draft-vocabulary log-probs."""
    view = with_aux_hidden(target, head.config.aux_layers)
    g = head.fuse(view(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1).unsqueeze(0), CausalAttention()))

    def feature(path):
        feats = torch.cat([g] + [f.view(1, 1, -1) for f, _ in path], 1)
        toks = torch.tensor([seq[1:] + [t for _, t in path]])
        return head(target, feats, toks, torch.arange(toks.shape[1]).unsqueeze(0), CausalAttention())[0, -1]

    def children(f):
        s, t = head.draft_log_probs(f).topk(topk)
        return list(zip(s.tolist(), t.tolist()))

    root = feature([])
    cands, frontier = [], []
    for s, t in children(root):
        frontier.append((len(cands), s, [(root, t)]))
        cands.append((t, s, -1, 1))
    for d in range(1, depth):
        kids = []
        for idx, score, path in frontier:
            f = feature(path)
            kids += [(idx, t, score + s, path + [(f, t)]) for s, t in children(f)]
        first = len(cands)
        cands += [(t, s, idx, d + 1) for idx, t, s, _ in kids]
        order = torch.tensor([s for _, _, s, _ in kids]).topk(topk).indices.tolist()
        frontier = [(first + j, kids[j][2], kids[j][3]) for j in order]
    keep = sorted(sorted(range(len(cands)), key=lambda i: -cands[i][1])[:budget])
    node = {c: i for i, c in enumerate(keep)}
    return [cands[c][0] for c in keep], [node.get(cands[c][2], -1) for c in keep], [cands[c][3] for c in keep]


class CheckedEagle3(Eagle3Drafter):
    checked = 0

    def propose(self, state):
        tree = super().propose(state)
        check_valid_tree(tree, self.tree_depth, self.tree_budget)
        for i, row in enumerate(state.rows_host):
            toks, parents, depths = reference_tree3(self.head, self.target, state.tokens_host[row], self.tree_depth,
                                                    self.tree_topk, self.tree_budget)
            assert tree.token_ids[i].tolist() == toks
            assert tree.parents[i].tolist() == parents and tree.depths[i].tolist() == depths
            self.checked += 1
        return tree


def test_trees_equal_a_cache_free_eagle3_at_every_step(target):
    """The aux features through prefill and the pending pairs, the fused / predicted features per depth, the head's
    cache and the draft vocabulary mapping give the trees a recomputation from scratch gives."""
    drafter = CheckedEagle3(head_for(target, seed=8), target, 3, 3, 8)
    res = engine(target, drafter, max_new_tokens=12, kv_block_size=4).generate(PROMPTS)
    assert drafter.checked >= 10
    assert res.outputs == [reference_greedy(target, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["eager", "captured-step"])
def test_sampled_trees_follow_the_target_distribution(fixed_shape):
    """Temperature 1: the joint of the two tokens after the first sampled token matches the target's exact joint
    (chi-square), with a draft vocabulary that leaves some target tokens out."""
    small = random_model(vocab=8, hidden=16, layers=4, heads=2, kv_heads=1, seed=5, std=0.8)
    params = SamplingParams(temperature=1.0)
    prompt, n = [1, 2, 3, 1, 2], 3000
    head = Eagle3Head.for_target(small, seed=7, std=0.5, draft_tokens=torch.tensor([0, 2, 3, 5, 6]))
    e = SpecEngine(engine_target(small, d := Eagle3Drafter(head, small, 2, 3, 6)), d, EngineConfig(
        max_new_tokens=3, sampling=params, seed=11, cuda_graphs=fixed_shape, graph_batch_sizes=(1, 2)))
    res = e.generate([prompt] * n)
    outs = torch.tensor(res.outputs)
    t0 = int(torch.mode(outs[:, 0]).values)
    sel = outs[outs[:, 0] == t0]
    with torch.no_grad():
        ctx = torch.tensor(prompt + [t0])

        def dist(ids):
            h = small(ids.unsqueeze(0), torch.arange(len(ids)).unsqueeze(0))
            return probs_from_logits(small.compute_logits(h[0, -1]), params)
        p1 = dist(ctx)
        joint = torch.stack([p1[a] * dist(torch.cat([ctx, torch.tensor([a])])) for a in range(8)])
    counts = torch.bincount(sel[:, 1] * 8 + sel[:, 2], minlength=64).float()
    assert sel.shape[0] > 500 and sum(sum(s.accepted) for s in res.steps) > 0
    assert chi_square_pvalue(counts, joint.flatten()) > 1e-3


def test_aux_view_shares_the_weights_and_leaves_the_target_alone(target):
    view = with_aux_hidden(target, (1, 3, 5))
    assert with_aux_hidden(target, (1, 3, 5)) is view and with_aux_hidden(view, (1, 3, 5)) is view
    assert view.model is target.model and target.aux_hidden_layers == ()
    ids, pos = torch.tensor([PROMPTS[0]]), torch.arange(len(PROMPTS[0])).unsqueeze(0)
    with torch.no_grad():
        plain, wide = target(ids, pos), view(ids, pos)
        assert plain.shape[-1] == 32 and wide.shape[-1] == 4 * 32
        torch.testing.assert_close(wide[..., :32], plain, rtol=0, atol=0)
        torch.testing.assert_close(view.compute_logits(wide), target.compute_logits(plain), rtol=0, atol=0)
    assert {id(p) for p in view.parameters()} == {id(p) for p in target.parameters()}  # nothing copied


def test_default_layers_follow_the_published_rule_where_it_gives_three():
    assert default_aux_layers(32) == (2, 16, 29) and default_aux_layers(12) == (2, 6, 9)
    assert default_aux_layers(6) == (1, 3, 5) and default_aux_layers(4) == (1, 2, 3)
    with pytest.raises(EagleSettingsError, match="three distinct layers; the target has only 2"):
        default_aux_layers(2)


def test_registry_builds_eagle3_with_its_knobs(target):
    d = make_drafter("eagle3", {"tree_depth": 3, "tree_topk": 2, "tree_budget": 5, "eagle3_layers": "0,2,4"},
                     target=target)
    assert isinstance(d, Eagle3Drafter) and d.head.config.aux_layers == (0, 2, 4)
    assert d.settings == {"tree_depth": 3, "tree_topk": 2, "tree_budget": 5, "eagle3_layers": "0,2,4"}
    assert make_drafter("eagle3", {}, target=target).head.config.aux_layers == (1, 3, 5)


@pytest.mark.parametrize("values, message", [
    ({"method": "eagle3", "eagle3_layers": "3,1,5"}, "must be three increasing layer indices"),
    ({"method": "eagle3", "eagle3_layers": "1,2"}, "must be three increasing layer indices"),
    ({"method": "eagle3", "eagle3_layers": "a,b,c"}, "is not 'auto' or three layer indices"),
    ({"method": "eagle3", "tree_depth": 4, "tree_topk": 4, "tree_budget": 3}, "tree_budget=3 is below tree_depth=4"),
])
def test_bad_settings_are_named(values, message):
    with pytest.raises(SettingError, match=message):
        check(values)


def test_heads_and_layers_that_do_not_fit_are_named(target):
    head = head_for(target)
    with pytest.raises(EagleSettingsError, match="eagle3_layers=0,2,4, but the head was trained on layers 1,3,5"):
        Eagle3Drafter(head, target, aux_layers=(0, 2, 4))
    with pytest.raises(EagleSettingsError, match=r"tree_topk=30 exceeds the vocabulary \(21 tokens\)"):
        Eagle3Drafter(head, target, 2, 30, 40)
    with pytest.raises(EagleSettingsError, match="aux layers 2,4,6 must be three increasing layer indices in 0..5"):
        Eagle3Drafter(Eagle3Head.for_target(target, aux_layers=(2, 4, 6)), target)
    other = random_model(vocab=64, hidden=16, layers=6, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="EAGLE-3 head has hidden_size 16, the target 32"):
        Eagle3Drafter(Eagle3Head.for_target(other), target)
    d = Eagle3Drafter(head, target)
    with pytest.raises(DrafterError, match="built over another target than the engine's"):
        engine_target(other, d)


def test_head_folder_round_trip(target, tmp_path):
    head = head_for(target, seed=9)
    head.save(tmp_path / "h")
    back = Eagle3Head.load(tmp_path / "h")
    assert back.config == head.config and back.config.aux_layers == (1, 3, 5)
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name


# ---- training (training-time test rollout) and the zoo CLI ---------------------------------------------------------
def test_a_few_training_steps_lower_the_loss_on_the_draft_vocabulary(target):
    from dataclasses import replace

    from workbench.zoo.train_eagle3 import Eagle3TrainSpec, _loss, frequent_tokens, make_eagle3_head, train_eagle3

    torch.manual_seed(0)
    windows = torch.randint(0, 40, (8, 24))  # ids 40..63 never occur: left out of a 40-token draft vocabulary
    spec = replace(Eagle3TrainSpec(), depth=2, seq_len=24, batch_size=8, lr=1e-2, warmup_steps=2, max_steps=40,
                   max_seconds=120, draft_vocab_size=40)
    head = make_eagle3_head(target, spec)
    with torch.no_grad():
        before = float(_loss(head, target, windows, spec))
    report = train_eagle3(head, target, windows, spec, log=lambda _: None)
    with torch.no_grad():
        after = float(_loss(head, target, windows, spec))
    assert report["steps"] == 40 and report["draft_vocab_size"] == 40 and after < 0.7 * before
    assert head.draft_to_target.tolist() == frequent_tokens(windows, 64, 40).tolist() == list(range(40))


def test_train_and_export_head_cli_end_to_end(tmp_path):
    """zoo train-head --kind eagle3 (3 steps on CPU) writes a head and its manifest; zoo export-head writes it in the
    published EAGLE-3 layout, which loads back through the published loader with the same tensors; --draft-head
    runs it."""
    import json

    from workbench.__main__ import main
    from workbench.engine.drafters.published import HeadCheckpointError, load_published_head, read_checkpoint
    from workbench.models import load_model
    from workbench.zoo.heads import has_head
    from workbench.zoo.presets import COMMITTED_DIR

    out = tmp_path / "eagle3"
    rc = main(["zoo", "train-head", "--kind", "eagle3", "--preset", "tiny", "--device", "cpu", "--max-seconds", "60",
               "--max-steps", "3", "--train-windows", "16", "--eval-windows", "2", "--draft-vocab", "1024",
               "--out", str(out)])
    assert rc == 0 and has_head(out)
    m = json.loads((out / "manifest.json").read_text())
    assert m["kind"] == "eagle3" and m["train"]["steps"] == 3 and m["train"]["draft_vocab_size"] == 1024
    assert m["train"]["eagle3_layers"] == "1,3,5" and len(m["heldout"]["agreement_by_depth"]) == m["recipe"]["depth"]
    head = Eagle3Head.load(out)
    assert main(["zoo", "export-head", "--kind", "eagle3", "--preset", "tiny", "--head", str(out), "--out",
                 str(tmp_path / "pub"), "--dtype", "float32"]) == 0
    config, weights = read_checkpoint(tmp_path / "pub")
    assert config["draft_vocab_size"] == 1024 and config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    tiny = load_model(COMMITTED_DIR / "tiny" / "target", dtype=torch.float32, device="cpu")
    back = load_published_head(tmp_path / "pub", tiny).head
    for name, tensor in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert main(["zoo", "export-head", "--kind", "eagle", "--preset", "tiny", "--out", str(tmp_path / "x")]) == 2
    rc = main(["zoo", "train-head", "--kind", "eagle", "--style", "eagle", "--preset", "tiny", "--device", "cpu",
               "--max-steps", "2", "--train-windows", "8", "--eval-windows", "2", "--out", str(tmp_path / "e1")])
    assert rc == 0 and json.loads((tmp_path / "e1" / "manifest.json").read_text())["recipe"]["style"] == "eagle"
    assert main(["zoo", "export-head", "--kind", "eagle", "--preset", "tiny", "--head", str(tmp_path / "e1"),
                 "--out", str(tmp_path / "e1pub")]) == 0
    loaded = load_published_head(tmp_path / "e1pub", tiny)
    assert loaded.layout == "eagle" and loaded.stored_dtype == "bfloat16" and loaded.head.config.style == "eagle"
    # the trained head's token ranking (counted on its training windows) and SGLang's token map of its first N
    ranking = EagleHead.load(tmp_path / "e1").hot_tokens
    assert sorted(ranking.tolist()) == list(range(tiny.config.vocab_size))
    assert main(["zoo", "export-head", "--kind", "eagle", "--preset", "tiny", "--head", str(tmp_path / "e1"),
                 "--out", str(tmp_path / "e1hot"), "--hot-vocab", "64"]) == 0
    assert torch.equal(torch.load(tmp_path / "e1hot" / "hot_tokens_64.pt", weights_only=True), ranking[:64])
    assert torch.equal(load_published_head(tmp_path / "e1hot", tiny).head.hot_tokens, ranking[:64])  # round trip
    assert load_published_head(tmp_path / "e1pub", tiny).head.hot_tokens is None  # no token map in the folder
    torch.save(torch.tensor([5, 5]), tmp_path / "e1hot" / "hot_tokens_100.pt")  # the largest N is the one read
    with pytest.raises(HeadCheckpointError, match="hot_tokens_100.pt is not a token map"):
        load_published_head(tmp_path / "e1hot", tiny)
    assert main(["zoo", "export-head", "--kind", "eagle3", "--preset", "tiny", "--head", str(out), "--out",
                 str(tmp_path / "pub3"), "--hot-vocab", "64"]) == 2
    assert main(["zoo", "train-head", "--kind", "eagle", "--preset", "tiny", "--draft-vocab", "10"]) == 2


# ---- serving: chunked prefill, preemption and the row -----------------------------------------------------------------
def test_served_eagle3_equals_solo_greedy_through_chunks_and_preemption():
    """The aux features reach the head through chunked prefill and the re-prefill of preempted rows: outputs equal
    each request's solo greedy output, and the serving row records the head."""
    import math

    from workbench.harness.bench import BenchSession
    from workbench.serving.bench import engine_for, serve_bench
    from workbench.serving.config import ServeConfig
    from workbench.serving.loadgen import arrival_times
    from workbench.serving.loop import ServingLoop, StepClock
    from workbench.serving.request import Request

    tiny = BenchSession.load(preset="tiny", device="cpu")
    prompts = tiny.encode(6)
    times = arrival_times(len(prompts), 2.0, seed=3)
    reqs = [Request(i, p, 16, times[i]) for i, p in enumerate(prompts)]
    cfg = ServeConfig(method="eagle3", max_new_tokens=16, max_num_seqs=4, kv_block_size=16, tree_depth=3,
                      tree_topk=2, tree_budget=6)
    whole = ServingLoop(engine_for(tiny, cfg), reqs, clock=StepClock(), max_num_seqs=4).run()
    worst = max(math.ceil((len(r.prompt) + 16 + 8) / 16) for r in reqs)
    preempted = ServingLoop(engine_for(tiny, cfg), reqs, clock=StepClock(), max_num_seqs=4, policy="max_util",
                            num_blocks=worst + 1, prefill_chunk=16).run()
    assert preempted.preemptions > 0 and preempted.outputs == whole.outputs
    solo = SpecEngine(tiny.target, None, EngineConfig(max_new_tokens=16))
    for r in reqs:
        assert whole.outputs[r.id] == solo.generate([r.prompt]).outputs[0]
    rec = serve_bench(tiny, ServeConfig(method="eagle3", rate=20.0, num_requests=4, max_new_tokens=8, max_num_seqs=4,
                                        tree_depth=3, tree_topk=2, tree_budget=6, greedy_check_requests=2)).record
    assert rec["greedy_matches_solo"] is True and rec["draft_head"] == "untrained (seed 0)"
    assert rec["draft_head_layout"] == "eagle3" and rec["eagle3_layers"] == "auto"
