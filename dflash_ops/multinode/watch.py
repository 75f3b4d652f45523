"""A launched multi-node run, or a run on one target: where it lives (from its record on this machine, or from the
run.json of one of its nodes), its nodes' states and `status` rows, read at once, and `stop` of every node at once.
runs/lifecycle.py does each node's part.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from dflash_ops import hoststatus, inventory, names, wire
from dflash_ops.errors import OpsError, RemoteFailed, RunNotFound, UsageError
from dflash_ops.fanout import Outcome
from dflash_ops.gpus.facts import GpuSettings
from dflash_ops.multinode.fan import SLACK_S, connect_s, together
from dflash_ops.multinode.plan import same_place, targets_of
from dflash_ops.noderecord import Node, NodeRun, parse_node
from dflash_ops.multinode.state import NodeState
from dflash_ops.runs import lifecycle
from dflash_ops.runs.lifecycle import Session
from dflash_ops.spec import RunStatus, Target
from dflash_ops.ssh import transport


# -- where a run lives ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Located:
    """A run and where it lives: every node of a multi-node run (`multinode` set), or the one target of a run."""

    run_id: str
    nodes: tuple[Node, ...]
    targets: tuple[Target, ...]            # by rank
    multinode: NodeRun | None = None

    @staticmethod
    def of(inv: inventory.Inventory, run: NodeRun) -> "Located":
        return Located(run.run_id, run.nodes, targets_of(inv, run), run)

    @staticmethod
    def single(run_id: str, target: Target) -> "Located":
        return Located(run_id, (Node(0, target.host.name, target.container.ctid if target.container else None),),
                       (target,))

    def pick(self, text: str | None) -> int:
        """The rank `--node` names (a rank number or HOST[:CT] as launched); rank 0 without one."""
        if text is None:
            return 0
        if self.multinode is None:
            raise UsageError(f"--node: {self.run_id} is not a multi-node run")
        if names.is_digits(text) and int(text) < len(self.nodes):
            return int(text)
        ref = parse_node(text)
        for n in self.nodes:
            if (n.host, n.ct) == (ref.host, ref.ct):
                return n.rank
        known = ", ".join(f"{n.rank} ({n.spec})" for n in self.nodes)
        raise UsageError(f"--node {text}: not a node of {self.run_id} (its nodes: {known})")


def located_from(inv: inventory.Inventory, status: RunStatus, target: Target) -> tuple[Located, str | None]:
    """The run `status`, read on `target`: the whole multi-node run its run.json records when that record can be
    followed, else `target` alone and why not (a warning line). A record read from a node is followed only when
    it names that node at its rank, and inventory hosts only (it could otherwise send `stop` anywhere)."""
    record, rank = status.multinode, status.node_rank
    if record is None or rank is None:
        return Located.single(status.run_id, target), None
    strangers = [n.spec for n in record.nodes if inv.host(n.host) is None]
    why = f"it names {strangers[0]}, not an inventory host" if strangers else None
    if why is None:
        try:
            targets = targets_of(inv, record)
        except UsageError as exc:
            why = exc.message
        else:
            if same_place(targets[rank]) != same_place(target):
                why = f"its node {rank} is {record.nodes[rank].spec}, not {target.label}"
    if why is not None:
        return Located.single(status.run_id, target), (
            f"warning: the record of {status.run_id}'s nodes in its run.json on {target.label} is not followed "
            f"({why}); showing {target.label} alone")
    return Located(record.run_id, record.nodes, targets, record), None


# -- read -----------------------------------------------------------------------------------------------------
class _Sessions:
    """A Session per rank of `loc` (of `ranks`), each closed on exit."""

    def __init__(self, loc: Located, ranks: Sequence[int]) -> None:
        self.by_rank = {i: Session.of(loc.targets[i]) for i in ranks}

    def __enter__(self) -> dict[int, Session]:
        return self.by_rank

    def __exit__(self, *exc: object) -> None:
        for s in self.by_rank.values():
            s.transport.close()


def _at_once(loc: Located, sessions: dict[int, Session], keys: Sequence[int], fn: Callable[[int, Session], object],
             deadline_s: float) -> list[Outcome]:
    return together(keys, lambda i: fn(i, sessions[i]), deadline_s=deadline_s,
                    describe=lambda i: f"node {i} ({loc.targets[i].label})")


def _state(loc: Located, rank: int, status=None, error: OpsError | None = None) -> NodeState:
    why = None if error is None else "no run there" if isinstance(error, RunNotFound) else error.message
    return NodeState(node=loc.nodes[rank], label=loc.targets[rank].label, status=status, error=why,
                     exit_code=0 if error is None else error.exit_code)


def read_states(loc: Located, *, deadline_s: float = 60.0) -> list[NodeState]:
    """Each node's state of the run, read at once; a node that cannot be read says why."""
    ranks = range(len(loc.targets))
    with _Sessions(loc, ranks) as sessions:
        outcomes = _at_once(loc, sessions, ranks, lambda i, s: lifecycle.find_run(s, loc.run_id), deadline_s)
    return [_state(loc, o.key, o.value, o.error) for o in outcomes]


@dataclass(frozen=True)
class NodeRow:
    state: NodeState
    row: hoststatus.RunRow | None = None   # its latest metrics and the GPUs it holds


def part_timeout_s(timeout_s: float) -> int:
    """The time each part of a host's status script is given, within `status --timeout`."""
    return max(1, int(timeout_s) - 3)


def status_rows(loc: Located, gpu: GpuSettings, *, timeout_s: float,
                reuse: transport.Transport | None = None,
                known: dict[str, hoststatus.HostStatus] | None = None) -> list[NodeRow]:
    """`status` of the run's nodes: one query per host (its nodes' containers together), all hosts at once.
    `reuse`: an open transport to the host of a one-node run (so `status RUN` connects once). `known`: a host's
    status already read (by the query that found the run), used instead of asking that host again where it
    covers exactly that host's nodes."""
    by_host: dict[str, list[int]] = {}
    for i, t in enumerate(loc.targets):
        by_host.setdefault(t.host.name, []).append(i)
    hosts = {t.host.name: t.host for t in loc.targets}
    part = part_timeout_s(timeout_s)

    def query(h: str) -> hoststatus.HostStatus:
        have = (known or {}).get(h)
        if have is not None and [t.label for t in have.targets] == [loc.targets[i].label for i in by_host[h]]:
            return have
        return hoststatus.query_host(hosts[h], [loc.targets[i] for i in by_host[h]], gpu, part_timeout_s=part,
                                     transport=reuse if len(by_host) == 1 else None, also=loc.run_id)

    outcomes = together(by_host, query, deadline_s=timeout_s, describe=lambda h: f"host {h}")
    rows: dict[int, NodeRow] = {}
    for o in outcomes:
        for j, i in enumerate(by_host[o.key]):
            if not o.ok:
                rows[i] = NodeRow(_state(loc, i, error=o.error))
                continue
            t = o.value.targets[j]
            row = next((r for r in t.runs if r.status.run_id == loc.run_id), None)
            if t.error is not None:
                rows[i] = NodeRow(_state(loc, i, error=RemoteFailed(t.error)))
            elif row is None:
                rows[i] = NodeRow(_state(loc, i, error=RunNotFound(f"no run {loc.run_id}")))
            else:
                rows[i] = NodeRow(_state(loc, i, row.status), row)
    return [rows[i] for i in range(len(loc.targets))]


# -- stop -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeStopped:
    node: Node
    label: str
    how: str                 # terminated | killed | killed_now | not_running | not_there | fenced | failed
    stopped: lifecycle.Stopped | None = None
    error: OpsError | None = None

    @property
    def exit_code(self) -> int:
        return self.error.exit_code if self.error is not None else 0

    @property
    def text(self) -> str:
        if self.how == "failed":
            return f"could not be stopped: {self.error.message}"
        if self.how == "not_there":
            return "had no run"
        if self.how == "fenced":
            return "had not started it (fenced off: a launch arriving late cannot start it)"
        state = self.stopped.status.state_text
        if self.how == "not_running":
            return f"was not running ({state})"
        return f"stopped with {lifecycle.signal_text(self.how)}; state: {state}"


_ABSENT = object()


def stop(loc: Located, *, grace_s: float = wire.STOP_GRACE_S, now: bool = False,
         fence: Collection[int] = ()) -> list[NodeStopped]:
    """Every node at once, in two phases: first the run is marked stopped on every node, then each node gets
    lifecycle.stop's ladder (SIGTERM, `grace_s`, SIGKILL). Marking first makes a node that fails because another
    was signalled (its collective lost a peer) read as stopped, not failed. A node already ended, or without the
    run, is reported as such; one that cannot be reached does not keep the others from stopping. `now`: SIGKILL
    at once. The ranks of `fence` (a launch may still be on its way there) are stopped with lifecycle.fence."""
    ranks = range(len(loc.targets))

    def mark(i: int, s: Session):
        if i in fence:
            return None        # not looked for yet: lifecycle.fence looks under the launch lock
        try:
            found = lifecycle.find_run(s, loc.run_id)
        except RunNotFound:
            return _ABSENT
        lifecycle.mark_stopped(s, found)
        return found

    def signal(i: int, s: Session) -> lifecycle.Stopped:
        return lifecycle.fence(s, loc.run_id, grace_s=grace_s) if i in fence else \
            lifecycle.stop(s, marked[i], grace_s=grace_s, now=now)

    out: dict[int, NodeStopped] = {}
    with _Sessions(loc, ranks) as sessions:
        marked = {}
        for o in _at_once(loc, sessions, ranks, mark, connect_s(loc.targets)):
            node, label = loc.nodes[o.key], loc.targets[o.key].label
            if not o.ok:
                out[o.key] = NodeStopped(node, label, "failed", error=o.error)
            elif o.value is _ABSENT:
                out[o.key] = NodeStopped(node, label, "not_there")
            else:
                marked[o.key] = o.value
        for o in _at_once(loc, sessions, list(marked), signal, (0 if now else grace_s) + 60 + SLACK_S):
            node, label = loc.nodes[o.key], loc.targets[o.key].label
            if not o.ok:
                out[o.key] = NodeStopped(node, label, "not_there" if isinstance(o.error, RunNotFound) else "failed",
                                         error=None if isinstance(o.error, RunNotFound) else o.error)
            else:
                out[o.key] = NodeStopped(node, label, o.value.how, stopped=o.value)
    return [out[i] for i in ranks]
