"""What a run reports: device-side metric accumulation and the log-cadence sync (the ONLY trainer module that calls
.item()/.tolist()), the metrics sink (metrics.jsonl + the contract lines), and the human console lines.

Between log intervals everything stays on the device: the step never waits for the host. torch is imported where it
is used: the console speaks before torch is loaded.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from dflash_ops.wire import DONE_PREFIX, METRICS_PREFIX, PROGRESS_PREFIX, STOPPED_PREFIX

if TYPE_CHECKING:
    import torch

    from trainer.step.step import StepOut

PROGRESS_EVERY_S = 10.0  # between DFLASH_PROGRESS lines of a long job (the first and the last always print)


def _bar(done: float, total: float, label: str, width: int = 30) -> str:
    filled = int(width * min(1.0, done / total)) if total > 0 else width
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {label}"


def write_out(stream: TextIO, text: str) -> None:
    """Write and flush text to the console. A reader that went away (a `| tee` that the same Ctrl-C ended) costs the
    console, not the run: the stream's descriptor then points at /dev/null, and the run goes on to its stop's
    checkpoint (metrics.jsonl keeps every record), where a BrokenPipeError would have ended it with none."""
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        silence(stream)


def silence(stream: TextIO) -> None:
    """Point `stream`'s descriptor at /dev/null (what it still buffers is dropped there, at its next flush)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # an in-memory stream (tests): nothing to repoint
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


class Console:
    """The run's human lines on stdout, from the first second: each phase when it begins and, with its time, when
    it ends (`[  12.3s] loading the target ...`, `[  15.0s] loading the target: 2.7s (...)`); the seconds count
    from the program's start. On a TTY (stderr) a progress bar follows long phases. No line matches a runbook's
    liveness pattern (`DFLASH_METRICS|step `, tests/trainer/test_cli.py): only training proves a run alive.
    quiet: a data-parallel rank other than 0 (rank 0 speaks for the job)."""

    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False, t0: float | None = None) -> None:
        self.stream = stream
        self.quiet = quiet
        self.t0 = time.perf_counter() if t0 is None else t0
        self.tty = not quiet and sys.stderr.isatty()
        self._bar_shown = False

    def say(self, text: str) -> None:
        if not self.quiet:
            self.write(f"[{time.perf_counter() - self.t0:7.1f}s] {text}\n")

    def write(self, text: str) -> None:
        """Text as it is (whole lines, e.g. a contract line and its human twin), after clearing any bar; `quiet`
        silences `say`, not this."""
        self._clear_bar()
        write_out(self.stream or sys.stdout, text)

    @contextmanager
    def phase(self, what: str) -> Iterator[list[str]]:
        """`with console.phase("loading the target X") as notes: ...; notes.append("36 layers")`."""
        notes: list[str] = []
        self.say(f"{what} ...")
        t = time.perf_counter()
        yield notes
        self._clear_bar()
        self.say(f"{what}: {time.perf_counter() - t:.1f}s" + (f" ({'; '.join(notes)})" if notes else ""))

    def bar(self, done: float, total: float, label: str) -> None:
        """A one-line bar on stderr, only on a TTY (logs stay clean)."""
        if not self.tty:
            return
        write_out(sys.stderr, _bar(done, total, label))
        self._bar_shown = True

    def bytes_bar(self, label: str) -> Callable[[int, int], None]:
        return lambda done, total: self.bar(done, total, f"{label} {done / 2**20:.1f}/{total / 2**20:.1f} MiB")

    def _clear_bar(self) -> None:
        if self._bar_shown:
            write_out(sys.stderr, "\r\033[K")
            self._bar_shown = False


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def progress_human(record: dict) -> str:
    """Pure: the human twin of a DFLASH_PROGRESS record."""
    text = f"{record['job']} {record['done']}/{record['total']} {record['unit']}"
    if record.get("resumed"):
        text += f" ({record['resumed']} from an earlier run)"
    if record.get("tokens") is not None:
        text += f", {record['tokens']:,} new tokens"
    if record.get("tokens_per_s") is not None:
        text += f", {record['tokens_per_s']:,.0f} tokens/s"
    if record.get("eta_s") is not None:
        text += f", eta {_duration(record['eta_s'])}"
    return text


class JobProgress:
    """A long job that is not training (regenerate): `DFLASH_PROGRESS {json}` and its human line on stdout, at most
    every `every_s` seconds (the first and the last update always), and a bar on a TTY for every update.

    done counts units of the whole job, `resumed` of them done by an earlier run; rates and the ETA are this run's."""

    def __init__(self, job: str, total: int, unit: str, console: Console, *, resumed: int = 0,
                 every_s: float = PROGRESS_EVERY_S) -> None:
        self.job, self.total, self.unit, self.console = job, total, unit, console
        self.resumed, self.every_s = resumed, every_s
        self.t0 = time.perf_counter()
        self.last_print: float | None = None
        self.record: dict = {}

    def update(self, done: int, tokens: int) -> dict:
        now = time.perf_counter()
        elapsed = now - self.t0
        fresh = done - self.resumed
        rate = fresh / elapsed if elapsed > 0 else 0.0
        self.record = {"job": self.job, "done": done, "total": self.total, "unit": self.unit,
                       "resumed": self.resumed, "tokens": tokens,
                       "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
                       "elapsed_s": round(elapsed, 1),
                       "eta_s": round((self.total - done) / rate, 1) if rate > 0 else None}
        if self.last_print is None or done >= self.total or now - self.last_print >= self.every_s:
            self.last_print = now
            self.console.write(f"{PROGRESS_PREFIX}{json.dumps(self.record)}\n{progress_human(self.record)}\n")
        self.console.bar(done, self.total, progress_human(self.record))
        return self.record

    def done(self, record: dict, human: str) -> None:
        """DFLASH_DONE {"job": ..., ...} and a human line: the job finished."""
        self.console.write(f"{DONE_PREFIX}{json.dumps({'job': self.job, **record})}\n{human}\n")


def drop_records_after(path: Path, step: int) -> int:
    """Resume: keep metrics.jsonl's records up to the checkpoint's `step`, drop those after it (the resumed run logs
    those steps again). The kept lines are written to a temp file that then replaces the log (a crash leaves one
    or the other, never a cut log). A torn last line (killed mid-write) goes too; any other line that is not a
    record is kept as it is. -> lines dropped."""
    if not path.is_file():
        return 0
    data = path.read_bytes()
    lines = data.split(b"\n")
    torn = lines.pop() if lines else b""  # the bytes after the last newline ("" for a complete log)
    kept, dropped = [], 1 if torn.strip() else 0
    for line in lines:
        try:
            record = json.loads(line)
            late = isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step
        except ValueError:
            late = False
        if late:
            dropped += 1
        else:
            kept.append(line + b"\n")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class DeviceMetrics:
    """Running sums over micro-steps since the last flush, plus a sticky non-finite flag (never reset)."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        import torch

        self.loss_sum_ = torch.zeros((), dtype=torch.float32, device=device)
        self.correct_ = torch.zeros(block_size, dtype=torch.float32, device=device)
        self.valid_ = torch.zeros(block_size, dtype=torch.float32, device=device)
        self.nonfinite_ = torch.zeros((), dtype=torch.bool, device=device)
        self.micro_steps = 0  # host counter, no sync

    def add(self, out: StepOut) -> None:
        import torch

        self.loss_sum_ += out.loss_
        self.correct_ += out.correct_by_pos_
        self.valid_ += out.valid_by_pos_
        self.nonfinite_ |= ~torch.isfinite(out.loss_)
        self.micro_steps += 1

    def nonfinite(self, reduce_sum_: Callable[[list[torch.Tensor]], None] | None = None) -> bool:
        """SYNC: one bool from the device. reduce_sum_ (data parallel): True if any rank saw a non-finite loss."""
        import torch

        flag = self.nonfinite_.to(torch.int32)
        if reduce_sum_ is not None:
            reduce_sum_([flag])
        return bool(flag.item())

    def flush(self, reduce_sum_: Callable[[list[torch.Tensor]], None] | None = None) -> dict:
        """SYNC: mean loss, accuracy overall and per block position (k >= 1), then reset the sums.

        reduce_sum_ (data parallel): sums the device sums and the micro-step count over ranks first, so every rank
        returns the global figures."""
        import torch

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
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


class MetricsSink:
    """Writes one JSON object per interval to metrics.jsonl and prints the contract line + a human line, flushed.

    resume_step (a resumed run): before the first new record, the records after that step (the checkpoint's) are
    dropped from metrics.jsonl, so that each step is logged once."""

    def __init__(self, path: Path, stream: TextIO | None = None, resume_step: int | None = None) -> None:
        self.path = path
        self._stream = stream  # None: the sys.stdout of each write (in-process callers may swap it, as tests do)
        self.progress = sys.stderr.isatty()
        self.resume_step = resume_step

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stdout

    def _clear_bar(self) -> None:
        if self.progress:
            write_out(sys.stderr, "\r\033[K")

    def emit(self, record: dict) -> None:
        record = {k: v for k, v in record.items() if v is not None}
        line = json.dumps(record, separators=(", ", ": "))
        if self.resume_step is not None:
            drop_records_after(self.path, self.resume_step)
            self.resume_step = None
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        human = (f"step {record['step']}/{record.get('total_steps', '?')} epoch {record.get('epoch', '?')} "
                 f"loss {_fmt(record.get('loss'))} acc {_fmt(record.get('acc'))} lr {_fmt(record.get('lr'), '.2e')} "
                 f"tok/s {_fmt(record.get('tokens_per_s'), '.0f')}")
        self._clear_bar()
        write_out(self.stream, f"{METRICS_PREFIX}{line}\n{human}\n")

    def progress_bar(self, step: int, total: int) -> None:
        """A one-line bar on stderr, only when stderr is a TTY (logs stay clean)."""
        if not self.progress:
            return
        write_out(sys.stderr, _bar(step, total, f"{step}/{total}"))

    def done(self, record: dict) -> None:
        """The contract line, then the same facts for a person: where the export is, and tau."""
        self._clear_bar()
        write_out(self.stream, f"{DONE_PREFIX}{json.dumps(record)}\n{done_line(record)}\n")

    def stopped(self, record: dict) -> None:
        """A run a signal stopped (trainer/train.py `stopped`): the contract line, then where its checkpoint is and
        the command that resumes it."""
        self._clear_bar()
        write_out(self.stream, f"{STOPPED_PREFIX}{json.dumps(record)}\n{stopped_lines(record)}\n")


def done_line(record: dict) -> str:
    """Pure: the human end-of-run line of a DFLASH_DONE record."""
    ev = record.get("eval")
    if isinstance(ev, dict) and isinstance(ev.get("tau"), (int, float)):
        tau = f"simulated tau {ev['tau']:.2f} (on {ev.get('blocks', '?')} held-out blocks)"
    elif isinstance(ev, dict):  # the eval ran; its rows held no block to draft (no two supervised tokens in a row)
        tau = ("no simulated tau: the held-out rows hold no block to evaluate (0 blocks: no two consecutive "
               "supervised tokens; check data.eval_paths / data.eval_fraction)")
    else:
        tau = ("tau not evaluated (eval_at_end=false or no held-out data; "
               f"python -m trainer eval run --run-dir {record.get('run_dir', 'D')})")
    return f"run finished after {record.get('step', '?')} optimizer steps: export {record.get('export', '?')}, {tau}"


def serving_lines(export: str | Path, target: str | Path, block_size: int) -> str:
    """Pure: the commands that serve `export` beside `target`, SGLang's and vLLM's (docs/training.md, "Serving the
    export"). vLLM drafts `num_speculative_tokens` positions and never reads the export's block size: the block
    less one."""
    import shlex

    spec = json.dumps({"method": "dflash", "model": str(export), "num_speculative_tokens": block_size - 1})
    sglang = ["python", "-m", "sglang.launch_server", "--model-path", str(target), "--speculative-algorithm",
              "DFLASH", "--speculative-draft-model-path", str(export)]
    vllm = ["vllm", "serve", str(target), "--speculative-config", spec]
    return f"serve it with SGLang: {shlex.join(sglang)}\n  or with vLLM: {shlex.join(vllm)}"


def stopped_lines(record: dict) -> str:
    """Pure: the human lines of a DFLASH_STOPPED record (no "step " in them: a runbook's liveness pattern must not
    take a stopped run for a training one)."""
    return (f"stopped by {record.get('signal', '?')} after {record.get('step', '?')} of "
            f"{record.get('total_steps', '?')} optimizer steps: checkpoint {record.get('checkpoint', '?')}\n"
            f"resume with: {record.get('resume', '?')}"
            + (" (where it was launched from, with its --host/--ct)" if "resume_in_place" in record else ""))


class QuietSink(MetricsSink):
    """The sink of a data-parallel rank other than 0: writes and prints nothing (rank 0 reports global figures)."""

    def emit(self, record: dict) -> None:
        pass

    def progress_bar(self, step: int, total: int) -> None:
        pass

    def done(self, record: dict) -> None:
        pass

    def stopped(self, record: dict) -> None:
        pass


def _fmt(value, spec: str = ".4f") -> str:
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)
