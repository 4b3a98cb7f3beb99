"""Tensor parallelism on CPU: two gloo ranks give the single-process engine's greedy outputs token for token."""
import argparse
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from workbench.engine import EngineConfig, SpecEngine
from workbench.engine.drafters import EagleHead, RedrafterHead, make_drafter
from workbench.engine.tp import TensorParallelError, check_divides, free_port, init_tp, shard_llama_
from workbench.models import LlamaModel, ModelConfig

# the tiny preset's shape (8 heads, 4 KV heads, intermediate 640, hidden 256), 2 layers; an odd vocabulary
# exercises the LM head's padded last slice
TINY = dict(vocab_size=97, hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=256)
PROMPTS = [[3, 9, 4, 1, 3, 9, 4, 1, 3], [7, 7, 2], [5, 11, 13, 5, 11, 13, 5, 11, 6, 2, 8, 30]]
CASES = [(method, paged) for method in ("ar", "ngram", "draft") for paged in (True, False)] + \
    [("redrafter", True), ("eagle", True)]  # heads over the target's hidden states, replicated on every rank
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
        heads = {"redrafter": lambda: RedrafterHead.for_target(target, seed=4, std=0.3),
                 "eagle": lambda: EagleHead.for_target(target, seed=4, std=0.3)}  # sized from the full config
        values = {"k": 3, "ngram_min": 1, "ngram_max": 3, "beam_width": 2, "beam_length": 3, "tree_depth": 3,
                  "tree_topk": 3, "tree_budget": 8}
        drafter = make_drafter(method, values, draft=draft, target=target, heads=heads)
        engine = SpecEngine(target, drafter, EngineConfig(max_new_tokens=N, paged=paged, kv_block_size=4))
        with torch.no_grad():
            single = [engine.generate([p]) for p in PROMPTS]
            ragged = engine.generate(PROMPTS)
        # outputs, and the tokens accepted per step: the drafts too are the same on every rank as in one process
        out[(method, paged)] = ([r.outputs[0] for r in single], ragged.outputs,
                                [sum(s.accepted) for r in [*single, ragged] for s in r.steps])
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
    assert sum(expected[("draft", True)][2]) > 0 and sum(expected[("ngram", True)][2]) > 0  # drafts were accepted


def test_world_that_does_not_divide_is_named():
    cfg = ModelConfig(**TINY)
    check_divides(cfg, 4)  # 8 heads, 4 KV heads, 640: all divide
    with pytest.raises(TensorParallelError, match=r"tp_size=8 does not divide the model's num_key_value_heads=4"):
        check_divides(cfg, 8)
    with pytest.raises(TensorParallelError, match="intermediate_size=100"):
        check_divides(ModelConfig(**{**TINY, "intermediate_size": 100}), 8)
    with pytest.raises(TensorParallelError, match="tp_size=3 is not supported"):
        shard_llama_(_model(1), 0, 3)


# ---- the knob, the launcher and the bench ---------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
RUN = ["--preset", "tiny", "--device", "cpu", "--tp-size", "2", "--threads", "1", "--warmup", "0"]


def _bench(*args, store) -> list[str]:
    return [sys.executable, "-m", "workbench", "bench", *args, "--store", str(store)]


def test_tp_size_reaches_the_cli_and_the_schema():
    from results.schema import run_specs
    from workbench.harness import bench_cli
    from workbench.settings import KNOBS, SettingError

    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    assert parser.parse_args(["bench", "--tp-size", "2"]).tp_size == 2
    assert parser.parse_args(["bench"]).tp_size == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--tp-size", "3"])
    with pytest.raises(SettingError, match="tp_size=3 is not supported"):
        KNOBS["tp_size"].check(3)
    assert run_specs()["tp_size"].kind == "int" and run_specs()["tp_size"].group == "config"


def test_session_refuses_what_tp_does_not_run():
    from workbench.harness.bench import BenchConfig, BenchError, BenchSession

    session = BenchSession.load(preset="tiny", device="cpu")
    cfg = BenchConfig(method="ngram", tp_size=2, num_prompts=1, max_new_tokens=4, compile="off", cuda_graphs=False)
    with pytest.raises(BenchError, match=r"tp_size=2, but this session's target runs in 1 process"):
        session.check(cfg, session.encode(1))
    shard_llama_(session.target, 0, 2)  # no collective runs: check only reads the shard's world
    session.check(cfg, session.encode(1))
    with pytest.raises(BenchError, match=r"tp_size=2 does not run with target_quant=int8 .*; compile=default"):
        session.check(replace(cfg, compile="default", target_quant="int8"), session.encode(1))
    with pytest.raises(BenchError, match=r"tp_size=2 does not run with hot_vocab=512 \(each rank holds"):
        session.check(replace(cfg, method="eagle", hot_vocab=512), session.encode(1))


def test_bench_tp2_stores_one_row_with_tp_size(tmp_path):
    from results.store import ResultStore

    proc = subprocess.run(_bench(*RUN, "--method", "draft", "--num-prompts", "1", "--max-new-tokens", "12",
                                 "--repeats", "1", "--json", store=tmp_path),
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(proc.stdout)  # rank 0 alone prints
    assert rec["tp_size"] == 2 and rec["greedy_matches_ar"] is True and rec["mean_accepted_tokens"] > 1
    df = ResultStore(tmp_path).load()
    assert list(df["run_id"]) == [rec["run_id"]] and list(df["tp_size"]) == [2]


def _rank_pids(pid: int) -> list[int]:
    """The launcher's spawned rank processes (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return sorted(int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())


def test_a_killed_rank_ends_the_run_with_a_named_error(tmp_path):
    from results.store import ResultStore

    proc = subprocess.Popen(_bench(*RUN, "--method", "ngram", "--num-prompts", "8", "--max-new-tokens", "64",
                                   "--repeats", "5", store=tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for line in proc.stderr:  # rank 0's progress: the timed repeats have begun
            if "repeat 1/5" in line:
                break
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        t_kill = time.monotonic()
        os.kill(ranks[-1], signal.SIGKILL)
        rc = proc.wait(timeout=60)
        rest = proc.stderr.read()
    finally:
        proc.kill()
    assert time.monotonic() - t_kill < 60
    assert rc == 2
    assert re.search(r"error: tensor-parallel rank \d of 2 (died|failed)", rest), rest[-3000:]
    df = ResultStore(tmp_path).load()
    assert list(df["status"]) == ["failed"] and "tensor-parallel rank" in df["error"].iloc[0]
    assert list(df["tp_size"]) == [2]
