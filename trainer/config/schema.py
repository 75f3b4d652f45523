"""The trainer's configuration schema: one typed tree of frozen dataclasses (`TrainCfg` and its sections), each
validated in `__post_init__` with a ConfigError whose message names the fix, and what the tree says about devices
(`cuda_only`, `on_cpu`). Pure: no torch, no YAML (trainer/config/loader.py builds a tree from recipes and --set).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from trainer.config.dflash2 import DRAFTER_KINDS, SELECTOR_LOSS_DEFAULTS, SELECTOR_LOSS_FIELDS, Dflash2Cfg
from trainer.errors import require

STEP_MODES = ("eager", "compile", "graph", "compile+graph")
ATTN_BACKENDS = ("sdpa", "flex")
CE_KERNELS = ("auto", "torch", "triton")
DTYPES = ("auto", "float32", "bfloat16")
DIST_BACKENDS = ("auto", "nccl", "gloo")
# Paper (DFlash App. A.1): gamma = 7 / 5 / 4 for block sizes 16 / 10 / 8.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass(frozen=True, kw_only=True)
class ModelCfg:
    target: str = ""  # local HF directory; "" is refused unless allow_tiny_target
    # True (the smoke recipe, tests): an empty target means "build the tiny test target into <run_dir>/tiny_target".
    # Off everywhere else, so that a forgotten model.target is one clear error, not a run on a toy model.
    allow_tiny_target: bool = False
    num_draft_layers: int = 5
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None  # None = DFlash spacing over [1, L-3]
    mask_token_id: int | None = None  # None = tokenizer.mask_token_id, else the `<|MASK|>` token
    gamma: float | None = None  # loss decay; None = paper value for the block size
    dtype: str = "auto"  # target dtype: auto = bf16 on CUDA, fp32 on CPU
    # Opt-in: the target's decoder-layer linears in FP8 (e4m3, per-channel weight / per-token input scales; Hopper or
    # newer; trainer/model/fp8.py). Faster, and different features: measure acceptance before relying on it.
    target_fp8: bool = False
    # The drafter's layers: full_attention | sliding_attention each (None: all full). A sliding layer's query sees
    # the `draft_sliding_window` positions ending at itself (causal inside its block).
    draft_layer_types: tuple[str, ...] | None = None
    draft_sliding_window: int | None = None
    # The drafter's architecture: dflash (z-lab's DFlashDraftModel) or dflash2 (DFlash2DraftModel: the DFlash backbone,
    # a grouped dynamic convolution around every attention and MLP, a low-rank candidate selector; docs/dflash2.md),
    # whose `dflash_config` fields are model.dflash2.
    drafter: str = "dflash"
    dflash2: Dflash2Cfg = field(default_factory=Dflash2Cfg)

    def __post_init__(self) -> None:
        require(self.num_draft_layers >= 1, "model.num_draft_layers must be >= 1")
        require(self.drafter in DRAFTER_KINDS, f"model.drafter must be one of {DRAFTER_KINDS}, got {self.drafter!r}")
        if self.drafter == "dflash":
            set_ = self.dflash2.set_fields()
            require(not set_, f"{set_[0] if set_ else ''} is a DFlash2 option and model.drafter=dflash; "
                              "add --set model.drafter=dflash2 or drop it")
        else:
            taps = self.dflash2.resolved("conv_kernel_size")
            require(taps <= self.block_size,
                    f"model.dflash2.conv_kernel_size={taps} is longer than the block (model.block_size="
                    f"{self.block_size}); the convolution mixes positions of one block only")
        if self.draft_layer_types is not None:
            kinds = ("full_attention", "sliding_attention")
            require(len(self.draft_layer_types) == self.num_draft_layers and set(self.draft_layer_types) <= set(kinds),
                    f"model.draft_layer_types must list {kinds[0]} or {kinds[1]} for each of the "
                    f"{self.num_draft_layers} draft layers")
            require("sliding_attention" not in self.draft_layer_types or (self.draft_sliding_window or 0) >= 1,
                    "model.draft_layer_types has sliding layers: set model.draft_sliding_window >= 1")
        require(self.block_size >= 2, "model.block_size must be >= 2 (anchor + at least one MASK)")
        require(self.dtype in DTYPES, f"model.dtype must be one of {DTYPES}")
        require(self.gamma is None or self.gamma > 0, "model.gamma must be > 0 (or null for the paper value)")
        if self.target_layer_ids is not None:
            require(len(self.target_layer_ids) >= 1, "model.target_layer_ids must list at least one layer (or be null)")
            require(all(i >= 0 for i in self.target_layer_ids), "model.target_layer_ids must be >= 0")

    @property
    def loss_gamma(self) -> float:
        return self.gamma if self.gamma is not None else PAPER_GAMMA.get(self.block_size, self.block_size * 7.0 / 16.0)


@dataclass(frozen=True, kw_only=True)
class DataCfg:
    # JSONL files; "bundled:NAME" = trainer/assets/NAME. Empty (the gpu recipe) is refused at start
    # (targetdir.check_target), not here, so that such a recipe still loads and the user is told which --set to add.
    paths: tuple[str, ...] = ("bundled:smoke.jsonl",)
    eval_paths: tuple[str, ...] = ()  # held-out files; empty = hold out eval_fraction of `paths`
    eval_fraction: float = 0.05
    seq_len: int = 3072  # tokens per packed row
    rows_per_step: int = 16  # token budget per micro-step = rows_per_step * seq_len
    num_anchors: int = 512  # anchor slots per row (the anchor tensor's size; unused slots masked out)
    # None: num_anchors anchors per packed row. f in (0, 1]: ceil(f * the row's supervised tokens), at most
    # num_anchors, so every supervised token is anchored with about the same chance f however rows were packed.
    anchor_fraction: float | None = None
    max_bad_fraction: float = 0.01  # fail when more than this fraction of lines is malformed
    max_eval_rows: int = 64  # held-out rows the simulated tau is measured on, at most (>= 1)

    def __post_init__(self) -> None:
        require(0.0 <= self.eval_fraction < 1.0, "data.eval_fraction must be in [0, 1)")
        require(self.seq_len >= 8, "data.seq_len must be >= 8")
        require(self.rows_per_step >= 1, "data.rows_per_step must be >= 1")
        require(1 <= self.num_anchors < self.seq_len, "data.num_anchors must be in [1, seq_len)")
        require(self.anchor_fraction is None or 0.0 < self.anchor_fraction <= 1.0,
                "data.anchor_fraction must be in (0, 1] (or null: data.num_anchors per row)")
        require(0.0 <= self.max_bad_fraction <= 1.0, "data.max_bad_fraction must be in [0, 1]")
        require(self.max_eval_rows >= 1, f"data.max_eval_rows must be >= 1, got {self.max_eval_rows}")

    @property
    def tokens_per_step(self) -> int:
        return self.rows_per_step * self.seq_len


LOSS_KINDS = ("dflash", "dpace")  # trainer/model/loss.py
DPACE_NORMS = ("rows", "positions")


@dataclass(frozen=True, kw_only=True)
class LossCfg:
    """The training objective over block positions k = 1..B-1 (trainer/model/loss.py).

    dflash: CE weighted by exp(-(k-1)/gamma) (model.gamma), the weighted mean. dpace: D-PACE (arXiv 2605.18810),
    CE weighted by detached weights from the drafter's own confidence: dpace_alpha smooths it (the paper's 0.5),
    dpace_norm divides by the rows holding a valid position (the paper's) or by the valid positions (speculators')."""

    kind: str = "dflash"
    dpace_alpha: float = 0.5
    dpace_norm: str = "rows"
    # DFlash2's selector objective (model.drafter=dflash2 only; null: SELECTOR_LOSS_DEFAULTS): a CE over the unary
    # top-k candidates, weighted by selector_alpha after a warm-up (weight 0) and a linear ramp, each a fraction of
    # the run's optimizer steps; stop_gradient: the selector term trains the selector's parameters alone.
    selector_alpha: float | None = None
    selector_warmup_ratio: float | None = None
    selector_ramp_ratio: float | None = None
    selector_stop_gradient: bool | None = None

    def __post_init__(self) -> None:
        require(self.kind in LOSS_KINDS, f"loss.kind must be one of {LOSS_KINDS}, got {self.kind!r}")
        require(0.0 <= self.dpace_alpha <= 1.0, "loss.dpace_alpha must be in [0, 1]")
        require(self.dpace_norm in DPACE_NORMS,
                f"loss.dpace_norm must be one of {DPACE_NORMS}, got {self.dpace_norm!r}")
        require(self.selector_alpha is None or (self.selector_alpha >= 0 and math.isfinite(self.selector_alpha)),
                f"loss.selector_alpha must be a finite number >= 0, got {self.selector_alpha!r}")
        for key in ("selector_warmup_ratio", "selector_ramp_ratio"):
            value = getattr(self, key)
            require(value is None or 0.0 <= value <= 1.0, f"loss.{key} must be in [0, 1], got {value!r}")
        require((self.selector_warmup_ratio or 0.0) + (self.selector_ramp_ratio or 0.0) <= 1.0,
                "loss.selector_warmup_ratio + loss.selector_ramp_ratio must be <= 1")

    def selector(self, key: str):
        """A selector-loss field's value: the one set, else SELECTOR_LOSS_DEFAULTS'."""
        value = getattr(self, key)
        return SELECTOR_LOSS_DEFAULTS[key] if value is None else value


@dataclass(frozen=True, kw_only=True)
class StepCfg:
    mode: str = "eager"  # eager | compile | graph | compile+graph (non-eager modes need CUDA)
    attn: str = "sdpa"  # drafter block attention backend
    loss_chunk: int = 4096  # positions per LM-head/CE chunk (bounds the [chunk, vocab] logits)
    # The CE chunk's softmax/argmax/dlogits math: triton = one kernel per chunk (trainer/model/ce_kernel.py, CUDA),
    # torch = PyTorch ops (Inductor-fused in the compile modes), auto = triton where it runs unless step.mode=eager.
    ce: str = "auto"
    # The LM head's two GEMMs in the loss (the logits and the gradient into the drafter) in FP8 e4m3, the CE chunk
    # writing that gradient in e4m3 (trainer/model/fp8.py). auto = on in the compile and graph modes where the FP8
    # tensor cores run it (CUDA compute capability 9.0+, a bf16 head, vocabulary and hidden size multiples of 16, a
    # test matmul that runs), else off; true = on or refuse. Acceptance at equal GPU time: docs/quality.md.
    head_fp8: bool | str = "auto"

    def __post_init__(self) -> None:
        require(self.mode in STEP_MODES, f"step.mode must be one of {STEP_MODES}, got {self.mode!r}")
        require(self.ce in CE_KERNELS, f"step.ce must be one of {CE_KERNELS}, got {self.ce!r}")
        require(type(self.head_fp8) is bool or self.head_fp8 == "auto",
                f"step.head_fp8 must be auto, true or false, got {self.head_fp8!r}")
        require(self.attn in ATTN_BACKENDS, f"step.attn must be one of {ATTN_BACKENDS}, got {self.attn!r}")
        require(self.loss_chunk >= 1, "step.loss_chunk must be >= 1")

    @property
    def eager(self) -> bool:
        """Neither compiled nor captured: the reference step, on any device."""
        return not (self.compiles or self.captures)

    @property
    def compiles(self) -> bool:
        """torch.compile the step's layers and loss math (Inductor; runs on CPU too)."""
        return self.mode in ("compile", "compile+graph")

    @property
    def captures(self) -> bool:
        """Capture the whole step as a CUDA graph in the main thread's warm-up, then replay it (CUDA only)."""
        return self.mode in ("graph", "compile+graph")


@dataclass(frozen=True, kw_only=True)
class OptimCfg:
    lr: float = 6e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    schedule: str = "cosine"  # cosine | constant
    min_lr_ratio: float = 0.0
    clip: float = 1.0  # global grad-norm clip; 0 = off
    accum_steps: int = 1
    epochs: int = 6
    max_steps: int = 0  # > 0 = run length in optimizer steps (overrides epochs); 0 = epochs * steps_per_epoch
    name: str = "adamw"  # adamw | muon (Muon on the drafter's 2-D weight matrices, AdamW on the rest)
    # name=muon only (torch.optim.Muon's settings; the LR is `lr`, scheduled, times the shape factor of adjust_lr)
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_weight_decay: float = 0.1
    muon_adjust_lr: str = "match_rms_adamw"  # original | match_rms_adamw

    def __post_init__(self) -> None:
        require(self.name in ("adamw", "muon"), f"optim.name must be 'adamw' or 'muon', got {self.name!r}")
        require(0.0 <= self.muon_momentum < 1.0, f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum!r}")
        require(isinstance(self.muon_nesterov, bool), "optim.muon_nesterov must be true or false")
        require(1 <= self.muon_ns_steps < 100, f"optim.muon_ns_steps must be in [1, 99], got {self.muon_ns_steps!r}")
        require(self.muon_weight_decay >= 0 and math.isfinite(self.muon_weight_decay),
                f"optim.muon_weight_decay must be a finite number >= 0, got {self.muon_weight_decay!r}")
        require(self.muon_adjust_lr in ("original", "match_rms_adamw"),
                f"optim.muon_adjust_lr must be 'original' or 'match_rms_adamw', got {self.muon_adjust_lr!r}")
        require(self.lr > 0 and math.isfinite(self.lr), "optim.lr must be a finite number > 0")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 "optim.betas must be two floats in [0, 1)")
        # torch.optim refuses these only when the optimizer is built, after the target has loaded; nan/inf it
        # accepts, and the first step turns every weight into nan.
        require(self.eps > 0 and math.isfinite(self.eps), f"optim.eps must be a finite number > 0, got {self.eps!r}")
        require(self.weight_decay >= 0 and math.isfinite(self.weight_decay),
                f"optim.weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        require(0.0 <= self.warmup_ratio < 1.0, "optim.warmup_ratio must be in [0, 1)")
        require(self.schedule in ("cosine", "constant"), "optim.schedule must be 'cosine' or 'constant'")
        require(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio must be in [0, 1]")
        require(self.clip >= 0, "optim.clip must be >= 0 (0 disables clipping)")
        require(self.accum_steps >= 1, "optim.accum_steps must be >= 1")
        require(self.epochs >= 1, "optim.epochs must be >= 1")
        require(self.max_steps >= 0, "optim.max_steps must be >= 0 (0 = run all epochs)")


@dataclass(frozen=True, kw_only=True)
class CkptCfg:
    every: int = 500  # optimizer steps between checkpoints; 0 = only at the end
    keep: int = 3

    def __post_init__(self) -> None:
        require(self.every >= 0, "ckpt.every must be >= 0")
        require(self.keep >= 1, "ckpt.keep must be >= 1")


@dataclass(frozen=True, kw_only=True)
class LogCfg:
    every: int = 10  # optimizer steps between metrics lines

    def __post_init__(self) -> None:
        require(self.every >= 1, "log.every must be >= 1")


def device_spec_ok(spec: str) -> bool:
    """A device spec: auto | cpu | cuda | cuda:N | cuda:local | cuda:local+K (K >= 0; see trainer/placement.py)."""
    if spec in ("auto", "cpu", "cuda"):
        return True
    if not spec.startswith("cuda:"):
        return False
    rest = spec[len("cuda:"):]
    if rest.isdigit():
        return True
    if rest == "local":
        return True
    return rest.startswith("local+") and rest[len("local+"):].isdigit()


@dataclass(frozen=True, kw_only=True)
class DistCfg:
    """Data parallel under torchrun: one drafter replica per process, gradients averaged outside the graphs."""

    backend: str = "auto"  # auto = nccl when the drafter is on CUDA, gloo on CPU

    def __post_init__(self) -> None:
        require(self.backend in DIST_BACKENDS, f"dist.backend must be one of {DIST_BACKENDS}, got {self.backend!r}")


@dataclass(frozen=True, kw_only=True)
class PipelineCfg:
    """Threaded pipeline: loader thread -> target producer thread -> event ring -> drafter consumer thread (CUDA)."""

    enabled: bool = False
    # Where this rank's target runs: same = the drafter's device (`device`); cuda:N; cuda:local+K = cuda:(LOCAL_RANK+K)
    target_device: str = "same"
    slots: int = 3  # ring slots (optimizer steps in flight between producer and consumer)
    prefetch: int = 4  # CPU batches the loader thread builds ahead

    def __post_init__(self) -> None:
        require(self.target_device == "same" or (device_spec_ok(self.target_device)
                                                  and self.target_device.startswith("cuda")),
                f"pipeline.target_device must be same, cuda, cuda:N or cuda:local+K, got {self.target_device!r}")
        require(self.slots >= 2, "pipeline.slots must be >= 2 (one slot written while another is read)")
        require(self.prefetch >= 1, "pipeline.prefetch must be >= 1")


TRACK_BACKENDS = ("tensorboard", "wandb", "mlflow")


@dataclass(frozen=True, kw_only=True)
class TrackCfg:
    """Experiment tracking beside metrics.jsonl (trainer/tracking.py). W&B offline: WANDB_MODE=offline."""

    backends: tuple[str, ...] = ()  # any of tensorboard, wandb, mlflow
    project: str = "dflash"  # the W&B project / MLflow experiment
    # "" = <run_dir>/tracking; a directory several runs share: DIR/<run-dir name>, each run its own folder (a fresh
    # run refuses one that holds another run's tracking: trainer/tracking.py)
    dir: str = ""

    def __post_init__(self) -> None:
        bad = [b for b in self.backends if b not in TRACK_BACKENDS]
        require(not bad, f"track.backends: unknown {bad}; choose from {TRACK_BACKENDS}")


@dataclass(frozen=True, kw_only=True)
class TrainCfg:
    model: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    step: StepCfg = field(default_factory=StepCfg)
    loss: LossCfg = field(default_factory=LossCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    ckpt: CkptCfg = field(default_factory=CkptCfg)
    log: LogCfg = field(default_factory=LogCfg)
    dist: DistCfg = field(default_factory=DistCfg)
    pipeline: PipelineCfg = field(default_factory=PipelineCfg)
    track: TrackCfg = field(default_factory=TrackCfg)
    seed: int = 0
    # The drafter's device: auto | cpu | cuda | cuda:N | cuda:local+K. Under torchrun auto/cuda = cuda:LOCAL_RANK.
    device: str = "auto"
    threads: int = 0  # torch intra-op threads on CPU (at most OMP_NUM_THREADS where set, and the free cores); 0 = default
    eval_at_end: bool = True

    def __post_init__(self) -> None:
        require(device_spec_ok(self.device),
                f"device must be auto, cpu, cuda, cuda:N or cuda:local+K, got {self.device!r}")
        require(self.threads >= 0, "threads must be >= 0")
        # torch.manual_seed takes a signed 64-bit seed: a larger one failed with a traceback after the build.
        require(0 <= self.seed < 2**63, f"seed must be in [0, 2**63), got {self.seed}")
        if self.device == "cpu":
            require(not self.pipeline.enabled,
                    "pipeline.enabled needs CUDA (device=cpu); use --set pipeline.enabled=false")
            require(self.dist.backend != "nccl",
                    "dist.backend=nccl needs CUDA (device=cpu); use --set dist.backend=gloo")
        require(self.pipeline.target_device == "same" or self.pipeline.enabled,
                f"pipeline.target_device={self.pipeline.target_device} places the target apart from the drafter, "
                "which only the threaded pipeline supports; add --set pipeline.enabled=true or use "
                "pipeline.target_device=same")
        # Anchors sit at 0..seq_len-2 (data/anchors.py: an anchor and its first label in the row), so a longer block
        # always runs past the row's end: positions that are never labels, yet drafted, attended and decoded.
        if self.model.drafter == "dflash":
            set_ = [f"loss.{k}" for k in SELECTOR_LOSS_FIELDS if getattr(self.loss, k) is not None]
            require(not set_, f"{set_[0] if set_ else ''} is a DFlash2 option and model.drafter=dflash; "
                              "add --set model.drafter=dflash2 or drop it")
        require(self.model.block_size <= self.data.seq_len,
                f"model.block_size={self.model.block_size} does not fit in a row of data.seq_len={self.data.seq_len} "
                "tokens; use --set model.block_size=N with N <= data.seq_len (or raise data.seq_len)")


def cuda_only(cfg: TrainCfg) -> list[tuple[str, str]]:
    """Pure: the settings of `cfg` that only run on a CUDA device, each with its CPU alternative. (compile runs on
    CPU too, through Inductor's C++ backend.)"""
    found = []
    if cfg.step.captures:
        found.append((f"step.mode={cfg.step.mode}", "step.mode=eager"))
    if cfg.step.attn != "sdpa":
        found.append((f"step.attn={cfg.step.attn}", "step.attn=sdpa"))
    if cfg.pipeline.enabled:
        found.append(("pipeline.enabled", "pipeline.enabled=false"))
    if cfg.model.target_fp8:
        found.append(("model.target_fp8", "model.target_fp8=false"))
    if cfg.step.head_fp8 is True:  # auto turns itself off where it cannot run
        found.append(("step.head_fp8", "step.head_fp8=false"))
    return found


def on_cpu(cfg: TrainCfg) -> TrainCfg:
    """Pure: `cfg` with device=cpu and every CUDA-only setting (`cuda_only`, the pipeline's placement, an nccl
    backend) at its CPU alternative: the config a CPU-side rebuild of a GPU run (the export) validates and builds."""
    replace = dataclasses.replace
    step = cfg.step
    return replace(
        cfg, device="cpu",
        model=replace(cfg.model, target_fp8=False),
        step=replace(step, mode="eager" if step.captures else step.mode, attn="sdpa",
                     head_fp8=False if step.head_fp8 is True else step.head_fp8),
        pipeline=replace(cfg.pipeline, enabled=False, target_device="same"),
        dist=replace(cfg.dist, backend="gloo") if cfg.dist.backend == "nccl" else cfg.dist)
