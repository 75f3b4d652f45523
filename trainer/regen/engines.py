"""The engine seam of regenerate: `answerer(...)` -> stream(prompts, streams) -> (prompt index, new tokens through
its first stop id, kept) as each answer ends (an answer that reaches --max-new without one keeps all its tokens;
which ids stop it: trainer/decode/stops.py).

  static  trainer.decode.generate.BatchGenerator: one static KV cache (and a hybrid's recurrent states) of `rows`
          slots that every prompt passes through, a slot taking the next prompt when its answer ends, one CUDA graph
          replay per token. Where it refuses the target (a family it does not serve) or cannot be built, one note
          line and the hf engine instead.
  hf      trainer.decode.generate.hf_generate: HF `generate` over left-padded batches (KV cache, launch-bound), the
          reference.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace

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


@dataclass
class Answerer:
    # (prompts, streams) -> (prompt index, its new tokens) as each answer ends; streams: one id per prompt, the
    # static engine's sampling noise stream (a prompt's samples do not depend on the slot or time it lands in)
    stream: Callable[[list[list[int]], list[int]], Iterator[tuple[int, list[int]]]]
    used: str  # the engine that runs: "static" or "hf"

    def answer(self, prompts: list[list[int]], streams: list[int]) -> list[list[int]]:
        """Every answer, in prompt order."""
        out: list[list[int]] = [[] for _ in prompts]
        for i, tokens in self.stream(prompts, streams):
            out[i] = tokens
        return out


def answerer(engine: str, target, *, rows: int, max_len: int, stops: Sequence[int], sampling: SamplingSettings,
             pad_id: int, log=print) -> Answerer:
    """Build the engine (the static one captures its graphs on its first call, in the calling thread) -> Answerer.
    static: all prompts through `rows` refilled slots, answers as they end; hf:
    batches of `rows` in order, each batch's answers when it ends."""
    from trainer.decode.generate import Sampling, hf_generate

    engine_sampling = Sampling(**asdict(sampling))
    batches = [0]

    def hf(prompts: list[list[int]], streams: list[int]) -> Iterator[tuple[int, list[int]]]:
        for at in range(0, len(prompts), rows):
            # HF draws from torch's RNG: one seed per batch, in order (reproducible for the same batches, not per
            # prompt)
            seeded = replace(engine_sampling, seed=engine_sampling.seed + batches[0])
            batches[0] += 1
            for i, tokens in enumerate(hf_generate(target.model, prompts[at:at + rows], seeded, stops, pad_id)):
                yield at + i, tokens

    if engine == "hf":
        return Answerer(hf, "hf")
    try:
        from trainer.decode.generate import BatchGenerator

        gen = BatchGenerator(target, rows, max_len, list(stops))
    except Exception as exc:  # noqa: BLE001 -- a refused family, a failed build: hf is the reference
        log(f"note: the static engine cannot serve this target ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else 'no message'}); generating with the hf engine")
        return Answerer(hf, "hf")
    return Answerer(lambda prompts, streams: gen.generate_stream(prompts, engine_sampling, streams=streams),
                    "static")
