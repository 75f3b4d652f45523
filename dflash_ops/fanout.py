"""Run one function per item in parallel; collect every outcome; never fail fast; bounded in time.

Like Fabric's GroupResult: each item gets an `Outcome` holding its value or its exception. Workers are daemon
threads, so an item stuck past the deadline (a black-holed SSH connect) is abandoned, reported as timed out, and
never keeps the process alive at exit (a ThreadPoolExecutor would join it).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from dflash_ops.errors import HostUnreachable

K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True)
class Outcome(Generic[K, V]):
    key: K
    value: V | None
    error: BaseException | None     # an OpsError for expected failures; anything else is a bug to re-raise
    elapsed_s: float
    timed_out: bool = False         # still running at the deadline (its thread goes on, abandoned)

    @property
    def ok(self) -> bool:
        return self.error is None


def fan_out(keys: Sequence[K], fn: Callable[[K], V], *, deadline_s: float,
            describe: Callable[[K], str] = str) -> list[Outcome[K, V]]:
    """`fn(key)` for every key at once; returns outcomes in the order of `keys` after all finished or
    `deadline_s` passed. A key still running at the deadline gets HostUnreachable("no answer within ...")."""
    t0 = time.monotonic()
    slots: dict[int, Outcome[K, V]] = {}

    def work(i: int, key: K) -> None:
        start = time.monotonic()
        try:
            value, error = fn(key), None
        except BaseException as exc:  # noqa: BLE001 - collected, never lost: the caller decides what is fatal
            value, error = None, exc
        slots[i] = Outcome(key, value, error, time.monotonic() - start)

    threads = [threading.Thread(target=work, args=(i, k), daemon=True, name=f"fanout-{i}")
               for i, k in enumerate(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, t0 + deadline_s - time.monotonic()))
    late = HostUnreachable
    return [slots.get(i) or Outcome(k, None, late(f"{describe(k)}: no answer within {deadline_s:g} s"),
                                    time.monotonic() - t0, timed_out=True)
            for i, k in enumerate(keys)]
