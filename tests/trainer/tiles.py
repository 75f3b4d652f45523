"""The one check of a flex tile table against the dense mask it stands for (the drafter's block mask and the
target's doc-causal mask both use it)."""
from __future__ import annotations

import torch


def assert_tiles_match(partial: torch.Tensor, full: torch.Tensor, dense: torch.Tensor, tile: int) -> None:
    """partial, full [R, 1, Qt, Kt] bool; dense [R, Q, K] bool. A full tile has every pair visible, a partial one
    some, an absent one none; no tile is both."""
    rows, q_tiles, k_tiles = partial.shape[0], partial.shape[2], partial.shape[3]
    for r in range(rows):
        for q in range(q_tiles):
            for k in range(k_tiles):
                t = dense[r, q * tile:(q + 1) * tile, k * tile:(k + 1) * tile]
                assert not (partial[r, 0, q, k] and full[r, 0, q, k]), (r, q, k)
                if full[r, 0, q, k]:
                    assert t.all(), (r, q, k)
                elif partial[r, 0, q, k]:
                    assert t.any(), (r, q, k)
                else:
                    assert not t.any(), (r, q, k)
