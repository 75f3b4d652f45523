"""DFlash labels, decay weights and a chunked LM-head cross-entropy (pure, static shapes, no host sync).

Shape legend: R rows, S tokens, N anchors, B block size, M = R*N*B block positions, D hidden, V vocab, C chunk.

Labels are SAME-POSITION: block position k of anchor a predicts token[a + k] (k = 0 is the given anchor token and is
never trained). Weight w_k = exp(-(k-1)/gamma) for k >= 1. Loss = sum(CE * w) / sum(w) over valid positions.
"""
from __future__ import annotations

import torch


def decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B] float: 0 at k=0, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


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


def ce_chunk(logits: torch.Tensor, y: torch.Tensor, s: torch.Tensor, want_grad: bool):
    """One chunk's CE math from raw logits [C, V] (any float dtype), labels y [C], loss scale s [C] (w / sum w)
    -> (sum(ce * s) fp32 scalar, correct [C] bool, dlogits [C, V] in the logits' dtype, or None). Pure; computed
    in fp32; torch.compile-able into a few fused passes (step.mode compile: trainer.step.graph.compile_step)."""
    dtype = logits.dtype
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, y[:, None])[:, 0]
    loss = ((lse - picked) * s).sum()
    correct = logits.argmax(dim=-1) == y
    if not want_grad:
        return loss, correct, None
    g = torch.softmax(logits, dim=-1)
    g.scatter_add_(1, y[:, None], torch.full_like(picked[:, None], -1.0))
    return loss, correct, g.mul_(s[:, None]).to(dtype)


def ce_chunk_fused(logits: torch.Tensor, y: torch.Tensor, s: torch.Tensor, want_grad: bool):
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
    lse = m + torch.exp(x - m).sum(dim=-1, keepdim=True).log()  # [C, 1]
    picked = x.gather(1, y[:, None])
    loss = ((lse - picked)[:, 0] * s).sum()
    correct = x.argmax(dim=-1) == y
    if not want_grad:
        return loss, correct, None
    # softmax - onehot, scaled. exp(x - lse) rather than reusing exp(x - m): a value used by both a reduction and the
    # pointwise output would be stored as a [C, V] fp32 buffer; this way each pass only reads the logits.
    is_label = torch.arange(x.shape[-1], device=x.device) == y[:, None]  # [C, V] bool, an index compare when fused
    g = (torch.exp(x - lse) - is_label.float()) * s[:, None]
    return loss, correct, g.to(dtype)


class _ChunkedLMHeadCE(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T + b, y_i) / sum(w), never holding more than [C, V] logits.

    The LM head is frozen, so only dL/dh is needed; it is computed in forward, chunk by chunk, and saved ([M, D]).
    chunk_fn: `ce_chunk` or a compiled copy of it (same contract).
    """

    @staticmethod
    def forward(ctx, h_MD, weight_VD, bias_V, labels_M, w_M, chunk: int, chunk_fn=ce_chunk):
        M = h_MD.shape[0]
        wsum = w_M.sum().clamp_min(1e-12)  # device scalar; all-padding micro-batch -> loss 0, grad 0
        scale_M = w_M / wsum
        loss = h_MD.new_zeros((), dtype=torch.float32)
        correct_M = torch.empty(M, dtype=torch.bool, device=h_MD.device)
        want_grad = ctx.needs_input_grad[0]
        grad_MD = torch.empty_like(h_MD) if want_grad else None
        for start in range(0, M, chunk):  # static trip count: M and chunk are Python ints
            end = min(start + chunk, M)
            logits = h_MD[start:end] @ weight_VD.t()
            if bias_V is not None:
                logits = logits.float() + bias_V.float()
            loss_c, correct_M[start:end], g = chunk_fn(logits, labels_M[start:end], scale_M[start:end], want_grad)
            loss = loss + loss_c
            if grad_MD is not None:
                grad_MD[start:end] = (g.to(weight_VD.dtype) @ weight_VD).to(h_MD.dtype)
        ctx.save_for_backward(grad_MD)
        ctx.mark_non_differentiable(correct_M)
        return loss, correct_M

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad_MD,) = ctx.saved_tensors
        if grad_MD is None:
            return None, None, None, None, None, None, None
        return grad_MD * grad_loss.to(grad_MD.dtype), None, None, None, None, None, None


def chunked_lm_loss(h_MD: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None, labels_M: torch.Tensor,
                    w_M: torch.Tensor, chunk: int, chunk_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weighted mean CE: scalar fp32, correct [M] bool = argmax == label). Weights must be 0 where invalid.
    chunk_fn: None = eager `ce_chunk`; the compile modes pass a compiled copy."""
    return _ChunkedLMHeadCE.apply(h_MD, weight_VD, bias_V, labels_M, w_M.float(), int(chunk), chunk_fn or ce_chunk)


def naive_lm_loss(h_MD, weight_VD, bias_V, labels_M, w_M) -> torch.Tensor:
    """Reference: full [M, V] logits. For tests only."""
    logits = (h_MD @ weight_VD.t()).float()
    if bias_V is not None:
        logits = logits + bias_V.float()
    ce = torch.nn.functional.cross_entropy(logits, labels_M, reduction="none")
    return (ce * w_M).sum() / w_M.sum().clamp_min(1e-12)
