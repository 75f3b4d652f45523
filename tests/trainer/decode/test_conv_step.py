"""The one-token convolution, SiLU, conv-state shift and gates kernel (trainer/decode/conv_step.py) on CPU tensors under
Triton's interpreter: equal to the decode layer's torch ops (`causal_conv1d_window` over the cat of the state and the
input, the state copy, `gates`) in fp32, and in bf16 SiLU of the conv's sum rounded to a bf16 neighbour at most (the
interpreter rounds fp32 -> bf16 toward zero where the torch ops round to nearest), the state shifted in place exactly,
a state in another dtype than the input, softplus around its threshold, strided views; the decode layer's steps with
and without it for each hybrid family's tiny layer, whole and on a subset of rows (the refilling generator's compacted
step); its switch; the kernel compiles to an sm_90 cubin without a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.trainer.decode.test_recurrent_kernel import hf_layer
from tests.trainer.families import HYBRID_FAMILIES
from trainer.decode import conv_step
from trainer.decode.layers.linear import STEP, GatedDeltaNetDecode, LinearCall
from trainer.model.linear_attention import causal_conv1d_window, gates

ROWS, DIM = 3, 64
# fp32: the conv's sum order and numpy's exp / log against torch's; bf16 (beta): the interpreter's truncation and
# numpy's exp, an ulp each (2 ** -7 relative at most)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -6, atol=1e-5)}


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values (8 significant bits) at |x|, in x's dtype."""
    _, e = torch.frexp(x.abs().clamp_min(2 ** -126))
    return torch.ldexp(torch.ones_like(x), e - 8)


def assert_silu_of_the_rounded_conv(mixed, qkv, conv, weight) -> None:
    """bf16 `mixed` [R, L, C] against the rule from the window (the state `conv` before the call, then qkv [R, L, C]):
    SiLU of each of the conv's sums rounded to bf16, rounded. The sum is the kernels': K fp32 products (exact, of bf16
    factors) added in tap order, rounded once each, not the exact sum: where the taps cancel, an fp32 ulp of the
    partial sums is many bf16 ulps of the result (such sums turn up in 134M outputs at the 35B's prefill). The
    interpreter's cast truncates and torch's own sum order may differ: SiLU of the rounded sum or of a bf16
    neighbour, within an ulp (a flip can move SiLU's output by more than an ulp where it is flat, as far below 0)."""
    window = torch.cat([conv.transpose(1, 2).to(qkv.dtype), qkv], dim=1).float()  # [R, K-1+L, C]
    w = weight.to(qkv.dtype).float().T  # [K, C]
    total = torch.zeros_like(window[:, :qkv.shape[1]])
    for j in range(w.shape[0]):
        total += window[:, j:j + qkv.shape[1]] * w[j]  # [R, L, C]
    rounded = total.bfloat16().double()
    step = bf16_ulp(rounded)
    silus = torch.stack([torch.nn.functional.silu(rounded + d * step) for d in (-1, 0, 1)])
    lo, hi = silus.min(0).values, silus.max(0).values
    got = mixed.double()
    assert ((got >= lo - bf16_ulp(lo)) & (got <= hi + bf16_ulp(hi))).all()


def torch_ops(qkv, conv, weight, a, b, A_log, dt_bias):
    """What the decode layer's torch path computes (`_convolve`, `gates`, the state copy) -> (mixed, g, beta, the new
    state)."""
    window = torch.cat([conv.transpose(1, 2).to(qkv.dtype), qkv], dim=1)
    mixed = causal_conv1d_window(window, weight)
    g, beta = gates(SimpleNamespace(A_log=A_log, dt_bias=dt_bias), a, b)
    return mixed, g, beta, conv.clone().copy_(window[:, 1:].transpose(1, 2))


def random_inputs(R, C, K, Hv, dtype, state_dtype, seed):
    """Activations in `dtype`, the state and conv weight in `state_dtype` (values bf16 holds, as a state written from
    bf16 windows and a weight upcast from a bf16 checkpoint are), A_log and dt_bias fp32 as HF keeps them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(R, 1, C, generator=gen).to(dtype)
    conv = torch.randn(R, C, K - 1, generator=gen).bfloat16().to(state_dtype)
    weight = (torch.randn(C, K, generator=gen) / K ** 0.5).bfloat16().to(state_dtype)
    a, b = (3 * torch.randn(R, 1, Hv, generator=gen)).to(dtype), (2 * torch.randn(R, 1, Hv, generator=gen)).to(dtype)
    A_log, dt_bias = torch.rand(Hv, generator=gen) * 3 - 1, torch.randn(Hv, generator=gen)
    return qkv, conv, weight, a, b, A_log, dt_bias


def assert_like_torch(args) -> None:
    """The kernel on `args` against `torch_ops`: outputs within the dtype's rounding, the state updated in place to
    the torch ops' state exactly."""
    qkv, conv, weight, a, b, A_log, dt_bias = args
    before = conv.clone()
    want_mixed, want_g, want_beta, want_conv = torch_ops(*args)
    assert conv_step.usable(*args)
    ptr = conv.data_ptr()
    mixed, g, beta = conv_step.conv_gates_step(*args)
    assert (mixed.shape, mixed.dtype, g.dtype, beta.dtype) == (qkv.shape, qkv.dtype, torch.float32, b.dtype)
    assert g.shape == beta.shape == a.shape
    assert conv.data_ptr() == ptr
    torch.testing.assert_close(conv, want_conv, atol=0, rtol=0)
    if qkv.dtype == torch.float32:
        torch.testing.assert_close(mixed, want_mixed, **TOL[torch.float32])
    else:
        assert_silu_of_the_rounded_conv(mixed, qkv, before, weight)
        assert_silu_of_the_rounded_conv(want_mixed, qkv, before, weight)  # the band holds torch's own too
    torch.testing.assert_close(g, want_g, rtol=1e-5, atol=1e-6)  # fp32 from any inputs
    torch.testing.assert_close(beta.float(), want_beta.float(), **TOL[b.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R, C, K, Hv", [(1, 96, 4, 2), (5, 200, 2, 3), (3, 1100, 4, 7), (2, 64, 4, 32)])
def test_the_kernel_equals_the_torch_ops(interpreter, dtype, R, C, K, Hv):
    """C = 1100: three channel blocks, the last one partial; K = 2: a state of one input."""
    args = random_inputs(R, C, K, Hv, dtype, dtype, seed=R * C + K)
    state = args[1].clone()
    assert_like_torch(args)
    assert not torch.equal(args[1], state)  # the state did move


@pytest.mark.parametrize("dtype, state_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_a_state_in_another_dtype_than_the_input(interpreter, dtype, state_dtype):
    """HF keeps the state in the conv weight's dtype: the window is the state cast to the input's dtype, the new
    state that window cast back. An fp32 input entering a bf16 state is rounded (toward zero here: one bf16 ulp)."""
    args = random_inputs(4, 160, 4, 4, dtype, state_dtype, seed=7)
    conv = args[1]
    before, old = conv.clone(), conv[..., 1:].clone()
    want_mixed, _, _, want_conv = torch_ops(*args)
    mixed, _, _ = conv_step.conv_gates_step(*args)
    assert conv.dtype == state_dtype and mixed.dtype == dtype
    assert torch.equal(conv[..., :-1], old)  # the kept inputs moved down a slot, bit for bit
    torch.testing.assert_close(conv[..., -1].float(), want_conv[..., -1].float(), rtol=2 ** -7, atol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(mixed, want_mixed, **TOL[dtype])
    else:
        assert_silu_of_the_rounded_conv(mixed, args[0], before, args[2])


def test_softplus_around_its_threshold_and_in_its_tails(interpreter):
    """a + dt_bias from -100 (softplus ~ exp, below fp32's 1 + x resolution) through 20 (torch's threshold: above it
    softplus is its input) to 100 (where exp overflows)."""
    pre = torch.tensor([-100.0, -30.0, -17.0, -5.0, -0.5, 0.0, 0.5, 5.0, 19.9, 20.0, 20.001, 20.5, 100.0])
    Hv = pre.numel()
    qkv, conv, weight, a, b, A_log, dt_bias = random_inputs(2, 32, 4, Hv, torch.float32, torch.float32, seed=3)
    a = (pre - dt_bias).expand(2, 1, Hv).contiguous()
    want_g = torch_ops(qkv, conv.clone(), weight, a, b, A_log, dt_bias)[1]
    _, g, _ = conv_step.conv_gates_step(qkv, conv, weight, a, b, A_log, dt_bias)
    torch.testing.assert_close(g, want_g, rtol=1e-6, atol=0)
    assert (g < 0).all() and torch.isfinite(g).all()


def test_strided_views_are_read_and_the_state_view_written_in_place(interpreter):
    """qkv a slice of a wider projection, a and b interleaved in one tensor, the state every other row of a larger
    buffer: the kernel reads qkv and the state through their strides (a and b made unit-stride first) and writes the
    state into its own view only."""
    R, C, K, Hv = 3, 80, 4, 4
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(R, 1, C + 16, generator=gen)
    ab = 2 * torch.randn(R, 1, Hv, 2, generator=gen)
    buffer = torch.randn(2 * R, C, K - 1, generator=gen)
    qkv, b, a, conv = wide[..., 8:8 + C], ab[..., 0], ab[..., 1], buffer[::2]
    weight = torch.randn(C, 1, K, generator=gen).squeeze(1)
    A_log, dt_bias = torch.rand(Hv, generator=gen), torch.randn(Hv, generator=gen)
    others = buffer[1::2].clone()
    assert_like_torch((qkv, conv, weight, a, b, A_log, dt_bias))
    assert torch.equal(buffer[1::2], others)


def test_usable_within_its_bounds_only(interpreter, monkeypatch):
    from trainer import triton_device

    args = random_inputs(2, 64, 4, 4, torch.bfloat16, torch.bfloat16, seed=0)
    qkv, conv, weight, a, b, A_log, dt_bias = args
    assert conv_step.usable(*args)
    assert not conv_step.usable(torch.cat([qkv, qkv], 1), *args[1:])  # two tokens a row: the block path's
    assert not conv_step.usable(qkv, conv[:, :, :0], weight[:, :1], *args[3:])  # K = 1: no state
    assert not conv_step.usable(qkv, conv, weight[:, :3], *args[3:])  # weight and state disagree on K
    assert not conv_step.usable(*args[:3], a[:, :, :3], *args[4:])  # a and b of other head counts
    assert not conv_step.usable(qkv, conv.double(), *args[2:])
    with pytest.raises(ValueError, match="conv_gates_step: qkv"):
        conv_step.conv_gates_step(qkv, conv, weight[:, :3], *args[3:])
    monkeypatch.setattr(triton_device, "CPU_UNDER_INTERPRETER", False)
    assert not conv_step.usable(*args)  # CPU outside the kernel tests: the torch ops


def step_rows(layer, h, rows):
    """The layer called as the stack calls it for a compacted step of cache rows `rows`."""
    return layer(h, SimpleNamespace(linear=LinearCall(STEP, torch.tensor(False), None, None, rows)))


@pytest.mark.parametrize("joined", [False, True], ids=["own-projections", "joined-projections"])
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_layers_steps_with_the_kernel_equal_its_torch_steps(interpreter, monkeypatch, family, joined):
    """Prefill, steps of every row, then a compacted step of rows 2 and 0 (`_on_rows`: the kernel shifts the gathered
    state, written back to those rows only); the fused recurrent step and the torch one both. Joined: the kernel's
    layer takes its input projections as the batch generator's one GEMM (decode/fused.py), so qkv, a and b reach
    the kernel as column slices of one output."""
    from trainer.decode.fused import Joined, joined as join
    from trainer.model.linear_attention import input_projections

    calls = []
    kernel_step = conv_step.conv_gates_step
    monkeypatch.setattr(conv_step, "conv_gates_step", lambda *args: calls.append(1) or kernel_step(*args))
    inner = hf_layer(family)
    gen = torch.Generator().manual_seed(2)
    x, sub = torch.randn(ROWS, 12, DIM, generator=gen), torch.randn(2, 2, DIM, generator=gen)
    rows = torch.tensor([2, 0])
    for fused in (True, False):
        mine, plain = (GatedDeltaNetDecode(inner, ROWS, block=4, fused=fused, conv_kernel=k) for k in (True, False))
        assert mine.conv_kernel and not plain.conv_kernel
        if joined:
            mine.joined = join(input_projections(inner))
            assert isinstance(mine.joined, Joined)
        conv = mine.conv
        with torch.no_grad():
            outs = [(layer.prefill(x[:, :8]), [layer.step(x[:, t:t + 1]) for t in range(8, 12)],
                     [step_rows(layer, sub[:, t:t + 1], rows) for t in range(2)]) for layer in (mine, plain)]
        assert mine.conv is conv
        (pre_k, steps_k, sub_k), (pre_p, steps_p, sub_p) = outs
        # the prefill's convolution through conv_prefill.py's kernel (an fp32 ulp of the sum's order, numpy's exp);
        # joined: the joined GEMM's columns within an fp32 ulp of their own GEMMs' (test_fused.py)
        torch.testing.assert_close(pre_k, pre_p, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat(steps_k, 1), torch.cat(steps_p, 1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat(sub_k, 1), torch.cat(sub_p, 1), atol=1e-5, rtol=1e-5)
        if joined:  # the joined GEMM's columns need not be its parts' bits on CPU
            torch.testing.assert_close(mine.conv, plain.conv, atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(mine.conv, plain.conv)  # fp32: the shift is a copy
        torch.testing.assert_close(mine.state, plain.state, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 * (4 + 2)


def test_a_bf16_layers_steps_with_the_kernel_stay_within_bf16_of_its_torch_steps(interpreter):
    import copy

    inner = copy.deepcopy(hf_layer("qwen3_5")).to(torch.bfloat16)
    x = torch.randn(ROWS, 10, DIM, generator=torch.Generator().manual_seed(4)).bfloat16()
    mine, plain = (GatedDeltaNetDecode(inner, ROWS, block=4, conv_kernel=k) for k in (True, False))
    with torch.no_grad():
        outs = [torch.cat([layer.prefill(x[:, :6])] + [layer.step(x[:, t:t + 1]) for t in range(6, 10)], 1)
                for layer in (mine, plain)]
    assert mine.conv.dtype == torch.bfloat16
    err, scale = (outs[0].float() - outs[1].float()).abs().max().item(), outs[1].float().abs().max().item()
    assert err <= 3e-2 * scale, (err, scale)
    assert not torch.equal(mine.conv, torch.zeros_like(mine.conv))


def test_the_switch_picks_the_kernel_and_without_triton_the_torch_ops_run(kernels_off):
    inner = hf_layer("qwen3_next")
    assert GatedDeltaNetDecode(inner, ROWS, block=4).conv_kernel  # on by default
    kernels_off(["conv"])
    assert not GatedDeltaNetDecode(inner, ROWS, block=4).conv_kernel
    # CPU outside the kernel tests (no interpreter fixture): asked for, the kernel is not usable, the torch ops run
    mine, plain = (GatedDeltaNetDecode(inner, ROWS, block=4, conv_kernel=k) for k in (True, False))
    x = torch.randn(ROWS, 4, DIM, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = ([layer.step(x[:, t:t + 1]) for t in range(4)] for layer in (mine, plain))
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and torch.equal(mine.conv, plain.conv)


COMPILE_FOR_H200 = r'''
import json
from tests.trainer.cubin import sm90
from trainer.decode import conv_step

fn = conv_step._kernel()
out = {}
for act, state in (("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32")):
    sig = {"qkv_ptr": "*" + act, "conv_ptr": "*" + state, "w_ptr": "*" + state, "a_ptr": "*" + act,
           "b_ptr": "*" + act, "alog_ptr": "*fp32", "dtb_ptr": "*fp32", "mixed_ptr": "*" + act, "g_ptr": "*fp32",
           "beta_ptr": "*" + act, **{n: "i32" for n in "C HV sq_r sc_r sc_c sc_k sw_c sw_k sa_r sb_r".split()}}
    consts = {"TAPS": 4, "KEPT": 4, "BLOCK": conv_step.BLOCK_C, "BLOCK_H": 32, "THRESHOLD": 20.0, "LIBDEVICE": True}
    compiled = sm90(fn, sig, consts, num_warps=4)
    ptx = compiled.asm["ptx"]
    out[act + "/" + state] = {"stages": sorted(compiled.asm), "barrier": "bar.sync" in ptx,
                              "ieee_division": "div.rn.f32" in ptx}
print("COMPILED " + json.dumps(out))
'''


def test_the_kernel_compiles_for_the_h200(tmp_path):
    """What only the compiler checks, at qwen3.5-35b-a3b's shape (K = 4, Hv = 32), for bf16, fp32 and a bf16 input
    over an fp32 state: down to an sm_90 cubin, with the barrier between the state's reads and writes and IEEE
    divisions (Triton's `/` would be an approximate one)."""
    from tests.trainer.cubin import compile_for_h200

    compiled = compile_for_h200(COMPILE_FOR_H200, tmp_path)
    assert set(compiled) == {"bf16/bf16", "fp32/fp32", "bf16/fp32"}
    assert all("cubin" in c["stages"] and c["barrier"] and c["ieee_division"] for c in compiled.values())
