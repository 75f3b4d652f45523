"""Build a training session from a config: placement, target, data, drafter + optimizer, and the step driver.

Everything that compiles or captures happens here, in the main thread, before any worker thread issues CUDA work:
the sequential runner (`make_runner`) or the threaded pipeline (`make_pipeline`) is fully warmed up and captured when
`build` returns. The returned `Session` is fixed for the run's life (captured graphs hold raw addresses into its
state); the training loop (trainer/loop.py) only drives it.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import checkpoint, rundir
from trainer import distributed as ddp
from trainer import placement as place
from trainer.checkpoint import Cursor
from trainer.config import TrainCfg
from trainer.data.batching import EpochBatches, StaticBatch
from trainer.data.dataset import Datasets, build_datasets
from trainer.errors import ConfigError
from trainer.metrics import MetricsSink, QuietSink
from trainer.model.drafter import Drafter, DrafterConfig
from trainer.model.target import Target, load_target
from trainer.step.step import EagerRunner, TrainState, build_optimizer


@dataclass(frozen=True)
class Session:
    """A built run. `runner` drives sequential steps; `pipe` the threaded pipeline (exactly one is set)."""

    cfg: TrainCfg  # as resolved (model.target filled in)
    run_dir: Path
    env: place.DistEnv
    device: torch.device  # the drafter's
    state: TrainState
    datasets: Datasets
    batches: EpochBatches
    planned_steps: int  # the run's length: optim.max_steps, or epochs x steps per epoch
    start: Cursor  # where training begins (0, or the resumed checkpoint's cursor)
    sink: MetricsSink
    runner: EagerRunner | None = None
    pipe: object | None = None  # trainer.pipeline.train_pipe.PipelinedSteps


def resolve_placement(cfg: TrainCfg, env: place.DistEnv) -> place.Placement:
    return place.resolve_placement(cfg.device, cfg.pipeline.target_device, cfg.dist.backend, env,
                                   torch.cuda.is_available(), torch.cuda.device_count())


def resolve_target(cfg: TrainCfg, run_dir: Path) -> TrainCfg:
    """model.target "" -> build (or reuse) the tiny target in <run_dir>/tiny_target; the path goes into the config."""
    if cfg.model.target:
        return cfg
    from trainer.tiny import build_tiny_target

    path = rundir.tiny_target_dir(run_dir)
    if not (path / "config.json").is_file():
        build_tiny_target(path, seed=cfg.seed)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, target=str(path.resolve())))


def target_attn(device: torch.device) -> str:
    """The target's attention path: doc-causal flex on CUDA (visits only the causal in-document tiles of packed rows,
    where sdpa with the dense mask cannot use its flash kernel), the dense-mask sdpa reference elsewhere. Same
    semantics (tests/trainer/test_target_doc_attention.py). Rows whose length is not a multiple of 128 use the reference."""
    return "flex" if device.type == "cuda" else "sdpa"


def load_run_target(cfg: TrainCfg, device: torch.device | str, *, truncate: bool, dtype: str | None = None,
                    attn: str = "sdpa") -> Target:
    """The run's target with the run's taps and mask token (truncated after the last tap for training)."""
    m = cfg.model
    return load_target(m.target, num_draft_layers=m.num_draft_layers, layer_ids=m.target_layer_ids,
                       mask_token_id=m.mask_token_id, device=device, dtype=dtype or m.dtype, truncate=truncate,
                       attn=attn)


def build_state(cfg: TrainCfg, target: Target, device: torch.device) -> TrainState:
    torch.manual_seed(cfg.seed)
    m = cfg.model
    dcfg = DrafterConfig.from_target(target.hf_config, num_layers=m.num_draft_layers, num_taps=len(target.layer_ids),
                                     layer_types=m.draft_layer_types or (), sliding_window=m.draft_sliding_window)
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


def check_device_support(cfg: TrainCfg, device: torch.device) -> None:
    """Graph step modes and the flex backend are CUDA-only: say so before anything is built. (compile runs on CPU
    too, through Inductor's C++ backend.)"""
    if device.type == "cuda":
        return
    if cfg.step.captures:
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
    if cfg.step.eager:
        return EagerRunner(state, batch_dev, cfg.optim.accum_steps, grad_sync=grad_sync)
    try:
        from trainer.step.graph import make_runner as make_graph_runner  # GPU branch: compile / graph runners
    except ImportError as e:
        raise ConfigError(f"step.mode={cfg.step.mode} is not available in this build ({e})",
                          hint="use --set step.mode=eager") from None
    return make_graph_runner(cfg.step, state, batch_dev, cfg.optim.accum_steps, grad_sync=grad_sync)


def make_pipeline(cfg: TrainCfg, state: TrainState, batches: EpochBatches, target_device: torch.device,
                  device: torch.device, grad_sync):
    """Main thread, before any worker thread: capture / warm up both sides (trainer/pipeline/train_pipe.py)."""
    from trainer.pipeline import train_pipe

    return train_pipe.build(state, [batches.batch(m) for m in range(cfg.optim.accum_steps)], step=cfg.step,
                            target_device=target_device, drafter_device=device, grad_sync=grad_sync,
                            slots=cfg.pipeline.slots, prefetch=cfg.pipeline.prefetch)


def build(cfg: TrainCfg, run_dir: Path, resume: bool = False, stream=sys.stdout, *,
          env: place.DistEnv = place.DistEnv(0, 1, 0), placement: place.Placement | None = None) -> Session:
    """Build everything, capture in the main thread. Under torchrun the process group must already exist."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    placement = placement or resolve_placement(cfg, env)
    device, target_device = torch.device(placement.drafter), torch.device(placement.target)
    check_device_support(cfg, device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if env.is_main:  # rank 0 builds the tiny target and writes (or checks) config.json; the others then read
        cfg = resolve_target(cfg, run_dir)
        rundir.write_or_check_config(cfg, run_dir, resume)
    ddp.barrier()
    if not env.is_main:
        cfg = resolve_target(cfg, run_dir)
    target = load_run_target(cfg, target_device, truncate=True, attn=target_attn(target_device))
    vocab = target.embed_tokens.weight.shape[0]
    datasets = build_datasets(cfg.data, target.tokenizer, vocab, cfg.seed)
    _warn_data(datasets, cfg, env)
    pad_id = target.tokenizer.pad_token_id or 0
    batches = EpochBatches(datasets.train, cfg.data.rows_per_step, cfg.data.num_anchors, cfg.seed, pad_id,
                           rank=env.rank, world_size=env.world)
    state = build_state(cfg, target, device)
    per_epoch_steps = max(1, batches.per_epoch // cfg.optim.accum_steps)
    planned = cfg.optim.max_steps or cfg.optim.epochs * per_epoch_steps
    start = Cursor(step=0, micro=0, world=env.world)
    if resume:
        # Under torchrun on several nodes, only the node that held rank 0 has the checkpoints: it sends them.
        start = checkpoint.restore(checkpoint.read_latest_any_rank(run_dir), state.drafter, state.optimizer,
                                   state.lr_)
        if start.world != env.world:
            raise ConfigError(f"--resume with {env.world} data-parallel rank(s); the run was checkpointed with "
                              f"{start.world} (its data cursor counts per-rank micro-batches)",
                              hint=f"relaunch with --nproc-per-node {start.world}" if start.world > 1 else
                              "resume as one process (without torchrun)")
    grad_sync = ddp.make_grad_sync([p for p in state.drafter.parameters() if p.requires_grad], env.world)
    runner, pipe = None, None
    if cfg.pipeline.enabled:
        pipe = make_pipeline(cfg, state, batches, target_device, device, grad_sync)
    else:
        batch_dev = batches.batch(0).to(device)  # static device buffers; contents replaced every micro-step
        runner = make_runner(cfg, state, batch_dev, device, grad_sync)
    sink = (MetricsSink if env.is_main else QuietSink)(run_dir / "metrics.jsonl", stream)
    if env.is_main and cfg.track.backends:
        from trainer.config import to_dict
        from trainer.tracking import TrackedSink, Tracker

        sink = TrackedSink(run_dir / "metrics.jsonl", stream, Tracker(cfg.track, run_dir, to_dict(cfg), start.step))
    return Session(cfg=cfg, run_dir=run_dir, env=env, device=device, state=state, datasets=datasets,
                   batches=batches, planned_steps=planned, start=start, sink=sink, runner=runner, pipe=pipe)


def _warn_data(datasets: Datasets, cfg: TrainCfg, env: place.DistEnv) -> None:
    if not env.is_main:
        return
    for report in datasets.reports:
        if report.bad:
            print(f"warning: {report.summary()}", file=sys.stderr, flush=True)
    if datasets.train.truncated:
        print(f"warning: {datasets.train.truncated} samples longer than data.seq_len={cfg.data.seq_len} were truncated",
              file=sys.stderr, flush=True)
