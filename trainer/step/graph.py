"""Whole-training-step CUDA graph capture (StepGraph) and the trainer-loop runner built on it (GraphRunner).

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


class EagerStep:
    """The uncaptured twin of `StepGraph` (same call shape) for the `eager` and `compile` modes and for tests.

    Each `step()` zeroes grads (set_to_none), runs forward_backward, sync_grads and optimizer_step eagerly on the
    current stream. `inputs` are used directly, not copied.
    """

    def __init__(
        self,
        forward_backward: Callable[[Tensors], Tensors],
        optimizer_step: Callable[[], Tensors],
        optimizer: torch.optim.Optimizer,
        *,
        sync_grads: Callable[[], None] | None = None,
    ) -> None:
        self._forward_backward = forward_backward
        self._optimizer_step = optimizer_step
        self._optimizer = optimizer
        self._sync_grads = sync_grads

    def step(self, inputs: Tensors) -> dict[str, torch.Tensor]:
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


# --- Runner for the trainer loop (trainer/train.py: `outs = runner.step(micro_batches)` once per optimizer step) ----


def compile_drafter(state) -> None:
    """torch.compile (default mode, no CUDA graphs) every drafter layer and the two norms outside them (`hidden_norm`
    on the context, the final `norm`: eager, each is ~7 forward and ~10 backward passes over [rows, tokens, D]) in
    place: `Module.compile` keeps the module tree, so state_dict keys (checkpoints, export) do not change. Main thread
    only."""
    d = state.drafter
    for module in (*d.layers, d.hidden_norm, d.norm):
        module.compile(dynamic=False)


def compile_step(state) -> None:
    """What step.mode compile / compile+graph compile (default mode, no CUDA graphs), in place, main thread only:
    every drafter layer, every (kept) target decoder layer -- run under no_grad, their tap hooks traced along -- and
    the LM-head CE chunk math (`state.ce_chunk_fn`; its eager form makes several passes over [chunk, vocab] fp32
    logits).
    The matmuls stay cuBLAS calls either way; compilation fuses the norms, RoPE, SiLU and CE elementwise work."""
    from trainer.model.loss import ce_chunk_fused

    compile_drafter(state)
    for layer in state.target.model.model.layers:
        layer.compile(dynamic=False)
    # The Inductor-shaped twin of ce_chunk: two passes over the [chunk, vocab] logits instead of an fp32 softmax
    # written, scattered into and re-read (the largest elementwise cost of the step on shape (b)).
    state.ce_chunk_fn = torch.compile(ce_chunk_fused, dynamic=False)


def slot_step(state, accum: int, *, with_feats: bool = False):
    """(forward_backward(inputs) -> outputs, optimizer_step() -> outputs) over one step's flat inputs
    (trainer/step/slots.py), as StepGraph and EagerStep take them. with_feats: the target's features come in the
    inputs ("{i}.feats", computed by the pipeline's producer) instead of being computed in the step."""
    from trainer.step.slots import encode_out, micro_batch
    from trainer.step.step import forward_backward, optimizer_step

    scale = 1.0 / accum

    def fwd_bwd(inputs):
        out = {}
        for i in range(accum):
            feats = inputs[f"{i}.feats"] if with_feats else None
            out.update(encode_out(i, forward_backward(state, micro_batch(inputs, i), scale, feats=feats)))
        return out

    return fwd_bwd, lambda: {"grad_norm": optimizer_step(state)}


class GraphRunner:
    """The trainer's whole optimizer step -- `accum` micro-steps (target features, drafter forward + backward), clip
    and AdamW -- as one `StepGraph`, over `accum` static copies of the device batch.

    Same contract as `trainer.step.step.EagerRunner.step`: takes the step's CPU micro-batches, returns one StepOut per
    micro-batch. Differences: the returned StepOuts alias graph-owned memory (valid until the next `step`; the
    trainer's DeviceMetrics.add consumes them at once), and the grad policy is StepGraph's (set_to_none before
    capture, grads rewritten by every replay; nothing else may zero them). Warm-up does not train (StepGraph restores
    parameters and optimizer state), so a graph run follows an eager run step for step.
    Thread affinity: construct (capture) in the main thread before any other thread runs CUDA work.
    grad_sync: optional eager callback between the forward/backward and the update graphs (data-parallel all-reduce).
    """

    def __init__(self, state, batch_dev, accum_steps: int, *, warmup_steps: int = 3, grad_sync=None) -> None:
        from trainer.step.slots import encode

        self.state, self.accum = state, accum_steps
        params = [p for p in state.drafter.parameters() if p.requires_grad]
        fwd_bwd, opt_step = slot_step(state, accum_steps)
        self.graph = StepGraph(fwd_bwd, opt_step, params, state.optimizer, encode([batch_dev] * accum_steps),
                               sync_grads=grad_sync, warmup_steps=warmup_steps)
        self.graph.capture(restore=True)

    def step(self, micro_batches):
        from trainer.step.slots import decode_outs, encode

        if len(micro_batches) != self.accum:
            raise ValueError(f"expected {self.accum} micro-batches, got {len(micro_batches)}")
        return decode_outs(self.graph.step(encode(micro_batches)), self.accum)


def fp8_head_unmet(head: torch.nn.Module, device: torch.device) -> str | None:
    """Why the FP8 tensor cores cannot run this LM head's GEMMs on `device`, or None when they can (the last check
    runs one tiny FP8 matmul there)."""
    from trainer.model import fp8

    vocab, hidden = head.weight.shape
    if vocab % 16 or hidden % 16:
        return (f"the LM head's vocabulary and hidden size divisible by 16 (FP8 tensor cores); this target's are "
                f"{vocab} and {hidden}")
    if head.weight.dtype != torch.bfloat16:
        return (f"a bf16 LM head (model.dtype=bfloat16; the FP8 products write bf16); this one is "
                f"{str(head.weight.dtype).replace('torch.', '')}")
    if not fp8.fp8_supported(device):
        return f"FP8 tensor cores (CUDA compute capability 9.0+); the step runs on {device}"
    error = fp8.rowwise_matmul_error(device)
    if error is not None:
        return f"row-wise FP8 matmuls, which this torch cannot run on {device}: {error}"
    return None


def fp8_head(step_cfg, head: torch.nn.Module, device: torch.device):
    """step.head_fp8 -> the frozen LM head's `Fp8Head`, or None: auto where it can run (not in the eager reference
    mode), true or ConfigError."""
    from trainer.errors import ConfigError
    from trainer.model.fp8 import Fp8Head

    wanted = step_cfg.head_fp8
    if wanted is False or (wanted == "auto" and step_cfg.eager):
        return None
    unmet = fp8_head_unmet(head, device)
    if unmet is not None:
        if wanted == "auto":
            return None
        raise ConfigError(f"step.head_fp8 needs {unmet}", hint="--set step.head_fp8=false")
    # On the step's device: with the target on another GPU (pipeline placement), prepare_step runs before the
    # drafter side gets its own copy of the head.
    return Fp8Head(head.weight.detach().to(device))


def prepare_step(step_cfg, state, device: torch.device) -> None:
    """What every runner does first, in the main thread: compile (the compile modes), build the FP8 head copies
    (step.head_fp8), then choose the CE chunk kernel (`step.ce`; auto: the Triton kernel in the compile and graph
    modes where it runs and the loss is DFlash's, the eager mode stays the PyTorch reference). Raises ConfigError
    where step.ce=triton or step.head_fp8 cannot run."""
    from trainer.errors import ConfigError
    from trainer.model import ce_kernel

    if step_cfg.compiles:
        compile_step(state)
    state.head_fp8 = fp8_head(step_cfg, state.lm_head, device)
    usable = ce_kernel.usable_on(device)
    if step_cfg.ce == "triton" and not usable:
        raise ConfigError(f"step.ce=triton needs a CUDA device and Triton (this step runs on {device.type})",
                          hint="--set step.ce=auto")
    if state.loss_kind != "dflash":  # D-PACE reweights each chunk by its own CE before the gradient: torch math only
        if step_cfg.ce == "triton":
            raise ConfigError(f"step.ce=triton computes the DFlash loss only, not loss.kind={state.loss_kind}",
                              hint="--set step.ce=auto")
        return
    if step_cfg.ce == "triton" or (step_cfg.ce == "auto" and usable and not step_cfg.eager):
        state.ce_chunk_fn = ce_kernel.ce_chunk_triton


def make_runner(step_cfg, state, batch_dev, accum_steps: int, *, grad_sync=None):
    """The runner for the step mode (trainer/build.py): EagerRunner, compiled first when the mode compiles, or a
    GraphRunner when it captures. Main thread, before any worker."""
    from trainer.step.step import EagerRunner

    prepare_step(step_cfg, state, batch_dev.input_ids.device)
    if step_cfg.captures:
        return GraphRunner(state, batch_dev, accum_steps, grad_sync=grad_sync)
    return EagerRunner(state, batch_dev, accum_steps, grad_sync=grad_sync)
