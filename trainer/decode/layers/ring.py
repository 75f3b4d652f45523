"""A sliding-window layer's K/V cache as a ring of W = window + block slots plus one trash slot (`ring_size`): such a
layer's queries only ever see the `window` keys ending at themselves, so it keeps that many, not the whole context.
Pure rules (which slot a token goes to, which keys a query sees); `AttentionLayer` applies them.

Position p lives in ring slot p mod W. A forward reads before it writes: its queries attend over the forward's
rows' ring [R', Hkv, W, Dh] followed by its own L new keys, then the new tokens go into the ring. For a row whose
forward starts at p0 (its first query position), ring slot s holds the latest position < p0 that maps to s,
kpos(s) = p0 - 1 - ((p0 - 1 - s) mod W), so the ring's positions need no tensor. That is the position really there:
- positions p0 - window + 1 .. p0 - 1 (the ones a query of this forward may see) were written by the forwards that
  committed them (an accepted draft token's K/V are the target's own);
- a rejected draft of the previous verify (at most `block` tokens, at positions >= p0) went to the slots of
  positions <= p0 - window - 1, which no query of this forward sees;
- a row that starts over (p0 = 0) sees no ring key (kpos < 0), whatever the ring still holds.
Key at position k is visible to the query at q by attention.key_visible's rule, the one a full cache's mask
follows: 0 <= k <= q and k > q - window (HF's window rule), and, for a left-padded batch, k >= min(row_start, q).

Writes: a forward's token j goes to slot (p0 + j) mod W only if it is real (j <= the row's last real index: a
prefill's bucket or chunk padding is not) and among the row's last W real tokens (a chunk longer than W would
overwrite its own keys); any other token goes to the trash slot W, which no query reads.

Shape legend: L tokens, R rows (R' of the forward), W ring slots.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from trainer.decode.layers.attention import key_visible


class Ring(NamedTuple):
    """What every ring layer of one forward shares (built once per forward by the stack). Device tensors only."""

    slots: torch.Tensor  # [L] (shared positions) or [R', L] long: each new token's ring slot, W for the trash
    visible: torch.Tensor  # [R or 1, 1, L, W + L] bool: the ring's keys, then the forward's new ones


def ring_size(window: int | None, block: int, slots: int) -> int | None:
    """W = window + block ring slots, or None where W + 1 (the trash slot) would not be fewer than `slots` (the full
    cache is then no larger). trainer/regen/memory.py counts the same."""
    if not window:
        return None
    size = window + block
    return size if size + 1 < slots else None


def ring_positions(p0: torch.Tensor, size: int) -> torch.Tensor:
    """p0 [R or 1, 1] long (each row's first query position) -> the position each ring slot holds, [R or 1, size]
    (negative: nothing yet)."""
    s = torch.arange(size, device=p0.device)
    return p0 - 1 - torch.remainder(p0 - 1 - s, size)


def ring_visible(pos: torch.Tensor, size: int, window: int, row_start: torch.Tensor | None = None) -> torch.Tensor:
    """Queries at positions pos [L] (or [R, L]: per-row positions, each row's first one its p0) -> visible [R or 1,
    1, L, size + L] bool over [ring keys | new keys] (module docstring). row_start [R] (a left-padded batch, pos
    [L]): a row sees no key before its start, except a padding query its own."""
    at = pos if pos.dim() == 2 else pos[None]  # [R or 1, L]
    keys = torch.cat([ring_positions(at[:, :1], size), at], dim=1)  # [R or 1, size + L]
    return key_visible(keys, pos, row_start, window)[:, None]


def ring_slots(pos: torch.Tensor, size: int, last: torch.Tensor | None = None) -> torch.Tensor:
    """The ring slot of each new token, pos [L] or [R', L] -> the same shape: pos mod size where the token is real
    and among the row's last `size` real ones, else the trash slot `size`. last: the index of the last real token
    (a 0-dim or [1] long for shared positions, [R'] per row); None: every token is real."""
    L = pos.shape[-1]
    j = torch.arange(L, device=pos.device)
    if last is None:
        keep = j > L - 1 - size
    else:
        end = last.reshape(-1, 1) if pos.dim() == 2 else last.reshape(-1)[-1:]
        keep = (j <= end) & (j > end - size)
    return torch.where(keep, torch.remainder(pos, size), size)


def ring_step(pos: torch.Tensor, size: int, window: int, row_start: torch.Tensor | None = None,
              last: torch.Tensor | None = None) -> Ring:
    """The ring layers' share of one forward (`Ring`): see ring_visible and ring_slots."""
    return Ring(ring_slots(pos, size, last), ring_visible(pos, size, window, row_start))
