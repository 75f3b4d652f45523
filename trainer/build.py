"""Build a training session from a config: placement, data, target, drafter + optimizer, and the step driver.

Start-up order: what is cheap and can refuse comes first, so a bad config or bad data fails in seconds and creates
nothing -- placement and device support, the empty-target rule and the run directory's checks, then the tokenizer
alone and the whole data set (tokenized and packed), and only then the run directory, the target, the drafter, and
compilation / capture. A start that fails before training removes what it created (bad_lines.txt stays: its error
names it). Each phase is a line on the console (trainer/metrics.py).

Everything that compiles or captures happens here, in the main thread, before any worker thread issues CUDA work:
the sequential runner (`make_runner`) or the threaded pipeline (`make_pipeline`) is fully warmed up and captured when
`build` returns. Both apply the step's kernel policy (trainer/step/policy.py) and get their stepper from the one
`trainer.step.stepper.build_stepper`. The device is checked once, where the placement is resolved
(`resolve_placement`). The returned `Session` is fixed for the run's life (captured graphs hold raw addresses into its
state); the training loop (trainer/loop.py) only drives it.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer import checkpoint, rundir
from trainer import distributed as ddp
from trainer import placement as place
from trainer.checkpoint import Cursor
from trainer.config import TrainCfg, cuda_only
from trainer.data.batching import EpochBatches, StaticBatch
from trainer.data.checks import check_ids_fit, warn_data
from trainer.data.dataset import Datasets, build_datasets
from trainer.data.source import BadLineFile
from trainer.errors import ConfigError
from trainer.metrics import Console, MetricsSink, QuietSink
from trainer.model.drafter import Dflash2Config, Drafter, DrafterConfig
from trainer.model.target import Target, load_target, resolve_mask_token_id
from trainer.step.step import TrainState, build_optimizer
from trainer.step.stepper import GradSync, Runner

if TYPE_CHECKING:
    from trainer.pipeline.train_pipe import PipelinedSteps


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
    runner: Runner | None = None
    pipe: PipelinedSteps | None = None
    console: Console = dataclasses.field(default_factory=lambda: Console(quiet=True))


def resolve_placement(cfg: TrainCfg, env: place.DistEnv) -> place.Placement:
    """This rank's devices, refused (`check_device_support`) where the drafter's device cannot run the config's
    CUDA-only settings: the trainer's one device check, before anything is built."""
    placement = place.resolve_placement(cfg.device, cfg.pipeline.target_device, cfg.dist.backend, env,
                                        torch.cuda.is_available(), torch.cuda.device_count())
    check_device_support(cfg, torch.device(placement.drafter))
    return placement


def resolve_target(cfg: TrainCfg, run_dir: Path) -> TrainCfg:
    """model.target, or <run_dir>/tiny_target where the tiny test target is allowed (rundir.with_target: the
    empty-target rule); `build` fills (or reuses) the tiny one. Pure."""
    return rundir.with_target(cfg, run_dir)


def uses_tiny_target(cfg: TrainCfg, run_dir: Path) -> bool:
    return cfg.model.allow_tiny_target and Path(cfg.model.target) == rundir.tiny_target_dir(Path(run_dir).resolve())


def load_tokenizer(cfg: TrainCfg, tiny: bool):
    """The target's tokenizer alone (light: no weights) -> (tokenizer, vocabulary rows of the target's embedding).
    A tiny target not built yet: the tokenizer it will be saved with (trainer/tiny.py: one row per token)."""
    path = Path(cfg.model.target)
    if tiny and not (path / "config.json").is_file():
        from trainer.tiny import build_tokenizer

        tokenizer = build_tokenizer()
        return tokenizer, len(tokenizer)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.target={path}: no config.json there",
                          hint="set model.target to a local Hugging Face model directory")
    from transformers import AutoConfig, AutoTokenizer

    hf = AutoConfig.from_pretrained(path, local_files_only=True)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    return AutoTokenizer.from_pretrained(path, local_files_only=True), int(text.vocab_size)


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


def to_fp8(target: Target) -> int:
    """model.target_fp8: the target's decoder-layer linears to FP8, in place (trainer/model/fp8_target.py) -> how
    many."""
    from trainer.model.fp8 import fp8_refusal
    from trainer.model.fp8_target import quantize_target_layers

    why = fp8_refusal(target.embed_tokens.weight.device, "model.target_fp8")
    if why:
        raise ConfigError(why, hint="--set model.target_fp8=false")
    return quantize_target_layers(target.model.model.layers)


def build_state(cfg: TrainCfg, target: Target, device: torch.device) -> TrainState:
    torch.manual_seed(cfg.seed)
    m = cfg.model
    dcfg = DrafterConfig.from_target(target.hf_config, num_layers=m.num_draft_layers, num_taps=len(target.layer_ids),
                                     layer_types=m.draft_layer_types or (), sliding_window=m.draft_sliding_window,
                                     dflash2=dflash2_config(m, vocab_size=target.embed_tokens.weight.shape[0]))
    drafter = Drafter(dcfg, backend=cfg.step.attn).to(device)
    o = cfg.optim
    optimizer, lr_ = build_optimizer(drafter, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                     device=device, name=o.name, muon_momentum=o.muon_momentum,
                                     muon_nesterov=o.muon_nesterov, muon_ns_steps=o.muon_ns_steps,
                                     muon_weight_decay=o.muon_weight_decay, muon_adjust_lr=o.muon_adjust_lr)
    mask_fn = None
    if cfg.step.attn == "flex":  # every mode: the static, in-place-updated BlockMask (GPU branch)
        from trainer.model.flex import build_block_mask as mask_fn
    return TrainState(target=target, drafter=drafter, optimizer=optimizer, lr_=lr_, block_size=cfg.model.block_size,
                      gamma=cfg.model.loss_gamma, loss_chunk=cfg.step.loss_chunk, clip=o.clip, attn=cfg.step.attn,
                      mask_fn=mask_fn, loss_kind=cfg.loss.kind, dpace_alpha=cfg.loss.dpace_alpha,
                      dpace_norm=cfg.loss.dpace_norm,
                      selector_weight_=(torch.zeros((), dtype=torch.float32, device=device)
                                        if dcfg.dflash2 is not None else None),
                      selector_stop_gradient=bool(cfg.loss.selector("selector_stop_gradient")))


def dflash2_config(m, *, vocab_size: int) -> Dflash2Config | None:
    """The drafter's DFlash2 structure from the config (model.drafter=dflash2, model.dflash2.*), or None (dflash)."""
    if m.drafter != "dflash2":
        return None
    d = m.dflash2
    return Dflash2Config(block_size=m.block_size, vocab_size=vocab_size,
                         conv_kernel_size=d.resolved("conv_kernel_size"), conv_group_size=d.resolved("conv_group_size"),
                         selector_rank=d.resolved("selector_rank"), selector_top_k=d.resolved("selector_top_k"),
                         output_multiplier=d.output_multiplier if d.output_multiplier is not None else 1.0,
                         final_logit_softcapping=d.final_logit_softcapping)


def check_device_support(cfg: TrainCfg, device: torch.device) -> None:
    """Graph step modes, the flex backend and the pipeline are CUDA-only (config.cuda_only): say so before anything
    is built."""
    found = cuda_only(cfg) if device.type != "cuda" else []
    if not found:
        return
    setting, alternative = found[0]
    # device=auto found no GPU: this is a GPU recipe, and running it on the CPU is not the likely fix.
    where = ("no CUDA GPU here (device=auto chose the cpu): run this recipe on a GPU machine, or on a CPU use"
             if cfg.device == "auto" else "on a CPU use")
    raise ConfigError(f"{setting} needs a CUDA device (this run is on {device})", hint=f"{where} --set {alternative}")


def make_runner(cfg: TrainCfg, state: TrainState, batch_dev: StaticBatch,
                grad_sync: GradSync | None = None) -> Runner:
    """Main thread: the step's kernel policy, then its stepper over `accum` micro-batches shaped like `batch_dev` (on
    the step's device). grad_sync: the data-parallel gradient average (None in one process)."""
    from trainer.step.policy import prepare_step
    from trainer.step.slots import encode
    from trainer.step.stepper import build_stepper

    accum = cfg.optim.accum_steps
    prepare_step(cfg.step, state, batch_dev.input_ids.device)
    return Runner(build_stepper(cfg.step, state, encode([batch_dev] * accum), accum, grad_sync=grad_sync), accum)


def make_pipeline(cfg: TrainCfg, state: TrainState, batches: EpochBatches, target_device: torch.device,
                  device: torch.device, grad_sync: GradSync | None) -> PipelinedSteps:
    """Main thread, before any worker thread: capture / warm up both sides (trainer/pipeline/train_pipe.py)."""
    from trainer.pipeline import train_pipe

    return train_pipe.build(state, [batches.batch(m) for m in range(cfg.optim.accum_steps)], step=cfg.step,
                            target_device=target_device, drafter_device=device, grad_sync=grad_sync,
                            slots=cfg.pipeline.slots, prefetch=cfg.pipeline.prefetch)


def make_driver(cfg: TrainCfg, state: TrainState, batches: EpochBatches, target_device: torch.device,
                device: torch.device, grad_sync: GradSync | None,
                console: Console) -> tuple[Runner | None, PipelinedSteps | None]:
    """(runner, None), or (None, pipe) with pipeline.enabled: what drives the session's steps, compiled, warmed up
    and captured in the main thread (each phase a console line)."""
    if cfg.pipeline.enabled:
        with console.phase(f"warming up and capturing the threaded pipeline (step.mode={cfg.step.mode})"):
            return None, make_pipeline(cfg, state, batches, target_device, device, grad_sync)
    batch_dev = batches.batch(0).to(device)  # the step's shapes on its device (a graph copies its static inputs)
    if cfg.step.captures:
        what = "compiling, warming up and capturing" if cfg.step.compiles else "warming up and capturing"
        with console.phase(f"{what} the CUDA graph (step.mode={cfg.step.mode})"):
            return make_runner(cfg, state, batch_dev, grad_sync), None
    runner = make_runner(cfg, state, batch_dev, grad_sync)
    if cfg.step.compiles:
        console.say("step.mode=compile: torch.compile compiles during the first optimizer steps")
    return runner, None


def build(cfg: TrainCfg, run_dir: Path, resume: bool = False, stream=None, *,
          env: place.DistEnv = place.DistEnv(0, 1, 0), placement: place.Placement | None = None,
          console: Console | None = None) -> Session:
    """Build everything, capture in the main thread. Under torchrun the process group must already exist. A start
    that fails (a config or data error, or Ctrl-C) removes what it created (Rollback)."""
    console = console or Console(stream, quiet=not env.is_main)
    run_dir = Path(run_dir).resolve()
    with Rollback(run_dir, active=env.is_main) as rollback:
        placement = placement or resolve_placement(cfg, env)  # train() resolved (and checked) it before the group
        device, target_device = torch.device(placement.drafter), torch.device(placement.target)
        cfg, tiny = _check_start(cfg, run_dir, resume, env)
        datasets, vocab = _read_data(cfg, run_dir, tiny, env, console)
        target = _load_target(cfg, tiny, target_device, env, console, rollback)
        rows = target.embed_tokens.weight.shape[0]
        if rows < vocab:
            check_ids_fit(datasets, rows)
        batches = EpochBatches(datasets.train, cfg.data.rows_per_step, cfg.data.num_anchors, cfg.seed,
                               target.tokenizer.pad_token_id or 0, rank=env.rank, world_size=env.world,
                               anchor_fraction=cfg.data.anchor_fraction)
        with console.phase(f"building the drafter and its optimizer on {device}") as notes:
            state = build_state(cfg, target, device)
            notes.append(f"{sum(p.numel() for p in state.drafter.parameters()) / 1e6:.1f}M parameters, "
                         f"{cfg.model.num_draft_layers} layers")
        planned = cfg.optim.max_steps or cfg.optim.epochs * max(1, batches.per_epoch // cfg.optim.accum_steps)
        start = _restore(run_dir, state, env, console) if resume else Cursor(step=0, micro=0, world=env.world)
        grad_sync = ddp.make_grad_sync([p for p in state.drafter.parameters() if p.requires_grad], env.world)
        runner, pipe = make_driver(cfg, state, batches, target_device, device, grad_sync, console)
        if state.head_fp8 is not None:
            console.say(f"step.head_fp8={cfg.step.head_fp8}: the LM head's loss GEMMs run on the FP8 tensor cores")
        if env.is_main:
            _write_run_config(cfg, run_dir, resume, console, rollback)
        sink = _make_sink(cfg, run_dir, stream, env, start, resume, rollback)
        console.say(f"training: {planned - start.step} of {planned} optimizer steps to go, in {run_dir}")
        return Session(cfg=cfg, run_dir=run_dir, env=env, device=device, state=state, datasets=datasets,
                       batches=batches, planned_steps=planned, start=start, sink=sink, runner=runner, pipe=pipe,
                       console=console)


class Rollback:
    """A start's undo, as a context manager: the paths it created (`add`), removed again -- newest first, with the run
    directory where the start created it and nothing else is in it -- when the block raises anything (a config or
    data error, Ctrl-C), on rank 0 alone (`active`: it owns the run directory). A bad_lines.txt stays: the error
    names it. Nothing that was there before the start is touched. On success it does nothing."""

    def __init__(self, run_dir: Path, active: bool) -> None:
        self.run_dir = run_dir
        self.active = active
        self.created = not run_dir.exists()
        self.made: list[Path] = []

    def add(self, path: Path) -> None:
        self.made.append(Path(path))

    def __enter__(self) -> Rollback:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and self.active:
            for path in reversed(self.made):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            if self.created and self.run_dir.is_dir() and not any(self.run_dir.iterdir()):
                self.run_dir.rmdir()
        return False  # the error goes on


def _check_start(cfg: TrainCfg, run_dir: Path, resume: bool, env: place.DistEnv) -> tuple[TrainCfg, bool]:
    """The CPU threads, the resolved target (-> cfg) and whether it is the tiny one, and rank 0's run-directory
    checks (on several nodes, the other ranks may not even have it)."""
    threads = place.cpu_threads(cfg.threads, os.environ, place.free_cores())
    if threads:
        torch.set_num_threads(threads)
    cfg = resolve_target(cfg, run_dir)
    if env.is_main:
        rundir.check_start(cfg, run_dir, resume, env.world)
    return cfg, uses_tiny_target(cfg, run_dir)


def _read_data(cfg: TrainCfg, run_dir: Path, tiny: bool, env: place.DistEnv,
               console: Console) -> tuple[Datasets, int]:
    """The tokenizer alone, then the whole data set, tokenized and packed (rank 0 records bad lines and warns) ->
    (datasets, the vocabulary rows of the target's embedding)."""
    with console.phase("loading the tokenizer" + (" of the tiny target" if tiny else f" of {cfg.model.target}")):
        tokenizer, vocab = load_tokenizer(cfg, tiny)
        # the mask id needs only the tokenizer and the embedding's rows: refuse a target without one before the data
        # is tokenized and the weights load (the target says which id it took when it loads)
        resolve_mask_token_id(tokenizer, vocab, cfg.model.mask_token_id, log=lambda _line: None)
    bad_file = BadLineFile(rundir.bad_lines_path(run_dir)) if env.is_main else None
    with console.phase(f"reading and tokenizing the data ({len(cfg.data.paths) + len(cfg.data.eval_paths)} "
                       f"file(s))") as notes:
        datasets = build_datasets(cfg.data, tokenizer, vocab, cfg.seed, bad_file=bad_file,
                                  progress=console.bytes_bar("tokenizing"))
        notes.append(f"{datasets.num_train_samples} training samples in {datasets.train.num_rows} rows of "
                     f"{cfg.data.seq_len} tokens, {datasets.num_eval_samples} held out")
    if bad_file is not None:
        bad_file.finish()
    warn_data(datasets, cfg, env)
    return datasets, vocab


def _load_target(cfg: TrainCfg, tiny: bool, target_device: torch.device, env: place.DistEnv, console: Console,
                 rollback: Rollback) -> Target:
    """Rank 0 makes the run directory and, for a tiny target not built yet, builds it (a path of the rollback);
    every rank then loads the target, in FP8 under model.target_fp8."""
    if env.is_main:
        run_dir = rollback.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        if tiny and not (Path(cfg.model.target) / "config.json").is_file():
            from trainer.tiny import build_tiny_target

            with console.phase(f"building the tiny target into {cfg.model.target}"):
                rollback.add(Path(cfg.model.target))
                build_tiny_target(cfg.model.target, seed=cfg.seed)
    ddp.barrier()  # the tiny target exists for every rank
    with console.phase(f"loading the target {cfg.model.target} on {target_device}") as notes:
        target = load_run_target(cfg, target_device, truncate=True, attn=target_attn(target_device))
        notes.append(f"{target.num_layers} layers, taps {list(target.layer_ids)}, "
                     f"{str(target.embed_tokens.weight.dtype).replace('torch.', '')}")
        if cfg.model.target_fp8:
            notes.append(f"{to_fp8(target)} linears in FP8")
    return target


def _restore(run_dir: Path, state: TrainState, env: place.DistEnv, console: Console) -> Cursor:
    """--resume: the newest checkpoint into the drafter, optimizer and schedule -> its cursor, refused where the run
    was checkpointed with another number of ranks."""
    with console.phase("restoring the newest checkpoint") as notes:
        # Under torchrun on several nodes, only the node that held rank 0 has the checkpoints: it sends them.
        start = checkpoint.restore(checkpoint.read_latest_any_rank(run_dir), state.drafter, state.optimizer,
                                   state.lr_)
        notes.append(f"{start.step} optimizer steps done")
    if start.world != env.world:
        raise ConfigError(f"--resume with {env.world} data-parallel rank(s); the run was checkpointed with "
                          f"{start.world} (its data cursor counts per-rank micro-batches)",
                          hint=f"relaunch with --nproc-per-node {start.world}" if start.world > 1 else
                          "resume as one process (without torchrun)")
    return start


def _write_run_config(cfg: TrainCfg, run_dir: Path, resume: bool, console: Console, rollback: Rollback) -> None:
    """Rank 0: config.json and data.json (new ones are the rollback's: a start that fails after this, at a tracker's
    login, keeps none), and a line where a resumed run's target or data moved."""
    for path in (rundir.config_path(run_dir), rundir.data_record_path(run_dir)):
        if not (resume and path.is_file()):
            rollback.add(path)
    moved = rundir.write_config(cfg, run_dir, resume)
    if moved:
        console.say(f"the run's files moved: {'; '.join(moved)} (config.json and data.json now say so)")


def _make_sink(cfg: TrainCfg, run_dir: Path, stream, env: place.DistEnv, start: Cursor, resume: bool,
               rollback: Rollback) -> MetricsSink:
    """The metrics sink: rank 0's (with the tracking backends of track.backends, whose outermost new folder is the
    rollback's), a quiet one on the other ranks."""
    resume_step = start.step if resume else None
    if not (env.is_main and cfg.track.backends):
        return (MetricsSink if env.is_main else QuietSink)(run_dir / "metrics.jsonl", stream, resume_step=resume_step)
    from trainer.config import to_dict
    from trainer.tracking import TrackedSink, Tracker, tracking_dir

    where = tracking_dir(cfg.track, run_dir)
    missing = [p for p in (where, *where.parents) if not p.exists()]
    if missing:  # the outermost folder this start creates goes again if the start fails
        rollback.add(missing[-1])
    return TrackedSink(run_dir / "metrics.jsonl", stream,
                       Tracker(cfg.track, run_dir, to_dict(cfg), start.step, resume=resume), resume_step=resume_step)
