"""DFlash2's selector objective and its weight schedule. Pure torch, static shapes, no host sync.

Shape legend: M trained block positions (k = 1..B-1 of every anchor), K candidates, D hidden, V vocabulary.

At every trained position the candidates are the target head's top K unary logits of the drafter's hidden state
(ids from the CE chunks, `chunked_lm_loss(top_k=K)`); the predecessor is the true previous token (the anchor at
k = 1). The selector scores the candidates (`CandidateSelector.score` over the transformed unary logits) and the
objective is the CE of the label among them, over the positions whose label is a candidate (a label outside the top K
is the backbone's miss, not a selector example: SpecForge's rule), scaled as the unary objective scales the position
(`s`: DFlash's w / sum(w), or D-PACE's base scale before its confidence weights) and weighted by
`selector_weight_at`. docs/dflash2.md says which parts follow SpecForge and which are this trainer's.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from trainer.model.selector import CandidateSelector, transform_unary


def selector_weight_at(step: int, *, total_steps: int, alpha: float, warmup_ratio: float, ramp_ratio: float) -> float:
    """The selector term's weight before optimizer step `step` (0-based): 0 for ceil(warmup_ratio * total) steps,
    then a linear ramp over ceil(ramp_ratio * total) steps, then alpha. Pure; fed to the step as a device tensor."""
    warmup, ramp = math.ceil(warmup_ratio * total_steps), math.ceil(ramp_ratio * total_steps)
    if step < warmup:
        return 0.0
    if step < warmup + ramp:
        return alpha * (step - warmup + 1) / ramp
    return alpha


class _CandidateLogits(torch.autograd.Function):
    """unary[m, k] = h[m] . W[cand[m, k]] (+ b[cand]) in chunks of `chunk` positions, in both passes: the gathered
    head rows [chunk, K, D] never outlive their chunk (saved: h and the ids). The head is frozen: no grad for W.

    Traced by torch.compile (the compile modes' selector_objective), both passes are instead one product-and-sum over
    the gathered rows, in fp32: Inductor fuses the gather into the reduction, so no [M, K, D] tensor is written at all
    (with the einsum it gathers every chunk's rows and its partitioner keeps them all for the backward)."""

    @staticmethod
    def forward(ctx, h_MD, weight_VD, bias_V, cand_MK, chunk: int):
        if torch.compiler.is_compiling():
            out = (weight_VD[cand_MK].float() * h_MD.float()[:, None, :]).sum(dim=-1)
        else:
            M, K = cand_MK.shape
            out = torch.empty(M, K, dtype=torch.float32, device=h_MD.device)
            for start in range(0, M, chunk):  # static trip count
                end = min(start + chunk, M)
                rows = weight_VD[cand_MK[start:end]]  # [C, K, D]
                out[start:end] = torch.einsum("ckd,cd->ck", rows, h_MD[start:end].to(rows.dtype)).float()
        if bias_V is not None:
            out = out + bias_V.float()[cand_MK]
        ctx.save_for_backward(h_MD, weight_VD, cand_MK)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_MK):
        h_MD, weight_VD, cand_MK = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        if torch.compiler.is_compiling():
            grad_h = (grad_MK.float()[:, :, None] * weight_VD[cand_MK].float()).sum(dim=1).to(h_MD.dtype)
            return grad_h, None, None, None, None
        grad_h = torch.empty_like(h_MD)
        M, chunk = h_MD.shape[0], ctx.chunk
        for start in range(0, M, chunk):
            end = min(start + chunk, M)
            rows = weight_VD[cand_MK[start:end]]
            grad_h[start:end] = torch.einsum("ck,ckd->cd", grad_MK[start:end].to(rows.dtype), rows).to(h_MD.dtype)
        return grad_h, None, None, None, None


class SelectorTerm(NamedTuple):
    loss: torch.Tensor  # 0-d fp32: sum(CE * s) over the covered positions (unweighted by the schedule)
    covered: torch.Tensor  # [M] bool: the label is among the candidates
    correct: torch.Tensor  # [M] bool: the selector's pick (after the true predecessor) is the label


def selector_loss(selector: CandidateSelector, h_MD: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None,
                  cand_MK: torch.Tensor, labels_M: torch.Tensor, pred_M: torch.Tensor, s_M: torch.Tensor, *,
                  chunk: int, multiplier: float = 1.0, softcap: float | None = None, stop_gradient: bool = False,
                  objective=None) -> SelectorTerm:
    """The selector objective of M positions (module docstring). stop_gradient: the term trains the selector's own
    parameters only (its inputs, the hidden states and so the unary logits, detached), as SpecForge's
    `dflash2_selector_stop_gradient`. Call it under the step's autocast (trainer.step.step.compute_loss does).
    objective: `selector_objective` or a compiled copy of it (the compile modes)."""
    if stop_gradient:
        h_MD = h_MD.detach()
    # The codebook lookups stay out of `objective`: Inductor would turn their backward into an fp32 atomic
    # scatter-add, whose sums over repeated ids come in a different order every run on CUDA (the compile and
    # compile+graph modes would no longer agree bit for bit); eager, it is a deterministic sort and segment sum.
    pred_code, cand_code = selector.codes(cand_MK, pred_M)
    return (objective or selector_objective)(selector, h_MD, weight_VD, bias_V, cand_MK, labels_M, pred_code,
                                             cand_code, s_M, chunk=chunk, multiplier=multiplier, softcap=softcap)


def selector_objective(selector: CandidateSelector, h_MD: torch.Tensor, weight_VD: torch.Tensor,
                       bias_V: torch.Tensor | None, cand_MK: torch.Tensor, labels_M: torch.Tensor,
                       pred_code: torch.Tensor, cand_code: torch.Tensor, s_M: torch.Tensor, *, chunk: int,
                       multiplier: float = 1.0, softcap: float | None = None) -> SelectorTerm:
    """`selector_loss` after its codebook lookups (`CandidateSelector.codes`): the candidate logits, the scores and
    their CE. A function of its own so that the compile modes run it as one compiled graph, forward and backward
    (eager it is ~20 small kernels and a chunk loop)."""
    unary = transform_unary(_CandidateLogits.apply(h_MD, weight_VD, bias_V, cand_MK, int(chunk)), multiplier, softcap)
    # Under autocast (CUDA: the step's bf16) the selector's matmuls take the head-dtype hidden states as they are;
    # without it they run in the selector's parameter dtype.
    h_sel = h_MD if torch.is_autocast_enabled(h_MD.device.type) else h_MD.to(selector.hidden_projection.weight.dtype)
    scores = selector.score_codes(pred_code, cand_code, unary, h_sel)  # [M, K] fp32
    match = cand_MK == labels_M[:, None]
    covered = match.any(dim=-1)
    target = match.long().argmax(dim=-1)  # 0 where not covered: masked below
    ce = torch.logsumexp(scores, dim=-1) - scores.gather(1, target[:, None])[:, 0]
    loss = (ce * torch.where(covered, s_M.float(), torch.zeros_like(ce))).sum()
    correct = covered & (scores.argmax(dim=-1) == target)
    return SelectorTerm(loss=loss, covered=covered, correct=correct)
