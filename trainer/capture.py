"""CUDA graph capture, the one way the trainer does it: training (trainer/step/graph.py), the pipeline's target side
(trainer/pipeline/train_pipe.py) and decoding (trainer/decode/engine.py) all capture through here.

The rules it keeps:
- main thread only, one device at a time, before any worker thread issues CUDA work;
- every call runs under a device guard on an explicit stream made for that device: torch.cuda.graph's default side
  stream is a class attribute created on whichever device was current first, the capture-device trap;
- warm-up runs on the same stream as the capture (lazy inits: cuBLAS handles, autotuning, autocast caches, Adam's
  state), and the caller's stream waits for it, so nothing the warm-up wrote is in flight when capture starts;
- graphs that are always replayed back to back, never concurrently, may share one memory pool (`pool`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Capture:
    """One device's capture context: an explicit stream, and warm-up / capture on it under a device guard."""

    def __init__(self, device: torch.device, error_mode: str = "thread_local") -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.device = device
        self.error_mode = error_mode
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device=device)

    def warm_up(self, fn: Callable[[], Any], times: int) -> None:
        """Run fn `times` times on the capture stream, then make the caller's stream wait and sync the device."""
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                for _ in range(times):
                    fn()
            current.wait_stream(self.stream)
            torch.cuda.synchronize(self.device)

    def graph(self, fn: Callable[[], Any], pool=None) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Capture one call of fn -> (graph, fn's return value: the graph's static outputs)."""
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=self.stream, capture_error_mode=self.error_mode):
                out = fn()
            torch.cuda.synchronize(self.device)
        return g, out


def capture(fn: Callable[[], Any], device: torch.device, warmup: int = 2,
            pool=None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm fn up `warmup` times, then capture it: the common case (a pure device function over static buffers)."""
    c = Capture(device)
    c.warm_up(fn, warmup)
    return c.graph(fn, pool)
