"""DFlash2's part of the configuration schema (model.drafter=dflash2; docs/dflash2.md): the drafter kinds, the
`model.dflash2` section and the selector objective's defaults. Pure, like schema.py, which composes it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainer.errors import require

DRAFTER_KINDS = ("dflash", "dflash2")  # trainer/model/drafter.py
# What the published DFlash2 drafters use (SpecForge's configs/qwen3.6-27b-dflash2.json, docs/dflash2.md): the
# DFlash2 fields' values when `model.drafter=dflash2` leaves them unset.
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


@dataclass(frozen=True, kw_only=True)
class Dflash2Cfg:
    """A DFlash2 drafter's `dflash_config` fields (model.drafter=dflash2; docs/dflash2.md). Unset (null) they take
    DFLASH2_DEFAULTS; a dflash drafter refuses any of them."""

    conv_kernel_size: int | None = None  # the convolution's causal taps inside a block (<= model.block_size)
    conv_group_size: int | None = None  # channels that share one dynamic coefficient (divides the hidden size)
    selector_rank: int | None = None  # the selector's codebooks' rank (vocabulary x rank)
    selector_top_k: int | None = None  # candidates per block position the selector re-scores (<= vocabulary)
    output_multiplier: float | None = None  # the serving stacks' unary-logit multiplier (null: 1, none written)
    final_logit_softcapping: float | None = None  # their soft cap tanh(x / c) * c of the unary logits (null: none)

    def __post_init__(self) -> None:
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, key)
            require(value is None or value >= 1, f"model.dflash2.{key} must be >= 1, got {value}")
        for key in ("output_multiplier", "final_logit_softcapping"):
            value = getattr(self, key)
            require(value is None or (value > 0 and math.isfinite(value)),
                    f"model.dflash2.{key} must be a finite number > 0 (or null), got {value!r}")

    def set_fields(self) -> list[str]:
        return [f"model.dflash2.{f.name}" for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def resolved(self, key: str) -> int:
        """A structure field's value: the one set, else DFLASH2_DEFAULTS'."""
        value = getattr(self, key)
        return DFLASH2_DEFAULTS[key] if value is None else value


SELECTOR_LOSS_FIELDS = ("selector_alpha", "selector_warmup_ratio", "selector_ramp_ratio", "selector_stop_gradient")
# SpecForge's DFlash2 recipe (docs/sections/concepts/DFlash2.md): alpha 1, warm-up and ramp 0.0005 of the run each.
SELECTOR_LOSS_DEFAULTS = {"selector_alpha": 1.0, "selector_warmup_ratio": 0.0005, "selector_ramp_ratio": 0.0005,
                          "selector_stop_gradient": False}
