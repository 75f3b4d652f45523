"""The quality pipeline's configuration: one recipe YAML (`trainer/recipes/quality_*.yaml`).

`corpus`, `target`, `pretrain`, `regen`, `eval` are typed here; `drafter` is a whole trainer config (`TrainCfg`, the
same keys as `trainer/recipes/*.yaml`), whose target and data the pipeline fills in. One tree, one parser (the
trainer's loader, `trainer.config.from_tree`): `--set drafter.optim.lr=1e-3` reaches the trainer's leaf like any
other, and a typo gets the same error. Pure: no torch import.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config import TrainCfg, device_spec_ok, from_tree, recipe_tree, require


@dataclass(frozen=True, kw_only=True)
class CorpusCfg:
    root: str = ""  # directory of .py sources; "" = this Python's stdlib (sysconfig "stdlib")
    max_files: int = 0  # 0 = every eligible file
    max_file_bytes: int = 200_000  # larger files (generated tables) are skipped
    heldout_every: int = 10  # files with crc32(path) % N == 0 are held out of pretraining AND drafter training
    # N >= 2: about 1/N of the other files are kept out of pretraining and feed only the drafter's regenerated data
    # (the target then answers on text it never saw, as at evaluation); 0: the drafter's data comes from the
    # pretraining files.
    drafter_only_every: int = 0
    vocab_size: int = 8192
    max_prompt_lines: int = 6  # the user turn: a function's signature and docstring, at most this many lines
    max_body_lines: int = 60  # functions with longer bodies are not used as prompts

    def __post_init__(self) -> None:
        require(self.max_files >= 0, "corpus.max_files must be >= 0 (0 = all)")
        require(self.heldout_every >= 2, "corpus.heldout_every must be >= 2")
        require(self.drafter_only_every == 0 or self.drafter_only_every >= 2,
                "corpus.drafter_only_every must be 0 (off) or >= 2")
        require(self.vocab_size >= 300, "corpus.vocab_size must be >= 300 (256 bytes + special tokens + merges)")
        require(self.max_prompt_lines >= 1 and self.max_body_lines >= 1, "corpus.max_*_lines must be >= 1")


TARGET_FAMILIES = ("qwen3", "qwen3_5")  # qwen3_5: Gated DeltaNet layers, every fourth a full-attention one


@dataclass(frozen=True, kw_only=True)
class TargetCfg:
    family: str = "qwen3"
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 1536
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        require(self.hidden_size % self.num_heads == 0, "target.hidden_size must be divisible by target.num_heads")
        require(self.num_heads % self.num_kv_heads == 0, "target.num_heads must be divisible by target.num_kv_heads")
        require(self.num_layers >= 4, "target.num_layers must be >= 4 (the drafter taps layers 1..L-3)")
        require(self.family in TARGET_FAMILIES, f"target.family must be one of {', '.join(TARGET_FAMILIES)}")


@dataclass(frozen=True, kw_only=True)
class PretrainCfg:
    steps: int = 2000
    rows: int = 64  # sequences per step
    seq_len: int = 512
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    budget_s: float = 200.0  # wall-clock cap; the LR schedule follows max(step/steps, elapsed/budget)
    compile: bool = False
    log_every: int = 50

    def __post_init__(self) -> None:
        require(self.steps >= 1 and self.rows >= 1 and self.seq_len >= 8, "pretrain.steps/rows/seq_len too small")
        require(self.lr > 0 and self.budget_s > 0, "pretrain.lr and pretrain.budget_s must be > 0")


@dataclass(frozen=True, kw_only=True)
class RegenCfg:
    train_prompts: int = 4000  # held-in prompts (from pretraining files) answered by the target -> drafter data
    eval_prompts: int = 200  # held-out prompts (from held-out files)
    max_new_tokens: int = 256
    batch_size: int = 256
    budget_s: float = 120.0  # stop starting new batches after this long (fewer samples, reported)
    # Extra drafter data: greedy continuations of random windows of held-in source text (the chat prompts alone
    # give only ~5k answers). 0 = none.
    continuations: int = 0
    continuation_prompt_tokens: int = 96
    continuation_new_tokens: int = 128
    continuation_batch_size: int = 1024
    # static: continuations through trainer.decode.generate.BatchGenerator (static cache, one CUDA graph replay per
    # token for the whole batch; falls back to hf with a note if it fails); hf: HF generate.
    engine: str = "static"

    def __post_init__(self) -> None:
        require(self.train_prompts >= 1 and self.eval_prompts >= 1, "regen.*_prompts must be >= 1")
        require(self.max_new_tokens >= 1 and self.batch_size >= 1, "regen.max_new_tokens/batch_size must be >= 1")
        require(self.continuations >= 0 and self.continuation_prompt_tokens >= 1 and self.continuation_new_tokens >= 1
                and self.continuation_batch_size >= 1, "regen.continuation_* must be >= 1 (continuations >= 0)")
        require(self.engine in ("static", "hf"), "regen.engine must be static|hf")


@dataclass(frozen=True, kw_only=True)
class EvalCfg:
    prompts: int = 32  # held-out prompts decoded at batch 1, target-only and speculative
    max_new_tokens: int = 256
    warmup: int = 2  # untimed decodes first (allocator, kernels)
    budget_s: float = 120.0
    # The target's dtype while decoding. float32: a 16-token verify and a 1-token decode step then round alike, so
    # speculative output is the target's own greedy output (bf16 flipped near-ties: 22/24 prompts identical on H200).
    target_dtype: str = "float32"
    # static: static KV caches, each decode step / speculative round one CUDA graph replay (trainer/decode/);
    # hf: the HF DynamicCache reference path (trainer/decode/reference.py), eager. Both paths share the engine's timing.
    engine: str = "static"
    # static engine: torch.compile "none", the "drafter" (its draft and context append), or "all" (also the
    # target's step and verify forwards). Fewer kernels per replay; compilation takes ~30-50 s per decoder.
    compile: str = "none"
    # A second decoding benchmark with the target in this dtype ("" = none): bf16 is how targets are served, and
    # its verify forward costs less relative to a decode step, while near-ties may flip (reported as `identical`).
    also_dtype: str = ""
    # static engine, true: the target's attention through a row-invariant Triton kernel (trainer/decode/kernels.py),
    # so that a verify forward computes each token bitwise as a decode step does and bf16 decoding is lossless too.
    # Off by default because it needs Triton on CUDA (or Triton's interpreter on CPU); `quality_gpu` turns it on
    # (measured on the H200: docs/quality.md, "Exact bf16"). Not with compile=all.
    invariant: bool = False

    def __post_init__(self) -> None:
        require(self.target_dtype in ("float32", "bfloat16", "auto"), "eval.target_dtype must be float32|bfloat16|auto")
        require(self.engine in ("static", "hf"), "eval.engine must be static|hf")
        require(self.compile in ("none", "drafter", "all"), "eval.compile must be none|drafter|all")
        require(self.also_dtype in ("", "float32", "bfloat16"), "eval.also_dtype must be '', float32 or bfloat16")
        require(not (self.invariant and self.compile == "all"),
                "eval.invariant keeps the target uncompiled: use eval.compile none or drafter")
        require(self.prompts >= 1 and self.max_new_tokens >= 1, "eval.prompts and eval.max_new_tokens must be >= 1")


@dataclass(frozen=True, kw_only=True)
class QualityCfg:
    corpus: CorpusCfg = field(default_factory=CorpusCfg)
    target: TargetCfg = field(default_factory=TargetCfg)
    pretrain: PretrainCfg = field(default_factory=PretrainCfg)
    regen: RegenCfg = field(default_factory=RegenCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    drafter_budget_s: float = 200.0  # wall-clock cap on drafter training (stops early, reported)
    # > 0: the whole pipeline's wall-clock target. The drafter then gets what is left of it after pretrain and
    # regenerate, minus `eval_reserve_s` for evaluation (and never more than drafter_budget_s).
    total_budget_s: float = 0.0
    eval_reserve_s: float = 60.0
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N (trainer/placement.py)
    threads: int = 0  # CPU intra-op threads (at most OMP_NUM_THREADS where set); 0 = torch default
    drafter: TrainCfg = field(default_factory=TrainCfg)  # model.target, data paths: filled in by the pipeline

    def __post_init__(self) -> None:
        require(self.drafter_budget_s > 0, "drafter_budget_s must be > 0")
        require(device_spec_ok(self.device), f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        require(self.total_budget_s >= 0 and self.eval_reserve_s >= 0, "total_budget_s and eval_reserve_s must be >= 0")


def check_drafter_fits_target(q: QualityCfg, reused_target: str | None = None) -> None:
    """The drafter's settings against the target it will train on, before anything runs (a DFlash2 drafter's groups
    and top-k: trainer.targetdir.check_drafter_fits): the reused target's config.json under --reuse, else the one the
    recipe's `target` section builds, whose vocabulary is at most `corpus.vocab_size` (the tokenizer may learn fewer
    merges: building the drafter checks the rest). One ConfigError naming the `drafter.` key. Pure but for reading
    config.json."""
    from trainer.errors import ConfigError
    from trainer.targetdir import TargetShape, check_drafter_fits, read_shape

    shape = read_shape(reused_target) if reused_target else TargetShape(
        num_layers=q.target.num_layers, hidden_size=q.target.hidden_size, vocab_size=q.corpus.vocab_size)
    try:
        check_drafter_fits(shape, q.drafter.model)
    except ConfigError as e:
        raise ConfigError(f"drafter.{e}", hint=e.hint.replace("set model.", "set drafter.model.")) from None


def load_recipe(recipe: str, overrides: list[str] = ()) -> QualityCfg:
    """Bundled NAME (trainer/recipes/NAME.yaml) or PATH.yaml, plus `--set` overrides -> validated QualityCfg (the
    drafter's trainer config included: a bad drafter key fails here, before minutes of pretraining)."""
    _source, tree = recipe_tree(recipe)
    return from_tree(QualityCfg, tree, overrides)
