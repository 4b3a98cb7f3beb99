"""Engine conformance: every drafter reproduces plain greedy decoding token for token; caches agree; sampling is
lossless end to end."""
import copy

import pytest
import torch

from tests.test_verify import chi_square_pvalue
from workbench.engine.drafters import DraftModelDrafter, EagleDrafter, EagleHead, NgramDrafter, RedrafterDrafter, RedrafterHead
from workbench.engine.drafters import make_drafter as registry_drafter
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.kv_cache import ContiguousKVCache, PagedKVCache
from workbench.models import CausalAttention, LlamaModel, ModelConfig
from workbench.engine.sampling import SamplingParams, probs_from_logits


def random_model(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, seed=0, std=0.3) -> LlamaModel:
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512)
    model = LlamaModel(cfg)
    # a larger init than training's 0.02 gives peaked, input-dependent distributions: greedy paths branch a lot
    model.reset_parameters(std=std, generator=torch.Generator().manual_seed(seed))
    return model.eval()


@pytest.fixture(scope="module")
def target():
    return random_model(seed=1)


@pytest.fixture(scope="module")
def draft():
    return random_model(hidden=16, layers=1, heads=2, kv_heads=1, seed=2)


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Cache-free reference: recompute the whole sequence each token with causal attention."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids])
            h = model(x, torch.arange(len(ids)).unsqueeze(0), CausalAttention())
            ids.append(int(model.compute_logits(h[0, -1]).argmax()))
    return ids[len(prompt):]


PROMPTS = [[3, 9, 4, 1, 3, 9, 4, 1, 3], [7, 7, 2], [5, 11, 13, 5, 11, 13, 5, 11, 6, 2, 8, 30]]


def make_drafter(kind, draft_model, target_model):
    """The test drafters, built through the one registry (workbench.engine.drafters.make_drafter): each kind is a
    method, its knobs and its models (self-draft variants hand the registry a copy of the target as the draft)."""
    if kind in ("self-draft", "noisy-self-draft"):  # every draft accepted (bonus path) / partial acceptance
        model = copy.deepcopy(target_model)
        if kind == "noisy-self-draft":
            g = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for w in model.parameters():
                    w.add_(torch.randn(w.shape, generator=g) * 0.02 * w.std())
        return registry_drafter("draft", {"k": 4}, draft=model)
    if kind.startswith("redrafter"):  # an untrained head: few drafts accepted, but trees, hidden states, KV moves run
        w, length, penalty = {"redrafter-w1": (1, 4, 0.0), "redrafter-w3": (3, 3, 0.0),
                              "redrafter-diverse": (3, 2, 1.0)}[kind]
        return registry_drafter("redrafter", {"beam_width": w, "beam_length": length, "diversity_penalty": penalty},
                                target=target_model,
                                heads={"redrafter": RedrafterHead.for_target(target_model, seed=4, std=0.3)})
    values = {"draft": {"k": 3}, "ngram": {"k": 3, "ngram_min": 1, "ngram_max": 3},
              # an untrained head: a dynamic tree of 16 nodes, depth 4, top-4
              "eagle": {"tree_depth": 4, "tree_topk": 4, "tree_budget": 16},
              # the same from the 24 lowest ids only (the untrained head's ranking: id order)
              "eagle-hot": {"tree_depth": 4, "tree_topk": 4, "tree_budget": 16, "hot_vocab": 24}}.get(kind, {})
    kind = "eagle" if kind == "eagle-hot" else kind
    return registry_drafter(kind, values, draft=draft_model, target=target_model,
                            heads={"eagle": lambda: EagleHead.for_target(target_model, seed=4, std=0.3)})


DRAFTERS = ["ar", "draft", "self-draft", "noisy-self-draft", "ngram", "redrafter-w1", "redrafter-w3",
            "redrafter-diverse", "eagle"]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("kind", DRAFTERS)
def test_greedy_output_equals_autoregressive(kind, paged, target, draft):
    n = 20
    expected = [reference_greedy(target, p, n) for p in PROMPTS]
    engine = SpecEngine(target, make_drafter(kind, draft, target),
                        EngineConfig(max_new_tokens=n, paged=paged, kv_block_size=4))
    # batch 1 and a ragged batch (different prompt lengths, different acceptance per step)
    for p, e in zip(PROMPTS, expected):
        assert engine.generate([p]).outputs == [e]
    res = engine.generate(PROMPTS)
    assert res.outputs == expected
    if kind == "noisy-self-draft":  # the test really covers partial acceptance
        accepted = [a for s in res.steps for a in s.accepted]
        assert 0 in accepted and 4 in accepted and any(0 < a < 4 for a in accepted)
    if kind == "self-draft":
        assert sum(sum(s.accepted) for s in res.steps) > 0.8 * sum(sum(s.drafted) for s in res.steps)


def test_self_draft_accepts_everything(target):
    engine = SpecEngine(target, DraftModelDrafter(copy.deepcopy(target), k=4), EngineConfig(max_new_tokens=21))
    res = engine.generate([PROMPTS[0]])
    assert all(s.accepted == [4] for s in res.steps)
    assert len(res.steps) == 4  # 1 token from prefill + 4 steps x 5 tokens


def test_finished_sequences_leave_the_batch(target, draft):
    engine = SpecEngine(target, make_drafter("draft", draft, target), EngineConfig(max_new_tokens=12))
    res = engine.generate(PROMPTS)
    sizes = [len(s.rows) for s in res.steps]
    assert sizes[0] == 3 and sizes == sorted(sizes, reverse=True)
    assert all(len(o) == 12 for o in res.outputs)


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("kind", ["ar", "draft", "ngram", "redrafter-w3", "eagle"])
def test_one_host_read_per_step(kind, fixed, target, draft, monkeypatch):
    """generate's synchronous loop (SpecEngine.decode_step) reads the device once per step: the packed accepted /
    drafted / emitted counts (and, for trees, the path ranks and beam pairs) in one `HostCopy` (launch_step), and
    nothing else is read to the host per step (no `.cpu()` or `.item()`; `.tolist()` is the read's own unpacking)."""
    import workbench.engine.step as step_module

    reads, other = [], []
    real_init = step_module.HostCopy.__init__

    def counting_init(self, t):
        reads.append(tuple(t.shape))
        real_init(self, t)

    def counting(name):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            other.append(name)
            return real(self, *args, **kwargs)
        return wrapper

    # the synchronous step (overlapped steps read one step behind: tests/test_fast_path.py)
    engine = SpecEngine(target, make_drafter(kind, draft, target),
                        EngineConfig(max_new_tokens=9, cuda_graphs=fixed, kv_block_size=4, overlap=False))
    engine.generate(PROMPTS)  # warm-up: caches, buffers and steps are built outside the count
    monkeypatch.setattr(step_module.HostCopy, "__init__", counting_init)
    for name in ("cpu", "item"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    res = engine.generate(PROMPTS)
    assert other == [], other  # (tolist: the host side of the read, and the prefill's first tokens, use it)
    monkeypatch.undo()
    assert len(reads) == len(res.steps) and [r[0] for r in reads] == [len(s.rows) for s in res.steps]
    assert res.outputs == [reference_greedy(target, p, 9) for p in PROMPTS]


def test_step_records_cap_at_eos_and_max_new_tokens(target, draft):
    """A StepRecord's `emitted` counts the tokens kept (cut after EOS or at max_new_tokens), its `accepted` the
    verifier's; a sequence stopped by EOS leaves the batch at that step."""
    import doctest

    import workbench.engine.step as step_module

    assert doctest.testmod(step_module).failed == 0  # cap_emitted's worked examples
    n = 12
    free_run = SpecEngine(target, make_drafter("self-draft", draft, target), EngineConfig(max_new_tokens=n))
    full = free_run.generate(PROMPTS).outputs
    eos = full[1][4]  # stops the second prompt mid-step (a self-draft accepts 4 + 1 per step)
    engine = SpecEngine(target, make_drafter("self-draft", draft, target),
                        EngineConfig(max_new_tokens=n, stop_on_eos=True, eos_token_id=eos))
    res = engine.generate(PROMPTS)
    for out, ref in zip(res.outputs, full):
        assert out == (ref[:ref.index(eos) + 1] if eos in ref else ref)
    assert res.outputs[1][-1] == eos and len(res.outputs[1]) < n  # the example stops the second prompt early
    for i, out in enumerate(res.outputs):
        kept = [e for s in res.steps for row, e in zip(s.rows, s.emitted) if row == i]
        assert 1 + sum(kept) == len(out)  # the first token comes from the prefill
        steps_in = [k for k, s in enumerate(res.steps) if i in s.rows]
        assert steps_in == list(range(len(steps_in)))  # it leaves the batch once and for all
        for m in range(1, len(kept)):  # before its last step, the sequence was not finished
            assert 1 + sum(kept[:m]) < n and eos not in out[:1 + sum(kept[:m])]
    assert all(e <= a + 1 for s in res.steps for a, e in zip(s.accepted, s.emitted))
    assert any(e < a + 1 for s in res.steps for a, e in zip(s.accepted, s.emitted))  # a step was cut


def test_paged_cache_frees_and_reuses_blocks(target, draft, monkeypatch):
    import workbench.engine.step as engine_module

    made = []
    real_make_cache = engine_module.make_cache

    def recording_make_cache(*args, **kwargs):
        made.append(real_make_cache(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(engine_module, "make_cache", recording_make_cache)
    engine = SpecEngine(target, make_drafter("draft", draft, target),
                        EngineConfig(max_new_tokens=8, paged=True, kv_block_size=2))
    engine.generate(PROMPTS)
    [used] = made
    assert isinstance(used, PagedKVCache)
    assert used.free_blocks == used.num_blocks  # every finished sequence returned all of its blocks
    cache = PagedKVCache(1, 1, 2, max_rows=2, max_len=8, dtype=torch.float32, device="cpu", block_size=2)
    cache._ensure_capacity([0, 1], [0, 0], 7)
    assert cache.free_blocks == 8 - 8
    cache.truncate(0, 3)
    assert cache.free_blocks == 2
    cache.free(1)
    assert cache.free_blocks == 6


def test_paged_and_contiguous_attention_agree():
    torch.manual_seed(0)
    kw = dict(num_layers=1, num_kv_heads=2, head_dim=8, max_rows=3, max_len=40, dtype=torch.float32, device="cpu")
    caches = [ContiguousKVCache(**kw), PagedKVCache(**kw, block_size=3)]
    rows = torch.tensor([2, 0])
    outs = []
    for cache in caches:
        torch.manual_seed(1)
        res = []
        base = [0, 0]
        for t in [5, 1, 3, 1]:  # prefill 5, then steps; second step uses a tree mask
            mask = None
            if t == 3:
                mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
            cache.begin(rows, torch.tensor(base), base, t, mask)
            q, k, v = torch.randn(2, 4, t, 8), torch.randn(2, 2, t, 8), torch.randn(2, 2, t, 8)
            res.append(cache.attend(0, q, k, v))
            base = [b + t for b in base]
        outs.append(res)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def test_bad_settings_raise_before_work(target, draft):
    with pytest.raises(ValueError, match="k"):
        DraftModelDrafter(draft, k=0)
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(k=2, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        EngineConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)


@pytest.mark.parametrize("kind", ["draft", "ngram", "redrafter"])
def test_sampled_speculation_follows_target_distribution(kind, target, draft):
    """End to end, temperature 1: the joint of the first two generated tokens after the prefill token, from a batch
    of identical prompts, matches the target's exact joint distribution (chi-square)."""
    small_target = random_model(vocab=8, hidden=16, layers=1, heads=2, kv_heads=1, seed=5, std=0.8)
    small_draft = random_model(vocab=8, hidden=16, layers=1, heads=2, kv_heads=1, seed=6, std=0.8)
    params = SamplingParams(temperature=1.0)
    prompt = [1, 2, 3, 1, 2]
    n = 3000
    drafter = {"draft": lambda: DraftModelDrafter(small_draft, k=3),
               "ngram": lambda: NgramDrafter(k=3, min_n=1, max_n=2),
               # beams of deterministic candidates (3 of the 8 tokens at depth 1): the sampled tree rule end to end
               "redrafter": lambda: RedrafterDrafter(RedrafterHead.for_target(small_target, seed=7, std=0.5),
                                                     small_target, beam_width=3, beam_length=2)}[kind]()
    engine = SpecEngine(small_target, drafter, EngineConfig(max_new_tokens=3, sampling=params, seed=11))
    res = engine.generate([prompt] * n)
    outs = torch.tensor(res.outputs)  # [n, 3]: token 0 from prefill, tokens 1-2 from speculative steps
    # exact target distribution of (t1, t2) given the prefill token t0, for the most common t0
    t0 = int(torch.mode(outs[:, 0]).values)
    sel = outs[outs[:, 0] == t0]
    with torch.no_grad():
        ctx = torch.tensor(prompt + [t0])
        def dist(ids):
            h = small_target(ids.unsqueeze(0), torch.arange(len(ids)).unsqueeze(0))
            return probs_from_logits(small_target.compute_logits(h[0, -1]), params)
        p1 = dist(ctx)
        joint = torch.stack([p1[a] * dist(torch.cat([ctx, torch.tensor([a])])) for a in range(8)])  # [8, 8]
    counts = torch.bincount(sel[:, 1] * 8 + sel[:, 2], minlength=64).float()
    assert sel.shape[0] > 500
    assert chi_square_pvalue(counts, joint.flatten()) > 1e-3
    assert sum(sum(s.accepted) for s in res.steps) > 0  # drafts were really accepted (not only recovered tokens)


class TwoBranchDrafter(DraftModelDrafter):
    """Test drafter that proposes a real tree: the n-gram lookup's chain (k nodes) as one branch and the draft
    model's greedy chain as a second branch from the root, e.g. k = 3:
        token_ids = [g1, g2, g3, d1, d2, d3]; parents = [-1, 0, 1, -1, 3, 4]; depths = [1, 2, 3, 1, 2, 3]
    so the engine's tree path (tree mask, depth positions, KV move of an accepted second branch) runs end to end."""

    proposes_chains = False

    def __init__(self, model, k):
        super().__init__(model, k)
        self.ngram = NgramDrafter(k, 1, 3)
        self.num_nodes = 2 * k

    def propose(self, state):
        from workbench.engine.tree import DraftTree

        b = super().propose(state)
        a = self.ngram.propose(state)
        k = self.k
        bsz = a.token_ids.shape[0]
        par_b = torch.cat([torch.tensor([-1]), torch.arange(k, 2 * k - 1)])
        parents = torch.cat([a.parents, par_b.expand(bsz, k)], 1)
        depths = torch.cat([a.depths, b.depths], 1)
        return DraftTree(torch.cat([a.token_ids, b.token_ids], 1), parents, depths,
                         torch.cat([a.valid, b.valid], 1), None, is_chain=False)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_tree_drafts_reproduce_greedy_output(paged, target, monkeypatch):
    import workbench.engine.step as engine_module

    first_nodes = []
    accept = engine_module.Verifier.accept

    def spy(self, tree, logits):
        acc = accept(self, tree, logits)
        first_nodes.extend(acc.path_nodes[:, 0].tolist())
        return acc

    monkeypatch.setattr(engine_module.Verifier, "accept", spy)
    n = 20
    noisy = make_drafter("noisy-self-draft", None, target).model
    engine = SpecEngine(target, TwoBranchDrafter(noisy, k=3), EngineConfig(max_new_tokens=n, paged=paged,
                                                                            kv_block_size=4))
    res = engine.generate(PROMPTS)
    assert res.outputs == [reference_greedy(target, p, n) for p in PROMPTS]
    # the second branch (node 3 on) won some steps, so accepted KV really moved down to depth slots
    assert 3 in first_nodes


def test_paged_pool_is_sized_to_the_prompts_not_the_longest_row(target, monkeypatch):
    import workbench.engine.step as engine_module

    made = []
    real = engine_module.make_cache

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(engine_module, "make_cache", spy)
    prompts = [[1] * 60, [2] * 3, [3] * 3]
    engine = SpecEngine(target, None, EngineConfig(max_new_tokens=4, paged=True, kv_block_size=4))
    assert engine.generate(prompts).outputs == [reference_greedy(target, p, 4) for p in prompts]
    pool = made[0]
    worst_case = pool.max_rows * pool.blocks_per_row
    steps_need = sum(-(-engine.required_len(len(p)) // 4) for p in prompts)  # 17 + 3 + 3 blocks
    prefill_need = len(prompts) * -(-60 // 4)  # the right-padded prefill: 15 blocks in each of 3 rows
    assert pool.num_blocks == max(steps_need, prefill_need) < worst_case
    assert pool.free_blocks == pool.num_blocks  # every block came back when the sequences finished


def test_phase_timer_records_into_spare_cuda_events_across_calls(monkeypatch):
    """generate's timer draws CUDA events from a list the engine keeps: created on the first call, reused after each
    resolve (never while they may still be pending), with the same totals. Fake events: one clock tick per record."""
    from workbench.engine.step import PhaseTimer

    ticks, made = iter(range(10_000)), []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            made.append(self)

        def record(self):
            self.t = next(ticks)

        def elapsed_time(self, end):
            return float(end.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    spare, totals = [], []
    for _ in range(3):
        timer = PhaseTimer(torch.device("cuda"), True, spare)
        for name in ("draft", "verify", "draft"):
            with timer.phase(name):
                pass
        assert len({id(e) for _, s, e in timer._events} | {id(s) for _, s, e in timer._events}) == 6  # none twice
        totals.append(timer.resolve())
    assert len(made) == 6  # the first call's three pairs, recorded again by the next two calls
    assert all(t["draft"] == 2.0 and t["verify"] == 1.0 for t in totals)
    fresh = PhaseTimer(torch.device("cuda"), True)  # no list given: events of its own, as before
    with fresh.phase("kv"):
        pass
    assert len(made) == 8 and fresh.resolve()["kv"] == 1.0


def test_block_table_uploads_do_not_wait_for_the_device():
    """A block allocated between steps reaches the device table without a blocking copy (which would wait for every
    step in flight); the table still holds the host's blocks."""
    cache = PagedKVCache(1, 1, 2, max_rows=2, max_len=8, dtype=torch.float32, device="cpu", block_size=2)
    table, modes = cache.block_table, []
    real = table.copy_
    table.copy_ = lambda src, non_blocking=False: modes.append(non_blocking) or real(src, non_blocking=non_blocking)
    cache.plan([0, 1], [0, 2], 3)  # row 0 needs 2 blocks, row 1 needs 3
    assert modes == [True]
    assert [table[r, :len(b)].tolist() for r, b in enumerate(cache._host_table[:2])] == cache._host_table[:2]
    assert [len(b) for b in cache._host_table[:2]] == [2, 3]


def test_block_table_upload_is_one_copy_of_the_host_image(monkeypatch):
    """Each upload of the block table is one copy of a host image refreshed only in the rows that changed (taken,
    dropped, re-taken blocks; a prefix cache's attached blocks): no tensor is built per cache row (about 5 host ops
    per row per upload before: 190 per serving iteration on tiny). After any such sequence the device table
    is every row's host blocks, then zeros; the padding row keeps its own blocks."""
    from workbench.engine import kv_cache as kv_mod
    from workbench.serving.prefix_cache import PrefixCachingKVCache

    made = []
    real_tensor = torch.tensor
    monkeypatch.setattr(kv_mod.torch, "tensor", lambda *a, **kw: made.append(1) or real_tensor(*a, **kw))
    cache = PagedKVCache(1, 1, 2, max_rows=3, max_len=12, dtype=torch.float32, device="cpu", block_size=2)

    def expect(c):
        rows = [b + [0] * (c.blocks_per_row - len(b)) for b in c._host_table]
        assert c.block_table.tolist() == rows

    cache.plan([0, 1, 2], [0, 2, 4], 3)  # 2, 3 and 4 blocks
    expect(cache)
    cache.truncate(1, 1)  # row 1 drops to one block: the device keeps stale entries until the next upload
    cache.free(2)
    cache.plan([0, 1], [3, 1], 4)  # row 0 grows to 4 blocks, row 1 back to 3 (blocks reused from rows 1 and 2)
    expect(cache)
    assert cache.block_table[cache.pad_row].tolist() == cache._host_table[-1]
    assert made == [], "a tensor built per row"
    shared = PrefixCachingKVCache(1, 1, 2, max_rows=2, max_len=8, dtype=torch.float32, device="cpu", block_size=2)
    shared.plan([0], [0], 6)
    shared.register(0, list(range(6)), 6)
    shared.attach(1, shared.match(list(range(6)), 2))  # row 1 starts with row 0's first two blocks
    expect(shared)
    assert shared._host_table[1] == shared._host_table[0][:2] and made == []
