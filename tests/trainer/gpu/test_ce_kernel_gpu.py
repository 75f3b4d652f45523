"""The Triton CE kernel on the H200 at the real vocabulary (152K, bf16 logits), against the PyTorch chunk math, and
inside a CUDA graph."""
import pytest
import torch

from trainer.model.ce_kernel import ce_chunk_triton
from trainer.model.loss import ce_chunk

pytestmark = pytest.mark.gpu
DEV = "cuda:0"


def test_kernel_at_the_real_vocab_equals_the_torch_chunk_and_replays_in_a_graph():
    g = torch.Generator(device=DEV).manual_seed(0)
    C, V = 512, 151936
    logits = (3 * torch.randn(C, V, generator=g, device=DEV)).to(torch.bfloat16)
    y = torch.randint(V, (C,), generator=g, device=DEV)
    y[:8] = logits[:8].float().argmax(-1)
    s = torch.rand(C, generator=g, device=DEV)
    s = s / s.sum()
    loss, correct, grad = ce_chunk(logits, y, s, True)
    static = ce_chunk_triton(logits, y, s, True)  # the warm-up compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = ce_chunk_triton(logits, y, s, True)
    logits.mul_(0.5)  # new values in the same buffer: the replay must see them
    loss, correct, grad = ce_chunk(logits, y, s, True)
    graph.replay()
    torch.cuda.synchronize()
    loss_k, correct_k, grad_k = static
    torch.testing.assert_close(loss_k, loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(correct_k, correct) and int(correct[:8].sum()) == 8
    torch.testing.assert_close(grad_k, grad, rtol=8e-3, atol=1e-7)
