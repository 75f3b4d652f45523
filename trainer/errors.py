"""Domain errors of the trainer: each carries an exit code and a hint; `__main__` renders them in one place."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping

from dflash_ops.wire import EXIT_INTERRUPTED, launch_hint


class TrainerError(Exception):
    """A user-facing failure: bad config, bad data, bad target, a non-finite loss.

    `exit_code` follows the convention 2 = usage/config, 3 = data, 4 = run failed (non-finite loss).
    """

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class ConfigError(TrainerError):
    exit_code = 2


def require(cond: bool, message: str) -> None:
    """The config checks' one form: `cond`, or ConfigError(message)."""
    if not cond:
        raise ConfigError(message)


class DataError(TrainerError):
    exit_code = 3


class NonFiniteLoss(TrainerError):
    exit_code = 4


class ReplicaDrift(TrainerError):
    """Data-parallel replicas ended with different parameters (a bug, not a user error)."""

    exit_code = 4


QUIET_RANK_LINGER_S = 5.0


def secondary_rank(environ: Mapping[str, str] = os.environ) -> bool:
    """A torchrun rank other than 0 (RANK and WORLD_SIZE set and consistent). Malformed values are not: such a
    process is one the user must hear from."""
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return False
    return 0 < rank < world


def run_cli(command: Callable[[], int]) -> int:
    """The one error boundary of the trainer's entry points: a TrainerError becomes `error:` + `hint:` lines on stderr
    and its exit code (under `dflash-ops launch`, a `--set k=v` in them reads `-- --set k=v`: wire.launch_hint);
    Ctrl-C exits 130. Anything else is a bug and keeps its traceback.

    Under torchrun every rank meets the same config or data error (they read the same config and files, and
    placement is checked for every local rank at once): rank 0 alone says it, every rank exits with its code."""
    quiet = secondary_rank()
    try:
        return command()
    except TrainerError as e:
        if not quiet:
            print(f"error: {launch_hint(str(e))}", file=sys.stderr, flush=True)
            if e.hint:
                print(f"hint: {launch_hint(e.hint)}", file=sys.stderr, flush=True)
        else:
            # torchrun stops every rank as soon as one exits non-zero: a quiet rank that got there first would
            # silence rank 0 before it said the error they share. Lingering lets rank 0 speak first.
            import time

            time.sleep(QUIET_RANK_LINGER_S)
        return e.exit_code
    except KeyboardInterrupt:
        if not quiet:
            print("interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
