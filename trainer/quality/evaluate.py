"""Evaluate a trained drafter against its target on held-out prompts.

- simulated tau: the trainer's own `evaluate_run` (teacher-forced blocks on the held-out regenerated answers);
- real speculative decoding at batch size 1: mean tau, acceptance per block position, whether every output equals
  target-only greedy decoding token for token, and the wall-clock speedup over target-only decoding (same prompts,
  same max_new_tokens, timed back to back after untimed warm-up decodes).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from trainer.quality.config import EvalCfg
from trainer.quality.regenerate import chat_prompt_ids
from trainer.speculative import DFlashProposer, acceptance_stats, generate_speculative, generate_target_only


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: wall-clock timing needs finished kernels


def load_pair(export_dir: Path, target_dir: Path, device: torch.device, target_dtype: str = "auto"):
    """The exported drafter (fp32; run under autocast on CUDA, as in training) and the full target (in
    `target_dtype`) with the drafter's taps and mask id."""
    from trainer.export import load_exported
    from trainer.model.target import load_target

    drafter, ecfg = load_exported(export_dir, device)
    dc = ecfg["dflash_config"]
    target = load_target(target_dir, num_draft_layers=ecfg["num_hidden_layers"],
                         layer_ids=tuple(dc["target_layer_ids"]), mask_token_id=dc["mask_token_id"], device=device,
                         dtype=target_dtype, truncate=False)
    return target, drafter, int(ecfg["block_size"])


class Decoders(NamedTuple):
    """The two decoders of one engine and what they really run (a fallback can differ from what was asked)."""
    target_only: Callable  # (ids, max_new, eos=None) -> tokens
    speculative: Callable  # (ids, max_new, eos=None, host_s=None) -> SpecResult
    compile: str  # none | drafter | all
    attention: str  # sdpa | invariant (the static target's Triton kernel) | hf


def decoders(target, drafter, block_size: int, encoded: list[list[int]], cfg: EvalCfg, compile: str | None = None,
             log=print) -> Decoders:
    """Target-only and speculative decoding for `cfg.engine`. Both use the same target forward, so the comparison is
    one engine against itself. A compilation that fails (torch.compile raises while the graphs are captured) falls
    back to the uncompiled engine, with a note, and the mode used is then "none". `cfg.invariant` where the Triton
    kernel cannot run (no Triton, CPU) decodes with SDPA, with a note."""
    if cfg.engine == "hf":
        proposer = DFlashProposer(target, drafter, block_size)
        def speculative(ids, n, eos=None, host_s=None):
            return generate_speculative(target, proposer, ids, n, eos, host_s=host_s)

        return Decoders(lambda ids, n, eos=None: generate_target_only(target, ids, n, eos), speculative, "none", "hf")
    from trainer.decode.engine import StaticDecoder
    from trainer.decode.static_draft import StaticDFlashProposer

    capacity = -(-(max(map(len, encoded), default=0) + cfg.max_new_tokens) // 64) * 64
    compile = cfg.compile if compile is None else compile

    def build(how: str):
        # Captures its graphs here, in this (the main) thread, before any decoding.
        proposer = StaticDFlashProposer(target, drafter, block_size, capacity)
        return StaticDecoder(target, capacity, proposer, block_size, compile=how, invariant=cfg.invariant)

    try:
        decoder = build(compile)
    except Exception as exc:  # noqa: BLE001 -- any compiler failure; the uncompiled engine is the reference
        if compile == "none":
            raise
        log(f"note: eval.compile={compile} failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            f"decoding uncompiled")
        compile = "none"
        decoder = build(compile)
    attention = decoder.static.attention
    if cfg.invariant and attention != "invariant":
        log("note: eval.invariant: the Triton attention kernel cannot run here (no Triton, or not CUDA); decoding "
            "with SDPA")
    return Decoders(decoder.generate_target_only, decoder.generate_speculative, compile, attention)


def replay_stats(target, drafter, block_size: int, decoded: list[tuple[list[int], list[int]]],
                 results: list) -> dict:
    """Untimed: each decoded answer replayed through the training layout (`trainer.eval.replayed_rounds`), with the
    drafter under the numerics the decode ran it in (bf16 autocast on CUDA). `replayed_equal` counts the prompts
    whose replayed rounds equal the real rounds; `replayed_tau` is their mean tau."""
    from trainer.eval import capped_rounds, replayed_rounds

    on_cuda = target.device.type == "cuda"
    rounds, equal = [], 0
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda):
        for (ids, want), got in zip(decoded, results):
            replayed = replayed_rounds(target, drafter, ids, want, block_size)
            rounds += replayed
            equal += replayed == capped_rounds(got.accepted, len(want))
    return {"replayed_tau": round(sum(a + 1 for a in rounds) / len(rounds), 4) if rounds else None,
            "replayed_equal": equal}


def decode_benchmark(target, drafter, block_size: int, prompts: list[str], cfg: EvalCfg, log=print) -> dict:
    """Batch-1 greedy decoding of each prompt, target-only then speculative -> stats dict."""
    device = target.device
    tok = target.tokenizer
    encoded = [chat_prompt_ids(tok, p) for p in prompts[:cfg.prompts]]
    t_setup = time.perf_counter()
    target_only, speculative, compiled, attention = decoders(target, drafter, block_size, encoded, cfg, log=log)
    for ids in encoded[:1] * cfg.warmup:
        target_only(ids, cfg.max_new_tokens, tok.eos_token_id)
        speculative(ids, cfg.max_new_tokens, tok.eos_token_id)
    results, decoded, repeats, t_target, t_spec, tokens, identical = [], [], [], 0.0, 0.0, 0, 0
    host_s: dict[str, float] = {}
    first_output = None
    setup_s = time.perf_counter() - t_setup  # graph capture, compilation, warm-up
    deadline = time.perf_counter() + cfg.budget_s
    for ids in encoded:
        if time.perf_counter() > deadline:
            break
        sync(device)
        t0 = time.perf_counter()
        want = target_only(ids, cfg.max_new_tokens, tok.eos_token_id)
        sync(device)
        t1 = time.perf_counter()
        got = speculative(ids, cfg.max_new_tokens, tok.eos_token_id, host_s=host_s)
        sync(device)
        t2 = time.perf_counter()
        t_target, t_spec = t_target + t1 - t0, t_spec + t2 - t1
        tokens += len(want)
        identical += got.tokens == want
        results.append(got)
        decoded.append((ids, want))
        repeats.append(repeated_ngram_fraction(want))
        if first_output is None:
            first_output = want
    # The static engine checks itself against the HF-cache reference once (untimed): `identical` compares the
    # engine with itself, this compares it with HF.
    matches_hf = None
    if cfg.engine == "static" and first_output is not None:
        matches_hf = generate_target_only(target, encoded[0], cfg.max_new_tokens, tok.eos_token_id) == first_output
    t_replay = time.perf_counter()
    replay = replay_stats(target, drafter, block_size, decoded, results)
    replay_s = time.perf_counter() - t_replay
    timing = DecodeTiming(prompts=len(results), tokens=tokens, target_s=round(t_target, 4),
                          speculative_s=round(t_spec, 4), identical=identical)
    stats = acceptance_stats(results, block_size)
    rounds = max(1, sum(r.rounds for r in results))
    # A round's wall time (static: replay + sync; hf: host time split draft / verify / accept) next to one
    # target-only decode step: speedup ~= tau * step / round.
    round_ms = {k: round(1e3 * v / rounds, 3) for k, v in host_s.items()}
    out = {**stats, "prompts": timing.prompts, "tokens": timing.tokens, "identical": timing.identical,
           "target_s": timing.target_s, "speculative_s": timing.speculative_s, "speedup": timing.speedup,
           "target_tok_s": round(tokens / t_target, 1) if t_target else None,
           "speculative_tok_s": round(tokens / t_spec, 1) if t_spec else None,
           "block_size": block_size, "device": str(device), "engine": cfg.engine, "compile": compiled,
           "attention": attention,
           "matches_hf": matches_hf, **replay,
           "round_ms": round_ms, "setup_s": round(setup_s, 1), "replay_s": round(replay_s, 1),
           "target_step_ms": round(1e3 * t_target / tokens, 3) if tokens else None,
           "repeated_4gram_frac": round(sum(repeats) / len(repeats), 4) if repeats else None}
    log(f"decode ({cfg.engine}): tau {out['tau']} over {out['rounds']} rounds, "
        f"{timing.identical}/{timing.prompts} identical, "
        f"speedup {timing.speedup}x ({out['target_tok_s']} -> {out['speculative_tok_s']} tok/s); one round "
        f"{sum(round_ms.values()):.2f} ms {round_ms} vs one target step {out['target_step_ms']} ms; replayed in the "
        f"training layout: tau {out['replayed_tau']}, {out['replayed_equal']}/{timing.prompts} prompts round for round; "
        f"set-up {setup_s:.1f}s, timed {t_target + t_spec:.1f}s, replay {replay_s:.1f}s")
    return out


def main(argv: list[str] | None = None) -> int:
    """Re-run the batch-1 decoding benchmark on any export + target + held-out chat JSONL (no retraining):
    python -m trainer.quality.evaluate --drafter DIR/drafter/export --target DIR/target --data DIR/data/eval.jsonl"""
    import argparse
    import json
    import os
    import sys

    p = argparse.ArgumentParser(prog="python -m trainer.quality.evaluate", description=main.__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="drafter export directory (config.json + model.safetensors)")
    p.add_argument("--target", required=True, help="target HF model directory")
    p.add_argument("--data", required=True, help="chat JSONL whose user turns are the prompts")
    p.add_argument("--prompts", type=int, default=EvalCfg.prompts)
    p.add_argument("--max-new", type=int, default=EvalCfg.max_new_tokens)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--target-dtype", default=EvalCfg.target_dtype, choices=("float32", "bfloat16", "auto"))
    p.add_argument("--engine", default=EvalCfg.engine, choices=("static", "hf"),
                   help="static: static caches, CUDA-graph replay per step/round; hf: the DynamicCache reference")
    p.add_argument("--compile", default=EvalCfg.compile, choices=("none", "drafter", "all"),
                   help="static engine: torch.compile nothing, the drafter, or the drafter and the target")
    args = p.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for path in (Path(args.drafter) / "config.json", Path(args.target) / "config.json", Path(args.data)):
        if not path.is_file():
            print(f"error: {path} not found", file=sys.stderr)
            return 2
    target, drafter, block_size = load_pair(Path(args.drafter), Path(args.target), torch.device(args.device),
                                            args.target_dtype)
    cfg = EvalCfg(prompts=args.prompts, max_new_tokens=args.max_new, warmup=1, budget_s=float("inf"),
                  engine=args.engine, compile=args.compile)
    result = decode_benchmark(target, drafter, block_size, heldout_prompts(Path(args.data)), cfg)
    print("DFLASH_DECODE " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
