"""Batched generation over one static KV cache: up to `rows` prompts of any lengths, greedy or sampled, each new
token one CUDA graph replay for the whole batch. HF `generate` (`hf_generate`) is the reference it is tested and
benchmarked against; both keep the same contract.

How a batch runs (`BatchGenerator.generate`):
- the prompts are left-padded to the longest, P tokens; row r's prompt starts at slot P - len(r), and the
  static target hides the slots before it and gives RoPE the position slot - start (`StaticTarget(padded=True)`),
  so a row computes what it would alone, as HF's left padding does;
- the prefill runs eagerly, in chunks (their attention scores stay within a memory budget), and chooses every
  row's first new token;
- then one replay per token: forward of each row's last token, choose the next one on the device, rows that have
  stopped are masked (they emit a filler that the result drops), the token is written into a device history.
  The host reads nothing per token: it asks "have all rows stopped?" once every `CHECK_EVERY` tokens and reads the
  history once at the end. Each row's answer runs through its first stop id (kept).
- Attention reads only the cache slots the sequence has reached, rounded up to a power of two (`span`): one graph
  per (choice mode, span), captured when a batch first needs it, in the calling thread, before that batch's
  prefill. The graphs share one memory pool (they are never replayed concurrently).

Choosing a token, on the device (no host sync, no value-dependent shape):
    greedy     argmax of the logits (HF greedy: the first index of a tie)
    sampled    Gumbel-max: argmax(logits / temperature + g), g = -log(-log(u)), which draws from
               softmax(logits / temperature); with top_p < 1 the logits outside the nucleus (HF's TopPLogitsWarper:
               the smallest set of most likely tokens whose probability reaches top_p) are -inf first.
u is a counter-based hash of (seed, draw, stream, token id): a seeded per-step stream that needs no generator
state, so a graph replay, an eager run and every device draw the same u for the same seed. A row's stream is its
index in the batch unless the caller names one (`streams`, e.g. the prompt's index in its file): a prompt then
draws the same u whichever batch it lands in (a resumed job's batches differ from the first run's). A seed gives
the same tokens on every run of one device and dtype (floating point may differ across devices, and the batch's
padding may move a near-tie; so may the tokens).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.decode.engine import GraphProgram, prefill_buckets
from trainer.decode.stops import cut_at_stop
from trainer.decode.stack import StaticTarget
from trainer.model.target import Target

CHECK_EVERY = 16  # tokens between the host's "have all rows stopped?" reads (each one host sync)
SCORE_BUDGET = 2 ** 28  # attention score elements (rows x heads x chunk x slots) one prefill chunk may hold
GREEDY, SAMPLE, NUCLEUS = "greedy", "sample", "top_p"
_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0.0:  # also NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    @property
    def mode(self) -> str:
        if self.temperature == 0.0:
            return GREEDY
        return SAMPLE if self.top_p == 1.0 else NUCLEUS


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32-style xor-shift-multiply) on int64 values in [0, 2^32). The multipliers are
    below 2^31, so no product leaves int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x31848BAB) & _M32
    return x ^ (x >> 16)


def seed32(seed: int) -> int:
    """A seed of any size -> the 32-bit key of the noise stream. Pure."""
    return (seed ^ (seed >> 32) ^ (seed >> 64)) & _M32


def gumbel_noise(seed: torch.Tensor, draw: torch.Tensor, streams: torch.Tensor,
                 vocab_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [R, V] fp32 for draw number `draw` (0-dim long) of `seed` (0-dim long, 32 bits), one
    row per stream id (`streams` [R] long, each < 2^31), from a hash of (seed, draw, stream, token id): u uniform in
    (0, 1) on a 2^-24 grid, g = -log(-log(u))."""
    step_key = _mix32((seed + draw * 0x9E3779B9) & _M32)
    row_key = _mix32((step_key + streams * 0x85EBCA6B) & _M32)  # [R]
    bits = _mix32(vocab_ids[None, :] ^ row_key[:, None])  # [R, V]
    u = ((bits >> 8).float() + 0.5) * 2.0 ** -24
    return -torch.log(-torch.log(u))


def top_p_filter(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF's TopPLogitsWarper (min_tokens_to_keep 1): scores [R, V] with every token outside the nucleus set to -inf.
    top_p: 0-dim device tensor."""
    ascending, order = torch.sort(scores, dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= 1 - top_p
    remove[:, -1] = False  # the most likely token always stays
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))


class BatchGenerator:
    """Continue up to `rows` prompts of varying lengths (prompt + max_new_tokens <= max_len) until each row's
    first stop id, on one static cache. Construction allocates the cache; graphs are captured on first use
    (module docstring). Not thread-safe: one batch at a time, from the thread that captures."""

    def __init__(self, target: Target, rows: int, max_len: int, stop_ids: Sequence[int], graphs: bool = True) -> None:
        if rows < 1 or max_len < 2:
            raise ValueError(f"rows must be >= 1 and max_len >= 2, got {rows} and {max_len}")
        self.rows, self.max_len, self.graphs = rows, max_len, graphs
        self.stop_ids = [int(s) for s in stop_ids]
        self.static = self._static_target(target, rows, max_len)
        dev = self.static.device
        self.device = dev
        vocab = target.embed_tokens.weight.shape[0]

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=dev)

        self.stops = torch.tensor(self.stop_ids, dtype=torch.long, device=dev)
        # what a stopped row emits from then on (cut_at_stop drops it)
        self.filler = torch.tensor(self.stop_ids[0] if self.stop_ids else 0, dtype=torch.long, device=dev)
        self.tok, self.pos, self.done = zeros(rows, 1), zeros(), zeros(rows, dtype=torch.bool)
        # history[r, s]: the token at slot s. Two spare columns: a capture's warm-up steps from slot 0 write there
        # even when max_len is tiny.
        self.history = zeros(rows, max_len + 2)
        self.seed, self.draw = zeros(), zeros()
        self.temperature, self.top_p = zeros(dtype=torch.float32), zeros(dtype=torch.float32)
        self.row_ids, self.vocab_ids = torch.arange(rows, device=dev), torch.arange(vocab, device=dev)
        self.streams = zeros(rows)  # each row's noise stream (see `generate`)
        self.spans = prefill_buckets(max_len, smallest=min(64, max_len))
        self.pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" and graphs else None
        self.programs: dict[tuple[str, int], GraphProgram] = {}
        self.replays = 0  # step replays of the last batch (its tokens per row, less the prefill's)

    def _static_target(self, target: Target, rows: int, max_len: int):
        """The padded static target of `rows` rows over `max_len` slots (a subclass serves other layer kinds)."""
        return StaticTarget(target, max_len, rows=rows, padded=True)

    # ------------------------------------------------------------ device programs (no host sync inside)

    def _choose(self, logits: torch.Tensor, mode: str) -> torch.Tensor:
        """logits [R, V] fp32 -> the next token per row [R] long."""
        if mode == GREEDY:
            return logits.argmax(-1)
        scores = logits / self.temperature
        if mode == NUCLEUS:
            scores = top_p_filter(scores, self.top_p)
        noise = gumbel_noise(self.seed, self.draw, self.streams, self.vocab_ids)
        self.draw.add_(1)
        return (scores + noise).argmax(-1)

    def _is_stop(self, tok: torch.Tensor) -> torch.Tensor:
        return (tok[:, None] == self.stops[None, :]).any(-1)

    def _step(self, mode: str, span: int) -> None:
        """The token at slot `pos` -> the next one, at slot pos + 1, for every row; attention over slots < span."""
        logits, _ = self.static.forward(self.tok, self.pos, want_features=False, span=span)
        new = torch.where(self.done, self.filler, self._choose(logits[:, -1], mode))
        self.done.logical_or_(self._is_stop(new))
        self.pos.add_(1)
        self.history.index_copy_(1, self.pos.view(1), new[:, None])
        self.tok.copy_(new[:, None])

    # ------------------------------------------------------------ host side

    def _span(self, slots: int) -> int:
        return next(s for s in self.spans if s >= slots)

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

    def check_fits(self, prompts: list[list[int]], sampling: Sampling, streams: Sequence[int] | None = None) -> None:
        """ValueError, in one line, for a batch `generate` cannot take."""
        if streams is not None and (len(streams) != len(prompts) or not all(0 <= s < 2 ** 31 for s in streams)):
            raise ValueError(f"streams must be one id in 0..2^31-1 per prompt, got {len(streams)} for "
                             f"{len(prompts)} prompts")
        if not 1 <= len(prompts) <= self.rows:
            raise ValueError(f"{len(prompts)} prompts do not fit a batch of 1..{self.rows} rows")
        if not all(prompts):
            raise ValueError("an empty prompt: every row needs at least one token")
        longest = max(map(len, prompts))
        if longest + sampling.max_new_tokens > self.max_len:
            raise ValueError(f"a prompt of {longest} tokens + max_new_tokens {sampling.max_new_tokens} exceeds "
                             f"max_len {self.max_len}")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling,
                 streams: Sequence[int] | None = None) -> list[list[int]]:
        """Up to `rows` prompts of varying lengths (prompt + max_new_tokens <= max_len) -> each prompt's new
        tokens through its first stop id (kept); rows that stopped are masked, the batch ends when all stopped or
        max_new_tokens. One static cache, prefill, then one CUDA-graph replay per token for the whole batch.
        streams: sampling only, each prompt's noise stream id (default: its index in `prompts`)."""
        self.check_fits(prompts, sampling, streams)
        r, R, mode, n_max = len(prompts), self.rows, sampling.mode, sampling.max_new_tokens
        P = max(map(len, prompts))
        # Every graph this batch replays, captured before its prefill: step k (1 <= k < n_max) reads P + k slots.
        programs = {self._span(P + k): None for k in range(1, n_max)}
        programs = {span: self._program(mode, span) for span in programs}
        rows = list(prompts) + [prompts[0]] * (R - r)  # spare rows: copies of the first prompt, stopped at once
        ids = torch.tensor([[0] * (P - len(p)) + list(p) for p in rows], dtype=torch.long).to(self.device)
        self.static.row_start.copy_(torch.tensor([P - len(p) for p in rows], dtype=torch.long))
        named = list(streams) if streams is not None else list(range(r))
        self.streams.copy_(torch.tensor(named + list(range(R - r)), dtype=torch.long))  # spare rows: any stream
        self.seed.fill_(seed32(sampling.seed))
        self.draw.zero_()
        self.temperature.fill_(sampling.temperature or 1.0)
        self.top_p.fill_(sampling.top_p)
        first = self._choose(self._prefill(ids), mode)
        self.done.copy_((self.row_ids >= r) | self._is_stop(first))
        self.history[:, P].copy_(first)
        self.tok.copy_(first[:, None])
        self.pos.fill_(P)
        n = 1
        while n < n_max:
            programs[self._span(P + n)]()
            n += 1
            if n % CHECK_EVERY == 0 and bool(self.done.all()):  # SYNC: one per CHECK_EVERY tokens
                break
        self.replays = n - 1
        out = self.history[:r, P:P + n].tolist()  # SYNC: once per batch
        return [cut_at_stop(row, self.stop_ids) for row in out]


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], sampling: Sampling, stop_ids: Sequence[int],
                pad_id: int) -> list[list[int]]:
    """HF `generate` over the same contract: left-padded batch, KV cache, greedy or sampled (temperature, top_p;
    no top-k), stopping at `stop_ids` -> each prompt's new tokens through its first stop id (kept). Sampling draws
    from torch's RNG seeded with `sampling.seed`, forked so the caller's RNG state is untouched (HF's draws, not
    the static engine's: sampled tokens agree in distribution, not token for token)."""
    L = max(map(len, prompts))
    dev = model.get_input_embeddings().weight.device
    ids = torch.tensor([[pad_id] * (L - len(p)) + list(p) for p in prompts], device=dev)
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=dev)
    # Explicit values: HF fills every unset one from the model's generation_config.json (top_k, a repetition
    # penalty), which would change what is compared.
    how = dict(do_sample=False) if sampling.mode == GREEDY else \
        dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(sampling.seed)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                             eos_token_id=list(stop_ids), pad_token_id=pad_id, repetition_penalty=1.0, **how)
    return [cut_at_stop(row, stop_ids) for row in out[:, L:].tolist()]  # SYNC: once per batch
