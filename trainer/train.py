"""The training program: resolve config -> build target, data, drafter, optimizer -> loop -> checkpoint/export/eval.

Host syncs happen only at log / checkpoint cadence (trainer/metrics.py); the loop itself only enqueues work.
"""
from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import checkpoint
from trainer.checkpoint import Cursor
from trainer.config import TrainCfg, from_dict, to_dict
from trainer.data.batching import EpochBatches, StaticBatch
from trainer.data.dataset import Datasets, build_datasets
from trainer.errors import ConfigError, NonFiniteLoss
from trainer.metrics import DeviceMetrics, MetricsSink, peak_mem_gib
from trainer.model.drafter import Drafter, DrafterConfig
from trainer.model.target import Target, load_target
from trainer.step.step import EagerRunner, TrainState, build_optimizer, lr_at


def resolve_device(cfg: TrainCfg) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={cfg.device} but CUDA is not available", hint="use --set device=cpu (or auto)")
    return device


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
    device: torch.device
    state: TrainState
    datasets: Datasets
    batches: EpochBatches
    runner: EagerRunner
    total_steps: int
    cursor: Cursor
    sink: MetricsSink
    metrics: DeviceMetrics


def build_state(cfg: TrainCfg, target: Target, device: torch.device) -> TrainState:
    torch.manual_seed(cfg.seed)
    dcfg = DrafterConfig.from_target(target.hf_config, num_layers=cfg.model.num_draft_layers,
                                     num_taps=len(target.layer_ids))
    drafter = Drafter(dcfg, backend=cfg.step.attn).to(device)
    o = cfg.optim
    optimizer, lr_ = build_optimizer(drafter, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                     device=device)
    return TrainState(target=target, drafter=drafter, optimizer=optimizer, lr_=lr_, block_size=cfg.model.block_size,
                      gamma=cfg.model.loss_gamma, loss_chunk=cfg.step.loss_chunk, clip=o.clip, attn=cfg.step.attn)


def check_device_support(cfg: TrainCfg, device: torch.device) -> None:
    """Non-eager step modes and the flex backend are CUDA-only: say so before anything is built."""
    if device.type == "cuda":
        return
    if cfg.step.mode != "eager":
        raise ConfigError(f"step.mode={cfg.step.mode} needs a CUDA device (this run is on {device})",
                          hint="use --set step.mode=eager on CPU")
    if cfg.step.attn != "sdpa":
        raise ConfigError(f"step.attn={cfg.step.attn} needs a CUDA device (this run is on {device})",
                          hint="use --set step.attn=sdpa on CPU")


def make_runner(cfg: TrainCfg, state: TrainState, batch_dev: StaticBatch, device: torch.device):
    check_device_support(cfg, device)
    if cfg.step.mode == "eager":
        return EagerRunner(state, batch_dev, cfg.optim.accum_steps)
    try:
        from trainer.step.graph import make_runner as make_graph_runner  # GPU branch: compile / graph runners
    except ImportError as e:
        raise ConfigError(f"step.mode={cfg.step.mode} is not available in this build ({e})",
                          hint="use --set step.mode=eager") from None
    return make_graph_runner(cfg, state, batch_dev)


def setup(cfg: TrainCfg, run_dir: Path, resume: bool = False, stream=sys.stdout) -> Run:
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg)
    check_device_support(cfg, device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg = resolve_target(cfg, run_dir)
    write_or_check_config(cfg, run_dir, resume)
    m = cfg.model
    target = load_target(m.target, num_draft_layers=m.num_draft_layers, layer_ids=m.target_layer_ids,
                         mask_token_id=m.mask_token_id, device=device, dtype=m.dtype, truncate=True)
    vocab = target.embed_tokens.weight.shape[0]
    datasets = build_datasets(cfg.data, target.tokenizer, vocab, cfg.seed)
    for report in datasets.reports:
        if report.bad:
            print(f"warning: {report.summary()}", file=sys.stderr, flush=True)
    if datasets.train.truncated:
        print(f"warning: {datasets.train.truncated} samples longer than data.seq_len={cfg.data.seq_len} were truncated",
              file=sys.stderr, flush=True)
    pad_id = target.tokenizer.pad_token_id or 0
    batches = EpochBatches(datasets.train, cfg.data.rows_per_step, cfg.data.num_anchors, cfg.seed, pad_id)
    state = build_state(cfg, target, device)
    per_epoch_steps = max(1, batches.per_epoch // cfg.optim.accum_steps)
    total = cfg.optim.max_steps or cfg.optim.epochs * per_epoch_steps
    cursor = Cursor(step=0, micro=0)
    if resume:
        cursor = checkpoint.load_latest(run_dir, state.drafter, state.optimizer, state.lr_)
    batch_dev = batches.batch(0).to(device)  # static device buffers; contents replaced every micro-step
    runner = make_runner(cfg, state, batch_dev, device)
    return Run(cfg=cfg, run_dir=run_dir, device=device, state=state, datasets=datasets, batches=batches,
               runner=runner, total_steps=total, cursor=cursor, sink=MetricsSink(run_dir / "metrics.jsonl", stream),
               metrics=DeviceMetrics(cfg.model.block_size, device))


def _lr(run: Run, step: int) -> float:
    o = run.cfg.optim
    return lr_at(step, base_lr=o.lr, total_steps=run.total_steps, warmup_ratio=o.warmup_ratio, schedule=o.schedule,
                 min_lr_ratio=o.min_lr_ratio)


def _check_finite(run: Run, step: int) -> None:
    """SYNC. Raise NonFiniteLoss (exit 4) naming the last good checkpoint; nothing is saved over it."""
    if run.metrics.nonfinite():
        found = checkpoint.list_checkpoints(run.run_dir)
        last = str(found[-1][1]) if found else "none"
        raise NonFiniteLoss(f"non-finite loss (NaN/inf) by step {step}; stopping. Last good checkpoint: {last}",
                            hint="lower optim.lr or check the data; resume from the last good checkpoint with --resume")


def train_loop(run: Run, stop_at: int | None = None) -> Cursor:
    """Run optimizer steps from run.cursor up to stop_at (default: total). Updates run.cursor; returns it."""
    cfg, accum = run.cfg, run.cfg.optim.accum_steps
    end = min(stop_at or run.total_steps, run.total_steps)
    t_interval, steps_in_interval = time.perf_counter(), 0
    t_start = time.perf_counter()
    step, micro = run.cursor.step, run.cursor.micro
    while step < end:
        run.state.lr_.fill_(_lr(run, step))
        for out in run.runner.step([run.batches.batch(m) for m in range(micro, micro + accum)]):
            run.metrics.add(out)
        micro += accum
        step += 1
        steps_in_interval += 1
        run.cursor = Cursor(step=step, micro=micro)
        run.sink.progress_bar(step, run.total_steps)
        if step % cfg.log.every == 0 or step == end:
            _check_finite(run, step)
            now = time.perf_counter()
            _log(run, step, micro, now - t_interval, steps_in_interval, now - t_start)
            t_interval, steps_in_interval = now, 0
        if cfg.ckpt.every and step % cfg.ckpt.every == 0:
            _check_finite(run, step)
            checkpoint.save(run.run_dir, run.cursor, run.state.drafter, run.state.optimizer, cfg.ckpt.keep)
    return run.cursor


def _log(run: Run, step: int, micro: int, dt: float, steps: int, elapsed: float) -> None:
    record = {"step": step, "total_steps": run.total_steps, "epoch": run.batches.locate(max(0, micro - 1))[0]}
    record.update(run.metrics.flush())
    tokens = steps * run.cfg.optim.accum_steps * run.cfg.data.tokens_per_step
    record.update({"tokens_per_s": round(tokens / dt, 1) if dt > 0 else None, "lr": _lr(run, step - 1),
                   "peak_mem_gib": peak_mem_gib(run.device), "step_time_s": round(dt / max(1, steps), 4),
                   "elapsed_s": round(elapsed, 2)})
    run.sink.emit(record)


def finish(run: Run) -> dict:
    """Final checkpoint, export and (optionally) eval; prints DFLASH_EVAL and DFLASH_DONE."""
    from trainer.export import export_drafter

    _check_finite(run, run.cursor.step)
    found = checkpoint.list_checkpoints(run.run_dir)
    if not found or found[-1][0] != run.cursor.step:
        checkpoint.save(run.run_dir, run.cursor, run.state.drafter, run.state.optimizer, run.cfg.ckpt.keep)
    export_drafter(run.run_dir / "export", run.state.drafter, exported_config(run.cfg, run.state))
    result = {"step": run.cursor.step, "run_dir": str(run.run_dir), "export": str(run.run_dir / "export")}
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


def train(cfg: TrainCfg, run_dir: Path, resume: bool = False) -> dict:
    random.seed(cfg.seed)
    run = setup(cfg, run_dir, resume)
    train_loop(run)
    return finish(run)


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
