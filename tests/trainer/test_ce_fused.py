"""`ce_chunk_fused` (what the compile modes run) has `ce_chunk`'s contract: same loss, accuracy and dlogits."""
import pytest
import torch

from trainer.model.loss import ce_chunk, ce_chunk_fused, chunked_lm_loss


def chunk_case(dtype, C=24, V=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(C, V, generator=g)).to(dtype)
    y = torch.randint(V, (C,), generator=g)
    y[0], y[1] = 0, V - 1  # the label compare must hit both ends of the vocab
    y[2] = int(logits[2].float().argmax())  # at least one correct prediction
    s = torch.rand(C, generator=g) * (torch.rand(C, generator=g) > 0.3)  # some zero-weight rows
    return logits, y, s / s.sum()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_chunk_equals_the_scatter_form(dtype):
    logits, y, s = chunk_case(dtype)
    loss, correct, g = ce_chunk(logits, y, s, True)
    loss_f, correct_f, g_f = ce_chunk_fused(logits, y, s, True)
    assert g_f.dtype == dtype and g_f.shape == logits.shape
    assert torch.equal(correct_f, correct) and bool(correct[2])
    torch.testing.assert_close(loss_f, loss, rtol=1e-6, atol=1e-7)
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-8)
    if dtype == torch.bfloat16:  # the two fp32 softmax forms differ by an ulp, which can flip one bf16 rounding
        tol = dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(g_f, g, **tol)
    no_grad = ce_chunk_fused(logits, y, s, False)
    assert no_grad[2] is None and torch.equal(no_grad[0], loss_f)


def test_fused_chunk_gradient_is_softmax_minus_onehot_scaled():
    """Independent of ce_chunk: d(sum_i s_i * CE_i)/dlogits by autograd in fp64 (the chunk math runs in fp32)."""
    logits, y, s = chunk_case(torch.float64, seed=3)
    x = logits.clone().requires_grad_()
    (torch.nn.functional.cross_entropy(x, y, reduction="none") * s).sum().backward()
    torch.testing.assert_close(ce_chunk_fused(logits, y, s, True)[2], x.grad, rtol=1e-5, atol=1e-7)


def test_compiled_fused_chunk_through_the_chunked_loss():
    """What compile_step installs (Inductor, CPU here): the chunked loss gives the eager loss, accuracy and dh."""
    assert_chunked_loss_equals_eager(torch.compile(ce_chunk_fused, dynamic=False))  # chunks 16, 16, 8: two shapes


def assert_chunked_loss_equals_eager(chunk_fn) -> None:
    """The chunked LM-head loss through `chunk_fn` (ce_chunk's contract) gives the eager chunk's loss, accuracy and
    dh, over 40 positions in chunks of 16 (the last one partial) with some zero weights."""
    g = torch.Generator().manual_seed(1)
    M, D, V = 40, 16, 131
    h = torch.randn(M, D, generator=g)
    W = torch.randn(V, D, generator=g)
    y = torch.randint(V, (M,), generator=g)
    w = torch.rand(M, generator=g) * (torch.rand(M, generator=g) > 0.2)
    results = []
    for fn in (None, chunk_fn):
        h1 = h.clone().requires_grad_()
        loss, correct = chunked_lm_loss(h1, W, None, y, w, 16, fn)
        loss.backward()
        results.append((loss.detach(), correct, h1.grad))
    (l0, c0, d0), (l1, c1, d1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d1, d0, rtol=1e-4, atol=1e-6)
    assert torch.equal(c1, c0)
