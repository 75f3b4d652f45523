"""The training program: resolve config -> build target, data, drafter, optimizer -> loop -> checkpoint/export/eval.

Host syncs happen only at log / checkpoint cadence (trainer/metrics.py); the loop itself only enqueues work.

Data parallel (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK): every rank trains one drafter replica on its shard
(`EpochBatches(rank, world)`), gradients are averaged between the backward and the update (outside any captured
graph), so the replicas stay identical. Metrics are reduced across ranks at log cadence. Only rank 0 writes
config.json, metrics, checkpoints and the export, and prints; the other ranks are quiet. The same code runs as one
process without torchrun.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import checkpoint
from trainer import distributed as ddp
from trainer import placement as place
from trainer.checkpoint import Cursor
from trainer.config import TrainCfg, from_dict, to_dict
from trainer.data.batching import EpochBatches, StaticBatch
from trainer.data.dataset import Datasets, build_datasets
from trainer.errors import ConfigError, NonFiniteLoss, ReplicaDrift, TrainerError
from trainer.metrics import DeviceMetrics, MetricsSink, QuietSink, peak_mem_gib
from trainer.model.drafter import Drafter, DrafterConfig
from trainer.model.target import Target, load_target
from trainer.step.step import EagerRunner, TrainState, build_optimizer, lr_at


def resolve_device(cfg: TrainCfg) -> torch.device:
    """The drafter's device for a one-process use (eval); local rank 0."""
    return torch.device(place.resolve_device(cfg.device, 0, torch.cuda.is_available(), torch.cuda.device_count()))


def resolve_placement(cfg: TrainCfg, env: place.DistEnv) -> place.Placement:
    return place.resolve_placement(cfg.device, cfg.pipeline.target_device, cfg.dist.backend, env,
                                   torch.cuda.is_available(), torch.cuda.device_count())


def resolve_target(cfg: TrainCfg, run_dir: Path) -> TrainCfg:
    """model.target "" -> build (or reuse) the tiny target in <run_dir>/tiny_target; the path goes into the config."""
    if cfg.model.target:
        return cfg
    from trainer.tiny import build_tiny_target

    path = run_dir / "tiny_target"
    if not (path / "config.json").is_file():
        build_tiny_target(path, seed=cfg.seed)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, target=str(path.resolve())))


def write_or_check_config(cfg: TrainCfg, run_dir: Path, resume: bool) -> None:
    """Fresh run: write config.json. Resume: refuse a config that differs from the one the run started with."""
    path = run_dir / "config.json"
    current = to_dict(cfg)
    if resume and path.is_file():
        saved = json.loads(path.read_text())
        diffs = _diff(saved, current)
        if diffs:
            raise ConfigError(f"--resume with a different config: {', '.join(diffs)}",
                              hint="resume with the same recipe and --set values as the original run")
        return
    if not resume and checkpoint.list_checkpoints(run_dir):
        raise ConfigError(f"{run_dir} already holds checkpoints", hint="pass --resume to continue it, or use a new --run-dir")
    path.write_text(json.dumps(current, indent=2) + "\n")


def _diff(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]} ({a!r} -> {b!r})"]


@dataclass
class Run:
    cfg: TrainCfg
    run_dir: Path
    device: torch.device  # the drafter's
    state: TrainState
    datasets: Datasets
    batches: EpochBatches
    runner: EagerRunner | None  # None when the pipeline drives the steps
    total_steps: int
    cursor: Cursor
    sink: MetricsSink
    metrics: DeviceMetrics
    env: place.DistEnv = place.DistEnv(0, 1, 0)
    pipe: object | None = None  # trainer.pipeline.train_pipe.PipelinedSteps when pipeline.enabled


def build_state(cfg: TrainCfg, target: Target, device: torch.device) -> TrainState:
    torch.manual_seed(cfg.seed)
    dcfg = DrafterConfig.from_target(target.hf_config, num_layers=cfg.model.num_draft_layers,
                                     num_taps=len(target.layer_ids))
    drafter = Drafter(dcfg, backend=cfg.step.attn).to(device)
    o = cfg.optim
    optimizer, lr_ = build_optimizer(drafter, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                     device=device)
    mask_fn = None
    if cfg.step.attn == "flex":  # every mode: the static, in-place-updated BlockMask (GPU branch)
        from trainer.model.flex import build_block_mask as mask_fn
    return TrainState(target=target, drafter=drafter, optimizer=optimizer, lr_=lr_, block_size=cfg.model.block_size,
                      gamma=cfg.model.loss_gamma, loss_chunk=cfg.step.loss_chunk, clip=o.clip, attn=cfg.step.attn,
                      mask_fn=mask_fn)


def target_attn(device: torch.device) -> str:
    """The target's attention path: doc-causal flex on CUDA (visits only the causal in-document tiles of packed rows,
    where sdpa with the dense mask cannot use its flash kernel), the dense-mask sdpa reference elsewhere. Same
    semantics (tests/trainer/test_bench_target_attn.py). Rows whose length is not a multiple of 128 use the reference."""
    return "flex" if device.type == "cuda" else "sdpa"


def check_device_support(cfg: TrainCfg, device: torch.device) -> None:
    """Graph step modes and the flex backend are CUDA-only: say so before anything is built. (compile runs on CPU
    too, through Inductor's C++ backend.)"""
    if device.type == "cuda":
        return
    if cfg.step.mode in ("graph", "compile+graph"):
        raise ConfigError(f"step.mode={cfg.step.mode} needs a CUDA device (this run is on {device})",
                          hint="use --set step.mode=eager on CPU")
    if cfg.step.attn != "sdpa":
        raise ConfigError(f"step.attn={cfg.step.attn} needs a CUDA device (this run is on {device})",
                          hint="use --set step.attn=sdpa on CPU")
    if cfg.pipeline.enabled:
        raise ConfigError(f"pipeline.enabled needs a CUDA device (this run is on {device})",
                          hint="use --set pipeline.enabled=false on CPU")


def make_runner(cfg: TrainCfg, state: TrainState, batch_dev: StaticBatch, device: torch.device, grad_sync=None):
    """Main thread. grad_sync: the data-parallel gradient average (None in one process)."""
    check_device_support(cfg, device)
    if cfg.step.mode == "eager":
        return EagerRunner(state, batch_dev, cfg.optim.accum_steps, grad_sync=grad_sync)
    try:
        from trainer.step.graph import make_runner as make_graph_runner  # GPU branch: compile / graph runners
    except ImportError as e:
        raise ConfigError(f"step.mode={cfg.step.mode} is not available in this build ({e})",
                          hint="use --set step.mode=eager") from None
    return make_graph_runner(cfg, state, batch_dev, grad_sync=grad_sync)


def make_pipeline(cfg: TrainCfg, state: TrainState, batches: EpochBatches, target_device: torch.device,
                  device: torch.device, grad_sync):
    """Main thread, before any worker thread: capture / warm up both sides (trainer/pipeline/train_pipe.py)."""
    from trainer.pipeline import train_pipe

    return train_pipe.build(state, [batches.batch(m) for m in range(cfg.optim.accum_steps)], mode=cfg.step.mode,
                            target_device=target_device, drafter_device=device, grad_sync=grad_sync,
                            slots=cfg.pipeline.slots, prefetch=cfg.pipeline.prefetch)


def setup(cfg: TrainCfg, run_dir: Path, resume: bool = False, stream=sys.stdout, *,
          env: place.DistEnv = place.DistEnv(0, 1, 0), placement: place.Placement | None = None) -> Run:
    """Build everything, capture in the main thread. Under torchrun the process group must already exist (train())."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    placement = placement or resolve_placement(cfg, env)
    device, target_device = torch.device(placement.drafter), torch.device(placement.target)
    check_device_support(cfg, device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if env.is_main:  # rank 0 builds the tiny target and writes (or checks) config.json; the others then read
        cfg = resolve_target(cfg, run_dir)
        write_or_check_config(cfg, run_dir, resume)
    ddp.barrier()
    if not env.is_main:
        cfg = resolve_target(cfg, run_dir)
    m = cfg.model
    target = load_target(m.target, num_draft_layers=m.num_draft_layers, layer_ids=m.target_layer_ids,
                         mask_token_id=m.mask_token_id, device=target_device, dtype=m.dtype, truncate=True,
                         attn=target_attn(target_device))
    vocab = target.embed_tokens.weight.shape[0]
    datasets = build_datasets(cfg.data, target.tokenizer, vocab, cfg.seed)
    _warn_data(datasets, cfg, env)
    pad_id = target.tokenizer.pad_token_id or 0
    batches = EpochBatches(datasets.train, cfg.data.rows_per_step, cfg.data.num_anchors, cfg.seed, pad_id,
                           rank=env.rank, world_size=env.world)
    state = build_state(cfg, target, device)
    per_epoch_steps = max(1, batches.per_epoch // cfg.optim.accum_steps)
    total = cfg.optim.max_steps or cfg.optim.epochs * per_epoch_steps
    cursor = Cursor(step=0, micro=0, world=env.world)
    if resume:
        # Under torchrun on several nodes, only the node that held rank 0 has the checkpoints: it sends them.
        cursor = checkpoint.restore(checkpoint.read_latest_any_rank(run_dir), state.drafter, state.optimizer,
                                    state.lr_)
        if cursor.world != env.world:
            raise ConfigError(f"--resume with {env.world} data-parallel rank(s); the run was checkpointed with "
                              f"{cursor.world} (its data cursor counts per-rank micro-batches)",
                              hint=f"relaunch with --nproc-per-node {cursor.world}" if cursor.world > 1 else
                              "resume as one process (without torchrun)")
    grad_sync = ddp.make_grad_sync([p for p in state.drafter.parameters() if p.requires_grad], env.world)
    runner, pipe = None, None
    if cfg.pipeline.enabled:
        pipe = make_pipeline(cfg, state, batches, target_device, device, grad_sync)
    else:
        batch_dev = batches.batch(0).to(device)  # static device buffers; contents replaced every micro-step
        runner = make_runner(cfg, state, batch_dev, device, grad_sync)
    sink = (MetricsSink if env.is_main else QuietSink)(run_dir / "metrics.jsonl", stream)
    return Run(cfg=cfg, run_dir=run_dir, device=device, state=state, datasets=datasets, batches=batches,
               runner=runner, total_steps=total, cursor=cursor, sink=sink,
               metrics=DeviceMetrics(cfg.model.block_size, device), env=env, pipe=pipe)


def _warn_data(datasets: Datasets, cfg: TrainCfg, env: place.DistEnv) -> None:
    if not env.is_main:
        return
    for report in datasets.reports:
        if report.bad:
            print(f"warning: {report.summary()}", file=sys.stderr, flush=True)
    if datasets.train.truncated:
        print(f"warning: {datasets.train.truncated} samples longer than data.seq_len={cfg.data.seq_len} were truncated",
              file=sys.stderr, flush=True)


def _lr(run: Run, step: int) -> float:
    o = run.cfg.optim
    return lr_at(step, base_lr=o.lr, total_steps=run.total_steps, warmup_ratio=o.warmup_ratio, schedule=o.schedule,
                 min_lr_ratio=o.min_lr_ratio)


def _check_finite(run: Run, step: int) -> None:
    """SYNC (collective: every rank calls it at the same steps). Raise NonFiniteLoss (exit 4) naming the last good
    checkpoint on every rank if any rank saw a non-finite loss; nothing is saved over it."""
    if run.metrics.nonfinite(ddp.all_reduce_sum_):
        found = checkpoint.list_checkpoints(run.run_dir)
        last = str(found[-1][1]) if found else "none"
        raise NonFiniteLoss(f"non-finite loss (NaN/inf) by step {step}; stopping. Last good checkpoint: {last}",
                            hint="lower optim.lr or check the data; resume from the last good checkpoint with --resume")


@dataclass
class _Clock:
    """Wall time of the current log interval (host clock; no device sync of its own)."""

    start: float
    interval_start: float
    steps: int = 0

    @staticmethod
    def now() -> "_Clock":
        t = time.perf_counter()
        return _Clock(start=t, interval_start=t)


def train_loop(run: Run, stop_at: int | None = None) -> Cursor:
    """Run optimizer steps from run.cursor up to stop_at (default: total). Updates run.cursor; returns it.

    Sequential (one thread) or, with pipeline.enabled, through the loader/producer/consumer threads; the per-step
    bookkeeping (`_after_step`) is the same and runs in whichever thread finished the step.
    """
    accum = run.cfg.optim.accum_steps
    end = min(stop_at or run.total_steps, run.total_steps)
    clock = _Clock.now()
    if run.pipe is not None:
        _pipelined(run, end, clock)
        return run.cursor
    while run.cursor.step < end:
        step, micro = run.cursor.step, run.cursor.micro
        run.state.lr_.fill_(_lr(run, step))
        _after_step(run, run.runner.step([_host_batch(run, m) for m in range(micro, micro + accum)]), end, clock)
    return run.cursor


def _host_batch(run: Run, micro: int) -> StaticBatch:
    """CPU micro-batch; pinned when the step runs on CUDA, so the runner's non_blocking copy never blocks the host
    (a pageable source may make the driver wait for the stream)."""
    batch = run.batches.batch(micro)
    return batch.pin_memory() if run.device.type == "cuda" else batch


def _pipelined(run: Run, end: int, clock: _Clock) -> None:
    from trainer.pipeline.train_pipe import step_inputs

    start, accum = run.cursor, run.cfg.optim.accum_steps
    steps = end - start.step
    if steps <= 0:
        return

    def feed():  # loader thread: CPU batches only
        for k in range(steps):
            first = start.micro + k * accum
            yield step_inputs([run.batches.batch(m) for m in range(first, first + accum)])

    def before() -> None:  # consumer thread, on its stream, before the step's replay
        run.state.lr_.fill_(_lr(run, run.cursor.step))

    try:
        run.pipe.run(steps, feed, before, lambda outs: _after_step(run, outs, end, clock))
    except RuntimeError as e:
        if isinstance(e.__cause__, TrainerError):  # e.g. NonFiniteLoss raised by _after_step in the consumer
            raise e.__cause__ from None
        raise


def _after_step(run: Run, outs, end: int, clock: _Clock) -> None:
    """Bookkeeping after one optimizer step: metrics (device), cursor, and at cadence log / checkpoint (SYNC)."""
    cfg = run.cfg
    for out in outs:
        run.metrics.add(out)
    step, micro = run.cursor.step + 1, run.cursor.micro + cfg.optim.accum_steps
    run.cursor = Cursor(step=step, micro=micro, world=run.env.world)
    clock.steps += 1
    run.sink.progress_bar(step, run.total_steps)
    if step % cfg.log.every == 0 or step == end:
        _check_finite(run, step)
        now = time.perf_counter()
        _log(run, step, micro, now - clock.interval_start, clock.steps, now - clock.start)
        clock.interval_start, clock.steps = now, 0
    if cfg.ckpt.every and step % cfg.ckpt.every == 0:
        _check_finite(run, step)
        _save(run)


def _save(run: Run) -> None:
    """Rank 0 only: the replicas are identical, one copy is the checkpoint."""
    if run.env.is_main:
        checkpoint.save(run.run_dir, run.cursor, run.state.drafter, run.state.optimizer, run.cfg.ckpt.keep)


def _log(run: Run, step: int, micro: int, dt: float, steps: int, elapsed: float) -> None:
    """Collective at log cadence: metrics are summed over ranks; tokens/s counts every rank's tokens."""
    record = {"step": step, "total_steps": run.total_steps, "epoch": run.batches.locate(max(0, micro - 1))[0]}
    record.update(run.metrics.flush(ddp.all_reduce_sum_))
    tokens = steps * run.cfg.optim.accum_steps * run.cfg.data.tokens_per_step * run.env.world
    record.update({"tokens_per_s": round(tokens / dt, 1) if dt > 0 else None, "lr": _lr(run, step - 1),
                   "peak_mem_gib": peak_mem_gib(run.device), "step_time_s": round(dt / max(1, steps), 4),
                   "elapsed_s": round(elapsed, 2), "world": run.env.world})
    run.sink.emit(record)


def finish(run: Run) -> dict:
    """Final checkpoint, export and (optionally) eval; prints DFLASH_EVAL and DFLASH_DONE.

    Data parallel: every rank runs the collective non-finite check and compares replica digests; rank 0 writes the
    checkpoint and export; then all ranks leave the process group together (a rank exiting alone aborts the others'
    gloo/NCCL teardown) and rank 0 alone evaluates and prints DFLASH_DONE. The other ranks return at once.
    """
    from trainer.export import export_drafter

    _check_finite(run, run.cursor.step)
    digests = ddp.replica_digests(run.state.drafter)
    if len(set(digests)) != 1:  # the replicas must never drift apart; a checkpoint of one would not be the model
        raise ReplicaDrift(f"data-parallel drafter replicas differ at step {run.cursor.step} "
                           f"(sha256 per rank: {[d[:12] for d in digests]})",
                           hint="a bug: gradients were not averaged identically; report it with the run directory")
    if run.env.is_main:
        found = checkpoint.list_checkpoints(run.run_dir)
        if not found or found[-1][0] != run.cursor.step:
            checkpoint.save(run.run_dir, run.cursor, run.state.drafter, run.state.optimizer, run.cfg.ckpt.keep)
        export_drafter(run.run_dir / "export", run.state.drafter, exported_config(run.cfg, run.state))
    ddp.barrier()
    ddp.shutdown()
    if not run.env.is_main:
        return {"step": run.cursor.step, "rank": run.env.rank, "world": run.env.world}
    result = {"step": run.cursor.step, "run_dir": str(run.run_dir), "export": str(run.run_dir / "export"),
              "world": run.env.world, "replica_sha256": digests}
    if run.cfg.eval_at_end and run.datasets.eval is not None:
        from trainer.eval import evaluate_run

        result["eval"] = evaluate_run(run.run_dir, rows=run.datasets.eval, stream=run.sink.stream)
    run.sink.done(result)
    return result


def exported_config(cfg: TrainCfg, state: TrainState) -> dict:
    from trainer.export import export_config

    t = state.target
    return export_config(state.drafter.cfg, block_size=cfg.model.block_size, layer_ids=t.layer_ids,
                         num_target_layers=t.num_layers, mask_token_id=t.mask_token_id,
                         vocab_size=t.embed_tokens.weight.shape[0],
                         max_position_embeddings=getattr(t.hf_config, "max_position_embeddings", 32768),
                         dtype="bfloat16")


def train(cfg: TrainCfg, run_dir: Path, resume: bool = False, environ=None) -> dict:
    """The whole run, as one process or as one rank of a torchrun job (process group joined and left here)."""
    random.seed(cfg.seed)
    env = place.dist_env(os.environ if environ is None else environ)
    placement = resolve_placement(cfg, env)
    if placement.backend is not None:
        ddp.die_with_launcher()
        ddp.init_group(placement.backend, torch.device(placement.drafter))
    try:
        run = setup(cfg, run_dir, resume, env=env, placement=placement)
        train_loop(run)
        return finish(run)
    finally:
        ddp.shutdown()


def load_run_config(run_dir: Path) -> TrainCfg:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no config.json", hint="point --run-dir at a trainer run directory")
    return from_dict(TrainCfg, json.loads(path.read_text()))


def export_run(run_dir: Path) -> Path:
    """Rewrite <run_dir>/export from the newest complete checkpoint (CPU; the target supplies dims and ids)."""
    from trainer.export import export_drafter

    cfg = dataclasses.replace(load_run_config(run_dir), device="cpu")
    found = checkpoint.list_checkpoints(run_dir)
    if not found:
        raise ConfigError(f"{run_dir} has no complete checkpoint to export")
    m = cfg.model
    target = load_target(m.target, num_draft_layers=m.num_draft_layers, layer_ids=m.target_layer_ids,
                         mask_token_id=m.mask_token_id, device="cpu", dtype="float32", truncate=True)
    state = build_state(cfg, target, torch.device("cpu"))
    state.drafter.load_state_dict(torch.load(found[-1][1] / "drafter.pt", map_location="cpu"))
    return export_drafter(Path(run_dir) / "export", state.drafter, exported_config(cfg, state))
