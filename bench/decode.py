"""Decoding-speed benchmark, independent of drafter quality: what one target-only decode step and one speculative
round cost at batch 1, per engine. A round's cost does not depend on how many drafts are accepted (fixed shapes), so
with any drafter the speedup a drafter of mean acceptance tau would reach is tau * step_ms / round_ms.

    python -m bench.decode --engines hf,static,static+compile-drafter,static+compile
    python -m bench.decode --target DIR --drafter DIR/export   # a trained pair (e.g. a quality run's)

Default model: the quality_gpu target shape (Qwen3, 16 layers, hidden 512, 8/4 heads of 64, vocab 8192, ~55M params,
random init) in fp32 and a random 3-layer drafter tapping layers 1, 7, 13 (DFlash's spacing); `--layers N` another
depth (taps by the same rule). Run from the repository root. Prints one `DECODE_BENCH {json}` per engine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


# engine name -> what the static decoder compiles ("hf" ignores it)
ENGINES = {"hf": "none", "static": "none", "static+compile-drafter": "drafter", "static+compile": "all"}


def random_pair(device: torch.device, block_size: int, dtype: torch.dtype = torch.float32, *, num_layers: int):
    """A random Qwen3 target of the quality recipe's width (tapped, untruncated; `num_layers` deep) and a random
    3-layer drafter tapping the layers DFlash's rule picks."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.model.drafter import Drafter, DrafterConfig
    from trainer.model.target import Target, _tap_hook, build_target_layer_ids

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=num_layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.config._attn_implementation = "sdpa"
    layer_ids = tuple(build_target_layer_ids(num_layers, 3))
    taps: dict = {}
    for i in layer_ids:
        model.model.layers[i].register_forward_hook(_tap_hook(taps, i))
    target = Target(model=model, tokenizer=None, layer_ids=layer_ids, num_layers=num_layers, mask_token_id=8191,
                    truncated=False, _taps=taps)
    drafter = Drafter(DrafterConfig.from_target(cfg, num_layers=3, num_taps=3)).to(device).eval()
    return target, drafter, block_size


def trained_pair(target_dir: str, drafter_dir: str, device: torch.device, dtype: str = "float32"):
    from pathlib import Path

    from trainer.export import load_pair

    target, drafter, ecfg = load_pair(Path(drafter_dir), Path(target_dir), device, dtype)
    return target, drafter, ecfg.block_size


def wall_s(fn, device: torch.device):
    """-> (wall seconds of fn(), its result), synced before and after so the device's queued work is counted."""
    from trainer.decode.decoders import sync

    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def measure(engine: str, target, drafter, block_size: int, prompt: list[int], new_tokens: int, repeats: int,
            invariant: bool = False) -> dict:
    """Median over `repeats` of (seconds per target-only token, seconds per speculative round). Each figure is the
    difference between a decode of `new_tokens` and one of half as many, divided by the extra tokens (rounds): the
    prefill and the per-sequence set-up cancel out."""
    from trainer.decode.decoders import capacity_for, decoders

    t0 = time.perf_counter()
    target_only, speculative, compiled, attention, _norms = decoders(
        target, drafter, block_size, capacity_for([prompt], new_tokens), engine="hf" if engine == "hf" else "static",
        compile=ENGINES[engine], invariant=invariant)
    target_only(prompt, new_tokens)  # warm-up (and, compiled, the compilation)
    speculative(prompt, new_tokens)
    setup_s = time.perf_counter() - t0
    device = target.device

    def timed(fn, n: int):
        return wall_s(lambda: fn(prompt, n), device)

    short = new_tokens // 2
    steps, rounds, target_fixed, spec_fixed = [], [], [], []
    for _ in range(repeats):
        (t_long, out_long), (t_short, out_short) = timed(target_only, new_tokens), timed(target_only, short)
        (s_long, res_long), (s_short, res_short) = timed(speculative, new_tokens), timed(speculative, short)
        steps.append((t_long - t_short) / max(1, len(out_long) - len(out_short)))
        rounds.append((s_long - s_short) / max(1, res_long.rounds - res_short.rounds))
        # What a decode costs before its first step (round): a 1-token decode is the prefill alone (speculative:
        # with the drafter's context reset).
        target_fixed.append(timed(target_only, 1)[0])
        spec_fixed.append(timed(speculative, 1)[0])
    step, rnd = statistics.median(steps), statistics.median(rounds)
    # The long decodes no slower than the short ones: noise (a loaded machine, too few tokens) swamped the extra
    # tokens, and no ratio of the two differences means anything. Said in the record, not printed as figures.
    noisy = step <= 0 or rnd <= 0
    return {"engine": engine, "compiled": compiled, "attention": attention, "step_ms": round(1e3 * step, 4),
            "round_ms": round(1e3 * rnd, 4), "noisy": noisy,
            "round_over_step": None if noisy else round(rnd / step, 3),
            "fixed_ms": {"target_only": round(1e3 * statistics.median(target_fixed), 3),
                         "speculative": round(1e3 * statistics.median(spec_fixed), 3)},
            "speedup_at_tau": None if noisy else {str(tau): round(tau * step / rnd, 2) for tau in (2, 3, 4, 5)},
            "spread_step_ms": [round(1e3 * min(steps), 4), round(1e3 * max(steps), 4)],
            "setup_s": round(setup_s, 1), "block_size": block_size, "prompt_tokens": len(prompt),
            "new_tokens": new_tokens, "device": str(device), "torch": torch.__version__}


def _pieces(target, drafter, block_size: int, graphs: bool, compile: str = "none", invariant: bool = False) -> dict:
    """Each piece of a round as a callable over one decoder's static buffers, start at position 200: the decode step
    (1 token), the verify forward (B tokens), the draft, the context append, and (graphs only) the whole round."""
    from trainer.decode.engine import GraphProgram, StaticDecoder
    from trainer.decode.static_draft import StaticDFlashProposer

    proposer = StaticDFlashProposer(target, drafter, block_size, 512)
    decoder = StaticDecoder(target, 512, proposer, block_size, graphs=graphs, compile=compile, invariant=invariant)
    dev = target.device
    block = torch.zeros(1, block_size, dtype=torch.long, device=dev)
    feats = torch.zeros(1, block_size, len(target.layer_ids) * target.hf_config.hidden_size, device=dev)
    fns = {"step": decoder._decode_step, "verify": lambda: decoder._forward(block, decoder.start),
           "draft": lambda: proposer.draft(decoder.anchor, decoder.start),
           "append": lambda: proposer.append(feats, decoder.start)}

    def rewind() -> None:
        decoder.start.fill_(200)
        decoder.pos.fill_(200)

    rewind()
    if not graphs:
        return {name: (fn, rewind) for name, fn in fns.items()}
    programs = {name: GraphProgram(fn, dev, True) for name, fn in fns.items() if name != "step"}
    return {"step": (decoder.step, rewind), "round": (decoder.round, rewind),
            **{name: (program, rewind) for name, program in programs.items()}}


def breakdown(target, drafter, block_size: int, compile: str, replays: int = 200, invariant: bool = False) -> dict:
    """GPU ms of each piece of a round, each captured as its own graph and replayed `replays` times (200 steps advance
    pos from 200 to 400, inside the 512-slot cache)."""
    out = {}
    for name, (program, rewind) in _pieces(target, drafter, block_size, graphs=True, compile=compile,
                                           invariant=invariant).items():
        rewind()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            if name == "round":
                rewind()  # a round advances start by its accepted count: keep it inside the cache (2 fill kernels)
            program()
        end.record()
        torch.cuda.synchronize(target.device)
        out[name] = round(begin.elapsed_time(end) / replays, 4)
    return out


def setup_costs(target, drafter, block_size: int, prompt: list[int], compile: str, invariant: bool,
                repeats: int = 20) -> dict:
    """Wall ms (median, synced) of what each decode does once before its first step or round: the prefill graph's
    replay (target-only; speculative, which also writes the prompt's context into the drafter), and the same
    forwards run eagerly over the unpadded prompt, as they ran before the prefill became a graph."""
    from trainer.decode.engine import StaticDecoder
    from trainer.decode.static_draft import StaticDFlashProposer

    proposer = StaticDFlashProposer(target, drafter, block_size, 512)
    decoder = StaticDecoder(target, 512, proposer, block_size, compile=compile, invariant=invariant)
    ids = torch.tensor([prompt], dtype=torch.long, device=target.device)
    zero = torch.zeros((), dtype=torch.long, device=target.device)

    def eager(with_reset: bool) -> None:
        _, feats = decoder.static.forward(ids, zero, want_features=with_reset)
        if with_reset:
            proposer.reset(feats)

    pieces = {"prefill": lambda: decoder.prefill(prompt), "prefill_spec": lambda: decoder.prefill_spec(prompt),
              "prefill_eager": lambda: eager(False), "prefill_spec_eager": lambda: eager(True)}
    out = {}
    for name, fn in pieces.items():
        times = [wall_s(fn, target.device)[0] for _ in range(repeats + 1)]
        out[name] = round(1e3 * statistics.median(times[1:]), 3)  # the first call is a warm-up
    return out


def profile_pieces(target, drafter, block_size: int, rows: int = 12) -> None:
    """Top GPU kernels (eager, so every kernel is attributed) of 20 calls of each piece of a round: PROF lines."""
    from torch.profiler import ProfilerActivity, profile

    dev = target.device
    pieces = {name: fn for name, (fn, _) in _pieces(target, drafter, block_size, graphs=False).items()}
    for name, fn in pieces.items():
        fn()
        torch.cuda.synchronize(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize(dev)
        attr = "self_device_time_total"
        events = sorted((e for e in prof.key_averages() if getattr(e, attr, 0) > 0), key=lambda e: -getattr(e, attr))
        total = sum(getattr(e, attr) for e in events) / 20
        print(f"PROF {name}: {total:.1f} us kernel time per call, {sum(e.count for e in events) // 20} kernels")
        for e in events[:rows]:
            print(f"PROF {name}   {getattr(e, attr) / 20:8.1f} us  x{e.count // 20:<4d} {e.key[:110]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="hf,static,static+compile",
                   help=f"comma list of {' | '.join(ENGINES)}")
    p.add_argument("--target", default="", help="target HF directory (default: random quality-shaped target)")
    p.add_argument("--drafter", default="", help="drafter export directory (with --target)")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--layers", type=int, default=16,
                   help="the random target's depth (default 16, quality_gpu's; ignored with --target)")
    p.add_argument("--prompt-tokens", type=int, default=120)
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    p.add_argument("--breakdown", action="store_true",
                   help="CUDA: also print the GPU ms of each piece of a round and the wall ms of the prefill and "
                        "the drafter's reset (DECODE_PIECES), per static engine")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the target's dtype")
    p.add_argument("--profile", action="store_true", help="CUDA: top kernels of a step, a verify and a draft (PROF)")
    p.add_argument("--attention", default="gqa", choices=("gqa", "invariant"),
                   help="static engines: gqa (SDPA, the default) or invariant (the row-invariant Triton kernel, "
                        "which makes a verify equal its decode steps bitwise)")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        print(f"error: unknown engine(s) {bad or engines}; use {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    if args.attention == "invariant" and "static+compile" in engines:
        print("error: --attention invariant keeps the target uncompiled; drop the static+compile engine",
              file=sys.stderr)
        return 2
    if args.new_tokens < 8:
        print("error: --new-tokens must be >= 8 (the figures are differences of two decode lengths)", file=sys.stderr)
        return 2
    if args.layers < 4:
        print("error: --layers must be >= 4 (the drafter taps layers 1..L-3)", file=sys.stderr)
        return 2
    if bool(args.target) != bool(args.drafter):
        print("error: --target and --drafter go together", file=sys.stderr)
        return 2
    from pathlib import Path

    for given in (args.target, args.drafter):
        if given and not (Path(given) / "config.json").is_file():
            print(f"error: {given} has no config.json (a target HF directory / a drafter export directory)",
                  file=sys.stderr)
            return 2
    from trainer.placement import local_device

    device = local_device(args.device)
    if args.target:
        target, drafter, block = trained_pair(args.target, args.drafter, device, args.dtype)
    else:
        target, drafter, block = random_pair(device, args.block, getattr(torch, args.dtype), num_layers=args.layers)
    vocab = target.embed_tokens.weight.shape[0]
    prompt = torch.randint(0, vocab - 1, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    if args.profile and device.type == "cuda":
        profile_pieces(target, drafter, block)
    invariant = args.attention == "invariant"
    for engine in engines:
        record = measure(engine, target, drafter, block, prompt, args.new_tokens, args.repeats, invariant)
        print("DECODE_BENCH " + json.dumps(record), flush=True)
        if record["noisy"]:
            print(f"warning: {engine}: the longer decodes were no slower than the shorter ones (noise): no ratio "
                  f"given; raise --new-tokens or --repeats, on an idle machine", file=sys.stderr)
        if args.breakdown and engine != "hf" and device.type == "cuda":
            pieces = breakdown(target, drafter, block, compile=ENGINES[engine], invariant=invariant)
            once = setup_costs(target, drafter, block, prompt, ENGINES[engine], invariant)
            print("DECODE_PIECES " + json.dumps({"engine": engine, "gpu_ms": pieces, "once_wall_ms": once}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
