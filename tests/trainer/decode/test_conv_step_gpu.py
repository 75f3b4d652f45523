"""The one-token convolution, SiLU, conv-state shift and gates kernel (trainer/decode/conv_step.py) compiled on CUDA
(run on the H200: `python3 -m pytest -m gpu tests/trainer/decode/test_conv_step_gpu.py`): at qwen3.5-35b-a3b's decode
shape in bf16 against the torch ops (the state exactly; mixed, g and beta bit for bit but where the conv's sum order
flips a rounding, as conv_step.py's docstring says), replayed from a CUDA graph on new inputs, the decode layer's
graph-replayed steps with and without it for each hybrid family's tiny layer, and the batch generator with the kernel
(on by default), graphed against eager."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.decode.test_conv_step import assert_silu_of_the_rounded_conv, random_inputs, torch_ops
from tests.trainer.decode.test_generate import prompts_of
from tests.trainer.decode.test_recurrent_kernel import hf_layer
from tests.trainer.decode.test_recurrent_kernel_gpu import DIM, ROWS, replayed_steps
from tests.trainer.families import HYBRID_FAMILIES
from trainer.capture import capture
from trainer.decode import conv_step
from trainer.decode.layers.linear import GatedDeltaNetDecode
from trainer.model.target import load_target

pytestmark = pytest.mark.gpu

DECODE_SHAPE = dict(R=64, C=8192, K=4, Hv=32)  # qwen3.5-35b-a3b: 64 rows, 2 x 16 x 128 + 32 x 128 conv channels


def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    return torch.device("cuda")


def decode_shape_inputs(state_dtype: torch.dtype, seed: int = 0):
    return tuple(t.to(cuda()) for t in random_inputs(**DECODE_SHAPE, dtype=torch.bfloat16, state_dtype=state_dtype,
                                                     seed=seed))


def equal_share(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got == want).float().mean().item()


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_equals_the_torch_ops_at_the_decode_shape(state_dtype):
    args = decode_shape_inputs(state_dtype)
    qkv, conv, weight, a, b, A_log, dt_bias = args
    before = conv.clone()
    want_mixed, want_g, want_beta, want_conv = torch_ops(*args)
    assert conv_step.usable(*args)
    mixed, g, beta = conv_step.conv_gates_step(*args)
    assert torch.equal(conv, want_conv)
    assert_silu_of_the_rounded_conv(mixed, qkv, before, weight)
    assert equal_share(mixed, want_mixed) >= 0.99, equal_share(mixed, want_mixed)
    torch.testing.assert_close(g, want_g, rtol=2 ** -22, atol=0)
    assert equal_share(g, want_g) >= 0.99 and equal_share(beta, want_beta) >= 0.99
    torch.testing.assert_close(beta.float(), want_beta.float(), rtol=2 ** -7, atol=0)


def test_the_kernel_replays_in_a_cuda_graph_on_new_inputs():
    """Captured once, replayed after the inputs and the state changed in place: the replay computes the new ones, bit
    for bit as an eager call, the state shifted in its own buffer."""
    dev = cuda()
    qkv, conv, weight, a, b, A_log, dt_bias = decode_shape_inputs(torch.bfloat16, seed=1)
    graph, outs = capture(lambda: conv_step.conv_gates_step(qkv, conv, weight, a, b, A_log, dt_bias), dev)
    fresh = decode_shape_inputs(torch.bfloat16, seed=2)
    for mine, new in zip((qkv, conv, a, b), (fresh[0], fresh[1], fresh[3], fresh[4])):
        mine.copy_(new)
    graph.replay()
    eager_state = fresh[1].clone()
    want = conv_step.conv_gates_step(fresh[0], eager_state, weight, fresh[3], fresh[4], A_log, dt_bias)
    assert all(torch.equal(got, w) for got, w in zip(outs, want))
    assert torch.equal(conv, eager_state) and torch.equal(conv, torch_ops(*fresh)[3])


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_graph_replayed_steps_with_the_kernel_equal_the_torch_steps(family, monkeypatch):
    """fp32 layers: the torch steps' convolution in fp32 too (cuDNN would otherwise take TF32 products)."""
    dev = cuda()
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    inner = copy.deepcopy(hf_layer(family)).to(dev)
    mine, plain = (GatedDeltaNetDecode(inner, ROWS, block=4, conv_kernel=k) for k in (True, False))
    outs = replayed_steps((mine, plain), dev)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine.state, plain.state, atol=1e-5, rtol=1e-5)
    assert torch.equal(mine.conv, plain.conv)  # fp32: the shift is a copy


def test_the_batch_generator_with_the_conv_kernel_replays_as_it_runs_eagerly(family_dirs, monkeypatch):
    """The kernel "conv" (on by default, trainer/decode/switches.py) inside the batch generator's captured steps on the tiny
    qwen3_5 target, bf16: the tokens the same generator gives run eagerly; every Gated DeltaNet layer took it."""
    from trainer.decode.generate import BatchGenerator, Sampling

    cuda()
    calls = []
    kernel_step = conv_step.conv_gates_step
    monkeypatch.setattr(conv_step, "conv_gates_step", lambda *args: calls.append(1) or kernel_step(*args))
    target = load_target(family_dirs["qwen3_5"], num_draft_layers=2, layer_ids=(1, 3), device="cuda",
                         dtype="bfloat16", truncate=False)
    prompts = prompts_of(target, (3, 11, 7, 5, 9), seed=0)
    graphed = BatchGenerator(target, rows=4, max_len=48, stop_ids=[])
    eager = BatchGenerator(target, rows=4, max_len=48, stop_ids=[], graphs=False)
    layers = graphed.static.linear
    assert layers and all(layer.conv_kernel for layer in layers)
    got = graphed.generate(prompts, Sampling(max_new_tokens=24))
    calls.clear()
    assert got == eager.generate(prompts, Sampling(max_new_tokens=24))
    assert calls  # the eager steps ran the kernel
