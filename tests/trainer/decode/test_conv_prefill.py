"""The prefill convolution kernel (trainer/decode/conv_prefill.py) on CPU tensors under Triton's interpreter: equal to
the torch form (`causal_conv1d_window` over the cat of the state and the chunk) within fp32's rounding, and in bf16
SiLU of the conv's sum rounded to a bf16 neighbour at most (the interpreter's casts truncate); chunks shorter than the
state, token and channel blocks cut short, K = 2, strided chunks, a state in another dtype, the state left as it was;
`state_after` against the window's last inputs; the decode layer's prefill with and without it, right-padded rows
included, for each hybrid family; its bounds; the kernel compiles to an sm_90 cubin without a GPU."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_conv_step import DIM, ROWS, TOL, assert_silu_of_the_rounded_conv
from tests.trainer.decode.test_recurrent_kernel import hf_layer
from tests.trainer.families import HYBRID_FAMILIES
from trainer.decode import conv_prefill
from trainer.decode.layers.linear import GatedDeltaNetDecode
from trainer.model.linear_attention import causal_conv1d_window


def window_of(qkv, conv):
    return torch.cat([conv.transpose(1, 2).to(qkv.dtype), qkv], dim=1)  # [R, K-1+L, C]


def torch_form(qkv, conv, weight):
    return causal_conv1d_window(window_of(qkv, conv), weight)


def random_chunk(R, L, C, K, dtype, state_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(R, L, C, generator=gen).to(dtype)
    conv = torch.randn(R, C, K - 1, generator=gen).bfloat16().to(state_dtype)
    weight = (torch.randn(C, K, generator=gen) / K ** 0.5).bfloat16().to(state_dtype)
    return qkv, conv, weight


def assert_like_torch(qkv, conv, weight) -> None:
    before = conv.clone()
    want = torch_form(qkv, conv, weight)
    assert conv_prefill.usable(qkv, conv, weight)
    got = conv_prefill.conv_silu(qkv, conv, weight)
    assert got.shape == qkv.shape and got.dtype == qkv.dtype and got.is_contiguous()
    assert torch.equal(conv, before)  # read, not changed
    if qkv.dtype == torch.float32:
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    else:
        assert_silu_of_the_rounded_conv(got, qkv, conv, weight)
        assert_silu_of_the_rounded_conv(want, qkv, conv, weight)  # the band holds torch's own too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R, L, C, K", [(1, 1, 96, 4), (3, 2, 200, 4), (2, 37, 300, 4), (4, 20, 64, 2),
                                        (2, 5, 40, 6)])
def test_the_kernel_equals_the_torch_form(interpreter, dtype, R, L, C, K):
    """L = 1 and 2: every output reads the state, L < K - 1 reads only it and the chunk; L = 37: three token blocks,
    the last cut short, C = 300 two channel blocks; K = 2: a state of one input."""
    assert_like_torch(*random_chunk(R, L, C, K, dtype, dtype, seed=R * L + C + K))


@pytest.mark.parametrize("dtype, state_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_a_state_in_another_dtype_than_the_chunk(interpreter, dtype, state_dtype):
    assert_like_torch(*random_chunk(3, 19, 130, 4, dtype, state_dtype, seed=5))


def test_a_strided_chunk_and_state(interpreter):
    """qkv a column slice of a wider projection (the joined GEMM's output), the state every other row of a buffer."""
    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(3, 21, 150, generator=gen)
    buffer = torch.randn(6, 120, 3, generator=gen)
    weight = torch.randn(120, 1, 4, generator=gen).squeeze(1)
    assert_like_torch(wide[..., 10:130], buffer[::2], weight)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_state_after_is_the_windows_last_inputs(state_dtype):
    """valid 0 (the state unchanged), 1 and 2 (< K - 1: part state, part chunk), L - 1 and L: the last K - 1 inputs
    of cat(state, qkv[:valid]), as the window's gather gives them, cast back to the state's dtype exactly alike."""
    qkv, conv, _ = random_chunk(5, 7, 33, 4, torch.float32, state_dtype, seed=3)
    valid = torch.tensor([0, 1, 2, 6, 7])
    window = window_of(qkv, conv)
    at = (valid.view(-1, 1) + torch.arange(3))[..., None].expand(-1, -1, 33)
    want = conv.clone().copy_(window.gather(1, at).transpose(1, 2))
    got = conv.clone().copy_(conv_prefill.state_after(conv, qkv, valid))
    assert torch.equal(got, want)
    assert torch.equal(got[0], conv[0]) and torch.equal(got[4].float(), qkv[4, 4:].T.to(state_dtype).float())


def test_usable_within_its_bounds_only(interpreter, monkeypatch):
    from trainer import triton_device

    qkv, conv, weight = random_chunk(2, 5, 64, 4, torch.bfloat16, torch.bfloat16, seed=0)
    assert conv_prefill.usable(qkv, conv, weight)
    assert not conv_prefill.usable(qkv[:, :0], conv, weight)  # no tokens
    assert not conv_prefill.usable(qkv, conv[:, :, :0], weight[:, :1])  # K = 1: no state
    assert not conv_prefill.usable(qkv, conv, weight[:, :3])  # weight and state disagree on K
    assert not conv_prefill.usable(qkv, conv[:1], weight)  # rows
    assert not conv_prefill.usable(qkv, conv.double(), weight)
    with pytest.raises(ValueError, match="conv_silu: qkv"):
        conv_prefill.conv_silu(qkv, conv, weight[:, :3])
    monkeypatch.setattr(triton_device, "CPU_UNDER_INTERPRETER", False)
    assert not conv_prefill.usable(qkv, conv, weight)  # CPU outside the kernel tests: the torch form


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_layers_prefill_with_the_kernel_equals_its_torch_prefill(interpreter, monkeypatch, family):
    """Two prefill chunks (the second continues the first's state), rows right-padded to different lengths (valid 9,
    4 and 0 of the first: a row whose state stays zero), then steps: outputs within fp32's rounding, the conv states
    equal (the same inputs kept), the recurrent states close."""
    calls = []
    kernel = conv_prefill.conv_silu
    monkeypatch.setattr(conv_prefill, "conv_silu", lambda *args: calls.append(1) or kernel(*args))
    inner = hf_layer(family)
    x = torch.randn(ROWS, 16, DIM, generator=torch.Generator().manual_seed(6))
    first, second = torch.tensor([9, 4, 0]), torch.tensor([3, 3, 2])
    mine, plain = (GatedDeltaNetDecode(inner, ROWS, block=4, conv_kernel=k) for k in (True, False))
    with torch.no_grad():
        outs = [[layer.prefill(x[:, :9], first), layer.prefill(x[:, 9:12], second)] for layer in (mine, plain)]
        assert torch.equal(mine.conv, plain.conv)
        assert torch.equal(plain.conv[2, :, 0], torch.zeros_like(plain.conv[2, :, 0]))  # row 2: 2 inputs after zeros
        assert not torch.equal(plain.conv[2, :, 1:], torch.zeros_like(plain.conv[2, :, 1:]))
        for layer, out in zip((mine, plain), outs):
            out.extend(layer.step(x[:, t:t + 1]) for t in range(12, 16))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(mine.conv, plain.conv)
    torch.testing.assert_close(mine.state, plain.state, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2


COMPILE_FOR_H200 = r'''
import json
from tests.trainer.cubin import sm90
from trainer.decode import conv_prefill

fn = conv_prefill._kernel()
out = {}
for act, state in (("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32")):
    sig = {"qkv_ptr": "*" + act, "conv_ptr": "*" + state, "w_ptr": "*" + state, "out_ptr": "*" + act,
           **{n: "i32" for n in "L C sq_r sq_t sc_r sc_c sc_k sw_c sw_k".split()}}
    consts = {"TAPS": 4, "BLOCK_T": conv_prefill.BLOCK_T, "BLOCK_C": conv_prefill.BLOCK_C, "LIBDEVICE": True}
    compiled = sm90(fn, sig, consts, num_warps=4)
    ptx = compiled.asm["ptx"]
    out[act + "/" + state] = {"stages": sorted(compiled.asm), "ieee_division": "div.rn.f32" in ptx,
                              "shared": compiled.metadata.shared}
print("COMPILED " + json.dumps(out))
'''


def test_the_kernel_compiles_for_the_h200(tmp_path):
    """At qwen3.5-35b-a3b's K = 4, for bf16, fp32 and a bf16 chunk over an fp32 state: down to an sm_90 cubin, with
    IEEE divisions (Triton's `/` would be an approximate one), within a 99 KB SM's shared memory."""
    from tests.trainer.cubin import compile_for_h200

    compiled = compile_for_h200(COMPILE_FOR_H200, tmp_path)
    assert set(compiled) == {"bf16/bf16", "fp32/fp32", "bf16/fp32"}
    assert all("cubin" in c["stages"] and c["ieee_division"] for c in compiled.values())
    assert all(c["shared"] <= 99 * 1024 for c in compiled.values())
