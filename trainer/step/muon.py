"""Muon for the drafter's 2-D weight matrices, AdamW for the rest, as one capturable optimizer.

torch.optim.Muon reads its LR as a host number (`param.add_(update, alpha=lr)`), so a device-tensor LR costs a host
sync inside step() and cannot be captured into a CUDA graph. `CapturableMuon` is the same update (momentum, optional
Nesterov, torch's Newton-Schulz iteration and coefficients in bf16, decoupled weight decay, torch's shape LR
adjustment) with every LR product kept on the device. `MuonAdamW` presents it and an AdamW as one optimizer to the
step, the graph and the checkpoint code.
"""
from __future__ import annotations

import math
from typing import Any

import torch

# torch.optim.Muon's defaults (Keller Jordan's quintic Newton-Schulz coefficients).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
ADJUST_LR = ("original", "match_rms_adamw")


def zeropower(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """The approximate orthogonalisation of a 2-D `grad` (torch.optim.Muon's iteration, op for op), in bf16."""
    a, b, c = coefficients
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_ratio(shape: torch.Size, adjust_lr: str) -> float:
    """The per-matrix LR factor (torch.optim.Muon's adjust_lr_fn): 'original' sqrt(max(1, rows/cols)) keeps the
    update's RMS across shapes; 'match_rms_adamw' 0.2 sqrt(max(rows, cols)) matches AdamW's, so AdamW's LR serves."""
    rows, cols = shape[:2]
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


class CapturableMuon(torch.optim.Optimizer):
    """torch.optim.Muon's update with the LR a 0-d device tensor read only on the device (no host sync in step())."""

    def __init__(self, params, *, lr: torch.Tensor, weight_decay: float, momentum: float, nesterov: bool,
                 ns_steps: int, adjust_lr: str, capturable: bool, eps: float = NS_EPS) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_steps": ns_steps, "ns_coefficients": NS_COEFFICIENTS, "eps": eps, "adjust_lr": adjust_lr,
                    "capturable": capturable}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, got one of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch.optim.Optimizer's signature)
        if closure is not None:
            raise ValueError("CapturableMuon.step takes no closure")
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                update = p.grad.lerp(buf, mom) if group["nesterov"] else buf
                update = zeropower(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.sub_(update.to(p.dtype) * (lr * lr_ratio(p.shape, group["adjust_lr"])))
        return None


def is_muon_param(name: str, p: torch.nn.Parameter) -> bool:
    """Muon takes a trainable matrix whose both sides exceed 1, except a vocabulary-indexed table (a DFlash2
    selector's codebooks): those, norms, biases and vectors take AdamW (speculators' split)."""
    return p.requires_grad and p.ndim == 2 and min(p.shape) > 1 and "codebook" not in name


class MuonAdamW:
    """A CapturableMuon and an AdamW seen as one optimizer: step, zero_grad, param_groups (Muon's then AdamW's, the
    group dicts themselves, so filling or rebinding group["lr"] reaches both), state, state_dict/load_state_dict."""

    def __init__(self, muon: CapturableMuon, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}

    def step(self, closure=None):  # noqa: ANN001
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuses (KeyError) an AdamW-only optimizer state: a run's optimizer does not change on resume."""
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
