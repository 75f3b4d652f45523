"""DFlash2's proposal for one block (docs/dflash2.md, "Decoding"): the drafter's layers with their grouped dynamic
convolutions over the block's B positions only, then the candidate selector's greedy walk over the target head's
top-k. Used by the reference proposer (trainer/decode/reference.py) and, through `StaticDFlash2Proposer`, by the
static engine; both run these same functions, so on one device the two propose the same tokens.

Shape legend: B block positions (the anchor, then L = B - 1 masks), D hidden, K candidates (selector_top_k), V vocab.

Free of host syncs and value-dependent shapes: top-k with the config's K, the walk a fixed loop of L - 1 gathers
(`CandidateSelector.greedy_path`), the convolution a fixed number of shifted products.
"""
from __future__ import annotations

import torch

from trainer.decode.static_draft import StaticDFlashProposer
from trainer.model.drafter import Dflash2Config, Dflash2Layer, Drafter
from trainer.model.dynconv import GroupedDynamicConv, grouped_conv
from trainer.model.selector import transform_unary


def _conv(conv: GroupedDynamicConv, x_1BD: torch.Tensor, delta_1BTG: torch.Tensor, side: int) -> torch.Tensor:
    """One side of `conv` over one block of B = x's length. B is the proposal's block, which may be shorter than the
    one trained (vLLM sizes it from the speculative tokens, docs/dflash2.md); a tap t >= B reads no position of the
    block, so only the first min(T, B) taps enter."""
    B = x_1BD.shape[1]
    taps = min(conv.taps, B)
    return grouped_conv(x_1BD, delta_1BTG[:, :, :taps], conv.base_kernel[side, :taps], B, conv.group_size)


def _prepare(conv: GroupedDynamicConv, x_1BD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`GroupedDynamicConv.prepare` over one block of any length B: (side 0 of x, side 1's kernel [1, B, T, G])."""
    R, B, _ = x_1BD.shape
    delta = conv.kernel_projection(x_1BD).view(R, B, 2, conv.taps, conv.num_groups)
    return _conv(conv, x_1BD, delta[:, :, 0], 0), delta[:, :, 1]


def attention_input(layer, x_1BD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention's input for the block: input_layernorm, then (DFlash2) the attention convolution's side 0 ->
    (the attention's input, side 1's kernel or None). The context features never pass here (they enter K/V as they
    are, as in training)."""
    h = layer.input_layernorm(x_1BD)
    if not isinstance(layer, Dflash2Layer):
        return h, None
    return _prepare(layer.attention_conv, h)


def attention_output(layer, y_1BD: torch.Tensor, kernel: torch.Tensor | None) -> torch.Tensor:
    """The attention's output (after o_proj) as the residual adds it: (DFlash2) side 1 of the convolution."""
    return y_1BD if kernel is None else _conv(layer.attention_conv, y_1BD, kernel, 1)


def mlp_residual(layer, x_1BD: torch.Tensor) -> torch.Tensor:
    """What the MLP sublayer adds to the residual: post_attention_layernorm, (DFlash2) conv side 0, MLP, side 1."""
    h = layer.post_attention_layernorm(x_1BD)
    if not isinstance(layer, Dflash2Layer):
        return layer.mlp(h)
    h, kernel = _prepare(layer.mlp_conv, h)
    return _conv(layer.mlp_conv, layer.mlp(h), kernel, 1)


def unary_candidates(logits_LV: torch.Tensor, d2: Dflash2Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's logits at the L mask positions -> (candidate ids [L, K], their transformed unary logits [L, K]
    fp32): top-k of the fp32 logits, then the output multiplier and soft cap on the K values (vLLM
    `DFlash2Qwen3ForCausalLM.propose_greedy`, SGLang `DFlash2DraftModel.compute_candidates`; the transform is
    monotone, so the ids are the raw logits' top-k)."""
    unary, cand = torch.topk(logits_LV.float(), d2.selector_top_k, dim=-1)
    return cand, transform_unary(unary, d2.output_multiplier, d2.final_logit_softcapping)


def select_drafts(drafter: Drafter, logits_LV: torch.Tensor, hidden_LD: torch.Tensor,
                  anchor_1: torch.Tensor) -> torch.Tensor:
    """The block's draft [L] long: the candidates of `unary_candidates`, walked greedily by the selector from the
    anchor (`CandidateSelector.greedy_path`: position 0 takes the best score after the anchor, each next position
    the best after the candidate chosen before it). hidden: the drafter's final-normed hidden states at the mask
    positions, the ones the logits come from. Call it under the drafter's autocast: its products then run as
    training's selector term runs them."""
    selector = drafter.candidate_selector
    cand, unary = unary_candidates(logits_LV, drafter.cfg.dflash2)
    if not torch.is_autocast_enabled(hidden_LD.device.type):  # as the selector term feeds it (model/selector_loss.py)
        hidden_LD = hidden_LD.to(selector.hidden_projection.weight.dtype)
    return selector.greedy_path(cand[None], unary[None], hidden_LD[None], anchor_1)[0]


class StaticDFlash2Proposer(StaticDFlashProposer):
    """`StaticDFlashProposer` for a DFlash2 drafter: the same context cache and block attention, each layer's
    sublayers wrapped in its convolutions (this module's functions), and the drafts chosen by the selector instead
    of the head's argmax. Same protocol, same graph-safety: no host sync, static shapes."""

    def __init__(self, target, drafter: Drafter, block_size: int, slots: int, autocast: bool | None = None) -> None:
        if drafter.cfg.dflash2 is None:
            raise ValueError("StaticDFlash2Proposer needs a DFlash2 drafter (DrafterConfig.dflash2)")
        super().__init__(target, drafter, block_size, slots, autocast)

    def attention_input(self, layer, x):
        return attention_input(layer, x)

    def attention_output(self, layer, y, kernel):
        return attention_output(layer, y, kernel)

    def mlp_residual(self, layer, x):
        return mlp_residual(layer, x)

    @torch.no_grad()
    def draft_tokens(self, anchor: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        head = self.target.lm_head
        hidden = self.draft_hidden(anchor, start)[0, 1:]  # [L, D]: the mask positions
        logits = head(hidden.to(head.weight.dtype))  # outside autocast, as the DFlash proposal's head
        with self._autocast():
            return select_drafts(self.drafter, logits, hidden, anchor)
