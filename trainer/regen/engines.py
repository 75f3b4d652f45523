"""The engine seam of regenerate: `answerer(...)` -> answer(prompts, streams) -> new tokens per prompt through its
first stop id (kept; an answer that reaches --max-new without one keeps all its tokens; which ids stop it:
trainer/decode/stops.py).

  static  trainer.decode.generate.BatchGenerator: one static KV cache (and a hybrid's recurrent states) for `rows`
          prompts of varying length, one CUDA graph replay per token. Where it refuses the target (a family it does not serve) or cannot be built, one
          note line and the hf engine instead.
  hf      trainer.decode.generate.hf_generate: HF `generate` over left-padded batches (KV cache, launch-bound), the
          reference.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
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
    # (prompts, streams) -> new tokens per prompt; streams: one id per prompt, the static engine's sampling noise
    # stream (a prompt's samples do not depend on the batch it lands in)
    answer: Callable[[list[list[int]], list[int]], list[list[int]]]
    used: str  # the engine that runs: "static" or "hf"


def answerer(engine: str, target, *, rows: int, max_len: int, stops: Sequence[int], sampling: SamplingSettings,
             pad_id: int, log=print) -> Answerer:
    """Build the engine (the static one captures its graphs on its first batch, in the calling thread) -> Answerer."""
    from trainer.decode.generate import Sampling, hf_generate

    engine_sampling = Sampling(**asdict(sampling))
    batches = [0]

    def hf(prompts: list[list[int]], streams: list[int]) -> list[list[int]]:
        # HF draws from torch's RNG: one seed per batch, in order (reproducible for the same batches, not per prompt)
        seeded = replace(engine_sampling, seed=engine_sampling.seed + batches[0])
        batches[0] += 1
        return hf_generate(target.model, prompts, seeded, stops, pad_id)

    if engine == "hf":
        return Answerer(hf, "hf")
    try:
        from trainer.decode.generate import BatchGenerator

        gen = BatchGenerator(target, rows, max_len, list(stops))
    except Exception as exc:  # noqa: BLE001 -- a refused family, a failed build: hf is the reference
        log(f"note: the static engine cannot serve this target ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else 'no message'}); generating with the hf engine")
        return Answerer(hf, "hf")
    return Answerer(lambda prompts, streams: gen.generate(prompts, engine_sampling, streams=streams), "static")
