"""An opt-in FP8 forward for the frozen target's decoder-layer linears (`model.target_precision: fp8`).

The target never trains, so its weights are quantized once, per output channel, to float8 e4m3; each forward
quantizes its input per row (token) and multiplies on the FP8 tensor cores (`torch._scaled_mm` with row-wise scales,
bf16 out). The embedding, the final norm and the LM head stay in the target's dtype: the drafter trains through the
LM head and reads the embedding. The target's features then differ from the bf16 target's (by the quantization error
of every linear), which is why this is opt-in: what it does to acceptance is a quality-pipeline question.

Shape legend: M rows (tokens), K input features, N output features.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x / scale in e4m3 [M, K], scale [M, 1] fp32) with each row's absolute max mapped to the e4m3 maximum."""
    amax = x_MK.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / E4M3_MAX
    return (x_MK.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores with row-wise scaled matmuls: CUDA compute capability 9.0 (Hopper) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


class Fp8Linear(torch.nn.Module):
    """A frozen `nn.Linear` (no bias: the supported families' decoder linears have none, or keep it in bf16) whose
    weight is held in e4m3 with one scale per output channel. On CUDA the product runs on the FP8 tensor cores; on
    CPU (tests) it is computed from the same quantized values in fp32, so both compute the same function."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w_q, w_scale = quantize_rows(linear.weight.detach())  # per output channel = per row of [N, K]
        self.register_buffer("weight_q", w_q)  # [N, K]
        self.register_buffer("weight_scale", w_scale.t().contiguous())  # [1, N]
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.out_dtype = linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x_q, x_scale = quantize_rows(x.reshape(-1, self.in_features))
        if x.device.type == "cuda":
            out = torch._scaled_mm(x_q, self.weight_q.t(), scale_a=x_scale, scale_b=self.weight_scale,
                                   out_dtype=self.out_dtype)
        else:
            out = ((x_q.float() * x_scale) @ (self.weight_q.float() * self.weight_scale.t()).t()).to(self.out_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)


def quantize_target_layers(layers) -> int:
    """Replace every decoder-layer linear named in LINEAR_NAMES (attention and MLP projections) by an `Fp8Linear`,
    in place -> how many were replaced. The bf16 weights are freed."""
    replaced = 0
    for layer in layers:
        for parent in (getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
            if parent is None:
                continue
            for name in LINEAR_NAMES:
                child = getattr(parent, name, None)
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Fp8Linear(child))
                    replaced += 1
    return replaced
