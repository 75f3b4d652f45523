"""Block attention for the drafter: the visibility rule, built from static layout tensors (pure).

Shape legend: R rows, S context tokens per row, N anchors per row, B block size, Q = N*B block queries,
K = S + Q keys ([context features | block tokens]), H query heads, Hkv key/value heads, Dh head dim.

Visibility (query = row r, anchor n, block position k):
  context key j (< S): anchor n valid AND doc_ids[r, j] == doc of anchor n AND j < anchor_pos[r, n] (STRICTLY before:
      at inference the anchor is the bonus token, whose target feature does not exist yet).
  block key (m, k'):   m == n (bidirectional inside the block; nothing of other blocks).
  Equivalently (packed rows: documents are contiguous, positions restart at 0): ctx_lo[r, n] <= j < anchor_pos[r, n],
  with ctx_lo = anchor_pos - position_ids[anchor_pos]; tile-based backends (flex) use this form.
Padded anchors (valid = False) see only their own block, so no row is fully masked (no NaN); the loss masks them out.

Sliding-window layers (window W, the reference implementations' rule): the query at position anchor + k sees only
the W positions ending at itself -- context keys j >= anchor + k - (W - 1), and the block keys k' <= k (causal
inside the block). The layout then carries one mask per kind of layer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class BlockLayout:
    """Everything the drafter needs about one micro-batch's block structure. Device tensors, static shapes."""

    anchor_pos: torch.Tensor  # [R, N] long: row index of each anchor
    anchor_valid: torch.Tensor  # [R, N] bool
    anchor_doc: torch.Tensor  # [R, N] long: document id of the anchor
    ctx_lo: torch.Tensor  # [R, N] long: row index where the anchor's document starts; visible context = [ctx_lo, anchor)
    doc_ids: torch.Tensor  # [R, S] long: -1 = padding
    ctx_rope_pos: torch.Tensor  # [R, S] long: per-document positions of the context keys
    q_rope_pos: torch.Tensor  # [R, Q] long: position_ids[anchor] + k
    block_size: int
    mask: Any = None  # backend-specific: [R, 1, Q, K] bool for "sdpa"; a BlockMask for "flex"; {kind: mask} with
    # sliding-window layers

    @property
    def num_queries(self) -> int:
        return self.anchor_pos.shape[1] * self.block_size


def make_layout(position_ids: torch.Tensor, doc_ids: torch.Tensor, anchor_pos: torch.Tensor,
                anchor_valid: torch.Tensor, block_size: int, backend: str = "sdpa",
                mask_fn: Callable[..., Any] | None = None, window: int | None = None) -> BlockLayout:
    """Build the layout on the tensors' device with gathers only (no host sync, capturable).

    The backend's mask: `mask_fn(layout, window)` when given (e.g. the flex backend's static, in-place-updated
    BlockMask, owned by the GPU runner), else the dense bool mask for "sdpa". window: the drafter's sliding window
    when some of its layers use one: the mask is then {FULL: ..., SLIDING: ...}.
    """
    offsets = torch.arange(block_size, device=anchor_pos.device)
    anchor_doc = doc_ids.gather(1, anchor_pos)  # [R, N]
    anchor_rope = position_ids.gather(1, anchor_pos)  # [R, N]
    # Packing restarts positions at 0 for every document, so its first token sits at anchor_pos - position.
    ctx_lo = anchor_pos - anchor_rope
    q_rope_pos = (anchor_rope[:, :, None] + offsets).flatten(1)  # [R, N*B]
    layout = BlockLayout(anchor_pos=anchor_pos, anchor_valid=anchor_valid, anchor_doc=anchor_doc, ctx_lo=ctx_lo,
                         doc_ids=doc_ids, ctx_rope_pos=position_ids, q_rope_pos=q_rope_pos, block_size=block_size)
    if mask_fn is None and backend != "sdpa":
        raise ValueError(f"attention backend {backend!r} needs a mask_fn (flex: a FlexBlockMask updated in place)")

    def build(w: int | None):
        if mask_fn is not None:
            return mask_fn(layout, w) if w is not None else mask_fn(layout)
        return dense_block_mask(layout, w)

    if window is None:
        return _with_mask(layout, build(None))
    return _with_mask(layout, {FULL: build(None), SLIDING: build(window)})


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[Lq, Lk] bool: the sliding rule by absolute positions (decoding's layout, where the block follows its
    context): a query at p sees the keys at p - window + 1 .. p."""
    return (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)


def mask_of(layout: BlockLayout, kind: str):
    """The mask a layer of this kind attends with."""
    return layout.mask[kind] if isinstance(layout.mask, dict) else layout.mask


def _with_mask(layout: BlockLayout, mask: Any) -> BlockLayout:
    return BlockLayout(**{**layout.__dict__, "mask": mask})


def dense_block_mask(layout: BlockLayout, window: int | None = None) -> torch.Tensor:
    """[R, 1, Q, S+Q] bool, True = may attend. The reference definition of the visibility rule (and of the sliding
    rule when `window` is given)."""
    R, N = layout.anchor_pos.shape
    S = layout.doc_ids.shape[1]
    B = layout.block_size
    key_idx = torch.arange(S, device=layout.doc_ids.device)
    ctx = (layout.doc_ids[:, None, :] == layout.anchor_doc[:, :, None]) \
        & (key_idx[None, None, :] < layout.anchor_pos[:, :, None]) \
        & layout.anchor_valid[:, :, None]  # [R, N, S]
    ctx = ctx[:, :, None, :].expand(R, N, B, S)  # [R, N, B, S]
    block_of = torch.arange(N * B, device=ctx.device) // B
    blk = (block_of[:, None] == block_of[None, :]).expand(R, N * B, N * B)  # [R, Q, Q]
    if window is not None:
        k = torch.arange(B, device=ctx.device)
        lower = layout.anchor_pos[:, :, None] + k - (window - 1)  # [R, N, B]: the window's first position
        ctx = ctx & (key_idx[None, None, None, :] >= lower[..., None])
        offset = torch.arange(N * B, device=ctx.device) % B
        blk = blk & (offset[None, :] <= offset[:, None])  # causal inside the block
    return torch.cat([ctx.reshape(R, N * B, S), blk], dim=2)[:, None]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                    backend: str = "sdpa") -> torch.Tensor:
    """q [R, H, Q, Dh], k/v [R, Hkv, S+Q, Dh] -> [R, H, Q, Dh]. Non-causal; visibility from `mask` (a layer's
    `mask_of(layout, kind)`)."""
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    if backend == "flex":
        from trainer.model.flex import flex_block_attention  # GPU branch

        return flex_block_attention(q, k, v, mask)
    raise ValueError(f"unknown attention backend {backend!r}; use 'sdpa' or 'flex'")
