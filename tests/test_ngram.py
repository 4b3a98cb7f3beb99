"""The n-gram drafter's two lookups: the host scan and the fixed-shape device lookup must propose the same tokens,
and the device lookup lets n-gram steps overlap (engine/drafters/ngram.py)."""
import doctest
import random

import pytest
import torch

import workbench.engine.drafters.ngram as ngram_module
from tests.test_engine import PROMPTS, draft, make_drafter, reference_greedy, target  # noqa: F401 (fixtures)
from tests.test_fast_path import fast
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import NgramDrafter
from workbench.engine.drafters.ngram import device_lookup, lookup


def test_worked_examples():
    assert doctest.testmod(ngram_module).failed == 0


@pytest.mark.parametrize("k,min_n,max_n", [(1, 1, 1), (3, 1, 3), (4, 2, 3), (5, 1, 4), (2, 3, 3)])
def test_device_lookup_equals_host_lookup(k, min_n, max_n):
    """Random histories of every length from 1 token up, small vocabularies (many matches, overlapping ones,
    matches right before the root) and a large one (few); garbage past the root must not matter."""
    rng = random.Random(k * 100 + min_n * 10 + max_n)
    s_len = 40
    for vocab in (2, 3, 5, 50):
        histories, roots = [], []
        for _ in range(64):
            length = rng.randint(1, s_len)
            histories.append([rng.randrange(vocab) for _ in range(length)] +
                             [rng.randrange(vocab) for _ in range(s_len - length)])  # garbage past the root
            roots.append(length - 1)
        ids, valid = device_lookup(torch.tensor(histories), torch.tensor(roots), k, min_n, max_n)
        for h, r, row_ids, row_valid in zip(histories, roots, ids.tolist(), valid.tolist()):
            want = lookup(h[:r + 1], k, min_n, max_n)
            got = [t for t, v in zip(row_ids, row_valid) if v]
            assert got == want, (h[:r + 1], k, min_n, max_n)
            assert row_valid == [True] * len(want) + [False] * (k - len(want))  # a prefix, the rest padding
            assert all(t == 0 for t, v in zip(row_ids, row_valid) if not v)


def test_device_lookup_at_the_buffer_edge():
    """A root at the buffer's last slot, and histories shorter than every n: no index leaves the buffer."""
    h = torch.tensor([[7, 8, 7, 8, 7, 8], [9, 0, 0, 0, 0, 0]])
    ids, valid = device_lookup(h, torch.tensor([5, 0]), 3, 1, 3)
    assert [t for t, v in zip(ids[0].tolist(), valid[0].tolist()) if v] == lookup([7, 8, 7, 8, 7, 8], 3, 1, 3)
    assert not valid[1].any()


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_fixed_shape_ngram_uses_the_device_lookup_and_proposes_as_the_host(paged, target, monkeypatch):
    """With fixed shapes every propose goes through the device step (the host scan is never called) and each
    step's drafts equal the host scan of the same history; outputs equal greedy decoding."""
    n = 20
    drafts = {}
    for fixed in (True, False):
        engine = SpecEngine(target, NgramDrafter(k=3), fast(max_new_tokens=n, paged=paged) if fixed else
                            EngineConfig(max_new_tokens=n, paged=paged, kv_block_size=4))
        calls = []
        real = ngram_module.lookup
        monkeypatch.setattr(ngram_module, "lookup", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        res = engine.generate(PROMPTS)
        monkeypatch.undo()
        assert res.outputs == [reference_greedy(target, p, n) for p in PROMPTS]
        assert (engine.drafter.step is not None) is fixed and (not calls) is fixed
        drafts[fixed] = [(s.rows, s.drafted, s.accepted) for s in res.steps]
        if fixed:
            assert res.graph_stats.misses == 0 and engine.drafter.step.stats.hits == len(res.steps)
    assert drafts[True] == drafts[False]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_ngram_overlaps_with_fixed_shapes(paged, target):
    """Overlapped n-gram steps (the lookup reads the device state step t wrote): the same tokens and per-step
    records as the synchronous loop, alone and in a ragged batch."""
    n = 19
    expected = [reference_greedy(target, p, n) for p in PROMPTS]
    runs = {}
    for overlap in (False, True):
        engine = SpecEngine(target, NgramDrafter(k=3), fast(max_new_tokens=n, paged=paged, overlap=overlap))
        singles = [engine.generate([p]) for p in PROMPTS]
        batch = engine.generate(PROMPTS)
        assert engine.overlaps() is overlap
        assert [r.outputs[0] for r in singles] == expected and batch.outputs == expected
        runs[overlap] = [[(s.rows, s.drafted, s.accepted, s.emitted) for s in r.steps] for r in singles + [batch]]
        assert any(d for r in singles + [batch] for s in r.steps for d in s.accepted)  # drafts were accepted
    assert runs[True] == runs[False]


def test_device_lookup_follows_new_engine_buffers(target):
    """When the engine grows its buffers (a longer call), the lookup step is rebuilt over the new ones."""
    engine = SpecEngine(target, NgramDrafter(k=3), fast(max_new_tokens=8))
    engine.generate(PROMPTS[:1])
    first = engine.drafter.step
    engine.generate([PROMPTS[0] * 6])  # a longer prompt: a bigger cache and new token buffers
    assert engine.drafter.step is not first and engine.drafter._state[0] is engine.tokens
    assert engine.generate(PROMPTS).outputs == [reference_greedy(target, p, 8) for p in PROMPTS]


def test_sampled_ngram_with_fixed_shapes_equals_the_host_scan(target, monkeypatch):
    """Sampling (acceptance outside the fused step): the device lookup's proposals, and so the seeded outputs, equal
    the host scan's in the same fixed-shape engine."""
    from workbench.engine.sampling import SamplingParams

    cfg = fast(max_new_tokens=64, sampling=SamplingParams(temperature=0.3, top_k=5), seed=5)
    outs = {}
    for device in (True, False):
        if not device:
            monkeypatch.setattr(NgramDrafter, "_on_device", lambda self: False)
        engine = SpecEngine(target, NgramDrafter(k=3), cfg)
        res = engine.generate(PROMPTS)
        assert (engine.drafter.step is not None) is device and not engine.overlaps()
        outs[device] = (res.outputs, [(s.drafted, s.accepted) for s in res.steps])
    assert outs[True] == outs[False]
    assert sum(d for ds, _ in outs[True][1] for d in ds) > 0 and sum(a for _, acc in outs[True][1] for a in acc) > 0
