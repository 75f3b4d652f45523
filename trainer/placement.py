"""Where one rank's target and drafter run, and how its process joins the data-parallel job.

The one home of device resolution: the trainer, evaluation, the quality pipeline and the benchmarks all read a
device spec through `resolve_device` (pure) or `local_device` (asks torch what this host has; torch is imported
only there).

A torchrun job sets RANK / WORLD_SIZE / LOCAL_RANK in every process; without them the run is one process (world 1).
Device specs (config `device` for the drafter, `pipeline.target_device` for the target):
  auto          cuda:LOCAL_RANK when CUDA is available, else cpu
  cuda          cuda:LOCAL_RANK
  cuda:N        that GPU on every rank (one process: any GPU; several: give each rank its own via cuda:local+K)
  cuda:local+K  cuda:(LOCAL_RANK + K), e.g. targets on GPUs 0-5 (`cuda:local`) and drafters on 2-7 (`cuda:local+2`)
  same          (target only) the drafter's device
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.config import device_spec_ok
from trainer.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Placement:
    """Device strings for this rank, and the torch.distributed backend (None = one process, no process group)."""

    drafter: str
    target: str
    backend: str | None


def cpu_threads(threads: int, environ: Mapping[str, str], free_cores: int | None = None) -> int:
    """The intra-op threads to set: the config's `threads` (0: torch's default, set nothing), capped by
    OMP_NUM_THREADS where the environment sets it -- the standard way to share a machine wins over a recipe's figure
    -- and by the cores other processes leave free (at least one): more threads than free cores slow tiny CPU work
    several-fold. Pure."""
    cap = environ.get("OMP_NUM_THREADS", "").strip()
    if threads and cap.isdigit() and int(cap) > 0:
        threads = min(threads, int(cap))
    if threads and free_cores is not None:
        threads = min(threads, max(1, free_cores))
    return threads


def free_cores() -> int:
    """The cores this process may run on less those the machine is busy with (the 1-minute load average)."""
    return len(os.sched_getaffinity(0)) - round(os.getloadavg()[0])


def dist_env(environ: Mapping[str, str]) -> DistEnv:
    """Read torchrun's variables; a partial or malformed set is a usage error (one line naming the fix)."""
    keys = ("RANK", "WORLD_SIZE")
    if not any(k in environ for k in keys):
        return DistEnv(0, 1, 0)
    try:
        env = DistEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", "0")))
    except (KeyError, ValueError):
        raise ConfigError("RANK / WORLD_SIZE / LOCAL_RANK must all be integers when set",
                          hint="launch with `python -m torch.distributed.run --nproc-per-node N -m trainer train ...`, "
                               "or unset them for one process") from None
    if not (env.world >= 1 and 0 <= env.rank < env.world and env.local_rank >= 0):
        raise ConfigError(f"bad torchrun environment: RANK={env.rank} WORLD_SIZE={env.world} "
                          f"LOCAL_RANK={env.local_rank}",
                          hint="launch through torch.distributed.run; do not set these variables by hand")
    return env


def resolve_device(spec: str, local_rank: int, cuda_available: bool, device_count: int,
                   cpu_hint: str = "use --set device=cpu (or auto)") -> str:
    """One device spec (see the module docstring) -> a concrete 'cpu' or 'cuda:N' for this rank. cpu_hint: the fix
    when CUDA is missing, as the calling command takes it (`--device cpu` for regenerate and the benches)."""
    if not device_spec_ok(spec):
        raise ConfigError(f"device {spec!r} is not a device: use auto, cpu, cuda, cuda:N or cuda:local+K")
    if spec == "cpu" or (spec == "auto" and not cuda_available):
        return "cpu"
    if not cuda_available:
        raise ConfigError(f"device {spec} needs CUDA, which is not available here", hint=cpu_hint)
    if spec in ("auto", "cuda", "cuda:local"):
        index = local_rank
    elif spec.startswith("cuda:local+"):
        index = local_rank + int(spec[len("cuda:local+"):])
    else:
        index = int(spec[len("cuda:"):])
    if index >= device_count:
        raise ConfigError(f"device {spec} resolves to cuda:{index} on local rank {local_rank}, but this host has "
                          f"{device_count} GPU(s)", hint="lower --nproc-per-node or change the placement offsets")
    return f"cuda:{index}"


def local_device(spec: str, cpu_hint: str = "use --device cpu (or auto)"):
    """A device spec -> torch.device for a one-process use (evaluation, regenerate, the quality pipeline,
    benchmarks). cpu_hint: as in resolve_device."""
    import torch

    return torch.device(resolve_device(spec, 0, torch.cuda.is_available(), torch.cuda.device_count(), cpu_hint))


def resolve_placement(device: str, target_device: str, backend: str, env: DistEnv, cuda_available: bool,
                      device_count: int) -> Placement:
    """Config + torchrun env + what the host has -> this rank's Placement."""
    drafter = resolve_device(device, env.local_rank, cuda_available, device_count)
    target = drafter if target_device == "same" else resolve_device(target_device, env.local_rank, cuda_available,
                                                                     device_count)
    if env.world == 1:
        return Placement(drafter=drafter, target=target, backend=None)
    chosen = backend if backend != "auto" else ("nccl" if drafter.startswith("cuda") else "gloo")
    if chosen == "nccl" and drafter == "cpu":
        raise ConfigError("dist.backend=nccl needs the drafter on CUDA", hint="use --set dist.backend=gloo on CPU")
    return Placement(drafter=drafter, target=target, backend=chosen)
