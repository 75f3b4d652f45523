"""The refilling generator's fused projections (trainer/decode/fused.py) and the residual add + norm kernel
(trainer/decode/kernels.py `RowInvariantRMSNorm.add`): q/k/v and gate/up as one GEMM over the modules' own weights
(views, no copy), silu(gate) * up as one kernel, on the real tiny targets of each family; the generator's greedy
answers through them are HF's; a verify's target refuses them. Kernels on CPU under Triton's interpreter;
tests/trainer/decode/test_fused_gpu.py compares bits on the H200."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.decode.test_generate import LENGTHS, family_target, prompts_of, stops_inside
from tests.trainer.families import load_two_layers
from trainer.decode import kernels
from trainer.decode.fused import Joined, SiluMlp, silu_mul
from trainer.decode.generate import BatchGenerator, Sampling, hf_generate
from trainer.decode.layers.attention import AttentionLayer
from trainer.decode.layers.moe import MoeMLP
from trainer.decode.stack import StaticTarget


def attention_layers(static: StaticTarget) -> list[AttentionLayer]:
    return [m for m in static.mixers if isinstance(m, AttentionLayer)]


def storages(model) -> int:
    """Bytes of the distinct storages behind the model's parameters."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


def inside(t: torch.Tensor, joined: torch.Tensor) -> bool:
    start, size = joined.data_ptr(), joined.numel() * joined.element_size()
    return (t.untyped_storage().data_ptr() == joined.untyped_storage().data_ptr()
            and start <= t.data_ptr() < start + size)


# qwen2: q/k/v biases; gemma3: joined q/k/v, its gelu MLP left as HF's; qwen3_5: a hybrid's gated q (2 x the heads)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "gemma3", "qwen3_5"])
@torch.no_grad()
def test_joined_projections_equal_the_separate_calls_over_views_of_the_weights(family, dtype, family_dirs):
    """Each attention layer's joined q/k/v (and each dense SiLU MLP's gate/up) gives what the modules gave one by
    one, bit for bit (on CPU, fp32 and bf16 alike, each output column's K sum is computed the same way in the
    wider GEMM); the modules' weights and biases are views into the joined tensors, so memory and the state_dict are
    as they were."""
    target = family_target(family_dirs, family)
    target.model.to(dtype)
    torch.manual_seed(0)
    D = target.hf_config.hidden_size
    h = torch.randn(3, 5, D).to(dtype)
    layers = [layer for layer in target.model.model.layers if hasattr(layer, "self_attn")]
    want = [[lin(h) for lin in (a.self_attn.q_proj, a.self_attn.k_proj, a.self_attn.v_proj)] for a in layers]
    mlps = [layer.mlp for layer in target.model.model.layers]
    want_gate_up = [(m.gate_proj(h), m.up_proj(h)) for m in mlps if hasattr(m, "gate_proj")]
    state = {k: v.clone() for k, v in target.model.state_dict().items()}
    before = storages(target.model)

    static = StaticTarget(target, 16, rows=2, padded=True, fuse=True)

    joined = [m.project for m in attention_layers(static)]
    assert len(joined) == len(layers) and all(isinstance(j, Joined) for j in joined)
    for j, layer, w in zip(joined, layers, want):
        got = j(h)
        assert all(torch.equal(g, x) for g, x in zip(got, w))
        attn = layer.self_attn
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert inside(lin.weight, j.weight) and (lin.bias is None or inside(lin.bias, j.bias))
        assert (j.bias is not None) == (family == "qwen2")
    fused = [m for m in static.mlps if isinstance(m, SiluMlp)]
    assert len(fused) == (0 if family == "gemma3" else len(mlps))  # Gemma's gelu MLP stays HF's
    for m, (gate, up) in zip(fused, want_gate_up):
        gu = F.linear(h, m.gate_up.weight)
        assert torch.equal(gu[..., :m.intermediate], gate) and torch.equal(gu[..., m.intermediate:], up)
    assert storages(target.model) == before
    after = target.model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())


@torch.no_grad()
def test_joining_a_target_twice_allocates_nothing(family_dirs):
    target = family_target(family_dirs, "qwen3")
    first = StaticTarget(target, 16, rows=2, padded=True, fuse=True)
    before = storages(target.model)
    second = StaticTarget(target, 16, rows=2, padded=True, fuse=True)
    assert storages(target.model) == before
    for a, b in zip(attention_layers(first), attention_layers(second)):
        assert a.project.weight.data_ptr() == b.project.weight.data_ptr()
        assert torch.equal(a.project.weight, b.project.weight)


@torch.no_grad()
def test_an_moe_layers_shared_expert_is_fused_and_its_routed_experts_are_not(family_dirs):
    """Qwen3.5-MoE: each MoE layer stays the engine's grouped experts, its shared expert a `SiluMlp` over views of
    its own weights whose output is the HF module's, bit for bit (CPU)."""
    target = family_target(family_dirs, "qwen3_5_moe")
    blocks = [layer.mlp for layer in target.model.model.layers]
    torch.manual_seed(0)
    h = torch.randn(3, 5, target.hf_config.get_text_config().hidden_size)
    want = [block.shared_expert(h) for block in blocks]
    static = StaticTarget(target, 16, rows=2, padded=True, fuse=True)
    moe = [m for m in static.mlps if isinstance(m, MoeMLP)]
    assert len(moe) == len(blocks) and all(isinstance(m.shared, SiluMlp) for m in moe)
    for m, block, w in zip(moe, blocks, want):
        assert torch.equal(m.shared(h), w) and inside(block.shared_expert.gate_proj.weight, m.shared.gate_up.weight)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
@torch.no_grad()
def test_a_linear_layers_input_projections_are_one_gemm(family, family_dirs):
    """A Gated DeltaNet layer's input linears (Qwen3.5: qkv, z, b, a; Qwen3-Next: qkvz, ba) as one GEMM over views of
    their weights: `project` gives what the modules gave one by one, within an fp32 ulp (CPU's GEMM may sum a narrow
    output, b's and a's few columns, another way alone than inside the wide one); memory as it was."""
    from trainer.decode.layers.linear import GatedDeltaNetDecode
    from trainer.model.linear_attention import input_projections, project

    target = family_target(family_dirs, family)
    torch.manual_seed(0)
    h = torch.randn(3, 5, target.hf_config.get_text_config().hidden_size)
    inner = [getattr(layer.linear_attn, "inner", layer.linear_attn) for layer in target.model.model.layers
             if hasattr(layer, "linear_attn")]
    want = [project(m, h) for m in inner]
    before = storages(target.model)
    static = StaticTarget(target, 16, rows=2, padded=True, fuse=True)
    linear = [m for m in static.mixers if isinstance(m, GatedDeltaNetDecode)]
    assert len(linear) == len(inner) > 0 and all(isinstance(m.joined, Joined) for m in linear)
    for m, w in zip(linear, want):
        assert all(inside(lin.weight, m.joined.weight) for lin in input_projections(m.inner))
        got = project(m.inner, h, m.joined)
        torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-6)
    assert storages(target.model) == before


@torch.no_grad()
def test_an_moe_layers_router_and_shared_gate_are_one_gemm(family_dirs):
    """Qwen3.5-MoE: the router's weight and the shared expert's gate as one [E + 1, D] weight (views, no copy); the
    layer's output is the unjoined layer's."""
    target = family_target(family_dirs, "qwen3_5_moe")
    torch.manual_seed(0)
    h = torch.randn(3, 5, target.hf_config.get_text_config().hidden_size)
    plain = StaticTarget(target, 16, rows=2, padded=True)
    want = [m(h) for m in plain.mlps if isinstance(m, MoeMLP)]
    assert all(m.router_gate is None for m in plain.mlps if isinstance(m, MoeMLP))
    static = StaticTarget(target, 16, rows=2, padded=True, fuse=True)
    moe = [m for m in static.mlps if isinstance(m, MoeMLP)]
    assert len(moe) == len(want) > 0
    for m, w in zip(moe, want):
        assert m.router_gate is not None and m.router_gate.shape[0] == m.num_experts + 1
        assert inside(m.router.weight, m.router_gate) and inside(m.block.shared_expert_gate.weight, m.router_gate)
        torch.testing.assert_close(m(h), w, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_moe_and_verify_targets_keep_their_own_layers(family_dirs):
    """MoE MLPs stay the engine's grouped experts; a target built for a lossless verify refuses the joined GEMMs;
    without `fuse` the stack calls the modules."""
    target = family_target(family_dirs, "qwen3_moe")
    static = StaticTarget(target, 16, rows=2, padded=True, fuse=True)
    assert all(isinstance(m, MoeMLP) for m, kind in zip(static.mlps, static.plan.mlps) if kind == "moe")
    assert all(m.project is not None for m in attention_layers(static))
    plain = StaticTarget(family_target(family_dirs, "qwen3"), 16)
    assert all(m.project is None for m in attention_layers(plain)) and not any(isinstance(m, SiluMlp)
                                                                             for m in plain.mlps)
    with pytest.raises(ValueError, match="verify"):
        StaticTarget(family_target(family_dirs, "qwen3"), 16, invariant=True, fuse=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_is_torchs_silu_times_up(interpreter, dtype):
    """[gate | up] rows (a width over two column blocks, the last partial) -> silu(gate) * up. Under the interpreter
    exp is numpy's (an fp32 ulp from torch's) and bf16 casts truncate, so: close, not equal; the GPU test compares
    bits."""
    torch.manual_seed(1)
    n = 1500
    gu = (torch.randn(2, 3, 2 * n) * 4).to(dtype)
    got = silu_mul(gu, n)
    want = F.silu(gu[..., :n]) * gu[..., n:]
    assert got.shape == (2, 3, n) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_kernel_is_the_add_then_the_norm(interpreter, dtype, offset):
    """One launch for x + out and its norm: in fp32 both outputs equal the two ops' bitwise; in bf16 the
    interpreter truncates the sum where torch rounds it (the GPU rounds: test_fused_gpu.py compares bits), so the sum
    is within one bf16 step, and the norm is the norm kernel's of that sum, bitwise. A row alone as among others."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(2)
    module = Qwen3RMSNorm(96, eps=1e-6)
    module.weight.data.normal_(0.0 if offset else 1.0, 0.2)
    module.to(dtype)
    norm = kernels.RowInvariantRMSNorm(module, offset=offset)
    x, out = (torch.randn(2, 8, 96) * 3).to(dtype), torch.randn(2, 8, 96).to(dtype)
    assert norm.uses_kernel(x)
    s, y = norm.add(x, out)
    assert s.shape == y.shape == x.shape and s.dtype == y.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(s, x + out) and torch.equal(y, norm(x + out))
    else:
        torch.testing.assert_close(s.float(), (x + out).float(), rtol=2 ** -7, atol=0)
        assert torch.equal(y, norm(s))
    s1, y1 = norm.add(x[:1, 3:4], out[:1, 3:4])
    assert torch.equal(s1, s[:1, 3:4]) and torch.equal(y1, y[:1, 3:4])


def test_add_norm_outside_the_kernel_is_the_two_ops():
    """Where the kernel does not run (CPU without the interpreter), the same two ops as before."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    module = Qwen3RMSNorm(96, eps=1e-6)
    norm = kernels.RowInvariantRMSNorm(module)
    x, out = torch.randn(4, 96), torch.randn(4, 96)
    assert not norm.uses_kernel(x)
    s, y = norm.add(x, out)
    assert torch.equal(s, x + out) and torch.equal(y, module(x + out))


def counting_calls(modules) -> tuple[list, list]:
    calls: list = []
    return calls, [m.register_forward_hook(lambda *_: calls.append(1)) for m in modules]


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # qwen2: biased q/k/v, sliding layers (no row kernel)
def test_the_generator_answers_as_hf_through_the_fused_kernels(interpreter, family, two_layer_dirs):
    """The batch generator with every kernel running (interpreter): greedy answers equal HF `generate`'s, and its
    forward never called the HF q/k/v, gate/up projections or activation (the joined GEMMs and the SiLU kernel
    computed them); the same generator without `fuse` calls them. Two-layer targets: the interpreter's cost is per
    layer."""
    target = load_two_layers(two_layer_dirs[family])
    prompts = prompts_of(target, LENGTHS)
    greedy = Sampling(max_new_tokens=12)
    stops = stops_inside(target, prompts, 12)
    want = hf_generate(target.model, prompts, greedy, stops, target.tokenizer.pad_token_id)
    watched = [m for layer in target.model.model.layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                                  layer.self_attn.v_proj, layer.mlp.gate_proj,
                                                                  layer.mlp.up_proj, layer.mlp.act_fn)]
    gen = BatchGenerator(target, rows=4, max_len=28, stop_ids=stops, graphs=False)  # (its MLP probe calls them)
    calls, hooks = counting_calls(watched)
    assert gen.static.row_kernel == (family == "qwen3") and all(isinstance(m, SiluMlp) for m in gen.static.mlps)
    assert gen.generate(prompts, greedy) == want and not calls
    unfused = BatchGenerator(target, rows=4, max_len=28, stop_ids=stops, graphs=False, fuse=False)
    assert unfused.generate(prompts, greedy) == want and calls
    for hook in hooks:
        hook.remove()


COMPILE_FOR_H200 = r'''
import json
from tests.trainer.cubin import sm90
from trainer.decode import fused

out = {}
for dt in ("bf16", "fp32"):
    sig = {"gu_ptr": "*" + dt, "h_ptr": "*" + dt, "gu_stride": "i32", "n": "i32"}
    compiled = sm90(fused._kernel(), sig, {"BLOCK": fused.SILU_BLOCK, "LIBDEVICE": True}, num_warps=4,
                    aligned_ints=True)
    out[dt] = {"stages": sorted(compiled.asm), "ptx": compiled.asm["ptx"]}
print("COMPILED " + json.dumps(out))
'''


def test_silu_kernel_compiles_for_the_h200_with_cudas_exp_and_division(tmp_path):
    """The GPU form (libdevice's expf, an IEEE division), which the interpreter never runs, compiles to a cubin for
    sm_90; its PTX divides with div.rn, not the approximate division."""
    from tests.trainer.cubin import compile_for_h200

    compiled = compile_for_h200(COMPILE_FOR_H200, tmp_path)
    assert set(compiled) == {"bf16", "fp32"}
    for c in compiled.values():
        assert "cubin" in c["stages"] and "div.rn.f32" in c["ptx"] and "div.full.f32" not in c["ptx"]
