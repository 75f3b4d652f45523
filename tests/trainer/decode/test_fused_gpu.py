"""The refilling generator's fusions on CUDA (run on the H200: `python3 -m pytest -m gpu tests/trainer/decode`):
with them the generator answers token for token as without them (bf16 tiny targets, graph replay), the residual
add + norm kernel gives the two launches' bits at qwen3-8b's width and batch, and the SiLU kernel torch's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.decode.test_generate import REFILL_LENGTHS, prompts_of, stops_inside
from trainer.decode import kernels
from trainer.decode.fused import SiluMlp, silu_mul
from trainer.decode.generate import BatchGenerator, Sampling
from trainer.model.target import load_target

pytestmark = pytest.mark.gpu


def cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    return torch.device("cuda")


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # qwen2: biased q/k/v
def test_the_fused_generator_answers_as_the_unfused_one(family, family_dirs):
    """Nine prompts through 3 refilled rows, graphs replayed, bf16: greedy and sampled answers with the joined
    GEMMs, the SiLU kernel and the add + norm kernel equal those of the separate projections and HF's MLP."""
    cuda()
    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), device="cuda", dtype="bfloat16",
                         truncate=False)
    prompts = prompts_of(target, REFILL_LENGTHS + (90,), seed=3)
    stops = stops_inside(target, prompts, 40)
    unfused = BatchGenerator(target, rows=3, max_len=160, stop_ids=stops, fuse=False)
    fused = BatchGenerator(target, rows=3, max_len=160, stop_ids=stops)
    assert all(isinstance(m, SiluMlp) for m in fused.static.mlps) and fused.static.mixers[0].project is not None
    for sampling in (Sampling(max_new_tokens=40), Sampling(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=11)):
        assert fused.generate(prompts, sampling) == unfused.generate(prompts, sampling)
    assert fused.refilled >= 6 and all(p.graph is not None for p in fused.programs.values())


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_norm_kernel_gives_the_bits_of_the_add_then_the_norm(dtype, offset):
    """qwen3-8b's width (4096) and the generator's 256 rows: the one-launch residual add + norm equals torch's add
    followed by the norm kernel, bit for bit, in both outputs."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    device = cuda()
    torch.manual_seed(0)
    module = Qwen3RMSNorm(4096, eps=1e-6).to(device)
    module.weight.data.normal_(0.0 if offset else 1.0, 0.2)
    module.to(dtype)
    norm = kernels.RowInvariantRMSNorm(module, offset=offset)
    x = (torch.randn(256, 1, 4096, device=device) * 4).to(dtype)
    out = torch.randn(256, 1, 4096, device=device).to(dtype)
    assert norm.uses_kernel(x)
    s, y = norm.add(x, out)
    assert torch.equal(s, x + out) and torch.equal(y, norm(x + out))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_kernel_gives_torchs_bits(dtype):
    """qwen3-8b's intermediate width (12288) and 256 rows: silu(gate) * up from the joined GEMM's [gate | up] rows
    equals torch's F.silu(gate) * up, bit for bit (CUDA's expf and an IEEE division in the kernel)."""
    device = cuda()
    torch.manual_seed(1)
    n = 12288
    gu = (torch.randn(256, 1, 2 * n, device=device) * 4).to(dtype)
    assert torch.equal(silu_mul(gu, n), F.silu(gu[..., :n]) * gu[..., n:])
