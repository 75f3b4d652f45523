"""Batched generation with the target's decoder linears in FP8 (`regenerate --target-fp8`, `bench.generate
--target-fp8 1`): the target is quantized in place (`quantize_target_layers`) before the engine is built, and the
static engine, which calls the HF modules' projections, then runs the same FP8 modules as HF `generate` on that model.
On CPU the FP8 products are computed in fp32 from the same e4m3 values the H200 multiplies
(trainer/model/fp8.py); tests/trainer/decode/test_generate_fp8_gpu.py replays the graphs on the FP8 tensor cores."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_generate import REFILL_LENGTHS, family_target, prompts_of, stops_inside
from trainer.decode.generate import BatchGenerator, Sampling, hf_generate
from trainer.model.fp8 import Fp8Linear
from trainer.model.fp8_target import Fp8GatedMlp, quantize_target_layers


def fp8_modules(target) -> list:
    return [m for m in target.model.model.layers.modules() if isinstance(m, (Fp8Linear, Fp8GatedMlp))]


# dense; MoE (routed experts stay bf16: the engine's grouped expert GEMMs read their 3-D weights, the attention is
# FP8); hybrid (the Gated DeltaNet's input and output projections in FP8, read through `project`)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_5"])
@torch.no_grad()
def test_the_fp8_target_answers_as_hf_generate_on_the_same_fp8_model(family, family_dirs):
    """Eight prompts of 2..30 tokens through 3 refilled rows: every greedy answer of the static engine over the
    quantized target is HF `generate`'s on that same quantized model, the engine's forward passes through the FP8
    modules, and the model's logits are not the unquantized target's (the quantization is in the path; the tiny
    random targets' greedy answers may survive it)."""
    target = family_target(family_dirs, family)
    prompts = prompts_of(target, REFILL_LENGTHS, seed=3)
    greedy, pad = Sampling(max_new_tokens=24), target.tokenizer.pad_token_id
    stops = stops_inside(target, prompts, 24)
    probe = torch.tensor([prompts[1]])
    bf = target.model(probe).logits
    assert quantize_target_layers(target.model.model.layers) > 0
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in fp8_modules(target)]
    gen = BatchGenerator(target, rows=3, max_len=60, stop_ids=stops)
    got = gen.generate(prompts, greedy)
    assert calls and gen.refilled >= 3
    for h in hooks:
        h.remove()
    assert got == hf_generate(target.model, prompts, greedy, stops, pad)
    fp8 = target.model(probe).logits
    assert fp8.shape == bf.shape and not torch.equal(fp8, bf)
    assert float(torch.nn.functional.cosine_similarity(fp8.flatten(), bf.flatten(), dim=0)) > 0.99


@torch.no_grad()
def test_an_fp8_targets_qkv_join_into_one_e4m3_gemm_over_views(family_dirs):
    """The batch generator's target (`fuse`): each attention layer's FP8 q/k/v as one e4m3 GEMM (decode/fused.py
    `JoinedFp8`) whose outputs are each FP8 linear's alone, bit for bit (CPU: each column's fp32 sum as the narrower
    product's), the modules' e4m3 weights views into the joined one, and a second join allocates nothing."""
    from tests.trainer.decode.test_fused import attention_layers, inside
    from trainer.decode.fused import JoinedFp8
    from trainer.decode.stack import StaticTarget

    target = family_target(family_dirs, "qwen3")
    assert quantize_target_layers(target.model.model.layers) > 0
    layers = [layer.self_attn for layer in target.model.model.layers]
    torch.manual_seed(0)
    h = torch.randn(3, 5, target.hf_config.hidden_size)
    want = [[lin(h) for lin in (a.q_proj, a.k_proj, a.v_proj)] for a in layers]
    static = StaticTarget(target, 16, rows=2, padded=True, fuse=True)
    joined = [m.project for m in attention_layers(static)]
    assert len(joined) == len(layers) and all(isinstance(j, JoinedFp8) for j in joined)
    for j, attn, w in zip(joined, layers, want):
        assert all(torch.equal(g, x) for g, x in zip(j(h), w))
        assert all(inside(lin.weight_q, j.weight_q) for lin in (attn.q_proj, attn.k_proj, attn.v_proj))
    again = StaticTarget(target, 16, rows=2, padded=True, fuse=True)
    assert all(a.project.weight_q.data_ptr() == b.project.weight_q.data_ptr()
               for a, b in zip(attention_layers(static), attention_layers(again)))
