"""The step's kernel policy, decided once in the main thread before any stepper is built (trainer/step/stepper.py):
what the compile modes compile, whether the LM head's loss GEMMs run in FP8 (`step.head_fp8`), and which CE chunk
kernel the loss uses (`step.ce`). `prepare_step` applies all three to a `TrainState`, for the sequential runner and
the pipeline alike.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer.config import StepCfg
    from trainer.model.fp8 import Fp8Head
    from trainer.step.step import TrainState


def compile_drafter(state: TrainState) -> None:
    """torch.compile (default mode, no CUDA graphs) every drafter layer and the two norms outside them (`hidden_norm`
    on the context, the final `norm`: eager, each is ~7 forward and ~10 backward passes over [rows, tokens, D]) in
    place: `Module.compile` keeps the module tree, so state_dict keys (checkpoints, export) do not change. Main thread
    only."""
    d = state.drafter
    for module in (*d.layers, d.hidden_norm, d.norm):
        module.compile(dynamic=False)


def compile_step(state: TrainState) -> None:
    """What step.mode compile / compile+graph compile (default mode, no CUDA graphs), in place, main thread only:
    every drafter layer, every (kept) target decoder layer -- run under no_grad, their tap hooks traced along -- and
    the LM-head CE chunk math (`state.ce_chunk_fn`; its eager form makes several passes over [chunk, vocab] fp32
    logits) and, for a DFlash2 drafter, the per-chunk top-k's second stage and the selector objective after its
    codebook lookups (eager, ~90 small kernels a CE chunk: key building, gathers, the candidate logits' chunks, the
    score and its CE, forward and backward).
    The matmuls stay cuBLAS calls either way; compilation fuses the norms, RoPE, SiLU and CE elementwise work."""
    from trainer.model.loss import ce_chunk_fused

    compile_drafter(state)
    for layer in state.target.model.model.layers:
        layer.compile(dynamic=False)
    # The Inductor-shaped twin of ce_chunk: two passes over the [chunk, vocab] logits instead of an fp32 softmax
    # written, scattered into and re-read (the largest elementwise cost of the step on shape (b)).
    state.ce_chunk_fn = torch.compile(ce_chunk_fused, dynamic=False)
    if state.drafter.cfg.dflash2 is not None:
        from trainer.model.selector_loss import selector_objective
        from trainer.model.topk import compiled_select

        state.topk_select_fn = compiled_select()
        state.selector_objective_fn = torch.compile(selector_objective, dynamic=False, fullgraph=True)


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


def fp8_head(step_cfg: StepCfg, head: torch.nn.Module, device: torch.device) -> Fp8Head | None:
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


def prepare_step(step_cfg: StepCfg, state: TrainState, device: torch.device) -> None:
    """Once per run, in the main thread, before the stepper is built (trainer/build.py's runner, the pipeline's
    drafter side): compile (the compile modes), build the FP8 head copies (step.head_fp8), then choose the CE chunk
    kernel (`step.ce`; auto: the Triton kernel in the compile and graph modes where it runs and the loss is DFlash's,
    the eager mode stays the PyTorch reference). Raises ConfigError where step.ce=triton or step.head_fp8 cannot
    run."""
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
