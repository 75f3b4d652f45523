"""Greedy batch-1 decoding, target-only and speculative, over static caches; on CUDA each step is a graph replay.

Two device-side programs, each captured once as a CUDA graph in the calling (main) thread at construction:
- the decode step: target forward of 1 token at `pos` -> greedy next token; pos += 1;
- the speculative round (DFlash, one drafter forward per block): draft B-1 tokens after `anchor` at `start`;
  verify [anchor, drafts] in one target forward; a = leading matches; the bonus token post[a] becomes the next
  anchor; the block's tapped features go to the drafter's context; start += a + 1; the target commits the anchor
  and the a accepted drafts (a hybrid's linear layers move their recurrent state past them: `stack.StaticTarget`).
Per token (target-only) or per round (speculative) the host replays the graph and reads the result once -- the one
sync the stop rule (EOS, max_new) needs. The prefill is a graph too, one per prompt-length bucket (`Prefill`): a
prompt is padded up to its bucket, and the padding's K/V land in slots that no query sees before they are rewritten
(a sliding layer's ring: in its trash slot).

Lossless by construction: every committed token is the target's greedy choice at its position, computed by the same
static forward as target-only decoding (tests compare the two token for token, and both with HF's own cache path).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Collection
from typing import Callable

import torch

from trainer.capture import capture
from trainer.decode.rounds import SpecResult
from trainer.decode.stops import stop_index
from trainer.decode.stack import StaticTarget


COMPILE_CHOICES = ("none", "drafter", "all")


def greedy_step(forward, tok: torch.Tensor, pos: torch.Tensor) -> None:
    """One greedy decode step for every row, on the device: tok [R, 1] at position `pos` -> the next token, in place;
    pos += 1. `forward` is a `StaticTarget.forward` (or its compiled form). Graph-safe: no sync, fixed shapes."""
    logits, _ = forward(tok, pos, want_features=False)
    tok.copy_(logits[:, -1:].argmax(-1))
    pos.add_(1)


class GraphProgram:
    """A device function over static buffers: captured as a CUDA graph on CUDA (when `graphs`, through
    trainer/capture.py: explicit stream, device guard, warm-up on the capture stream), run eagerly otherwise.
    pool: a memory pool shared with other programs that are never replayed concurrently with this one."""

    def __init__(self, fn: Callable[[], None], device: torch.device, graphs: bool, warmup: int = 2,
                 pool=None) -> None:
        self.fn = fn
        self.graph = None
        if device.type == "cuda" and graphs:
            # warm-up: lazy inits (cuBLAS handles, autocast caches) happen outside the capture
            self.graph, _ = capture(fn, device, warmup, pool)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


def prefill_buckets(slots: int, smallest: int = 16) -> list[int]:
    """Prompt lengths a prefill graph is captured for: powers of two from `smallest`, then `slots` (the cache's
    size) so that every prompt that fits the cache fits a bucket. At most ~2x the prompt's tokens are computed;
    at batch 1 a prefill of a few hundred tokens costs its kernel launches, not its FLOPs. (`generate.py` uses the
    same ladder for the attention spans of its step graphs.)"""
    buckets, size = [], smallest
    while size < slots:
        buckets.append(size)
        size *= 2
    return buckets + [slots]


class Prefill:
    """The prompt's forward as one graph replay: per bucket of `prefill_buckets`, static ids and a graph (captured
    at construction, in the calling thread). The prompt is copied into its bucket's ids; the rest of the bucket is
    whatever the last prompt left there. Rows after the prompt cannot change the prompt's rows (causal attention,
    row-wise norms and linears); their K/V land in slots at or after the prompt's end, which every later forward
    rewrites before any query at that position can see them (slot = position). Likewise for the drafter's context.

    proposer: None -> only the next token (target-only decoding); else also the prompt's tapped features, written
    into the proposer's context (`reset`) inside the same graph. Eager on CPU (same padding).

    Each bucket's graph keeps its own memory pool for its activations: small at the few hundred slots evaluation
    uses; a long-context decoder (thousands of slots) would want the buckets to share one pool."""

    def __init__(self, static: StaticTarget, slots: int, proposer=None, graphs: bool = True) -> None:
        dev = static.device
        self.static, self.proposer = static, proposer
        self.buckets = prefill_buckets(slots)
        self.zero = torch.zeros((), dtype=torch.long, device=dev)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)  # index of the prompt's last token
        self.first = torch.zeros(1, 1, dtype=torch.long, device=dev)  # the greedy token after the prompt
        self.ids = {L: torch.zeros(1, L, dtype=torch.long, device=dev) for L in self.buckets}
        self.programs = {L: GraphProgram(functools.partial(self._run, L), dev, graphs) for L in self.buckets}

    def _run(self, L: int) -> None:
        logits, feats = self.static.forward(self.ids[L], self.zero, want_features=self.proposer is not None,
                                            logits_at=self.last)
        self.first.copy_(logits[:, -1:].argmax(-1))
        if self.proposer is not None:
            self.proposer.reset(feats)

    def __call__(self, prompt_ids: list[int]) -> torch.Tensor:
        """-> the greedy token after the prompt, [1, 1] long on the device (this object's buffer)."""
        P = len(prompt_ids)
        L = next((b for b in self.buckets if b >= P), None)
        if L is None or P == 0:
            raise ValueError(f"a prompt of {P} tokens does not fit a prefill bucket (1..{self.buckets[-1]})")
        self.ids[L][0, :P].copy_(torch.tensor(prompt_ids, dtype=torch.long), non_blocking=False)
        self.last.fill_(P - 1)
        self.programs[L]()
        return self.first


class StaticDecoder:
    """Target-only and speculative greedy decoding of sequences up to `capacity` tokens (prompt + new).

    proposer: None for target-only decoding, else a static proposer (see `trainer.decode.static_draft`) whose caches
    hold at least `capacity` slots. Construction captures the graphs (CUDA) and leaves the caches dirty; every
    `generate_*` call starts from its own prefill, so stale contents never matter."""

    def __init__(self, target, capacity: int, proposer=None, block_size: int = 16, graphs: bool = True,
                 compile: str = "none", invariant: bool = False) -> None:
        if proposer is not None and block_size != proposer.block_size:
            raise ValueError(f"block_size {block_size} differs from the proposer's {proposer.block_size}")
        if proposer is not None and (getattr(proposer, "capacity", None) or capacity) < capacity:
            raise ValueError(f"the proposer's caches hold {proposer.capacity} positions, the decoder needs {capacity}")
        # B spare slots: a verify at the last start writes a whole block (and a hybrid's linear layers keep one).
        # invariant: see StaticTarget.
        self.static = StaticTarget(target, capacity + block_size, invariant=invariant, block=block_size)
        # compile: "all" sends the target's step/verify forwards and the drafter's draft/append through torch.compile
        # (fused norms and RoPE: fewer kernels per replay); "drafter" only the drafter's, so both target paths keep
        # the same uncompiled forward. The prefill (one graph per prompt-length bucket) always runs uncompiled.
        if compile not in COMPILE_CHOICES:
            raise ValueError(f"compile must be one of {COMPILE_CHOICES}, got {compile!r}")
        if invariant and compile == "all":
            raise ValueError("invariant decoding keeps the target uncompiled (its Triton kernels are not traced); "
                             "use compile='drafter'")
        self._forward = torch.compile(self.static.forward, dynamic=False) if compile == "all" else \
            self.static.forward
        if compile != "none" and hasattr(proposer, "compile"):
            proposer.compile()
        self.capacity = capacity
        self.proposer = proposer
        self.block_size = block_size
        dev = self.static.device
        self.device = dev
        # Decode-step state: the last committed token and its position.
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.step = GraphProgram(self._decode_step, dev, graphs)
        self.prefill = Prefill(self.static, self.static.slots, None, graphs)
        if proposer is not None:
            self.prefill_spec = Prefill(self.static, self.static.slots, proposer, graphs)
            # Round state: the anchor (committed, not yet cached) at position `start`; the result row
            # [a, block (B), post (B)] read by the host once per round.
            self.anchor = torch.zeros(1, dtype=torch.long, device=dev)
            self.start = torch.zeros((), dtype=torch.long, device=dev)
            self.result = torch.zeros(1 + 2 * block_size, dtype=torch.long, device=dev)
            self.round = GraphProgram(self._spec_round, dev, graphs)

    # ------------------------------------------------------------ device programs (no host sync inside)

    def _decode_step(self) -> None:
        greedy_step(self._forward, self.tok, self.pos)

    def _spec_round(self) -> None:
        draft = self.proposer.draft(self.anchor, self.start)  # [B-1]
        block = torch.cat([self.anchor, draft])  # [B]
        logits, feats = self._forward(block[None], self.start, verify=True)
        post = logits[0].argmax(-1)  # [B]: the target's greedy token after each block position
        a = (block[1:] == post[:-1]).long().cumprod(0).sum()  # leading accepted drafts
        self.static.commit((a + 1).view(1))  # the anchor and the accepted drafts
        self.proposer.append(feats, self.start)
        self.result.copy_(torch.cat([a[None], block, post]))
        self.anchor.copy_(post.gather(0, a[None]))
        self.start.add_(a + 1)

    # ------------------------------------------------------------ host loops

    def _check_fits(self, prompt_ids: list[int], max_new: int) -> None:
        if len(prompt_ids) + max_new > self.capacity:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_new ({max_new}) exceeds the decoder's capacity "
                             f"({self.capacity} tokens)")

    @torch.no_grad()
    def generate_target_only(self, prompt_ids: list[int], max_new: int, stops: Collection[int] = ()) -> list[int]:
        if max_new <= 0:
            return []
        self._check_fits(prompt_ids, max_new)
        first = self.prefill(prompt_ids)
        self.tok.copy_(first)
        self.pos.fill_(len(prompt_ids))
        out = [int(first)]  # SYNC: one per token, inherent to greedy decoding
        while stop_index(out, stops, max_new) is None:
            self.step()
            out.append(int(self.tok))  # SYNC
        return out[:stop_index(out, stops, max_new)]

    @torch.no_grad()
    def generate_speculative(self, prompt_ids: list[int], max_new: int, stops: Collection[int] = (),
                             host_s: dict[str, float] | None = None, drafts: list | None = None) -> SpecResult:
        """host_s: if given, wall seconds of the rounds are added under "round" (replay, the round's one sync, and
        bookkeeping; the prefill is not included). drafts: if given, each round's B-1 draft tokens are appended."""
        if self.proposer is None:
            raise RuntimeError("this decoder was built without a proposer")
        if max_new <= 0:
            return SpecResult(tokens=[])
        B = self.block_size
        self._check_fits(prompt_ids, max_new)
        first = self.prefill_spec(prompt_ids)  # also writes the prompt's context into the proposer
        self.anchor.copy_(first[0])
        self.start.fill_(len(prompt_ids))
        committed_new = [int(first)]  # SYNC
        accepted: list[int] = []
        t0 = time.perf_counter()
        while stop_index(committed_new, stops, max_new) is None:
            self.round()
            host = self.result.tolist()  # SYNC: one per round
            a, block, post = host[0], host[1:B + 1], host[B + 1:]
            accepted.append(a)
            committed_new += block[1:a + 1] + [post[a]]
            if drafts is not None:
                drafts.append(block[1:])
        if host_s is not None:
            host_s["round"] = host_s.get("round", 0.0) + time.perf_counter() - t0
        return SpecResult(tokens=committed_new[:stop_index(committed_new, stops, max_new)], accepted=accepted)
