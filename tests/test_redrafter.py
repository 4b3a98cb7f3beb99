"""ReDrafter (workbench/engine/drafters/redrafter.py): the beam search against a brute-force one, the diversity penalty,
W = 1 as a chain, head save/load, named errors, and an oracle whose beams hold the target's continuation in the last
beam only, so every step accepts a whole beam that is not beam 0 (the tree KV move runs) and checks the hidden states
the engine hands over (the `wants_hidden` contract) against a cache-free recomputation."""
from pathlib import Path

import pytest
import torch

from tests.test_engine import PROMPTS, reference_greedy, target  # noqa: F401 (fixture)
from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import RedrafterDrafter, RedrafterHead, make_drafter
from workbench.engine.drafters.base import DraftContext
from workbench.engine.sampling import SamplingParams
from workbench.engine.tree import DraftTree
from workbench.models import CausalAttention


def drafter_for(target, w, length, penalty=0.0, sampling=SamplingParams()):
    d = make_drafter("redrafter", {"beam_width": w, "beam_length": length, "diversity_penalty": penalty},
                     target=target, heads={"redrafter": RedrafterHead.for_target(target, seed=4, std=0.3)})
    d.setup(DraftContext(max_rows=4, max_len=64, device=torch.device("cpu"), sampling=sampling, generator=None))
    torch.manual_seed(0)
    d.last_hidden.copy_(torch.randn_like(d.last_hidden))
    return d


@torch.no_grad()
def test_beam_search_equals_brute_force(target):
    """W = 3, L = 2: depth 1 keeps the 3 best tokens; depth 2 the 3 best (token, token) pairs among their children."""
    d = drafter_for(target, 3, 2)
    rows, root = torch.tensor([0, 2]), torch.tensor([5, 9])
    beams = d._search(rows, root)  # [B, 3, 2]
    for i in range(2):
        h = d.last_hidden[rows[i]].unsqueeze(0)
        s1, f1 = d.head(h, target.model.embed_tokens(root[i:i + 1]), h)
        logp1 = torch.log_softmax(target.compute_logits(f1)[0].float(), -1)
        first = logp1.topk(3).indices
        pairs = []
        for a in first.tolist():
            _, f2 = d.head(s1, target.model.embed_tokens(torch.tensor([a])), h)
            logp2 = torch.log_softmax(target.compute_logits(f2)[0].float(), -1)
            pairs += [(float(logp1[a] + logp2[b]), a, b) for b in range(logp2.shape[0])]
        best = sorted(pairs, reverse=True)[:3]
        assert beams[i].tolist() == [[a, b] for _, a, b in best]


@torch.no_grad()
def test_width_one_is_the_heads_greedy_chain(target):
    d = drafter_for(target, 1, 4)
    beams = d._search(torch.tensor([1]), torch.tensor([3]))
    tree, _ = DraftTree.from_beams(beams)
    assert tree.is_chain and tree.num_nodes == 4 and d.proposes_chains
    h = d.last_hidden[1:2]
    s, prev, chain = h, torch.tensor([3]), []
    for _ in range(4):
        s, f = d.head(s, target.model.embed_tokens(prev), h)
        prev = target.compute_logits(f).argmax(-1)
        chain.append(int(prev))
    assert beams[0, 0].tolist() == chain


@torch.no_grad()
def test_diversity_penalty_spreads_the_beams(target):
    """Worked example, W = 2, V = 3, candidate scores per (parent beam, token): plain beam search keeps token 0 twice;
    a penalty of 1 lowers the second token-0 candidate to -1.5, below (beam 1, token 2) at -0.6."""
    cand = torch.tensor([[-0.1, -3.0, -4.0, -0.5, -3.5, -0.6]])  # [B, W*V]
    selected = {p: drafter_for(target, 2, 1, p)._select(cand, 3) for p in (0.0, 0.05, 1.0)}
    assert {p: idx.tolist() for p, (_, idx) in selected.items()} == {0.0: [[0, 3]], 0.05: [[0, 3]], 1.0: [[0, 5]]}
    assert all(torch.equal(score, cand.gather(1, idx)) for score, idx in selected.values())  # a beam keeps its score
    sampled = drafter_for(target, 3, 2, sampling=SamplingParams(temperature=0.7, top_k=2))
    # top-k 2 < W: a third candidate has score -inf, and the search still runs
    beams = sampled._search(torch.arange(4), torch.tensor([1, 2, 3, 4]))
    assert beams.shape == (4, 3, 2) and (beams >= 0).all()


def test_head_save_and_load_round_trip(target, tmp_path):
    head = RedrafterHead.for_target(target, seed=9)
    head.save(tmp_path / "head")
    back = RedrafterHead.load(tmp_path / "head")
    assert back.config == head.config
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    with pytest.raises(FileNotFoundError, match="ReDrafter head .*nowhere: missing config.json"):
        RedrafterHead.load(tmp_path / "nowhere")
    eagle = Path(__file__).resolve().parents[1] / "workbench" / "zoo" / "weights" / "tiny" / "eagle"
    with pytest.raises(ValueError, match="describes a 'eagle' head, not a ReDrafter head"):  # not a KeyError
        RedrafterHead.load(eagle)


def test_bad_settings_are_named(target):
    head = RedrafterHead.for_target(target)
    with pytest.raises(ValueError, match="beam_width"):
        RedrafterDrafter(head, target, beam_width=0)
    with pytest.raises(ValueError, match="beam_length"):
        RedrafterDrafter(head, target, beam_length=0)
    with pytest.raises(ValueError, match="diversity_penalty"):
        RedrafterDrafter(head, target, diversity_penalty=-0.5)
    with pytest.raises(ValueError, match="diversity_penalty"):
        RedrafterDrafter(head, target, diversity_penalty=float("nan"))
    from workbench.models import LlamaModel, ModelConfig
    other = LlamaModel(ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="hidden size"):
        RedrafterDrafter(RedrafterHead.for_target(other), target)


class OracleRedrafter(RedrafterDrafter):
    """Beams: 0 wrong at depth 1; 1 right at depth 1, wrong at depth 2; 2 the target's greedy continuation. The tree
    is [beam 0: nodes 0..L-1] [beam 1: L..2L-1] [beam 2 shares node L, then 2L..]: the accepted path L, 2L, 2L+1, ...
    is not contiguous, so the engine must move its KV. Every call also checks `last_hidden` against a recomputation."""

    checked = 0

    def _search(self, rows, root):
        """The beams from the engine's device buffers (what the drafter's one step reads: on a CPU the fixed-shape
        step runs this eagerly, padding rows included)."""
        vocab, w = self.target.config.vocab_size, self.beam_width
        out = []
        for row in rows.tolist():
            if row == self.ctx.max_rows:  # a padding row of the fixed-shape step
                out.append([[0] * self.beam_length] * w)
                continue
            n = int(self.ctx.kv_len_all[row])
            seq = self.ctx.tokens[row, :n + 1].tolist()  # committed tokens, then the root
            assert seq[-1] == int(root[len(out)])
            h = self.target(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1).unsqueeze(0), CausalAttention())
            torch.testing.assert_close(self.last_hidden[row], h[0, -1], rtol=1e-4, atol=1e-4)
            self.checked += 1
            right = reference_greedy(self.target, seq, self.beam_length)
            wrong = [(t + 1) % vocab for t in right]
            out.append([wrong, right[:1] + wrong[1:], right])
        return torch.tensor(out, device=rows.device)


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_oracle_beams_accept_through_the_tree_kv_move(paged, cuda_graphs, target):
    n, length = 17, 3
    drafter = OracleRedrafter(RedrafterHead.for_target(target), target, beam_width=3, beam_length=length)
    engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=n, paged=paged, kv_block_size=4,
                                                      cuda_graphs=cuda_graphs, graph_batch_sizes=(1, 2, 4)))
    res = engine.generate(PROMPTS)
    assert res.outputs == [reference_greedy(target, p, n) for p in PROMPTS]
    assert all(a == length for s in res.steps for a in s.accepted)  # the whole last beam, every step
    assert all(d == 3 * length - 1 for s in res.steps for d in s.drafted)  # beams 1 and 2 share their first node
    assert drafter.checked == sum(len(s.rows) for s in res.steps)


def test_on_device_takes_cuda_for_the_current_card(monkeypatch):
    """`torch.device("cuda") != cuda:0`: compared that way, ReDrafter reallocated `last_hidden` in every setup on a GPU
    and every graph over it (its search, the engine's tree step) was captured again inside each generate."""
    from types import SimpleNamespace

    from workbench.engine.graphs import on_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    on0, on1 = SimpleNamespace(device=torch.device("cuda", 0)), SimpleNamespace(device=torch.device("cuda", 1))
    assert torch.device("cuda") != on0.device  # the comparison that went wrong
    assert on_device(on0, "cuda") and on_device(on0, torch.device("cuda:0")) and not on_device(on1, "cuda")
    assert on_device(on1, "cuda:1") and not on_device(on0, "cpu")
    assert on_device(torch.zeros(1), "cpu") and not on_device(torch.zeros(1), "cuda")


def test_setup_keeps_its_buffers_and_step_across_generates(target):
    """A second generate over the same engine reuses the drafter's `last_hidden`, its captured search and the engine's
    tree step (a rebuild recaptures them inside a timed run)."""
    drafter = make_drafter("redrafter", {"beam_width": 2, "beam_length": 3}, target=target,
                           heads={"redrafter": RedrafterHead.for_target(target, seed=4)})
    engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=6, cuda_graphs=True, graph_batch_sizes=(1, 2)))
    first = engine.generate(PROMPTS[:1])
    held = (drafter.last_hidden, drafter.step, engine.tree_step)
    second = engine.generate(PROMPTS[:1])
    assert second.outputs == first.outputs
    assert all(a is b for a, b in zip((drafter.last_hidden, drafter.step, engine.tree_step), held))
