"""The chunk-max kernel (trainer/model/chunk_max.py) on CPU tensors under Triton's interpreter: bit for bit amax's,
and fast_topk through it equals torch.topk."""
from __future__ import annotations

import pytest
import torch

from trainer.model import chunk_max as cm
from trainer.model.topk import fast_topk




@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_chunks, chunk, V", [(37, 128, 37 * 128 + 5), (64, 128, 64 * 128), (5, 16, 90)])
def test_the_kernel_equals_amax(interpreter, dtype, n_chunks, chunk, V):
    assert cm.usable_on(torch.device("cpu"))
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(V)).to(dtype)
    x[0, :chunk] = float("-inf")  # a chunk of -inf only
    x[1, n_chunks * chunk - 1] = 1e4  # the max in a chunk's last column
    x[2, n_chunks * chunk:] = 1e6  # columns after the chunks are not read
    got = cm.chunk_max(x, n_chunks, chunk)
    want = x[:, :n_chunks * chunk].reshape(3, n_chunks, chunk).amax(dim=-1)
    assert got.dtype == dtype and torch.equal(got, want)


def test_fast_topk_through_the_kernel_equals_torch_topk(interpreter):
    x = torch.randn(4, 40 * 128 + 17, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    values, indices = fast_topk(x, 8)
    want = torch.topk(x, 8)
    assert torch.equal(values, want.values) and torch.equal(x.gather(1, indices), want.values)


def test_the_torch_rule_where_the_kernel_cannot_run():
    """Without the interpreter switch a CPU tensor takes amax (the same values)."""
    assert not cm.usable_on(torch.device("cpu"))
    x = torch.randn(2, 300)
    assert torch.equal(cm.chunk_max(x, 2, 128), x[:, :256].reshape(2, 2, 128).amax(-1))
