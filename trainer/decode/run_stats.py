"""What one `BatchGenerator` call did (`generate.py`), counted on the host as it issues the work, so that counting
adds no device sync to the token loop: `RunStats`, and `Spans`, the time of the prefills and of the token steps.

Spans: on CUDA, a pair of events around each stretch of work of one kind (a refill's prefill forwards; the replays
between two host checks), recorded on the current stream and read once at the end of the call, after the loop's
last sync; elsewhere the host's time around the same stretches (eager CPU ops finish before they return). What
neither kind covers is the host's: its checks (each one sync, the device idle while the host reads), building a
refill's inputs, launching.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

PREFILL, STEP = "prefill", "step"
# the counts the generator adds up as it goes (RunStats' other fields it knows at the end)
COUNTED = ("steps", "refilled", "prompts", "generated", "checks", "fills", "prefills", "prefill_tokens",
           "prefill_positions", "occupied", "tail_steps", "compact_steps", "slot_steps")


@dataclass(frozen=True)
class RunStats:
    """One call's counts. Of the steps x rows slot-steps: live ones, generated - prompts (an answer of n tokens took
    n - 1 steps: its first token is its prefill's choice), their share `busy`; `occupied` ones, whose row held a
    prompt (live, or ended and waiting for the host's next check), their share `held`. So held - busy is the share
    idle between a row's end and its check (and refill), 1 - held the share idle for want of a prompt (the tail,
    once the queue is empty: `tail_steps`). Those shares stay over the full steps x rows grid; a compacted step
    (`compact_steps`: in the tail, the live rows and a few ended ones only, generate.py) computes fewer rows, so
    `slot_steps` counts the row-steps computed and `busy_computed` the live share of those. prefill_s, step_s:
    seconds (CUDA: device time between events; CPU: host time), None if not timed."""
    rows: int
    prompts: int  # answers handed out
    generated: int  # their tokens
    steps: int  # token-step replays (every row steps in each, live or not)
    checks: int  # host reads of which rows ended (one sync each, one more where some had)
    fills: int  # prefill rounds: the first fill and each refill
    refilled: int  # prompts prefilled into a slot another prompt had held
    prefills: int  # prefill forwards (a fill takes one per chunk, all its rows together)
    prefill_tokens: int  # prompt tokens those forwards covered
    prefill_positions: int  # positions they computed: rows x chunk width, padding included
    occupied: int  # slot-steps whose row held a prompt
    tail_steps: int  # steps after the last prompt was filled
    compact_steps: int  # steps over some rows only (the tail's compacted steps)
    slot_steps: int  # row-steps computed: each step's width summed (steps x rows without compacted steps)
    prefill_s: float | None = None
    step_s: float | None = None

    @property
    def busy(self) -> float:
        return (self.generated - self.prompts) / (self.steps * self.rows) if self.steps else 0.0

    @property
    def busy_computed(self) -> float:
        return (self.generated - self.prompts) / self.slot_steps if self.slot_steps else 0.0

    @property
    def held(self) -> float:
        return self.occupied / (self.steps * self.rows) if self.steps else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "busy": round(self.busy, 4), "held": round(self.held, 4),
                "busy_computed": round(self.busy_computed, 4)}


class Spans:
    """Time of marked stretches of work by kind (module docstring); `start`/`stop` never sync, `seconds` reads them
    all once (syncing on the last event, which the generator's last check has already passed)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict[str, list] = {PREFILL: [], STEP: []}
        self.open: dict[str, object] = {}
        self.last = None  # the latest event: the others complete before it (one stream)

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        self.last = torch.cuda.Event(enable_timing=True)
        self.last.record()
        return self.last

    def start(self, kind: str) -> None:
        if kind not in self.open:
            self.open[kind] = self._mark()

    def stop(self, kind: str) -> None:
        if kind in self.open:
            self.marks[kind].append((self.open.pop(kind), self._mark()))

    def seconds(self) -> dict[str, float]:
        for kind in list(self.open):
            self.stop(kind)
        if self.cuda:
            if self.last is not None:
                self.last.synchronize()
            return {kind: sum(a.elapsed_time(b) for a, b in marks) / 1e3 for kind, marks in self.marks.items()}
        return {kind: sum(b - a for a, b in marks) for kind, marks in self.marks.items()}
