"""`python -m workbench bench --tp-size N`: one process per tensor-parallel rank, started here (no torchrun).

Every rank joins a loopback process group (workbench.engine.tp.init_tp: NCCL with GPU r on a GPU machine, gloo on a
CPU), loads the same session, shards its target for its rank and runs the same prompts with the same settings and
seed, so every drafter (replicated on each rank) and every acceptance decision is the same on all ranks. Rank 0 alone
prints and stores the row. A rank that fails or dies ends the run: the launcher stops the other ranks, names the rank
and why on stderr, stores a failed row and exits 2; a rank stuck in a collective fails after the process group's
timeout (workbench.engine.tp.TP_TIMEOUT_S) instead of hanging.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch
import torch.multiprocessing as mp

# what a rank reports back: (rank, message) of a rank that ended with a named error
_Report = tuple[int, str]


def rank_device(device: str, rank: int, world: int) -> str:
    """The device of rank `rank`: GPU r where the run asks for a GPU (--device auto on a GPU machine, or cuda),
    else the CPU. ValueError for a single named GPU or too few GPUs."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if device not in ("auto", "cuda"):
        raise ValueError(f"--device {device} names one device; with --tp-size {world} give --device cuda (rank r "
                         "runs on GPU r) or cpu")
    if torch.cuda.device_count() < world:
        raise ValueError(f"--tp-size {world} needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    return f"cuda:{rank}"


def _entry(rank: int, world: int, port: int, args: argparse.Namespace, run_rank: Callable, reports) -> None:
    from workbench.harness.bench import BenchError

    try:
        rc = run_rank(args, rank, world, port)
    except BenchError as e:  # the same settings fail the same way on every rank: rank 0's message is the one kept
        reports.put((rank, str(e)))
        sys.exit(2)
    if rc:
        sys.exit(rc)


def launch(args: argparse.Namespace, run_rank: Callable, on_failure: Callable[[str], None]) -> int:
    """Run `run_rank(args, rank, world, port)` in args.tp_size spawned processes; its return value is the rank's
    exit status (rank 0's is the command's). A failed or dead rank: `on_failure(message)` (print, failed row), 2."""
    from workbench.engine.tp import free_port

    world = args.tp_size
    try:
        for rank in range(world):
            rank_device(args.device, rank, world)
    except ValueError as e:
        on_failure(str(e))
        return 2
    if not args.threads:  # the ranks share the cores: an even split keeps them from oversubscribing the CPU
        args.threads = max(1, (os.cpu_count() or 1) // world)
    ctx = mp.get_context("spawn")
    reports = ctx.SimpleQueue()
    procs = mp.start_processes(_entry, args=(world, free_port(), args, run_rank, reports), nprocs=world,
                               join=False, start_method="spawn")
    try:
        while not procs.join():
            pass
    except mp.ProcessExitedException as e:
        got: list[_Report] = []
        while not reports.empty():
            got.append(reports.get())
        if got:  # a named error (bad settings, a model tensor parallelism cannot split): rank 0's first
            on_failure(min(got)[1])
            return 2
        if e.error_index == 0 and e.exit_code == 3:  # rank 0 printed the row, the store refused it (named there)
            return 3
        how = f"signal {e.signal_name}" if e.signal_name else f"exit status {e.exit_code}"
        on_failure(f"tensor-parallel rank {e.error_index} of {world} died ({how}); the other ranks were stopped")
        return 2
    except mp.ProcessRaisedException as e:
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1]
        on_failure(f"tensor-parallel rank {e.error_index} of {world} failed: {last}")
        return 2
    return 0
