"""One bench mode over the stand-in workload (`--impl standin`, CUDA only): trainer/pipeline/standin.py, the
self-contained model the first figures in docs/benchmarks.md came from. Kept as the reference those rows name."""
from __future__ import annotations

import json
import statistics

import torch

from trainer.benchkit.shapes import PEAK_FLOPS, Dims, FlopShape, StepCounts, useful_flops
from trainer.benchkit.timing import Timed, mem_line, peak_memory, print_profile, reset_peak, time_steps
from trainer.errors import ConfigError


def model_shape(name: str):
    from trainer.pipeline import standin

    shapes = {"small": standin.SMALL, "qwen3-8b": standin.QWEN3_8B, "tiny": standin.TINY}
    return shapes[name]


def flop_shape(s) -> FlopShape:
    dims = Dims(s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate)
    return FlopShape(target=dims, target_layers_run=max(s.tap_layers) + 1, drafter=dims, draft_layers=s.draft_layers,
                     taps=len(s.tap_layers), vocab=s.vocab)


def run_mode(cfg, mode: str) -> dict:
    """Child process body: build, warm up / capture, time `cfg.steps` steps, return the figures."""
    from trainer.distributed import init_from_env, make_grad_sync, shutdown
    from trainer.model.flex import dense_block_mask
    from trainer.pipeline.standin import Workload, build, make_batch
    from trainer.step.graph import EagerStep, StepGraph

    if not torch.cuda.is_available():
        raise ConfigError("--impl standin needs a CUDA device (use --impl trainer on CPU)")
    if cfg.target:
        raise ConfigError("--target DIR needs --impl trainer (the stand-in builds its own model)")
    info = init_from_env()
    dev = torch.device("cuda", torch.cuda.current_device())
    attn = "flex" if cfg.attn == "auto" else cfg.attn
    compiled, graphed = mode in ("compile", "compile+graph"), mode in ("graph", "compile+graph")
    shape = model_shape(cfg.shape)
    w = Workload(shape, cfg.batch, cfg.seq, cfg.anchors, cfg.block, cfg.accum, ce_chunk=cfg.ce_chunk)
    target, drafter, opt, st = build(w, dev, attn=attn, compile=compiled)
    if compiled:
        for layer in target.layers:
            layer.compile(dynamic=False)
    batches = [make_batch(w, dev, seed=1000 * info.rank + k) for k in range(4)]
    dense = dense_block_mask(batches[0]["anchor"], batches[0]["ctx_lo"], batches[0]["valid"], cfg.seq, cfg.block)
    rows = cfg.accum * cfg.batch
    counts = StepCounts(rows=rows, seq=cfg.seq, anchors=cfg.anchors, block=cfg.block,
                        target_pairs=rows * cfg.seq * (cfg.seq + 1) / 2, draft_pairs=float(dense.sum()))
    flops = useful_flops(flop_shape(shape), counts)
    del dense

    sync = make_grad_sync(st.params, info.world)
    sample = dict(batches[0], taps=target.taps(batches[0]["input_ids"]))
    if graphed:
        stepper = StepGraph(st.forward_backward, st.optimizer_step, st.params, opt, sample, warmup_steps=cfg.warmup,
                            sync_grads=sync)
        stepper.capture()
        # Sequential runs write the taps straight into the step graph's static input; the pipeline gives the target
        # graph its own buffers (the producer copies them into a ring slot).
        ids_static = stepper.static_inputs["input_ids"] if not cfg.pipeline else sample["input_ids"].clone()
        taps_static = stepper.static_inputs["taps"] if not cfg.pipeline else sample["taps"].clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                target.taps(ids_static, out=taps_static)
        torch.cuda.current_stream().wait_stream(s)
        tgraph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(tgraph, stream=s):
            target.taps(ids_static, out=taps_static)

        def target_fn(ids):
            ids_static.copy_(ids, non_blocking=True)
            tgraph.replay()
            return taps_static

        def one_step(b):
            stepper.load_inputs({k: v for k, v in b.items() if k != "taps"} | {"taps": taps_static})
            tgraph.replay()  # writes the taps straight into the step graph's static input
            return stepper.replay()
    else:
        stepper = EagerStep(st.forward_backward, st.optimizer_step, opt, sync_grads=sync)
        for _ in range(cfg.warmup):
            stepper.step(sample)
        target_fn = target.taps

        def one_step(b):
            return stepper.step(dict(b, taps=target.taps(b["input_ids"])))

    if cfg.pipeline:
        timed = run_pipeline(cfg, mode, dev, batches, target_fn, stepper, sample)
    else:
        del sample
        timed = time_steps(lambda k: one_step(batches[k % len(batches)])["loss"], cfg.steps, device=dev,
                           interval=cfg.interval, label=mode)
        if cfg.profile:
            print_profile(lambda: one_step(batches[0]), cfg.profile, mode)
    med = statistics.median(timed.step_s)
    tokens = w.tokens_per_step
    peak, reserved = peak_memory(dev)
    result = {
        "mode": mode + ("+pipeline" if cfg.pipeline else ""), "impl": "standin", "shape": cfg.shape, "attn": attn,
        "world": info.world, "step_s_median": med, "step_s_min": min(timed.step_s), "step_s_max": max(timed.step_s),
        "tokens_per_s_per_gpu": tokens / med, "wall_tokens_per_s_per_gpu": tokens * cfg.steps / timed.elapsed_s,
        "mfu": flops["total"] / med / PEAK_FLOPS, "tflops_per_s": flops["total"] / med / 1e12, "flops": flops,
        "peak_alloc_gib": peak, "peak_reserved_gib": reserved, "mem": timed.mem,
        "loss_first_last": [timed.losses[0], timed.losses[-1]], "tokens_per_step": tokens,
        "torch": torch.__version__, "device": torch.cuda.get_device_name(dev),
    }
    torch.cuda.synchronize()
    del stepper
    shutdown()
    return result


def run_pipeline(cfg, mode: str, dev, batches, target_fn, stepper, sample) -> Timed:
    """Loader -> target producer -> drafter consumer threads (trainer.pipeline.threads), target and drafter on `dev`."""
    from trainer.pipeline.threads import Devices, Pipeline

    cpu_batches = [{k: v.cpu() for k, v in b.items()} for b in batches]

    def feed():
        k = 0
        while True:
            yield cpu_batches[k % len(cpu_batches)]
            k += 1

    mem: list[dict] = []

    def on_interval(step: int) -> None:
        mem.append(mem_line(step, dev))
        print("MEM", mode + "+pipeline", json.dumps(mem[-1]), flush=True)

    pipe = Pipeline(Devices(dev, dev), feed, lambda b: {"taps": target_fn(b["input_ids"])}, stepper, sample,
                    on_interval=on_interval, interval=cfg.interval)
    pipe.run(3)  # warm the threads' streams and the pinned-memory pool
    reset_peak(dev)
    mem.clear()
    res = pipe.run(cfg.steps)
    return Timed(res.step_s, res.losses, mem, res.elapsed_s)
