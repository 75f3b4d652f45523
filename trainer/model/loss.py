"""DFlash labels, decay weights and a chunked LM-head cross-entropy (pure, static shapes, no host sync).

Shape legend: R rows, S tokens, N anchors, B block size, M = R*N*B block positions, D hidden, V vocab, C chunk.

Labels are SAME-POSITION: block position k of anchor a predicts token[a + k] (k = 0 is the given anchor token and is
never trained). Two loss kinds (config `loss.kind`):
- dflash: weight w_k = exp(-(k-1)/gamma) for k >= 1; loss = sum(CE * w) / sum(w) over valid positions.
- dpace: D-PACE's detached, per-block weights from the drafter's own confidence (`dpace_weights`); loss =
  sum(CE * w) / norm, norm = rows (the paper's per-sequence mean) or valid positions (`dpace_scale`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from trainer.model import ce_kernel
from trainer.model.topk import CHUNK as TOPK_CHUNK, chunk_maxes_used, fast_topk


def decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B] float: 0 at k=0, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


class DPace(NamedTuple):
    """D-PACE inside one CE chunk: `span` consecutive positions form one block (B - 1: k = 1..B-1), `alpha` smooths
    the confidence. A Python constant, so a compiled chunk function specializes on it."""

    span: int
    alpha: float


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights (Wu et al., "D-PACE: Dynamic Position-Aware Cross-Entropy for Parallel Speculative
    Drafting", https://arxiv.org/abs/2605.18810; the authors' code https://github.com/Lucas-TY/D-PACE,
    specforge/core/dflash.py, as merged into https://github.com/sgl-project/SpecForge as `loss_type: dpace`).

    ce [..., K] = -log q_k, the drafter's CE at each block position; valid [..., K] bool. With the smoothed
    confidence c_k = (1 - alpha) q_k + alpha (1 where invalid: a no-op in the products), the weight is
    w_k = sum_{j >= k, valid} prod_{i <= j} c_i (0 where invalid): the gradient weight of position k in the
    smoothed expected accepted length. Pure, no grad, no host sync; -> [..., K] in ce's dtype."""
    with torch.no_grad():
        q = torch.exp(-ce)
        smooth = torch.where(valid, (1.0 - alpha) * q + alpha, torch.ones_like(q))
        prefix = torch.where(valid, torch.cumprod(smooth, dim=-1), torch.zeros_like(q))
        suffix = prefix.flip(-1).cumsum(-1).flip(-1)
        return torch.where(valid, suffix, torch.zeros_like(q))


def dpace_scale(valid: torch.Tensor, norm: str) -> torch.Tensor:
    """valid [R, N, B] bool -> the base loss scale [R, N, B] fp32 that D-PACE's weights multiply: valid / the number
    of rows holding a valid position (norm "rows": the paper's loss, summed over a sequence and averaged over the
    batch; a packed row here plays the sequence, all-padding rows do not count), or / the number of valid positions
    (norm "positions": vllm-project/speculators' reduction, src/speculators/losses/utils.py). Device-side, no sync."""
    if norm == "rows":
        count = valid.flatten(1).any(dim=1).sum()
    elif norm == "positions":
        count = valid.sum()
    else:
        raise ValueError(f"D-PACE norm must be rows or positions, got {norm!r}")
    return valid.float() / count.clamp_min(1).float()


def block_labels(input_ids: torch.Tensor, doc_ids: torch.Tensor, loss_mask: torch.Tensor, anchor_pos: torch.Tensor,
                 anchor_valid: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> labels [R, N, B] long, valid [R, N, B] bool.

    valid = anchor valid & k >= 1 & anchor+k < S & same document as the anchor & loss_mask[anchor+k].
    """
    S = input_ids.shape[1]
    k = torch.arange(block_size, device=input_ids.device)
    pos = anchor_pos[:, :, None] + k  # [R, N, B]
    in_row = pos < S
    idx = pos.clamp(max=S - 1).flatten(1)  # [R, N*B]
    labels = input_ids.gather(1, idx).view_as(pos)
    same_doc = doc_ids.gather(1, idx).view_as(pos) == doc_ids.gather(1, anchor_pos)[:, :, None]
    supervised = loss_mask.gather(1, idx).view_as(pos).bool()
    valid = anchor_valid[:, :, None] & (k >= 1) & in_row & same_doc & supervised
    return labels, valid


def block_input_ids(input_ids: torch.Tensor, anchor_pos: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """The noise block [anchor token, MASK x (B-1)] per anchor -> [R, N*B] long."""
    anchor_tok = input_ids.gather(1, anchor_pos)  # [R, N]
    block = torch.full((*anchor_pos.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    block[:, :, 0] = anchor_tok
    return block.flatten(1)


def _reweighted(ce: torch.Tensor, s: torch.Tensor, dpace: DPace | None) -> torch.Tensor:
    """The chunk's loss scale: s itself, or s times the D-PACE weights of the chunk's whole blocks (s > 0 = valid)."""
    if dpace is None:
        return s
    shape = (-1, dpace.span)
    return s * dpace_weights(ce.view(shape), (s > 0).view(shape), dpace.alpha).flatten()


def ce_chunk(logits: torch.Tensor, y: torch.Tensor, s: torch.Tensor, want_grad: bool, dpace: DPace | None = None,
             grad_fp8: bool = False):
    """One chunk's CE math from raw logits [C, V] (any float dtype), labels y [C], loss scale s [C] (w / sum w)
    -> (sum(ce * s) fp32 scalar, correct [C] bool, dlogits [C, V] in the logits' dtype, or None). Pure; computed
    in fp32; torch.compile-able into a few fused passes (step.mode compile: trainer.step.policy.compile_step).
    dpace: s is first multiplied by the D-PACE weights computed from this chunk's own CE (C a multiple of
    dpace.span, each span one block); the weights are constants to the gradient, as in the paper.
    grad_fp8 (step.head_fp8): dlogits comes as (e4m3 [C, V], row scales [C, 1]) for `Fp8Head.input_grad`."""
    dtype = logits.dtype
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, y[:, None])[:, 0]
    ce = lse - picked
    s = _reweighted(ce, s, dpace)
    loss = (ce * s).sum()
    correct = logits.argmax(dim=-1) == y
    if not want_grad:
        return loss, correct, None
    g = torch.softmax(logits, dim=-1)
    if grad_fp8:  # in place: no second [C, V] fp32 buffer
        rest = g.scatter_(1, y[:, None], 0.0).sum(dim=-1)  # 1 - p_label, summed: it never cancels
        return loss, correct, _e4m3_rows(g.scatter_(1, y[:, None], -rest[:, None]), s, rest)
    g.scatter_add_(1, y[:, None], torch.full_like(picked[:, None], -1.0))
    return loss, correct, g.mul_(s[:, None]).to(dtype)


def _e4m3_rows(unscaled: torch.Tensor, s: torch.Tensor, rest: torch.Tensor):
    """softmax - onehot [C, V] fp32 (the label's entry as -rest), the loss scale s [C] and rest = 1 - p_label [C]
    -> (dlogits / row scale in e4m3, row scale [C, 1])."""
    from trainer.model.fp8 import dlogits_scale
    from trainer.model.fp8_rows import to_e4m3

    scale = dlogits_scale(s, rest)[:, None]
    return to_e4m3(unscaled * (s[:, None] / scale)), scale


def ce_chunk_fused(logits: torch.Tensor, y: torch.Tensor, s: torch.Tensor, want_grad: bool,
                   dpace: DPace | None = None, grad_fp8: bool = False):
    """`ce_chunk`'s contract and math, written for Inductor (the form `compile_step` compiles): one reduction pass
    over the logits (max, sum of exp, argmax, the label's logit) and one pass that writes dlogits in the logits' dtype
    (softmax as exp(x - lse): equal to ce_chunk's up to fp32 rounding).

    Why not compile `ce_chunk`: its `scatter_add_` makes Inductor materialize the fp32 softmax [C, V] (a write and a
    read of 4 bytes per logit, on top of re-reading the logits for logsumexp and softmax separately). Here the label's
    -1 is a compare against the vocab index, so dlogits is one pointwise expression of logits and per-row scalars.
    Eager, this form holds more [C, V] fp32 transients than `ce_chunk`: keep it for compiled use.
    """
    dtype = logits.dtype
    x = logits.float()
    m = x.amax(dim=-1, keepdim=True)  # [C, 1]
    sum_exp = torch.exp(x - m).sum(dim=-1, keepdim=True)  # [C, 1]
    lse = m + sum_exp.log()
    picked = x.gather(1, y[:, None])
    ce = (lse - picked)[:, 0]
    s = _reweighted(ce, s, dpace)
    loss = (ce * s).sum()
    correct = x.argmax(dim=-1) == y
    if not want_grad:
        return loss, correct, None
    # softmax - onehot, scaled. exp(x - lse) rather than reusing exp(x - m): a value used by both a reduction and the
    # pointwise output would be stored as a [C, V] fp32 buffer; this way each pass only reads the logits.
    is_label = torch.arange(x.shape[-1], device=x.device) == y[:, None]  # [C, V] bool, an index compare when fused
    if grad_fp8:
        # 1 - p_label as the mass off the label (it never cancels), in the pass that sums exp(x - m)
        rest = (torch.where(is_label, 0.0, torch.exp(x - m)).sum(dim=-1, keepdim=True) / sum_exp)[:, 0]
        p = torch.exp(x - lse)
        return loss, correct, _e4m3_rows(torch.where(is_label, -rest[:, None], p), s, rest)
    g = (torch.exp(x - lse) - is_label.float()) * s[:, None]
    return loss, correct, g.to(dtype)


class _ChunkedLMHeadCE(torch.autograd.Function):
    """sum_i s_i * CE(h_i @ W^T + b, y_i), never holding more than [C, V] logits; s = w / sum(w) (DFlash), or with
    `dpace` s = w times each block's D-PACE weights, computed chunk by chunk from the chunk's own CE.

    The LM head is frozen, so only dL/dh is needed; it is computed in forward, chunk by chunk, and saved ([M, D]).
    chunk_fn: `ce_chunk` or a compiled copy of it (same contract). head8: an `Fp8Head` of the same weight
    (step.head_fp8): both of the chunk's GEMMs run in FP8, and chunk_fn hands dlogits over in e4m3.
    """

    @staticmethod
    def forward(ctx, h_MD, weight_VD, bias_V, labels_M, w_M, chunk: int, chunk_fn=ce_chunk, dpace=None, head8=None,
                top_k: int = 0, select=None):
        M = h_MD.shape[0]
        if dpace is None:
            wsum = w_M.sum().clamp_min(1e-12)  # device scalar; all-padding micro-batch -> loss 0, grad 0
            scale_M = w_M / wsum
        else:
            scale_M = w_M  # already normalized (dpace_scale)
        loss = h_MD.new_zeros((), dtype=torch.float32)
        correct_M = torch.empty(M, dtype=torch.bool, device=h_MD.device)
        want_grad = ctx.needs_input_grad[0]
        grad_MD = torch.empty_like(h_MD) if want_grad else None
        cand_MK = torch.empty(M, top_k, dtype=torch.long, device=h_MD.device) if top_k else None
        extra = {} if dpace is None else {"dpace": dpace}
        if head8 is not None:
            extra["grad_fp8"] = True
        for start in range(0, M, chunk):  # static trip count: M and chunk are Python ints
            end = min(start + chunk, M)
            h = h_MD[start:end]
            logits = h @ weight_VD.t() if head8 is None else head8.logits(h)
            if bias_V is not None:
                logits = logits.float() + bias_V.float()
            maxes, kw = None, dict(extra)
            if cand_MK is not None and chunk_fn is ce_kernel.ce_chunk_triton:
                # the CE kernel writes the top-k's chunk maxes from the logits it reads anyway
                used = chunk_maxes_used(logits.shape[1], top_k)
                if used and ce_kernel.writes_chunk_maxes(logits.shape[1], TOPK_CHUNK):
                    maxes = logits.new_empty(end - start, used)
                    kw.update(maxes=maxes, chunk=TOPK_CHUNK)
            loss_c, correct_M[start:end], g = chunk_fn(logits, labels_M[start:end], scale_M[start:end], want_grad,
                                                       **kw)
            loss = loss + loss_c
            if cand_MK is not None:
                cand_MK[start:end] = fast_topk(logits, top_k, select=select, maxes=maxes)[1]
            if grad_MD is not None:
                g_MD = g.to(weight_VD.dtype) @ weight_VD if head8 is None else head8.input_grad(*g)
                grad_MD[start:end] = g_MD.to(h_MD.dtype)
        ctx.save_for_backward(grad_MD)
        if cand_MK is None:
            ctx.mark_non_differentiable(correct_M)
            return loss, correct_M
        ctx.mark_non_differentiable(correct_M, cand_MK)
        return loss, correct_M, cand_MK

    @staticmethod
    def backward(ctx, grad_loss, *_grad_non_differentiable):
        (grad_MD,) = ctx.saved_tensors
        grad_h = None if grad_MD is None else grad_MD * grad_loss.to(grad_MD.dtype)
        return grad_h, None, None, None, None, None, None, None, None, None, None


def chunked_lm_loss(h_MD: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None, labels_M: torch.Tensor,
                    w_M: torch.Tensor, chunk: int, chunk_fn=None, dpace: DPace | None = None,
                    head8=None, top_k: int = 0, select=None) -> tuple[torch.Tensor, ...]:
    """-> (loss: scalar fp32, correct [M] bool = argmax == label), and with top_k > 0 (DFlash2's selector) a third
    value, the ids of each position's top_k logits [M, top_k] long (from the same chunks' logits: no extra head GEMM;
`fast_topk`'s, so tied logits rank by the lower id).
    Weights must be 0 where invalid.

    dpace None: the weighted mean CE, sum(CE * w) / sum(w). dpace: sum(CE * w * D-PACE weights), w the normalized
    base scale (`dpace_scale`); consecutive runs of dpace.span positions are one block each (M a multiple of it), so
    the chunk is rounded down to whole blocks and every block's weights come from one chunk.
    chunk_fn: None = eager `ce_chunk`; the compile modes pass a compiled copy. head8: the head's `Fp8Head`
    (step.head_fp8), or None for the GEMMs in the head's dtype. select: the top-k's second stage
    (`trainer.model.topk.fast_topk`'s); the compile modes pass a compiled copy."""
    chunk = int(chunk)
    if dpace is not None:
        if h_MD.shape[0] % dpace.span:
            raise ValueError(f"D-PACE needs whole blocks: {h_MD.shape[0]} positions, {dpace.span} per block")
        chunk = max(dpace.span, chunk - chunk % dpace.span)
    return _ChunkedLMHeadCE.apply(h_MD, weight_VD, bias_V, labels_M, w_M.float(), chunk, chunk_fn or ce_chunk, dpace,
                                  head8, top_k, select)


def naive_lm_loss(h_MD, weight_VD, bias_V, labels_M, w_M) -> torch.Tensor:
    """Reference: full [M, V] logits. For tests only."""
    logits = (h_MD @ weight_VD.t()).float()
    if bias_V is not None:
        logits = logits + bias_V.float()
    ce = torch.nn.functional.cross_entropy(logits, labels_M, reduction="none")
    return (ce * w_M).sum() / w_M.sum().clamp_min(1e-12)
