"""PURE: a multi-node run's state, from its nodes' states (`runs RUN`, `status RUN`, `stop`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dflash_ops.errors import RunFailed
from dflash_ops.multinode.record import Node
from dflash_ops.spec import EXITED, RUNNING, STOPPED, RunStatus


@dataclass(frozen=True)
class NodeState:
    node: Node
    label: str
    status: RunStatus | None = None      # None: its run could not be read (error says why)
    error: str | None = None
    exit_code: int = 0                   # the exit code of that error


@dataclass(frozen=True)
class Overall:
    state: str                           # running | exited 0 | stopped | failed | unknown
    text: str
    first: NodeState | None = None       # failed: the node that failed first


def overall(states: Sequence[NodeState]) -> Overall:
    """The run's state from its nodes': `failed` as soon as a node ended other than by exiting 0 or by `stop`
    (or was stopped while others run), naming the node that ended first: by the nodes' clocks, and a node that
    ended without recording its exit (lost: killed outright, its container stopped) before any that did, as the
    others' failures follow it. Else `unknown` while a node cannot be read, `running` while any node runs,
    `stopped` when every node ended and those that did not exit 0 were stopped (by `stop`, or after their
    checkpoint), else `exited 0`."""
    read = [s for s in states if s.status is not None]
    running = [s for s in read if s.status.state == RUNNING]
    bad = [s for s in read if s.status.state != RUNNING and not (s.status.state == EXITED and s.status.exit_code == 0)]
    if bad and (running or not all(s.status.stopped or s.status.state == STOPPED for s in bad)):
        first = min(bad, key=lambda s: (s.status.ended_at is not None, s.status.ended_at or 0.0, s.node.rank))
        return Overall("failed", f"failed: node {first.node.rank} ({first.label}) first: {first.status.state_text}",
                       first)
    if len(read) < len(states):
        lost = next(s for s in states if s.status is None)
        return Overall("unknown", f"unknown: node {lost.node.rank} ({lost.label}): {lost.error}")
    if running:
        return Overall(RUNNING, RUNNING)
    return Overall("stopped", "stopped") if bad else Overall(f"{EXITED} 0", f"{EXITED} 0")


def exit_code(items) -> int:
    """`runs`, `status` and `stop` of a multi-node run: 0 when every node answered, else the first failed node's
    exit code (`items`: NodeState or watch.NodeStopped, in rank order; each has an `exit_code`)."""
    return next((x.exit_code for x in items if x.exit_code), 0)


def verdict_code(run: Overall, items) -> int:
    """`status RUN`: `exit_code(items)` where a node could not be read, else 4 (RunFailed) when the run failed,
    else 0 (running, exited 0, stopped)."""
    return exit_code(items) or (RunFailed.exit_code if run.state == "failed" else 0)
