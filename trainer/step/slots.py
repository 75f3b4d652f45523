"""The flat encoding of one optimizer step's micro-batches, as a graph's static inputs and a pipeline ring slot hold
them: "{i}.{field}" for micro-batch i's StaticBatch fields (plus "{i}.feats" when a producer computed the target's
features), and "{i}.loss_" / "{i}.correct_by_pos_" / "{i}.valid_by_pos_" for its StepOut. Pure."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from trainer.data.batching import StaticBatch
from trainer.step.step import StepOut

TARGET_FIELDS = ("input_ids", "position_ids", "doc_ids")  # what the target's forward reads of a micro-batch
OUT_FIELDS = ("loss_", "correct_by_pos_", "valid_by_pos_")

Tensors = Mapping[str, torch.Tensor]


def encode(micro_batches: Sequence[StaticBatch]) -> dict[str, torch.Tensor]:
    """One optimizer step's micro-batches -> the flat dict."""
    return {f"{i}.{k}": v for i, mb in enumerate(micro_batches) for k, v in mb.tensors().items()}


def micro_batch(inputs: Tensors, i: int) -> StaticBatch:
    return StaticBatch(**{f.name: inputs[f"{i}.{f.name}"] for f in dataclasses.fields(StaticBatch)})


def target_keys(accum: int) -> tuple[str, ...]:
    return tuple(f"{i}.{f}" for i in range(accum) for f in TARGET_FIELDS)


def encode_out(i: int, out: StepOut) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": getattr(out, name) for name in OUT_FIELDS}


def decode_outs(outputs: Tensors, accum: int) -> list[StepOut]:
    return [StepOut(**{name: outputs[f"{i}.{name}"] for name in OUT_FIELDS}) for i in range(accum)]
