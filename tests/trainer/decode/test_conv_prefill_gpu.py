"""The prefill convolution kernel (trainer/decode/conv_prefill.py) compiled on CUDA (run on the H200: `python3 -m
pytest -m gpu tests/trainer/decode/test_conv_prefill_gpu.py`): at qwen3.5-35b-a3b's prefill shape in bf16 against the
torch form (bit for bit but where the conv's sum order flips a rounding, as conv_prefill.py's docstring says), the
state it reads left as it was, qkv whole or a slice of the joined projection; the decode layer's prefill (the torch
rule and fla's chunked one) with and without it for each hybrid family's tiny layer in fp32, rows right-padded."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.decode.test_conv_prefill import random_chunk, torch_form
from tests.trainer.decode.test_conv_step import assert_silu_of_the_rounded_conv
from tests.trainer.decode.test_recurrent_kernel import hf_layer
from tests.trainer.decode.test_recurrent_kernel_gpu import DIM, ROWS
from tests.trainer.families import HYBRID_FAMILIES
from trainer.decode import conv_prefill
from trainer.decode.layers.linear import GatedDeltaNetDecode, kernel_for

pytestmark = pytest.mark.gpu

PREFILL_SHAPE = dict(R=64, L=256, C=8192, K=4)  # qwen3.5-35b-a3b: 64 prompts of 256 tokens


def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    return torch.device("cuda")


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "joined-slice"])
def test_the_kernel_equals_the_torch_form_at_the_prefill_shape(state_dtype, strided):
    """joined-slice: qkv the first C columns of the batch generator's one projection GEMM (Qwen3.5-35B-A3B's 12,352
    columns: qkv, z, b, a), 250 tokens (the last token block cut short)."""
    qkv, conv, weight = (t.to(cuda()) for t in random_chunk(**PREFILL_SHAPE, dtype=torch.bfloat16,
                                                            state_dtype=state_dtype, seed=0))
    if strided:
        wide = torch.randn(64, 250, 12352, device=cuda()).bfloat16()
        qkv = wide[..., :8192]
    before = conv.clone()
    want = torch_form(qkv, conv, weight)
    assert conv_prefill.usable(qkv, conv, weight)
    got = conv_prefill.conv_silu(qkv, conv, weight)
    assert torch.equal(conv, before)
    assert_silu_of_the_rounded_conv(got, qkv, conv, weight)
    share = (got == want).float().mean().item()
    assert share >= 0.99, share


@pytest.mark.parametrize("rule", ["torch", "fla"])
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_layers_prefill_with_the_kernel_equals_its_torch_prefill(family, rule, monkeypatch):
    """fp32 layers, the torch form's convolution in fp32 too (cuDNN would otherwise take TF32 products); two chunks,
    rows right-padded (valid 9, 4, 0 of the first), then a step; the rule in torch or through fla's chunked kernel
    (whose fp32 products are TF32: an fp32 ulp of the convolution's sum order can move a TF32 rounding there, so
    test_linear_layer_gpu.py's tolerance)."""
    dev = cuda()
    if rule == "fla" and kernel_for(dev) != "fla":
        pytest.fail("the gpu tier needs fla installed")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    calls = []
    kernel = conv_prefill.conv_silu
    monkeypatch.setattr(conv_prefill, "conv_silu", lambda *args: calls.append(1) or kernel(*args))
    inner = copy.deepcopy(hf_layer(family)).to(dev)
    x = torch.randn(ROWS, 13, DIM, generator=torch.Generator().manual_seed(6)).to(dev)
    first, second = torch.tensor([9, 4, 0], device=dev), torch.tensor([3, 3, 2], device=dev)
    mine, plain = (GatedDeltaNetDecode(inner, ROWS, block=4, kernel=rule, conv_kernel=k) for k in (True, False))
    with torch.no_grad():
        outs = [[layer.prefill(x[:, :9], first), layer.prefill(x[:, 9:12], second), layer.step(x[:, 12:])]
                for layer in (mine, plain)]
    tol = 1e-5 if rule == "torch" else 5e-3
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(mine.conv, plain.conv)
    torch.testing.assert_close(mine.state, plain.state, atol=tol, rtol=tol)
    assert len(calls) == 2  # the kernel ran (usable on the GPU), twice
