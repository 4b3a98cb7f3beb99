"""kernels/fused_topk.py: the Triton kernel (under the interpreter on a CPU) against its PyTorch reference, the launch
plan, the named errors, and the drafters' dispatch (workbench.engine.topk.ranked_topk)."""
import pytest
import torch

from kernels.fused_topk import check_args, fused_topk_reference, fused_topk_triton, launch_plan
from workbench.engine.topk import ranked_topk


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# (shape, k, log_softmax, group, bias, max_block): one chunk per row (one launch) and several (two launches), groups
# of beams with their scores, k not a power of two, k = 1, rows shorter than k's power of two
CASES = [
    ((4, 300), 4, True, 1, False, 512),
    ((2, 3, 300), 4, True, 1, False, 64),
    ((8, 200), 4, True, 4, True, 64),
    ((6, 250), 3, True, 3, True, 1024),
    ((3, 100), 5, True, 1, True, 32),
    ((5, 16), 4, False, 1, False, 4096),
    ((2, 2, 9), 1, False, 1, False, 4),
    ((1, 3), 3, False, 1, False, 4096),
    ((4, 130), 8, False, 2, True, 32),
]


@pytest.mark.parametrize("shape,k,log_softmax,group,with_bias,max_block", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(shape, k, log_softmax, group, with_bias, max_block, dtype):
    x = (3 * torch.randn(*shape, generator=_gen(1))).to(dtype)
    rows = x.numel() // shape[-1]
    bias = torch.randn(rows, generator=_gen(2)) if with_bias else None
    values, idx = fused_topk_triton(x, k, log_softmax, group, bias, max_block=max_block)
    want_values, want_idx = fused_topk_reference(x, k, log_softmax, group, bias)
    assert values.shape == want_values.shape and values.dtype == torch.float32 and idx.dtype == torch.long
    torch.testing.assert_close(values, want_values, atol=2e-6, rtol=1e-6)
    if dtype == torch.float32:  # random float32 rows have no ties: the same elements, in the same order
        assert torch.equal(idx, want_idx)
    # whatever the ties, every index names an element of its output row whose score is the value returned
    flat = fused_topk_reference(x, group * x.shape[-1], log_softmax, group, bias)  # every candidate, sorted
    scores = torch.empty_like(flat[0]).scatter_(-1, flat[1], flat[0])
    torch.testing.assert_close(scores.gather(-1, idx), values, atol=2e-6, rtol=1e-6)
    assert all(len(set(row.tolist())) == k for row in idx.reshape(-1, k))


def test_ties_pick_lower_indices_and_minus_infinity_stays_last():
    x = torch.zeros(2, 40)
    x[0, 7] = x[0, 30] = 1.0
    x[1, :] = float("-inf")
    x[1, 33] = 0.5
    values, idx = fused_topk_triton(x, 3, False, max_block=16)  # three chunks, then the merge
    assert idx[0].tolist() == [7, 30, 0] and values[0].tolist() == [1.0, 1.0, 0.0]
    assert idx[1, 0] == 33 and values[1, 0] == 0.5 and (values[1, 1:] == float("-inf")).all()
    assert len(set(idx[1].tolist())) == 3


def test_beam_scores_rank_whole_beams():
    """A beam at -inf (ReDrafter's first depth: only beam 0 is live) contributes no candidate above a live one."""
    x = torch.randn(4, 50, generator=_gen(3))
    bias = torch.tensor([0.0, float("-inf"), float("-inf"), float("-inf")])
    values, idx = fused_topk_triton(x, 4, True, group=4, bias=bias, max_block=16)
    assert (idx < 50).all()  # all four from beam 0
    want = torch.log_softmax(x[0], -1).topk(4)
    torch.testing.assert_close(values[0], want.values)
    assert torch.equal(idx[0], want.indices)


def test_launch_plan():
    assert launch_plan(4096, 4) == (1024, 4, 4)  # tiny's vocabulary: four chunks, then the merge
    assert launch_plan(128256, 4) == (1024, 126, 4)  # an EAGLE level at 128k: 126 chunks to merge
    assert launch_plan(128256, 4, group=4) == (4096, 32, 4)  # a beam depth: 4 x 32 chunks to merge, not 4 x 126
    assert launch_plan(32000, 4, group=4) == (1024, 32, 4)
    assert launch_plan(40 * 8192, 4, group=4) == (8192, 40, 4)  # past every chunk's merge limit: the largest chunk
    assert launch_plan(16, 4) == (16, 1, 4)  # a frontier's K*K scores: one program
    assert launch_plan(3, 3) == (4, 1, 4)  # k rounds up to a power of two, the chunk at least that
    assert launch_plan(300, 5, max_block=64) == (64, 5, 8)


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(4, 0), 1, 1, None), "last dimension"),
    ((torch.zeros(6, 10), 2, 4, None), "divide the 6 input rows"),
    ((torch.zeros(4, 10), 41, 4, None), "k=41 must be in 1..40"),
    ((torch.zeros(4, 10), 0, 1, None), "k=0"),
    ((torch.zeros(4, 10), 2, 2, torch.zeros(3)), "bias has 3 elements"),
])
def test_bad_arguments_name_the_problem(args, match):
    with pytest.raises(ValueError, match=match):
        check_args(*args)


def test_cpu_dispatch_takes_the_reference():
    x = torch.randn(3, 64, generator=_gen(4))
    got = ranked_topk(x, 4)
    want = torch.log_softmax(x, -1).clamp(max=0.0).topk(4)
    assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)
