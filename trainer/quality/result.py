"""The quality pipeline's results as values: each stage's record and the run's (quality.json, DFLASH_QUALITY).

`to_dict` gives the JSON the pipeline writes (quality.json, stages.json), key for key and in the same order; the
decoding benchmark's and the simulated eval's records (quality/evaluate.py, eval.py) stay the dicts those modules
return. Pure."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # their modules import torch; this one stays pure
    from trainer.quality.pretrain import PretrainResult
    from trainer.quality.regenerate import RegenResult

ALSO_KEYS = ("target_dtype", "tau", "speedup", "identical", "target_tok_s", "speculative_tok_s")


@dataclass(frozen=True)
class DrafterResult:
    """The drafter stage: what the trainer's loop did inside its budget."""

    steps: int
    total_steps: int  # the LR schedule's length the stop rule settled on
    mode: str  # the step mode it trained with (eager where a graph mode was refused)
    loss: float | None
    acc: float | None
    tokens_per_s: float | None
    seconds: float
    planned_steps: int
    stopped_by: str
    kind: str  # model.drafter: the drafter's architecture (dflash | dflash2)
    optim: str  # optim.name: the optimizer it trained with (adamw | muon)


@dataclass(frozen=True)
class EvalResult:
    """The eval stage: the simulated tau (eval.evaluate_run's record), the decoding benchmark at eval.target_dtype,
    and at eval.also_dtype where set (quality/evaluate.decode_benchmark's records, with their `target_dtype`)."""

    simulated: Mapping
    decode: Mapping
    decode_also: Mapping | None = None

    def to_dict(self) -> dict:
        also = {} if self.decode_also is None else {"decode_also": dict(self.decode_also)}
        return {"simulated": dict(self.simulated), "decode": dict(self.decode), **also}


@dataclass(frozen=True)
class QualityResult:
    """One pipeline run: its stages' results and its headline figures (those of the decoding benchmark at
    eval.target_dtype, and the simulated tau)."""

    recipe: str
    reused_from: str | None
    device: str
    torch: str
    gpu: str | None
    target: PretrainResult
    regen: RegenResult
    drafter: DrafterResult
    eval: EvalResult
    timings_s: Mapping[str, float]

    @property
    def tau(self) -> float:
        return self.eval.decode["tau"]

    @property
    def speedup(self) -> float:
        return self.eval.decode["speedup"]

    @property
    def simulated_tau(self) -> float | None:
        return self.eval.simulated["tau"]

    @property
    def identical(self) -> str:
        """"k/n": the speculative outputs equal to the target's alone, of n prompts."""
        return f'{self.eval.decode["identical"]}/{self.eval.decode["prompts"]}'

    def to_dict(self) -> dict:
        """quality.json's object."""
        d = self.eval.decode
        also = {} if self.eval.decode_also is None else {"also": {k: self.eval.decode_also[k] for k in ALSO_KEYS}}
        return {"recipe": self.recipe, "reused_from": self.reused_from, "device": self.device, "torch": self.torch,
                "gpu": self.gpu, "target": dataclasses.asdict(self.target), "regen": dataclasses.asdict(self.regen),
                "drafter": dataclasses.asdict(self.drafter), "tau": self.tau, "accept_by_pos": d["accept_by_pos"],
                "speedup": self.speedup, "simulated_tau": self.simulated_tau, "replayed_tau": d.get("replayed_tau"),
                "identical": self.identical, "lossless_by_construction": d["lossless"]["guaranteed"],
                "repeated_4gram_frac": d["repeated_4gram_frac"], "eval": self.eval.to_dict(), **also,
                "timings_s": dict(self.timings_s)}


def stage_record(result) -> dict:
    """A stage's result -> its stages.json record."""
    return result.to_dict() if hasattr(result, "to_dict") else dataclasses.asdict(result)
