"""The two-stage top-k on the H200 at the real vocabulary (151936) and DFlash2's CE chunk (4096 rows, bf16, k = 16),
against torch.topk, inside a CUDA graph; its second-stage kernel against the torch reference."""
import pytest
import torch

from trainer.model.topk import fast_topk

pytestmark = pytest.mark.gpu
DEV = "cuda:0"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_topk_at_the_real_vocab_equals_torch_topk_under_graph_replay(dtype):
    g = torch.Generator(device=DEV).manual_seed(0)
    N, V, k = 4096, 151936, 16
    x = (3 * torch.randn(N, V, generator=g, device=DEV)).to(dtype)
    fast_topk(x, k)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_v, static_i = fast_topk(x, k)
    x.copy_((5 * torch.randn(N, V, generator=g, device=DEV)).to(dtype))  # new values in the same buffer
    x[0, 1000:1100] = 100.0  # planted ties: the lower index first
    graph.replay()
    torch.cuda.synchronize()
    want_v, want_i = torch.topk(x, k)
    assert torch.equal(static_v, want_v)
    assert torch.equal(x.gather(1, static_i), static_v)
    assert static_i[0].tolist() == list(range(1000, 1000 + k))
    # the tie rule on every row (bf16 ties often among the top 16): a stable descending sort's first k
    assert torch.equal(static_i, torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k])
    # torch's own indices on the rows with no tie among their top k + 1
    top = x.topk(k + 1).values
    distinct = (top[:, 1:] != top[:, :-1]).all(dim=1)
    if dtype == torch.float32:
        assert int(distinct.sum()) > N - 8
    assert torch.equal(static_i[distinct], want_i[distinct])


def test_the_select_kernel_equals_select_from_maxes_at_the_real_vocab():
    """The second stage's Triton kernel (trainer/model/topk_kernel.py, the one fast_topk takes on CUDA) against the
    torch reference on DFlash2's shape, bf16, with planted ties across and inside chunks, signed zeros and -inf."""
    from trainer.model import topk_kernel
    from trainer.model.chunk_max import chunk_max
    from trainer.model.topk import CHUNK, select_from_maxes

    g = torch.Generator(device=DEV).manual_seed(1)
    N, V, k = 4096, 151936, 16
    x = (3 * torch.randn(N, V, generator=g, device=DEV)).to(torch.bfloat16)
    x[0, torch.arange(0, V, CHUNK, device=DEV) + 5] = 50.0  # every chunk's max equal: the lowest chunks
    x[1, 300:340] = 50.0  # ties inside a chunk
    x[2] = 0.0
    x[2, 1::2] = -0.0
    x[3] = float("-inf")
    x[3, [V - 1, 7, 9000]] = 1.0
    maxes = chunk_max(x, V // CHUNK, CHUNK)
    assert topk_kernel.usable(x, maxes, k, CHUNK)
    values, indices = topk_kernel.select(x, maxes, k, CHUNK)
    want_v, want_i = select_from_maxes(x, maxes, k, CHUNK)
    assert torch.equal(values.view(torch.int16), want_v.view(torch.int16))
    assert torch.equal(indices, want_i)
    assert indices[0].tolist() == [c * CHUNK + 5 for c in range(k)]
    assert indices[2].tolist() == list(range(k))
