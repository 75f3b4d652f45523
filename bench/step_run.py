"""One bench mode over the trainer's own path, in the child process of `python -m bench.step`.

Built exactly as `trainer train` builds it: an HF target of the named shape prepared by `trainer.model.target.prepare_target`
(random init from a named shape, bf16 on CUDA, frozen, tap hooks, truncated after the last tap; or `--target DIR`
through `load_target`), `trainer.build.build_state` (Drafter, AdamW with a device LR, chunked LM-head loss, the flex
mask builder), `trainer.build.make_runner` (the step's policy, then the eager or captured stepper of
`trainer.step.stepper.build_stepper`) or, with `--pipeline 1`, `trainer.pipeline.train_pipe.build` driven by
`trainer.pipeline.threads.Pipeline`. Data: synthetic StaticBatches (bench/synthetic.py). Data parallel under
torchrun: `trainer.distributed.make_grad_sync`, rank-specific data.
"""
from __future__ import annotations

import json
import statistics

import torch

from bench.shapes import Dims, FlopShape, StepCounts, target_config, target_layer_costs, useful_flops
from bench.synthetic import draft_pairs, synthetic_batches, target_pairs
from bench.timing import Timed, mem_line, peak_memory, print_profile, reset_peak, time_steps
from trainer.config import DataCfg, ModelCfg, OptimCfg, PipelineCfg, StepCfg, TrainCfg
from trainer.errors import ConfigError


def train_config(cfg, mode: str, attn: str) -> TrainCfg:
    """The TrainCfg the bench's step corresponds to (only the fields build_state / make_runner read matter)."""
    return TrainCfg(model=ModelCfg(target=cfg.target, num_draft_layers=cfg.draft_layers, block_size=cfg.block,
                                   drafter=cfg.drafter),
                    data=DataCfg(seq_len=cfg.seq, rows_per_step=cfg.batch, num_anchors=cfg.anchors),
                    step=step_config(cfg, mode, attn),
                    optim=OptimCfg(accum_steps=cfg.accum, name=cfg.optim),
                    pipeline=PipelineCfg(enabled=bool(cfg.pipeline)))


def step_config(cfg, mode: str, attn: str) -> StepCfg:
    """The trainer's StepCfg for this bench run and mode (--ce, --ce-chunk, --head-fp8)."""
    return StepCfg(mode=mode, attn=attn, loss_chunk=cfg.ce_chunk, ce=cfg.ce, head_fp8=cfg.step_head_fp8)


def bench_target(cfg, device: torch.device):
    """`_bench_target`, with the target's linears in FP8 under --target-fp8 1 (trainer.build.to_fp8)."""
    target = _bench_target(cfg, device)
    if cfg.target_fp8:
        from trainer.build import to_fp8

        to_fp8(target)
    return target


def _bench_target(cfg, device: torch.device):
    """--target DIR: load_target. Else a random-init causal LM of the named shape's family, built on `device` in the
    target dtype with the options load_target gives its family, and prepared by the same `prepare_target` (bf16 on
    CUDA, fp32 on CPU, as model.dtype=auto)."""
    from trainer.model.target import hf_attention, load_options, load_target, pick_dtype, prepare_target
    from trainer.build import target_attn

    attn = target_attn(device)
    if cfg.target:
        return load_target(cfg.target, num_draft_layers=cfg.draft_layers, device=device, attn=attn)
    from transformers import AutoModelForCausalLM

    from trainer.tiny import build_tokenizer

    config = target_config(cfg.shape, cfg.seq)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=pick_dtype("auto", device),
                                                 attn_implementation=hf_attention(config), **load_options(config))
    model = model.to(device)  # a no-op where the device context was honoured
    # The tokenizer only supplies the mask token id (a row of the embedding that is neither pad nor eos).
    return prepare_target(model, build_tokenizer(), num_draft_layers=cfg.draft_layers, attn=attn)


def flop_shape(target, dcfg) -> FlopShape:
    h = target.hf_config
    d = Dims(dcfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim,
             dcfg.intermediate_size)
    return FlopShape(target_layers=target_layer_costs(h, max(target.layer_ids) + 1), target_hidden=h.hidden_size,
                     drafter=d, draft_layers=dcfg.num_layers, taps=dcfg.num_taps,
                     vocab=target.embed_tokens.weight.shape[0])


def run_mode(cfg, mode: str) -> dict:
    """Build, warm up / capture, time `cfg.steps` optimizer steps; return the figures (a JSON-able dict)."""
    from trainer.build import build_state, check_device_support, make_runner
    from trainer.distributed import init_from_env, make_grad_sync, shutdown

    info = init_from_env()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    attn = cfg.attn if cfg.attn != "auto" else ("flex" if cuda else "sdpa")
    tcfg = train_config(cfg, mode, attn)
    check_device_support(tcfg, dev)  # graph modes, flex and the pipeline refuse a CPU here, before any build
    torch.manual_seed(0)
    target = bench_target(cfg, dev)
    state = build_state(tcfg, target, dev)
    if state.selector_weight_ is not None:  # DFlash2: the selector term at its full weight, as after the ramp
        state.selector_weight_.fill_(tcfg.loss.selector("selector_alpha"))
    if cuda:
        torch.cuda.empty_cache()  # the target layers truncation dropped: not part of the footprint
    vocab = target.embed_tokens.weight.shape[0]
    micro = synthetic_batches(2 * cfg.accum, cfg.batch, cfg.seq, cfg.anchors, vocab, seed=1000 * info.rank,
                              docs_per_row=cfg.docs)
    if cuda:
        micro = [b.pin_memory() for b in micro]  # as the trainer's loop hands them over (async H2D copies)
    steps_in = [micro[:cfg.accum], micro[cfg.accum:]]  # two different optimizer steps, alternated
    counts = StepCounts(rows=cfg.accum * cfg.batch, seq=cfg.seq, anchors=cfg.anchors, block=cfg.block,
                        target_pairs={w: sum(target_pairs(b, w) for b in steps_in[0])
                                      for w in {None, getattr(target.hf_config, "sliding_window", None)}},
                        draft_pairs=sum(draft_pairs(b, cfg.block) for b in steps_in[0]))
    flops = useful_flops(flop_shape(target, state.drafter.cfg), counts)
    sync = make_grad_sync([p for p in state.drafter.parameters() if p.requires_grad], info.world)
    if cfg.pipeline:
        timed = run_pipeline(cfg, mode, state, steps_in, dev, sync)
    else:
        runner = make_runner(tcfg, state, steps_in[0][0].to(dev), sync)
        if not tcfg.step.captures:  # a captured stepper is warmed up and captured already
            for _ in range(cfg.warmup):
                runner.step(steps_in[0])
        timed = time_steps(lambda k: runner.step(steps_in[k % 2])[0].loss_, cfg.steps, device=dev,
                           interval=cfg.interval, label=mode)
        if cfg.profile and cuda:
            step_ms = 1e3 * statistics.median(timed.step_s)
            print_profile(lambda: runner.step(steps_in[0]), cfg.profile, mode, step_ms, flops["matmul"])
    # Read off the batches the step ran on (doc ids count from 0 in each row), not echoed from --docs.
    docs = int(steps_in[0][0].doc_ids.max()) + 1
    result = figures(cfg, mode, timed, flops, dev, info.world) | {"attn": attn, "target_attn": target.attn,
                                                                  "docs_per_row": docs,
                                                                  "head_fp8": state.head_fp8 is not None,
                                                                  "inductor": cfg.inductor, **built_kinds(state)}
    if cuda:
        torch.cuda.synchronize(dev)
    shutdown()
    return result


def built_kinds(state) -> dict:
    """What was built, read off the state (not echoed from the flags): the drafter's architecture and the optimizer."""
    from trainer.step.muon import MuonAdamW

    return {"drafter": "dflash" if state.drafter.cfg.dflash2 is None else "dflash2",
            "optim": "muon" if isinstance(state.optimizer, MuonAdamW) else "adamw",
            "drafter_params": sum(p.numel() for p in state.drafter.parameters())}


def run_pipeline(cfg, mode: str, state, steps_in, dev: torch.device, sync) -> Timed:
    """The trainer's pipeline (`trainer train` with pipeline.enabled): train_pipe.build captures / warms up in this
    thread, then loader -> target producer -> drafter consumer threads; timed by the consumer's step-end events."""
    from trainer.pipeline import train_pipe
    from trainer.pipeline.threads import Devices, Pipeline
    from trainer.step.slots import encode, target_keys

    if dev.type != "cuda":
        raise ConfigError("--pipeline 1 needs a CUDA device (this run is on cpu)")
    pc = PipelineCfg()
    built = train_pipe.build(state, steps_in[0], step=step_config(cfg, mode, state.attn), target_device=dev,
                             drafter_device=dev, grad_sync=sync, slots=pc.slots, prefetch=pc.prefetch)
    inputs = [encode(s) for s in steps_in]

    def feed():  # loader thread: CPU dicts (it pins them)
        k = 0
        while True:
            yield inputs[k % 2]
            k += 1

    mem: list[dict] = []

    def on_interval(step: int) -> None:
        mem.append(mem_line(step, dev))
        print("MEM", mode + "+pipeline", json.dumps(mem[-1]), flush=True)

    consumer = train_pipe.ConsumerStep(built.stepper, cfg.accum, lambda: None, lambda outs: None)
    pipe = Pipeline(Devices(dev, dev), feed, built.target_fn, consumer, built.example,
                    target_keys=target_keys(cfg.accum), slots=built.slots, prefetch=built.prefetch,
                    on_interval=on_interval, interval=cfg.interval)
    pipe.run(3)  # the threads' streams, the pinned-memory pool
    reset_peak(dev)
    mem.clear()
    res = pipe.run(cfg.steps)
    return Timed(res.step_s, res.losses, mem, res.elapsed_s)


def figures(cfg, mode: str, timed: Timed, flops: dict, dev: torch.device, world: int) -> dict:
    from bench.shapes import PEAK_FLOPS

    tokens = cfg.accum * cfg.batch * cfg.seq
    med = statistics.median(timed.step_s)
    peak, reserved = peak_memory(dev)
    return {
        "mode": mode + ("+pipeline" if cfg.pipeline else ""),
        "shape": cfg.target or cfg.shape,
        "world": world,
        "step_s_median": med,
        "step_s_min": min(timed.step_s),
        "step_s_max": max(timed.step_s),
        "tokens_per_s_per_gpu": tokens / med,
        "wall_tokens_per_s_per_gpu": tokens * cfg.steps / timed.elapsed_s,
        "mfu": flops["total"] / med / PEAK_FLOPS,
        "tflops_per_s": flops["total"] / med / 1e12,
        "flops": flops,
        "peak_alloc_gib": peak,
        "peak_reserved_gib": reserved,
        "mem": timed.mem,
        "loss_first_last": [timed.losses[0], timed.losses[-1]],
        "tokens_per_step": tokens,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    }
