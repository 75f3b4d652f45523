"""PURE parser of the trainer's metrics and progress lines (docs/contracts.md section 3).

    DFLASH_METRICS {"step": 20, "loss": 3.41, "acc": 0.22, "tokens_per_s": 51234.5, ...}      training
    DFLASH_PROGRESS {"job": "regenerate", "done": 128, "total": 1000, "unit": "answers", ...}   any other long job
    DFLASH_DONE {"step": 200, ...} | {"job": "regenerate", ...}                                the job finished

Only these three prefixes are read; any other log line is ignored. `step` and `loss` are required in a metrics
line, `job` and `done` in a progress line (a line without them is not one); every other key is optional and
unknown keys are ignored.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

from dflash_ops.wire import DONE_PREFIX, METRICS_PREFIX, PROGRESS_PREFIX

READ_PREFIXES = (METRICS_PREFIX, PROGRESS_PREFIX, DONE_PREFIX)
# A remote `tail -c N | grep -a -e PATTERN` keeps only candidate lines (a BRE); the parser still checks each one.
GREP_PATTERN = "\\(" + "\\|".join(p.rstrip() for p in READ_PREFIXES) + "\\) {"
NON_FINITE = {"nan", "inf", "-inf", "infinity", "-infinity"}


@dataclass(frozen=True)
class Metrics:
    step: int
    loss: float
    acc: float | None = None
    tokens_per_s: float | None = None
    lr: float | None = None
    epoch: int | None = None
    step_time_s: float | None = None
    peak_mem_gib: float | None = None
    elapsed_s: float | None = None
    done: bool = False            # a DFLASH_DONE line followed this metrics line

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Progress:
    job: str                      # what runs, e.g. "regenerate"
    done: int                     # units done, of the whole job (an earlier run's included)
    total: int | None = None
    unit: str = ""
    tokens_per_s: float | None = None
    elapsed_s: float | None = None
    eta_s: float | None = None
    finished: bool = False        # a DFLASH_DONE line followed this progress line

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _number(obj: dict, key: str) -> float | None:
    value = obj.get(key)
    if isinstance(value, str) and value.lower() in NON_FINITE:
        value = float(value)     # strict-JSON writers spell a non-finite loss as "nan" / "inf"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) and key != "loss":
        return None          # a non-finite loss is news (divergence) and is kept; elsewhere it is noise
    return float(value)


def _json_after(line: str, prefix: str) -> dict | None:
    at = line.find(prefix)
    if at < 0:
        return None
    try:
        obj = json.loads(line[at + len(prefix):])
    except json.JSONDecodeError:
        return None     # a line cut by the tail window or still being written
    return obj if isinstance(obj, dict) else None


def parse_metrics_line(line: str) -> Metrics | None:
    """One log line -> Metrics, or None when it is not a well-formed metrics line."""
    obj = _json_after(line.rstrip("\r\n"), METRICS_PREFIX)
    if obj is None or isinstance(obj.get("step"), bool) or not isinstance(obj.get("step"), int):
        return None
    loss = _number(obj, "loss")
    if loss is None:
        return None
    opt = {k: _number(obj, k) for k in ("acc", "tokens_per_s", "lr", "step_time_s", "peak_mem_gib", "elapsed_s")}
    epoch = obj.get("epoch")
    return Metrics(step=obj["step"], loss=loss, epoch=epoch if isinstance(epoch, int) else None, **opt)


def _count(obj: dict, key: str) -> int | None:
    value = obj.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse_progress_line(line: str) -> Progress | None:
    """One log line -> Progress, or None when it is not a well-formed progress line."""
    obj = _json_after(line.rstrip("\r\n"), PROGRESS_PREFIX)
    if obj is None or not isinstance(obj.get("job"), str) or _count(obj, "done") is None:
        return None
    unit = obj.get("unit")
    return Progress(job=obj["job"], done=obj["done"], total=_count(obj, "total"),
                    unit=unit if isinstance(unit, str) else "",
                    **{k: _number(obj, k) for k in ("tokens_per_s", "elapsed_s", "eta_s")})


def latest(lines: Iterable[str]) -> Metrics | Progress | None:
    """The last metrics or progress line of `lines`, marked done when a DFLASH_DONE line comes after it."""
    last: Metrics | Progress | None = None
    done = False
    for line in lines:
        parsed = parse_metrics_line(line) or parse_progress_line(line)
        if parsed is not None:
            last, done = parsed, False
        elif _json_after(line, DONE_PREFIX) is not None:
            done = True
    if last is None:
        return None
    if isinstance(last, Progress):
        return Progress(**{**last.__dict__, "finished": done})
    return Metrics(**{**last.__dict__, "done": done})
