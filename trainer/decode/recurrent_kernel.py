"""The hybrids' one-token Gated DeltaNet decode step as one Triton kernel that updates each row's recurrent state in
place, in the static buffer the decode layer (layers/linear.py) owns.

Why our own: the torch rule (`model/linear_attention.gated_delta_step`) passes the whole fp32 state [R, Hv, dk, dv]
about fourteen times a step in eager torch (the decay, the products materialized before S^T k and S^T q, the rank-one
update, the copy back into the buffer); one kernel reads it once and writes it once. fla's
`fused_recurrent_gated_delta_rule` (fla-core 0.6.0) computes the same step but always returns its final state in a
tensor it allocates (`initial_state` is only read), so the buffer would still take a copy; its lower-level kernel is
not a public API.

One program per (row, value head, BV columns of dv): the state tile [dk, BV] in fp32, with the key head's q and k
(each key head serves Hv // Hk consecutive value heads, as `_heads_first` repeats them) L2-normalized in fp32 (HF's
`use_qk_l2norm_in_kernel=True`) and q scaled by dk ** -0.5 (fla's and HF's default scale):
    S *= exp(g);  delta = beta (v - S^T k);  S += k delta^T;  out = S^T q
Each program reads and writes only its own tile, so the update in place is race-free. No host sync: captured in the
step's graph. Runs on CUDA, and on CPU under Triton's interpreter (the tests). Wrapped as a custom op that mutates
`state`, so torch.compile (the engine's compile="all") leaves the kernel opaque.
Shape legend: R rows, Hk / Hv key / value heads, dk / dv head dims.
"""
from __future__ import annotations

import torch

from trainer.triton_device import triton_kernels

# dv columns a program and its warps (both read at each launch): a [128, 64] fp32 tile is 32 KB, 2 programs per
# (row, head) at dv = 128. The fastest of `python -m bench.linear_step --shape qwen3.5-35b-a3b --rows 64 --tiles
# "32,4;16,4;64,4;32,2;32,8;64,8;16,2;128,8"` on the H200 (docs/benchmarks.md).
BLOCK_V = 64
WARPS = 4


@triton_kernels
def _kernel(triton, tl):
    """The jitted kernel, or None where Triton is not installed."""
    @triton.jit
    def gated_delta_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, scale, sq_r, sq_h, sk_r, sk_h, sv_r,
                         sv_h, sg_r, sb_r, so_r, so_h, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr,
                         DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1)
        cols = tl.program_id(2) * BV + tl.arange(0, BV)
        kk = tl.arange(0, BK)
        in_k, in_v = kk < DK, cols < DV
        hk = hv // GROUP
        q = tl.load(q_ptr + r * sq_r + hk * sq_h + kk, mask=in_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + r * sk_r + hk * sk_h + kk, mask=in_k, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + r * sv_r + hv * sv_h + cols, mask=in_v, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + r * sg_r + hv).to(tl.float32)
        beta = tl.load(beta_ptr + r * sb_r + hv).to(tl.float32)
        at = s_ptr + (r * HV + hv) * DK * DV + kk[:, None] * DV + cols[None, :]
        inside = in_k[:, None] & in_v[None, :]
        s = tl.load(at, mask=inside, other=0.0) * tl.exp(g)  # [BK, BV] fp32
        delta = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * delta[None, :]
        out = tl.sum(s * q[:, None], axis=0)
        tl.store(at, s, mask=inside)
        tl.store(o_ptr + r * so_r + hv * so_h + cols, out.to(o_ptr.dtype.element_ty), mask=in_v)

    return gated_delta_step


def usable_for(state: torch.Tensor) -> bool:
    """The kernel can run on `state`'s device here (CUDA, or CPU under the interpreter)."""
    from trainer.triton_device import runs_on

    return _kernel() is not None and runs_on(state.device)


def _rows_heads(x: torch.Tensor) -> torch.Tensor:
    """[R, 1, H, d] -> [R, H, d] with unit stride along d (a view where it already has one)."""
    x = x[:, 0]
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("dflash::gated_delta_step_", mutates_args=("state",))
def gated_delta_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor) -> torch.Tensor:
    """`gated_delta_step` with the new state written into `state` [R, Hv, dk, dv] (fp32, contiguous) in place:
    q, k [R, 1, Hk, dk]; v [R, 1, Hv, dv]; g (the log decay), beta [R, 1, Hv] -> out [R, 1, Hv, dv] in v's dtype."""
    R, _, Hk, dk = k.shape
    Hv, dv = v.shape[2], v.shape[3]
    if state.shape != (R, Hv, dk, dv) or state.dtype != torch.float32 or not state.is_contiguous() or Hv % Hk:
        raise ValueError(f"gated_delta_step_: a contiguous fp32 state [R, Hv, dk, dv] with Hv a multiple of Hk, got "
                         f"state {tuple(state.shape)} {state.dtype}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    q, k, v = (_rows_heads(x) for x in (q, k, v))
    g, beta = g[:, 0].contiguous(), beta[:, 0].contiguous()
    out = torch.empty(R, 1, Hv, dv, dtype=v.dtype, device=v.device)
    o = out[:, 0]
    bv = min(BLOCK_V, 1 << (dv - 1).bit_length())
    _kernel()[(R, Hv, -(-dv // bv))](q, k, v, g, beta, state, o, dk ** -0.5, q.stride(0), q.stride(1), k.stride(0),
                                     k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), o.stride(0),
                                     o.stride(1), HV=Hv, GROUP=Hv // Hk, DK=dk, DV=dv,
                                     BK=1 << (dk - 1).bit_length(), BV=bv, num_warps=WARPS)
    return out


@gated_delta_step_.register_fake
def _(q, k, v, g, beta, state):
    return torch.empty(v.shape, dtype=v.dtype, device=v.device)
