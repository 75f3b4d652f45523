"""DFlash2's low-rank candidate selector and the unary-logit transform of the serving stacks. Pure torch, static
shapes (top-k and the path walk have fixed sizes), no host sync.

Shape legend: M block positions, L positions of one block's proposal (B - 1), K candidates (selector_top_k),
r rank, D hidden, V vocabulary.

The target's head gives unary logits at every block position; its top K are the candidates. A candidate c following
predecessor token p at a position with drafter hidden state h scores

    score(c | p, h) = unary(c) + sum_r A[p, r] * (W h)[r] * Bc[c, r]

with the codebooks A = `predecessor_codebook` [V, r] and Bc = `successor_codebook` [V, r] and W =
`hidden_projection` [r, D]. Bc starts at zero, so a fresh selector ranks the candidates as the unary logits do.
Names, shapes and the score are SGLang's and vLLM's `CandidateSelector` (docs/dflash2.md).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def transform_unary(logits: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """The serving stacks' unary-logit transform: fp32, times `multiplier`, then tanh(x / softcap) * softcap where a
    soft cap is set. Monotone, so the top-k ids do not depend on it."""
    out = logits.float()
    if multiplier != 1.0:
        out = out * multiplier
    if softcap is not None:
        out = torch.tanh(out / softcap) * softcap
    return out


def _score_dtype(unary: torch.Tensor) -> torch.dtype:
    return torch.promote_types(unary.dtype, torch.float32)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_top_k must be in [1, vocab_size={vocab_size}], got {top_k}")
        if rank < 1:
            raise ValueError(f"selector_rank must be >= 1, got {rank}")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """predecessor codebook and projection normal(0, std), successor codebook 0: the transition starts at 0."""
        self.predecessor_codebook.normal_(0.0, std)
        self.hidden_projection.weight.normal_(0.0, std)
        self.successor_codebook.zero_()

    def codes(self, cand_MK: torch.Tensor, pred_M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Predecessor ids [...] and candidates [..., K] -> their codebook rows, ([..., r], [..., K, r])."""
        # embedding rather than indexing: the same gather, and on CUDA its backward is a sort and segment sum, where
        # indexing's (index_put accumulate) walks each repeated id's rows in one warp; ids repeat a lot here
        return F.embedding(pred_M, self.predecessor_codebook), F.embedding(cand_MK, self.successor_codebook)

    def score(self, cand_MK: torch.Tensor, unary_MK: torch.Tensor, h_MD: torch.Tensor,
              pred_M: torch.Tensor) -> torch.Tensor:
        """Candidates [..., K] (ids), their unary logits [..., K], hidden [..., D], predecessor ids [...] ->
        scores [..., K], fp32 at least."""
        return self.score_codes(*self.codes(cand_MK, pred_M), unary_MK, h_MD)

    def score_codes(self, pred_code: torch.Tensor, cand_code: torch.Tensor, unary_MK: torch.Tensor,
                    h_MD: torch.Tensor) -> torch.Tensor:
        """`score` from the codebook rows `codes` gives."""
        context = pred_code * self.hidden_projection(h_MD)  # [..., r]
        # a batched product: the [..., K, r] elementwise product is never materialized
        transition = torch.einsum("...r,...kr->...k", context, cand_code)
        dtype = _score_dtype(unary_MK)
        return unary_MK.to(dtype) + transition.to(dtype)

    def lattice(self, cand_RLK: torch.Tensor, unary_RLK: torch.Tensor, h_RLD: torch.Tensor,
                anchor_R: torch.Tensor) -> torch.Tensor:
        """Every transition of one proposal block -> [R, L, K, K] fp32: [.., l, p, c] = the score of candidate c at
        position l after candidate p of position l - 1 (at l = 0 the anchor token, the same for every p)."""
        K = cand_RLK.shape[-1]
        pred = torch.cat([anchor_R[:, None, None].expand(-1, 1, K), cand_RLK[:, :-1]], dim=1)  # [R, L, K]
        context = self.predecessor_codebook[pred] * self.hidden_projection(h_RLD)[:, :, None]  # [R, L, K, r]
        transition = torch.einsum("rlpk,rlck->rlpc", context, self.successor_codebook[cand_RLK])
        dtype = _score_dtype(unary_RLK)
        return unary_RLK.to(dtype)[:, :, None] + transition.to(dtype)

    def greedy_path(self, cand_RLK: torch.Tensor, unary_RLK: torch.Tensor, h_RLD: torch.Tensor,
                    anchor_R: torch.Tensor) -> torch.Tensor:
        """The proposal: at each position the best-scoring candidate after the one chosen before it (the anchor
        before the first) -> token ids [R, L]. L steps of fixed shape (a gather each), no host sync."""
        scores = self.lattice(cand_RLK, unary_RLK, h_RLD, anchor_R)  # [R, L, K, K]
        L = cand_RLK.shape[1]
        index = scores[:, 0, 0].argmax(dim=-1)  # [R]: position 0's row is the anchor's whatever p
        picks = [index]
        for pos in range(1, L):  # static trip count
            index = scores[:, pos].gather(1, index[:, None, None].expand(-1, 1, scores.shape[-1]))[:, 0].argmax(-1)
            picks.append(index)
        return cand_RLK.gather(2, torch.stack(picks, dim=1)[:, :, None])[:, :, 0]
