"""DFlash2's grouped dynamic depthwise convolution inside each proposal block. Pure torch, static shapes, no I/O.

Shape legend: R rows, Q = N*B block positions (N blocks of B, each block contiguous), D channels, T taps, G = D / g
groups of g channels.

For block position i = q mod B, channel h and its group h // g:

    out[r, q, h] = sum_{t = 0 .. min(i, T-1)} (base[t, h] + delta[r, q, t, h // g]) * x[r, q - t, h]

a causal convolution that never reads across a block's start. `delta` is projected from the wrapped sublayer's input
(`kernel_projection`, zero at init) and `base` starts as the identity (tap 0 = 1), so a fresh convolution is the
identity and a fresh DFlash2 drafter computes what a DFlash drafter does. One module wraps one sublayer (attention or
MLP): `prepare` convolves the sublayer's input with side 0 and hands back side 1's dynamic kernel, which `finish`
applies to the sublayer's output. Parameter names and shapes are SGLang's and vLLM's (`DFlashGroupedConv`:
`base_kernel` [2, T, D], `kernel_projection.weight` [2*T*G, D]; docs/dflash2.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_conv(x_RQD: torch.Tensor, delta_RQTG: torch.Tensor, base_TD: torch.Tensor, block_size: int,
                 group_size: int) -> torch.Tensor:
    """The rule above -> [R, Q, D] in x's dtype. Q a multiple of block_size; every shape a Python constant."""
    R, Q, D = x_RQD.shape
    T = base_TD.shape[0]
    G, B = D // group_size, block_size
    x = x_RQD.view(R, Q // B, B, G, group_size)
    delta = delta_RQTG.view(R, Q // B, B, T, G).to(x.dtype)
    base = base_TD.to(x.dtype).view(T, G, group_size)
    out = None
    for t in range(T):  # static trip count: T is the config's
        # Tap t reads position i - t of the same block; the first t positions of a block have no such source.
        shifted = x if t == 0 else F.pad(x[:, :, :B - t], (0, 0, 0, 0, t, 0))
        # Two products, not shifted * (base + delta): the sum would be a full [R, Q, D] coefficient tensor that
        # autograd keeps for the backward; this way it keeps `shifted` and the small base and delta only.
        term = shifted * base[t] + shifted * delta[:, :, :, t, :, None]
        out = term if out is None else out + term
    return out.view(R, Q, D)


class GroupedDynamicConv(nn.Module):
    """One sublayer's convolution pair (input side 0, output side 1), both kernels from one projection of the
    sublayer's input."""

    def __init__(self, hidden_size: int, block_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        if not 1 <= taps <= block_size:
            raise ValueError(f"conv_kernel_size must be in [1, block_size={block_size}], got {taps}")
        if group_size < 1 or hidden_size % group_size:
            raise ValueError(f"conv_group_size={group_size} must divide hidden_size={hidden_size}")
        self.block_size, self.taps, self.group_size = block_size, taps, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity: base tap 0 = 1, every other tap and the dynamic projection 0."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x_RQD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input -> (its convolution, side 1's dynamic kernel [R, Q, T, G] for `finish`)."""
        R, Q, _ = x_RQD.shape
        delta = self.kernel_projection(x_RQD).view(R, Q, 2, self.taps, self.num_groups)
        out = grouped_conv(x_RQD, delta[:, :, 0], self.base_kernel[0], self.block_size, self.group_size)
        return out, delta[:, :, 1]

    def finish(self, y_RQD: torch.Tensor, delta_RQTG: torch.Tensor) -> torch.Tensor:
        return grouped_conv(y_RQD, delta_RQTG, self.base_kernel[1], self.block_size, self.group_size)
