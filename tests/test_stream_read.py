"""The read-floor kernel (kernels/stream_read.py): word-exact against torch under the Triton interpreter, and its
bad input named. Its timing is a GPU matter (scripts/gpu_gemv.py --parts read)."""
import os

import pytest
import torch

from kernels import stream_read as sr

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CUDA GPU is here: these run the Triton kernel under the interpreter, on a machine without one (on a GPU: "
           "scripts/gpu_gemv.py --parts read)")


@interpreter
@pytest.mark.parametrize("n, block, iters", [(4096, 256, 4), (5000, 128, 3), (100, 32, 1)])
def test_stream_read_folds_every_word(n, block, iters):
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    got = sr.stream_read(words, block=block, iters=iters, num_warps=4)
    want = sr.stream_read_reference(words, block, iters)
    assert got.shape == (-(-n // (block * iters)),)
    assert torch.equal(got, want)
    words[n - 1] ^= 1  # the last (masked) program's last word is read too
    assert sr.stream_read(words, block=block, iters=iters, num_warps=4)[-1] == want[-1] ^ 1


def test_reference_is_an_xor_per_program():
    words = torch.tensor([1, 2, 4, 8, 16], dtype=torch.int32)
    assert sr.stream_read_reference(words, 2, 1).tolist() == [3, 12, 16]
    assert sr.stream_read_reference(words, 2, 2).tolist() == [15, 16]


def test_stream_read_names_bad_input():
    with pytest.raises(ValueError, match="int32"):
        sr.stream_read(torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="power of two"):
        sr.stream_read(torch.zeros(64, dtype=torch.int32), block=100)
