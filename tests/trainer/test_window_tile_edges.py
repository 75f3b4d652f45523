"""Sliding windows at flex's 128-token tile edges, up to a window of 128K + 127 tokens: the target's doc-causal
tile tables and mask_mod (trainer/model/doc_attention.py) and the drafter's (trainer/model/flex.py), against the
plain rule written here -- key j visible to query i iff j <= i and i - j < window (same document) -- evaluated on
the index pairs of chosen tiles, never as a dense S x S mask."""
from __future__ import annotations

import pytest
import torch

from trainer.model.doc_attention import DocCausalMask, doc_tile_states
from trainer.model.flex import BlockLayoutShape, FlexBlockMask

TILE = 128
BIG = 128 * 1024
WINDOWS = [127, 128, 129, 130, 255, 256, 257, 258, BIG - 1, BIG, BIG + 1, BIG + 2, BIG + 127, BIG + 128, BIG + 129]


def seq_for(window: int) -> int:
    """A row a few tiles longer than the window, a whole number of tiles."""
    return (window // TILE + 3) * TILE


def visible(i: torch.Tensor, j: torch.Tensor, window: int) -> torch.Tensor:
    return (j <= i) & (i - j < window)


def edge_tiles(window: int, n: int) -> list[tuple[int, int]]:
    """(q-tile, k-tile) pairs around where the window's edge falls: tile gaps window//TILE - 1 .. + 1, the diagonal."""
    pairs = []
    for qi in (n - 1, n - 2):
        for gap in (0, 1, window // TILE - 1, window // TILE, window // TILE + 1):
            if 0 <= gap <= qi:
                pairs.append((qi, qi - gap))
    return pairs


@pytest.mark.parametrize("window", WINDOWS)
def test_target_tile_tables_at_the_window_edge_follow_the_plain_rule(window):
    seq = seq_for(window)
    doc = torch.zeros(1, seq, dtype=torch.long)  # one document: only the window and causality decide
    partial, full = doc_tile_states(doc, TILE, window)
    offsets = torch.arange(TILE)
    for qi, ki in edge_tiles(window, seq // TILE):
        pairs = visible((qi * TILE + offsets)[:, None], (ki * TILE + offsets)[None, :], window)
        assert bool(full[0, 0, qi, ki]) == bool(pairs.all()), (window, qi, ki)
        assert bool(partial[0, 0, qi, ki] | full[0, 0, qi, ki]) == bool(pairs.any()), (window, qi, ki)
        assert not bool(partial[0, 0, qi, ki] & full[0, 0, qi, ki])


@pytest.mark.parametrize("window", [127, 128, 129, BIG + 127])
def test_target_mask_mod_at_the_window_edge_follows_the_plain_rule(window):
    seq = seq_for(window)
    mask = DocCausalMask(1, seq, "cpu", window=window)
    mask.update_(torch.zeros(1, seq, dtype=torch.long))
    i = torch.tensor([seq - 1, seq - 2, seq - TILE, seq - TILE - 1, window, window - 1, window + 1])
    d = torch.tensor([-1, 0, 1, window - 2, window - 1, window, window + 1])  # i - j
    q, k = i[:, None].expand(-1, len(d)), i[:, None] - d[None, :]
    keep = (k >= 0) & (k < seq)
    q, k = q[keep], k[keep]
    zero = torch.zeros_like(q)
    assert torch.equal(mask.block_mask.mask_mod(zero, zero, q, k), visible(q, k, window))


@pytest.mark.slow
@pytest.mark.parametrize("window", [127, 128, 129, 130, 255, BIG + 127, BIG + 128, BIG + 130])
def test_drafter_sliding_tiles_and_mask_mod_at_the_window_edge_follow_the_plain_rule(window):
    """The drafter's block queries (anchor a, offset k) sit at a + k and see context keys j < a of their document
    with (a + k) - j < window, and the block keys up to their own offset. A tile [t0, t1) of context is wholly
    visible to an anchor's block iff a + B - window <= t0 and a >= t1, partly iff a - (window - 1) < t1: one query
    tile per anchor value on each side of those edges (all its anchors alike, so no other anchor hides a wrong
    tile), and one of mixed anchors with an invalid one. Every query tile against every key."""
    block, per_tile = 4, TILE // 4
    ctx_len = seq_for(window)
    edge = (window // TILE + 1) * TILE  # t0 of a context tile the window's edge crosses
    values = [edge + window - block + d for d in (-1, 0, 1)] + [edge + TILE + window - 1 + d for d in (-2, -1, 0)]
    values = [min(ctx_len - 1, v) for v in values]
    mixed = sorted(min(ctx_len - 1, max(1, edge + window - 1 - k + s)) for k in range(block)
                   for s in (-1, 0, 1, 2, 127, 128, -130, 3))[:per_tile]
    anchor = torch.tensor([v for v in values for _ in range(per_tile)] + mixed)[None]
    ctx_lo, valid = torch.zeros_like(anchor), torch.ones_like(anchor, dtype=torch.bool)
    valid[0, -5] = False  # sees its own block only
    shape = BlockLayoutShape(batch=1, ctx_len=ctx_len, num_anchors=anchor.shape[1], block_size=block, tile=TILE)
    mask = FlexBlockMask(shape, "cpu", window=window)
    mask.update_(anchor.to(torch.int32), ctx_lo.to(torch.int32), valid)
    got = mask.block_mask
    kv = torch.arange(shape.kv_len)[None, :]
    for qt in range(shape.q_len // TILE):
        q = torch.arange(qt * TILE, (qt + 1) * TILE)
        j, k = q // block, q % block
        a = anchor[0, j][:, None]
        in_ctx = (kv < a) & ((a + k[:, None]) - kv < window) & valid[0, j][:, None]
        in_blk = (kv >= ctx_len) & ((kv - ctx_len) // block == j[:, None]) & ((kv - ctx_len) % block <= k[:, None])
        want = in_ctx | in_blk  # [TILE, KV]: this query tile against every key
        zero = torch.zeros_like(q)[:, None]
        assert torch.equal(got.mask_mod(zero, zero, q[:, None], kv), want), (window, qt)

        tiles = want.view(TILE, -1, TILE).transpose(0, 1).reshape(shape.kv_len // TILE, -1)
        full = torch.zeros(shape.kv_len // TILE, dtype=torch.bool)
        full[got.full_kv_indices[0, 0, qt, :got.full_kv_num_blocks[0, 0, qt]].long()] = True
        seen = full.clone()
        seen[got.kv_indices[0, 0, qt, :got.kv_num_blocks[0, 0, qt]].long()] = True
        assert torch.equal(seen, tiles.any(dim=1)), (window, qt)  # no visible pair dropped, no empty tile visited
        ctx_tiles = ctx_len // TILE  # full: no mask_mod at all, so every pair must be visible (and is, when it is)
        assert torch.equal(full[:ctx_tiles], tiles.all(dim=1)[:ctx_tiles]), (window, qt)
