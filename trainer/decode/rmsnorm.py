"""RMSNorm whose result for a row does not depend on how many rows are normalized together.

Why: speculative decoding is lossless only if the target's 16-token verify forward computes, for each token, exactly
what a 1-token decode step computes. In bf16 on the H200, cuBLAS gives bitwise the same rows at M = 1 and M = 16 for
the target's linears, and SDPA does for 1 and 16 queries (scratch measurement, docs/quality.md). The HF RMSNorm does
not: its `mean` is a PyTorch reduction whose thread layout depends on the number of rows (512 threads on one row,
32 per row on 16), so the fp32 sums round differently, and now and then a bf16 output lands one ulp apart. Q4 saw 3
of 24 prompts diverge that way. Here one Triton program normalizes one row with a reduction shaped only by the row
length, so a row's result is the same whatever the batch.

The arithmetic is HF's (Qwen3/Qwen2/Llama RMSNorm): fp32 mean of squares, `rsqrt(var + eps)`, cast to the input
dtype, then times the weight in that dtype. It is also one kernel instead of about eight, which makes a decode step
faster. Where Triton or CUDA is missing (CPU), or inside `torch.compile` (which fuses the HF module anyway), the HF
module runs unchanged.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def _kernel():
    """The compiled Triton kernel, or None where Triton is not installed (the CPU build)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rms_norm_rows(x_ptr, w_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        normed = (x * tl.rsqrt(var + eps)).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0)
        tl.store(y_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(y_ptr.dtype.element_ty),
                 mask=inside)

    return triton, rms_norm_rows


def triton_available() -> bool:
    return _kernel() is not None


class RowInvariantRMSNorm:
    """Wraps an HF RMSNorm module (`weight`, `variance_epsilon`); callable like it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.weight = module.weight
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))

    def uses_kernel(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and _kernel() is not None and self.weight.dtype == x.dtype
                and not torch.compiler.is_compiling())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_kernel(x):
            return self.module(x)
        triton, kernel = _kernel()
        n = x.shape[-1]
        x2 = x.contiguous().view(-1, n)
        y = torch.empty_like(x2)
        if x2.shape[0] == 0:
            return y.view(x.shape)
        block = triton.next_power_of_2(n)
        # num_warps depends on the row length only: the reduction tree must not change with the row count.
        kernel[(x2.shape[0],)](x2, self.weight, y, n, self.eps, BLOCK=block, num_warps=max(1, min(8, block // 256)))
        return y.view(x.shape)
