"""Host-side cost of one int4_cuda_gemv call on a machine without a GPU: the Python work of a launch (checks, the
tile, the cached launcher, the output allocation), with the driver, the kernel lookup and the stream faked. Under CUDA
graphs (the engine's fast path) this cost is paid once, at capture; without graphs it is paid by every linear of
every step.

    python scripts/int4_cuda_overhead.py [--calls 5000] [--n 4096 --k 4096]
"""
import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import int4_cuda  # noqa: E402


class _FakeDriver:
    @staticmethod
    def cuLaunchKernelEx(*args):  # noqa: N802 - the driver's name
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    args = ap.parse_args()
    int4_cuda.device_problem = lambda device: None
    int4_cuda._function = lambda *a: ctypes.c_void_p(1)
    int4_cuda._raw_stream = lambda dev: 1234
    int4_cuda._libcuda = lambda: _FakeDriver
    torch.cuda.current_device = lambda: 0
    g = 128
    w = torch.randint(0, 256, (args.n, args.k // 2), dtype=torch.uint8)
    s = torch.rand(args.n, args.k // g).to(torch.bfloat16)
    x = torch.randn(1, args.k).to(torch.bfloat16)
    for _ in range(100):
        int4_cuda.int4_cuda_gemv(x, w, s, s, g, pdl=True)
    t0 = time.perf_counter()
    for _ in range(args.calls):
        int4_cuda.int4_cuda_gemv(x, w, s, s, g, pdl=True)
    print(f"{(time.perf_counter() - t0) / args.calls * 1e6:.1f} us per call (host side; driver faked)")


if __name__ == "__main__":
    main()
