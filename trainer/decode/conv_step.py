"""A hybrid target's one-token Gated DeltaNet step before the recurrence, as one Triton kernel: the causal depthwise
convolution over the conv state and the new input, its SiLU, the conv state's shift, and the gates g and beta.
The decode layer (`layers/linear.py`) runs it unless switched off (the kernel "conv", `switches.py`).

Why: in torch the step's `cat` of the state and the input, the depthwise conv1d, SiLU, the transposes, the state
copy and the ~8 gate ops (`model/linear_attention.gates`) are about 13 small launches a layer; at qwen3.5-35b-a3b's
decode shape (30 such layers, 64 rows, C = 8192 channels, K = 4 taps, Hv = 32) about 1 ms of a 31 ms step on the
H200. Here one launch a layer.

What it computes, per row (the tensors `_convolve`, `gates` and the state copy give):
    window   the K-1 state inputs cast to the activation dtype (the state may be in another: HF keeps it in the conv
             weight's dtype), then the new input
    mixed    silu(sum_j weight[c, j] (cast to the activation dtype, as `causal_conv1d_window` casts it) x window[j])
    state    window[1:], cast back to the state's dtype, in place
    g        -exp(A_log) * softplus(a + dt_bias), fp32 (softplus as torch's: x above 20, else log1p(exp(x)))
    beta     sigmoid(b), in b's dtype
Grid: (rows, channel blocks of BLOCK_C). A program reads its channels' state and writes them back shifted; a barrier
between its reads and its writes keeps its warps from overwriting a slot another warp has yet to read (the loads and
the store have different layouts), and no two programs share a slot, so the update in place is race-free. The gates,
Hv values a row, are computed by the row's first channel-block program: a separate program would cost a launch slot
for less work than one channel block. No host sync: captured in the step's CUDA graph.

Rounding, as torch's: the K products in fp32 summed in fp32 in tap order (an FMA each on the GPU), rounded to the
activation dtype; SiLU in fp32 on that rounded value as x / (1 + exp(-x)) with CUDA's expf (libdevice) and an IEEE
division, rounded; softplus with libdevice's log1p and expf; sigmoid as 1 / (1 + exp(-b)) in fp32, rounded. Where bits
may differ from torch's ops: the conv's sum order (torch runs cuDNN or its own depthwise kernel depending on layout and
version; the latter sums taps in order with FMAs, as here): an fp32 ulp in the sum, which survives the rounding to
bf16 at a rounding boundary and where the taps cancel (many ulps of a small result then), and then moves SiLU's
output by about an ulp of its input's relative size (more than an output ulp far below 0, where SiLU is small).
In fp32 torch's convolution may take cuDNN's TF32 path (`torch.backends.cudnn.allow_tf32`, on by default), whose
products see 10-bit mantissas; the kernel's stay fp32. g and beta use torch's CUDA formulas and math library (expf,
log1pf), so they are expected equal.
Under Triton's interpreter (the CPU tests) exp and log are numpy's (log1p there in Kahan's form, log(u) x / (u - 1)
for u = 1 + x), within an fp32 ulp or two of torch's CPU ops, and fp32 -> bf16 casts round toward zero, so a bf16
output there is SiLU of the sum rounded to its bf16 value or a neighbour, within an ulp (the CPU tests' bound).

Runs on CUDA, and on CPU under Triton's interpreter (the tests); not under torch.compile (`usable`).
Shape legend: R rows, C conv channels, K conv taps, Hv value heads.
"""
from __future__ import annotations

import torch

from trainer.triton_device import interpreting, runs_on, triton_kernels

BLOCK_C = 512  # channels a program: 16 programs a row at C = 8192 (not measured: one choice, 1024 programs at R = 64)
MAX_TAPS = 8  # the taps are unrolled
MAX_HEADS = 1024  # the gates of a row are one [Hv] tile
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus default: above it softplus(x) = x


@triton_kernels
def _kernel(triton, tl):
    """The jitted kernel, or None where Triton is not installed."""
    from triton.language.extra import libdevice

    @triton.jit
    def conv_gates_step(qkv_ptr, conv_ptr, w_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, mixed_ptr, g_ptr, beta_ptr, C, HV,
                        sq_r, sc_r, sc_c, sc_k, sw_c, sw_k, sa_r, sb_r, TAPS: tl.constexpr, KEPT: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, THRESHOLD: tl.constexpr,
                        LIBDEVICE: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        c = blk * BLOCK + tl.arange(0, BLOCK)
        inside = c < C
        dt = qkv_ptr.dtype.element_ty
        state = conv_ptr + r * sc_r + c * sc_c  # [BLOCK]: each channel's tap 0
        new = tl.load(qkv_ptr + r * sq_r + c, mask=inside, other=0.0)
        # the window tap by tap, in the activation dtype; the products summed in fp32 in tap order
        acc = tl.zeros([BLOCK], tl.float32)
        for t in tl.static_range(TAPS):
            if t < TAPS - 1:
                x = tl.load(state + t * sc_k, mask=inside, other=0.0).to(dt)
            else:
                x = new
            w = tl.load(w_ptr + c * sw_c + t * sw_k, mask=inside, other=0.0).to(dt)
            acc += w.to(tl.float32) * x.to(tl.float32)
        # the shifted state: slot j takes window tap j + 1 (the last slot the new input)
        j = tl.arange(0, KEPT)
        slots = inside[:, None] & (j[None, :] < TAPS - 1)
        kept = tl.load(state[:, None] + (j[None, :] + 1) * sc_k, mask=inside[:, None] & (j[None, :] < TAPS - 2),
                       other=0.0).to(dt)
        shifted = tl.where(j[None, :] == TAPS - 2, new[:, None], kept)
        conv = acc.to(dt).to(tl.float32)
        if LIBDEVICE:
            e = libdevice.exp(-conv)
        else:
            e = tl.exp(-conv)
        tl.store(mixed_ptr + r * C + c, tl.math.div_rn(conv, 1.0 + e).to(dt), mask=inside)
        tl.debug_barrier()  # every read of the state above before any write below, across the program's warps
        tl.store(state[:, None] + j[None, :] * sc_k, shifted.to(conv_ptr.dtype.element_ty), mask=slots)
        if blk == 0:
            h = tl.arange(0, BLOCK_H)
            heads = h < HV
            pre = tl.load(a_ptr + r * sa_r + h, mask=heads, other=0.0).to(tl.float32)
            pre = pre + tl.load(dtb_ptr + h, mask=heads, other=0.0).to(tl.float32)
            capped = tl.where(pre > THRESHOLD, THRESHOLD, pre)  # past it softplus is pre: no exp to overflow
            a_log = tl.load(alog_ptr + h, mask=heads, other=0.0).to(tl.float32)
            bg = tl.load(b_ptr + r * sb_r + h, mask=heads, other=0.0).to(tl.float32)
            if LIBDEVICE:
                soft = libdevice.log1p(libdevice.exp(capped))
                decay = libdevice.exp(a_log)
                eb = libdevice.exp(-bg)
            else:
                ex = tl.exp(capped)
                u = 1.0 + ex
                soft = tl.where(u == 1.0, ex, tl.log(u) * tl.math.div_rn(ex, tl.where(u == 1.0, 1.0, u - 1.0)))
                decay = tl.exp(a_log)
                eb = tl.exp(-bg)
            soft = tl.where(pre > THRESHOLD, pre, soft)
            tl.store(g_ptr + r * HV + h, -decay * soft, mask=heads)
            tl.store(beta_ptr + r * HV + h, tl.math.div_rn(1.0, 1.0 + eb).to(beta_ptr.dtype.element_ty), mask=heads)

    return conv_gates_step


def _fits(qkv, conv, weight, a, b, A_log, dt_bias) -> bool:
    """The shapes and dtypes the kernel handles (see `conv_gates_step`)."""
    if qkv.dim() != 3 or qkv.shape[1] != 1 or conv.dim() != 3 or a.dim() != 3:
        return False
    R, _, C = qkv.shape
    K, Hv = conv.shape[2] + 1, a.shape[2]
    return (conv.shape[:2] == (R, C) and 2 <= K <= MAX_TAPS and tuple(weight.shape) == (C, K)
            and tuple(a.shape) == tuple(b.shape) == (R, 1, Hv) and 1 <= Hv <= MAX_HEADS
            and tuple(A_log.shape) == tuple(dt_bias.shape) == (Hv,)
            and all(t.dtype in FLOATS and t.device == qkv.device for t in (qkv, conv, weight, a, b, A_log, dt_bias)))


def usable(qkv: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           A_log: torch.Tensor, dt_bias: torch.Tensor) -> bool:
    """The kernel can run on these arguments (those of `conv_gates_step`) here: CUDA, or CPU under the interpreter
    (the tests); not under torch.compile (building the kernel is not traceable); one token a row, 2 <= K <= MAX_TAPS,
    Hv <= MAX_HEADS, fp32 / bf16 / fp16 tensors on one device."""
    return (not torch.compiler.is_compiling() and _fits(qkv, conv, weight, a, b, A_log, dt_bias)
            and runs_on(qkv.device) and _kernel() is not None)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """[R, 1, N] -> [R, N] with unit stride along N (a view where it already has one)."""
    x = x[:, 0]
    return x if x.stride(-1) == 1 else x.contiguous()


def conv_gates_step(qkv: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [R, 1, C] (one token a row, after the projections), conv [R, C, K-1] (the state: each row's last K-1
    inputs, updated in place to the window's last K-1), weight [C, K] (the conv1d weight squeezed), a / b [R, 1, Hv],
    A_log / dt_bias [Hv] -> (mixed [R, 1, C] in qkv's dtype: the causal conv + SiLU; g [R, 1, Hv] fp32; beta
    [R, 1, Hv] in b's dtype): what `layers/linear.py`'s `_convolve`, `gates` and the state copy give (rounding: the
    module docstring). One launch; call where `usable` holds."""
    if not _fits(qkv, conv, weight, a, b, A_log, dt_bias):
        raise ValueError(f"conv_gates_step: qkv [R, 1, C], conv [R, C, K-1], weight [C, K], a / b [R, 1, Hv], A_log / "
                         f"dt_bias [Hv], got qkv {tuple(qkv.shape)}, conv {tuple(conv.shape)}, weight "
                         f"{tuple(weight.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(A_log.shape)}")
    R, _, C = qkv.shape
    K, Hv = conv.shape[2] + 1, a.shape[2]
    mixed = torch.empty(R, 1, C, dtype=qkv.dtype, device=qkv.device)
    g = torch.empty(R, 1, Hv, dtype=torch.float32, device=qkv.device)
    beta = torch.empty(R, 1, Hv, dtype=b.dtype, device=qkv.device)
    if R == 0:
        return mixed, g, beta
    q2, a2, b2 = _unit_last(qkv), _unit_last(a), _unit_last(b)
    block = min(BLOCK_C, 1 << (C - 1).bit_length())
    _kernel()[(R, -(-C // block))](q2, conv, weight, a2, b2, A_log.contiguous(), dt_bias.contiguous(), mixed, g, beta,
                                   C, Hv, q2.stride(0), *conv.stride(), *weight.stride(), a2.stride(0), b2.stride(0),
                                   TAPS=K, KEPT=max(2, 1 << (K - 2).bit_length()), BLOCK=block,
                                   BLOCK_H=max(2, 1 << (Hv - 1).bit_length()), THRESHOLD=SOFTPLUS_THRESHOLD,
                                   LIBDEVICE=not interpreting(), num_warps=4)
    return mixed, g, beta
