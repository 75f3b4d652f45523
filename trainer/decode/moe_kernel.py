"""An MoE layer's experts at decode as Triton kernels: two GEMM kernels, one program per (expert, tile of output
columns), each reading its expert's weight tile once for all the copies routed to it, and one that combines.

Why: at decode a batch of 64 rows routes 512 copies to 256 experts, two a piece. The grouped GEMM
(`torch.nn.functional.grouped_mm`, `layers/moe.py`) tiles 128 copies per expert, so it streams the expert weights,
the step's bulk (qwen3.5-35b-a3b: ~56 GB a step), at ~2.9 TB/s on the H200. Here a program holds BLOCK_M = 16 copies
and streams one expert's weight rows through a pipelined loop over the input dimension; and the arithmetic around the
GEMMs runs in their epilogues:
    experts_up    the copies' token rows gathered by `order` (no copy of x), gate and up of the SiLU-GLU as two
                  accumulators, written as SiLU(gate) x up [S, I] in sorted order
    experts_down  act [S, I] times the down weights, times each copy's routing weight, written at the copy's own
                  index t x k + j (the scatter back to token order)
    combine       the k copies summed and the shared expert added, times its gate's sigmoid (`combine`); for a
                  prefill's grouped GEMMs, whose output is in expert order and unweighted, the same kernel first
                  reads each copy's row where the sort put it and multiplies its routing weight (`combine_sorted`)
Rounding as the grouped path's: each GEMM's fp32 sum rounded to the activation dtype, SiLU and the products on those
rounded values (fp32 math with CUDA's expf and IEEE divisions, rounded again as torch's ops round; the shared expert's
gate sigmoid is torch's own), so only the GEMMs' summation order differs.

Serves the SiLU-GLU experts (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral: `_apply_gate` transformers' default,
`act_fn` SiLU, no biases, weights [E, out, in]) in bf16 on CUDA, and on CPU under Triton's interpreter (the tests);
`layers/moe.py` picks them for a decode step's few copies an expert (`few_copies`) unless switched off (the kernel
"moe", `switches.py`); `python -m bench.moe_experts` times them against the grouped GEMM. No host sync: captured in
the graphs.
Shape legend: T tokens, k experts a token, S = T x k copies, E experts, D hidden, I expert intermediate.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from trainer.triton_device import triton_kernels



class Tiles(NamedTuple):
    """A kernel's launch shape: output columns a program, input columns a loop step, pipeline stages, warps."""

    n: int
    k: int
    stages: int
    warps: int


BLOCK_M = 16  # copies a block: tl.dot's smallest side
# Each kernel's tiles (bench.moe_experts --tiles times others): the up kernel streams 2 x n rows of D inputs a
# program, the down kernel n rows of only I inputs, so it takes wider programs for as long a stream
UP_TILES, DOWN_TILES = Tiles(64, 128, 4, 4), Tiles(128, 128, 4, 4)
# copies an expert, on average, up to which the kernels run: past it a GEMM tile of 128 copies (the grouped kernel)
# reuses each weight tile better than programs that loop over blocks of 16
MAX_COPIES_PER_EXPERT = 16


@triton_kernels
def _kernels(triton, tl):
    """The jitted kernels, or None where Triton is not installed."""
    from triton.language.extra import libdevice

    @triton.jit
    def up_kernel(x_ptr, w_ptr, order_ptr, ends_ptr, act_ptr, sx, swe, swn, sa, N_COPIES: tl.constexpr,
                  TOP_K: tl.constexpr, D: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, LOADED_BOUND: tl.constexpr,
                  STAGES: tl.constexpr, LIBDEVICE: tl.constexpr):
        e = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        kk = tl.arange(0, BK)
        end = tl.load(ends_ptr + e)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        gate_rows = w_ptr + e.to(tl.int64) * swe + n[:, None] * swn
        up_rows = gate_rows + I * swn
        # On the GPU the loop runs over the expert's own copies (a loaded bound); the interpreter cannot loop to
        # one, so there it walks every block of the N_COPIES copies and masks those outside [start, end) (`_copies`:
        # 0 on the GPU, which never reads it, so one compilation serves every count of copies).
        for m0 in tl.range(start if LOADED_BOUND else 0, end if LOADED_BOUND else N_COPIES, BM):
            i = m0 + tl.arange(0, BM)
            live = (i >= start) & (i < end)
            token = tl.load(order_ptr + i, mask=live, other=0) // TOP_K
            a_rows = x_ptr + token.to(tl.int64)[:, None] * sx
            gate = tl.zeros([BM, BN], tl.float32)
            up = tl.zeros([BM, BN], tl.float32)
            for k0 in tl.range(0, D, BK, num_stages=STAGES):
                a = tl.load(a_rows + (k0 + kk)[None, :], mask=live[:, None], other=0.0)
                wg = tl.load(gate_rows + (k0 + kk)[None, :])
                wu = tl.load(up_rows + (k0 + kk)[None, :])
                if UPCAST:
                    a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
                gate = tl.dot(a, tl.trans(wg), gate, input_precision=PRECISION)
                up = tl.dot(a, tl.trans(wu), up, input_precision=PRECISION)
            dtype = act_ptr.dtype.element_ty
            g = gate.to(dtype).to(tl.float32)
            # torch's SiLU: g / (1 + exp(-g)) with CUDA's expf and an IEEE division (the interpreter: numpy's exp)
            if LIBDEVICE:
                ex = libdevice.exp(-g)
            else:
                ex = tl.exp(-g)
            silu = tl.math.div_rn(g, 1.0 + ex).to(dtype).to(tl.float32)
            act = silu * up.to(dtype).to(tl.float32)
            tl.store(act_ptr + i.to(tl.int64)[:, None] * sa + n[None, :], act.to(dtype), mask=live[:, None])

    @triton.jit
    def down_kernel(act_ptr, w_ptr, order_ptr, ends_ptr, weight_ptr, out_ptr, sa, swe, swn, so,
                    N_COPIES: tl.constexpr, D: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, LOADED_BOUND: tl.constexpr,
                    STAGES: tl.constexpr):
        e = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        kk = tl.arange(0, BK)
        end = tl.load(ends_ptr + e)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        w_rows = w_ptr + e.to(tl.int64) * swe + n[:, None] * swn
        for m0 in tl.range(start if LOADED_BOUND else 0, end if LOADED_BOUND else N_COPIES, BM):
            i = m0 + tl.arange(0, BM)
            live = (i >= start) & (i < end)
            a_rows = act_ptr + i.to(tl.int64)[:, None] * sa
            acc = tl.zeros([BM, BN], tl.float32)
            for k0 in tl.range(0, I, BK, num_stages=STAGES):
                a = tl.load(a_rows + (k0 + kk)[None, :], mask=live[:, None], other=0.0)
                w = tl.load(w_rows + (k0 + kk)[None, :])
                if UPCAST:
                    a, w = a.to(tl.float32), w.to(tl.float32)
                acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
            copy = tl.load(order_ptr + i, mask=live, other=0).to(tl.int64)
            weight = tl.load(weight_ptr + copy, mask=live, other=0.0).to(tl.float32)
            y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
            tl.store(out_ptr + copy[:, None] * so + n[None, :], y.to(out_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def combine_kernel(out_ptr, pos_ptr, w_ptr, factor_ptr, shared_ptr, y_ptr, D: tl.constexpr, K: tl.constexpr,
                       BLOCK: tl.constexpr, SHARED: tl.constexpr, GATHERED: tl.constexpr, ROUND: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = d < D
        # torch's sum over k (Reduce.cuh, a reduction over an outer dimension): four fp32 accumulators, value j into
        # accumulator j % 4 in order, then ((a0 + a1) + a2) + a3
        a0 = tl.zeros([BLOCK], tl.float32)
        a1 = tl.zeros([BLOCK], tl.float32)
        a2 = tl.zeros([BLOCK], tl.float32)
        a3 = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(K):
            if GATHERED:  # copy (t, j)'s row in expert order, times its routing weight, rounded as torch's product
                row = tl.load(pos_ptr + t * K + j)
                v = tl.load(out_ptr + row * D + d, mask=inside, other=0.0).to(tl.float32)
                v = v * tl.load(w_ptr + t * K + j).to(tl.float32)
                if ROUND:
                    v = v.to(out_ptr.dtype.element_ty).to(tl.float32)
            else:
                v = tl.load(out_ptr + (t * K + j) * D + d, mask=inside, other=0.0).to(tl.float32)
            if j % 4 == 0:
                a0 += v
            elif j % 4 == 1:
                a1 += v
            elif j % 4 == 2:
                a2 += v
            else:
                a3 += v
        acc = ((a0 + a1) + a2) + a3
        if ROUND:  # the summed tensor's dtype is out's (else fp32: products of fp32 routing weights)
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        if SHARED:
            f = tl.load(factor_ptr + t).to(tl.float32)
            s = tl.load(shared_ptr + t * D + d, mask=inside, other=0.0).to(tl.float32)
            y = y + (f * s).to(shared_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + t * D + d, y.to(y_ptr.dtype.element_ty), mask=inside)

    return up_kernel, down_kernel, combine_kernel


def tile(width: int, block: int) -> int:
    """A tile side over `width` columns: `block`, or the width where it is narrower (a tiny test model's)."""
    return min(block, width)


def divides(out_width: int, in_width: int, tiles: Tiles) -> bool:
    """The kernel's tile sides over its output and input widths are powers of two >= 16 (tl.dot's and tl.arange's)
    that divide them."""
    sides = ((out_width, tile(out_width, tiles.n)), (in_width, tile(in_width, tiles.k)))
    return all(t >= 16 and t & (t - 1) == 0 and width % t == 0 for width, t in sides)


def shared_bytes(I: int, D: int, element_size: int) -> int:
    """Shared memory the larger of the two GEMM kernels asks for at these widths: its pipeline holds stages - 1
    buffers, each its weight tile (the up kernel's gate and up rows, 2 x BN, the down kernel's BN) and its copies' tile
    (BLOCK_M rows), BK wide. qwen3.5-35b-a3b's: 108 KB, within the H100/H200's 227 KB and the A100's 163 KB, not a
    99 KB SM (RTX 4090, RTX 5090, L40S), where Triton would refuse the launch."""
    up = (UP_TILES.stages - 1) * (2 * tile(I, UP_TILES.n) + BLOCK_M) * tile(D, UP_TILES.k)
    down = (DOWN_TILES.stages - 1) * (tile(D, DOWN_TILES.n) + BLOCK_M) * tile(I, DOWN_TILES.k)
    return max(up, down) * element_size


def serves(experts) -> bool:
    """The kernels compute this experts module here: SiLU-GLU experts as transformers' default gate computes them,
    no biases, weights [E, out, in] (bf16 on CUDA; any float on CPU under the interpreter), widths that the tiles
    divide, on a device the kernels run on whose shared memory holds their tiles (`shared_bytes`), not under
    torch.compile."""
    from trainer.triton_device import runs_on, shared_memory_limit
    up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and up.dim() == down.dim() == 3):
        return False
    if _kernels() is None or not runs_on(up.device) or torch.compiler.is_compiling() or not _silu_glu(experts):
        return False
    E, two_i, D = up.shape
    I = two_i // 2
    return (not getattr(experts, "is_transposed", False) and getattr(experts, "gate_up_proj_bias", None) is None
            and getattr(experts, "down_proj_bias", None) is None and down.shape == (E, D, I)
            and up.dtype == down.dtype and (up.dtype == torch.bfloat16 or up.device.type == "cpu")
            and up.stride(-1) == down.stride(-1) == 1 and divides(I, D, UP_TILES)
            and divides(D, I, DOWN_TILES) and shared_bytes(I, D, up.element_size()) <= shared_memory_limit(up.device))


def _silu_glu(experts) -> bool:
    """The experts' gate is transformers' default (SiLU of the first half times the second) with a SiLU act_fn."""
    try:
        from transformers.activations import SiLUActivation
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    return (getattr(type(experts), "_apply_gate", None) is _default_apply_gate
            and isinstance(getattr(experts, "act_fn", None), (SiLUActivation, torch.nn.SiLU)))


def few_copies(copies: int, num_experts: int) -> bool:
    """Few copies an expert (a decode step's, not a prefill's): where the kernels beat the grouped GEMM."""
    return copies <= MAX_COPIES_PER_EXPERT * num_experts


def _copies(S: int) -> int:
    """The kernels' N_COPIES: the count under the interpreter (its loop bound), 0 on the GPU (unread there: a
    compilation per count of copies would be a new compile at every new prefill shape)."""
    from trainer.triton_device import interpreting
    return S if interpreting() else 0


def _launch_options(x: torch.Tensor, tiles: Tiles) -> dict:
    from trainer.triton_device import interpreting
    return dict(UPCAST=interpreting(), PRECISION="ieee" if interpreting() or x.dtype == torch.float32 else "tf32",
                LOADED_BOUND=not interpreting(), STAGES=tiles.stages, BM=BLOCK_M, num_warps=tiles.warps)


def experts_up(experts, x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, top_k: int) -> torch.Tensor:
    """x [T, D] (the tokens, unsorted), order [S] long (copy indices t x k + j sorted by expert), offsets [E] int32
    (where each expert's copies end) -> act [S, I] in sorted order: SiLU(gate) x up of each copy's expert."""
    from trainer.triton_device import interpreting

    w = experts.gate_up_proj
    E, two_i, D = w.shape
    I, S = two_i // 2, order.shape[0]
    x, order, offsets = x.contiguous(), order.contiguous(), offsets.contiguous()
    act = torch.empty(S, I, dtype=x.dtype, device=x.device)
    bn = tile(I, UP_TILES.n)
    _kernels()[0][(E, I // bn)](x, w, order, offsets, act, x.stride(0), w.stride(0), w.stride(1), act.stride(0),
                                N_COPIES=_copies(S), TOP_K=top_k, D=D, I=I, BN=bn, BK=tile(D, UP_TILES.k),
                                LIBDEVICE=not interpreting(), **_launch_options(x, UP_TILES))
    return act


def experts_down(experts, act: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """act [S, I] in sorted order, weights [T, k] (routing weights) -> [T, k, D]: copy (t, j)'s down projection
    times its weight, in the dtype the grouped path's product has (act's, or fp32 for fp32 routing weights)."""
    w = experts.down_proj
    E, D, I = w.shape
    T, k = weights.shape
    S = order.shape[0]
    out = torch.empty(T, k, D, dtype=torch.promote_types(act.dtype, weights.dtype), device=act.device)
    flat = out.view(S, D)
    bn = tile(D, DOWN_TILES.n)
    _kernels()[1][(E, D // bn)](act, w, order.contiguous(), offsets.contiguous(), weights.contiguous(), flat,
                                act.stride(0), w.stride(0), w.stride(1), flat.stride(0), N_COPIES=_copies(S),
                                D=D, I=I, BN=bn, BK=tile(I, DOWN_TILES.k), **_launch_options(act, DOWN_TILES))
    return out


def experts_forward(experts, x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """x [T, D] (the tokens, unsorted), order [S] long (copy indices t x k + j sorted by expert), offsets [E] int32
    (where each expert's copies end), weights [T, k] (routing weights) -> [T, k, D]: copy (t, j)'s expert output
    times its weight, in the dtype the grouped path's product has (x's, or fp32 for fp32 routing weights)."""
    act = experts_up(experts, x, order, offsets, weights.shape[1])
    return experts_down(experts, act, order, offsets, weights)


COMBINE_BLOCK = 1024  # columns a program: the combine is elementwise over D, so any split gives the same bits
# no fused multiply-adds: an fp32 product (fp32 routing weights) is rounded before the sum adds it, as torch's
# `out * w` then `sum` round it (Triton would otherwise fuse the two into one FMA, one rounding)
COMBINE_OPTIONS = {"enable_fp_fusion": False}


def combine(out: torch.Tensor, dtype: torch.dtype, factor: torch.Tensor | None = None,
            shared: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, k, D] (`experts_forward`) -> y [T, D] in `dtype`: the k copies summed (in fp32 in torch's order,
    rounded to out's dtype, then to `dtype`), plus factor [T, 1] x shared [T, D] where the layer has a shared expert
    (factor: its gate's sigmoid, computed by torch beside the shared expert, so its bits are torch's), the product
    and the sum rounded as torch's `y + factor * shared` rounds them: one kernel for what were four."""
    T, k, D = out.shape
    return _combine(out.contiguous(), None, None, T, k, dtype, factor, shared)


def combine_sorted(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                   factor: torch.Tensor | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped GEMMs' output out [S, D] in expert order (order [S]: copy t x k + j of each row), weights [T, k]
    -> y [T, D] in `dtype`: `combine` of each copy's row times its routing weight, rounded as the grouped path's
    `out * weight`, the copies' scatter back to token order and `sum(dim=1)` round them (the product in out's dtype
    for weights of that dtype, else in fp32: bf16 or fp32 weights). A prefill's: one read of out for what were three
    passes over it."""
    T, k = weights.shape
    S, D = out.shape
    positions = torch.empty_like(order).index_copy_(0, order, torch.arange(S, device=order.device))
    return _combine(out.contiguous(), positions, weights.contiguous(), T, k, dtype, factor, shared)


def _combine(out: torch.Tensor, positions: torch.Tensor | None, weights: torch.Tensor | None, T: int, k: int,
             dtype: torch.dtype, factor: torch.Tensor | None, shared: torch.Tensor | None) -> torch.Tensor:
    D = out.shape[-1]
    y = torch.empty(T, D, dtype=dtype, device=out.device)
    if shared is not None:
        factor, shared = factor.reshape(T).contiguous(), shared.reshape(T, D).contiguous()
        if shared.dtype != dtype or factor.dtype != dtype:
            raise ValueError(f"combine: the shared expert's output and gate in {dtype}, got {shared.dtype} and "
                             f"{factor.dtype}")
    product = out.dtype if weights is None else torch.promote_types(out.dtype, weights.dtype)
    block = min(COMBINE_BLOCK, 1 << (D - 1).bit_length())
    _kernels()[2][(T, -(-D // block))](out, out if positions is None else positions,
                                       out if weights is None else weights, out if shared is None else factor,
                                       out if shared is None else shared, y, D=D, K=k, BLOCK=block,
                                       SHARED=shared is not None, GATHERED=positions is not None,
                                       ROUND=product == out.dtype, **COMBINE_OPTIONS)
    return y
