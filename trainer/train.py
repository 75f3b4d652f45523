"""The training program: build a session -> run the loop -> final checkpoint, export, eval -> a `TrainResult`.
`trainer export` too.

A SIGTERM or SIGINT during the loop or the last checkpoint (trainer/signals.py) ends the run at the next log step
with a checkpoint, `DFLASH_STOPPED {json}` and the resume command instead of the export (`TrainResult.exit_code`:
143 / 130).

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
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import checkpoint, resumeline, rundir
from trainer import distributed as ddp
from trainer import placement as place
from trainer.build import Session, build, build_state, load_run_target, resolve_placement
from trainer.config import TrainCfg
from trainer.errors import NonFiniteLoss, ReplicaDrift
from trainer.export import ExportConfig, export_drafter
from trainer.loop import LoopResult, StopRule, TrainLoop, weights_nonfinite
from trainer.metrics import Console, serving_lines, write_out
from trainer.signals import StopRequest, exit_code, signal_name, stop_requests


@dataclass(frozen=True)
class TrainResult:
    """How a run ended, with the same fields on every rank (rank 0 alone evaluates: `eval` is None elsewhere)."""

    run_dir: Path
    step: int  # optimizer steps done
    planned_steps: int
    horizon: int  # the LR schedule's length at the end (< planned when a budget cut the run)
    stopped_by: str  # "steps" | "budget" | "signal"
    world: int
    rank: int
    checkpoint: Path  # the newest checkpoint, at `step` (rank 0 wrote it)
    export: Path | None  # None when a signal stopped the run
    signal: int = 0  # the signal that stopped it (stopped_by == "signal")
    eval: dict | None = None  # the simulated tau's record (trainer/eval.py), when the run evaluated
    last: dict = dataclasses.field(default_factory=dict)  # the last metrics record logged
    replica_sha256: tuple[str, ...] = ()  # one per rank, when the run finished (not after a signal)
    seconds: float = 0.0  # of the loop

    @property
    def tau(self) -> float | None:
        return self.eval.get("tau") if self.eval else None

    @property
    def exit_code(self) -> int:
        """0, or 143 / 130 for a run a SIGTERM / SIGINT stopped (what the shell reports for a killed process)."""
        return exit_code(self.signal) if self.signal else 0


def train(cfg: TrainCfg, run_dir: Path, resume: bool = False, environ=None, stop: StopRule = StopRule(),
          console: Console | None = None) -> TrainResult:
    """The whole run, as one process or as one rank of a torchrun job (process group joined and left here).
    From the first step on, SIGTERM and SIGINT stop it with a checkpoint (trainer/signals.py)."""
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
        with stop_requests(quiet=not env.is_main) as request:
            loop = TrainLoop(session, request)
            ran = loop.run(stop)
            return finish(session, loop, ran, request, nodes=_nodes(env.world, environ), environ=environ)
    finally:
        ddp.shutdown()


def _nodes(world: int, environ) -> int:
    try:
        return max(1, world // int(environ.get("LOCAL_WORLD_SIZE", world)))
    except (ValueError, ZeroDivisionError):
        return 1


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


def finish(session: Session, loop: TrainLoop, ran: LoopResult, request: StopRequest | None = None,
           nodes: int = 1, environ=None) -> TrainResult:
    """Final checkpoint, export and (optionally) eval; prints DFLASH_EVAL and DFLASH_DONE. A loop a signal stopped
    (its checkpoint written) and a signal during the final checkpoint end in `stopped` instead: no export.

    Data parallel: every rank runs the collective non-finite check and compares replica digests; rank 0 writes the
    checkpoint and export; then all ranks leave the process group together (a rank exiting alone aborts the others'
    gloo/NCCL teardown) and rank 0 alone evaluates and prints DFLASH_DONE. The other ranks return at once.
    """
    s, cursor = session, loop.cursor
    if ran.signal:
        return stopped(s, ran, nodes, environ)
    loop.check_finite(cursor.step)
    digests = ddp.replica_digests(s.state.drafter)
    if len(set(digests)) != 1:  # the replicas must never drift apart; a checkpoint of one would not be the model
        raise ReplicaDrift(f"data-parallel drafter replicas differ at step {cursor.step} "
                           f"(sha256 per rank: {[d[:12] for d in digests]})",
                           hint="a bug: gradients were not averaged identically; report it with the run directory")
    if s.env.is_main:
        with s.console.phase("writing the last checkpoint") as notes:
            if checkpoint.newest_step(s.run_dir) == cursor.step:
                notes.append("already written at its ckpt.every cadence")
            else:
                loop.save()
    if request is not None:
        signum = ddp.max_over_ranks(request.signum, s.device)  # a signal during the last checkpoint: stop here
        if signum:
            return stopped(s, dataclasses.replace(ran, stopped_by="signal", signal=signum), nodes, environ)
        request.release()  # the checkpoint holds the run: a signal from here on acts as it did before
    export = rundir.export_dir(s.run_dir)
    if s.env.is_main:
        with s.console.phase(f"writing the export {export}"):
            export_drafter(export, s.state.drafter,
                           ExportConfig.of(s.state.drafter.cfg, s.state.target, s.cfg.model.block_size))
    ddp.barrier()
    ddp.shutdown()
    result = TrainResult(run_dir=s.run_dir, step=cursor.step, planned_steps=ran.planned_steps, horizon=ran.horizon,
                         stopped_by=ran.stopped_by, world=s.env.world, rank=s.env.rank,
                         checkpoint=checkpoint.ckpt_root(s.run_dir) / f"step_{cursor.step}", export=export,
                         last=ran.last, replica_sha256=tuple(digests), seconds=ran.seconds)
    if not s.env.is_main:
        return result
    if s.cfg.eval_at_end and s.datasets.eval is not None:
        from trainer.eval import evaluate_run

        with s.console.phase("evaluating the simulated tau on the held-out rows"):
            result = dataclasses.replace(result, eval=evaluate_run(s.run_dir, rows=s.datasets.eval,
                                                                   stream=s.sink.stream))
    s.sink.done(done_record(result))
    if s.cfg.model.target:  # an empty target (a run that never resolved one) has no command
        write_out(s.sink.stream, serving_lines(export, s.cfg.model.target, s.cfg.model.block_size) + "\n")
    return result


def done_record(result: TrainResult) -> dict:
    """The DFLASH_DONE line's object (docs/contracts.md section 3). Pure."""
    record = {"step": result.step, "run_dir": str(result.run_dir), "export": str(result.export),
              "world": result.world, "replica_sha256": list(result.replica_sha256)}
    if result.eval is not None:
        record["eval"] = result.eval
    return record


def stopped(session: Session, ran: LoopResult, nodes: int = 1, environ=None) -> TrainResult:
    """A run a signal stopped, its checkpoint written by rank 0: every rank waits for that write, leaves the process
    group, and rank 0 prints DFLASH_STOPPED and the resume command (resumeline.resume_fields: `dflash-ops resume` for
    a run dflash-ops launched, read from `environ`)."""
    s, step = session, ran.cursor.step
    ddp.barrier()
    ddp.shutdown()
    ckpt = checkpoint.ckpt_root(s.run_dir) / f"step_{step}"
    result = TrainResult(run_dir=s.run_dir, step=step, planned_steps=ran.planned_steps, horizon=ran.horizon,
                         stopped_by="signal", world=s.env.world, rank=s.env.rank, checkpoint=ckpt, export=None,
                         signal=ran.signal, last=ran.last, seconds=ran.seconds)
    if s.env.is_main:
        s.sink.stopped({"step": step, "total_steps": ran.horizon, "checkpoint": str(ckpt),
                        "signal": signal_name(ran.signal), "exit_code": result.exit_code, "run_dir": str(s.run_dir),
                        "world": s.env.world,
                        **resumeline.resume_fields(s.run_dir, s.env.world, nodes, os.environ if environ is None else environ)})
    return result


def export_run(run_dir: Path, target: str | None = None) -> Path:
    """Rewrite <run_dir>/export from the newest complete checkpoint (CPU; the target supplies dims and ids). A run
    trained with CUDA-only settings (pipeline, nccl, graph modes, flex) is rebuilt with their CPU alternatives: none
    of them changes the drafter's parameters. `target`: the run's target where it is now (moved since the run,
    or a run directory that was moved with its tiny target), checked against the run's shape (rundir.export_source,
    which the CLI runs before torch too)."""
    cfg, newest = rundir.export_source(run_dir, target)
    weights = checkpoint.load_drafter(newest)  # a checkpoint that cannot be read is refused before the target loads
    target = load_run_target(cfg, "cpu", truncate=True, dtype="float32")
    state = build_state(cfg, target, torch.device("cpu"))
    state.drafter.load_state_dict(weights)
    if weights_nonfinite(state.drafter):
        raise NonFiniteLoss(f"checkpoint {newest} holds non-finite (NaN/inf) weights: nothing exported",
                            hint="remove that step's directory to export the one before it")
    return export_drafter(rundir.export_dir(run_dir), state.drafter,
                          ExportConfig.of(state.drafter.cfg, target, cfg.model.block_size))
