"""Batched generation over one static KV cache with refilled slots: any number of prompts of any lengths, greedy or
sampled, through `rows` slots; each new token is one CUDA graph replay for every slot, and a slot whose answer ended
takes the next prompt while the others keep decoding. HF `generate` (`hf_generate`) is the reference it is tested
and benchmarked against; both keep the same contract (each prompt's answer through its first stop id, kept).

How slots run (`BatchGenerator.generate_stream`; `generate` returns the answers in prompt order):
- per-row positions: row r of the cache holds one prompt and its answer at slots 0, 1, ... (slot = the token's
  position), its own `pos[r]` (the position of its current token), so rows never pad and never wait for each other
  (`StaticTarget.forward_rows`, layers/attention.py);
- a refill (at the start, and whenever slots have ended) prefills the next prompts into the freed rows only,
  eagerly, in the forwards of prefill_plan.py: where the target's attention runs a prefill from position 0 as causal
  SDPA over its own keys (`StaticTarget.whole_prefill`), whole prompts, longest first, several to a forward up to
  PREFILL_TOKENS positions; otherwise the rows together in chunks. Padding past a shorter prompt's end writes slots
  its own decode rewrites before any query sees them (a sliding layer's ring: its trash slot, layers/ring.py). It
  chooses each new row's first token;
- then one replay per token for all rows: forward of each row's current token at its own position, choose the next
  one on the device, a live row writes it into a device history and advances; a row that ended (its stop id, or
  max_new_tokens) steps at position 0 until the host refills it. The host reads nothing per token: every
  CHECK_EVERY tokens, and at the step where some row must have reached max_new_tokens, it reads which rows ended
  (one sync), then the ended rows' answers (one more), hands them out (prompt index, tokens) and refills.
- A step's attention: where step_kernel.py's kernel computes the target's attention (no soft cap, sinks or
  sliding window; CUDA; `row_kernel`, on by default), each row reads its own slots up to its position only, and
  one graph per choice mode serves every step. Otherwise masked SDPA reads the slots the longest live row has
  reached, rounded up to a power of two (`span`; the host knows an upper bound of every row's position without
  reading it), for every row: one graph per (choice mode, span). The graphs a call can reach are captured at its
  start, before any prefill, in the calling thread, and share one memory pool (they are never replayed
  concurrently).
- The tail, compacted (`compact`, on by default, where the per-row kernel runs): once no prompt waits, at a check
  where at most half the rows are live, the steps run over W rows only, W the narrowest of rows / 2, rows / 4, ...
  down to `compact_floor` that holds them: the live rows and ended ones to make W, ascending (`compact_rows[W]`,
  copied to the device at that check), gathered, stepped by the same rules and scattered back; the other rows,
  ended, wait untouched (nothing refills them). One graph per W, captured with the others.
Slots are handed out in prompt order; answers come out as rows end (completion order).

After a call has handed out every answer, `last_run` holds its counts (run_stats.py's `RunStats`), added up on the
host as it issues the work, no sync added: step replays, host checks, fills (the first and each refill) and the
prompts refilled into a used slot, prefill forwards and the prompt tokens and positions (padding included) they
covered, answers and their tokens, the slot-steps whose row held a prompt (live, or ended and not yet seen by a
check) and the steps after the last prompt was filled (the tail); so the idle slot-steps split into those before a
check and those for want of a prompt; the compacted steps and the row-steps computed (each step's width summed).
Also the time of the prefills and of the token steps (CUDA events read once after the loop; on a CPU the host's
time), the rest of the wall being the host's checks and launches.

Choosing a token, on the device (no host sync, no value-dependent shape; the noise: draws.py):
    greedy     argmax of the logits (HF greedy: the first index of a tie)
    sampled    Gumbel-max: argmax(logits / temperature + g), g = -log(-log(u)), which draws from
               softmax(logits / temperature); with top_p < 1 the logits outside the nucleus (HF's TopPLogitsWarper:
               the smallest set of most likely tokens whose probability reaches top_p) are -inf first.
u is a counter-based hash of (seed, draw, stream, token id): a seeded stream that needs no generator state, so a
graph replay, an eager run and every device draw the same u for the same seed. `draw` is the token's index in its
answer (0 for the prefill's choice), per row; a row's stream is its prompt's index unless the caller names one
(`streams`, e.g. the prompt's index in its file): a prompt then draws the same u whichever slot and time it lands
in (a resumed job's slots differ from the first run's). A seed gives the same tokens on every run of one device and
dtype (floating point may differ across devices and batch shapes, which may move a near-tie; so may the tokens).

A hybrid target runs the same host loop and programs: in `StaticTarget.forward_rows` a refilled row's
linear-attention states start from zero and take its prompt alone.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from trainer.decode.draws import gumbel_noise, seed32, top_p_filter
from trainer.decode.engine import GraphProgram, prefill_buckets
from trainer.decode.prefill_plan import prefill_forwards
from trainer.decode.run_stats import COUNTED, PREFILL, STEP, RunStats, Spans
from trainer.decode.stops import cut_at_stop
from trainer.decode.stack import StaticTarget
from trainer.model.target import Target

CHECK_EVERY = 16  # tokens between the host's "which rows ended?" reads (each one host sync)
COMPACT_FLOOR = 16  # the narrowest compacted step (rows / 2, rows / 4, ... down to it)
GREEDY, SAMPLE, NUCLEUS = "greedy", "sample", "top_p"


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


class BatchGenerator:
    """Continue any number of prompts of varying lengths (each prompt + max_new_tokens <= max_len) until each one's
    first stop id, through `rows` refilled slots of one static cache (module docstring). Construction allocates the
    cache; graphs are captured on first use. Not thread-safe: one call at a time, from the thread that captures."""

    def __init__(self, target: Target, rows: int, max_len: int, stop_ids: Sequence[int], graphs: bool = True,
                 row_kernel: bool = True, ring: bool = True, fuse: bool = True, compact: bool = True,
                 compact_floor: int = COMPACT_FLOOR) -> None:
        if rows < 1 or max_len < 2:
            raise ValueError(f"rows must be >= 1 and max_len >= 2, got {rows} and {max_len}")
        self.rows, self.max_len, self.graphs = rows, max_len, graphs
        self.stop_ids = [int(s) for s in stop_ids]
        # row_kernel: the steps' attention through the per-row decode kernel where it serves the target; ring:
        # sliding-window layers keep a ring of window + 1 slots (+ trash) where that is fewer (False: every slot);
        # fuse: q/k/v and gate/up as one GEMM each, SiLU * up one kernel (decode/fused.py; the target's modules then
        # hold views into the joined weights)
        self.static = StaticTarget(target, max_len, rows=rows, padded=True, row_kernel=row_kernel, ring=ring,
                                   fuse=fuse)
        dev = self.static.device
        self.device = dev
        vocab = target.embed_tokens.weight.shape[0]

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=dev)

        self.stops = torch.tensor(self.stop_ids, dtype=torch.long, device=dev)
        # per row: the current token, its position, the prompt's length, the last position its answer may reach,
        # whether it ended (or holds no prompt)
        self.tok, self.pos, self.plen, self.end = zeros(rows, 1), zeros(rows), zeros(rows), zeros(rows)
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)
        # history[r, s]: the token at position s of row r; column max_len takes the writes of ended rows
        self.history = zeros(rows, max_len + 1)
        self.trash = torch.tensor(max_len, device=dev)
        self.seed = zeros()
        self.temperature, self.top_p = zeros(dtype=torch.float32), zeros(dtype=torch.float32)
        self.row_ids, self.vocab_ids = torch.arange(rows, device=dev), torch.arange(vocab, device=dev)
        self.streams = zeros(rows)  # each row's noise stream
        # compact: once no prompt waits, steps over W rows only (the live ones and ended ones to fill W), W the
        # narrowest of `widths` that holds the live rows; where the per-row kernel serves the target (one graph per W)
        self.widths = [rows >> k for k in range(1, rows.bit_length())
                       if compact and self.static.row_kernel and rows >> k >= max(1, compact_floor)]
        self.compact_rows = {w: torch.arange(w, device=dev) for w in self.widths}  # each W's cache rows, ascending
        self.spans = prefill_buckets(max_len, smallest=min(64, max_len))
        self.pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" and graphs else None
        self.programs: dict[tuple[str, int, int | None], GraphProgram] = {}
        self.last_run: RunStats | None = None  # the last call's counts, once it has handed out every answer
        self._counts = dict.fromkeys(COUNTED, 0)  # the current (or last) call's, as it goes

    @property
    def replays(self) -> int:
        """Step replays of the current (or last) call."""
        return self._counts["steps"]

    @property
    def refilled(self) -> int:
        """Prompts the current (or last) call prefilled into a slot another prompt had held."""
        return self._counts["refilled"]

    # ------------------------------------------------------------ device programs (no host sync inside)

    def _choose(self, logits: torch.Tensor, mode: str, streams: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
        """logits [R', V] fp32 -> the next token per row [R'] long; streams, draw [R'] long: each row's noise key."""
        if mode == GREEDY:
            return logits.argmax(-1)
        scores = logits / self.temperature
        if mode == NUCLEUS:
            scores = top_p_filter(scores, self.top_p)
        return (scores + gumbel_noise(self.seed, draw, streams, self.vocab_ids)).argmax(-1)

    def _is_stop(self, tok: torch.Tensor) -> torch.Tensor:
        return (tok[:, None] == self.stops[None, :]).any(-1)

    def _step(self, mode: str, span: int, width: int | None = None) -> None:
        """Each row's current token at its own position -> its next one; attention over slots < span. A row that
        ended steps at position 0 until it is refilled (its forward's result is dropped): through the per-row kernel
        it then reads one slot block, not its whole sequence. width: a compacted step of cache rows
        compact_rows[width] only (the host's pick: every live row, the rest ended ones), the others untouched."""
        rows = self.row_ids if width is None else self.compact_rows[width]

        def take(buf: torch.Tensor) -> torch.Tensor:
            return buf if width is None else buf.index_select(0, rows)

        pos, done = take(self.pos), take(self.done)
        logits = self.static.forward_rows(take(self.tok), pos[:, None], rows, span)
        live, nxt = ~done, pos + 1
        new = self._choose(logits, mode, take(self.streams), nxt - take(self.plen))
        self.history.index_put_((rows, torch.where(live, nxt, self.trash)), new)
        done = done | self._is_stop(new) | (nxt >= take(self.end))
        for buf, value in ((self.done, done), (self.pos, torch.where(done, 0, nxt)), (self.tok, new[:, None])):
            buf.copy_(value) if width is None else buf.index_copy_(0, rows, value)

    # ------------------------------------------------------------ host side

    def _span(self, slots: int) -> int:
        return next(s for s in self.spans if s >= slots)

    def _program(self, mode: str, span: int, width: int | None = None) -> GraphProgram:
        key = (mode, span, width)
        if key not in self.programs:
            # The warm-up runs real steps: every row ended at position 0 (the first refill sets them all).
            self.pos.zero_()
            self.done.fill_(True)
            self.programs[key] = GraphProgram(functools.partial(self._step, mode, span, width), self.device,
                                              self.graphs, pool=self.pool)
        return self.programs[key]

    def _fill(self, rows: list[int], prompts: list[list[int]], streams: list[int], sampling: Sampling) -> None:
        """Prefill `prompts` into cache rows `rows` (ascending) and choose their first tokens; other rows untouched.
        Which prompts share a forward, from where and how wide: prefill_plan.py."""
        dev = self.device
        lengths = [len(p) for p in prompts]
        logits = torch.empty(len(rows), self.vocab_ids.shape[0], dtype=torch.float32, device=dev)
        for sel, a, width in prefill_forwards(lengths, self.static.whole_prefill, self.static.heads, self._span):
            ids = [prompts[i][a:a + width] + [0] * max(0, a + width - lengths[i]) for i in sel]
            # padding past the cache's end writes its last slot, which no query of this prompt sees yet
            pos = (a + torch.arange(width)).clamp(max=self.max_len - 1).expand(len(sel), width)
            last = [min(lengths[i] - a, width) - 1 for i in sel]
            out = self.static.forward_rows(torch.tensor(ids).to(dev), pos.to(dev),
                                           torch.tensor([rows[i] for i in sel]).to(dev),
                                           self._span(min(a + width, self.max_len)), torch.tensor(last).to(dev),
                                           fresh=a == 0)
            self._count(prefills=1, prefill_positions=len(sel) * width)
            ending = [j for j, i in enumerate(sel) if lengths[i] <= a + width]
            if ending:  # a chunk inside every prompt still in it ends none
                logits.index_copy_(0, torch.tensor([sel[j] for j in ending], dtype=torch.long, device=dev),
                                   out.index_select(0, torch.tensor(ending, dtype=torch.long, device=dev)))
        self._count(fills=1, prefill_tokens=sum(lengths))
        at = torch.tensor(rows).to(dev)
        plen, named = torch.tensor(lengths).to(dev), torch.tensor(streams).to(dev)
        first = self._choose(logits, sampling.mode, named, torch.zeros_like(plen))
        end = plen + sampling.max_new_tokens - 1
        for buf, value in ((self.pos, plen), (self.plen, plen), (self.end, end), (self.streams, named),
                           (self.tok, first[:, None]), (self.done, self._is_stop(first) | (plen >= end))):
            buf.index_copy_(0, at, value)
        self.history.index_put_((at, plen), first)

    def _count(self, **counts: int) -> None:
        for name, n in counts.items():
            self._counts[name] += n

    def check_fits(self, prompts: list[list[int]], sampling: Sampling, streams: Sequence[int] | None = None) -> None:
        """ValueError, in one line, for prompts `generate` cannot take."""
        if streams is not None and (len(streams) != len(prompts) or not all(0 <= s < 2 ** 31 for s in streams)):
            raise ValueError(f"streams must be one id in 0..2^31-1 per prompt, got {len(streams)} for "
                             f"{len(prompts)} prompts")
        if not prompts:
            raise ValueError("no prompts")
        if not all(prompts):
            raise ValueError("an empty prompt: every row needs at least one token")
        longest = max(map(len, prompts))
        if longest + sampling.max_new_tokens > self.max_len:
            raise ValueError(f"a prompt of {longest} tokens + max_new_tokens {sampling.max_new_tokens} exceeds "
                             f"max_len {self.max_len}")

    def generate_stream(self, prompts: list[list[int]], sampling: Sampling,
                        streams: Sequence[int] | None = None) -> Iterator[tuple[int, list[int]]]:
        """Prompts of varying lengths (each prompt + max_new_tokens <= max_len; refused here, before anything runs)
        -> (prompt index, its new tokens through its first stop id, kept) as each answer ends. streams: sampling
        only, each prompt's noise stream id (default: its index in `prompts`)."""
        self.check_fits(prompts, sampling, streams)
        self.last_run, self._counts = None, dict.fromkeys(COUNTED, 0)
        return self._run(prompts, sampling, list(streams) if streams is not None else list(range(len(prompts))))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling,
                 streams: Sequence[int] | None = None) -> list[list[int]]:
        """`generate_stream`'s answers in prompt order."""
        out: list[list[int]] = [[] for _ in prompts]
        for i, answer in self.generate_stream(prompts, sampling, streams):
            out[i] = answer
        return out

    @torch.no_grad()
    def _run(self, prompts: list[list[int]], sampling: Sampling, streams: list[int]
             ) -> Iterator[tuple[int, list[int]]]:
        R, mode, n_max = self.rows, sampling.mode, sampling.max_new_tokens
        # Every graph this call can replay, captured before any prefill: a live row's position stays below
        # prompt + max_new - 1.
        top = self._span(max(map(len, prompts)) + n_max - 1)
        # the per-row kernel reads each row's own slots whatever the span: one graph serves every position and call
        span_of = (lambda slots: self.spans[-1]) if self.static.row_kernel else self._span
        programs = {span_of(s): self._program(mode, span_of(s)) for s in self.spans
                    if self._span(min(map(len, prompts)) + 1) <= s <= top and n_max > 1}
        compacted = {w: self._program(mode, self.spans[-1], w) for w in self.widths if n_max > 1}
        self.seed.fill_(seed32(sampling.seed))
        self.temperature.fill_(sampling.temperature or 1.0)
        self.top_p.fill_(sampling.top_p)
        self.done.fill_(True)
        held: list[int | None] = [None] * R  # the prompt each row holds
        since = [0] * R  # the clock when it was filled
        queue = iter(range(len(prompts)))
        t, checked, waiting = 0, -1, len(prompts)
        spans = Spans(self.device)  # marks only: read after the loop

        def refill(free: list[int]) -> None:
            nonlocal waiting
            taken = [(r, i) for r, i in zip(free, queue)]
            waiting -= len(taken)
            if taken:
                spans.start(PREFILL)
                self._fill([r for r, _ in taken], [prompts[i] for _, i in taken], [streams[i] for _, i in taken],
                           sampling)
                spans.stop(PREFILL)
                for r, i in taken:
                    held[r], since[r] = i, t
            self._count(refilled=sum(1 for r, _ in taken if r in refilled_rows))
            refilled_rows.update(r for r, _ in taken)

        def narrow() -> int | None:
            """Once no prompt waits: the narrowest compacted width that holds the live rows (None: every row); a
            narrower one than the last gets its rows (the live ones, then ended ones) on the device."""
            live = [r for r in range(R) if held[r] is not None]
            fit = [w for w in compacted if w >= len(live)]
            if waiting or not fit or (width is not None and fit[-1] >= width):
                return width
            idle = [r for r in range(R) if held[r] is None]
            index = torch.tensor(sorted(live + idle[:fit[-1] - len(live)]))
            # pinned, the copy joins the stream without a host wait (torch's pinned allocator keeps it until done)
            self.compact_rows[fit[-1]].copy_(index.pin_memory() if index.device != self.device else index,
                                             non_blocking=True)
            return fit[-1]

        refilled_rows, width = set(), None  # width: the compacted steps' (None: every row steps)
        refill(list(range(R)))
        width = narrow()
        while any(i is not None for i in held):
            live = [r for r in range(R) if held[r] is not None]
            due = min(since[r] + n_max - 1 for r in live)  # some row has surely ended by then
            if t >= due or ((t + 1) % CHECK_EVERY == 0 and t != checked):
                checked = t
                spans.stop(STEP)
                self._count(checks=1)
                done = self.done.tolist()  # SYNC: one per check
                ended = [r for r in live if done[r]]
                if not ended and t >= due:
                    raise RuntimeError(f"no row ended by step {t}, where a row's max_new_tokens had run out")
                if ended:
                    # An answer is its history from the prompt's end through its first stop id, or max_new_tokens
                    # tokens without one: what lies after it (a previous prompt's tokens) is cut either way.
                    lo = min(len(prompts[held[r]]) for r in ended)
                    hi = max(len(prompts[held[r]]) for r in ended) + n_max
                    rows = self.history.index_select(0, torch.tensor(ended).to(self.device))[:, lo:hi].tolist()
                    for r, row in zip(ended, rows):  # SYNC above: once per check where rows ended
                        i = held[r]
                        held[r] = None
                        start = len(prompts[i]) - lo
                        answer = cut_at_stop(row[start:start + n_max], self.stop_ids)
                        self._count(prompts=1, generated=len(answer))
                        yield i, answer
                    refill(ended)
                width = narrow()
                continue
            reach = max(min(len(prompts[held[r]]) + t - since[r], len(prompts[held[r]]) + n_max - 2) for r in live)
            spans.start(STEP)
            self._count(steps=1, occupied=len(live), tail_steps=int(not waiting), compact_steps=int(width is not None),
                        slot_steps=width or R)
            (programs[span_of(reach + 1)] if width is None else compacted[width])()
            t += 1
        took = spans.seconds()  # after the loop's last sync: no wait
        self.last_run = RunStats(rows=R, **self._counts, prefill_s=took[PREFILL], step_s=took[STEP])


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
