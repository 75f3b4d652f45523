"""The MoE experts kernels (trainer/decode/moe_kernel.py) compiled on the H200 (`python3 -m pytest -m gpu
tests/trainer/decode/test_moe_kernel_gpu.py`): at qwen3.5-35b-a3b's decode shape in bf16 against the grouped GEMM
path (the same roundings, another summation order), inside a CUDA graph, and the tiny MoE families' blocks through
MoeMLP with and without them."""
from __future__ import annotations

import json

import pytest
import torch
from transformers.activations import SiLUActivation
from transformers.integrations.moe import _default_apply_gate

from tests.trainer.decode.test_generate import prompts_of
from tests.trainer.decode.test_static_moe import redrawn_block
from trainer.decode import moe_kernel
from trainer.decode.layers.moe import MoeMLP, Routing, grouped_linear, route, routing_of, sort_by_expert
from trainer.model.target import load_target

pytestmark = pytest.mark.gpu
QWEN3_5_MOE = Routing("softmax_topk", renorm=True, cast=True)


def cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    return torch.device("cuda")


class Experts(torch.nn.Module):
    """SiLU-GLU experts as transformers keeps them (3-D weights, its default gate)."""

    _apply_gate = _default_apply_gate

    def __init__(self, E: int, D: int, I: int, gen: torch.Generator):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(0.02 * torch.randn(E, 2 * I, D, generator=gen, device="cuda"))
        self.down_proj = torch.nn.Parameter(0.02 * torch.randn(E, D, I, generator=gen, device="cuda"))
        self.act_fn = SiLUActivation()


def decode_shape_experts(E=256, D=2048, I=512):  # qwen3.5-35b-a3b's experts
    gen = torch.Generator(device="cuda").manual_seed(0)
    return Experts(E, D, I, gen).to(torch.bfloat16), gen


@pytest.mark.parametrize("tokens, k", [(64, 8), (16, 8), (256, 8)])
def test_the_kernels_equal_the_grouped_path_at_the_decode_shape(tokens, k):
    cuda()
    experts, gen = decode_shape_experts()
    assert moe_kernel.serves(experts)
    E, D = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[-1]
    x = torch.randn(tokens, D, generator=gen, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, E, generator=gen, device="cuda").to(torch.bfloat16)
    weights, chosen = route(logits, k, QWEN3_5_MOE)
    order, sorted_experts, offsets = sort_by_expert(chosen, E)
    up = grouped_linear(x[order // k], experts.gate_up_proj, False, offsets, sorted_experts, True)
    out = grouped_linear(experts._apply_gate(up), experts.down_proj, False, offsets, sorted_experts, True)
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    want = torch.empty_like(out).index_copy_(0, order, out).view(tokens, k, D)
    got = moe_kernel.experts_forward(experts, x, order, offsets, weights)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-4, rtol=2e-2)
    assert (got.float() - want.float()).abs().mean() < 1e-3 * want.float().abs().mean()


def test_the_kernels_replay_in_a_cuda_graph_on_new_routing():
    """Captured once, replayed after the routing inputs changed in place: the replay follows the new copies."""
    cuda()
    experts, gen = decode_shape_experts()
    E, D, T, k = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[-1], 64, 8
    x = torch.randn(T, D, generator=gen, device="cuda").to(torch.bfloat16)
    routing = QWEN3_5_MOE
    logits = torch.randn(T, E, generator=gen, device="cuda").to(torch.bfloat16)

    def step():
        weights, chosen = route(logits, k, routing)
        order, _, offsets = sort_by_expert(chosen, E)
        return moe_kernel.experts_forward(experts, x, order, offsets, weights)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    logits.copy_(torch.randn(T, E, generator=gen, device="cuda").to(torch.bfloat16))
    x.copy_(torch.randn(T, D, generator=gen, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(captured, step(), atol=0, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_moe"])
def test_the_tiny_families_blocks_with_and_without_the_kernels(family, family_dirs):
    cuda()
    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), device="cuda",
                         dtype="bfloat16", truncate=False)
    config = json.loads((family_dirs[family] / "config.json").read_text())
    block, gen = redrawn_block(target)
    kernel = MoeMLP(block, routing_of(target.hf_config), config["num_experts_per_tok"], kernel=True)
    grouped = MoeMLP(block, routing_of(target.hf_config), config["num_experts_per_tok"], kernel=False)
    assert kernel.kernel and not grouped.kernel and kernel.grouped
    x = torch.randn(4, 3, config["hidden_size"], generator=gen).to("cuda", torch.bfloat16)
    torch.testing.assert_close(kernel(x).float(), grouped(x).float(), atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_the_batch_generator_with_the_moe_kernels_replays_as_it_runs_eagerly(family, family_dirs):
    """The kernels "moe" and "route" (on by default, trainer/decode/switches.py) inside the batch generator's captured
    steps, bf16: the tokens the same generator gives run eagerly; every MoE layer took them."""
    from trainer.decode.generate import BatchGenerator, Sampling

    cuda()
    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), device="cuda",
                         dtype="bfloat16", truncate=False)
    prompts = prompts_of(target, (3, 11, 7, 5, 9), seed=0)
    graphed = BatchGenerator(target, rows=4, max_len=48, stop_ids=[])
    eager = BatchGenerator(target, rows=4, max_len=48, stop_ids=[], graphs=False)
    mlps = [m for m in graphed.static.mlps if isinstance(m, MoeMLP)]
    assert mlps and all(m.kernel and m.router_kernel for m in mlps), family
    got = graphed.generate(prompts, Sampling(max_new_tokens=24))
    assert got == eager.generate(prompts, Sampling(max_new_tokens=24)), family


@pytest.mark.parametrize("shared", [False, True])
def test_the_combine_kernel_is_torchs_ops_bit_for_bit_in_bf16(shared):
    """The k copies' sum and the sigmoid-gated shared expert at qwen3.5-35b-a3b's width, bf16: torch's
    `out.sum(dim=1) + torch.sigmoid(gate) * shared`, bit for bit (fp32 sums in torch's order; the sigmoid torch's)."""
    cuda()
    g = torch.Generator(device="cuda").manual_seed(4)
    T, k, D = 64, 8, 2048
    out = torch.randn(T, k, D, generator=g, device="cuda").to(torch.bfloat16)
    gate = (3 * torch.randn(T, 1, generator=g, device="cuda")).to(torch.bfloat16)
    expert = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
    want = out.sum(dim=1) + (torch.sigmoid(gate) * expert if shared else 0)
    got = moe_kernel.combine(out, torch.bfloat16, torch.sigmoid(gate) if shared else None, expert if shared else None)
    assert torch.equal(got, want)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])  # Qwen's cast weights, Mixtral's fp32
@pytest.mark.parametrize("shared", [False, True])
def test_combine_sorted_is_the_grouped_paths_ops_bit_for_bit_in_bf16(shared, weight_dtype):
    """A prefill's 2,048 tokens at qwen3.5-35b-a3b's width, bf16: the grouped path's `out * w[order]`, `index_copy_`
    back to token order, `sum(dim=1)`, the cast, `+ torch.sigmoid(gate) * shared`, bit for bit."""
    cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    T, k, D = 2048, 8, 2048
    S = T * k
    out = torch.randn(S, D, generator=g, device="cuda").to(torch.bfloat16)
    order = torch.randperm(S, generator=g, device="cuda")
    weights = torch.rand(T, k, generator=g, device="cuda").to(weight_dtype)
    gate = (3 * torch.randn(T, 1, generator=g, device="cuda")).to(torch.bfloat16)
    expert = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
    product = out * weights.reshape(-1)[order].unsqueeze(-1)
    want = torch.empty_like(product).index_copy_(0, order, product).view(T, k, D).sum(dim=1).to(torch.bfloat16)
    if shared:
        want = want + torch.sigmoid(gate) * expert
    got = moe_kernel.combine_sorted(out, order, weights, torch.bfloat16, torch.sigmoid(gate) if shared else None,
                                    expert if shared else None)
    assert torch.equal(got, want)


def test_the_h200s_shared_memory_holds_the_kernels_tiles():
    """What serves() and step_kernel.usable_for check a device against: the H200's opt-in maximum a block, which
    holds the experts kernels' 108 KB at qwen3.5-35b-a3b's widths (and the step attention's 144 KB in fp32)."""
    from trainer.decode import step_kernel
    from trainer.triton_device import shared_memory_limit

    cuda()
    limit = shared_memory_limit(torch.device("cuda"))
    assert limit == 232_448
    assert moe_kernel.shared_bytes(512, 2048, 2) <= limit and step_kernel.shared_bytes(128, 4) <= limit


class Slow:
    """A shared expert that notes the streams it ran on and first keeps the GPU busy (~1 ms), so that a missing or
    misplaced join would let the main stream read its output before it is written."""

    def __init__(self, expert):
        self.expert, self.streams = expert, set()

    def __call__(self, x):
        self.streams.add(torch.cuda.current_stream(x.device))
        torch.cuda._sleep(2_000_000)
        return self.expert(x)


def test_the_shared_expert_beside_the_experts_kernels_changes_no_token(family_dirs, kernels_off):
    """The "overlap" (the shared expert on a second stream, forked and joined inside the captured steps):
    Qwen3.5-MoE's tiny target through the batch generator gives the tokens it gives without it, graphed and eager,
    with every MoE layer's shared expert at decode on the side stream and slowed (`Slow`) so a bad join would show."""
    from trainer.decode.generate import BatchGenerator, Sampling

    cuda()
    target = load_target(family_dirs["qwen3_5_moe"], num_draft_layers=2, layer_ids=(1, 3), device="cuda",
                         dtype="bfloat16", truncate=False)
    prompts = prompts_of(target, (3, 11, 7, 5, 9), seed=1)
    answers = {}
    for overlap in (False, True):
        kernels_off(["overlap"], off=not overlap)
        for graphs in (True, False):
            gen = BatchGenerator(target, rows=4, max_len=48, stop_ids=[], graphs=graphs)
            assert not gen.programs  # nothing captured yet: the steps capture the slowed experts
            mlps = [m for m in gen.static.mlps if isinstance(m, MoeMLP)]
            for m in mlps:
                m.shared = Slow(m.shared)
            answers[overlap, graphs] = gen.generate(prompts, Sampling(max_new_tokens=24))
            assert mlps and all(m.kernel and m.overlap == overlap for m in mlps)
            assert all((m.side is not None) == overlap for m in mlps)
            # the decode steps' shared experts on the side stream (a prefill's, off the kernels' path, beside)
            assert all((m.side in m.shared.streams) == overlap for m in mlps)
    assert len({str(a) for a in answers.values()}) == 1
