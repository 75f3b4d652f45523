"""Random anchor sampling (pure given a torch.Generator).

An anchor p is a candidate iff tokens p and p+1 are both supervised (loss_mask) and in the same document (the
reference rule: the block has at least one label, and its anchor is a token the target itself produced -- a block
anchored on the last prompt token is one inference never runs, since decoding's first anchor is the prefill's
bonus token). Per row, N anchors are drawn uniformly without replacement among the candidates; rows with fewer
candidates are padded with valid=False anchors pointing at position 0. Output is sorted: valid anchors first, ascending.

Density (`data.anchor_fraction`): None draws N per row whatever the row holds; a fraction f draws
min(N, ceil(f * the row's supervised tokens)) per row, the rest of the N slots masked out, so that every supervised
token has about the same chance f to be anchored however the rows were packed. The tensors keep N slots either way.
"""
from __future__ import annotations

import torch


def anchor_counts(loss_mask: torch.Tensor, num_anchors: int, fraction: float | None) -> torch.Tensor:
    """[R, S] bool -> [R] long: anchors wanted per row (before the candidates limit them)."""
    R = loss_mask.shape[0]
    if fraction is None:
        return torch.full((R,), num_anchors, dtype=torch.long)
    wanted = torch.ceil(loss_mask.sum(dim=1).double() * fraction).long()
    return wanted.clamp(max=num_anchors)


def anchor_candidates(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """[R, S] bool."""
    cand = torch.zeros_like(loss_mask)
    cand[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:] & (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, :-1] >= 0)
    return cand


def sample_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, num_anchors: int,
                   generator: torch.Generator, fraction: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, S] -> anchor_pos [R, N] long, anchor_valid [R, N] bool. fraction: see the module docstring."""
    R, S = loss_mask.shape
    cand = anchor_candidates(loss_mask, doc_ids)
    keys = torch.rand(R, S, generator=generator)
    keys = torch.where(cand, keys, torch.full_like(keys, 2.0))  # non-candidates sort last
    picked_keys, picked = keys.topk(num_anchors, dim=1, largest=False)  # ascending keys: a random order
    valid = picked_keys < 2.0
    if fraction is not None:  # the first `count` of a random order: a uniform draw of that many
        valid &= torch.arange(num_anchors) < anchor_counts(loss_mask, num_anchors, fraction)[:, None]
    order = torch.where(valid, picked, picked + S).argsort(dim=1)  # valid first, each group ascending
    pos = picked.gather(1, order)
    valid = valid.gather(1, order)
    return torch.where(valid, pos, torch.zeros_like(pos)), valid
