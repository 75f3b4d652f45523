"""Batched generation benchmark: generated tokens/s of the engine regenerate uses (`trainer.regen.engines`: the
static, graph-replayed batch generator of `trainer.decode.generate.BatchGenerator`, or HF `generate` where the static
engine does not serve the family) against HF `generate` (`hf_generate`), on the same prompts, with the step's floor
beside them.

    python3 -m bench.generate --shape small --batch 32 --prompt-tokens 128 --new-tokens 256
    python3 -m bench.generate --shape qwen3-8b --batch 256 --workload mixed --prompts 512 --engines static
    python3 -m bench.generate --shape qwen3-8b --batch 256 --prompt-tokens 256 --new-tokens 256 --target-fp8 1

Run from the repository root. Target: a random-init model of a named shape (bench/shapes.py: every family shape),
built on the device in bf16 on CUDA (fp32 on CPU, or --dtype), prepared by `prepare_target` (frozen, untruncated).
Where the static batch generator refuses the family, the `static` engine's line measures HF `generate` (what regenerate
runs then) and says so (`asked`, `note`); a separate `hf` line is then not measured twice.

Workloads (`--workload`):
  equal   `--batch` random prompts of seeded lengths between half of `--prompt-tokens` and all of it; no stop ids:
          every row generates exactly `--new-tokens` tokens (defaults 128 and 256).
  mixed   `--prompts` prompts (default 2 x --batch) of `--min-prompt-tokens`..`--prompt-tokens` tokens (64..1024),
          each answer ending on a stop id after a seeded length, exponential of mean `--mean-new-tokens` (512), at
          most `--new-tokens` (2048; the first prompt is the longest and gets the longest answer), longest prompt
          first, as regenerate does: the static engine takes them all through `--batch` slots that refill as
          answers end, HF generate in chunks of `--batch`. The lengths are made real by a chain
          target: the random model with every residual write (o_proj, down_proj, out_proj and their biases) zeroed
          and its LM head set to the embedding of a seeded cyclic permutation of the vocabulary, so its greedy next
          token is the permutation's successor of the current one whatever the context; a row whose last prompt
          token lies L steps before the stop id answers exactly L tokens. Zeroed weights cost a GEMM what random
          ones do; `answers_as_drawn` checks every row's length.
Greedy by default (`--temperature`, `--top-p` sample; the mixed lengths hold only greedy).

`--profile N` (CUDA; on a CPU refused in one line, exit 2, before the target is built): after each engine's timed
runs, N more whole runs under torch.profiler, printed as bench/timing.py does for bench.step (PROF: top kernels;
PROFSUM: sums by category and the time no kernel runs; PROFGAP: idle gaps), per token step: divided by N x the
run's token steps (static: its step replays; hf: each chunk's longest answer). Prefill and decode are not split: the
figures are the whole run's, the prefill spread over the steps.

`--target-fp8 1`: the target's decoder-layer linears in FP8 (`trainer.model.fp8_target.quantize_target_layers`, what
`regenerate --target-fp8` runs: e4m3 weights with per-channel scales, per-token activation scales; routed experts,
routers, the embedding and the head stay bf16), quantized in place after the workload is drawn (the mixed workload's
chain is set on the bf16 weights: zeros quantize to zeros) and before either engine is built, so both engines run
the same FP8 modules. CUDA compute capability 9.0+ in bf16, refused in one line (exit 2) before the target is built
elsewhere. Each line records `target_fp8` and, on, `fp8_linears`; the floor stays the bf16 step's.
`--kernels-off NAME,...`: decode kernels to switch off (`trainer/decode/switches.py`, e.g. `moe`: an MoE target's
experts through `trainer/decode/moe_kernel.py`; off, their torch path runs), each one's share of a figure; each line
records the kernels off (`kernels_off`, this flag's and DFLASH_DECODE_KERNELS_OFF's) and, for the static engine, how
many of the target's layers took each kernel's path (`kernel_layers`: `trainer.decode.switches.layers_taking`).

Per engine, after an untimed warm-up (equal: one batch; mixed, static: the first batch with 32 new tokens where the
steps run the per-row attention kernel, one graph for every step, else the whole workload, each attention span's
graph captured; mixed, hf: the first chunk): the median over `--repeats` runs of the wall time of the
whole workload (prefill included, synced before and after). tokens/s = generated tokens / wall; ms per token step =
wall x batch / generated tokens (the time of one full-batch step); peak memory: the allocator's peak during the
engine's runs (CUDA; CPU: the process's peak RSS). The step's floor (bench/floor.py: weights + KV cache read once
at HBM_BYTES_PER_S, the GEMMs at GEMM_FLOPS_PER_S) is computed at the workload's mean context. Prints one
`GENERATE_BENCH {json}` per engine (a hybrid's static line: `linear_step`, "fused" where its Gated DeltaNet step
runs trainer/decode/recurrent_kernel.py, CUDA with fla, else "torch"), then `GENERATE_RATIO {json}` (static tokens/s
over HF's; greedy: the fraction of rows whose tokens agree, which bf16 rounding may lower below 1) and a table.

Where the static engine's time goes (its line, from the last timed run's `BatchGenerator.last_run`, counted on the
host without a sync): `steps` (token-step replays), `busy` (the share of the steps x rows slot-steps in which a row
was live, (generated - prompts) / (steps x rows): an answer's first token is its prefill's), `held` (the share
whose row held a prompt, live or ended and not yet seen by the host's check: held - busy idled between a row's end
and its check, 1 - held for want of a prompt), `tail_steps` (the steps after the last prompt was filled),
`compact_steps` (tail steps over the live rows and a few ended ones only, where the per-row kernel runs),
`slot_steps` (the row-steps computed: each step's width summed; busy and held stay over steps x rows) and
`busy_computed` ((generated - prompts) / slot_steps: the live share of the rows computed), `checks` (host reads of
which rows ended), `fills` (the first fill and each refill), `prefills` (prefill forwards), `prefill_tokens` (prompt
tokens) and `prefill_positions` (the positions those forwards computed, padding included), `prefill_s` and `step_s`
(the prefills' and the steps' time: CUDA events read after the run, on a CPU host time; the rest of the wall is the
host's checks and launches). The mixed workload also prints `EQUAL_LIKE {json}`: the equal workload with the same
rows, mean prompt and mean answer (so the same mean context), its `--prompt-tokens` (the longest prompt whose equal
draw's mean prompt is nearest), `--new-tokens` (the mean answer, rounded) and the command that measures it, the
comparison for "mixed reaches 85% of the equal-length tokens/s".
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time

from bench.generate_workloads import (RESIDUAL_WRITES, bench_prompts, equal_like, make_chain,  # noqa: F401
                                      mixed_lengths, mixed_prompts, workload)
from trainer.decode import switches

ENGINES = ("static", "hf")
WORKLOADS = ("equal", "mixed")
DEFAULTS = {"equal": {"prompt_tokens": 128, "new_tokens": 256}, "mixed": {"prompt_tokens": 1024, "new_tokens": 2048}}


def parse(argv: list[str]) -> argparse.Namespace:
    from bench.shapes import SHAPES

    p = argparse.ArgumentParser(prog="python -m bench.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", help=f"named target shape: {', '.join(SHAPES)} (default: small)")
    p.add_argument("--engines", default="static,hf", help="comma list of static, hf (default: %(default)s)")
    p.add_argument("--workload", default="equal", choices=WORKLOADS,
                   help="equal: one batch, every row --new-tokens, no stop id; mixed: --prompts prompts of varied "
                        "lengths, each answer ending on a stop id at a seeded length (default: %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="rows generated together (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=0, help="mixed: prompts in all (default: 2 x --batch)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="the longest prompt (equal 128, mixed 1024)")
    p.add_argument("--min-prompt-tokens", type=int, default=64, help="mixed: the shortest prompt (default: 64)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="max_new_tokens: equal, every answer; mixed, the longest (equal 256, mixed 2048)")
    p.add_argument("--mean-new-tokens", type=int, default=512, help="mixed: the mean answer asked (default: 512)")
    p.add_argument("--seed", type=int, default=1, help="the workload's lengths and tokens (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="the target's dtype; auto: bf16 on CUDA, fp32 on CPU (default: %(default)s)")
    p.add_argument("--target-fp8", type=int, default=0, choices=(0, 1),
                   help="1: the target's decoder-layer linears in FP8 (as regenerate --target-fp8; CUDA compute "
                        "capability 9.0+, bf16) (default: %(default)s)")
    p.add_argument("--kernels-off", default="", metavar="NAME,...",
                   help="decode kernels to switch off, their torch path run instead (trainer/decode/switches.py: "
                        f"{', '.join(switches.KERNELS)}) (default: none)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed runs, N more whole generations per engine under torch.profiler: the top "
                        "kernels (PROF lines) and their sums by category (PROFSUM), of the whole run (prefill and "
                        "decode together), divided by its token steps (static: step replays; hf: each chunk's "
                        "longest answer); CUDA only (default: 0, off)")
    a = p.parse_args(argv)
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        p.error(f"--engines must be a comma list of {', '.join(ENGINES)}, got {a.engines!r}")
    if a.shape not in SHAPES:
        p.error(f"unknown --shape {a.shape!r}; choose one of {', '.join(SHAPES)}")
    for name, value in DEFAULTS[a.workload].items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.prompts = a.prompts or (2 * a.batch if a.workload == "mixed" else a.batch)
    low = [name for name in ("batch", "prompt_tokens", "new_tokens", "repeats", "prompts", "min_prompt_tokens",
                             "mean_new_tokens") if getattr(a, name) < 1]
    if a.profile < 0:
        p.error("--profile must be >= 0")
    if low:
        p.error(f"--{low[0].replace('_', '-')} must be >= 1")
    if not (a.temperature >= 0 and 0 < a.top_p <= 1):
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")
    if a.workload == "mixed":
        vocab = SHAPES[a.shape]["vocab_size"]
        if a.min_prompt_tokens > a.prompt_tokens or a.mean_new_tokens > a.new_tokens:
            p.error("--workload mixed needs --min-prompt-tokens <= --prompt-tokens and --mean-new-tokens <= "
                    "--new-tokens")
        if a.new_tokens >= vocab:
            p.error(f"--workload mixed: --new-tokens must be below the vocabulary ({vocab}): the chain target's "
                    "cycle is that long")
        if a.temperature > 0:
            p.error("--workload mixed is greedy: its answer lengths come from the chain target's greedy tokens")
    if a.target_fp8 and a.dtype == "float32":
        p.error("--target-fp8 1 runs the target in bfloat16 (its FP8 products' output): leave --dtype at auto or "
                "bfloat16")
    a.engines = engines
    try:
        a.kernels_off = switches.parse(a.kernels_off, "--kernels-off")
        switches.check_environment()
    except ValueError as e:
        p.error(str(e))
    return a


def random_target(shape: str, max_len: int, device, dtype: str):
    """A random-init causal LM of the named shape on `device`, prepared as a full (untruncated) target."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.shapes import SHAPES, target_config
    from trainer.model.target import pick_dtype, prepare_target
    from trainer.tiny import build_tokenizer

    torch.manual_seed(0)
    attn = {"attn_implementation": "sdpa"} if SHAPES[shape]["model_type"] == "qwen3" else {}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(target_config(shape, max_len), dtype=pick_dtype(dtype, device),
                                                 **attn)
    model = model.to(device)  # a no-op where the device context was honoured
    # The tokenizer only supplies the mask token id the Target needs (decoding never uses it).
    return prepare_target(model, build_tokenizer(), num_draft_layers=1, truncate=False)


def engine_run(engine: str, target, rows: int, max_len: int, stops: list[int]):
    """-> (run(prompts, sampling) -> answers, the engine that runs, a note or None). The static engine where
    `BatchGenerator` serves the target, else HF generate, as trainer.regen.engines.answerer decides."""
    from trainer.decode.generate import BatchGenerator, hf_generate

    def hf(prompts, sampling):
        return hf_generate(target.model, prompts, sampling, stops, pad_id=0)

    if engine == "hf":
        return hf, "hf", None, None
    try:
        gen = BatchGenerator(target, rows, max_len, stop_ids=stops)
    except Exception as exc:  # noqa: BLE001 -- a refused family: what regenerate does then
        note = (f"the static engine cannot serve {target.model.config.model_type} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:160] if str(exc) else 'no message'}); measured HF generate, what "
                "regenerate uses")
        return hf, "hf", note, None
    return (lambda prompts, sampling: gen.generate(prompts, sampling)), "static", None, gen


def measure(engine: str, target, prompts: list[list[int]], rows: int, sampling, repeats: int,
            stops: list[int], profile: int = 0) -> tuple[dict, list]:
    """-> (figures, the last run's answers in prompt order). The static engine takes every prompt in one call
    (its `rows` slots refill as answers end); HF generate takes chunks of `rows`. `profile` > 0 (CUDA): then that
    many more runs under the profiler (`print_generation_profile`)."""
    import torch

    from bench.timing import peak_memory, reset_peak
    from trainer.decode.decoders import sync

    device = target.device
    rows = min(rows, len(prompts))
    max_len = max(map(len, prompts)) + sampling.max_new_tokens
    t0 = time.perf_counter()
    run, used, note, gen = engine_run(engine, target, rows, max_len, stops)
    chunks = [prompts] if used == "static" else [prompts[i:i + rows] for i in range(0, len(prompts), rows)]
    run(*warm_up(chunks[0], sampling, rows, gen))  # it captures the static engine's graphs here
    setup_s = time.perf_counter() - t0
    reset_peak(device)
    walls = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = [a for chunk in chunks for a in run(chunk, sampling)]
        sync(device)
        walls.append(time.perf_counter() - start)
    peak, _reserved = peak_memory(device)
    tokens = sum(map(len, out))
    wall = statistics.median(walls)
    lengths = list(map(len, prompts))
    figures = {"engine": used, "asked": engine, "batch": rows, "prompts": len(lengths),
               "prompt_tokens": [min(lengths), max(lengths)], "new_tokens": sampling.max_new_tokens,
               "generated_tokens": tokens, "mean_answer": round(tokens / len(out), 1),
               "wall_s": round(wall, 4), "wall_s_spread": [round(min(walls), 4), round(max(walls), 4)],
               "tokens_per_s": round(tokens / wall, 1), "ms_per_token_step": round(1e3 * wall * rows / tokens, 3),
               "peak_gib": round(peak, 3), "setup_s": round(setup_s, 2),
               "attention": gen.static.attention if gen is not None else "hf",
               "device": str(device), "dtype": str(target.embed_tokens.weight.dtype).replace("torch.", ""),
               "torch": torch.__version__}
    if gen is not None:  # the last timed run's counts (trainer/decode/run_stats.py)
        figures.update(run_figures(gen.last_run))
    if gen is not None:  # how many layers took each kernel's path (a kernel may not serve them)
        figures["kernel_layers"] = switches.layers_taking(gen.static)
    if gen is not None and gen.static.linear:  # a hybrid: its Gated DeltaNet step (recurrent_kernel.py or torch)
        figures["linear_step"] = "fused" if all(layer.fused for layer in gen.static.linear) else "torch"
    if note:
        figures["note"] = note
    if profile:
        print_generation_profile(run, chunks, sampling, profile, used, token_steps(gen, out, rows), wall)
    del gen, run
    gc.collect()  # a generator's graphs refer back to it (a cycle): free its cache before the next engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return figures, out


RUN_FIELDS = ("steps", "busy", "held", "tail_steps", "compact_steps", "slot_steps", "busy_computed", "checks", "fills",
              "prefills", "prefill_tokens", "prefill_positions", "prefill_s", "step_s")


def run_figures(run) -> dict:
    """A static run's counts as the line shows them (`RunStats`): step replays, busy (live share of slot-steps),
    held (the share whose row held a prompt), tail steps (after the last fill), compacted steps, the row-steps
    computed and the live share of those,
    host checks, fills, prefill forwards, their prompt tokens and positions (padding included), and the seconds of
    the prefills and of the steps (CUDA: device time by events; CPU: host time). Pure."""
    shown = run.as_dict()
    shown.update({k: round(shown[k], 4) for k in ("prefill_s", "step_s") if shown[k] is not None})
    return {k: shown[k] for k in RUN_FIELDS}


WARM_NEW_TOKENS = 32


def warm_up(prompts: list[list[int]], sampling, rows: int, gen,
            new_tokens: int = WARM_NEW_TOKENS) -> tuple[list[list[int]], object]:
    """The untimed run before the timed ones -> (prompts, sampling). Where the static engine's steps run the per-row
    attention kernel one graph serves every step, so `rows` prompts and `new_tokens` new tokens capture it (and
    warm the prefill's kernels); through masked SDPA each attention span has its own graph, so the whole workload
    runs once, as the timed runs will. HF: the first chunk, as given."""
    if gen is None or not gen.static.row_kernel or len(prompts) <= rows:
        return prompts, sampling
    return prompts[:rows], dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, new_tokens))


def token_steps(gen, answers: list[list[int]], rows: int) -> int:
    """Token steps of one run of the workload: the static engine's step replays (its last call's); HF generate's,
    each chunk's longest answer (the batch steps until its last row stops)."""
    if gen is not None:
        return gen.replays
    return sum(max(map(len, answers[i:i + rows])) for i in range(0, len(answers), rows))


def print_generation_profile(run, chunks: list[list[list[int]]], sampling, runs: int, label: str, steps: int,
                             wall_s: float) -> None:
    """`runs` whole runs of the workload (`run` over each chunk) under torch.profiler -> bench/timing.py's PROF /
    PROFSUM / PROFGAP lines, per token step (over runs x steps); prefill and decode together. `wall_s`: the timed
    median run, whose share per step PROFSUM's "no kernel running" is taken from. CUDA only."""
    from bench.timing import print_profile

    steps = max(steps, 1)
    print(f"PROF {label} {runs} whole run(s) of {steps} token steps, prefill included; figures per token step",
          flush=True)
    print_profile(lambda: [run(chunk, sampling) for chunk in chunks], runs * steps, label, 1e3 * wall_s / steps,
                  calls=runs)


def table(results: list[dict], ratio: float | None) -> str:
    lines = [f"{'engine':8} {'tok/s':>10} {'ms/step':>9} {'floor ms':>9} {'wall s':>8} {'peak GiB':>9} "
             f"{'setup s':>8}"]
    for r in results:
        name = r["engine"] if r["engine"] == r["asked"] else f"{r['asked']}->{r['engine']}"
        lines.append(f"{name:8} {r['tokens_per_s']:10.1f} {r['ms_per_token_step']:9.3f} {r['floor_ms']:9.3f} "
                     f"{r['wall_s']:8.3f} {r['peak_gib']:9.2f} {r['setup_s']:8.2f}")
        if "note" in r:
            lines.append(f"  note: {r['note']}")
        if "steps" in r:
            lines.append(f"  {r['steps']} steps ({r['tail_steps']} in the tail, {r['compact_steps']} compacted), busy "
                         f"{r['busy']:.3f} ({r['busy_computed']:.3f} of the rows computed), held "
                         f"{r['held']:.3f}; {r['fills']} fills, {r['prefills']} prefill "
                         f"forwards, {r['prefill_tokens']} prompt tokens in {r['prefill_positions']} positions; "
                         f"prefill {r['prefill_s']:.3f} s, steps {r['step_s']:.3f} s")
    if ratio is not None:
        lines.append(f"static / hf tokens/s: {ratio:.2f}x")
    return "\n".join(lines)


def cpu_refusal(shape: str, cuda: bool) -> str | None:
    """Pure: why this bench cannot run here, or None (a GPU shape on a CPU takes minutes and models nothing)."""
    if cuda or shape == "tiny":
        return None
    return f"--shape {shape} is a GPU shape and this run has no CUDA device; on a CPU use --shape tiny"


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    from bench.floor import GEMM_FLOPS_PER_S, HBM_BYTES_PER_S, step_floor
    from trainer.decode.generate import Sampling
    from trainer.placement import local_device

    device = local_device(args.device)
    refusal = cpu_refusal(args.shape, device.type == "cuda")
    if not refusal and args.target_fp8:
        from trainer.model.fp8 import fp8_refusal

        refusal = fp8_refusal(device, "--target-fp8 1")
    if not refusal and args.profile and device.type != "cuda":
        refusal = f"--profile {args.profile} profiles CUDA kernels; this run is on {device}"
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    sampling = Sampling(max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p)
    target = random_target(args.shape, args.prompt_tokens + args.new_tokens, device, args.dtype)
    prompts, stops, drawn, context = workload(args, target)
    switches.switch_off(args.kernels_off)
    fp8 = {"target_fp8": bool(args.target_fp8), "kernels_off": switches.switched_off()}
    if args.target_fp8:  # after the chain is set (it writes bf16 weights), before either engine is built
        from trainer.model.fp8_target import quantize_target_layers

        fp8["fp8_linears"] = quantize_target_layers(target.model.model.layers)
    floor = step_floor(target.model.config, args.batch, context, target.embed_tokens.weight.element_size())
    print("GENERATE_FLOOR " + json.dumps({"shape": args.shape, "workload": args.workload, "rows": args.batch,
                                          "context": round(context, 1), "hbm_bytes_per_s": HBM_BYTES_PER_S,
                                          "gemm_flops_per_s": GEMM_FLOPS_PER_S,
                                          **{k: round(v, 4) for k, v in floor.items()
                                             if k not in ("bandwidth", "gemm_flops")}}), flush=True)
    results, outputs = [], {}
    with torch.no_grad():
        for engine in args.engines:
            if engine == "hf" and any(r["engine"] == "hf" for r in results):
                continue  # the static engine's line already measured HF generate
            figures, outputs[engine] = measure(engine, target, prompts, args.batch, sampling, args.repeats, stops,
                                               args.profile)
            figures.update(workload=args.workload, shape=args.shape, floor_ms=round(floor["floor_ms"], 3), **fp8)
            if drawn is not None:
                figures["answers_as_drawn"] = round(sum(len(a) == n and a[-1] == stops[0]
                                                        for a, n in zip(outputs[engine], drawn)) / len(drawn), 4)
            results.append(figures)
            print("GENERATE_BENCH " + json.dumps(figures), flush=True)
    if drawn is not None:  # the equal workload to set this one beside (the goal: mixed >= 85% of its tokens/s)
        extra = " ".join([f"--repeats {args.repeats}"] + [f"--{k} {v}" for k, v in (("dtype", args.dtype),
                         ("device", args.device)) if v != "auto"] + (["--target-fp8 1"] if args.target_fp8 else []))
        print("EQUAL_LIKE " + json.dumps(equal_like(args.batch, list(map(len, prompts)), drawn, args.shape, extra)),
              flush=True)
    speed = {r["engine"]: r["tokens_per_s"] for r in results}
    ratio = None
    if len(results) == 2 and set(speed) == set(ENGINES):
        ratio = round(speed["static"] / speed["hf"], 3)
        agree = None
        if sampling.mode == "greedy":
            agree = round(sum(a == b for a, b in zip(outputs["static"], outputs["hf"])) / len(outputs["hf"]), 4)
        print("GENERATE_RATIO " + json.dumps({"shape": args.shape, "static_over_hf": ratio,
                                              "greedy_rows_equal": agree}), flush=True)
    print(table(results, ratio), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
