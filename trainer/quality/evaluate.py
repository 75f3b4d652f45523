"""Evaluate a trained drafter against its target on held-out prompts (composes trainer.eval and trainer.decode).

- simulated tau: the trainer's own `evaluate_run` (teacher-forced blocks on the held-out regenerated answers);
- real speculative decoding at batch size 1: mean tau, acceptance per block position, whether every output equals
  target-only greedy decoding token for token, and the wall-clock speedup over target-only decoding (same prompts,
  same max_new_tokens, timed back to back after untimed warm-up decodes);
- whether that decoding was lossless by construction (trainer/decode/lossless.py: the kernels, dtype and engine
  that ran, and the GEMMs' row identity measured here), next to the prompts whose outputs differed.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.decode import lossless
from trainer.decode.decoders import capacity_for, decoders, engine_for, sync
from trainer.decode.reference import generate_target_only
from trainer.decode.rounds import acceptance_stats, capped_rounds
from trainer.decode.stops import model_stop_ids
from trainer.quality.config import EvalCfg
from trainer.quality.regenerate import chat_prompt_ids


@dataclass(frozen=True)
class DecodeTiming:
    prompts: int
    tokens: int
    target_s: float
    speculative_s: float
    identical: int  # prompts whose speculative output == target-only output

    @property
    def speedup(self) -> float | None:
        return round(self.target_s / self.speculative_s, 3) if self.speculative_s > 0 else None


def repeated_ngram_fraction(tokens: list[int], n: int = 4) -> float:
    """Fraction of the n-grams of `tokens` that already occurred earlier in it: 0 for fresh text, near 1 for a loop.
    A looping target is trivially easy to draft, so tau must be read next to this number."""
    seen: set[tuple[int, ...]] = set()
    repeats = total = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        repeats += gram in seen
        total += 1
        seen.add(gram)
    return repeats / total if total else 0.0


def heldout_prompts(eval_jsonl: Path) -> list[str]:
    """The user turns of the regenerated held-out file, in file order."""
    import json

    with Path(eval_jsonl).open(encoding="utf-8") as f:
        return [json.loads(line)["conversations"][0]["content"] for line in f if line.strip()]


def replay_stats(target, drafter, block_size: int, decoded: list[tuple[list[int], list[int]]],
                 results: list) -> dict:
    """Untimed: each decoded answer replayed through the training layout (`trainer.eval.replayed_rounds`), with the
    drafter under the numerics the decode ran it in (bf16 autocast on CUDA). `replayed_equal` counts the prompts
    whose replayed rounds equal the real rounds; `replayed_tau` is their mean tau."""
    from trainer.eval import replayed_rounds

    on_cuda = target.device.type == "cuda"
    rounds, equal = [], 0
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda):
        for (ids, want), got in zip(decoded, results):
            replayed = replayed_rounds(target, drafter, ids, want, block_size)
            rounds += replayed
            equal += replayed == capped_rounds(got.accepted, len(want))
    return {"replayed_tau": round(sum(a + 1 for a in rounds) / len(rounds), 4) if rounds else None,
            "replayed_equal": equal}


def decode_benchmark(target, drafter, block_size: int, prompts: list[str], cfg: EvalCfg, log=print,
                     progress: Callable[[int, int], None] | None = None) -> dict:
    """Batch-1 greedy decoding of each prompt, target-only then speculative, each answer ending at the stop rule's
    first stop id (trainer/decode/stops.py: regenerate's) or at max_new_tokens -> stats dict. progress(prompts
    decoded, their tokens) after each prompt, outside the timed decodes."""
    device = target.device
    tok = target.tokenizer
    stops = model_stop_ids(target.model, tok)
    encoded = [chat_prompt_ids(tok, p) for p in prompts[:cfg.prompts]]
    t_setup = time.perf_counter()
    engine = engine_for(cfg.engine, target, log)
    target_only, speculative, compiled, attention, norms = decoders(
        target, drafter, block_size, capacity_for(encoded, cfg.max_new_tokens), engine=engine,
        compile=cfg.compile, invariant=cfg.invariant, log=log)
    for ids in encoded[:1] * cfg.warmup:
        target_only(ids, cfg.max_new_tokens, stops)
        speculative(ids, cfg.max_new_tokens, stops)
    results, decoded, repeats, same, t_target, t_spec, tokens = [], [], [], [], 0.0, 0.0, 0
    host_s: dict[str, float] = {}
    first_output = None
    setup_s = time.perf_counter() - t_setup  # graph capture, compilation, warm-up
    deadline = time.perf_counter() + cfg.budget_s
    for ids in encoded:
        if time.perf_counter() > deadline:
            break
        sync(device)
        t0 = time.perf_counter()
        want = target_only(ids, cfg.max_new_tokens, stops)
        sync(device)
        t1 = time.perf_counter()
        got = speculative(ids, cfg.max_new_tokens, stops, host_s=host_s)
        sync(device)
        t2 = time.perf_counter()
        t_target, t_spec = t_target + t1 - t0, t_spec + t2 - t1
        tokens += len(want)
        same.append(got.tokens == want)
        results.append(got)
        decoded.append((ids, want))
        repeats.append(repeated_ngram_fraction(want))
        if first_output is None:
            first_output = want
        if progress is not None:
            progress(len(results), tokens)
    # The static engine checks itself against the HF-cache reference once (untimed): `identical` compares the
    # engine with itself, this compares it with HF.
    matches_hf = None
    if engine == "static" and first_output is not None:
        matches_hf = generate_target_only(target, encoded[0], cfg.max_new_tokens, stops) == first_output
    t_replay = time.perf_counter()
    replay = replay_stats(target, drafter, block_size, decoded, results)
    replay_s = time.perf_counter() - t_replay
    timing = DecodeTiming(prompts=len(results), tokens=tokens, target_s=round(t_target, 4),
                          speculative_s=round(t_spec, 4), identical=sum(same))
    numerics = lossless.Numerics(engine=engine, dtype=str(target.embed_tokens.weight.dtype).replace("torch.", ""),
                                 norms=norms, attention=attention, target_compiled=compiled == "all",
                                 gemm_rows_identical=lossless.gemm_rows_identical(target.model, block_size))
    verdict = lossless.verdict(numerics, same)
    stats = acceptance_stats(results, block_size)
    rounds = max(1, sum(r.rounds for r in results))
    # A round's wall time (static: replay + sync; hf: host time split draft / verify / accept) next to one
    # target-only decode step: speedup ~= tau * step / round.
    round_ms = {k: round(1e3 * v / rounds, 3) for k, v in host_s.items()}
    out = {**stats, "prompts": timing.prompts, "tokens": timing.tokens, "identical": timing.identical,
           "stop_ids": list(stops), "ended_on_stop": sum(bool(want) and want[-1] in stops for _ids, want in decoded),
           "target_s": timing.target_s, "speculative_s": timing.speculative_s, "speedup": timing.speedup,
           "target_tok_s": round(tokens / t_target, 1) if t_target else None,
           "speculative_tok_s": round(tokens / t_spec, 1) if t_spec else None,
           "block_size": block_size, "device": str(device), "engine": engine, "compile": compiled,
           "attention": attention, "norms": norms, "lossless": verdict,
           "matches_hf": matches_hf, **replay,
           "round_ms": round_ms, "setup_s": round(setup_s, 1), "replay_s": round(replay_s, 1),
           "target_step_ms": round(1e3 * t_target / tokens, 3) if tokens else None,
           "repeated_4gram_frac": round(sum(repeats) / len(repeats), 4) if repeats else None}
    log(f"decode ({engine}): tau {out['tau']} over {out['rounds']} rounds, "
        f"{timing.identical}/{timing.prompts} identical, "
        f"speedup {timing.speedup}x ({out['target_tok_s']} -> {out['speculative_tok_s']} tok/s); one round "
        f"{sum(round_ms.values()):.2f} ms {round_ms} vs one target step {out['target_step_ms']} ms; replayed in the "
        f"training layout: tau {out['replayed_tau']}, {out['replayed_equal']}/{timing.prompts} prompts round for round; "
        f"set-up {setup_s:.1f}s, timed {t_target + t_spec:.1f}s, replay {replay_s:.1f}s")
    log(f"decode ({engine}): {lossless.describe(verdict)}")
    return out
