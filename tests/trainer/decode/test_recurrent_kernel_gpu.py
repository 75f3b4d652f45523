"""The fused one-token Gated DeltaNet step (trainer/decode/recurrent_kernel.py) compiled on CUDA (run on the H200:
`python3 -m pytest -m gpu tests/trainer/decode/test_recurrent_kernel_gpu.py`): equal to the torch rule at
Qwen3.5-9B's shapes with no state-sized allocation, and the decode layer's fused steps, captured as a CUDA graph and
replayed, equal to its torch steps for each hybrid family's tiny layer."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.decode.test_recurrent_kernel import hf_layer
from tests.trainer.families import HYBRID_FAMILIES
from trainer.capture import capture
from trainer.decode.layers.linear import GatedDeltaNetDecode
from trainer.decode.recurrent_kernel import gated_delta_step_
from trainer.model.linear_attention import gated_delta_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS, DIM = 3, 64


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_fused_step_equals_the_torch_rule_at_qwen3_5_9bs_shapes_in_place(dtype, tol):
    R, Hk, Hv, dk, dv = 64, 16, 32, 128, 128
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    q, k = (torch.randn(R, 1, Hk, dk, generator=gen, device=dev).to(dtype) for _ in range(2))
    v = torch.randn(R, 1, Hv, dv, generator=gen, device=dev).to(dtype)
    g = -3 * torch.rand(R, 1, Hv, generator=gen, device=dev)
    beta = torch.rand(R, 1, Hv, generator=gen, device=dev).to(dtype)
    state = torch.randn(R, Hv, dk, dv, generator=gen, device=dev)
    want, want_state = gated_delta_step(q, k, v, g, beta, state)
    gated_delta_step_(q, k, v, g, beta, state.clone())  # compiled before the memory is measured
    mine = state.clone()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = gated_delta_step_(q, k, v, g, beta, mine)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < state.numel() * 4 // 8  # the output only, no new state
    torch.testing.assert_close(mine, want_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def replayed_steps(layers, dev: torch.device) -> list[torch.Tensor]:
    """Each decode layer's one-token step captured as a CUDA graph; then, from a prefill of the same seeded prompt
    [ROWS, 20, DIM], replayed over the same 6 seeded tokens -> each layer's outputs [ROWS, 6, DIM]."""
    gen = torch.Generator().manual_seed(1)
    prompt, steps = torch.randn(ROWS, 20, DIM, generator=gen).to(dev), torch.randn(ROWS, 6, DIM, generator=gen)
    x = torch.zeros(ROWS, 1, DIM, device=dev)
    with torch.no_grad():
        graphs = [capture(lambda layer=layer: layer.step(x), dev) for layer in layers]
        outs = []
        for layer, (graph, out) in zip(layers, graphs):
            layer.reset(torch.ones(ROWS, dtype=torch.bool, device=dev))
            layer.prefill(prompt)
            got = []
            for t in range(steps.shape[1]):
                x.copy_(steps[:, t:t + 1])
                graph.replay()
                got.append(out.clone())
            outs.append(torch.cat(got, 1))
    return outs


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_graph_replayed_fused_steps_equal_the_torch_steps(family):
    dev = torch.device("cuda")
    inner = copy.deepcopy(hf_layer(family)).to(dev)
    fused, plain = (GatedDeltaNetDecode(inner, ROWS, block=4, fused=f) for f in (True, False))
    outs = replayed_steps((fused, plain), dev)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.state, plain.state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.conv, plain.conv)
