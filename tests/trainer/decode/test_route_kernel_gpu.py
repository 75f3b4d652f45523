"""The MoE router and sort-by-expert kernels (trainer/decode/route_kernel.py) compiled on CUDA (run on the H200:
`python3 -m pytest -m gpu tests/trainer/decode/test_route_kernel_gpu.py`), at qwen3.5-35b-a3b's decode shape
(T = 64 tokens, E = 256 experts, k = 8) and E = 128: the tensors of `route` + `sort_by_expert` bit for bit, weights
included (the softmax's summation order, CUDA's expf, the renorm sum's lanes: the module docstring's claims), also
on logits with ties; and the same under CUDA graph replay."""
from __future__ import annotations

import pytest
import torch

from trainer.decode import route_kernel
from trainer.decode.layers.moe import Routing, route, sort_by_expert

pytestmark = pytest.mark.gpu
SHAPES = [(64, 256, 8), (64, 128, 8)]
ROUTINGS = [Routing("softmax_topk", renorm=True, cast=True),  # Qwen3-MoE, Qwen3.5-MoE
            Routing("softmax_topk", renorm=True, cast=False),  # Mixtral
            Routing("softmax_topk")]  # the probabilities themselves


def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    return torch.device("cuda")


def tie_free(T: int, E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Each token's E logits distinct bf16 values drawn from those of magnitude 1/8 to 8 (some 1500)."""
    g = torch.Generator().manual_seed(seed)
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    table = every[(every.abs() >= 0.125) & (every.abs() < 8)]
    return torch.stack([table[torch.randperm(len(table), generator=g)[:E]] for _ in range(T)]).to(dtype).to(cuda())


def torch_tensors(logits: torch.Tensor, k: int, routing: Routing):
    weights, experts = route(logits, k, routing)
    return (weights, experts) + sort_by_expert(experts, logits.shape[1])


# + k not a power of two, E not either; the tiny families' step (fewer experts than a warp's lanes, a 16-copy chunk);
# S = 2048, two sort chunks a pass
@pytest.mark.parametrize("T, E, k", SHAPES + [(64, 60, 6), (7, 1024, 3), (4, 4, 2), (1, 8, 1), (256, 128, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_give_torchs_tensors_bit_for_bit(T, E, k, dtype):
    for seed in range(3):
        logits = tie_free(T, E, dtype, seed)
        for routing in ROUTINGS:
            assert route_kernel.usable(logits, routing, k)
            got = route_kernel.route_and_sort(logits, k, routing)
            for name, a, b in zip(("weights", "experts", "order", "sorted_experts", "offsets"), got,
                                  torch_tensors(logits, k, routing)):
                assert a.dtype == b.dtype and torch.equal(a, b), (name, routing, seed)


@pytest.mark.parametrize("T, E, k", SHAPES)
def test_random_bf16_logits_ties_included(T, E, k):
    """randn logits in bf16 (near the top-k cut two tokens' logits often tie): each weight is F.softmax's
    probability of the expert picked, bit for bit; the picks descend, a tie by expert index; the sort is
    sort_by_expert's of the kernel's experts."""
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(E), dtype=torch.float32)
    logits = (2 * logits).to(torch.bfloat16).to(cuda())
    weights, experts, order, sorted_experts, offsets = route_kernel.route_and_sort(logits, k, Routing("softmax_topk"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.equal(weights, probs.gather(1, experts))
    w, e = weights[:, :-1], weights[:, 1:]
    assert bool(((w > e) | ((w == e) & (experts[:, :-1] < experts[:, 1:]))).all())  # descending, a tie by index
    kth = weights[:, -1:]  # nothing left out above the k-th, nor equal to it at a lower index
    left = probs.scatter(1, experts, -1.0)
    lower = torch.arange(E, device=logits.device)[None, :] < experts[:, -1:]
    assert not bool(((left > kth) | ((left == kth) & lower)).any())
    for a, b in zip((order, sorted_experts, offsets), sort_by_expert(experts, E)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T, E, k", SHAPES + [(4, 4, 2)])
def test_under_graph_replay(T, E, k):
    """Captured once, replayed on new logits copied into the captured buffer: the eager kernels' tensors."""
    routing = ROUTINGS[0]
    static = tie_free(T, E, torch.bfloat16, seed=0)
    route_kernel.route_and_sort(static, k, routing)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = route_kernel.route_and_sort(static, k, routing)
    for seed in (1, 2):
        fresh = tie_free(T, E, torch.bfloat16, seed)
        static.copy_(fresh)
        graph.replay()
        for a, b in zip(outs, torch_tensors(fresh, k, routing)):
            assert torch.equal(a, b), seed
