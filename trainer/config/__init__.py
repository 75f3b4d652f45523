"""The trainer's configuration: one typed tree, recipe YAML < `--set a.b=v` overrides, validated once, written to the
run directory. Four modules, one job each, and this one import surface (`from trainer.config import ...`):

  schema.py   the frozen dataclasses (TrainCfg and its sections), their checks, and what needs CUDA (cuda_only,
              on_cpu). Pure.
  dflash2.py  DFlash2's section of it (model.dflash2, the drafter kinds, the selector objective's defaults). Pure.
  loader.py   raw tree + --set -> validated dataclass (from_tree, the one parser), the trainer's load_config /
              load_resumed_config, and the error for an unknown key (with the near one).
  recipes.py  where trees come from (bundled NAME or PATH.yaml) and what kind a recipe is.

No torch import anywhere here. The checks of a target directory against a config live in trainer/targetdir.py.
"""
from trainer.config.loader import (apply_overrides, from_dict, from_tree, load_config, load_resumed_config, near,
                                   parse_overrides, set_override, to_dict, user_path, with_home_expanded)
from trainer.config.recipes import (PIPELINE_COMMAND, PIPELINE_SECTION, bundled_recipes, pipeline_recipe_error,
                                    recipe_kind, recipe_text, recipe_tree)
from trainer.config.dflash2 import DRAFTER_KINDS, Dflash2Cfg
from trainer.config.schema import (ATTN_BACKENDS, CE_KERNELS, DIST_BACKENDS, DPACE_NORMS, DTYPES, LOSS_KINDS,
                                   PAPER_GAMMA, STEP_MODES, TRACK_BACKENDS, CkptCfg, DataCfg, DistCfg, LogCfg, LossCfg,
                                   ModelCfg, OptimCfg, PipelineCfg, StepCfg, TrackCfg, TrainCfg, cuda_only,
                                   device_spec_ok, on_cpu)
from trainer.errors import require

__all__ = [
    "apply_overrides", "from_dict", "from_tree", "load_config", "load_resumed_config", "near", "parse_overrides",
    "set_override", "to_dict", "user_path", "with_home_expanded",
    "PIPELINE_COMMAND", "PIPELINE_SECTION", "bundled_recipes", "pipeline_recipe_error", "recipe_kind", "recipe_text",
    "recipe_tree",
    "ATTN_BACKENDS", "CE_KERNELS", "DIST_BACKENDS", "DPACE_NORMS", "DRAFTER_KINDS", "DTYPES", "LOSS_KINDS",
    "PAPER_GAMMA", "STEP_MODES", "TRACK_BACKENDS", "CkptCfg", "DataCfg", "DistCfg", "Dflash2Cfg", "LogCfg", "LossCfg",
    "ModelCfg", "OptimCfg",
    "PipelineCfg", "StepCfg", "TrackCfg", "TrainCfg", "cuda_only", "device_spec_ok", "on_cpu", "require",
]
