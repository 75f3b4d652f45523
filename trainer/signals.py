"""Stop on SIGTERM or SIGINT (Ctrl-C) without losing work: the trainer's one place that handles signals.

While `stop_requests()` is active, the first SIGTERM or SIGINT only records itself in the `StopRequest` it yields:
the training loop reads that flag at its next log step, where the host syncs anyway and every data-parallel rank
agrees on it (trainer/loop.py), and the run writes a checkpoint and exits 128 + the signal: 143 or 130
(trainer/train.py).

After the first signal, a further SIGTERM is ignored: stoppers send it more than once (`dflash-ops stop` signals the
job's process group and each of its processes; torchrun forwards its own), and none of them means "drop the
checkpoint" (they escalate to SIGKILL after their grace). A further SIGINT (a second Ctrl-C) ends the process at
once, by SIGINT's default action, even while the main thread waits inside a C call (a checkpoint's write, a
collective) where no Python handler could run. Either way no checkpoint is torn: one cut short is never renamed into
place (trainer/checkpoint.py), and the newest complete one stays. The dispositions are set in the kernel, not in
Python handlers, so they hold whatever the main thread is doing.
"""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The shell's code for a process that a signal ended: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequest:
    """The signal this process was asked to stop by (0: none yet). Set by the handler, read by the loop."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def release(self) -> None:
        """Give SIGTERM and SIGINT back the handlers they had (from then on a signal acts as it did before)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


@contextmanager
def stop_requests(quiet: bool = False) -> Iterator[StopRequest]:
    """Record the first SIGTERM / SIGINT instead of dying (see the module docstring). quiet: a data-parallel rank
    other than 0 (rank 0 speaks for the job). Outside the main thread (where Python cannot set handlers) the request
    is never set."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def first(signum, _frame) -> None:
        request.signum = signum
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if not quiet:  # os.write: a print here could re-enter a print the signal interrupted
            try:
                os.write(2, f"{signal_name(signum)}: stopping at the next log step, after a checkpoint; Ctrl-C again "
                            f"ends the run at once, without it\n".encode())
            except OSError:  # no reader left (a `| tee` the same Ctrl-C ended): the stop goes on regardless
                pass

    # Both installed while both are blocked: a signal between the two would otherwise run `first`, which sets SIGINT
    # back to its default, before SIGINT's own handler is installed over that.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        request._previous = {s: signal.signal(s, first) for s in STOP_SIGNALS}
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        yield request
    finally:
        if not request.signum:  # a run that is stopping ignores further SIGTERMs until it has exited (143/130)
            request.release()
