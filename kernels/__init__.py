"""Optional fast paths (Triton / CUDA), each beside the PyTorch reference it must match.

Empty so far on purpose: the engine's eager PyTorch path is the reference, and BENCHMARKS.md shows where time goes
(host/launch overhead, not arithmetic), so CUDA graphs come before custom kernels. A kernel added here must ship with
a test comparing it to its reference on fresh random inputs (GPU-only tests skip on CPU CI) and a benchmark row.
"""
