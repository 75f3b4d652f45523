"""Pack variable-length samples into rows of exactly seq_len tokens (pure).

First-fit over the still-open rows, in the given sample order. A sample longer than seq_len is truncated to seq_len
(counted, so the caller can warn). Each document in a row gets its own doc id (0, 1, ...) and positions restarting at
0; padding has doc id -1, so masks built from doc ids keep documents (and padding) apart.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.data.source import Sample

_CLOSE_BELOW = 2  # a row with fewer free tokens than this can hold no useful document (need anchor + 1 label)


@dataclass(frozen=True)
class PackedRows:
    """All packed rows of a split. int32 storage (half of int64 for a large corpus); batches are cast to int64."""

    input_ids: torch.Tensor  # [Rtot, S] int32
    position_ids: torch.Tensor  # [Rtot, S] int32
    doc_ids: torch.Tensor  # [Rtot, S] int32, -1 = padding
    loss_mask: torch.Tensor  # [Rtot, S] bool
    truncated: int  # samples cut to seq_len

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]


def assign_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """First-fit: -> rows, each a list of sample indices (in order). Lengths are capped at seq_len."""
    rows: list[list[int]] = []
    free: list[int] = []
    open_rows: list[int] = []  # indices into rows that can still take a document
    for i, n in enumerate(lengths):
        n = min(n, seq_len)
        for slot, r in enumerate(open_rows):
            if free[r] >= n:
                break
        else:
            rows.append([])
            free.append(seq_len)
            r, slot = len(rows) - 1, len(open_rows)
            open_rows.append(r)
        rows[r].append(i)
        free[r] -= n
        if free[r] < _CLOSE_BELOW:
            open_rows.pop(slot)
    return rows


def pack(samples: list[Sample], seq_len: int, pad_id: int) -> PackedRows:
    lengths = [len(s.input_ids) for s in samples]
    rows = assign_rows(lengths, seq_len)
    R = len(rows)
    input_ids = torch.full((R, seq_len), pad_id, dtype=torch.int32)
    # Padding keeps row positions (never attended across documents).
    position_ids = torch.arange(seq_len, dtype=torch.int32).repeat(R, 1)
    doc_ids = torch.full((R, seq_len), -1, dtype=torch.int32)
    loss_mask = torch.zeros((R, seq_len), dtype=torch.bool)
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            n = min(lengths[i], seq_len)
            sl = slice(at, at + n)
            input_ids[r, sl] = samples[i].input_ids[:n]
            loss_mask[r, sl] = samples[i].loss_mask[:n]
            position_ids[r, sl] = torch.arange(n)
            doc_ids[r, sl] = d
            at += n
    truncated = sum(1 for n in lengths if n > seq_len)
    return PackedRows(input_ids, position_ids, doc_ids, loss_mask, truncated)
