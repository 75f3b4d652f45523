"""The inputs of the refilling batch generator's one-token attention step as one Triton kernel: q and k through their
RMSNorms and RoPE, k and v written into their cache slots, for every row at its own position (or some of the
cache's rows: the generator's compacted steps, token i writing cache row rows[i]). A whole-prompt prefill runs it
too, its R' x L tokens as one-token rows, the turned k also out for its attention (`k_out`).

Why: in that step (layers/attention.py's per-row branch, `step_kernel.step_attention` reading the caches) the torch
form runs about twelve small launches a layer around attention: the q and k norms, RoPE's muls, `cat` and add for q
and for k, the transposes and the two `index_put_` writes (about 2.4 ms a token over qwen3-8b's 36 layers at 256 rows
on the H200), while the data they move is a few MB. Here one launch a layer does it all.

It computes the same bits as that torch form. One program serves one (row, head) over the H query heads, then the
Hkv key heads, then the Hkv value heads: the norm of a head is then a one-row program over Dh values with the warps of
kernels.py's norm kernel (`norm_warps`), its reduction shaped as there, so the fp32 mean of squares sums in the same
order. (A program per KV head with its G query heads as one [G, Dh] tile would sum in another layout.) Each
rounding of the torch form is an explicit cast: the norm as `kernels.rms_norm_rows` computes it (plain: cast to the
dtype, times the weight in the dtype; offset: (1 + w) in fp32, then cast), and RoPE as `drafter.apply_rope` does,
x * cos rounded, rotate_half(x) * sin rounded, their sum rounded (a product of two bf16 values is exact in fp32,
so one rounding of the fp32 product is torch's bf16 mul). rotate_half's partner of a dim is loaded a second time,
from its own address, and normed the same way. The GPU compiler would fuse x * cos + ... into one FMA (in bf16 it
drops the casts around the product and emits `fma.rn.bf16x2`: a fifth of the bf16 outputs differed on the H200),
which torch's separate mul and add do not: there the RoPE products are PTX `mul.rn.f32`, which is never fused.
Partial rotary (the hybrids' gated layers: RoPE on the first `rot` dims) passes the other dims through normed.
The bits are checked on the H200 against the torch form (tests/trainer/decode/test_step_inputs_gpu.py).

Runs on CUDA, and on CPU under Triton's interpreter (the tests; it rounds fp32 -> bf16 toward zero, so bf16 there
agrees within an ulp or two). No host sync: captured in the step's graph.
Shape legend: R rows, H / Hkv query / KV heads, Dh head dim, S cache slots.
"""
from __future__ import annotations

import torch

from trainer.decode.kernels import RowInvariantRMSNorm, norm_warps
from trainer.triton_device import triton_kernels


@triton_kernels
def _kernel(triton, tl):
    """The jitted kernel, or None where Triton is not installed."""
    @triton.jit
    def step_inputs(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, rows_ptr, qo_ptr, kc_ptr, vc_ptr,
                    ko_ptr, n_cols, q_eps, k_eps, sq_r, sq_h, sk_r, sk_h, sv_r, sv_h, scos_r, ssin_r, sp_r, sc_r, sc_h,
                    sc_s, H: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr,
                    NORM: tl.constexpr, OFFSET: tl.constexpr, ASM_MUL: tl.constexpr, K_OUT: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cr = tl.load(rows_ptr + r).to(tl.int64)  # the cache row token r writes
        j = tl.program_id(1)
        cols = tl.arange(0, HEAD_DIM)
        inside = cols < n_cols
        p = tl.load(pos_ptr + r * sp_r)
        dt = qo_ptr.dtype.element_ty
        if j < H + HKV:
            if j < H:
                src = q_ptr + r * sq_r + j * sq_h
                w_ptr = qw_ptr
                eps = q_eps
                dst = qo_ptr + (r * H + j) * HEAD_DIM
            else:
                src = k_ptr + r * sk_r + (j - H) * sk_h
                w_ptr = kw_ptr
                eps = k_eps
                dst = kc_ptr + cr * sc_r + (j - H) * sc_h + p * sc_s
            # as kernels.rms_norm_rows loads, reduces and rounds a row
            x = tl.load(src + cols, mask=inside, other=0.0).to(tl.float32)
            turned = cols < ROT
            first = cols < ROT // 2
            partner = tl.where(first, cols + ROT // 2, cols - ROT // 2)
            xp = tl.load(src + partner, mask=turned, other=0.0).to(tl.float32)
            if NORM:
                var = tl.sum(x * x, axis=0) / n_cols
                w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
                wp = tl.load(w_ptr + partner, mask=turned, other=0.0).to(tl.float32)
                inv = tl.rsqrt(var + eps)
                if OFFSET:
                    x = (x * inv * (1.0 + w)).to(dt).to(tl.float32)
                    xp = (xp * inv * (1.0 + wp)).to(dt).to(tl.float32)
                else:
                    x = (w * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
                    xp = (wp * (xp * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            # apply_rope: x * cos + cat([-x2, x1]) * sin, each product and the sum rounded to the dtype
            c = tl.load(cos_ptr + r * scos_r + cols, mask=turned, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + r * ssin_r + cols, mask=turned, other=0.0).to(tl.float32)
            turn = tl.where(first, -xp, xp)
            if ASM_MUL:  # on the GPU: products no FMA can absorb
                a = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [x, c], dtype=tl.float32,
                                              is_pure=True, pack=1)
                b = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [turn, s], dtype=tl.float32,
                                              is_pure=True, pack=1)
            else:
                a = x * c
                b = turn * s
            a, b = a.to(dt).to(tl.float32), b.to(dt).to(tl.float32)
            y = tl.where(turned, a + b, x)
            tl.store(dst + cols, y.to(dt), mask=inside)
            if K_OUT:  # the turned k also as an output (a prefill's attention reads it, not the cache)
                if j >= H:
                    tl.store(ko_ptr + (r * HKV + j - H) * HEAD_DIM + cols, y.to(dt), mask=inside)
        else:
            h = j - H - HKV
            value = tl.load(v_ptr + r * sv_r + h * sv_h + cols, mask=inside, other=0.0)
            tl.store(vc_ptr + cr * sc_r + h * sc_h + p * sc_s + cols, value, mask=inside)

    return step_inputs


def norm_rule(q_norm, k_norm, x: torch.Tensor):
    """What the kernel computes for a layer's q/k norms on `x`: () for none (both None), (q weight, q eps, k weight,
    k eps, offset) for two row-invariant norms (kernels.RowInvariantRMSNorm) that run their kernel on x, else None:
    the kernel does not compute them (another norm callable, one norm alone, a weight in another dtype)."""
    if q_norm is None and k_norm is None:
        return ()
    norms = (q_norm, k_norm)
    if (not all(isinstance(n, RowInvariantRMSNorm) and n.uses_kernel(x) for n in norms)
            or q_norm.offset != k_norm.offset):
        return None
    return q_norm.weight, q_norm.eps, k_norm.weight, k_norm.eps, q_norm.offset


def fits(q: torch.Tensor, k_cache: torch.Tensor, cos: torch.Tensor, q_norm, k_norm) -> bool:
    """The kernel can compute this step's inputs: it runs here (CUDA or the interpreter, not under torch.compile,
    a power-of-two head dim: step_kernel.usable_for), one dtype for q, the cache and cos, a rotary span of an even
    number of dims within the head, q/k norms it computes (`norm_rule`). q [R, 1, H, Dh], k_cache [R, Hkv, S, Dh],
    cos [R, 1, 1, rot]."""
    from trainer.decode.step_kernel import usable_for

    Dh = q.shape[-1]
    rot = cos.shape[-1]
    return (usable_for(q, Dh, q.shape[2] // k_cache.shape[1]) and q.dtype == k_cache.dtype == cos.dtype
            and rot % 2 == 0 and 0 < rot <= Dh and cos.shape == (q.shape[0], 1, 1, rot) and norm_rule(q_norm, k_norm, q) is not None)


def step_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm, k_norm,
                rows: torch.Tensor | None = None, k_out: torch.Tensor | None = None) -> torch.Tensor:
    """q [R', H, Dh], k / v [R', Hkv, Dh] (the projections of one token a row; any strides, the head dims
    contiguous), k_cache / v_cache [R, Hkv, S, Dh], pos [R', 1] long (each token's position, < S), cos / sin
    [R', 1, 1, rot] (rot <= Dh: RoPE on the first rot dims), q_norm / k_norm: `norm_rule`'s (both None: no norms),
    rows [R'] long (token i is cache row rows[i]; default: every row in order, R' = R; tokens of one row write
    distinct slots) -> q normed and turned, [R', H, 1, Dh] (step_kernel.step_attention's q); k normed and turned,
    and v, written into the caches at slot pos[i] of row rows[i], every other slot untouched; the turned k also into
    k_out [R', Hkv, Dh] (contiguous) when given. Check `fits` first."""
    R, H, Dh = q.shape
    Hkv, rot = k.shape[1], cos.shape[-1]
    if rows is None:
        if k_cache.shape[0] < R:
            raise ValueError(f"step_inputs: {R} rows, a cache of {k_cache.shape[0]}")
        rows = torch.arange(R, device=q.device)
    if (k.shape != (R, Hkv, Dh) or v.shape != k.shape or rows.shape != (R,) or k_cache.shape[1] != Hkv
            or k_cache.shape[3] != Dh or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1
            or any(t.stride(-1) != 1 for t in (q, k, v, cos, sin)) or pos.shape != (R, 1) or sin.shape != cos.shape
            or (k_out is not None and (k_out.shape != k.shape or not k_out.is_contiguous()))):
        raise ValueError(f"step_inputs: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cache "
                         f"{tuple(k_cache.shape)}, pos {tuple(pos.shape)}, cos {tuple(cos.shape)} disagree")
    from trainer.triton_device import interpreting

    rule = norm_rule(q_norm, k_norm, q)
    if rule is None:
        raise ValueError("step_inputs computes no q/k norms but two row-invariant RMSNorms of q's dtype")
    qw, q_eps, kw, k_eps, offset = rule or (q, 0.0, q, 0.0, False)  # no norms: the weights are never read
    out = torch.empty(R, H, 1, Dh, dtype=q.dtype, device=q.device)
    if R == 0:
        return out
    _kernel()[(R, H + 2 * Hkv)](
        q, k, v, qw, kw, cos, sin, pos, rows.contiguous(), out, k_cache, v_cache, out if k_out is None else k_out, Dh,
        q_eps, k_eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        sin.stride(0), pos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), H=H, HKV=Hkv,
        HEAD_DIM=Dh, ROT=rot,
        NORM=bool(rule), OFFSET=offset, ASM_MUL=not interpreting(), K_OUT=k_out is not None,
        num_warps=norm_warps(Dh))
    return out
