"""The training program: build a session -> run the loop -> final checkpoint, export, eval. `trainer export` too.

Data parallel (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK): every rank trains one drafter replica on its shard
(`EpochBatches(rank, world)`), gradients are averaged between the backward and the update (outside any captured
graph), so the replicas stay identical. Metrics are reduced across ranks at log cadence. Only rank 0 writes
config.json, metrics, checkpoints and the export, and prints; the other ranks are quiet. The same code runs as one
process without torchrun.
"""
from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import torch

from trainer import checkpoint, rundir
from trainer import distributed as ddp
from trainer import placement as place
from trainer.build import Session, build, build_state, load_run_target, resolve_placement
from trainer.config import TrainCfg, on_cpu
from trainer.errors import ConfigError, NonFiniteLoss, ReplicaDrift
from trainer.export import ExportConfig, export_drafter
from trainer.loop import StopRule, TrainLoop, weights_nonfinite
from trainer.metrics import Console
from trainer.targetdir import check_target_loads


def train(cfg: TrainCfg, run_dir: Path, resume: bool = False, environ=None, stop: StopRule = StopRule(),
          console: Console | None = None) -> dict:
    """The whole run, as one process or as one rank of a torchrun job (process group joined and left here)."""
    random.seed(cfg.seed)
    environ = os.environ if environ is None else environ
    env = place.dist_env(environ)
    console = console or Console(quiet=not env.is_main)
    placement = check_placement(cfg, env, environ)
    if placement.backend is not None:
        ddp.die_with_launcher()
        with console.phase(f"joining the {env.world}-process group ({placement.backend})"):
            ddp.init_group(placement.backend, torch.device(placement.drafter))
    try:
        session = build(cfg, run_dir, resume, env=env, placement=placement, console=console)
        loop = TrainLoop(session)
        loop.run(stop)
        return finish(session, loop)
    finally:
        ddp.shutdown()


def check_placement(cfg: TrainCfg, env: place.DistEnv, environ) -> place.Placement:
    """This rank's placement, refused before the process group is joined when any rank of this node could not run:
    every rank resolves every local rank's devices (LOCAL_WORLD_SIZE of them), so all fail alike and rank 0's one
    line speaks for them (trainer/errors.py). -> this rank's Placement (`build` does not check it again)."""
    try:
        local_world = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local_world = 1
    placements = [resolve_placement(cfg, place.DistEnv(rank=env.rank - env.local_rank + local_rank, world=env.world,
                                                       local_rank=local_rank))
                  for local_rank in range(max(local_world, env.local_rank + 1))]  # this rank's own among them
    return placements[env.local_rank]


def finish(session: Session, loop: TrainLoop) -> dict:
    """Final checkpoint, export and (optionally) eval; prints DFLASH_EVAL and DFLASH_DONE.

    Data parallel: every rank runs the collective non-finite check and compares replica digests; rank 0 writes the
    checkpoint and export; then all ranks leave the process group together (a rank exiting alone aborts the others'
    gloo/NCCL teardown) and rank 0 alone evaluates and prints DFLASH_DONE. The other ranks return at once.
    """
    s, cursor = session, loop.cursor
    loop.check_finite(cursor.step)
    digests = ddp.replica_digests(s.state.drafter)
    if len(set(digests)) != 1:  # the replicas must never drift apart; a checkpoint of one would not be the model
        raise ReplicaDrift(f"data-parallel drafter replicas differ at step {cursor.step} "
                           f"(sha256 per rank: {[d[:12] for d in digests]})",
                           hint="a bug: gradients were not averaged identically; report it with the run directory")
    if s.env.is_main:
        with s.console.phase(f"writing the last checkpoint and the export {rundir.export_dir(s.run_dir)}"):
            found = checkpoint.list_checkpoints(s.run_dir)
            if not found or found[-1][0] != cursor.step:
                loop.save()
            export_drafter(rundir.export_dir(s.run_dir), s.state.drafter,
                           ExportConfig.of(s.state.drafter.cfg, s.state.target, s.cfg.model.block_size))
    ddp.barrier()
    ddp.shutdown()
    if not s.env.is_main:
        return {"step": cursor.step, "rank": s.env.rank, "world": s.env.world}
    result = {"step": cursor.step, "run_dir": str(s.run_dir), "export": str(rundir.export_dir(s.run_dir)),
              "world": s.env.world, "replica_sha256": digests}
    if s.cfg.eval_at_end and s.datasets.eval is not None:
        from trainer.eval import evaluate_run

        with s.console.phase("evaluating the simulated tau on the held-out rows"):
            result["eval"] = evaluate_run(s.run_dir, rows=s.datasets.eval, stream=s.sink.stream)
    s.sink.done(result)
    return result


def export_run(run_dir: Path, target: str | None = None) -> Path:
    """Rewrite <run_dir>/export from the newest complete checkpoint (CPU; the target supplies dims and ids). A run
    trained with CUDA-only settings (pipeline, nccl, graph modes, flex) is rebuilt with their CPU alternatives: none
    of them changes the drafter's parameters. `target`: the run's target where it is now (moved since the run,
    or a run directory that was moved with its tiny target), checked against the run's shape."""
    cfg = on_cpu(rundir.load_run_config(run_dir))
    if target is not None:
        check_target_loads(cfg.model, target)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, target=target))
    elif not (Path(cfg.model.target) / "config.json").is_file():
        raise ConfigError(f"the run's target {cfg.model.target} is not there (moved or removed since the run)",
                          hint="pass --target DIR: the same target where it is now")
    newest = rundir.newest_checkpoint(run_dir)
    target = load_run_target(cfg, "cpu", truncate=True, dtype="float32")
    state = build_state(cfg, target, torch.device("cpu"))
    state.drafter.load_state_dict(torch.load(newest / "drafter.pt", map_location="cpu"))
    if weights_nonfinite(state.drafter):
        raise NonFiniteLoss(f"checkpoint {newest} holds non-finite (NaN/inf) weights: nothing exported",
                            hint="remove that step's directory to export the one before it")
    return export_drafter(rundir.export_dir(run_dir), state.drafter,
                          ExportConfig.of(state.drafter.cfg, target, cfg.model.block_size))
