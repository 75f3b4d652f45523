"""The Gated DeltaNet layer's gated RMSNorm (HF's `Qwen3_5RMSNormGated`, `Qwen3NextRMSNormGated`) as one Triton
kernel for the decode layer (`layers/linear.py`).

Why: HF's module is about eight kernels over a [rows x value heads, head dim] tensor (the fp32 cast, the square, the
mean, rsqrt, the weight, the gate's SiLU, the products, the cast back); a hybrid's token step runs it in every
linear layer (24 of qwen3.5-9b's 32), where the uncompiled glue around the recurrent step took about a third of the
step on the H200 (docs/benchmarks.md, "Batched generation"). One program here normalizes one head's row, in HF's
arithmetic: fp32 mean of squares, rsqrt(var + eps), cast to the input dtype, times the weight (in that dtype), times
SiLU of the gate in fp32, cast back.

Runs on CUDA, and on CPU under Triton's interpreter (the tests); elsewhere, inside torch.compile, or where the weight's
dtype is not the input's (HF's product would promote), HF's module runs.
"""
from __future__ import annotations

import torch

from trainer.decode.kernels import norm_eps, norm_warps
from trainer.triton_device import runs_on, triton_kernels


@triton_kernels
def _kernel(triton, tl):
    """The jitted kernel, or None where Triton is not installed."""
    @triton.jit
    def gated_norm_rows(x_ptr, z_ptr, w_ptr, y_ptr, n_cols, heads, stride_zo, stride_zh, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        z_row = (row // heads) * stride_zo + (row % heads) * stride_zh  # the gate's own strides: a view, not a copy
        inside = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        normed = (x * tl.rsqrt(var + eps)).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0)
        weighted = (w.to(tl.float32) * normed.to(tl.float32)).to(y_ptr.dtype.element_ty)  # in the input dtype
        g = tl.load(z_ptr + z_row + cols, mask=inside, other=0.0).to(tl.float32)
        y = weighted.to(tl.float32) * (g * tl.sigmoid(g))
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=inside)

    return gated_norm_rows


class GatedRMSNorm:
    """Wraps an HF gated RMSNorm module (`weight`, `variance_epsilon` or `eps`, SiLU gate); callable like it:
    (x [N, d], gate [..., H, d] of N x d elements) -> [N, d] in x's dtype. The kernel reads the gate through its
    strides (a slice of the batch generator's joined input projection, `decode/fused.py`: no copy)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.weight = module.weight
        self.eps = norm_eps(module)
        self.silu = getattr(module, "activation", "silu") in ("silu", "swish")

    def uses_kernel(self, x: torch.Tensor) -> bool:
        # is_compiling first: building the kernel is not traceable (the decode layer's verify is compiled whole)
        return (not torch.compiler.is_compiling() and self.silu and self.weight.dtype == x.dtype
                and runs_on(x.device) and _kernel() is not None)

    def __call__(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if not self.uses_kernel(x) or gate.shape[-1] != n or gate.numel() != x.numel() or gate.dtype != x.dtype:
            return self.module(x, gate.reshape(x.shape))
        import triton

        x2 = x.contiguous().view(-1, n)
        z3 = gate.reshape(-1, gate.shape[-2] if gate.dim() > 2 else 1, n)  # a view where the strides allow
        if z3.stride(-1) != 1:
            z3 = z3.contiguous()
        y = torch.empty_like(x2)
        if x2.shape[0]:
            block = triton.next_power_of_2(n)
            _kernel()[(x2.shape[0],)](x2, z3, self.weight, y, n, z3.shape[1], z3.stride(0), z3.stride(1), self.eps,
                                      BLOCK=block, num_warps=norm_warps(block))
        return y.view(x.shape)
