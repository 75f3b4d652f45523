"""Step timing, memory lines and the kernel profile, shared by every bench workload.

CUDA: events recorded after every step and read once at the end (no host sync inside the loop; steps run back to
back, so host launch gaps count). CPU (tests, development): the host clock around every step (CPU work is
synchronous). MEM lines: allocator counters on CUDA (host-side bookkeeping, no sync), process peak RSS on CPU.
"""
from __future__ import annotations

import json
import re
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def mem_line(step: int, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"step": step, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    return {
        "step": step,
        "alloc_gib": torch.cuda.memory_allocated(device) / 2**30,
        "peak_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "reserved_gib": torch.cuda.memory_reserved(device) / 2**30,
    }


def peak_memory(device: torch.device) -> tuple[float, float]:
    """(peak allocated, peak reserved) GiB; on CPU (peak RSS, nan)."""
    if device.type != "cuda":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, float("nan")
    return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


@dataclass(frozen=True)
class Timed:
    step_s: list[float]
    losses: list[float]
    mem: list[dict]
    elapsed_s: float


def time_steps(step: Callable[[int], torch.Tensor], steps: int, *, device: torch.device, interval: int,
               label: str, untimed: int = 2) -> Timed:
    """Run `untimed` then `steps` timed calls of step(k) -> loss (device tensor); print a MEM line every `interval`."""
    for k in range(untimed):
        step(k)
    reset_peak(device)
    cuda = device.type == "cuda"
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else [0.0] * (steps + 1)
    losses, mem = [], []
    t0 = time.perf_counter()
    _mark(marks, 0, cuda)
    for k in range(steps):
        loss = step(untimed + k)
        _mark(marks, k + 1, cuda)
        losses.append(loss.detach().clone())  # graph-owned output: copy before the next replay
        if (k + 1) % interval == 0:
            mem.append(mem_line(k + 1, device))
            print("MEM", label, json.dumps(mem[-1]), flush=True)
    if cuda:
        torch.cuda.synchronize(device)  # the one sync: end of the timed loop
        step_s = [marks[k].elapsed_time(marks[k + 1]) / 1e3 for k in range(steps)]
    else:
        step_s = [marks[k + 1] - marks[k] for k in range(steps)]
    elapsed = time.perf_counter() - t0
    return Timed(step_s, [float(x) for x in losses], mem, elapsed)


def graphed(fn: Callable[[], object]) -> tuple[Callable[[], None], object]:
    """fn captured in a CUDA graph (warmed on a side stream first) -> (replay, the captured output). CUDA only."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def median_call_ms(fn: Callable[[], object], reps: int) -> float:
    """Median ms of `reps` calls of `fn`, each between its own CUDA events, after 3 untimed calls (compilation runs
    there). CUDA only."""
    for _ in range(3):
        fn()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    marks[0].record()
    for i in range(reps):
        fn()
        marks[i + 1].record()
    torch.cuda.synchronize()
    return round(statistics.median(marks[i].elapsed_time(marks[i + 1]) for i in range(reps)), 3)


def median_backward_ms(forward: Callable[[], "torch.Tensor"], grad: "torch.Tensor", reps: int) -> float:
    """Median ms of `reps` backward passes of `forward()`'s output against `grad`, each between its own CUDA events
    (the forward runs outside them), after 3 untimed calls. Timed apart rather than as fwd+bwd minus fwd, which a
    shared or busy GPU can drive to zero or below at small shapes. CUDA only."""
    for _ in range(3):
        forward().backward(grad)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        out = forward()
        starts[i].record()
        out.backward(grad)
        ends[i].record()
    torch.cuda.synchronize()
    return round(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), 3)


def _mark(marks: list, k: int, cuda: bool) -> None:
    if cuda:
        marks[k].record()
    else:
        marks[k] = time.perf_counter()


def profile_lines(kernels: list[tuple[str, float, int]], n: int, label: str, top: int = 40) -> list[str]:
    """Pure: (kernel name, device microseconds over `n` steps, calls over `n` steps) -> PROF lines, slowest first:
    ms per step, share of the device time, calls per step, the full kernel name (two workloads' lines are compared
    name by name); then the total."""
    total = sum(us for _, us, _ in kernels) or 1.0
    lines = [
        f"PROF {label} {us / n / 1e3:8.2f} ms {100 * us / total:5.1f}% x{calls // n:<4} {name}"
        for name, us, calls in sorted(kernels, key=lambda k: -k[1])[:top]
    ]
    return lines + [f"PROF {label} total device time {total / n / 1e3:.1f} ms/step"]


# Kernel name -> category, first match wins: flex attention is an Inductor template, SDPA's kernels are flash / fmha
# (efficient) / cuDNN's *sdpa*, a Gated DeltaNet layer's state step (ours `gated_delta_step`, fla's chunked prefill)
# counts as its attention; cuBLAS names its GEMMs nvjet / sm90_xmma (FP8 `_scaled_mm` too), the FP8 activations'
# row scales are our e4m3 quantizers; the LM-head CE is one Inductor reduction (online softmax + argmax) or the
# trainer's `ce_rows`, then the optimizer's foreach/fused kernels, Inductor's other pointwise/reduction/persistent
# kernels, and plain copies.
KERNEL_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention", r"flash|fmha|flex_attention|attention|sdpa|gated_delta"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|sm90_|sm100_|triton_tem_fused_(mm|addmm|bmm)|matmul|splitk"),
    ("fp8 quantize", r"e4m3|quantize"),
    ("lm-head softmax/CE", r"softmax|logsumexp|argmax|cross_entropy|nll_loss|ce_rows"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("communication", r"nccl|allreduce|all_reduce"),
    ("fused elementwise/reduction", r"triton_(poi|red|per)_"),
    ("copy/fill", r"memcpy|memset|copy|fill|cat|index"),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, pattern in KERNEL_CATEGORIES:
        if re.search(pattern, low):
            return category
    return "other elementwise"


def profile_summary(kernels: list[tuple[str, float, int]], n: int, label: str, step_ms: float,
                    matmul_flops: float) -> list[str]:
    """Pure: the same kernels as `profile_lines`, summed by `kernel_category` -> PROFSUM lines: ms per step, share
    of the step, kernels per step; the GEMM kernels' achieved TFLOP/s (`matmul_flops`: the step's useful matmul
    FLOPs outside attention); and the step time no kernel covers (launch gaps, host work, syncs)."""
    by: dict[str, list[float]] = {}
    for name, us, calls in kernels:
        acc = by.setdefault(kernel_category(name), [0.0, 0])
        acc[0] += us / n / 1e3
        acc[1] += calls / n
    busy = sum(ms for ms, _ in by.values())
    step_ms = max(step_ms, busy) or 1.0
    lines = [f"PROFSUM {label} {cat:<28} {ms:8.2f} ms {100 * ms / step_ms:5.1f}% x{calls:.0f}"
             for cat, (ms, calls) in sorted(by.items(), key=lambda kv: -kv[1][0])]
    idle = step_ms - busy
    lines.append(f"PROFSUM {label} {'no kernel running':<28} {idle:8.2f} ms {100 * idle / step_ms:5.1f}%")
    gemm_ms = by.get("gemm", [0.0])[0]
    if gemm_ms and matmul_flops:  # 0: the caller does not count its FLOPs
        lines.append(f"PROFSUM {label} gemm rate {matmul_flops / (gemm_ms / 1e3) / 1e12:.0f} TFLOP/s "
                     f"({matmul_flops / 1e12:.1f} TFLOP in {gemm_ms:.1f} ms)")
    return lines


def gap_lines(intervals: list[tuple[str, float, float]], n: int, label: str, top: int = 8) -> list[str]:
    """Pure: device activity (name, start us, end us) of `n` profiled steps -> PROFGAP lines: the window from the
    first start to the last end, the time some kernel or copy runs (their union: overlapping streams count once)
    and the time none does, per step; then the largest idle gaps by the pair of activities around them (the one
    that ended last, the one that starts), total ms per step and count per step. The window holds the n - 1 gaps
    between profiled steps, not the one before the first or after the last: profile 2 or more steps to see them."""
    if not intervals:
        return [f"PROFGAP {label} no device activity recorded"]
    events = sorted(intervals, key=lambda e: e[1])
    window = max(end for _, _, end in events) - events[0][1]
    busy, gaps = 0.0, {}
    last_name, run_start, run_end = events[0][0], events[0][1], events[0][2]
    for name, start, end in events[1:]:
        if start > run_end:
            busy += run_end - run_start
            acc = gaps.setdefault((last_name, name), [0.0, 0])
            acc[0] += start - run_end
            acc[1] += 1
            run_start = start
        if end >= run_end:
            last_name, run_end = name, end
    busy += run_end - run_start
    lines = [f"PROFGAP {label} window {window / n / 1e3:.2f} ms/step, device busy {busy / n / 1e3:.2f}, "
             f"idle {(window - busy) / n / 1e3:.2f}"]
    for (before, after), (us, count) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"PROFGAP {label} {us / n / 1e3:8.3f} ms x{count / n:<6.1f} after {before[:80]} | "
                     f"before {after[:80]}")
    return lines


def on_device(event) -> bool:
    """A profiler event (`key_averages()` row or `events()` entry) that is device work: a kernel, copy or memset.
    Kineto also reports annotation spans on the device (Inductor wraps each compiled graph's kernels in one while
    profiling); they are not work, and torch's own device totals skip them too."""
    return event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def print_profile(step: Callable[[], object], n: int, label: str, step_ms: float = 0.0,
                  matmul_flops: float = 0.0, calls: int = 0) -> None:
    """Top device kernels over `n` steps, as PROF lines (`profile_lines`), the PROFSUM summary by kernel category
    (`profile_summary`; `step_ms`: the timed median step, so its "no kernel running" compares two runs), then the
    profiled steps' own timeline (`gap_lines`: where the device waits, and between what). `step` runs `calls` times
    (default `n`: one step a call; bench.generate: one whole generation of many steps a call). CUDA only."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(calls or n):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total, e.count) for e in prof.key_averages() if on_device(e)]
    device = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if on_device(e)]
    for line in (profile_lines(rows, n, label) + profile_summary(rows, n, label, step_ms, matmul_flops)
                 + gap_lines(device, n, label)):
        print(line, flush=True)
