"""Training-step benchmark: `python -m trainer.bench --shape small --modes eager,compile,graph,compile+graph`.

Each mode runs in its own subprocess (fresh allocator, fresh peak-memory counters; a crash loses one mode only) over
the same workload: `accum` micro-steps of `batch` rows x `seq` tokens per step per GPU, `anchors` anchors per row,
block `block`. One step = target forward (no grad, taps only) + drafter forward/backward over every micro-step + grad
clip + AdamW. Modes:
  eager          everything eager (flex_attention itself is always compiled: its eager form materializes scores)
  compile        target and drafter layers torch.compile'd (default mode: no CUDA graphs)
  graph          target forward captured as one graph, the whole drafter step as a StepGraph (raw CUDA graphs)
  compile+graph  compiled kernels inside the same raw captures

--pipeline 1 runs the same steps through the threaded pipeline (loader -> target producer -> event-synchronized
ring -> drafter consumer; trainer.pipeline.threads), timed by the consumer's events. Under torchrun
(`torchrun --nproc-per-node 2 -m trainer.bench ...`) every rank trains a replica on its own data and gradients are
averaged by NCCL between the captured forward/backward and update graphs; figures are per GPU, printed by rank 0.

Timing: CUDA events around every step, read once at the end (no host sync in the loop); steps are back to back, so
host-side launch gaps count. Reported: median step time and its min-max spread over the timed steps.

MFU = useful FLOPs per step / median step time / PEAK_FLOPS, with PEAK_FLOPS = 989e12 (H200 SXM dense bf16, datasheet).
Useful FLOPs (a matmul of m x k by k x n = 2mkn; backward = 2 x forward unless stated):
  target   T tokens (rows*seq) through layers 0..last tap: 2*T*P_layer per layer, P_layer = D*Hq*hd + 2*D*Hkv*hd +
           Hq*hd*D + 3*D*I; causal attention 4*hd*Hq*seq*(seq+1)/2 per row per layer. Forward only.
  drafter  Tq = rows*anchors*block drafted positions: per layer 2*Tq*P_layer + context K/V projections 4*T*D*Hkv*hd +
           attention 4*hd*Hq*(visible query-key pairs, counted exactly from the step's mask); x3 for forward+backward.
           fc (taps*D -> D) on the T context positions: forward + weight grad only (x2).
  LM head  the frozen head on the rows*anchors*(block-1) supervised positions: forward + input grad, 2 * 2*D*V each.
Not counted: norms, RoPE, softmax/CE elementwise work, optimizer, any recomputation.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass

PEAK_FLOPS = 989e12
MODES = ("eager", "compile", "graph", "compile+graph")


@dataclass(frozen=True)
class BenchConfig:
    shape: str = "small"
    batch: int = 4
    seq: int = 3072
    anchors: int = 512
    block: int = 16
    accum: int = 1
    steps: int = 30
    warmup: int = 3
    attn: str = "flex"
    interval: int = 5
    ce_chunk: int = 4096
    profile: int = 0  # >0: after timing, profile this many steps and print the top kernels (PROF lines)
    pipeline: int = 0  # 1: run the steps through the loader/producer/consumer threads (trainer.pipeline)


def model_shape(name: str):
    from trainer.pipeline import standin

    shapes = {"small": standin.SMALL, "qwen3-8b": standin.QWEN3_8B, "tiny": standin.TINY}
    if name not in shapes:
        raise SystemExit(f"unknown --shape {name!r}; choose one of {sorted(shapes)}")
    return shapes[name]


def useful_flops(cfg: BenchConfig, visible_pairs: float) -> dict[str, float]:
    """Per-step useful FLOPs by part (module docstring). visible_pairs: query-key pairs the drafter mask allows."""
    s = model_shape(cfg.shape)
    rows = cfg.accum * cfg.batch
    t, tq = rows * cfg.seq, rows * cfg.anchors * cfg.block
    d, hq, hkv, hd = s.hidden, s.heads, s.kv_heads, s.head_dim
    p_layer = d * hq * hd + 2 * d * hkv * hd + hq * hd * d + 3 * d * s.intermediate
    n_target = max(s.tap_layers) + 1
    target = n_target * (2 * t * p_layer + 4 * hd * hq * rows * cfg.seq * (cfg.seq + 1) / 2)
    per_layer = 2 * tq * p_layer + 4 * t * d * hkv * hd + 4 * hd * hq * visible_pairs
    drafter = 3 * s.draft_layers * per_layer + 2 * (2 * t * len(s.tap_layers) * d * d)
    head = 2 * (2 * rows * cfg.anchors * (cfg.block - 1) * d * s.vocab)
    return {"target": target, "drafter": drafter, "lm_head": head, "total": target + drafter + head}


def mem_line(step: int) -> dict:
    """Allocator counters (host-side bookkeeping: reading them is no device sync)."""
    import torch

    return {
        "step": step,
        "alloc_gib": torch.cuda.memory_allocated() / 2**30,
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
        "reserved_gib": torch.cuda.memory_reserved() / 2**30,
    }


def run_mode(cfg: BenchConfig, mode: str) -> dict:
    """Child process body: build, warm up / capture, time `cfg.steps` steps, return the figures.

    Under torchrun (RANK/WORLD_SIZE set) every rank trains its own replica on its own data; gradients are averaged
    by NCCL between the forward/backward and update graphs (trainer.distributed).
    """
    import torch

    from trainer.distributed import init_from_env, make_grad_sync, shutdown
    from trainer.model.flex import dense_block_mask
    from trainer.pipeline.standin import Workload, build, make_batch
    from trainer.step.graph import EagerStep, StepGraph

    info = init_from_env()
    dev = torch.device("cuda", torch.cuda.current_device())
    compiled, graphed = mode in ("compile", "compile+graph"), mode in ("graph", "compile+graph")
    w = Workload(model_shape(cfg.shape), cfg.batch, cfg.seq, cfg.anchors, cfg.block, cfg.accum, ce_chunk=cfg.ce_chunk)
    target, drafter, opt, st = build(w, dev, attn=cfg.attn, compile=compiled)
    if compiled:
        for layer in target.layers:
            layer.compile(dynamic=False)
    seeds = [1000 * info.rank + k for k in range(4)]
    batches = [make_batch(w, dev, seed=k) for k in seeds]
    dense = dense_block_mask(batches[0]["anchor"], batches[0]["ctx_lo"], batches[0]["valid"], cfg.seq, cfg.block)
    flops = useful_flops(cfg, float(dense.sum()))
    del dense

    sync = make_grad_sync(st.params, info.world)
    sample = dict(batches[0], taps=target.taps(batches[0]["input_ids"]))
    if graphed:
        stepper = StepGraph(st.forward_backward, st.optimizer_step, st.params, opt, sample, warmup_steps=cfg.warmup,
                            sync_grads=sync)
        stepper.capture()
        # Target graph. Sequential runs write the taps straight into the step graph's static input; the pipeline
        # gives the target graph its own buffers (the producer copies them into a ring slot).
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
        times, losses, mem_lines, elapsed = run_pipeline(cfg, mode, dev, batches, target_fn, stepper, sample, w)
    else:
        del sample
        times, losses, mem_lines = run_sequential(cfg, mode, batches, one_step)
        elapsed = sum(times)
    if cfg.profile and not cfg.pipeline:
        print_profile(lambda: one_step(batches[0]), cfg.profile, mode)
    med = statistics.median(times)
    result = {
        "mode": mode + ("+pipeline" if cfg.pipeline else ""),
        "attn": cfg.attn,
        "world": info.world,
        "step_s_median": med,
        "step_s_min": min(times),
        "step_s_max": max(times),
        "tokens_per_s_per_gpu": w.tokens_per_step / med,
        "wall_tokens_per_s_per_gpu": w.tokens_per_step * cfg.steps / elapsed,
        "mfu": flops["total"] / med / PEAK_FLOPS,
        "tflops_per_s": flops["total"] / med / 1e12,
        "flops": flops,
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "mem": mem_lines,
        "loss_first_last": [losses[0], losses[-1]],
        "tokens_per_step": w.tokens_per_step,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(dev),
    }
    torch.cuda.synchronize()
    del stepper
    shutdown()
    return result


def run_sequential(cfg: BenchConfig, mode: str, batches, one_step):
    import torch

    for k in range(2):
        one_step(batches[k % len(batches)])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.steps + 1)]
    mem_lines, losses = [], []
    events[0].record()
    for k in range(cfg.steps):
        out = one_step(batches[k % len(batches)])
        events[k + 1].record()
        losses.append(out["loss"].detach().clone())
        if (k + 1) % cfg.interval == 0:
            mem_lines.append(mem_line(k + 1))
            print("MEM", mode, json.dumps(mem_lines[-1]), flush=True)
    torch.cuda.synchronize()
    times = [events[k].elapsed_time(events[k + 1]) / 1e3 for k in range(cfg.steps)]
    return times, [float(x) for x in losses], mem_lines


def run_pipeline(cfg: BenchConfig, mode: str, dev, batches, target_fn, stepper, sample, w):
    """Loader -> target producer -> drafter consumer threads (trainer.pipeline.threads), target and drafter on `dev`."""
    import torch

    from trainer.pipeline.threads import Pipeline, Placement

    cpu_batches = [{k: v.cpu() for k, v in b.items()} for b in batches]

    def feed():
        k = 0
        while True:
            yield cpu_batches[k % len(cpu_batches)]
            k += 1

    mem_lines: list[dict] = []

    def on_interval(step: int) -> None:
        mem_lines.append(mem_line(step))
        print("MEM", mode + "+pipeline", json.dumps(mem_lines[-1]), flush=True)

    pipe = Pipeline(Placement(dev, dev), feed, lambda b: {"taps": target_fn(b["input_ids"])}, stepper, sample,
                    on_interval=on_interval, interval=cfg.interval)
    pipe.run(3)  # warm the threads' streams and the pinned-memory pool
    torch.cuda.reset_peak_memory_stats()
    res = pipe.run(cfg.steps)
    return res.step_s, res.losses, mem_lines, res.elapsed_s


def print_profile(step, n: int, mode: str) -> None:
    """Top device kernels over `n` steps, as PROF lines (total ms per step, share, calls per step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in rows) or 1.0
    for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:25]:
        print(
            f"PROF {mode} {e.self_device_time_total / n / 1e3:8.2f} ms {100 * e.self_device_time_total / total:5.1f}% "
            f"x{e.count // n:<4} {e.key[:110]}",
            flush=True,
        )
    print(f"PROF {mode} total device time {total / n / 1e3:.1f} ms/step", flush=True)


def parse(argv: list[str]) -> tuple[BenchConfig, list[str], str | None]:
    p = argparse.ArgumentParser(prog="python -m trainer.bench", description=__doc__.split("\n")[0])
    for field, default in asdict(BenchConfig()).items():
        p.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = vars(p.parse_args(argv))
    modes, child = a.pop("modes").split(","), a.pop("child")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {list(MODES)}")
    cfg = BenchConfig(**a)
    model_shape(cfg.shape)
    return cfg, modes, child


def table(results: list[dict]) -> str:
    base = next((r for r in results if r.get("mode") == "eager" and "error" not in r), None)
    lines = [
        f"{'mode':14} {'tok/s/GPU':>10} {'step ms':>8} {'min-max ms':>13} {'MFU':>6} {'TFLOP/s':>8} "
        f"{'peak GiB':>8} {'rsvd GiB':>8} {'vs eager':>8}"
    ]
    for r in results:
        if "error" in r:
            lines.append(f"{r['mode']:14} FAILED: {r['error']}")
            continue
        speed = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else float("nan")
        lines.append(
            f"{r['mode']:14} {r['tokens_per_s_per_gpu']:10.0f} {r['step_s_median'] * 1e3:8.1f} "
            f"{r['step_s_min'] * 1e3:6.1f}-{r['step_s_max'] * 1e3:<6.1f} {r['mfu'] * 100:5.1f}% "
            f"{r['tflops_per_s']:8.1f} {r['peak_alloc_gib']:8.1f} {r['peak_reserved_gib']:8.1f} {speed:7.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg, modes, child = parse(argv)
    if child is not None:
        print("BENCH_RESULT " + json.dumps(run_mode(cfg, child)), flush=True)
        return 0
    main_rank = int(os.environ.get("RANK", "0")) == 0
    say = print if main_rank else (lambda *a, **k: None)
    say("config", json.dumps(asdict(cfg)), flush=True)
    results = []
    for mode in modes:
        cmd = [sys.executable, "-m", "trainer.bench", *argv, "--child", mode]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        keep = ("MEM", "PROF")
        if main_rank:
            sys.stdout.write("".join(line + "\n" for line in proc.stdout.splitlines() if line.startswith(keep)))
        found = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_RESULT ")]
        if proc.returncode or not found:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-8:]
            results.append({"mode": mode, "error": f"rc={proc.returncode}: " + " | ".join(tail)[-600:]})
        else:
            results.append(json.loads(found[-1][len("BENCH_RESULT ") :]))
        say("RESULT " + json.dumps(results[-1]), flush=True)
    say(table(results), flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
