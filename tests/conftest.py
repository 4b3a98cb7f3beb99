"""Shared test setup. Tests use the committed tiny preset and never download or train anything large."""
import os

# Two CPU cores: OpenMP threads spin against each other (and against subprocesses the tests start); one thread per
# process keeps the suite fast and its timings stable. Subprocesses inherit it through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
