"""The training step contract: capture-friendly forward/backward and optimizer step.

Contract for both functions (what makes them CUDA-graph capturable, trainer/step/graph.py):
- inputs are a StaticBatch already on the device (static buffers) and the state; shapes never change within a run;
- no `.item()`, no `.tolist()`, no print, no Python branching on tensor values, no host-to-device copies;
- outputs are device tensors (StepOut); under graph replay they alias graph-owned storage, so callers clone
  (or accumulate into their own buffers) before the next replay.

One optimizer step (trainer/step/stepper.py drives them, eager or captured): lr_.fill_(schedule(step)) -> accum x
forward_backward (grads accumulate into .grad; nothing here zeroes them) -> optimizer_step.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.data.batching import StaticBatch
from trainer.model.attention import BlockLayout, make_layout
from trainer.model.drafter import Drafter
from trainer.model.loss import DPace, block_input_ids, block_labels, chunked_lm_loss, decay_weights, dpace_scale
from trainer.model.selector_loss import selector_loss
from trainer.model.target import Target


@dataclass
class TrainState:
    """Everything the step touches. Mutable objects, fixed identity for the whole run (graphs hold raw addresses)."""

    target: Target  # frozen
    drafter: Drafter
    optimizer: torch.optim.Optimizer
    lr_: torch.Tensor  # 0-d fp32 device tensor; the schedule fills it in place
    block_size: int
    gamma: float
    loss_chunk: int
    clip: float
    attn: str = "sdpa"
    # Backend mask builder (see model/attention.make_layout); None = dense sdpa mask. The flex runner sets it to
    # update its static FlexBlockMask in place and return it.
    mask_fn: Callable[[BlockLayout], Any] | None = None
    # Frozen copies of the target's embedding and LM head on the drafter's device, when the target runs on another
    # GPU (pipeline placement); None = use the target's own.
    embed: torch.nn.Module | None = None
    head: torch.nn.Module | None = None
    # The LM-head CE chunk math (trainer.model.loss.ce_chunk contract); None = eager. trainer.step.policy.prepare_step
    # sets the Triton kernel (step.ce) or, in the compile modes, a torch.compile'd copy.
    ce_chunk_fn: Callable | None = None
    # step.head_fp8: the LM head's FP8 copies (trainer.model.fp8.Fp8Head), set by prepare_step; None = its dtype.
    head_fp8: Any = None
    # The objective (config `loss`): "dflash" (decay weights, gamma) or "dpace" (dpace_alpha, dpace_norm).
    loss_kind: str = "dflash"
    dpace_alpha: float = 0.5
    dpace_norm: str = "rows"
    # A DFlash2 drafter's selector objective (trainer/model/selector_loss.py): its weight, a 0-d fp32 device tensor the
    # schedule fills before every step as it fills lr_ (None: a DFlash drafter, no selector term), and whether the
    # term trains the selector's parameters alone.
    selector_weight_: torch.Tensor | None = None
    selector_stop_gradient: bool = False
    # DFlash2's per-chunk top-k second stage (trainer.model.topk.select_from_maxes: its torch path, where the Triton
    # kernel trainer.model.topk_kernel does not run) and its selector objective after the codebook lookups
    # (trainer.model.selector_loss.selector_objective); None = eager. The compile modes set compiled copies
    # (trainer.step.policy.compile_step).
    topk_select_fn: Callable | None = None
    selector_objective_fn: Callable | None = None

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.embed if self.embed is not None else self.target.embed_tokens

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.head if self.head is not None else self.target.lm_head


@dataclass(frozen=True)
class StepOut:
    """Device tensors of one micro-step. No host sync has happened."""

    # 0-d fp32: this micro-batch's objective (dflash: weighted mean CE; dpace: D-PACE's sum / norm; a DFlash2 drafter
    # adds the scheduled selector term)
    loss_: torch.Tensor
    correct_by_pos_: torch.Tensor  # [B] fp32: valid positions where argmax == label, per block position
    valid_by_pos_: torch.Tensor  # [B] fp32: valid (supervised) positions per block position


def adamw_options(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation flags for `device`. Pure.

    CUDA: the fused kernel (one pass over param, grad and both moments, where foreach makes several), step count and
    LR read on the device, so it captures into a CUDA graph. CPU: the
    per-parameter loop (torch refuses a tensor LR with foreach unless capturable).
    """
    on_cuda = device.type == "cuda"
    return {"foreach": False, "fused": on_cuda, "capturable": on_cuda}


def build_optimizer(drafter: Drafter, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                    device: torch.device, name: str = "adamw", muon_momentum: float = 0.95,
                    muon_nesterov: bool = True, muon_ns_steps: int = 5, muon_weight_decay: float = 0.1,
                    muon_adjust_lr: str = "match_rms_adamw") -> tuple[torch.optim.Optimizer, torch.Tensor]:
    """The run's optimizer, every group's LR the one device tensor returned (a float LR would be baked into a
    captured graph). name "adamw": AdamW on every parameter. "muon": trainer.step.muon's capturable Muon on the
    drafter's 2-D weight matrices (is_muon_param), AdamW on the rest, seen as one optimizer (MuonAdamW)."""
    lr_ = torch.tensor(lr, dtype=torch.float32, device=device)
    adamw = dict(lr=lr_, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **adamw_options(device))
    if name == "adamw":
        return torch.optim.AdamW(drafter.parameters(), **adamw), lr_
    from trainer.step.muon import CapturableMuon, MuonAdamW, is_muon_param

    split = [is_muon_param(n, p) for n, p in drafter.named_parameters()]
    params = [p for _, p in drafter.named_parameters()]
    muon = CapturableMuon([p for p, m in zip(params, split) if m], lr=lr_, weight_decay=muon_weight_decay,
                          momentum=muon_momentum, nesterov=muon_nesterov, ns_steps=muon_ns_steps,
                          adjust_lr=muon_adjust_lr, capturable=device.type == "cuda")
    return MuonAdamW(muon, torch.optim.AdamW([p for p, m in zip(params, split) if not m], **adamw)), lr_


def lr_at(step: int, *, base_lr: float, total_steps: int, warmup_ratio: float, schedule: str,
          min_lr_ratio: float = 0.0) -> float:
    """Linear warmup over ceil(warmup_ratio * total) steps, then cosine (or constant) down to min_lr_ratio * base_lr.

    `step` is the 0-based index of the optimizer step about to run.
    """
    warmup = math.ceil(warmup_ratio * total_steps)
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule == "constant":
        return base_lr
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def compute_loss(state: TrainState, batch: StaticBatch, feats: torch.Tensor | None = None) -> StepOut:
    """Forward only: target features -> drafter -> chunked LM-head CE. Returns un-detached loss in `loss_`.

    feats: the target's features for `batch` when a producer already computed them (pipeline); None = run the target.
    """
    B = state.block_size
    if feats is None:
        feats = state.target.features(batch.input_ids, batch.position_ids, batch.doc_ids)  # [R, S, T*D], no grad
    layout = make_layout(batch.position_ids, batch.doc_ids, batch.anchor_pos, batch.anchor_valid, B, state.attn,
                         state.mask_fn, window=state.drafter.cfg.window)
    noise_ids = block_input_ids(batch.input_ids, batch.anchor_pos, B, state.target.mask_token_id)  # [R, N*B]
    with torch.no_grad():
        noise_emb = state.embed_tokens(noise_ids)  # frozen target embedding
    with _autocast(feats.device):
        hidden = state.drafter(feats, noise_emb, layout)  # [R, N*B, D]
    labels, valid = block_labels(batch.input_ids, batch.doc_ids, batch.loss_mask, batch.anchor_pos,
                                 batch.anchor_valid, B)  # [R, N, B]
    if state.loss_kind == "dpace":
        w, dpace = dpace_scale(valid, state.dpace_norm), DPace(span=B - 1, alpha=state.dpace_alpha)
    else:
        w, dpace = decay_weights(B, state.gamma, device=labels.device) * valid, None  # [R, N, B]
    head = state.lm_head
    R, N = labels.shape[:2]
    # Block position k = 0 holds the given anchor token (weight 0, never trained): only k = 1..B-1 reach the LM head,
    # which saves 1/B of the head GEMMs and of the CE passes. One copy: slice + cast into a contiguous [M', D] (the
    # reshape copies only when the cast did not, i.e. when the dtypes already match).
    h = hidden.view(R, N, B, -1)[:, :, 1:].to(head.weight.dtype, memory_format=torch.contiguous_format)
    h = h.reshape(R * N * (B - 1), -1)
    bias = getattr(head, "bias", None)
    d2 = state.drafter.cfg.dflash2
    if state.selector_weight_ is None or d2 is None:
        loss, correct = chunked_lm_loss(h, head.weight, bias, labels[:, :, 1:].reshape(-1), w[:, :, 1:].reshape(-1),
                                        state.loss_chunk, state.ce_chunk_fn, dpace, state.head_fp8)
    else:
        loss, correct, cand = chunked_lm_loss(h, head.weight, bias, labels[:, :, 1:].reshape(-1),
                                              w[:, :, 1:].reshape(-1), state.loss_chunk, state.ce_chunk_fn, dpace,
                                              state.head_fp8, top_k=d2.selector_top_k, select=state.topk_select_fn)
        # The selector scales a position as the unary objective does before D-PACE's confidence weights.
        scale = w if dpace is not None else w / w.sum().clamp_min(1e-12)
        with _autocast(feats.device):  # the selector's matmuls in the drafter's numerics (bf16 on CUDA)
            term = selector_loss(state.drafter.candidate_selector, h, head.weight, bias, cand,
                                 labels[:, :, 1:].reshape(-1), labels[:, :, :-1].reshape(-1),
                                 scale[:, :, 1:].reshape(-1), chunk=state.loss_chunk,
                                 multiplier=d2.output_multiplier, softcap=d2.final_logit_softcapping,
                                 stop_gradient=state.selector_stop_gradient, objective=state.selector_objective_fn)
        loss = loss + state.selector_weight_ * term.loss
    validf = valid.float()
    correct = torch.cat([torch.zeros_like(valid[:, :, :1]), correct.view(R, N, B - 1)], dim=2)  # k = 0: never valid
    correct_by_pos = (correct.float() * validf).sum(dim=(0, 1))
    return StepOut(loss_=loss, correct_by_pos_=correct_by_pos, valid_by_pos_=validf.sum(dim=(0, 1)))


def forward_backward(state: TrainState, batch: StaticBatch, loss_scale: float = 1.0,
                     feats: torch.Tensor | None = None) -> StepOut:
    """One micro-step: forward + backward of loss * loss_scale. Grads ACCUMULATE into .grad (no zeroing here)."""
    out = compute_loss(state, batch, feats)
    (out.loss_ * loss_scale).backward()
    return StepOut(loss_=out.loss_.detach(), correct_by_pos_=out.correct_by_pos_, valid_by_pos_=out.valid_by_pos_)


def optimizer_step(state: TrainState) -> torch.Tensor:
    """Clip (global norm, foreach, no error_if_nonfinite: that would sync) + optimizer step (AdamW or MuonAdamW).
    Returns the grad norm (device)."""
    params = [p for p in state.drafter.parameters() if p.grad is not None]
    if state.clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, state.clip, foreach=True)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    state.optimizer.step()
    return norm
