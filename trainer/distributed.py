"""Data-parallel scale-out through torch.distributed (torchrun, NCCL): one process per GPU, one drafter replica each.

Gradients are all-reduced OUTSIDE the captured graphs (collectives inside graphs need matching captures on every
rank, and NCCL warns about multi-GPU-per-process capture): `StepGraph(sync_grads=...)` (what
`trainer.step.stepper.build_stepper(grad_sync=...)` builds in the graph modes) splits the step into forward/backward
and update graphs and calls `grad_sync()` eagerly between their replays. The all-reduce runs on the calling thread's current stream order (NCCL's internal
stream waits for it), so it needs no host sync.
"""
from __future__ import annotations

import os

import torch

from trainer.placement import DistEnv, dist_env


def init_from_env() -> DistEnv:
    """Join the torchrun job if its env is present (RANK/WORLD_SIZE/LOCAL_RANK), else a single-process 'world'.

    Sets the CUDA device to LOCAL_RANK before NCCL initializes (one GPU per process).
    """
    info = dist_env(os.environ)
    if "RANK" not in os.environ:
        return info
    torch.cuda.set_device(info.local_rank)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", info.local_rank))
    return info


def die_with_launcher() -> None:
    """Linux: SIGTERM this rank when its parent (torchrun) dies.

    torchrun starts every rank in a session of its own, so `dflash-ops stop` (which signals the job's process group)
    reaches the ranks only through torchrun: SIGTERM is forwarded, but a SIGKILL of torchrun would orphan them, still
    holding their GPUs. PR_SET_PDEATHSIG makes the kernel send SIGTERM instead. Best effort elsewhere.
    """
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the launcher died before the call above took effect
        os.kill(os.getpid(), signal.SIGTERM)


def init_group(backend: str, device: torch.device) -> None:
    """Join the torchrun job (env:// rendezvous) with `backend`; the trainer's entry (trainer/train.py) calls this once.

    nccl: binds the group to `device` (the drafter's GPU, made current first). gloo: CPU tensors, no device.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if backend == "nccl":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group(backend)


def make_grad_sync(params: list[torch.nn.Parameter], world: int):
    """Callable that averages every param's .grad across ranks in place (async all-reduces ordered on the current
    stream). Reads `p.grad` at call time, so it works with graph-owned grads allocated during capture.

    NCCL: ReduceOp.AVG. Gloo has no AVG: SUM, then divide by the world size (a power of two divides exactly, so
    2 ranks averaging equals one rank accumulating two half-scaled micro-steps bit for bit).
    """
    if world == 1:
        return None
    import torch.distributed as dist

    avg = dist.get_backend() == "nccl"
    op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM

    def sync() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        works = [dist.all_reduce(g, op=op, async_op=True) for g in grads]
        for w in works:
            w.wait()  # the current stream waits on NCCL's stream: a device-side dependency, no host sync
        if not avg:
            torch._foreach_div_(grads, float(world))

    return sync


def all_reduce_sum_(tensors: list[torch.Tensor]) -> None:
    """In-place SUM across ranks (log-cadence metrics; the caller syncs right after anyway). No-op in one process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    for t in tensors:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)


def max_over_ranks(value: int, device: torch.device) -> int:
    """Collective: the largest of every rank's `value` (the stop signal: trainer/loop.py), one all-reduce of one
    integer on `device` (the process group's: the drafter's). SYNC. One process: `value`."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def state_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and raw bytes: equal digests = bit-identical states.
    SYNC (copies to the host)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def replica_digests(module: torch.nn.Module) -> list[str]:
    """Collective: every rank's `state_digest` of `module`, in rank order (one process: a list of one)."""
    import torch.distributed as dist

    mine = state_digest(module.state_dict())
    if not dist.is_initialized():
        return [mine]
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    return found


def barrier() -> None:
    """Wait for every rank (rank 0 wrote something the others read next). No-op in one process."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group (after graphs referencing NCCL are gone and devices are synchronized)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
