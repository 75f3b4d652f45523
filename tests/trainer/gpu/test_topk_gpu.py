"""The two-stage top-k on the H200 at the real vocabulary (151936) and DFlash2's CE chunk (4096 rows, bf16, k = 16),
against torch.topk, inside a CUDA graph."""
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
