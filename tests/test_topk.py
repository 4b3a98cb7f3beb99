"""chunked_topk against torch.topk: the same values, indices that name them, on the chunked path and off it."""
import pytest
import torch

from workbench.engine import topk as topk_mod
from workbench.engine.topk import chunked_topk


@pytest.mark.parametrize("shape,k", [((1, 16384), 4), ((4, 4096), 4), ((1, 128256), 4), ((3, 9000), 4),
                                     ((16, 16384), 8), ((2, 3, 8192), 4), ((2, 700), 4), ((64, 4096), 4)])
def test_values_equal_torch_topk_and_indices_name_them(shape, k, monkeypatch):
    calls = []
    real = torch.Tensor.topk

    def spy(self, *args, **kwargs):
        calls.append(self.shape[-1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", spy)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    x[..., ::7] = float("-inf")
    values, idx = chunked_topk(x, k)
    n, rows = shape[-1], x.numel() // shape[-1]
    chunked = n >= topk_mod.MIN_LENGTH and rows <= topk_mod.MAX_ROWS and rows * (n // topk_mod.CHUNK) <= \
        topk_mod.MAX_CHUNKS
    assert (calls[0] == topk_mod.CHUNK) == chunked  # the chunked path ran where it should, torch.topk elsewhere
    assert torch.equal(values, real(x, k, -1).values)
    assert torch.equal(x.gather(-1, idx), values)
    assert (idx >= 0).all() and (idx < n).all()


def test_ties_and_rows_of_minus_infinity_give_distinct_valid_indices():
    x = torch.randint(0, 3, (4, 9000), generator=torch.Generator().manual_seed(2)).float()
    values, idx = chunked_topk(x, 8)
    assert torch.equal(values, x.topk(8, -1).values)
    assert all(len(set(row.tolist())) == 8 for row in idx)
    x = torch.full((2, 9000), float("-inf"))
    x[0, 8999] = 1.0  # the one finite value sits in the short last chunk
    values, idx = chunked_topk(x, 4)
    assert values[0, 0] == 1.0 and idx[0, 0] == 8999
    assert (idx < 9000).all() and all(len(set(row.tolist())) == 4 for row in idx)
