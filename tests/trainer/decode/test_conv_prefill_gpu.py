"""The prefill convolution kernel (trainer/decode/conv_prefill.py) compiled on CUDA (run on the H200: `python3 -m
pytest -m gpu tests/trainer/decode/test_conv_prefill_gpu.py`): at qwen3.5-35b-a3b's prefill shape in bf16 against the
torch form (bit for bit but where the conv's sum order flips a rounding, as conv_prefill.py's docstring says), the
state it reads left as it was; the decode layer's prefill (fla's chunked rule where installed) with and without it for
each hybrid family's tiny layer in fp32, rows right-padded."""
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
def test_the_kernel_equals_the_torch_form_at_the_prefill_shape(state_dtype):
    qkv, conv, weight = (t.to(cuda()) for t in random_chunk(**PREFILL_SHAPE, dtype=torch.bfloat16,
                                                            state_dtype=state_dtype, seed=0))
    before = conv.clone()
    want = torch_form(qkv, conv, weight)
    assert conv_prefill.usable(qkv, conv, weight)
    got = conv_prefill.conv_silu(qkv, conv, weight)
    assert torch.equal(conv, before)
    assert_silu_of_the_rounded_conv(got, qkv, conv, weight)
    share = (got == want).float().mean().item()
    assert share >= 0.99, share


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_layers_prefill_with_the_kernel_equals_its_torch_prefill(family, monkeypatch):
    """fp32 layers, the torch form's convolution in fp32 too (cuDNN would otherwise take TF32 products); two chunks,
    rows right-padded (valid 9, 4, 0 of the first), then a step."""
    dev = cuda()
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    inner = copy.deepcopy(hf_layer(family)).to(dev)
    x = torch.randn(ROWS, 13, DIM, generator=torch.Generator().manual_seed(6)).to(dev)
    first, second = torch.tensor([9, 4, 0], device=dev), torch.tensor([3, 3, 2], device=dev)
    mine, plain = (GatedDeltaNetDecode(inner, ROWS, block=4, kernel=kernel_for(dev), conv_kernel=k)
                   for k in (True, False))
    with torch.no_grad():
        outs = [[layer.prefill(x[:, :9], first), layer.prefill(x[:, 9:12], second), layer.step(x[:, 12:])]
                for layer in (mine, plain)]
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(mine.conv, plain.conv)
    torch.testing.assert_close(mine.state, plain.state, atol=1e-5, rtol=1e-5)
