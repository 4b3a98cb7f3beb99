"""EAGLE-2 (workbench/engine/drafters/eagle.py): greedy conformance through every cache and step mode, the drafted tree
against a cache-free brute-force EAGLE-2 at every step (head KV cache, pending pairs, tree attention, rerank), tree
validity, no host sync, chi-square losslessness of sampled verification, named errors, the committed tiny head and
the `zoo train-head --kind eagle` CLI path."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_engine import PROMPTS, random_model, reference_greedy, target  # noqa: F401 (fixture)
from tests.test_verify import chi_square_pvalue
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import DrafterError, EagleDrafter, EagleHead, make_drafter
from workbench.engine.drafters.eagle import EagleSettingsError, check_tree, rerank, tree_capacity
from workbench.engine.sampling import SamplingParams, probs_from_logits
from workbench.models import CausalAttention
from workbench.settings import SettingError, check
from workbench.zoo.presets import COMMITTED_DIR

TINY = COMMITTED_DIR / "tiny"
HEAD = TINY / "eagle"
TREES = [(4, 4, 16), (3, 1, 3), (5, 3, 12), (2, 6, 40)]  # (depth D, top-k K, budget N); K = 1 is a chain


def untrained(target, seed=4):
    return EagleHead.for_target(target, seed=seed, std=0.3)


def check_valid_tree(tree, depth: int, budget: int) -> None:
    """Parents before children, depths = parent's + 1 and <= D, N = budget nodes all valid, siblings distinct."""
    assert tree.num_nodes == budget and bool(tree.valid.all()) and tree.depth_bound == depth
    for toks, parents, depths in zip(tree.token_ids.tolist(), tree.parents.tolist(), tree.depths.tolist()):
        assert max(depths) <= depth
        assert depths.count(1) >= 1 and sorted(depths) == depths  # candidate order is depth-major
        for i, (p, d) in enumerate(zip(parents, depths)):
            assert p < i and d == (1 if p < 0 else depths[p] + 1)
        siblings = {}
        for t, p in zip(toks, parents):
            siblings.setdefault(p, []).append(t)
        assert all(len(set(s)) == len(s) for s in siblings.values())  # top-k children are distinct tokens


@torch.no_grad()
def reference_tree(head, target, seq: list[int], depth: int, topk: int, budget: int):
    """Cache-free EAGLE-2: each expansion recomputes the head over the committed pairs and the node's path (causal
    over that sequence = the tree attention the drafter uses), then the same frontier / rerank rules."""
    n_committed = len(seq) - 1
    hidden = target(torch.tensor([seq[:-1]]), torch.arange(n_committed).unsqueeze(0), CausalAttention())

    def feature(path):  # path: [(feature the entry reads, token)] after the committed pairs -> the last output
        feats = torch.cat([hidden] + [f.view(1, 1, -1) for f, _ in path], 1)
        toks = torch.tensor([seq[1:] + [t for _, t in path]])
        out = head(target, feats, toks, torch.arange(toks.shape[1]).unsqueeze(0), CausalAttention())
        return out[0, -1]

    def children(f):
        logp = torch.log_softmax(target.compute_logits(f).float(), -1).clamp(max=0.0)
        s, t = logp.topk(topk)
        return list(zip(s.tolist(), t.tolist()))

    root = feature([])
    cands = []  # (token, score, parent candidate, depth)
    frontier = []  # (candidate index, score, path incl. its own entry)
    for s, t in children(root):
        frontier.append((len(cands), s, [(root, t)]))
        cands.append((t, s, -1, 1))
    for d in range(1, depth):
        kids = []
        for idx, score, path in frontier:
            f = feature(path)
            for s, t in children(f):
                kids.append((idx, t, score + s, path + [(f, t)]))
        first = len(cands)
        cands += [(t, s, idx, d + 1) for idx, t, s, _ in kids]
        order = torch.tensor([s for _, _, s, _ in kids]).topk(topk).indices.tolist()
        frontier = [(first + j, kids[j][2], kids[j][3]) for j in order]
    keep = sorted(sorted(range(len(cands)), key=lambda i: -cands[i][1])[:budget])
    node = {c: i for i, c in enumerate(keep)}
    return ([cands[c][0] for c in keep], [node.get(cands[c][2], -1) for c in keep], [cands[c][3] for c in keep])


class CheckedEagle(EagleDrafter):
    """Every proposed tree checked for validity and against the brute-force reference of its sequence."""

    checked = 0

    def propose(self, state):
        tree = super().propose(state)
        check_valid_tree(tree, self.tree_depth, self.tree_budget)
        for i, row in enumerate(state.rows_host):
            toks, parents, depths = reference_tree(self.head, self.target, state.tokens_host[row], self.tree_depth,
                                                   self.tree_topk, self.tree_budget)
            assert tree.token_ids[i].tolist() == toks
            assert tree.parents[i].tolist() == parents and tree.depths[i].tolist() == depths
            self.checked += 1
        return tree


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("tree", TREES, ids=lambda t: "D{}K{}N{}".format(*t))
def test_greedy_output_equals_autoregressive(tree, paged, cuda_graphs, target):
    """Batch 1 and a ragged batch, token for token; with cuda_graphs on a CPU the padded fixed-shape step runs."""
    n = 20
    expected = [reference_greedy(target, p, n) for p in PROMPTS]
    engine = SpecEngine(target, EagleDrafter(untrained(target), target, *tree),
                        EngineConfig(max_new_tokens=n, paged=paged, kv_block_size=4, cuda_graphs=cuda_graphs,
                                     graph_batch_sizes=(1, 2, 4)))
    for p, e in zip(PROMPTS, expected):
        assert engine.generate([p]).outputs == [e]
    res = engine.generate(PROMPTS)
    assert res.outputs == expected
    assert all(d == tree[2] for s in res.steps for d in s.drafted)
    if cuda_graphs:
        assert res.graph_stats.padded_rows > 0 and res.graph_stats.misses == 0


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_trees_equal_a_cache_free_eagle2_at_every_step(paged, target):
    """The head's KV cache (prefill, pending pairs, frontier entries under prefix masks, rewinds) gives the trees a
    recomputation from scratch gives, step after step, while sequences accept different lengths."""
    drafter = CheckedEagle(untrained(target), target, 3, 3, 8)
    engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=14, paged=paged, kv_block_size=4))
    res = engine.generate(PROMPTS)
    assert res.outputs == [reference_greedy(target, p, 14) for p in PROMPTS]
    assert drafter.checked == sum(len(s.rows) for s in res.steps)


def test_accepted_paths_longer_than_one_keep_the_head_cache_right(target):
    """The same reference check while drafts are accepted: the head is trained a few steps on the target's own greedy
    text, so steps commit several pairs at once and the pending-pair path runs with counts above one."""
    from workbench.zoo.train_eagle import EagleTrainSpec, train_eagle

    windows = torch.tensor([[p[0]] + reference_greedy(target, [p[0]], 31) for p in ([3], [7], [5], [9], [11], [2])])
    head = EagleHead.for_target(target, seed=1)
    train_eagle(head, target, windows, EagleTrainSpec(seq_len=32, batch_size=6, max_steps=60, warmup_steps=2, lr=1e-2,
                                                      depth=2), log=lambda _: None)
    drafter = CheckedEagle(head, target, 3, 2, 6)
    engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=16, kv_block_size=4))
    prompts = [[3], [7, 7, 2], [5]]
    res = engine.generate(prompts)
    assert res.outputs == [reference_greedy(target, p, 16) for p in prompts]
    accepted = [a for s in res.steps for a in s.accepted]
    assert max(accepted) >= 2  # runs of committed pairs longer than one went through the pending buffers


class RecordingEagle(EagleDrafter):
    """Every proposed tree's tokens and parents, in order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.trees = []

    def propose(self, state):
        tree = super().propose(state)
        self.trees.append((tree.token_ids.tolist(), tree.parents.tolist()))
        return tree


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "fixed-shape"])
def test_head_cache_on_the_kernel_drafts_the_trees_of_gather_and_sdpa(cuda_graphs, monkeypatch):
    """The head's paged cache with the Triton kernels attached (the interpreter runs them on a CPU; on a GPU the
    engine's attention backend attaches them) drafts the same trees as gather + SDPA, token for token and parent for
    parent: the committed tiny target and head in float32, a ragged batch (fixed-shape: padded to 4 rows), D = 4 so that two frontier forwards hand
    the kernel a prefix mask (their ancestors among the earlier draft levels), and the full budget N = K + (D-1) K^2
    so that every child those forwards draft is in the tree (a kernel that ignored the prefix mask fails here)."""
    import workbench.engine.drafters.eagle as eagle_module
    from workbench.engine.kv_cache import make_cache, set_kernels
    from workbench.models.loader import load_model

    target = load_model(TINY / "target")
    head = EagleHead.load(HEAD, dtype=torch.float32)
    prompts = [[1, 50, 300, 7, 9, 50, 300], [12, 40, 2], [5, 77]]
    runs, prefix_calls = {}, []

    def with_kernels(*args, **kwargs):
        cache = make_cache(*args, **kwargs)
        set_kernels(cache)
        fused = cache.write_kernel

        def counted(*a, **kw):
            prefix_calls.append(kw.get("prefix_mask") is not None)
            return fused(*a, **kw)

        cache.write_kernel = counted
        return cache

    for kernel in (False, True):
        if kernel:
            monkeypatch.setattr(eagle_module, "make_cache", with_kernels)
        drafter = RecordingEagle(head, target, 4, 3, 30)
        engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=8, kv_block_size=16, cuda_graphs=cuda_graphs,
                                                          graph_batch_sizes=(1, 4)))
        runs[kernel] = (engine.generate(prompts).outputs, drafter.trees)
    assert runs[True] == runs[False]
    steps = len(runs[True][1])
    assert steps >= 2 and sum(prefix_calls) == 2 * steps  # frontier forwards at depths 2 and 3 carry prefix masks
    assert len(prefix_calls) == 4 * steps  # every head forward of a draft took the kernel path


@pytest.mark.parametrize("tree", TREES, ids=lambda t: "D{}K{}N{}".format(*t))
def test_propose_makes_no_host_sync(tree, target, monkeypatch):
    """No .tolist() / .item() / bool(tensor) / int(tensor) in a whole propose: one fixed-shape step per depth set."""
    drafter = EagleDrafter(untrained(target), target, *tree)
    engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=2, kv_block_size=4))
    real = drafter.propose

    def guarded(state):
        def sync(*args):
            raise AssertionError("host sync in propose")

        with pytest.MonkeyPatch.context() as mp:
            for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
                mp.setattr(torch.Tensor, name, sync)
            tree_ = real(state)
        check_valid_tree(tree_, drafter.tree_depth, drafter.tree_budget)
        return tree_

    monkeypatch.setattr(drafter, "propose", guarded)
    engine.generate(PROMPTS)


def test_rerank_keeps_parents_of_tied_children():
    """A child whose log-prob is exactly 0 ties its parent: the stable sort keeps the parent first."""
    tok = torch.tensor([[1, 2, 3, 4]])
    score = torch.tensor([[-1.0, -2.0, -1.0, -1.0]])  # node 2 (child of 0) and node 3 (child of 2) tie with 0
    tokens, parents, depths = rerank(tok, score, torch.tensor([[-1, -1, 0, 2]]), torch.tensor([[1, 1, 2, 3]]), 2)
    assert tokens.tolist() == [[1, 3]] and parents.tolist() == [[-1, 0]] and depths.tolist() == [[1, 2]]


def test_the_next_frontier_breaks_ties_like_the_ranking_kernel():
    """A level picks its next frontier with a stable descending sort (inductor fuses it with the scores' sum): the K
    best, exactly equal scores to the earlier child, the rule of `kernels.fused_topk`'s kernel on a GPU."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 1, (64, 16), generator=g).float()  # many exact ties
    values, idx = scores.sort(dim=-1, descending=True, stable=True)
    want = [sorted(range(16), key=lambda i: (-row[i], i))[:4] for row in scores.tolist()]
    assert idx[:, :4].tolist() == want
    assert torch.equal(values[:, :4], scores.gather(1, torch.tensor(want)))


def _greedy_after_root(tree, target_probs, uniforms):
    """Lossy: a draw from p at the root, then the argmax at every node (a rule that is not sampling p)."""
    import workbench.engine.verify as verify_module

    choice = torch.cat([verify_module.sample_rows(target_probs[:, :1], uniforms[:, :1]),
                        target_probs[:, 1:].argmax(-1)], 1)
    return verify_module.accept_choices(tree, choice)


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["eager", "captured-step"])
@pytest.mark.parametrize("lossy, hot", [(False, 0), (True, 0), (False, 5)], ids=["exact", "lossy-argmax", "hot-5"])
def test_sampled_dynamic_trees_follow_the_target_distribution(lossy, hot, fixed_shape, monkeypatch):
    """Temperature 1, deterministic top-k children (draft_probs None): the joint of the two tokens after the prefill
    token, over a batch of identical prompts, matches the target's exact joint (chi-square), on the eager path and
    through the captured tree step (its body; the batch is above every bucket); also drafting from a hot vocabulary
    of 5 of the 8 tokens (hot_vocab). The same check rejects a lossy rule (argmax instead of a draw below the root),
    so it has power."""
    import workbench.engine.verify as verify_module

    if lossy:
        monkeypatch.setattr(verify_module, "accept_sampled_candidates", _greedy_after_root)
    small = random_model(vocab=8, hidden=16, layers=1, heads=2, kv_heads=1, seed=5, std=0.8)
    params = SamplingParams(temperature=1.0)
    prompt, n = [1, 2, 3, 1, 2], 3000
    head = EagleHead.for_target(small, seed=7, std=0.5)
    head.set_hot_tokens(torch.tensor([6, 1, 4, 0, 7, 2, 3, 5]))  # tokens 2, 3, 5 are never drafted with hot = 5
    engine = SpecEngine(small, EagleDrafter(head, small, 2, 3, 6, hot_vocab=hot), EngineConfig(
        max_new_tokens=3, sampling=params, seed=11, cuda_graphs=fixed_shape, graph_batch_sizes=(1, 2)))
    res = engine.generate([prompt] * n)
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
    assert sel.shape[0] > 500
    pvalue = chi_square_pvalue(counts, joint.flatten())
    assert sum(sum(s.accepted) for s in res.steps) > 0
    if lossy:
        assert pvalue < 1e-6
    else:
        assert pvalue > 1e-3


# ---- named errors --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree, message", [
    ((4, 4, 3), "tree_budget=3 is below tree_depth=4"),
    ((2, 0, 4), "tree_topk must be a whole number >= 1, got 0"),
    ((0, 2, 4), "tree_depth must be a whole number >= 1, got 0"),
    ((3, 2, 11), "tree_budget=11 exceeds the 10 candidates that tree_depth=3, tree_topk=2 offer"),
    ((2, 65, 70), "tree_topk=65 exceeds the vocabulary (64 tokens)"),
    ((2, 2.5, 4), "tree_topk must be a whole number >= 1, got 2.5"),
])
def test_bad_tree_settings_are_named(tree, message, target):
    with pytest.raises(EagleSettingsError) as e:
        EagleDrafter(untrained(target), target, *tree)
    assert str(e.value).startswith(message)


def test_the_registry_names_a_tree_the_vocabulary_cannot_fill_as_a_drafter_error(target):
    """Every caller of make_drafter (bench, serving, studies) catches one error class for a drafter that cannot be
    built."""
    values = {"tree_depth": 2, "tree_topk": 65, "tree_budget": 70}  # the tiny test target has 64 tokens
    with pytest.raises(DrafterError, match=r"tree_topk=65 exceeds the vocabulary \(64 tokens\)"):
        make_drafter("eagle", values, target=target, heads={"eagle": untrained(target)})


@pytest.mark.parametrize("values, message", [
    ({"method": "eagle", "tree_depth": 5, "tree_budget": 4}, "tree_budget=4 is below tree_depth=5"),
    ({"method": "eagle", "tree_depth": 3, "tree_topk": 1, "tree_budget": 4},
     "tree_budget=4 exceeds the 3 candidates that tree_depth=3, tree_topk=1 offer"),
    ({"method": "eagle", "tree_topk": 0}, "tree_topk=0 is outside what the engine supports: 1..16"),
    ({"method": "eagle", "tree_budget": 64}, "tree_budget=64 is outside what the engine supports: 1..63"),
])
def test_bad_settings_in_the_registry_are_named(values, message):
    with pytest.raises(SettingError) as e:
        check(values)
    assert str(e.value).startswith(message)
    check({"method": "draft", "tree_budget": 1, "tree_depth": 9})  # only eagle reads the tree knobs


def test_registry_capacity_agrees_with_the_engine():
    from workbench import settings

    for d in range(1, 8):
        for k in range(1, 8):
            assert settings.tree_capacity(d, k) == tree_capacity(d, k)
            check_tree(d, k, tree_capacity(d, k))
            check({"method": "eagle", "tree_depth": d, "tree_topk": k, "tree_budget": min(tree_capacity(d, k), 63)})


def test_head_for_another_target_shape_is_refused(target):
    other = random_model(vocab=64, hidden=16, layers=1, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="hidden size 16 / head dim 8, the target 32 / 8"):
        EagleDrafter(EagleHead.for_target(other), target)


def test_head_save_and_load_round_trip(target, tmp_path):
    head = EagleHead.for_target(target, seed=9)
    head.save(tmp_path / "head")
    back = EagleHead.load(tmp_path / "head")
    assert back.config == head.config
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        EagleHead.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="describes a 'redrafter' head, not an EAGLE head"):
        EagleHead.load(TINY / "redrafter")


# ---- the committed tiny head, the bench and the CLI ----------------------------------------------------------------
def small_cfg(**kw):
    from workbench.harness.bench import BenchConfig

    base = dict(method="eagle", batch=2, max_new_tokens=24, num_prompts=4, warmup=0, repeats=1, tree_depth=4,
                tree_topk=4, tree_budget=16)
    base.update(kw)
    return BenchConfig(**base)


def test_committed_head_is_small_and_fits_the_committed_target():
    from workbench.models import tokenizer_fingerprint
    from workbench.zoo.heads import check_head, has_head, head_dir_for_target

    assert has_head(HEAD) and head_dir_for_target(TINY / "target", "eagle") == HEAD.resolve()
    assert sum((HEAD / f).stat().st_size for f in ("config.json", "model.safetensors", "manifest.json")) < 5e6
    manifest = check_head(HEAD, TINY / "target", tokenizer_fingerprint(TINY / "target"))
    held = manifest["heldout"]
    assert manifest["kind"] == "eagle" and len(held["agreement_by_depth"]) == 3
    assert held["agreement_by_depth"][0] > held["untrained_agreement_by_depth"][0] + 0.1


def test_committed_head_drafts_accepted_tokens_and_stays_exact():
    """The bench loads the head beside the tiny target; greedy output equals AR and more than one token per target
    step is emitted on the tiny prompts (measured)."""
    from workbench.harness.bench import BenchSession

    session = BenchSession.load(preset="tiny", device="cpu")
    rec = session.run(small_cfg()).record
    assert rec["greedy_matches_ar"] is True and rec["draft_path"] == str(HEAD.resolve())
    assert rec["mean_accepted_tokens"] > 1.3
    assert rec["tree_size_mean"] == 16 and rec["draft_target_cost_ratio"] is not None
    assert (rec["tree_depth"], rec["tree_topk"], rec["tree_budget"]) == (4, 4, 16)
    session._eagle = (EagleHead.for_target(session.target, seed=0), "untrained (seed 0)")
    untrained_rec = session.run(small_cfg(tree_depth=3)).record  # another engine: the untrained head drafts
    assert untrained_rec["greedy_matches_ar"] is True
    assert rec["mean_accepted_tokens"] > untrained_rec["mean_accepted_tokens"]


def _copy_preset(tmp_path) -> Path:
    root = tmp_path / "tiny"
    (root / "target").mkdir(parents=True)
    for f in (TINY / "target").iterdir():
        (root / "target" / f.name).symlink_to(f)
    shutil.copytree(HEAD, root / "eagle")
    return root


def test_head_trained_for_another_target_is_refused_by_name(tmp_path):
    from workbench.harness.bench import BenchError, BenchSession

    root = _copy_preset(tmp_path)
    manifest = json.loads((root / "eagle" / "manifest.json").read_text())
    manifest["target"]["id"] = "0123456789abcdef"
    (root / "eagle" / "manifest.json").write_text(json.dumps(manifest))
    session = BenchSession.load(model=str(root / "target"), device="cpu", prompts=str(TINY / "prompts.jsonl"))
    with pytest.raises(BenchError, match=r"was trained for target 0123456789abcdef, not .*retrain with zoo train-head"):
        session.run(small_cfg())
    manifest["target"]["id"] = json.loads((HEAD / "manifest.json").read_text())["target"]["id"]
    manifest["tokenizer"]["sha256"] = "f" * 64
    (root / "eagle" / "manifest.json").write_text(json.dumps(manifest))
    session = BenchSession.load(model=str(root / "target"), device="cpu", prompts=str(TINY / "prompts.jsonl"))
    with pytest.raises(BenchError, match="was trained for tokenizer ffff"):
        session.run(small_cfg())


def test_train_head_cli_end_to_end(tmp_path):
    """The path the GPU run takes (`--device cuda --max-seconds 60`), here on CPU and capped at 3 steps."""
    from workbench.__main__ import main
    from workbench.models import tokenizer_fingerprint
    from workbench.zoo.heads import check_head, has_head

    out = tmp_path / "eagle"
    rc = main(["zoo", "train-head", "--kind", "eagle", "--preset", "tiny", "--device", "cpu", "--max-seconds", "60",
               "--max-steps", "3", "--train-windows", "16", "--eval-windows", "2", "--out", str(out)])
    assert rc == 0 and has_head(out)
    m = json.loads((out / "manifest.json").read_text())
    assert m["kind"] == "eagle" and m["train"]["steps"] == 3 and m["recipe"]["max_seconds"] == 60
    assert len(m["heldout"]["agreement_by_depth"]) == m["recipe"]["depth"]
    # a head written elsewhere still names the committed target: it would be accepted beside it
    m["target"]["path"] = "unused"
    (out / "manifest.json").write_text(json.dumps(m))
    check_head(out, TINY / "target", tokenizer_fingerprint(TINY / "target"))
    EagleHead.load(out)
    assert main(["zoo", "train-head", "--kind", "eagle", "--preset", "tiny", "--max-seconds", "0"]) == 2


def test_studies_search_valid_trees():
    """A study over eagle only proposes trees the engine accepts (tree_budget narrowed to depth..capacity)."""
    import optuna

    from studies.space import IntRange, SearchSpace, SpaceError

    space = SearchSpace(methods=("eagle",), tree_depth=IntRange(1, 6), tree_topk=IntRange(1, 3),
                        tree_budget=IntRange(4, 40))
    space.validate()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for _ in range(40):
        trial = study.ask()
        params = space.suggest(trial)
        check(params)
        study.tell(trial, 0.0)
    with pytest.raises(SpaceError, match="tree_budget .at most 3. is below tree_depth .at least 4."):
        SearchSpace(methods=("eagle",), tree_depth=IntRange(4, 6), tree_budget=3).validate()
