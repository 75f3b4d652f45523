"""CPU checks of the stand-in workload's chunked LM-head cross-entropy (runs in CI; no gpu mark)."""
import pytest
import torch
import torch.nn.functional as F

from trainer.pipeline.standin import LinearCrossEntropy, ce_chunk_eager, ce_chunk_fusable


@pytest.mark.parametrize("chunk_fn", [ce_chunk_eager, ce_chunk_fusable])
@pytest.mark.parametrize("chunk", [7, 50, 64])
def test_chunked_loss_and_grad_match_autograd(chunk_fn, chunk):
    g = torch.Generator().manual_seed(chunk)
    h = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(30, 16, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 30, (50,), generator=g)
    weights = torch.rand(50, dtype=torch.float64, generator=g) * (torch.rand(50, generator=g) > 0.3)
    loss, acc = LinearCrossEntropy.apply(h, w, labels, weights, chunk, chunk_fn)
    (2.0 * loss).backward()
    got = h.grad.clone()
    h.grad = None
    logits = h @ w.t()
    ref = (F.cross_entropy(logits, labels, reduction="none") * weights).sum() / weights.sum()
    (2.0 * ref).backward()
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-5  # loss accumulates in fp32
    assert torch.allclose(got, h.grad, atol=1e-6)
    hits = ((logits.argmax(-1) == labels) & (weights > 0)).sum() / (weights > 0).sum()
    assert abs(float(acc) - float(hits)) < 1e-6
