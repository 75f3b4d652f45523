"""The sampled choice's draws for the refilling batch generator (generate.py, whose docstring gives the rule): the
counter-based Gumbel noise keyed by (seed, draw, stream, token id), and HF's top-p filter. On the device, no host
sync, no generator state."""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32-style xor-shift-multiply) on int64 values in [0, 2^32). The multipliers are
    below 2^31, so no product leaves int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x31848BAB) & _M32
    return x ^ (x >> 16)


def seed32(seed: int) -> int:
    """A seed of any size -> the 32-bit key of the noise stream. Pure."""
    return (seed ^ (seed >> 32) ^ (seed >> 64)) & _M32


def gumbel_noise(seed: torch.Tensor, draw: torch.Tensor, streams: torch.Tensor,
                 vocab_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [R, V] fp32 for draw number `draw` (0-dim long) of `seed` (0-dim long, 32 bits), one
    row per stream id (`streams` [R] long, each < 2^31), from a hash of (seed, draw, stream, token id): u uniform in
    (0, 1) on a 2^-24 grid, g = -log(-log(u))."""
    step_key = _mix32((seed + draw * 0x9E3779B9) & _M32)
    row_key = _mix32((step_key + streams * 0x85EBCA6B) & _M32)  # [R]
    bits = _mix32(vocab_ids[None, :] ^ row_key[:, None])  # [R, V]
    u = ((bits >> 8).float() + 0.5) * 2.0 ** -24
    return -torch.log(-torch.log(u))


def top_p_filter(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF's TopPLogitsWarper (min_tokens_to_keep 1): scores [R, V] with every token outside the nucleus set to -inf.
    top_p: 0-dim device tensor."""
    ascending, order = torch.sort(scores, dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= 1 - top_p
    remove[:, -1] = False  # the most likely token always stays
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
