"""Optional fast paths (Triton / CUDA), each beside the PyTorch reference it must match.

The engine's eager PyTorch path is the reference, and the measurements show where time goes (host/launch overhead, not
arithmetic), so CUDA graphs come before custom kernels. A kernel added here must ship with a test comparing it to its
reference on fresh random inputs (GPU-only tests skip on CPU CI) and a benchmark row.

Kernels:
- `paged_attention.py`: decode / tree-verify attention over a paged KV pool (flash-decoding split-K, fixed-shape and
  CUDA-graph capturable). `paged_attention_triton` beside `paged_attention_reference` (gather + SDPA);
  `paged_attention` picks the kernel on CUDA when triton imports. Tests: tests/test_kernels.py (the Triton half runs
  under TRITON_INTERPRET=1); GPU parity and timing: scripts/gpu_kernels.py. The engine's attention on CUDA
  (workbench/engine/kv_cache.py), with the K/V write and RoPE folded in.
- `quant_gemv.py`: weight-only int8 / int4 (group-wise) / fp8 GEMV for decode-sized calls (M <= 16), split-K with
  an in-kernel reduction, capture-safe. `quant_gemv_triton` beside `quant_gemv_reference` (dequantize, fp32
  matmul); the quant linears use it with kernel "triton" (knob `quant_kernel`). Tests: tests/test_quant_gemv.py
  (the Triton half under TRITON_INTERPRET=1); GPU parity, speed and decode: scripts/gpu_gemv.py.
- `int4_dequant.py`: the int4 "dequant" packing dequantized in one pass for prefill-sized calls (kernel "triton"
  past GEMV_MAX_ROWS), `int4_dequant_triton` beside `int4_dequant_reference` (the six PyTorch ops it replaces, bit for
  bit), measured 3.1-5.3x faster per 6.7 B linear.
  Tests: tests/test_quant_gemv.py.
- `fused_topk.py`: the drafters' ranking (log-softmax + top-k over a vocabulary, a beam search's W x V candidates
  with their beams' scores, or plain scores) in one or two launches, `fused_topk_triton` beside
  `fused_topk_reference`; 5-15x faster than log_softmax + torch.topk per call on an H100. Tests:
  tests/test_fused_topk.py; GPU timing: scripts/gpu_topk.py.
- `stream_read.py`: a read-only floor for one launch (a buffer's words streamed and xor-folded per program), what
  scripts/gpu_gemv.py --parts read times each linear's GEMV against. Tests: tests/test_stream_read.py.
- `pdl.py`: programmatic dependent launch (Hopper+) for the kernels above: `gdc_wait` / `gdc_launch_dependents` in
  the kernels, `use_pdl(device)` at their launches, switched per engine call by the `pdl` knob.
"""
