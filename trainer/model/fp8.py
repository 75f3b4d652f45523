"""FP8 products with the frozen target's weights, on the FP8 tensor cores (`torch._scaled_mm`, row-wise
scales, bf16 out). The target never trains, so each weight is quantized once to float8 e4m3; activations are
quantized per row (token) at each product.

- `model.target_fp8`: the target's decoder-layer linears (`Fp8Linear`; which module replaces what:
  trainer/model/fp8_target.py). The target's features then differ from the bf16 target's by the quantization error
  of every linear.
- `step.head_fp8`: the LM head's two GEMMs in the drafter's loss (`Fp8Head`): the logits, and the gradient into the
  drafter's hidden states (the head is frozen, so no weight gradient). The CE chunk writes that gradient in e4m3
  directly (`dlogits_scale`: the row's maximum, known before the row is written), so it is never held in bf16.

Both change what the drafter learns from, so their effect on acceptance is measured on the quality pipeline
(docs/quality.md): the head's is `auto` (on where the FP8 tensor cores run it), the target's stays opt-in. The
embedding and the final norm stay in the target's dtype, and the exported drafter and every decode use the bf16 head.

What runs where. An activation's rows are quantized by `quantize_rows` (trainer/model/fp8_rows.py): under
torch.compile (the trainer's compile modes) in torch, which Inductor fuses; eagerly on CUDA (the static decode
engine, whose CUDA graphs capture the target's modules as they run, and eager training) by one Triton kernel with the
same bits; on CPU (the tests) in torch. The product is `torch._scaled_mm` on CUDA, its fp32 form elsewhere. Linears
that read one input (attention's q/k/v, a Gated DeltaNet's input projections) share one quantization of it outside
compile (`project_shared`).

Shape legend: M rows (tokens), K input features, N output features.
"""
from __future__ import annotations

import torch

from trainer.model.fp8_rows import E4M3, E4M3_MAX, quantize_rows


def dlogits_scale(s: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """Per-row e4m3 scale of dlogits = (softmax - onehot) * s, from rest = 1 - p_label, the probability mass off the
    label: the row's largest magnitude is s * rest, the label's entry (every other probability is a part of rest).
    rest must be summed over the other entries, not taken as 1 - p_label, which cancels to 0 in a confident row.
    Floored so that a row of zeros (s = 0, or no mass off the label) divides by a finite scale. [C] -> [C] fp32."""
    return (s.float() * rest.float()).clamp_min(1e-30) / E4M3_MAX


def scaled_mm(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a_q * a_scale) @ (b_q * b_scale): a_q [M, K] e4m3 row-major with a_scale [M, 1], b_q [K, N] e4m3
    column-major with b_scale [1, N]. On CUDA the FP8 tensor cores (K and N multiples of 16); elsewhere (tests) the
    same function in fp32 from the same quantized values."""
    if a_q.device.type == "cuda":
        return torch._scaled_mm(a_q, b_q, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)
    return ((a_q.float() * a_scale) @ (b_q.float() * b_scale)).to(out_dtype)


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores with row-wise scaled matmuls: CUDA compute capability 9.0 (Hopper) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_refusal(device: torch.device, option: str) -> str | None:
    """Why `option` (the target's decoder linears in FP8) cannot run with the target on `device`, in one line, or
    None: it needs FP8 tensor cores (`fp8_supported`) and this torch's row-wise scaled matmul on them. Cheap (one
    16 x 16 product): callers ask before any weight loads."""
    if not fp8_supported(device):
        where = str(device)
        if device.type == "cuda":
            where += " (compute capability {}.{})".format(*torch.cuda.get_device_capability(device))
        return f"{option} needs FP8 tensor cores (CUDA compute capability 9.0+); the target would be on {where}"
    error = rowwise_matmul_error(device)
    return f"{option}: this torch cannot run row-wise scaled FP8 matmuls on {device} ({error})" if error else None


def rowwise_matmul_error(device: torch.device) -> str | None:
    """Run one tiny row-wise scaled e4m3 matmul with bf16 output on `device`: None, or the first line of why this
    build of torch cannot (its row-wise kernels exist for some GPU generations only)."""
    a = torch.zeros(16, 16, device=device, dtype=E4M3)
    ones = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t().contiguous(), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        return (str(e).strip().splitlines() or ["unknown error"])[0]
    return None


class Fp8Linear(torch.nn.Module):
    """A frozen `nn.Linear` (no bias: the supported families' decoder linears have none, or keep it in bf16) whose
    weight is held in e4m3 with one scale per output channel. On CUDA the product runs on the FP8 tensor cores; on
    CPU (tests) it is computed from the same quantized values in fp32, so both compute the same function.

    Several bias-free linears that read one input may be given: their weights are stacked by output rows, one GEMM
    for all (the scales are per row, so it is the same function as each apart)."""

    def __init__(self, *linears: torch.nn.Linear) -> None:
        super().__init__()
        first = linears[0]
        if len(linears) > 1 and (any(lin.bias is not None for lin in linears)
                                 or any(lin.in_features != first.in_features for lin in linears)):
            raise ValueError("only bias-free linears of one input width can be stacked")
        weight = torch.cat([lin.weight.detach() for lin in linears]) if len(linears) > 1 else first.weight.detach()
        w_q, w_scale = quantize_rows(weight)  # per output channel = per row of [N, K]
        self.register_buffer("weight_q", w_q)  # [N, K]
        self.register_buffer("weight_scale", w_scale.t().contiguous())  # [1, N]
        bias = first.bias.detach() if first.bias is not None else None
        self.register_buffer("bias", bias)
        self.out_dtype = first.weight.dtype
        self.in_features, self.out_features = first.in_features, weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x_q, x_scale = quantize_rows(x.reshape(-1, self.in_features))
        return self.product(x_q, x_scale).reshape(*lead, self.out_features)

    def product(self, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """Input rows already in e4m3 [M, K] with their scales [M, 1] -> [M, N] in the weight's dtype."""
        out = scaled_mm(x_q, x_scale, self.weight_q.t(), self.weight_scale, self.out_dtype)
        return out + self.bias if self.bias is not None else out


class Fp8Head:
    """The frozen LM head's weight W [V, D] in e4m3, twice: per vocab row for the logits h @ W^T, and per hidden
    column for the input gradient dlogits @ W (a scale must run along the output dimension of its product). Two
    one-byte copies: the footprint of one more bf16 head. Built once, before capture; never trained or saved."""

    def __init__(self, weight_VD: torch.Tensor) -> None:
        w = weight_VD.detach()
        self.out_dtype = w.dtype
        rows_q, rows_scale = quantize_rows(w)  # [V, D], [V, 1]
        self.rows_q, self.rows_scale = rows_q, rows_scale.t().contiguous()  # [1, V]
        cols_q, cols_scale = quantize_rows(w.t().contiguous())  # [D, V], [D, 1]
        self.cols_q, self.cols_scale = cols_q, cols_scale.t().contiguous()  # [1, D]

    def logits(self, h_CD: torch.Tensor) -> torch.Tensor:
        """[C, D] -> [C, V] logits in the head's dtype."""
        h_q, h_scale = quantize_rows(h_CD)
        return scaled_mm(h_q, h_scale, self.rows_q.t(), self.rows_scale, self.out_dtype)

    def input_grad(self, g_q_CV: torch.Tensor, g_scale_C1: torch.Tensor) -> torch.Tensor:
        """dlogits in e4m3 [C, V] with its row scales [C, 1] -> dL/dh [C, D] in the head's dtype."""
        return scaled_mm(g_q_CV, g_scale_C1, self.cols_q.t(), self.cols_scale, self.out_dtype)


def project_shared(x: torch.Tensor, linears) -> list[torch.Tensor]:
    """x [..., K] through linears that all read it -> their outputs, in order. Where every one is an `Fp8Linear`
    and this is not being compiled, x is quantized once for all of them (each linear's `quantize_rows` of x would
    give the same bits); otherwise each is called as it is, so a bf16 target runs the same ops as before and a compiled
    graph is what it was."""
    if len(linears) < 2 or torch.compiler.is_compiling() or not all(isinstance(lin, Fp8Linear) for lin in linears):
        return [lin(x) for lin in linears]
    lead = x.shape[:-1]
    x_q, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return [lin.product(x_q, x_scale).reshape(*lead, lin.out_features) for lin in linears]
