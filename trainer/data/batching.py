"""StaticBatch: the one value that crosses from the data pipeline into the training step.

Shape legend: R rows per micro-step, S tokens per row, N anchors per row. Every batch of a run has identical shapes and
dtypes, so the step can be captured once and replayed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


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
