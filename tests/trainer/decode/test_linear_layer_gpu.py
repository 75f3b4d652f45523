"""The Gated DeltaNet decode layer on CUDA, every method captured as a CUDA graph and replayed (run on the H200:
`python3 -m pytest -m gpu tests/trainer/decode/test_linear_layer_gpu.py`; the fla prefill needs fla-core): a padded
prefill, a verify, a commit of different counts per row, decode steps and a row reset, against HF's layer over each
row's own sequence in fp32 on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.families import family_config
from trainer.capture import capture
from trainer.decode.layers.linear import GatedDeltaNetDecode
from trainer.model.linear_attention import fla_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS, DIM, PROMPT, BLOCK = 3, 64, 80, 8


def hf_layer(family: str):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config(family, 64)).float().eval()
    return model.model.layers[0].linear_attn


@pytest.mark.parametrize("kernel", ["fla", "torch"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_graph_replayed_layer_equals_hfs_layer_per_row(family, kernel):
    if kernel == "fla":
        assert fla_available(), "the gpu tier needs fla-core (pip install fla-core einops)"
    cpu = hf_layer(family)
    dev = torch.device("cuda")
    layer = GatedDeltaNetDecode(copy.deepcopy(cpu).to(dev), ROWS, block=BLOCK, kernel=kernel)
    gen = torch.Generator().manual_seed(1)
    prompt, block, steps = (torch.randn(ROWS, n, DIM, generator=gen) for n in (PROMPT, BLOCK, 2))
    lengths, accepted = [PROMPT, PROMPT - 3, 1], [0, 3, BLOCK]

    # static inputs and the graphs over them; each warm-up runs the method, so the state is reset after capture
    x_prefill, valid = torch.zeros(ROWS, PROMPT, DIM, device=dev), torch.full((ROWS,), PROMPT, device=dev)
    x_block, kept = torch.zeros(ROWS, BLOCK, DIM, device=dev), torch.zeros(ROWS, dtype=torch.long, device=dev)
    x_step, rows = torch.zeros(ROWS, 1, DIM, device=dev), torch.zeros(ROWS, dtype=torch.bool, device=dev)
    with torch.no_grad():
        g_prefill, out_prefill = capture(lambda: layer.prefill(x_prefill, valid), dev)
        g_verify, out_verify = capture(lambda: layer.forward(x_block), dev)
        g_commit, _ = capture(lambda: layer.commit(kept), dev)
        g_step, out_step = capture(lambda: layer.step(x_step), dev)
        g_reset, _ = capture(lambda: layer.reset(rows), dev)
    layer.reset(torch.ones(ROWS, dtype=torch.bool, device=dev))

    x_prefill.copy_(prompt)
    valid.copy_(torch.tensor(lengths))
    g_prefill.replay()
    x_block.copy_(block)
    g_verify.replay()
    verified = out_verify.cpu()
    kept.copy_(torch.tensor(accepted))
    g_commit.replay()
    stepped = []
    for t in range(2):
        x_step.copy_(steps[:, t:t + 1])
        g_step.replay()
        stepped.append(out_step.cpu())
    stepped = torch.cat(stepped, 1)
    prefilled = out_prefill.cpu()

    def close(got, want):
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert err <= 5e-3 * scale, (family, kernel, err, scale)  # fla's fp32 dots run as TF32

    with torch.no_grad():
        for r, n in enumerate(lengths):
            seq = torch.cat([prompt[r, :n], block[r]])[None]
            want = cpu(seq)
            close(prefilled[r:r + 1, :n], want[:, :n])
            close(verified[r:r + 1], want[:, n:])
            seq = torch.cat([prompt[r, :n], block[r, :accepted[r]], steps[r]])[None]
            close(stepped[r:r + 1], cpu(seq)[:, -2:])

    # a reset row starts afresh inside the graph; the others go on
    rows.copy_(torch.tensor([True, False, False]))
    g_reset.replay()
    x_step.copy_(steps[:, :1])
    g_step.replay()
    with torch.no_grad():
        close(out_step.cpu()[:1], cpu(steps[:1, :1]))
        seq = torch.cat([prompt[1, :lengths[1]], block[1, :accepted[1]], steps[1], steps[1, :1]])[None]
        close(out_step.cpu()[1:2], cpu(seq)[:, -1:])
