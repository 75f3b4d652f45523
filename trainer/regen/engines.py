"""The answering seam of `trainer regenerate` and the quality pipeline: `answerer(...)` -> Answerer, whose
stream(prompts, streams, deadline) yields (prompt index, new tokens through its first stop id, kept) as each answer
ends (an answer that reaches max_new_tokens without one keeps all its tokens; which ids stop it:
trainer/decode/stops.py).

  static  trainer.decode.generate.BatchGenerator: one static KV cache (and a hybrid's recurrent states) of `rows`
          slots that every prompt passes through, a slot taking the next prompt when its answer ends, one CUDA graph
          replay per token. Where it refuses the target (a family it does not serve) or cannot be built, one note
          line and the hf engine instead (`used` "hf"); where it raises midway, one note line and the hf engine
          answers the prompts not yet answered (`used` "static->hf").
  hf      trainer.decode.generate.hf_generate: HF `generate` over left-padded batches (KV cache, launch-bound), the
          reference.
"""
from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace

import torch

from trainer.regen.plan import SamplingSettings


def load_generation_target(path, device: torch.device, dtype: str):
    """The full target for generation (trainer.model.target.Target, untruncated). Generation drafts nothing, so the
    drafter's mask token is set to an id that passes the mask rule rather than read from the tokenizer (a target
    without a spare embedding row would otherwise be refused for a token it never uses here)."""
    from transformers import AutoTokenizer

    from trainer.model.target import load_target

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    unused = next(i for i in range(3) if i not in (tok.pad_token_id, tok.eos_token_id))
    return load_target(path, num_draft_layers=1, device=device, dtype=dtype, truncate=False, mask_token_id=unused)


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else 'no message'}"


# how a lost CUDA context reads: torch's errors, and Triton's launcher's for our kernels
LOST_CONTEXT = ("CUDA error", "Triton Error [CUDA]", "illegal memory access")


def hf_can_go_on(exc: Exception) -> bool:
    """Whether HF generate can answer what the static engine left after it raised `exc`: not after a CUDA error,
    which loses the device's context for every engine."""
    return not (type(exc).__name__ == "AcceleratorError" or any(s in str(exc) for s in LOST_CONTEXT))


class Answerer:
    """The static generator `gen` while it runs, HF `generate` (batches of `batch`) otherwise. `used`: "static",
    "hf" (asked for, or the static engine could not be built), or "static->hf" (it failed midway). Not thread-safe:
    one stream at a time, in the thread that built it (the static engine captures its graphs on its first stream)."""

    def __init__(self, target, gen, sampling, stops: Sequence[int], pad_id: int, batch: int, log=print) -> None:
        self.target, self.gen, self.sampling, self.pad_id, self.batch, self.log = \
            target, gen, sampling, pad_id, batch, log
        self.stops = [int(s) for s in stops]
        self.used = "static" if gen is not None else "hf"
        self.hf_batches = 0  # HF batch k samples with seed + k

    def stream(self, prompts: list[list[int]], streams: Sequence[int] | None = None,
               deadline: float | None = None) -> Iterator[tuple[int, list[int]]]:
        """(prompt index, its new tokens) as each answer ends, each prompt once. streams: one id per prompt, the
        static engine's sampling noise stream (a prompt's samples do not depend on the slot or time it lands in;
        default: its index). deadline (a time.perf_counter() value): the static stream ends after the first answer
        past it, HF starts no batch after it."""
        if not prompts:
            return
        deadline = math.inf if deadline is None else deadline
        answered: set[int] = set()
        if self.used == "static":
            if self.gen is None:
                raise RuntimeError("this Answerer is closed: its static generator was freed")
            try:
                for i, tokens in self._static(prompts, streams, deadline):
                    answered.add(i)
                    yield i, tokens
                return
            except Exception as exc:  # noqa: BLE001 -- a failure of the fast path; HF generate is the reference
                if not hf_can_go_on(exc):
                    raise
                note = _first_line(exc)
            self.log(f"note: the static engine failed ({note}) after {len(answered)} of {len(prompts)} answers; "
                     f"the hf engine answers the other {len(prompts) - len(answered)}")
            # out of the except clause: its traceback holds the generator's frames, which close() must free
            self.close()
            self.used = "static->hf"
        rest = [i for i in range(len(prompts)) if i not in answered]
        yield from self._hf(prompts, rest, deadline)

    def _static(self, prompts, streams, deadline) -> Iterator[tuple[int, list[int]]]:
        answers = self.gen.generate_stream(prompts, self.sampling, streams=streams)
        try:
            for i, tokens in answers:
                yield i, tokens
                if time.perf_counter() > deadline:
                    return
        finally:
            answers.close()  # an early end: the generator's rows are reset by its next call

    def _hf(self, prompts, order: list[int], deadline) -> Iterator[tuple[int, list[int]]]:
        from trainer.decode.generate import hf_generate

        for at in range(0, len(order), self.batch):
            if time.perf_counter() > deadline:
                return
            # HF draws from torch's RNG: one seed per batch, in order (reproducible for the same batches, not per
            # prompt), wrapping within torch's seed range
            seeded = replace(self.sampling, seed=(self.sampling.seed + self.hf_batches) % 2 ** 64)
            self.hf_batches += 1
            chunk = order[at:at + self.batch]
            yield from zip(chunk, hf_generate(self.target.model, [prompts[i] for i in chunk], seeded, self.stops,
                                              self.pad_id))

    def answer(self, prompts: list[list[int]], streams: Sequence[int] | None = None) -> list[list[int]]:
        """Every answer, in prompt order."""
        out: list[list[int]] = [[] for _ in prompts]
        for i, tokens in self.stream(prompts, streams):
            out[i] = tokens
        return out

    def close(self) -> None:
        """Free the static cache and its graphs now (they hold GBs at a GPU batch); a static Answerer then streams
        no more."""
        self.gen = None
        gc.collect()  # a graph's callable refers back to its owner: a cycle
        if torch.cuda.is_initialized():
            try:
                torch.cuda.empty_cache()  # the graphs' pools back to the device, for HF or the next stage
            except RuntimeError as exc:  # a device in error: the caller's own error says why, not this one
                self.log(f"note: the static engine's memory was not returned to the device ({_first_line(exc)})")


def answerer(engine: str, target, *, rows: int, max_len: int, stops: Sequence[int], sampling: SamplingSettings,
             pad_id: int, batch: int | None = None, log=print) -> Answerer:
    """Build the engine -> Answerer. static: `rows` refilled slots of `max_len` positions (the graphs are captured on
    the first stream, in the calling thread); hf, and the fallback: batches of `batch` (default `rows`) in order,
    each batch's answers when it ends."""
    from trainer.decode.generate import Sampling

    engine_sampling = Sampling(**asdict(sampling))
    gen = None
    if engine == "static":
        try:
            from trainer.decode.generate import BatchGenerator

            gen = BatchGenerator(target, rows, max_len, list(stops))
        except Exception as exc:  # noqa: BLE001 -- a refused family, a failed build: hf is the reference
            log(f"note: the static engine cannot serve this target ({_first_line(exc)}); generating with the hf "
                f"engine")
    return Answerer(target, gen, engine_sampling, stops, pad_id, batch or rows, log)
