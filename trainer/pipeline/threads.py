"""Threaded training pipeline: loader (CPU) -> target producer (GPU a) -> drafter consumer (GPU b, may equal a).

    loader thread    builds/pins CPU batches ahead of time (bounded queue)
    producer thread  H2D copies, target forward (eager, compiled or a replayed graph) -> ring slot on the drafter device
    consumer thread  ring slot -> drafter step (`StepGraph` replay or `EagerStep`) -> next slot
The hand-off is `SlotRing` (preallocated slots + CUDA events): no host-device sync anywhere on the hot path; the only
syncs are the final `synchronize()` and whatever `on_interval` does (it gets no tensors, only the step number).

Thread affinity (trainer/capture.py): everything that compiles or captures -- the target graph, the
StepGraph, the first flex call -- happens in the main thread BEFORE `run()` starts the threads; the threads only
replay. Each thread sets its device and uses its own streams.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from trainer.pipeline.ring import SlotRing

Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Devices:
    """The torch devices the target runs on and the drafter trains on (resolved from the config's placement,
    `trainer.placement.Placement`, which holds their names and the process group backend)."""

    target: torch.device
    drafter: torch.device


@dataclass(frozen=True)
class PipelineResult:
    losses: list[float]
    step_s: list[float]  # consumer-side device time between consecutive step ends (event pairs)
    elapsed_s: float


class Pipeline:
    """Runs `steps` training steps through the three threads. See the module docstring.

    batches: yields CPU dicts of step inputs (every slot field the target does not produce).
    target_fn({name: tensor on placement.target for name in target_keys}) -> {slot field: tensor on placement.target}
        (may be a graph's static outputs: they are copied into the slot on the producer's stream before its next call).
    step: object with `.step(inputs) -> outputs` (StepGraph or EagerStep) for placement.drafter; outputs has "loss".
    example: one full step-input dict (batch fields + target outputs) giving the ring slots' shapes and dtypes.
    """

    def __init__(self, placement: Devices, batches: Callable[[], Iterator[Tensors]],
                 target_fn: Callable[[Tensors], Tensors], step, example: Tensors, *,
                 target_keys: tuple[str, ...] = ("input_ids",), slots: int = 3, prefetch: int = 4,
                 on_interval: Callable[[int], None] | None = None, interval: int = 10) -> None:
        self.placement, self.batches, self.target_fn, self.step = placement, batches, target_fn, step
        self.target_keys = target_keys
        self.ring = SlotRing(slots, example, placement.drafter)
        self.prefetch, self.on_interval, self.interval = prefetch, on_interval, interval
        self._errors: list[BaseException] = []

    def _guard(self, fn):
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:  # surfaced in run(); the other side is woken so nothing hangs
                self._errors.append(e)
                self.ring.abort()
        return run

    def _loader(self, out: queue.Queue, steps: int) -> None:
        it = self.batches()
        for _ in range(steps):
            out.put({k: v.pin_memory() for k, v in next(it).items()})
        out.put(None)

    def _producer(self, inq: queue.Queue) -> None:
        a, b = self.placement.target, self.placement.drafter
        torch.cuda.set_device(a)
        s_a = torch.cuda.Stream(device=a)
        s_b = s_a if a == b else torch.cuda.Stream(device=b)
        while (batch := inq.get()) is not None:
            k = self.ring.acquire(s_b)
            if k is None:
                return
            slot = self.ring.slots[k]
            with torch.cuda.stream(s_a):
                made = self.target_fn({n: batch[n].to(a, non_blocking=True) for n in self.target_keys})
                for name, t in made.items():
                    if a == b:
                        slot[name].copy_(t, non_blocking=True)
                    else:
                        with torch.cuda.stream(s_b):  # both current streams set: Copy.cu orders the peer copy on both
                            slot[name].copy_(t, non_blocking=True)
            with torch.cuda.device(b), torch.cuda.stream(s_b):
                for name, src in batch.items():
                    slot[name].copy_(src, non_blocking=True)  # pinned host -> device, async
            self.ring.publish(k, s_b)

    def _consumer(self, steps: int, losses: torch.Tensor, ends: list[torch.cuda.Event]) -> None:
        dev = self.placement.drafter
        torch.cuda.set_device(dev)
        s = torch.cuda.Stream(device=dev)
        for i in range(steps):
            item = self.ring.take(s)
            if item is None:
                return
            k, slot, _ = item
            with torch.cuda.stream(s):
                out = self.step.step(slot)
                losses[i].copy_(out["loss"])  # graph-owned output: copy before the next replay
                ends[i].record(s)
            self.ring.release(k, s)
            if self.on_interval is not None and (i + 1) % self.interval == 0:
                self.on_interval(i + 1)

    def run(self, steps: int) -> PipelineResult:
        """Run `steps` steps (threads started and joined here). Reusable after a successful run, not after a failure."""
        import time

        if self._errors:
            raise RuntimeError("this Pipeline already failed; build a new one") from self._errors[0]

        dev = self.placement.drafter
        losses = torch.zeros(steps, device=dev)
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        inq: queue.Queue = queue.Queue(maxsize=self.prefetch)
        threads = [
            threading.Thread(target=self._guard(self._loader), args=(inq, steps), name="loader", daemon=True),
            threading.Thread(target=self._guard(self._producer), args=(inq,), name="producer", daemon=True),
            threading.Thread(target=self._guard(self._consumer), args=(steps, losses, ends), name="consumer",
                             daemon=True),
        ]
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join()
        if self._errors:
            raise RuntimeError(f"pipeline thread failed: {self._errors[0]!r}") from self._errors[0]
        torch.cuda.synchronize(dev)  # the one sync: end of run
        elapsed = time.perf_counter() - t0
        step_s = [ends[i].elapsed_time(ends[i + 1]) / 1e3 for i in range(steps - 1)]
        return PipelineResult(losses=losses.tolist(), step_s=step_s, elapsed_s=elapsed)
