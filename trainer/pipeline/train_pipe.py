"""The trainer's optimizer steps through the threaded pipeline (`pipeline.enabled`, CUDA only).

One ring slot = one optimizer step: `accum` micro-batches in the flat encoding of trainer/step/slots.py, plus
`"{i}.feats"` ([R, S, T*D], the target's tapped features for micro-batch i, on the drafter's device).

    loader thread    EpochBatches -> CPU step dicts (pinned), `prefetch` ahead
    producer thread  target features on the target device (eager, or one replayed CUDA graph per step)
    consumer thread  drafter step on the drafter device (its `Stepper`: a StepGraph replay, or eager), then the
                     trainer's per-step bookkeeping (LR, metrics, log, checkpoint) on the consumer's stream

Thread affinity: `build()` runs in the main thread and does every capture, compilation and first flex call there --
target device first, then the drafter device -- before `PipelinedSteps.run()` starts any thread. The threads replay.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from trainer.capture import Capture
from trainer.config import StepCfg
from trainer.data.batching import StaticBatch
from trainer.model.target import Target
from trainer.step.policy import prepare_step
from trainer.step.slots import decode_outs, encode, target_keys
from trainer.step.step import StepOut, TrainState
from trainer.step.stepper import GradSync, Stepper, build_stepper

Tensors = dict[str, torch.Tensor]


class TargetFeatures:
    """The producer's callable: {"{i}.input_ids"/"position_ids"/"doc_ids"} -> {"{i}.feats"} on the target device.

    capture=True: the `accum` target forwards are captured (main thread) as one CUDA graph over static inputs; each
    call copies its inputs in and replays on the calling thread's current stream. Outputs then alias the graph's
    static buffers (the producer copies them into the ring slot before its next call, on the same stream).
    """

    def __init__(self, target: Target, sample: Tensors, accum: int, *, capture: bool, warmup: int = 2) -> None:
        self.target, self.accum = target, accum
        self.static = {k: v.detach().clone() for k, v in sample.items()}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Tensors = {}
        cap = Capture(self.target.device)
        cap.warm_up(lambda: self._features(self.static), warmup)  # cuBLAS handles, lazy inits: on the main thread
        if capture:
            self.graph, self.outputs = cap.graph(lambda: self._features(self.static))

    def _features(self, inputs: Tensors) -> Tensors:
        return {f"{i}.feats": self.target.features(inputs[f"{i}.input_ids"], inputs[f"{i}.position_ids"],
                                                   inputs[f"{i}.doc_ids"]) for i in range(self.accum)}

    def __call__(self, inputs: Tensors) -> Tensors:
        if self.graph is None:
            return self._features(inputs)
        for k, v in inputs.items():
            self.static[k].copy_(v, non_blocking=True)
        self.graph.replay()
        return self.outputs


def drafter_side_head(state: TrainState, device: torch.device) -> None:
    """Target on another GPU: give the drafter step frozen copies of the target's embedding and LM head (the only
    target modules it touches) on its own device."""
    state.embed = copy.deepcopy(state.target.embed_tokens).to(device).requires_grad_(False)
    state.head = copy.deepcopy(state.target.lm_head).to(device).requires_grad_(False)


class ConsumerStep:
    """What the consumer thread calls once per optimizer step, inside its stream: `before()` (the LR fill), the
    drafter step, then `after(outs)` (metrics, log, checkpoint; they may sync at their cadence). Returns {"loss"}."""

    def __init__(self, stepper: Stepper, accum: int, before: Callable[[], None],
                 after: Callable[[list[StepOut]], None]) -> None:
        self.stepper, self.accum, self.before, self.after = stepper, accum, before, after

    def step(self, slot: Tensors) -> Tensors:
        self.before()
        outs = decode_outs(self.stepper.step(slot), self.accum)
        self.after(outs)
        return {"loss": outs[0].loss_}


@dataclass
class PipelinedSteps:
    """Everything captured in the main thread; `run()` drives `steps` optimizer steps through the threads."""

    target_fn: TargetFeatures
    stepper: Stepper  # trainer.step.stepper.build_stepper's
    example: Tensors
    accum: int
    target_device: torch.device
    drafter_device: torch.device
    slots: int
    prefetch: int

    def run(self, steps: int, feed: Callable[[], Iterator[Tensors]], before: Callable[[], None],
            after: Callable[[list[StepOut]], None]) -> None:
        """Raises the first thread error as RuntimeError (its cause is the original exception)."""
        from trainer.pipeline.threads import Devices, Pipeline

        consumer = ConsumerStep(self.stepper, self.accum, before, after)
        pipe = Pipeline(Devices(self.target_device, self.drafter_device), feed, self.target_fn, consumer,
                        self.example, target_keys=target_keys(self.accum), slots=self.slots, prefetch=self.prefetch)
        pipe.run(steps)


def build(state: TrainState, sample_batches: Sequence[StaticBatch], *, step: StepCfg, target_device: torch.device,
          drafter_device: torch.device, grad_sync: GradSync | None, slots: int, prefetch: int) -> PipelinedSteps:
    """Main thread, before any worker: warm up / capture the target side (target device), then the drafter side
    (`build_stepper`, warmed up here: the threads must not compile).

    Warm-up never trains: the drafter's parameters and optimizer state are put back afterwards (`build_stepper`).
    """
    accum = len(sample_batches)
    cpu = encode(sample_batches)
    prepare_step(step, state, drafter_device)  # before the target's warm-up / capture below: both sides compiled
    target_fn = TargetFeatures(state.target, {k: cpu[k].to(target_device) for k in target_keys(accum)}, accum,
                               capture=step.captures)
    with torch.no_grad():
        feats = {k: v.to(drafter_device) for k, v in target_fn({k: cpu[k].to(target_device)
                                                                for k in target_keys(accum)}).items()}
    torch.cuda.synchronize(target_device)
    example = {k: v.to(drafter_device) for k, v in cpu.items()} | feats
    if target_device != drafter_device:
        drafter_side_head(state, drafter_device)
    stepper = build_stepper(step, state, example, accum, with_feats=True, grad_sync=grad_sync, warm_up=True)
    return PipelinedSteps(target_fn=target_fn, stepper=stepper, example=example, accum=accum,
                          target_device=target_device, drafter_device=drafter_device, slots=slots, prefetch=prefetch)
