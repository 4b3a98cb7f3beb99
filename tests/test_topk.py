"""chunked_topk against torch.topk: the passes give the same values with indices that name them; the dispatch rule."""
import pytest
import torch

from workbench.engine import topk as topk_mod
from workbench.engine.topk import chunked_topk, topk_in_chunks, uses_chunks


@pytest.mark.parametrize("shape,k", [((1, 16384), 4), ((4, 4096), 4), ((1, 128256), 4), ((3, 9000), 4),
                                     ((16, 16384), 8), ((2, 3, 8192), 4), ((2, 600), 4)])
def test_passes_give_torch_topks_values_and_indices_that_name_them(shape, k):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    x[..., ::7] = float("-inf")
    values, idx = topk_in_chunks(x, k)
    assert torch.equal(values, x.topk(k, -1).values)
    assert torch.equal(x.gather(-1, idx), values)
    assert (idx >= 0).all() and (idx < shape[-1]).all()


def test_ties_and_rows_of_minus_infinity_give_distinct_valid_indices():
    x = torch.randint(0, 3, (4, 9000), generator=torch.Generator().manual_seed(2)).float()
    values, idx = topk_in_chunks(x, 8)
    assert torch.equal(values, x.topk(8, -1).values)
    assert all(len(set(row.tolist())) == 8 for row in idx)
    x = torch.full((2, 9000), float("-inf"))
    x[0, 8999] = 1.0  # the one finite value sits in the short last chunk
    values, idx = topk_in_chunks(x, 4)
    assert values[0, 0] == 1.0 and idx[0, 0] == 8999
    assert (idx < 9000).all() and all(len(set(row.tolist())) == 4 for row in idx)


def test_chunks_only_where_they_measured_faster():
    assert uses_chunks((1, 4 * 4096), 4)  # ReDrafter W4 on tiny: one row of 16k
    assert uses_chunks((4, 4, 32000), 4)  # EAGLE's hot 32k head rows, batch 4: 16 rows x 125 chunks
    assert not uses_chunks((1, 4, 4096), 4)  # a 4k head row: no gain
    assert not uses_chunks((16, 4, 4096), 4)  # 64 rows: torch.topk's blocks fill the GPU
    assert not uses_chunks((16, 4 * 32000), 4)  # 16 rows x 500 chunks > MAX_CHUNKS
    assert not uses_chunks((1, 16384), topk_mod.CHUNK // 2)  # k too large for a chunk


def test_a_cpu_tensor_takes_torch_topk():
    x = torch.randn(1, 16384, generator=torch.Generator().manual_seed(3))
    values, idx = chunked_topk(x, 4)
    want = x.topk(4, -1)
    assert torch.equal(values, want.values) and torch.equal(idx, want.indices)
