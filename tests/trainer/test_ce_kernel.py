"""The Triton LM-head CE kernel (trainer/model/ce_kernel.py) has `ce_chunk`'s contract, run on CPU under Triton's
interpreter: the kernel code the H200 compiles."""
import pytest
import torch

from tests.trainer.test_ce_fused import assert_chunked_loss_equals_eager, chunk_case
from trainer.model import ce_kernel
from trainer.model.loss import ce_chunk


@pytest.fixture
def small_blocks(interpreter, monkeypatch):  # the interpreter fixture, with small column blocks
    monkeypatch.setattr(ce_kernel, "BLOCK", 32)  # V = 97: four column blocks, the last partial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_reference_chunk(small_blocks, dtype):
    assert ce_kernel.usable_on(torch.device("cpu"))
    logits, y, s = chunk_case(dtype)
    logits[5, 40] = logits[5, 70] = logits[5].float().max() + 1  # a tie: the first index is the argmax, as in torch
    y[5] = 70
    loss, correct, g = ce_chunk(logits, y, s, True)
    loss_k, correct_k, g_k = ce_kernel.ce_chunk_triton(logits, y, s, True)
    assert g_k.dtype == dtype and correct_k.dtype == torch.bool
    assert torch.equal(correct_k, correct) and bool(correct[2]) and not bool(correct_k[5])
    torch.testing.assert_close(loss_k, loss, rtol=1e-6, atol=1e-7)
    tol = dict(rtol=8e-3, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(g_k, g, **tol)
    loss_n, correct_n, none = ce_kernel.ce_chunk_triton(logits, y, s, False)
    assert none is None and torch.equal(loss_n, loss_k) and torch.equal(correct_n, correct_k)


def test_kernel_through_the_chunked_loss(small_blocks):
    assert_chunked_loss_equals_eager(ce_kernel.ce_chunk_triton)


def test_without_the_interpreter_the_kernel_is_not_offered_on_cpu():
    assert not ce_kernel.usable_on(torch.device("cpu"))
