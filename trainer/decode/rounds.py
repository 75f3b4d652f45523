"""What a speculative round commits and how rounds are counted: the acceptance rule, the result of a decode and its
statistics. Shared by every decoder (static engine, HF-cache reference) and by evaluation; the stop rule is
trainer/decode/stops.py."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def leading_matches(drafted: torch.Tensor, reference: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[..., B] -> [...]: number of leading k >= 1 with drafted == reference and valid (position 0 is the anchor)."""
    match = (drafted == reference) & valid
    return match[..., 1:].long().cumprod(dim=-1).sum(dim=-1)


@dataclass(frozen=True)
class SpecResult:
    tokens: list[int]  # new tokens (the stop rule of target-only decoding: trainer/decode/stops.py)
    accepted: list[int] = field(default_factory=list)  # per round: accepted draft tokens a in 0..B-1 (tau = a + 1)

    @property
    def rounds(self) -> int:
        return len(self.accepted)


def acceptance_stats(results: list[SpecResult], block_size: int) -> dict:
    """Mean tau (accepted + bonus, in [1, B]) over all rounds, and per block position k = 1..B-1 the fraction of
    rounds whose draft token k was accepted."""
    acc = [a for r in results for a in r.accepted]
    if not acc:
        return {"tau": None, "rounds": 0, "accept_by_pos": []}
    return {"tau": round(sum(a + 1 for a in acc) / len(acc), 4), "rounds": len(acc),
            "accept_by_pos": [round(sum(a >= k for a in acc) / len(acc), 4) for k in range(1, block_size)]}


def capped_rounds(accepted: list[int], n: int) -> list[int]:
    """Real rounds as a replay of an n-token answer sees them: a round anchored at answer token i cannot accept
    past the answer's end (real decoding drafts on and truncates at max_new)."""
    capped, i = [], 0
    for a in accepted:
        capped.append(min(a, n - i - 1))
        i += a + 1
    return capped
