"""Device-side metric accumulation and the log-cadence sync. The ONLY trainer module that calls .item()/.tolist().

Between log intervals everything stays on the device: the step never waits for the host.
"""
from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch

from trainer.step.step import StepOut

METRICS_PREFIX = "DFLASH_METRICS "
DONE_PREFIX = "DFLASH_DONE "
EVAL_PREFIX = "DFLASH_EVAL "


class DeviceMetrics:
    """Running sums over micro-steps since the last flush, plus a sticky non-finite flag (never reset)."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.loss_sum_ = torch.zeros((), dtype=torch.float32, device=device)
        self.correct_ = torch.zeros(block_size, dtype=torch.float32, device=device)
        self.valid_ = torch.zeros(block_size, dtype=torch.float32, device=device)
        self.nonfinite_ = torch.zeros((), dtype=torch.bool, device=device)
        self.micro_steps = 0  # host counter, no sync

    def add(self, out: StepOut) -> None:
        self.loss_sum_ += out.loss_
        self.correct_ += out.correct_by_pos_
        self.valid_ += out.valid_by_pos_
        self.nonfinite_ |= ~torch.isfinite(out.loss_)
        self.micro_steps += 1

    def nonfinite(self, reduce_sum_: Callable[[list[torch.Tensor]], None] | None = None) -> bool:
        """SYNC: one bool from the device. reduce_sum_ (data parallel): True if any rank saw a non-finite loss."""
        flag = self.nonfinite_.to(torch.int32)
        if reduce_sum_ is not None:
            reduce_sum_([flag])
        return bool(flag.item())

    def flush(self, reduce_sum_: Callable[[list[torch.Tensor]], None] | None = None) -> dict:
        """SYNC: mean loss, accuracy overall and per block position (k >= 1), then reset the sums.

        reduce_sum_ (data parallel): sums the device sums and the micro-step count over ranks first, so every rank
        returns the global figures."""
        count = torch.tensor([float(self.micro_steps)], device=self.loss_sum_.device)
        if reduce_sum_ is not None:
            reduce_sum_([self.loss_sum_, self.correct_, self.valid_, count])
        loss = self.loss_sum_.item() / max(1.0, count.item())
        correct, valid = self.correct_.tolist(), self.valid_.tolist()
        self.loss_sum_.zero_()
        self.correct_.zero_()
        self.valid_.zero_()
        self.micro_steps = 0
        acc_by_pos = [round(c / v, 4) if v else None for c, v in zip(correct[1:], valid[1:])]
        total_valid = sum(valid[1:])
        return {"loss": loss if math.isfinite(loss) else str(loss),
                "acc": round(sum(correct[1:]) / total_valid, 4) if total_valid else None,
                "acc_by_pos": acc_by_pos}


def peak_mem_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


class MetricsSink:
    """Writes one JSON object per interval to metrics.jsonl and prints the contract line + a human line, flushed."""

    def __init__(self, path: Path, stream: TextIO = sys.stdout) -> None:
        self.path = path
        self.stream = stream
        self.progress = sys.stderr.isatty()

    def emit(self, record: dict) -> None:
        record = {k: v for k, v in record.items() if v is not None}
        line = json.dumps(record, separators=(", ", ": "))
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        human = (f"step {record['step']}/{record.get('total_steps', '?')} epoch {record.get('epoch', '?')} "
                 f"loss {_fmt(record.get('loss'))} acc {_fmt(record.get('acc'))} lr {_fmt(record.get('lr'), '.2e')} "
                 f"tok/s {_fmt(record.get('tokens_per_s'), '.0f')}")
        if self.progress:
            sys.stderr.write("\r\033[K")
        self.stream.write(f"{METRICS_PREFIX}{line}\n{human}\n")
        self.stream.flush()

    def progress_bar(self, step: int, total: int) -> None:
        """A one-line bar on stderr, only when stderr is a TTY (logs stay clean)."""
        if not self.progress:
            return
        width = 30
        filled = int(width * step / max(1, total))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {step}/{total}")
        sys.stderr.flush()

    def done(self, record: dict) -> None:
        self.stream.write(f"{DONE_PREFIX}{json.dumps(record)}\n")
        self.stream.flush()


class QuietSink(MetricsSink):
    """The sink of a data-parallel rank other than 0: writes and prints nothing (rank 0 reports global figures)."""

    def emit(self, record: dict) -> None:
        pass

    def progress_bar(self, step: int, total: int) -> None:
        pass

    def done(self, record: dict) -> None:
        pass


def _fmt(value, spec: str = ".4f") -> str:
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)
