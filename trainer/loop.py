"""The training loop: drive a built `Session` until a `StopRule` says stop, or a signal asks it to.

Host syncs happen only at log / checkpoint cadence (trainer/metrics.py); between them the loop only enqueues work.
Sequential (one thread) or, with pipeline.enabled, through the loader/producer/consumer threads; the per-step
bookkeeping (`_after_step`) is the same and runs in whichever thread finished the step.

A stop request (trainer/signals.py: SIGTERM, SIGINT) is read at log steps only: there the host syncs anyway, so the
captured step stays free of host syncs, every rank agrees on the step (one all-reduce of the signal), and the
metrics intervals stay whole (a resumed run logs exactly what an uninterrupted one would). At that step the run
checkpoints (rank 0 writes) and the loop ends.

Data parallel: metrics, the non-finite check and the stop request are collective at log cadence (every rank reaches
them at the same steps); only rank 0's sink writes.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from trainer import checkpoint, rundir
from trainer import distributed as ddp
from trainer.build import Session
from trainer.checkpoint import Cursor
from trainer.data.batching import StaticBatch
from trainer.errors import ConfigError, NonFiniteLoss, TrainerError
from trainer.metrics import DeviceMetrics, peak_mem_gib
from trainer.model.selector_loss import selector_weight_at
from trainer.signals import StopRequest
from trainer.step.step import lr_at


@dataclass(frozen=True)
class StopRule:
    """steps: stop once the run has done this many optimizer steps (0 = the session's planned length); the LR
    schedule keeps the planned length, so a run stopped and resumed equals one that ran through.
    budget_s (None: no budget): also stop once this much wall time has passed; as soon as the step time is known
    (after the first log interval, which pays for warm-up and capture), the schedule's horizon is set, at every log
    interval, to the steps that fit (`fitting_horizon`), so a cut run still anneals and ends near its budget."""

    steps: int = 0
    budget_s: float | None = None


_RATE_CHUNKS = 5  # log intervals the step rate of a budgeted run is measured over


def fitting_horizon(step: int, elapsed_s: float, steps_measured: int, seconds_measured: float, budget_s: float,
                    end: int) -> int:
    """The LR schedule's length for a time-budgeted run: the steps done plus those that fit in what is left of the
    budget at the measured rate, at least one more than done and at most `end`. Set again at every log interval, it
    can shrink or grow as the rate settles. Pure."""
    if steps_measured <= 0 or seconds_measured <= 0:
        return end
    fits = step + int(max(0.0, budget_s - elapsed_s) * steps_measured / seconds_measured)
    return max(step + 1, min(end, fits))


@dataclass(frozen=True)
class LoopResult:
    cursor: Cursor
    planned_steps: int
    horizon: int  # the LR schedule's length at the end (< planned when a budget cut the run)
    stopped_by: str  # "steps" | "budget" | "signal"
    last: dict = field(default_factory=dict)  # the last metrics record logged ({} when none was)
    seconds: float = 0.0
    signal: int = 0  # stopped_by == "signal": the signal (the largest any rank received), checkpointed at cursor


class _Stopped(Exception):
    """Raised by `_after_step` once the stop step is checkpointed: it unwinds the sequential loop and, through the
    pipeline's thread guard, the pipeline's threads."""


@dataclass
class _Clock:
    """Wall time of the current log interval (host clock; no device sync of its own)."""

    start: float
    interval_start: float
    steps: int = 0

    @staticmethod
    def now() -> "_Clock":
        t = time.perf_counter()
        return _Clock(start=t, interval_start=t)


def weights_nonfinite(module) -> bool:
    """SYNC: any parameter holds a NaN or inf (the replicas are identical: each rank's answer is every rank's)."""
    import torch

    return not bool(torch.stack([torch.isfinite(p).all() for p in module.parameters()]).all())


class TrainLoop:
    """Owns the mutable side of a run: the data cursor, the device metrics, the LR horizon."""

    def __init__(self, session: Session, stop_request: StopRequest | None = None) -> None:
        self.s = session
        self.cursor = session.start
        self.horizon = session.planned_steps
        self.metrics = DeviceMetrics(session.cfg.model.block_size, session.device)
        self.last: dict = {}
        self.stop_request = stop_request  # None: nothing asks this loop to stop (the same on every rank)
        self.stop_signal = 0  # the agreed signal, once the loop stopped for it
        self.saved_step = -1  # the step of the newest checkpoint this loop wrote (rank 0) or had written (others)

    # ------------------------------------------------------------ driving

    def run(self, stop: StopRule = StopRule()) -> LoopResult:
        """Train from the cursor until the rule stops it; may be called again to go on (the cursor is kept)."""
        t0 = time.perf_counter()
        planned = self.s.planned_steps
        end = min(stop.steps or planned, planned)
        clock = _Clock.now()
        try:
            self._run_budgeted(stop, end, clock, t0)
        except _Stopped:
            pass
        stopped_by = "signal" if self.stop_signal else "steps" if self.cursor.step >= end else "budget"
        return LoopResult(cursor=self.cursor, planned_steps=planned, horizon=self.horizon, stopped_by=stopped_by,
                          last=dict(self.last), seconds=round(time.perf_counter() - t0, 1), signal=self.stop_signal)

    def _run_budgeted(self, stop: StopRule, end: int, clock: _Clock, t0: float) -> None:
        if stop.budget_s is None:
            self._run_to(end, clock)
        else:
            if self.s.env.world > 1:
                raise ConfigError("a time budget is for one process: data-parallel ranks would disagree on it")
            marks: deque[tuple[float, int]] = deque(maxlen=_RATE_CHUNKS + 1)  # (time, step) at each chunk's end
            while self.cursor.step < min(end, self.horizon) and time.perf_counter() - t0 < stop.budget_s:
                self._run_to(min(self.cursor.step + self.s.cfg.log.every, end, self.horizon), clock)
                marks.append((time.perf_counter(), self.cursor.step))
                if len(marks) < 2:  # the first chunk pays for warm-up / capture: measure from its end
                    continue
                # The rate of the last few chunks, not of the whole run: early steps can run slower than later ones,
                # and a horizon fixed from them would end the run well inside its budget.
                (t_from, step_from), (t_to, step_to) = marks[0], marks[-1]
                self.horizon = fitting_horizon(step_to, t_to - t0, step_to - step_from, t_to - t_from,
                                               stop.budget_s, end)

    def _run_to(self, end: int, clock: _Clock) -> None:
        if self.s.pipe is not None:
            self._pipelined(end, clock)
            return
        accum = self.s.cfg.optim.accum_steps
        while self.cursor.step < end:
            micro = self.cursor.micro
            self._fill_schedules(self.cursor.step)
            outs = self.s.runner.step([self._host_batch(m) for m in range(micro, micro + accum)])
            self._after_step(outs, end, clock)

    def _host_batch(self, micro: int) -> StaticBatch:
        """CPU micro-batch; pinned when the step runs on CUDA, so the runner's non_blocking copy never blocks the
        host (a pageable source may make the driver wait for the stream)."""
        batch = self.s.batches.batch(micro)
        return batch.pin_memory() if self.s.device.type == "cuda" else batch

    def _pipelined(self, end: int, clock: _Clock) -> None:
        from trainer.step.slots import encode

        start, accum = self.cursor, self.s.cfg.optim.accum_steps
        steps = end - start.step
        if steps <= 0:
            return

        def feed():  # loader thread: CPU batches only
            for k in range(steps):
                first = start.micro + k * accum
                yield encode([self.s.batches.batch(m) for m in range(first, first + accum)])

        def before() -> None:  # consumer thread, on its stream, before the step's replay
            self._fill_schedules(self.cursor.step)

        try:
            self.s.pipe.run(steps, feed, before, lambda outs: self._after_step(outs, end, clock))
        except RuntimeError as e:
            # NonFiniteLoss or the stop, raised by _after_step in the consumer thread
            if isinstance(e.__cause__, (TrainerError, _Stopped)):
                raise e.__cause__ from None
            raise

    # ------------------------------------------------------------ per step

    def _fill_schedules(self, step: int) -> None:
        """The step's scheduled scalars into their device tensors (a captured step reads them there): the LR and, for
        a DFlash2 drafter, the selector term's weight."""
        state = self.s.state
        state.lr_.fill_(self.lr(step))
        if state.selector_weight_ is not None:
            state.selector_weight_.fill_(self.selector_weight(step))

    def selector_weight(self, step: int) -> float:
        loss = self.s.cfg.loss
        return selector_weight_at(step, total_steps=self.horizon, alpha=loss.selector("selector_alpha"),
                                  warmup_ratio=loss.selector("selector_warmup_ratio"),
                                  ramp_ratio=loss.selector("selector_ramp_ratio"))

    def lr(self, step: int) -> float:
        o = self.s.cfg.optim
        return lr_at(step, base_lr=o.lr, total_steps=self.horizon, warmup_ratio=o.warmup_ratio, schedule=o.schedule,
                     min_lr_ratio=o.min_lr_ratio)

    def _after_step(self, outs, end: int, clock: _Clock) -> None:
        """Bookkeeping after one optimizer step: metrics (device), cursor, and at cadence log / checkpoint (SYNC)."""
        cfg = self.s.cfg
        for out in outs:
            self.metrics.add(out)
        step, micro = self.cursor.step + 1, self.cursor.micro + cfg.optim.accum_steps
        self.cursor = Cursor(step=step, micro=micro, world=self.s.env.world)
        clock.steps += 1
        self.s.sink.progress_bar(step, self.horizon)
        log_step = step % cfg.log.every == 0 or step == end
        if log_step:
            self.check_finite(step)
            now = time.perf_counter()
            self._log(step, micro, now - clock.interval_start, clock.steps, now - clock.start)
            clock.interval_start, clock.steps = now, 0
        if cfg.ckpt.every and step % cfg.ckpt.every == 0:
            self.check_finite(step)
            self.save()
        if log_step and self.stop_request is not None:
            signum = ddp.max_over_ranks(self.stop_request.signum, self.s.device)  # SYNC, collective
            if signum:
                self.stop_signal = signum
                if self.saved_step != step:  # the finite check ran at this log step
                    self.save()
                raise _Stopped

    def check_finite(self, step: int) -> None:
        """SYNC (collective: every rank calls it at the same steps, before every checkpoint and the export). Raise
        NonFiniteLoss (exit 4) naming the last good checkpoint on every rank if any rank saw a non-finite loss, or
        the drafter's weights are no longer finite (an update can break them after a finite loss: an inf gradient
        with clipping off); nothing is saved over it."""
        what = "loss" if self.metrics.nonfinite(ddp.all_reduce_sum_) else \
            "drafter weights" if weights_nonfinite(self.s.state.drafter) else None
        if what is not None:
            found = checkpoint.list_checkpoints(self.s.run_dir)
            last = str(found[-1][1]) if found else "none"
            raise NonFiniteLoss(f"non-finite {what} (NaN/inf) by step {step}; stopping. Last good checkpoint: {last}",
                                hint="lower optim.lr (or keep optim.clip on) or check the data, in a new run: "
                                     "--resume repeats the same steps with the same settings")

    def save(self) -> None:
        """Rank 0 only: the replicas are identical, one copy is the checkpoint."""
        self.saved_step = self.cursor.step
        if self.s.env.is_main:
            checkpoint.save(self.s.run_dir, self.cursor, self.s.state.drafter, self.s.state.optimizer,
                            self.s.cfg.ckpt.keep, config=rundir.recorded_config(self.s.run_dir, self.s.cfg))

    def _log(self, step: int, micro: int, dt: float, steps: int, elapsed: float) -> None:
        """Collective at log cadence: metrics are summed over ranks; tokens/s counts every rank's tokens."""
        s = self.s
        record = {"step": step, "total_steps": self.horizon, "epoch": s.batches.locate(max(0, micro - 1))[0]}
        record.update(self.metrics.flush(ddp.all_reduce_sum_))
        tokens = steps * s.cfg.optim.accum_steps * s.cfg.data.tokens_per_step * s.env.world
        record.update({"tokens_per_s": round(tokens / dt, 1) if dt > 0 else None, "lr": self.lr(step - 1),
                       "peak_mem_gib": peak_mem_gib(s.device), "step_time_s": round(dt / max(1, steps), 4),
                       "elapsed_s": round(elapsed, 2), "world": s.env.world})
        s.sink.emit(record)
        self.last = record
