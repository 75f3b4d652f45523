"""Whole-training-step CUDA graph capture: `StepGraph`, the captured `Stepper` (trainer/step/stepper.py builds it
for the graph modes).

`StepGraph` captures one training step -- forward+backward over every micro-step, gradient clip and a capturable
optimizer step -- through trainer/capture.py (raw `torch.cuda.graph` on an explicit stream under a device guard),
and replays it.

Thread affinity. `capture()` must run in the main thread, one device after another, before any producer or worker
thread issues CUDA work. After capture, exactly one thread may call `step()` on a given `StepGraph` (graph exec objects
must not be launched concurrently); that thread may differ from the capturing one. `step()` launches on the calling
thread's current stream of the graph's device.

Gradient policy. Warm-up steps run eagerly on the capture stream, each preceded by `zero_grad(set_to_none=True)`. Right
before capture the grads are set to None again, so the captured backward *allocates* every `.grad` from the graph's
private pool (the first micro-step assigns, later micro-steps accumulate in place). Each replay therefore rewrites the
grads from scratch; nothing may zero or replace them between replays. If `sync_grads` is given (data parallel), the step
is captured as two graphs sharing one pool -- `forward_backward` then `optimizer_step` -- and `sync_grads()` runs eagerly
between the two replays (e.g. an NCCL all-reduce of the graph-owned grads, in place, on the current stream).

Warm-up does not train (by default). `capture(restore=True)` snapshots the parameters and any existing optimizer
state before the warm-up steps and copies them back in place after capture; optimizer state first created during
warm-up is zeroed in place (a fresh Adam/AdamW state: step 0, zero moments). So a captured run and an eager run that
start from the same state stay step-for-step comparable, and resuming from a checkpoint is exact.

Learning rate. The optimizer must be built with `capturable=True` and a device tensor `lr`; change the LR only in
place (`set_lr`), never by assigning a float (a float is baked into the graph at capture).

Liveness. The graph stores raw addresses. `StepGraph` keeps strong references to the model parameters, their grads,
the optimizer (and so its state), the static inputs and the static outputs for as long as it lives. Callers must not
re-create optimizer state, reload parameters by re-allocation, or resize anything a graph touches; to change any of
that, drop this `StepGraph` and capture a new one.

Aliasing contract of `step()`: the returned tensors are the graph's static outputs. They are overwritten in place by the
next replay; clone them (or read them, after an event, before the next `step()`) if they must survive.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from trainer.capture import Capture

Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class InputSpec:
    """What a static input buffer holds; every `step()` input is checked against it before the copy."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> "InputSpec":
        return InputSpec(tuple(t.shape), t.dtype, t.device)


def check_inputs(specs: Mapping[str, InputSpec], inputs: Tensors) -> None:
    """Raise ValueError (naming the field and the fix) if `inputs` do not match `specs` in names, shapes and dtypes.
    Pure, no sync."""
    missing, extra = sorted(set(specs) - set(inputs)), sorted(set(inputs) - set(specs))
    if missing or extra:
        raise ValueError(f"step inputs mismatch: missing {missing}, unexpected {extra}")
    for name, spec in specs.items():
        got = InputSpec.of(inputs[name])
        if got.shape != spec.shape or got.dtype != spec.dtype:
            raise ValueError(
                f"step input {name!r}: got {tuple(got.shape)} {got.dtype}, graph was captured for "
                f"{spec.shape} {spec.dtype}; pad the batch to the captured shape or capture a new StepGraph"
            )
        # Any device is accepted: the copy into the static buffer is explicit (async from pinned host memory or
        # another GPU; a pageable host tensor makes that one copy synchronous, never the graph).


Snapshot = tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]


def snapshot_training_state(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> Snapshot:
    """Clones of the parameters and of every existing optimizer-state tensor (device memory: one more model copy)."""
    state = {
        id(p): {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)} for p, st in optimizer.state.items()
    }
    return [p.detach().clone() for p in params], state


@torch.no_grad()
def restore_training_state(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, snap: Snapshot) -> None:
    """Copy a snapshot back IN PLACE (graphs keep their addresses); state created since is zeroed (fresh AdamW)."""
    saved_params, saved_state = snap
    for p, saved in zip(params, saved_params):
        p.copy_(saved)
    for p, st in optimizer.state.items():
        before = saved_state.get(id(p), {})
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                v.copy_(before[k]) if k in before else v.zero_()


class StepGraph:
    """One captured training step on one device. See the module docstring for the full contract.

    forward_backward(inputs) -> outputs: runs every micro-step's forward and backward over the static `inputs`
        (a dict of tensors it must only read), returning a dict of output tensors (loss, accuracy, ...). It must not
        zero or replace grads, sync with the host, or branch on tensor values.
    optimizer_step() -> outputs: gradient clip + `optimizer.step()`; returns a dict (e.g. the grad norm).
    sync_grads: optional eager callback run between the two graphs (data-parallel gradient all-reduce).
    """

    def __init__(
        self,
        forward_backward: Callable[[Tensors], Tensors],
        optimizer_step: Callable[[], Tensors],
        params: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        sample_inputs: Tensors,
        *,
        sync_grads: Callable[[], None] | None = None,
        warmup_steps: int = 3,
        capture_error_mode: str = "thread_local",
    ) -> None:
        if warmup_steps < 1:
            raise ValueError("warmup_steps must be >= 1 (optimizer state and autotuning must exist before capture)")
        for group in optimizer.param_groups:
            if not group.get("capturable", False):
                raise ValueError("optimizer must be built with capturable=True to be captured")
            if not isinstance(group["lr"], torch.Tensor):
                raise ValueError("optimizer lr must be a device tensor (lr=torch.tensor(x, device=d)); a float is baked in")
        devices = {t.device for t in sample_inputs.values()} | {p.device for p in params}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"StepGraph needs params and inputs on one CUDA device, got {sorted(map(str, devices))}")
        self.device = next(iter(devices))
        self._forward_backward = forward_backward
        self._optimizer_step = optimizer_step
        self._sync_grads = sync_grads
        self._params = list(params)
        self._optimizer = optimizer
        self._warmup_steps = warmup_steps
        self._capture_error_mode = capture_error_mode
        # Static inputs: own copies, so callers can reuse or free theirs.
        self.static_inputs: dict[str, torch.Tensor] = {k: v.detach().clone() for k, v in sample_inputs.items()}
        self.specs = {k: InputSpec.of(v) for k, v in self.static_inputs.items()}
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._outputs: dict[str, torch.Tensor] = {}
        self._grads: list[torch.Tensor | None] = []

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def _eager_step(self) -> dict[str, torch.Tensor]:
        self._optimizer.zero_grad(set_to_none=True)
        out = dict(self._forward_backward(self.static_inputs))
        if self._sync_grads is not None:
            self._sync_grads()
        out.update(self._optimizer_step())
        return out

    def capture(self, restore: bool = True) -> None:
        """Warm up, then capture (trainer/capture.py). Main thread only, nothing else issuing CUDA work.

        restore: put parameters and optimizer state back to their pre-warm-up values afterwards (module docstring).
        """
        if self.captured:
            raise RuntimeError("StepGraph.capture() called twice; build a new StepGraph to re-capture")
        snap = snapshot_training_state(self._params, self._optimizer) if restore else None
        cap = Capture(self.device, self._capture_error_mode)
        cap.warm_up(self._eager_step, self._warmup_steps)
        self._optimizer.zero_grad(set_to_none=True)  # captured backward allocates .grad in the graph pool
        if self._sync_grads is None:
            def whole() -> dict[str, torch.Tensor]:
                out = dict(self._forward_backward(self.static_inputs))
                out.update(self._optimizer_step())
                return out

            g, out = cap.graph(whole)
            self._graphs = [g]
        else:
            g_fb, out = cap.graph(lambda: dict(self._forward_backward(self.static_inputs)))
            # Same pool and stream: g_opt is always replayed right after g_fb, never concurrently.
            g_opt, opt_out = cap.graph(lambda: dict(self._optimizer_step()), pool=g_fb.pool())
            out.update(opt_out)
            self._graphs = [g_fb, g_opt]
        if snap is not None:
            with torch.cuda.device(self.device):
                restore_training_state(self._params, self._optimizer, snap)
                torch.cuda.synchronize(self.device)
        self._outputs = out
        self._grads = [p.grad for p in self._params]  # graph-owned; referenced so they outlive any zero_grad
        missing = [i for i, gr in enumerate(self._grads) if gr is None]
        if missing:
            raise RuntimeError(f"{len(missing)} trainable parameters got no grad in the captured step (first: #{missing[0]})")

    def load_inputs(self, inputs: Tensors) -> None:
        """Validate, then copy `inputs` into the static buffers on the calling thread's current stream (async)."""
        check_inputs(self.specs, inputs)
        for name, src in inputs.items():
            dst = self.static_inputs[name]
            if src.data_ptr() != dst.data_ptr():  # a producer may write straight into the static buffer
                dst.copy_(src, non_blocking=True)

    def replay(self) -> dict[str, torch.Tensor]:
        """Replay the captured step on the calling thread's current stream; returns the graph-owned outputs."""
        if not self.captured:
            raise RuntimeError("StepGraph.replay() before capture()")
        self._graphs[0].replay()
        if self._sync_grads is not None:
            self._sync_grads()
            self._graphs[1].replay()
        return self._outputs

    def step(self, inputs: Tensors) -> dict[str, torch.Tensor]:
        """`load_inputs(inputs)` then `replay()`. Outputs alias graph memory (see the module docstring)."""
        self.load_inputs(inputs)
        return self.replay()

    def set_lr(self, lr: float) -> None:
        """Update every param group's LR tensor in place (async H2D fill; safe between replays)."""
        for group in self._optimizer.param_groups:
            group["lr"].fill_(lr)
