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
    """First-fit: -> rows, each a list of sample indices (in order). Lengths are capped at seq_len.

    Each sample goes to the first open row (in the order the rows were opened) with room for it; a row closes once
    fewer than _CLOSE_BELOW tokens are free. The first such row is found in a max-tree over the rows' free tokens, in
    O(log rows): a scan of the open rows is quadratic, as rows that keep a few free tokens stay open."""
    rows: list[list[int]] = []
    free = _FreeTree()
    for i, n in enumerate(lengths):
        n = min(n, seq_len)
        r = free.first_at_least(n)
        if r is None:
            rows.append([])
            r = free.open(seq_len)
        rows[r].append(i)
        left = free.take(r, n)
        if left < _CLOSE_BELOW:
            free.close(r)
    return rows


class _FreeTree:
    """Free tokens per row (rows numbered as opened; a closed row reads -1) in a binary max-tree whose leaves are
    the rows, doubled in size as rows are opened."""

    def __init__(self) -> None:
        self.size = 1  # leaves
        self.rows = 0
        self.node = [-1, -1]  # node[1] is the root, node[size + r] row r's leaf

    def first_at_least(self, n: int) -> int | None:
        """The first row with at least n free tokens, or None."""
        node = self.node
        if node[1] < n:
            return None
        at = 1
        while at < self.size:
            at = 2 * at if node[2 * at] >= n else 2 * at + 1
        return at - self.size

    def open(self, free: int) -> int:
        if self.rows == self.size:
            leaves = self.node[self.size:] + [-1] * self.size
            self.size *= 2
            self.node = [-1] * self.size + leaves
            for at in range(self.size - 1, 0, -1):
                self.node[at] = max(self.node[2 * at], self.node[2 * at + 1])
        r, self.rows = self.rows, self.rows + 1
        self._set(r, free)
        return r

    def take(self, r: int, n: int) -> int:
        """Row r loses n free tokens -> what it has left."""
        left = self.node[self.size + r] - n
        self._set(r, left)
        return left

    def close(self, r: int) -> None:
        self._set(r, -1)

    def _set(self, r: int, value: int) -> None:
        node = self.node
        at = self.size + r
        node[at] = value
        at //= 2
        while at:
            best = max(node[2 * at], node[2 * at + 1])
            if node[at] == best:
                break  # the ancestors above already hold the right maxima
            node[at] = best
            at //= 2


def pack(samples: list[Sample], seq_len: int, pad_id: int) -> PackedRows:
    lengths = [min(s.input_ids.shape[0], seq_len) for s in samples]
    rows = assign_rows(lengths, seq_len)
    R = len(rows)
    input_ids = torch.full((R, seq_len), pad_id, dtype=torch.int32)
    # Padding keeps row positions (never attended across documents).
    position_ids = torch.arange(seq_len, dtype=torch.int32).repeat(R, 1)
    doc_ids = torch.full((R, seq_len), -1, dtype=torch.int32)
    loss_mask = torch.zeros((R, seq_len), dtype=torch.bool)
    if R:
        # Every sample's tokens go to one flat slice of the [R, S] storage: one scatter per field, not a Python
        # loop over samples.
        order, starts, docs = [], [], []
        for r, members in enumerate(rows):
            at = r * seq_len
            for d, i in enumerate(members):
                order.append(i)
                starts.append(at)
                docs.append(d)
                at += lengths[i]
        n = torch.tensor([lengths[i] for i in order])
        first = torch.cumsum(n, 0) - n  # where each sample starts in the concatenation
        within = torch.arange(int(n.sum())) - torch.repeat_interleave(first, n)
        dest = torch.repeat_interleave(torch.tensor(starts), n) + within

        def cut(t: torch.Tensor) -> torch.Tensor:  # a slice only where a sample is truncated: slices cost ~µs each
            return t if t.shape[0] <= seq_len else t[:seq_len]

        input_ids.view(-1)[dest] = torch.cat([cut(samples[i].input_ids) for i in order]).to(torch.int32)
        loss_mask.view(-1)[dest] = torch.cat([cut(samples[i].loss_mask) for i in order])
        position_ids.view(-1)[dest] = within.to(torch.int32)
        doc_ids.view(-1)[dest] = torch.repeat_interleave(torch.tensor(docs, dtype=torch.int32), n)
    truncated = sum(1 for s in samples if s.input_ids.shape[0] > seq_len)
    return PackedRows(input_ids, position_ids, doc_ids, loss_mask, truncated)
