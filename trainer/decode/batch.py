"""Greedy continuations of many equal-length prompts at once (the quality pipeline's regenerated drafter data): one
static KV cache for R rows that advance together, prefill eagerly, then one CUDA graph replay per new token for the
whole batch. No host sync until the batch is done. HF `generate` does the same work launch-bound, step by step."""
from __future__ import annotations

import torch

from trainer.decode.engine import GraphProgram, greedy_step
from trainer.decode.static_target import StaticTarget
from trainer.model.target import Target


class BatchGreedy:
    """Continue up to `rows` prompts of exactly `prompt_len` tokens by `new_tokens` greedy tokens each.

    The graph is captured at construction (in the calling thread) and reused for every batch; a smaller last batch is
    padded with copies of its first prompt, whose rows are dropped."""

    def __init__(self, target: Target, rows: int, prompt_len: int, new_tokens: int, graphs: bool = True) -> None:
        if rows < 1 or prompt_len < 1 or new_tokens < 1:
            raise ValueError("rows, prompt_len and new_tokens must be >= 1")
        self.rows, self.prompt_len, self.new_tokens = rows, prompt_len, new_tokens
        self.static = StaticTarget(target, prompt_len + new_tokens, rows=rows)
        dev = self.static.device
        self.tok = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.step = GraphProgram(self._step, dev, graphs)

    def _step(self) -> None:
        greedy_step(self.static.forward, self.tok, self.pos)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor) -> torch.Tensor:
        """prompts [r, prompt_len] long (r <= rows) -> new tokens [r, new_tokens], on the target's device."""
        r, length = prompts.shape
        if r > self.rows or length != self.prompt_len:
            raise ValueError(f"prompts of shape {tuple(prompts.shape)} do not fit a batch of {self.rows} x "
                             f"{self.prompt_len}")
        dev = self.static.device
        ids = prompts.to(dev)
        if r < self.rows:
            ids = torch.cat([ids, ids[:1].expand(self.rows - r, -1)])
        zero = torch.zeros((), dtype=torch.long, device=dev)
        logits, _ = self.static.forward(ids, zero, want_features=False, last_only=True)
        out = torch.empty(self.rows, self.new_tokens, dtype=torch.long, device=dev)
        out[:, 0] = logits[:, -1].argmax(-1)
        self.tok.copy_(out[:, :1])
        self.pos.fill_(self.prompt_len)
        for i in range(1, self.new_tokens):
            self.step()
            out[:, i] = self.tok[:, 0]
        return out[:r]
