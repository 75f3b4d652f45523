"""The optimizer step as the trainer drives it: one `Stepper` protocol, eager or captured, and `build_stepper`, the
one place that picks between them, used by the sequential runner (`Runner`, built by trainer/build.py) and by the
threaded pipeline's consumer (trainer/pipeline/train_pipe.py) alike.

A stepper runs one optimizer step over the flat encoding of the step's micro-batches (trainer/step/slots.py): every
micro-step's forward + backward (grads accumulate, each scaled by 1/accum), the data-parallel gradient average, then
clip + AdamW. It returns the flat StepOut encoding: device tensors, no host sync; a captured stepper's outputs alias
graph memory until its next step. Grad policy, both kinds: every step starts from grads set to None (the eager
stepper sets them so; the captured one allocated them from its pool, and each replay rewrites them).

Main thread: `build_stepper` (after `trainer.step.policy.prepare_step`) compiles, warms up and captures before any
worker thread runs; afterwards one thread at a time calls `step`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from trainer.data.batching import StaticBatch
from trainer.step.graph import StepGraph, restore_training_state, snapshot_training_state
from trainer.step.slots import decode_outs, encode, encode_out, micro_batch
from trainer.step.step import StepOut, TrainState, forward_backward, optimizer_step

if TYPE_CHECKING:
    from trainer.config import StepCfg

Tensors = Mapping[str, torch.Tensor]
GradSync = Callable[[], None]  # the data-parallel gradient average (trainer.distributed.make_grad_sync)


class Stepper(Protocol):
    """One optimizer step over one step's flat inputs (on any device: the stepper brings them to its own) -> the
    flat outputs ("{i}.loss_", "{i}.correct_by_pos_", "{i}.valid_by_pos_", "grad_norm")."""

    def step(self, inputs: Tensors) -> dict[str, torch.Tensor]: ...


class EagerStep:
    """The uncaptured stepper (`eager` and `compile` modes), the twin of `StepGraph` with the same call shape.

    Each `step()` sets grads to None, runs forward_backward, sync_grads and optimizer_step eagerly on the current
    stream. `inputs` already on `device` (or all of them when `device` is None) are used directly, not copied; others
    are copied there (async from pinned memory).
    """

    def __init__(self, forward_backward: Callable[[Tensors], Tensors], optimizer_step: Callable[[], Tensors],
                 optimizer: torch.optim.Optimizer, *, sync_grads: GradSync | None = None,
                 device: torch.device | None = None) -> None:
        self._forward_backward = forward_backward
        self._optimizer_step = optimizer_step
        self._optimizer = optimizer
        self._sync_grads = sync_grads
        self.device = device

    def step(self, inputs: Tensors) -> dict[str, torch.Tensor]:
        if self.device is not None:
            inputs = {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}  # no copy when already there
        self._optimizer.zero_grad(set_to_none=True)
        out = dict(self._forward_backward(inputs))
        if self._sync_grads is not None:
            self._sync_grads()
        out.update(self._optimizer_step())
        return out

    def set_lr(self, lr: float) -> None:
        for group in self._optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr


def slot_step(state: TrainState, accum: int, *, with_feats: bool = False
              ) -> tuple[Callable[[Tensors], dict[str, torch.Tensor]], Callable[[], dict[str, torch.Tensor]]]:
    """(forward_backward(inputs) -> outputs, optimizer_step() -> outputs) over one step's flat inputs
    (trainer/step/slots.py), as StepGraph and EagerStep take them. with_feats: the target's features come in the
    inputs ("{i}.feats", computed by the pipeline's producer) instead of being computed in the step."""
    scale = 1.0 / accum

    def fwd_bwd(inputs: Tensors) -> dict[str, torch.Tensor]:
        out = {}
        for i in range(accum):
            feats = inputs[f"{i}.feats"] if with_feats else None
            out.update(encode_out(i, forward_backward(state, micro_batch(inputs, i), scale, feats=feats)))
        return out

    return fwd_bwd, lambda: {"grad_norm": optimizer_step(state)}


def build_stepper(step_cfg: StepCfg, state: TrainState, example: Tensors, accum: int, *, with_feats: bool = False,
                  grad_sync: GradSync | None = None, warm_up: bool = False) -> Stepper:
    """The stepper of `step.mode`, in the main thread, after `prepare_step`: a `StepGraph` where the mode captures
    (warmed up and captured here; parameters and optimizer state put back afterwards, so warm-up does not train),
    else an `EagerStep`.

    example: one step's flat inputs on the step's device (their shapes and dtypes are the step's; a graph copies
    them into its static inputs). warm_up (the pipeline, whose worker threads must not compile): the eager stepper
    also runs one step here -- compilation, the first flex call and autotuning happen now -- and the training state
    is put back the same way. CUDA only."""
    fwd_bwd, opt_step = slot_step(state, accum, with_feats=with_feats)
    params = [p for p in state.drafter.parameters() if p.requires_grad]
    if step_cfg.captures:
        graph = StepGraph(fwd_bwd, opt_step, params, state.optimizer, example, sync_grads=grad_sync)
        graph.capture(restore=True)
        return graph
    device = next(iter(example.values())).device
    stepper = EagerStep(fwd_bwd, opt_step, state.optimizer, sync_grads=grad_sync, device=device)
    if warm_up:
        snap = snapshot_training_state(params, state.optimizer)
        with torch.cuda.device(device):
            stepper.step(example)
            torch.cuda.synchronize(device)
            restore_training_state(params, state.optimizer, snap)
            torch.cuda.synchronize(device)
    return stepper


class Runner:
    """What the sequential training loop drives (trainer/loop.py): one optimizer step over its CPU micro-batches
    through the session's stepper -> one StepOut per micro-batch (device tensors, no sync; from a captured stepper
    they alias graph memory until the next step: the loop's DeviceMetrics.add consumes them at once)."""

    def __init__(self, stepper: Stepper, accum: int) -> None:
        self.stepper, self.accum = stepper, accum

    def step(self, micro_batches: Sequence[StaticBatch]) -> list[StepOut]:
        if len(micro_batches) != self.accum:
            raise ValueError(f"expected {self.accum} micro-batches, got {len(micro_batches)}")
        return decode_outs(self.stepper.step(encode(micro_batches)), self.accum)
