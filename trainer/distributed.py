"""Data-parallel scale-out through torch.distributed (torchrun, NCCL): one process per GPU, one drafter replica each.

Gradients are all-reduced OUTSIDE the captured graphs (research/cudagraphs.md section 4: collectives inside graphs
need matching captures on every rank and NCCL warns about multi-GPU-per-process capture): `StepGraph(sync_grads=...)`
or `GraphRunner(grad_sync=...)` splits the step into forward/backward and update graphs and calls `grad_sync()`
eagerly between their replays. The all-reduce runs on the calling thread's current stream order (NCCL's internal
stream waits for it), so it needs no host sync.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_from_env() -> DistInfo:
    """Join the torchrun job if its env is present (RANK/WORLD_SIZE/LOCAL_RANK), else a single-process 'world'.

    Sets the CUDA device to LOCAL_RANK before NCCL initializes (one GPU per process).
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo(0, 1, 0)
    info = DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(info.local_rank)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", info.local_rank))
    return info


def make_grad_sync(params: list[torch.nn.Parameter], world: int):
    """Callable that averages every param's .grad across ranks in place (async NCCL all-reduces, AVG, ordered on the
    current stream). Reads `p.grad` at call time, so it works with graph-owned grads allocated during capture."""
    if world == 1:
        return None
    import torch.distributed as dist

    def sync() -> None:
        works = [dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, async_op=True) for p in params]
        for w in works:
            w.wait()  # the current stream waits on NCCL's stream: a device-side dependency, no host sync

    return sync


def shutdown() -> None:
    """Destroy the process group (after graphs referencing NCCL are gone and devices are synchronized)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
