"""The whole-batch path of the batch generator, for targets whose rows cannot be refilled one at a time (a hybrid's
linear-attention layers keep one recurrent state per row that a per-row prefill does not yet reset and fill):
prompts in chunks of `rows`, each chunk left-padded to its longest prompt, prefilled together, then one graph
replay per token for the whole chunk until every row stopped, so a chunk waits for its longest answer.

- row r's prompt starts at slot P - len(r); the static target hides the slots before it and gives RoPE the
  position slot - start (`StaticTarget(padded=True)`, `HybridStaticTarget(padded=True)`), so a row computes what
  it would alone, as HF's left padding does;
- the prefill runs eagerly, in chunks whose attention scores stay within SCORE_BUDGET, and chooses every row's
  first token; then one replay per token: rows that have stopped emit a filler that the result drops; the host
  asks "have all rows stopped?" once every CHECK_EVERY tokens and reads the token history once per chunk;
- one graph per (choice mode, attention span), captured before the chunk's prefill that first needs it.
Sampling noise as `generate.BatchGenerator`'s: keyed by (seed, the token's index in its answer, the prompt's
stream), so a prompt samples the same tokens in either path.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import torch

from trainer.decode.engine import GraphProgram
from trainer.decode.generate import CHECK_EVERY, SCORE_BUDGET, BatchGenerator, Sampling, seed32
from trainer.decode.stops import cut_at_stop


class WholeBatchGenerator(BatchGenerator):
    """`BatchGenerator`'s contract (any number of prompts, answers streamed by prompt index) over chunks of `rows`
    prompts run whole (module docstring); the static target is `padded` (row_start)."""

    refills = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        dev = self.device
        self.pos, self.draw = (torch.zeros((), dtype=torch.long, device=dev) for _ in range(2))
        self.filler = torch.tensor(self.stop_ids[0] if self.stop_ids else 0, dtype=torch.long, device=dev)
        # history[r, s]: the token at slot s; two spare columns for a capture's warm-up steps from slot 0
        self.history = torch.zeros(self.rows, self.max_len + 2, dtype=torch.long, device=dev)

    def _step(self, mode: str, span: int) -> None:
        """The token at slot `pos` -> the next one, at slot pos + 1, for every row; attention over slots < span."""
        logits, _ = self.static.forward(self.tok, self.pos, want_features=False, span=span)
        chosen = self._choose(logits[:, -1], mode, self.streams, self.draw.expand(self.rows))
        self.draw.add_(1)
        new = torch.where(self.done, self.filler, chosen)
        self.done.logical_or_(self._is_stop(new))
        self.pos.add_(1)
        self.history.index_copy_(1, self.pos.view(1), new[:, None])
        self.tok.copy_(new[:, None])

    def _program(self, mode: str, span: int) -> GraphProgram:
        key = (mode, span)
        if key not in self.programs:
            # The warm-up runs real steps: start them at slot 0 (inside any cache); the prefill resets everything.
            self.pos.zero_()
            self.done.zero_()
            self.programs[key] = GraphProgram(functools.partial(self._step, mode, span), self.device, self.graphs,
                                              pool=self.pool)
        return self.programs[key]

    def _prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [R, P] left-padded -> the logits after each row's prompt [R, V]."""
        R, P = ids.shape
        chunk = max(16, SCORE_BUDGET // (R * self.static.heads * P))
        for a in range(0, P, chunk):
            b = min(P, a + chunk)
            logits, _ = self.static.forward(ids[:, a:b], torch.tensor(a, device=self.device), want_features=False,
                                            last_only=True, span=b)
        return logits[:, -1]

    @torch.no_grad()
    def _run(self, prompts: list[list[int]], sampling: Sampling, streams: Sequence[int]
             ) -> Iterator[tuple[int, list[int]]]:
        for at in range(0, len(prompts), self.rows):
            chunk = prompts[at:at + self.rows]
            for i, answer in enumerate(self._batch(chunk, sampling, list(streams[at:at + self.rows]))):
                yield at + i, answer

    def _batch(self, prompts: list[list[int]], sampling: Sampling, named: list[int]) -> list[list[int]]:
        r, R, mode, n_max = len(prompts), self.rows, sampling.mode, sampling.max_new_tokens
        P = max(map(len, prompts))
        # Every graph this chunk replays, captured before its prefill: step k (1 <= k < n_max) reads P + k slots.
        programs = {self._span(P + k): None for k in range(1, n_max)}
        programs = {span: self._program(mode, span) for span in programs}
        rows = list(prompts) + [prompts[0]] * (R - r)  # spare rows: copies of the first prompt, stopped at once
        ids = torch.tensor([[0] * (P - len(p)) + list(p) for p in rows], dtype=torch.long).to(self.device)
        self.static.row_start.copy_(torch.tensor([P - len(p) for p in rows], dtype=torch.long))
        self.streams.copy_(torch.tensor(named + list(range(R - r)), dtype=torch.long))  # spare rows: any stream
        self.seed.fill_(seed32(sampling.seed))
        self.draw.zero_()
        self.temperature.fill_(sampling.temperature or 1.0)
        self.top_p.fill_(sampling.top_p)
        first = self._choose(self._prefill(ids), mode, self.streams, self.draw.expand(R))
        self.draw.add_(1)
        self.done.copy_((self.row_ids >= r) | self._is_stop(first))
        self.history[:, P].copy_(first)
        self.tok.copy_(first[:, None])
        self.pos.fill_(P)
        n = 1
        while n < n_max:
            programs[self._span(P + n)]()
            n += 1
            self.replays += 1
            if n % CHECK_EVERY == 0 and bool(self.done.all()):  # SYNC: one per CHECK_EVERY tokens
                break
        out = self.history[:r, P:P + n].tolist()  # SYNC: once per chunk
        return [cut_at_stop(row, self.stop_ids) for row in out]
