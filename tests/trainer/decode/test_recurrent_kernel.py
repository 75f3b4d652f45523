"""The hybrids' fused one-token Gated DeltaNet step (trainer/decode/recurrent_kernel.py) on CPU tensors under
Triton's interpreter: equal to the torch rule (`gated_delta_step`) in fp32 and with bf16 inputs, with fewer key heads
than value heads, the new state written into the state it was given; the decode layer's steps through it equal its
torch steps for each hybrid family's tiny layer; the op traces whole under torch.compile; the kernel compiles to an
sm_90 cubin without a GPU."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.families import HYBRID_FAMILIES, family_config
from trainer.decode import recurrent_kernel
from trainer.decode.layers.linear import GatedDeltaNetDecode
from trainer.model.linear_attention import gated_delta_step

ROWS, DIM = 3, 64




def random_step(R, Hk, Hv, dk, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(R, 1, Hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(R, 1, Hv, dv, generator=gen).to(dtype)
    g = -3 * torch.rand(R, 1, Hv, generator=gen)  # fp32 log decays, as `gates` computes them
    beta = torch.rand(R, 1, Hv, generator=gen).to(dtype)
    state = torch.randn(R, Hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("Hk, Hv, dk, dv", [(2, 4, 32, 48), (4, 4, 16, 16), (1, 3, 24, 40)])
def test_the_fused_step_equals_the_torch_rule_in_place(interpreter, dtype, tol, Hk, Hv, dk, dv):
    q, k, v, g, beta, state = random_step(4, Hk, Hv, dk, dv, dtype, seed=Hv + dk)
    want, want_state = gated_delta_step(q, k, v, g, beta, state)
    mine = state.clone()
    ptr = mine.data_ptr()
    got = recurrent_kernel.gated_delta_step_(q, k, v, g, beta, mine)
    assert got.shape == want.shape and got.dtype == dtype
    assert mine.data_ptr() == ptr and mine.dtype == torch.float32
    torch.testing.assert_close(mine, want_state, atol=1e-5, rtol=1e-5)  # the state stays fp32 from any inputs
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert (mine - state).abs().max() > 0.1  # the buffer did change


def test_strided_views_of_the_convolved_channels_are_read_in_place(interpreter):
    """The layer hands q, k, v as views into one [R, 1, C] tensor (`split_heads`): the kernel reads their strides."""
    R, Hk, Hv, d = 2, 2, 4, 16
    gen = torch.Generator().manual_seed(3)
    mixed = torch.randn(R, 1, 2 * Hk * d + Hv * d, generator=gen)
    q, k, v = torch.split(mixed, [Hk * d, Hk * d, Hv * d], dim=-1)
    q, k, v = q.reshape(R, 1, Hk, d), k.reshape(R, 1, Hk, d), v.reshape(R, 1, Hv, d)
    g, beta = -torch.rand(R, 1, Hv, generator=gen), torch.rand(R, 1, Hv, generator=gen)
    state = torch.randn(R, Hv, d, d, generator=gen)
    want, want_state = gated_delta_step(q, k, v, g, beta, state)
    got = recurrent_kernel.gated_delta_step_(q, k, v, g, beta, state)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)


def test_a_state_of_the_wrong_layout_is_refused(interpreter):
    q, k, v, g, beta, state = random_step(2, 2, 4, 16, 16, torch.float32, seed=0)
    for bad in (state.transpose(-1, -2), state.double(), state[:, :2]):
        with pytest.raises(ValueError, match="contiguous fp32 state"):
            recurrent_kernel.gated_delta_step_(q, k, v, g, beta, bad)


def test_the_op_traces_whole_under_torch_compile(interpreter):
    """compile='all' sends the step through Dynamo: the op stays one opaque node that mutates the state."""
    q, k, v, g, beta, state = random_step(2, 2, 4, 16, 16, torch.float32, seed=1)
    want, want_state = gated_delta_step(q, k, v, g, beta, state)
    torch._dynamo.reset()
    compiled = torch.compile(recurrent_kernel.gated_delta_step_, backend="aot_eager", fullgraph=True)
    got = compiled(q, k, v, g, beta, state)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)


def hf_layer(family: str):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config(family, 64)).float().eval()
    return model.model.layers[0].linear_attn


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_layers_fused_steps_equal_its_torch_steps(interpreter, family):
    inner = hf_layer(family)
    x = torch.randn(ROWS, 12, DIM, generator=torch.Generator().manual_seed(2))
    fused, plain = (GatedDeltaNetDecode(inner, ROWS, block=4, fused=f) for f in (True, False))
    assert fused.fused and not plain.fused
    state, conv = fused.state, fused.conv
    ptr = state.data_ptr()
    with torch.no_grad():
        outs = [(layer.prefill(x[:, :8]), [layer.step(x[:, t:t + 1]) for t in range(8, 12)])
                for layer in (fused, plain)]
    assert fused.state is state and fused.conv is conv and state.data_ptr() == ptr
    (pre_f, steps_f), (pre_p, steps_p) = outs
    torch.testing.assert_close(pre_f, pre_p)  # the prefill is the same torch rule
    torch.testing.assert_close(torch.cat(steps_f, 1), torch.cat(steps_p, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.state, plain.state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.conv, plain.conv)


def test_the_layer_refuses_a_fused_step_where_no_kernel_runs():
    from trainer import triton_device

    assert not triton_device.CPU_UNDER_INTERPRETER  # outside the fixture CPU tensors run no Triton kernel
    with pytest.raises(ValueError, match="fused step needs Triton"):
        GatedDeltaNetDecode(hf_layer("qwen3_5"), ROWS, block=4, fused=True)
    assert not GatedDeltaNetDecode(hf_layer("qwen3_5"), ROWS, block=4).fused  # the torch kernel steps in torch


COMPILE_FOR_H200 = r'''
import json
from tests.trainer.cubin import sm90
from trainer.decode import recurrent_kernel

fn = recurrent_kernel._kernel()
out = {}
for dt in ("bf16", "fp32"):
    sig = {"q_ptr": "*" + dt, "k_ptr": "*" + dt, "v_ptr": "*" + dt, "g_ptr": "*fp32", "beta_ptr": "*" + dt,
           "s_ptr": "*fp32", "o_ptr": "*" + dt, "scale": "fp32",
           **{n: "i32" for n in "sq_r sq_h sk_r sk_h sv_r sv_h sg_r sb_r so_r so_h".split()}}
    consts = {"HV": 32, "GROUP": 2, "DK": 128, "DV": 128, "BK": 128, "BV": recurrent_kernel.BLOCK_V}
    compiled = sm90(fn, sig, consts, num_warps=recurrent_kernel.WARPS)
    out[dt] = sorted(compiled.asm)
print("COMPILED " + json.dumps(out))
'''


def test_the_kernel_compiles_for_the_h200(tmp_path):
    """What only the compiler checks (types, layouts), at Qwen3.5-9B's shapes (32 value heads over 16 key heads,
    dk = dv = 128), in bf16 and fp32: down to an sm_90 cubin by triton's compiler and its bundled ptxas."""
    from tests.trainer.cubin import compile_for_h200

    compiled = compile_for_h200(COMPILE_FOR_H200, tmp_path)
    assert set(compiled) == {"bf16", "fp32"}
    assert all("cubin" in stages and "ptx" in stages for stages in compiled.values())
