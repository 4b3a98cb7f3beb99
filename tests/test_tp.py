"""Tensor parallelism on CPU: two gloo ranks give the single-process engine's greedy outputs token for token."""
import pickle

import pytest
import torch
import torch.multiprocessing as mp

from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import make_drafter
from workbench.engine.tp import TensorParallelError, check_divides, free_port, init_tp, shard_llama_
from workbench.models import LlamaModel, ModelConfig

# the tiny preset's shape (8 heads, 4 KV heads, intermediate 640, hidden 256), 2 layers; an odd vocabulary
# exercises the LM head's padded last slice
TINY = dict(vocab_size=97, hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=256)
PROMPTS = [[3, 9, 4, 1, 3, 9, 4, 1, 3], [7, 7, 2], [5, 11, 13, 5, 11, 13, 5, 11, 6, 2, 8, 30]]
CASES = [(method, paged) for method in ("ar", "ngram", "draft") for paged in (True, False)]
N = 16


def _model(seed: int, **over) -> LlamaModel:
    model = LlamaModel(ModelConfig(**{**TINY, **over}))
    model.reset_parameters(std=0.3, generator=torch.Generator().manual_seed(seed))  # peaked: greedy paths branch
    return model.eval()


def _outputs(target: LlamaModel) -> dict:
    """Every case's outputs, batch 1 per prompt and the ragged batch of all prompts."""
    out = {}
    draft = _model(2, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                   num_hidden_layers=1)  # replicated on every rank
    for method, paged in CASES:
        drafter = make_drafter(method, {"k": 3, "ngram_min": 1, "ngram_max": 3}, draft=draft, target=target)
        engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=N, paged=paged, kv_block_size=4))
        with torch.no_grad():
            out[(method, paged)] = ([engine.generate([p]).outputs[0] for p in PROMPTS],
                                    engine.generate(PROMPTS).outputs)
    return out


def _rank(rank: int, world: int, port: int, result_path: str) -> None:
    torch.set_num_threads(1)
    init_tp(rank, world, port, torch.device("cpu"), timeout_s=60)
    target = shard_llama_(_model(1), rank, world)
    assert target.config.num_key_value_heads == 4 // world
    out = _outputs(target)
    with open(f"{result_path}.{rank}", "wb") as f:
        pickle.dump(out, f)
    torch.distributed.destroy_process_group()


def test_tp2_greedy_equals_single_process(tmp_path):
    torch.set_num_threads(1)
    expected = _outputs(_model(1))
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path / "out")), nprocs=2, join=True)
    for rank in range(2):
        with open(tmp_path / f"out.{rank}", "rb") as f:
            got = pickle.load(f)
        for case in CASES:
            assert got[case] == expected[case], (rank, case)


def test_world_that_does_not_divide_is_named():
    cfg = ModelConfig(**TINY)
    check_divides(cfg, 4)  # 8 heads, 4 KV heads, 640: all divide
    with pytest.raises(TensorParallelError, match=r"tp_size=8 does not divide the model's num_key_value_heads=4"):
        check_divides(cfg, 8)
    with pytest.raises(TensorParallelError, match="intermediate_size=100"):
        check_divides(ModelConfig(**{**TINY, "intermediate_size": 100}), 8)
    with pytest.raises(TensorParallelError, match="tp_size=3 is not supported"):
        shard_llama_(_model(1), 0, 3)
