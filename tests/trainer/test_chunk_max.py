"""The chunk-max kernel (trainer/model/chunk_max.py) and the CE kernel's chunk maxes (trainer/model/ce_kernel.py) on
CPU tensors under Triton's interpreter: bit for bit amax's, and fast_topk through them equals torch.topk."""
from __future__ import annotations

import pytest
import torch

from trainer.model import ce_kernel
from trainer.model import chunk_max as cm
from trainer.model.loss import chunked_lm_loss
from trainer.model.topk import CHUNK, fast_topk


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [40 * CHUNK + 9, 64 * CHUNK, 3 * CHUNK + 1])
def test_the_ce_kernel_writes_amaxs_chunk_maxes_and_the_same_loss(interpreter, dtype, V):
    """Asked for them, the CE kernel's first loop writes each whole chunk's max bit for bit as amax does (a chunk of
    -inf, a max in a chunk's last column, the ragged tail not read) and its loss, correct and gradient stay those of
    the call without them."""
    g = torch.Generator().manual_seed(V)
    C, n = 3, V // CHUNK
    x = torch.randn(C, V, generator=g).to(dtype)
    x[0, :CHUNK] = float("-inf")
    x[1, n * CHUNK - 1] = 1e4
    x[2, n * CHUNK:] = 1e6
    y, s = torch.randint(V, (C,), generator=g), torch.rand(C, generator=g)
    assert ce_kernel.writes_chunk_maxes(V, CHUNK)
    maxes = torch.full((C, n), 7.0, dtype=dtype)
    loss, correct, grad = ce_kernel.ce_chunk_triton(x, y, s, True, maxes=maxes, chunk=CHUNK)
    assert torch.equal(maxes, x[:, :n * CHUNK].reshape(C, n, CHUNK).amax(dim=-1))
    loss0, correct0, grad0 = ce_kernel.ce_chunk_triton(x, y, s, True)
    assert torch.equal(loss, loss0) and torch.equal(correct, correct0) and torch.equal(grad, grad0)


def test_the_ce_kernel_refuses_maxes_it_cannot_write(interpreter):
    x = torch.randn(2, 5 * CHUNK)
    y, s = torch.zeros(2, dtype=torch.long), torch.ones(2)
    for maxes, chunk in ((torch.empty(2, 5), 96), (torch.empty(2, 6), CHUNK), (torch.empty(2, 5, dtype=torch.bfloat16),
                                                                               CHUNK)):
        with pytest.raises(ValueError, match="cannot write"):
            ce_kernel.ce_chunk_triton(x, y, s, False, maxes=maxes, chunk=chunk)


def test_dflash2_candidates_take_the_ce_kernels_maxes(interpreter, monkeypatch):
    """The LM-head loss with the CE kernel hands its chunk maxes to the top-k (no second read of the logits: the
    chunk-max kernel is never called) and the candidates are torch.topk's."""
    g = torch.Generator().manual_seed(3)
    M, D, V, K = 24, 16, 40 * CHUNK + 9, 6
    h, W = torch.randn(M, D, generator=g), torch.randn(V, D, generator=g)
    labels, w = torch.randint(V, (M,), generator=g), torch.rand(M, generator=g)

    def not_called(*a, **k):
        raise AssertionError("the top-k read the logits again")

    monkeypatch.setattr("trainer.model.topk.chunk_max", not_called)
    loss, correct, cand = chunked_lm_loss(h, W, None, labels, w, chunk=10, chunk_fn=ce_kernel.ce_chunk_triton, top_k=K)
    assert torch.equal(cand, torch.topk(h @ W.t(), K, dim=-1).indices)
    want_loss, want_correct = chunked_lm_loss(h, W, None, labels, w, chunk=10, chunk_fn=ce_kernel.ce_chunk_triton)
    assert torch.equal(loss, want_loss) and torch.equal(correct, want_correct)
