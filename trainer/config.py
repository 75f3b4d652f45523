"""One typed configuration tree: recipe YAML < `--set a.b=v` overrides, validated once, written to the run dir.

Pure: no torch import. Every `__post_init__` raises `ConfigError` with a message that names the fix.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from trainer.errors import ConfigError

STEP_MODES = ("eager", "compile", "graph", "compile+graph")
ATTN_BACKENDS = ("sdpa", "flex")
CE_KERNELS = ("auto", "torch", "triton")
DTYPES = ("auto", "float32", "bfloat16")
DIST_BACKENDS = ("auto", "nccl", "gloo")
# Paper (DFlash App. A.1): gamma = 7 / 5 / 4 for block sizes 16 / 10 / 8.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


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

    def __post_init__(self) -> None:
        _check(self.num_draft_layers >= 1, "model.num_draft_layers must be >= 1")
        if self.draft_layer_types is not None:
            kinds = ("full_attention", "sliding_attention")
            _check(len(self.draft_layer_types) == self.num_draft_layers and set(self.draft_layer_types) <= set(kinds),
                   f"model.draft_layer_types must list {kinds[0]} or {kinds[1]} for each of the "
                   f"{self.num_draft_layers} draft layers")
            _check("sliding_attention" not in self.draft_layer_types or (self.draft_sliding_window or 0) >= 1,
                   "model.draft_layer_types has sliding layers: set model.draft_sliding_window >= 1")
        _check(self.block_size >= 2, "model.block_size must be >= 2 (anchor + at least one MASK)")
        _check(self.dtype in DTYPES, f"model.dtype must be one of {DTYPES}")
        _check(self.gamma is None or self.gamma > 0, "model.gamma must be > 0 (or null for the paper value)")
        if self.target_layer_ids is not None:
            _check(len(self.target_layer_ids) >= 1, "model.target_layer_ids must list at least one layer (or be null)")
            _check(all(i >= 0 for i in self.target_layer_ids), "model.target_layer_ids must be >= 0")

    @property
    def loss_gamma(self) -> float:
        return self.gamma if self.gamma is not None else PAPER_GAMMA.get(self.block_size, self.block_size * 7.0 / 16.0)


@dataclass(frozen=True, kw_only=True)
class DataCfg:
    # JSONL files; "bundled:NAME" = trainer/assets/NAME. Empty (the gpu recipe) is refused at start (check_target),
    # not here, so that such a recipe still loads and the user is told which --set to add.
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
    max_eval_rows: int = 64

    def __post_init__(self) -> None:
        _check(0.0 <= self.eval_fraction < 1.0, "data.eval_fraction must be in [0, 1)")
        _check(self.seq_len >= 8, "data.seq_len must be >= 8")
        _check(self.rows_per_step >= 1, "data.rows_per_step must be >= 1")
        _check(1 <= self.num_anchors < self.seq_len, "data.num_anchors must be in [1, seq_len)")
        _check(self.anchor_fraction is None or 0.0 < self.anchor_fraction <= 1.0,
               "data.anchor_fraction must be in (0, 1] (or null: data.num_anchors per row)")
        _check(0.0 <= self.max_bad_fraction <= 1.0, "data.max_bad_fraction must be in [0, 1]")

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

    def __post_init__(self) -> None:
        _check(self.kind in LOSS_KINDS, f"loss.kind must be one of {LOSS_KINDS}, got {self.kind!r}")
        _check(0.0 <= self.dpace_alpha <= 1.0, "loss.dpace_alpha must be in [0, 1]")
        _check(self.dpace_norm in DPACE_NORMS, f"loss.dpace_norm must be one of {DPACE_NORMS}, got {self.dpace_norm!r}")


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
        _check(self.mode in STEP_MODES, f"step.mode must be one of {STEP_MODES}, got {self.mode!r}")
        _check(self.ce in CE_KERNELS, f"step.ce must be one of {CE_KERNELS}, got {self.ce!r}")
        _check(type(self.head_fp8) is bool or self.head_fp8 == "auto",
               f"step.head_fp8 must be auto, true or false, got {self.head_fp8!r}")
        _check(self.attn in ATTN_BACKENDS, f"step.attn must be one of {ATTN_BACKENDS}, got {self.attn!r}")
        _check(self.loss_chunk >= 1, "step.loss_chunk must be >= 1")

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

    def __post_init__(self) -> None:
        _check(self.lr > 0 and math.isfinite(self.lr), "optim.lr must be a finite number > 0")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas must be two floats in [0, 1)")
        # torch.optim refuses these only when the optimizer is built, after the target has loaded; nan/inf it
        # accepts, and the first step turns every weight into nan.
        _check(self.eps > 0 and math.isfinite(self.eps), f"optim.eps must be a finite number > 0, got {self.eps!r}")
        _check(self.weight_decay >= 0 and math.isfinite(self.weight_decay),
               f"optim.weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        _check(0.0 <= self.warmup_ratio < 1.0, "optim.warmup_ratio must be in [0, 1)")
        _check(self.schedule in ("cosine", "constant"), "optim.schedule must be 'cosine' or 'constant'")
        _check(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio must be in [0, 1]")
        _check(self.clip >= 0, "optim.clip must be >= 0 (0 disables clipping)")
        _check(self.accum_steps >= 1, "optim.accum_steps must be >= 1")
        _check(self.epochs >= 1, "optim.epochs must be >= 1")
        _check(self.max_steps >= 0, "optim.max_steps must be >= 0 (0 = run all epochs)")


@dataclass(frozen=True, kw_only=True)
class CkptCfg:
    every: int = 500  # optimizer steps between checkpoints; 0 = only at the end
    keep: int = 3

    def __post_init__(self) -> None:
        _check(self.every >= 0, "ckpt.every must be >= 0")
        _check(self.keep >= 1, "ckpt.keep must be >= 1")


@dataclass(frozen=True, kw_only=True)
class LogCfg:
    every: int = 10  # optimizer steps between metrics lines

    def __post_init__(self) -> None:
        _check(self.every >= 1, "log.every must be >= 1")


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
        _check(self.backend in DIST_BACKENDS, f"dist.backend must be one of {DIST_BACKENDS}, got {self.backend!r}")


@dataclass(frozen=True, kw_only=True)
class PipelineCfg:
    """Threaded pipeline: loader thread -> target producer thread -> event ring -> drafter consumer thread (CUDA)."""

    enabled: bool = False
    # Where this rank's target runs: same = the drafter's device (`device`); cuda:N; cuda:local+K = cuda:(LOCAL_RANK+K)
    target_device: str = "same"
    slots: int = 3  # ring slots (optimizer steps in flight between producer and consumer)
    prefetch: int = 4  # CPU batches the loader thread builds ahead

    def __post_init__(self) -> None:
        _check(self.target_device == "same" or (device_spec_ok(self.target_device)
                                                 and self.target_device.startswith("cuda")),
               f"pipeline.target_device must be same, cuda, cuda:N or cuda:local+K, got {self.target_device!r}")
        _check(self.slots >= 2, "pipeline.slots must be >= 2 (one slot written while another is read)")
        _check(self.prefetch >= 1, "pipeline.prefetch must be >= 1")


TRACK_BACKENDS = ("tensorboard", "wandb", "mlflow")


@dataclass(frozen=True, kw_only=True)
class TrackCfg:
    """Experiment tracking beside metrics.jsonl (trainer/tracking.py). W&B offline: WANDB_MODE=offline."""

    backends: tuple[str, ...] = ()  # any of tensorboard, wandb, mlflow
    project: str = "dflash"  # the W&B project / MLflow experiment
    dir: str = ""  # "" = <run_dir>/tracking

    def __post_init__(self) -> None:
        bad = [b for b in self.backends if b not in TRACK_BACKENDS]
        _check(not bad, f"track.backends: unknown {bad}; choose from {TRACK_BACKENDS}")


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
    threads: int = 0  # torch intra-op threads on CPU; 0 = torch default
    eval_at_end: bool = True

    def __post_init__(self) -> None:
        _check(device_spec_ok(self.device),
               f"device must be auto, cpu, cuda, cuda:N or cuda:local+K, got {self.device!r}")
        _check(self.threads >= 0, "threads must be >= 0")
        if self.device == "cpu":
            _check(not self.pipeline.enabled,
                   "pipeline.enabled needs CUDA (device=cpu); use --set pipeline.enabled=false")
            _check(self.dist.backend != "nccl",
                   "dist.backend=nccl needs CUDA (device=cpu); use --set dist.backend=gloo")
        _check(self.pipeline.target_device == "same" or self.pipeline.enabled,
               f"pipeline.target_device={self.pipeline.target_device} places the target apart from the drafter, "
               "which only the threaded pipeline supports; add --set pipeline.enabled=true or use "
               "pipeline.target_device=same")
        # Anchors sit at 0..seq_len-2 (data/anchors.py: an anchor and its first label in the row), so a longer block
        # always runs past the row's end: positions that are never labels, yet drafted, attended and decoded.
        _check(self.model.block_size <= self.data.seq_len,
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
    items = [alternative for _setting, alternative in cuda_only(cfg)]
    items += ["pipeline.enabled=false", "pipeline.target_device=same", "device=cpu"]
    if cfg.dist.backend == "nccl":
        items.append("dist.backend=gloo")
    return from_dict(TrainCfg, apply_overrides(to_dict(cfg), items, TrainCfg))


# ---------------------------------------------------------------- building from dicts / YAML / --set

def _resolved_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Type-check one leaf against its annotation; lists become tuples. Raises ConfigError naming the key."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        args = typing.get_args(hint)
        item = args[0]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, item, key) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{key} must have {len(args)} items, got {value!r}")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {hint!r}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build a config dataclass from nested dicts, rejecting unknown keys with the list of valid ones."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = _resolved_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in valid:
            raise ConfigError(f"unknown config key {path!r}; valid keys here: {', '.join(valid)}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(hint, value, prefix=f"{path}.")
        else:
            kwargs[key] = _coerce(value, hint, path)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    """JSON-ready dict (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def set_override(tree: dict[str, Any], dotted: str, raw: str, root: type) -> None:
    """Apply one `--set a.b=v` to a raw config tree, checking the path against the dataclass tree under `root`
    (unknown sections and keys are refused with the valid ones). The value is parsed as YAML; types are checked
    later, by `from_dict`."""
    node = tree
    parts = dotted.split(".")
    cls: type = root
    for depth, part in enumerate(parts[:-1]):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hint = _resolved_hints(cls).get(part)
        if part not in fields or not dataclasses.is_dataclass(hint):
            path = ".".join(parts[:depth + 1])
            if part in fields:
                raise ConfigError(f"--set {dotted}: {path!r} is a value, not a section; set it with --set {path}=...")
            sections = [f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(_resolved_hints(cls)[f.name])]
            if sections:
                raise ConfigError(f"unknown config section {part!r} in --set {dotted}; valid sections: "
                                  f"{', '.join(sections)}")
            raise ConfigError(f"unknown config key {path!r} in --set {dotted}; {'.'.join(parts[:depth])} has no "
                              f"sections; valid keys here: {', '.join(fields)}")
        if not isinstance(node.get(part, {}), dict):
            raise ConfigError(f"--set {dotted}: {part!r} is not a mapping in this recipe")
        node = node.setdefault(part, {})
        cls = hint
    leaf = parts[-1]
    valid = [f.name for f in dataclasses.fields(cls)]
    if leaf not in valid:
        raise ConfigError(f"unknown config key {dotted!r}; valid keys here: {', '.join(valid)}")
    if dataclasses.is_dataclass(_resolved_hints(cls)[leaf]):
        raise ConfigError(f"--set {dotted}: {leaf!r} is a section; set one of its keys, e.g. {dotted}.<key>=...")
    try:
        node[leaf] = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {dotted}: cannot parse value {raw!r}: {e}") from None


def parse_overrides(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value (e.g. --set optim.lr=3e-4), got {item!r}")
        key, raw = item.split("=", 1)
        out.append((key.strip(), raw))
    return out


def apply_overrides(tree: dict[str, Any], items: list[str], root: type) -> dict[str, Any]:
    """`--set` items on a raw tree whose schema is the dataclass `root` (in place; returns the tree)."""
    for key, raw in parse_overrides(list(items)):
        set_override(tree, key, raw, root)
    return tree


def recipe_text(recipe: str) -> tuple[str, str]:
    """Return (source, yaml text) for a bundled recipe NAME or a PATH.yaml."""
    if recipe.endswith((".yaml", ".yml")) or "/" in recipe:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {recipe}")
        return str(path), path.read_text()
    res = resources.files("trainer") / "recipes" / f"{recipe}.yaml"
    if not res.is_file():
        names = sorted(p.name[:-5] for p in (resources.files("trainer") / "recipes").iterdir() if p.name.endswith(".yaml"))
        raise ConfigError(f"unknown recipe {recipe!r}; bundled recipes: {', '.join(names)} (or pass a PATH.yaml)")
    return f"bundled:{recipe}", res.read_text()


def recipe_tree(recipe: str) -> tuple[str, dict[str, Any]]:
    """(source, parsed mapping) of a bundled recipe NAME or a PATH.yaml."""
    source, text = recipe_text(recipe)
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {source} is not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"recipe {source} must be a mapping of sections")
    return source, tree


# A recipe with this section is a quality-pipeline recipe: trainer/quality/config.py nests a whole TrainCfg under it.
PIPELINE_SECTION = "drafter"
PIPELINE_COMMAND = "python -m trainer.quality.pipeline"


def recipe_kind(tree: dict[str, Any]) -> str:
    """Pure: "train" (every top-level key is a TrainCfg field), "pipeline" (it has the pipeline's `drafter` section),
    or "unknown"."""
    if PIPELINE_SECTION in tree:
        return "pipeline"
    names = {f.name for f in dataclasses.fields(TrainCfg)}
    return "train" if set(tree) <= names else "unknown"


def bundled_recipes() -> dict[str, str]:
    """Every bundled recipe name -> its `recipe_kind` (a recipe that does not parse counts as "unknown")."""
    out = {}
    for res in sorted((resources.files("trainer") / "recipes").iterdir(), key=lambda r: r.name):
        if not res.name.endswith(".yaml"):
            continue
        try:
            tree = yaml.safe_load(res.read_text()) or {}
        except yaml.YAMLError:
            tree = None
        out[res.name[:-5]] = recipe_kind(tree) if isinstance(tree, dict) else "unknown"
    return out


def pipeline_recipe_error(recipe: str) -> ConfigError:
    return ConfigError(f"{recipe} is a quality-pipeline recipe, not a trainer recipe: run "
                       f"{PIPELINE_COMMAND} --recipe {recipe} --out DIR")


def load_config(recipe: str, overrides: list[str] = ()) -> TrainCfg:
    """Recipe (bundled name or YAML path) + `a.b=v` overrides -> validated TrainCfg. A quality-pipeline recipe is
    refused in one line that names the pipeline's command."""
    _source, tree = recipe_tree(recipe)
    if recipe_kind(tree) == "pipeline":
        raise pipeline_recipe_error(recipe)
    return _train_cfg(tree, overrides)


def _train_cfg(tree: dict[str, Any], overrides) -> TrainCfg:
    """A recipe's or a run's config tree with the `--set` overrides -> the validated TrainCfg, paths expanded."""
    return with_home_expanded(from_dict(TrainCfg, apply_overrides(tree, list(overrides), TrainCfg)))


def load_resumed_config(config_json: Path, overrides: list[str] = ()) -> TrainCfg:
    """A resumed run's config: the config.json it started with, and the `--set` overrides on top (which may change
    only rundir.RESUME_MAY_CHANGE: the resume check refuses any other difference). So `--resume` needs no --set."""
    try:
        tree = json.loads(Path(config_json).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume: cannot read {config_json} ({type(e).__name__})",
                          hint="resume a run directory that this trainer wrote") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"--resume: {config_json} is not a JSON object")
    return _train_cfg(tree, overrides)


def user_path(path: str) -> str:
    """`~` and `~user` at the start of a path, expanded as a shell would: in `--set model.target=~/m` or
    `--out=~/x.jsonl` the shell leaves it alone. Pure but for the home directory."""
    return os.path.expanduser(path) if path.startswith("~") else path


def with_home_expanded(cfg: TrainCfg) -> TrainCfg:
    """The path settings (model.target, data.paths, data.eval_paths) through `user_path`."""
    m, d = cfg.model, cfg.data
    return dataclasses.replace(
        cfg, model=dataclasses.replace(m, target=user_path(m.target)),
        data=dataclasses.replace(d, paths=tuple(map(user_path, d.paths)),
                                 eval_paths=tuple(map(user_path, d.eval_paths))))


def check_target(cfg: TrainCfg) -> None:
    """The empty-input rules, target first: model.target names a local HF directory, or is empty where the tiny
    test target is allowed (model.allow_tiny_target); data.paths lists the training data (the gpu recipe leaves it
    empty: a forgotten --set must not train a real target on the bundled toy set). Pure (the directory itself is
    checked by `check_target_dir`, the files by the data scan)."""
    if not cfg.model.target and not cfg.model.allow_tiny_target:
        raise ConfigError("model.target is empty: set model.target=DIR (a local Hugging Face model directory)",
                          hint="e.g. --set model.target=/models/Qwen3-8B")
    if not cfg.data.paths:
        raise ConfigError("data.paths is empty: name the training JSONL files with --set 'data.paths=[...]'")


def check_target_dir(cfg: TrainCfg) -> None:
    """model.target, when set, must be a target directory this trainer can load (`targetdir.read_target_dir`: its
    family, weights and tokenizer files) whose config.json the taps and model.mask_token_id fit (its layer count and
    vocabulary): read before anything is loaded."""
    check_target(cfg)
    if cfg.model.target and not (Path(cfg.model.target) / "config.json").is_file():
        raise ConfigError(f"model.target={cfg.model.target}: no config.json there",
                          hint="set model.target to a local Hugging Face model directory")
    if cfg.model.target:
        check_target_loads(cfg.model, cfg.model.target)


def check_target_loads(m: ModelCfg, target: str) -> None:
    """`target` is a directory this trainer can load (`targetdir.read_target_dir`) whose config.json the model
    settings' taps and mask id fit. Before torch: the start's check, and the export's of a target that moved."""
    from trainer.targetdir import check_model_fits, read_shape, read_target_dir

    read_target_dir(target)
    check_model_fits(read_shape(target), num_draft_layers=m.num_draft_layers, layer_ids=m.target_layer_ids,
                     mask_token_id=m.mask_token_id)
