"""Batched generation benchmark: generated tokens/s of the static, graph-replayed engine
(`trainer.decode.generate.BatchGenerator`) against HF `generate` (`hf_generate`) on the same batch, prompts and
max_new_tokens.

    python3 -m bench.generate --shape small --batch 32 --prompt-tokens 128 --new-tokens 256
    python3 -m bench.generate --shape qwen3-8b --batch 32 --prompt-tokens 128 --new-tokens 256

Run from the repository root. Target: a random-init model of a named shape (bench/shapes.py: the Qwen3 shapes tiny,
small, qwen3-8b; the MoE and sink shapes qwen3-30b-a3b, gpt-oss-20b; the hybrids, which the static engine refuses:
`--engines hf` only), built on the device in bf16 on CUDA (fp32 on CPU, or --dtype) with the options the trainer
loads it with (its experts as grouped GEMMs), prepared by `prepare_target` (frozen, untruncated). Prompts: `--batch` random token sequences of seeded lengths between half of `--prompt-tokens` and
all of it (the rows' lengths differ, so the static engine's left padding is exercised). No stop ids: every row
generates exactly `--new-tokens` tokens in both engines. Greedy by default (`--temperature`, `--top-p` sample).

Per engine, after one untimed warm-up batch (the static engine captures its graphs there; HF warms its kernels):
the median over `--repeats` batches of the wall time of a whole batch (prefill included, synced before and after).
tokens/s = batch * new_tokens / wall; ms per token step = wall / new_tokens (one step serves the whole batch);
peak memory: the allocator's peak during the engine's batches (CUDA; CPU: the process's peak RSS). Each engine's
state is freed before the next one is built. Prints one `GENERATE_BENCH {json}` per engine, then
`GENERATE_RATIO {json}` (static tokens/s over HF's; greedy: the fraction of rows whose tokens agree, which bf16
rounding may lower below 1) and a table.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

ENGINES = ("static", "hf")


def parse(argv: list[str]) -> argparse.Namespace:
    from bench.shapes import SHAPES

    p = argparse.ArgumentParser(prog="python -m bench.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", help=f"named target shape: {', '.join(SHAPES)} (default: small)")
    p.add_argument("--engines", default="static,hf", help="comma list of static, hf (default: %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="prompts per batch (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="the longest prompt (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per engine (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="the target's dtype; auto: bf16 on CUDA, fp32 on CPU (default: %(default)s)")
    a = p.parse_args(argv)
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        p.error(f"--engines must be a comma list of {', '.join(ENGINES)}, got {a.engines!r}")
    if a.shape not in SHAPES:
        p.error(f"unknown --shape {a.shape!r}; choose one of {', '.join(SHAPES)}")
    low = [name for name in ("batch", "prompt_tokens", "new_tokens", "repeats") if getattr(a, name) < 1]
    if low:
        p.error(f"--{low[0].replace('_', '-')} must be >= 1")
    if not (a.temperature >= 0 and 0 < a.top_p <= 1):
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")
    a.engines = engines
    return a


def random_target(shape: str, max_len: int, device, dtype: str):
    """A random-init causal LM of the named shape on `device` (a Qwen3ForCausalLM for the Qwen3 shapes; the others as
    `load_target` loads their family: HF's attention for it, the experts as grouped GEMMs), prepared as a full
    (untruncated) target."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    from bench.shapes import SHAPES, qwen3_config, target_config
    from trainer.model.target import hf_attention, load_options, pick_dtype, prepare_target
    from trainer.tiny import build_tokenizer

    torch.manual_seed(0)
    with torch.device(device):
        if SHAPES[shape]["model_type"] == "qwen3":
            model = Qwen3ForCausalLM._from_config(qwen3_config(shape, max_len), dtype=pick_dtype(dtype, device),
                                                  attn_implementation="sdpa")
        else:
            config = target_config(shape, max_len)
            model = AutoModelForCausalLM.from_config(config, dtype=pick_dtype(dtype, device),
                                                     attn_implementation=hf_attention(config), **load_options(config))
    model = model.to(device)  # a no-op where the device context was honoured
    # The tokenizer only supplies the mask token id the Target needs (decoding never uses it).
    return prepare_target(model, build_tokenizer(), num_draft_layers=1, truncate=False)


def bench_prompts(batch: int, longest: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """`batch` random prompts of seeded lengths in [ceil(longest / 2), longest]; the first is `longest` long."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = [longest] + torch.randint(-(-longest // 2), longest + 1, (batch - 1,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def measure(engine: str, target, prompts: list[list[int]], sampling, repeats: int) -> tuple[dict, list]:
    """-> (figures, the last batch's tokens)."""
    import torch

    from bench.timing import peak_memory, reset_peak
    from trainer.decode.decoders import sync
    from trainer.decode.generate import BatchGenerator, hf_generate

    device = target.device
    t0 = time.perf_counter()
    if engine == "static":
        gen = BatchGenerator(target, len(prompts), max(map(len, prompts)) + sampling.max_new_tokens, stop_ids=[])
        run = lambda: gen.generate(prompts, sampling)  # noqa: E731
    else:
        run = lambda: hf_generate(target.model, prompts, sampling, [], pad_id=0)  # noqa: E731
    run()  # warm-up; the static engine captures its graphs here
    setup_s = time.perf_counter() - t0
    reset_peak(device)
    walls = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = run()
        sync(device)
        walls.append(time.perf_counter() - start)
    peak, _reserved = peak_memory(device)
    tokens = sum(map(len, out))
    wall = statistics.median(walls)
    figures = {"engine": engine, "batch": len(prompts), "prompt_tokens": [min(map(len, prompts)),
                                                                          max(map(len, prompts))],
               "new_tokens": sampling.max_new_tokens, "generated_tokens": tokens,
               "wall_s": round(wall, 4), "wall_s_spread": [round(min(walls), 4), round(max(walls), 4)],
               "tokens_per_s": round(tokens / wall, 1),
               "ms_per_token_step": round(1e3 * wall / sampling.max_new_tokens, 3),
               "peak_gib": round(peak, 3), "setup_s": round(setup_s, 2),
               "attention": gen.static.attention if engine == "static" else "hf",
               "device": str(device), "dtype": str(target.embed_tokens.weight.dtype).replace("torch.", ""),
               "torch": torch.__version__}
    if engine == "static":
        del gen, run
    gc.collect()  # a generator's graphs refer back to it (a cycle): free its cache before the next engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return figures, out


def table(results: list[dict], ratio: float | None) -> str:
    lines = [f"{'engine':8} {'tok/s':>10} {'ms/step':>9} {'wall s':>8} {'peak GiB':>9} {'setup s':>8}"]
    for r in results:
        lines.append(f"{r['engine']:8} {r['tokens_per_s']:10.1f} {r['ms_per_token_step']:9.3f} {r['wall_s']:8.3f} "
                     f"{r['peak_gib']:9.2f} {r['setup_s']:8.2f}")
    if ratio is not None:
        lines.append(f"static / hf tokens/s: {ratio:.2f}x")
    return "\n".join(lines)


def static_refusal(shape: str, engines: list[str]) -> str | None:
    """Why the static engine cannot serve this shape's family (from its config alone), or None."""
    if "static" not in engines:
        return None
    from bench.shapes import target_config
    from trainer.decode.stack import check_supported
    from trainer.errors import ConfigError

    try:
        check_supported(target_config(shape, 1))
    except ConfigError as e:
        return f"--shape {shape}: {e}; use --engines hf"
    return None


def cpu_refusal(shape: str, cuda: bool) -> str | None:
    """Pure: why this bench cannot run here, or None (a GPU shape on a CPU takes minutes and models nothing)."""
    if cuda or shape == "tiny":
        return None
    return f"--shape {shape} is a GPU shape and this run has no CUDA device; on a CPU use --shape tiny"


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    from trainer.decode.generate import Sampling
    from trainer.placement import local_device

    device = local_device(args.device)
    refusal = static_refusal(args.shape, args.engines) or cpu_refusal(args.shape, device.type == "cuda")
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    sampling = Sampling(max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p)
    target = random_target(args.shape, args.prompt_tokens + args.new_tokens, device, args.dtype)
    prompts = bench_prompts(args.batch, args.prompt_tokens, target.embed_tokens.weight.shape[0])
    results, outputs = [], {}
    with torch.no_grad():
        for engine in args.engines:
            figures, outputs[engine] = measure(engine, target, prompts, sampling, args.repeats)
            results.append(figures)
            print("GENERATE_BENCH " + json.dumps(figures), flush=True)
    speed = {r["engine"]: r["tokens_per_s"] for r in results}
    ratio = None
    if set(speed) == set(ENGINES):
        ratio = round(speed["static"] / speed["hf"], 3)
        agree = None
        if sampling.mode == "greedy":
            agree = round(sum(a == b for a, b in zip(outputs["static"], outputs["hf"])) / len(prompts), 4)
        print("GENERATE_RATIO " + json.dumps({"shape": args.shape, "static_over_hf": ratio,
                                              "greedy_rows_equal": agree}), flush=True)
    print(table(results, ratio), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
