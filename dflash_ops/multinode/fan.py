"""Every node of a multi-node run at once, for launch.py and watch.py: fanout.fan_out with a bug (an error that is
not an OpsError) raised, and the time a node is given beyond its own timeouts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dflash_ops.errors import OpsError
from dflash_ops.fanout import Outcome, fan_out
from dflash_ops.spec import Target

SLACK_S = 90.0       # beyond each node's own timeouts: a node still busy past this is reported, not waited for


def raise_bugs(outcomes: Sequence[Outcome]) -> None:
    """An error that is not an OpsError (a bug) is raised with its traceback."""
    for o in outcomes:
        if o.error is not None and not isinstance(o.error, OpsError):
            raise o.error


def together(keys: Sequence, fn: Callable, *, deadline_s: float, describe: Callable[[object], str]) -> list[Outcome]:
    outcomes = fan_out(list(keys), fn, deadline_s=deadline_s, describe=describe)
    raise_bugs(outcomes)
    return outcomes


def connect_s(targets: Sequence[Target]) -> float:
    """How long connecting to every one of `targets` at once may take."""
    return max(t.host.connect_timeout_s for t in targets) * 3 + SLACK_S
