"""A hybrid target's Gated DeltaNet prefill convolution as one Triton kernel: the causal depthwise convolution of a
prompt chunk continuing each row's conv state, and its SiLU. The decode layer's prefill (`layers/linear.py`) runs it
unless switched off (the kernel "conv", `switches.py`); `state_after` is the conv state a prefill leaves, either way
(and a verify's commit of its accepted prefix).

Why: the torch form concatenates the state and the chunk ([R, K-1+L, C]), runs a depthwise conv1d on its transpose
(a layout cuDNN copies first), SiLU, and hands back a transposed result that the heads' reshape copies again: at
qwen3.5-35b-a3b's prefill (64 rows of 256 tokens, C = 8192 channels, 30 such layers) some 40 ms of a 0.41 s prefill
on the H200, for what is one read of the chunk and one write. Here: one launch a layer, the output [R, L, C]
contiguous (q, k and v are views of it).

What it computes, per row r, token t < L and channel c (what `model/linear_attention.causal_conv1d_window` gives over
the window cat(state, qkv)):
    mixed[r, t, c] = silu(sum_j weight[c, j] x window[r, t + j, c]),  window[r, i] = state[r, :, i] for i < K-1,
                     qkv[r, i - (K-1)] after (the state cast to the activation dtype, as the window casts it)
Grid: (rows, token blocks of BLOCK_T, channel blocks of BLOCK_C); each program reads its tile's K shifted views
(the overlap from L1/L2) and writes its tile. The state is only read: `state_after` gives the new one.

Rounding: `conv_step.py`'s (the same sum of K fp32 products in tap order, rounded to the activation dtype, SiLU as
x / (1 + exp(-x)) in fp32 with CUDA's expf and an IEEE division, rounded), and where bits may differ from torch's
conv1d for the same reason: its sum order, which survives the rounding at a rounding boundary and where the taps
cancel (an fp32 ulp of the partial sums is then many ulps of the small result); in fp32 torch may take cuDNN's TF32
path. Under Triton's interpreter (the CPU tests) fp32 -> bf16 casts round toward zero.

Runs on CUDA, and on CPU under Triton's interpreter (the tests); not under torch.compile (`usable`).
Shape legend: R rows, L tokens, C conv channels, K conv taps.
"""
from __future__ import annotations

import torch

from trainer.triton_device import interpreting, runs_on, triton_kernels

# Not tuned on the GPU: a 4 K-element tile a program (32,768 programs at the prefill above); K shifted reads a tile.
BLOCK_T = 16
BLOCK_C = 256
MAX_TAPS = 8  # the taps are unrolled
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton_kernels
def _kernel(triton, tl):
    """The jitted kernel, or None where Triton is not installed."""
    from triton.language.extra import libdevice

    @triton.jit
    def conv_silu_prefill(qkv_ptr, conv_ptr, w_ptr, out_ptr, L, C, sq_r, sq_t, sc_r, sc_c, sc_k, sw_c, sw_k,
                          TAPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                          LIBDEVICE: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        rows = t < L
        chans = c < C
        dt = qkv_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for j in tl.static_range(TAPS):
            p = t + (j - (TAPS - 1))  # the chunk token tap j reads; below 0 a state slot (p + K - 1)
            x = tl.load(qkv_ptr + r * sq_r + p[:, None] * sq_t + c[None, :],
                        mask=((p >= 0) & rows)[:, None] & chans[None, :], other=0.0)
            if j < TAPS - 1:  # only the first K-1 taps reach back into the state
                held = ((p < 0) & rows)[:, None] & chans[None, :]
                s = tl.load(conv_ptr + r * sc_r + c[None, :] * sc_c + (p + (TAPS - 1))[:, None] * sc_k,
                            mask=held, other=0.0).to(dt)
                x = tl.where(held, s, x)
            w = tl.load(w_ptr + c * sw_c + j * sw_k, mask=chans, other=0.0).to(dt)
            acc += w.to(tl.float32)[None, :] * x.to(tl.float32)
        conv = acc.to(dt).to(tl.float32)
        if LIBDEVICE:
            e = libdevice.exp(-conv)
        else:
            e = tl.exp(-conv)
        out = tl.math.div_rn(conv, 1.0 + e).to(dt)
        tl.store(out_ptr + r * L * C + t[:, None] * C + c[None, :], out, mask=rows[:, None] & chans[None, :])

    return conv_silu_prefill


def _fits(qkv: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor) -> bool:
    if qkv.dim() != 3 or conv.dim() != 3 or weight.dim() != 2:
        return False
    R, L, C = qkv.shape
    K = conv.shape[2] + 1
    return (L >= 1 and conv.shape[:2] == (R, C) and 2 <= K <= MAX_TAPS and tuple(weight.shape) == (C, K)
            and all(t.dtype in FLOATS and t.device == qkv.device for t in (qkv, conv, weight)))


def usable(qkv: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel can run on these arguments (those of `conv_silu`) here: CUDA, or CPU under the interpreter (the
    tests); not under torch.compile; 2 <= K <= MAX_TAPS, fp32 / bf16 / fp16 tensors on one device."""
    return (not torch.compiler.is_compiling() and _fits(qkv, conv, weight) and runs_on(qkv.device)
            and _kernel() is not None)


def conv_silu(qkv: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """qkv [R, L, C] (a prompt chunk after the projections; any row and token strides), conv [R, C, K-1] (each row's
    state: its last K-1 inputs, read, not changed), weight [C, K] (the conv1d weight squeezed) -> the causal conv +
    SiLU [R, L, C] in qkv's dtype, contiguous (rounding: the module docstring). One launch; call where `usable`
    holds."""
    if not _fits(qkv, conv, weight):
        raise ValueError(f"conv_silu: qkv [R, L, C], conv [R, C, K-1], weight [C, K], got qkv {tuple(qkv.shape)}, "
                         f"conv {tuple(conv.shape)}, weight {tuple(weight.shape)}")
    R, L, C = qkv.shape
    out = torch.empty(R, L, C, dtype=qkv.dtype, device=qkv.device)
    if R == 0:
        return out
    if qkv.stride(2) != 1:
        qkv = qkv.contiguous()
    grid = (R, -(-L // BLOCK_T), -(-C // BLOCK_C))
    _kernel()[grid](qkv, conv, weight, out, L, C, qkv.stride(0), qkv.stride(1), *conv.stride(), *weight.stride(),
                    TAPS=conv.shape[2] + 1, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, LIBDEVICE=not interpreting(),
                    num_warps=4)
    return out


def state_after(conv: torch.Tensor, qkv: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The conv state after row r took the first valid[r] tokens of qkv [R, L, C] from state conv [R, C, K-1]: the
    last K-1 inputs of cat(state, qkv[:valid]) -> [R, C, K-1] in qkv's dtype (valid [R] long, 0..L, on the device;
    no host sync). A new tensor: the caller copies it into the state after the convolution has read the old one."""
    kept = conv.shape[2]
    at = valid.view(-1, 1) + torch.arange(kept, device=valid.device)  # [R, K-1]: positions in cat(state, qkv)
    held = conv.gather(2, at.clamp(max=kept - 1)[:, None, :].expand(-1, conv.shape[1], -1)).to(qkv.dtype)
    taken = qkv.gather(1, (at - kept).clamp(min=0)[..., None].expand(-1, -1, qkv.shape[2])).transpose(1, 2)
    return torch.where((at < kept)[:, None, :], held, taken)
