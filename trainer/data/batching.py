"""StaticBatch: the one value that crosses from the data pipeline into the training step.

Shape legend: R rows per micro-step, S tokens per row, N anchors per row. Every batch of a run has identical shapes and
dtypes, so the step can be captured once and replayed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from trainer.data.anchors import sample_anchors


@dataclass(frozen=True)
class StaticBatch:
    input_ids: torch.Tensor  # [R, S] long; padding = pad id
    position_ids: torch.Tensor  # [R, S] long; restarts at 0 for every document
    doc_ids: torch.Tensor  # [R, S] long; -1 = padding
    loss_mask: torch.Tensor  # [R, S] bool; True on assistant tokens
    anchor_pos: torch.Tensor  # [R, N] long; sorted, valid first; padded anchors point at 0
    anchor_valid: torch.Tensor  # [R, N] bool

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def signature(self) -> tuple:
        """(name, shape, dtype) of every field: equal signatures = same captured graph."""
        return tuple((k, tuple(v.shape), v.dtype) for k, v in self.tensors().items())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "StaticBatch":
        return StaticBatch(**{k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()})

    def pin_memory(self) -> "StaticBatch":
        return StaticBatch(**{k: v.pin_memory() for k, v in self.tensors().items()})

    def copy_(self, src: "StaticBatch", non_blocking: bool = False) -> "StaticBatch":
        """Copy `src` into this batch's storage in place (static device buffers for graph replay)."""
        if src.signature() != self.signature():
            raise ValueError(f"batch signature changed: {src.signature()} != {self.signature()}")
        for k, v in self.tensors().items():
            v.copy_(getattr(src, k), non_blocking=non_blocking)
        return self

    @staticmethod
    def empty(rows: int, seq_len: int, num_anchors: int, pad_id: int = 0, device="cpu") -> "StaticBatch":
        """An all-padding batch (no document, no valid anchor): contributes nothing to the loss."""
        long = dict(dtype=torch.long, device=device)
        return StaticBatch(
            input_ids=torch.full((rows, seq_len), pad_id, **long),
            position_ids=torch.arange(seq_len, device=device).repeat(rows, 1),
            doc_ids=torch.full((rows, seq_len), -1, **long),
            loss_mask=torch.zeros(rows, seq_len, dtype=torch.bool, device=device),
            anchor_pos=torch.zeros(rows, num_anchors, **long),
            anchor_valid=torch.zeros(rows, num_anchors, dtype=torch.bool, device=device),
        )


def _generator(*parts: int) -> torch.Generator:
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p) + 1) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


class EpochBatches:
    """Deterministic micro-batches: batch(micro) depends only on (seed, epoch, index, rank), so the cursor is one integer.

    Every epoch shuffles the packed rows (the same permutation on every rank) and re-samples the anchors; rank r of
    `world_size` takes the r-th slice of each group of world_size * R rows. The last micro-batch of an epoch is filled
    up with all-padding rows, so every batch on every rank has the same shapes.
    """

    def __init__(self, rows, rows_per_step: int, num_anchors: int, seed: int, pad_id: int, rank: int = 0,
                 world_size: int = 1, anchor_fraction: float | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.rows = rows
        self.R = rows_per_step
        self.N = num_anchors
        self.anchor_fraction = anchor_fraction  # None: N per row; f: ceil(f * supervised) per row, at most N
        self.seed = seed
        self.pad_id = pad_id
        self.rank = rank
        self.world = world_size
        self.per_epoch = max(1, -(-rows.num_rows // (rows_per_step * world_size)))

    def locate(self, micro: int) -> tuple[int, int]:
        """Global micro-batch counter -> (epoch, index in epoch)."""
        return divmod(micro, self.per_epoch)

    def batch(self, micro: int) -> StaticBatch:
        epoch, index = self.locate(micro)
        perm = torch.randperm(self.rows.num_rows, generator=_generator(self.seed, epoch))
        first = (index * self.world + self.rank) * self.R
        take = perm[first:first + self.R]
        pad = StaticBatch.empty(self.R - len(take), self.rows.input_ids.shape[1], self.N, self.pad_id)

        def pick(name: str) -> torch.Tensor:
            part = getattr(pad, name)
            return torch.cat([getattr(self.rows, name)[take].to(part.dtype), part])

        loss_mask, doc_ids = pick("loss_mask"), pick("doc_ids")
        anchor_gen = _generator(self.seed, epoch, index * self.world + self.rank)
        anchor_pos, anchor_valid = sample_anchors(loss_mask, doc_ids, self.N, anchor_gen, self.anchor_fraction)
        return StaticBatch(input_ids=pick("input_ids"), position_ids=pick("position_ids"), doc_ids=doc_ids,
                           loss_mask=loss_mask, anchor_pos=anchor_pos, anchor_valid=anchor_valid)
