"""Per-row e4m3 quantization of activations (`quantize_rows`): the torch form, and one Triton kernel that gives the
same bits on CUDA outside torch.compile.

Why: the static decode engine runs the FP8 target's modules eagerly inside its CUDA graphs, where the torch form is
nine kernels a bf16 input (abs, amax, float, clamp_min, scale, float, divide, clamp, cast; seven for fp32): at
qwen3-8b, five quantized inputs a layer (q, k, v, o, gate|up; down's comes from the SwiGLU kernel), 1,620 small
launches a step. The kernel is one launch: one program per row, the row read once when it fits one block
(ROW_BLOCK_MAX values), else twice (the max, then the quantization); with q, k and v sharing one quantization
(trainer/model/fp8.py `project_shared`), 3 launches a layer. Under torch.compile the torch form stays, so that
Inductor fuses it as it always has.

Bit for bit the torch form on CUDA: the absolute max (order-free), the floor 1e-12, the scale as torch's CUDA division
by a Python scalar computes it (times the fp32 reciprocal of 448: `div_true_kernel_cuda`; Inductor does the same on
CUDA), the values divided with IEEE rounding (`div_rn`: Triton's `/` on fp32 is an approximate division), clamped to
+-448 and cast with round-to-nearest-even. A NaN spreads as in torch: the row's max is NaN, so its scale and every
value are. On CPU (the tests) torch divides by 448 exactly instead, which can differ in the scale's last bit.
"""
from __future__ import annotations

import contextlib

import torch

from trainer.triton_device import triton_kernels

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INV_E4M3_MAX = (torch.tensor(1.0) / torch.tensor(E4M3_MAX)).item()  # what torch's CUDA division by 448 multiplies by
ROW_BLOCK_MAX = 16384  # rows up to this many values are held in registers whole (one read); longer ones are looped


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x already divided by its scale -> e4m3, saturated (the cast alone would make out-of-range values NaN)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows_torch(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of `quantize_rows`: what Inductor compiles, and what runs off CUDA."""
    amax = x_MK.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / E4M3_MAX
    return to_e4m3(x_MK.float() / scale), scale


def quantize_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x / scale in e4m3 [M, K], scale [M, 1] fp32) with each row's absolute max mapped to the e4m3 maximum.
    One Triton kernel on CUDA outside torch.compile (`quantize_rows_kernel`), else the torch form: the same bits."""
    if x_MK.is_cuda and x_MK.dim() == 2 and not torch.compiler.is_compiling() and _kernel() is not None:
        return quantize_rows_kernel(x_MK)
    return quantize_rows_torch(x_MK)


@triton_kernels
def _kernel(triton, tl):
    """The row kernel, or None where Triton is not installed (built once, on first use)."""
    @triton.jit
    def quantize_e4m3_rows(x_ptr, q_ptr, scale_ptr, x_stride, q_stride, K: tl.constexpr, FP8_MAX: tl.constexpr,
                           INV_FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
        """One row of K values -> its e4m3 form at its absolute max -> FP8_MAX, and that scale."""
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * x_stride
        out = q_ptr + row * q_stride
        # every max and min keeps a NaN (Triton's default drops it; torch's amax and clamp keep it): the row's max is
        # NaN where any |x| is (x != x: the NaNs)
        if K <= BLOCK:
            cols = tl.arange(0, BLOCK)
            inside = cols < K
            x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
            ax = tl.abs(x)
            amax = tl.where(tl.max((ax != ax).to(tl.int32), axis=0) > 0, float("nan"), tl.max(ax, axis=0))
            scale = tl.maximum(amax, 1e-12, propagate_nan=tl.PropagateNan.ALL) * INV_FP8_MAX
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX, propagate_nan=tl.PropagateNan.ALL),
                           FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            tl.store(out + cols, q.to(q_ptr.dtype.element_ty), mask=inside)
        else:
            top = tl.zeros([BLOCK], tl.float32)
            for start in range(0, K, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < K, other=0.0).to(tl.float32)
                top = tl.maximum(top, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
            amax = tl.where(tl.max((top != top).to(tl.int32), axis=0) > 0, float("nan"), tl.max(top, axis=0))
            scale = tl.maximum(amax, 1e-12, propagate_nan=tl.PropagateNan.ALL) * INV_FP8_MAX
            for start in range(0, K, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < K
                x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
                q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX, propagate_nan=tl.PropagateNan.ALL),
                               FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
                tl.store(out + cols, q.to(q_ptr.dtype.element_ty), mask=inside)
        tl.store(scale_ptr + row, scale)

    return quantize_e4m3_rows


def row_block(K: int) -> int:
    """The kernel's column block for rows of K values: the whole row up to ROW_BLOCK_MAX, else 4096-value blocks."""
    import triton

    return triton.next_power_of_2(K) if K <= ROW_BLOCK_MAX else 4096


def row_warps(block: int) -> int:
    """One warp per 512 values of a (power-of-two) block, 4 to 16: a first guess, not yet timed on the H200."""
    return max(4, min(16, block // 512))


def quantize_rows_kernel(x_MK: torch.Tensor, block: int = 0,
                         out_dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` by the Triton kernel (CUDA, or CPU under Triton's interpreter: the tests). x [M, K] with unit
    column stride is read in place (other layouts are copied). block: the column block (0: `row_block`); out_dtype
    float32 keeps the values before their cast (the CPU tests: the interpreter's e4m3 cast rounds unlike the GPU)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the row quantization kernel needs Triton, which is not installed")
    if x_MK.dim() != 2:
        raise ValueError(f"expected [M, K] rows, got shape {tuple(x_MK.shape)}")
    if x_MK.stride(1) != 1:
        x_MK = x_MK.contiguous()
    M, K = x_MK.shape
    q = torch.empty(M, K, dtype=out_dtype, device=x_MK.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x_MK.device)
    if M == 0:
        return q, scale
    block = block or row_block(K)
    # Triton launches on the current device: make it x's
    on_device = torch.cuda.device(x_MK.device) if x_MK.is_cuda else contextlib.nullcontext()
    with on_device:
        kernel[(M,)](x_MK, q, scale, x_MK.stride(0), q.stride(0), K, FP8_MAX=E4M3_MAX, INV_FP8_MAX=INV_E4M3_MAX,
                     BLOCK=block, num_warps=row_warps(block))
    return q, scale
