"""Pick a decoding engine: target-only and speculative greedy decoders over one target forward, so that a speedup
compares an engine with itself.

    static  static KV caches; a decode step and a speculative round are each one CUDA graph replay (engine.py)
    hf      the HF DynamicCache reference (reference.py), eager
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

ENGINES = ("static", "hf")


class Decoders(NamedTuple):
    """The two decoders of one engine and what they really run (a fallback can differ from what was asked)."""
    target_only: Callable  # (ids, max_new, stops=()) -> tokens (trainer/decode/stops.py)
    speculative: Callable  # (ids, max_new, stops=(), host_s=None) -> SpecResult
    compile: str  # none | drafter | all
    attention: str  # sdpa | eager (soft-capped scores) | invariant (the static target's Triton kernel) | hf
    norms: str  # invariant (every RMSNorm through the Triton kernel) | hf (trainer/decode/lossless.py)


def engine_for(engine: str, target, log=print) -> str:
    """The engine a decode runs on: the one asked for, except that a target the static engine refuses (a family or
    layer kind it has no decode layer for, dynamic RoPE, bidirectional attention: `stack.check_supported`) is decoded
    by the hf engine, after one note line. The hybrids (Qwen3.5, Qwen3.6, Qwen3-Next; dense and MoE) are served."""
    if engine != "static":
        return engine
    from trainer.decode.stack import check_supported
    from trainer.errors import TrainerError

    try:
        check_supported(target.hf_config)
    except TrainerError as e:
        log(f"note: the static engine cannot serve this target ({e}); decoding with the hf engine")
        return "hf"
    return engine


def capacity_for(prompts: list[list[int]], max_new: int, multiple: int = 64) -> int:
    """Cache slots for the longest prompt plus `max_new`, rounded up (one set of graphs serves every prompt). Pure."""
    return -(-(max(map(len, prompts), default=0) + max_new) // multiple) * multiple


def decoders(target, drafter, block_size: int, capacity: int, *, engine: str = "static", compile: str = "none",
             invariant: bool = False, log=print) -> Decoders:
    """Target-only and speculative decoding for `engine`. A compilation that fails (torch.compile raises while the
    graphs are captured) falls back to the uncompiled engine, with a note, and the mode used is then "none".
    A DFlash drafter proposes the head's argmax per mask position, a DFlash2 drafter its selector's greedy walk
    (docs/dflash2.md, "Decoding"). `invariant` where the Triton kernel cannot run (no Triton, CPU) or cannot compute
    the target's attention (sliding windows, soft-capping, sinks, Gemma's norms, MoE experts) decodes with SDPA or
    eager attention, with a note. A hybrid (a target with Gated DeltaNet layers) decodes uncompiled, with SDPA
    attention, whatever `compile` and `invariant` ask (one note when they ask more: its linear layers
    are not traced by torch.compile, and its (1 + w) norms rule the invariant kernel out). The static engine captures
    its graphs here, in the calling (main) thread, before any decoding."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "hf":
        from trainer.decode.reference import DFlashProposer, generate_speculative, generate_target_only

        proposer = DFlashProposer(target, drafter, block_size)

        def speculative(ids, n, stops=(), host_s=None):
            return generate_speculative(target, proposer, ids, n, stops, host_s=host_s)

        return Decoders(lambda ids, n, stops=(): generate_target_only(target, ids, n, stops), speculative, "none", "hf",
                        "hf")
    if _hybrid(target):
        asked = [f"compile={compile}"] * (compile != "none") + ["invariant"] * invariant
        if asked:
            log(f"note: a hybrid target decodes uncompiled, with SDPA attention "
                f"({', '.join(asked)} not applied)")
        compile, invariant = "none", False
    from trainer.decode.drafters.dflash2 import StaticDFlash2Proposer
    from trainer.decode.engine import StaticDecoder
    from trainer.decode.lossless import norm_path
    from trainer.decode.static_draft import StaticDFlashProposer

    # A DFlash2 drafter: its convolutions and selector walk (trainer/decode/drafters/dflash2.py); the hf engine's
    # DFlashProposer picks the same by the drafter's config.
    proposer_cls = StaticDFlashProposer if drafter.cfg.dflash2 is None else StaticDFlash2Proposer

    def build(how: str):
        proposer = proposer_cls(target, drafter, block_size, capacity)
        return StaticDecoder(target, capacity, proposer, block_size, compile=how, invariant=invariant)

    try:
        decoder = build(compile)
    except Exception as exc:  # noqa: BLE001 -- any compiler failure; the uncompiled engine is the reference
        if compile == "none":
            raise
        log(f"note: compile={compile} failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            f"decoding uncompiled")
        compile = "none"
        decoder = build(compile)
    attention = decoder.static.attention
    if invariant and attention != "invariant":
        log(f"note: invariant attention: {decoder.static.fallback}; decoding with "
            f"{'SDPA' if attention == 'sdpa' else 'eager attention'} (a verify is then not bitwise its decode steps)")
    return Decoders(decoder.generate_target_only, decoder.generate_speculative, compile, attention,
                    norm_path(decoder.static))


def _hybrid(target) -> bool:
    """Whether the target has Gated DeltaNet layers (refused first, in one line, where the stack refuses it)."""
    from trainer.decode.stack import check_supported, layer_plan

    check_supported(target.hf_config)
    return "linear" in layer_plan(target.hf_config).mixers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: wall-clock timing needs finished kernels
