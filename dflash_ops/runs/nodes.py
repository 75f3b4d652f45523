"""Use cases of a multi-node run (noderun.py: the record, the wiring): plan it, launch every node at once (all or
none), find it from its run id, read its nodes, stop every node. lifecycle.py does each node's part, fanout.py
runs the nodes together.

Where a run is found: its record is written on this machine (`local_state_dir()/nodes/<run id>.json`) before any
node starts, and into every node's run.json, so `stop RUN_ID` works from the run id alone on the launching machine
and with the `--host/--ct` of any one of its nodes elsewhere.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_ops import hoststatus, inventory, names, nodespec
from dflash_ops.errors import ConfigError, HostUnreachable, OpsError, Refused, RemoteFailed, RunNotFound, UsageError
from dflash_ops.fanout import Outcome, fan_out
from dflash_ops.runs import lifecycle, noderun, parse, shellcmd
from dflash_ops.runs.lifecycle import Session
from dflash_ops.runs.noderun import Node, NodeRun, NodeState, Rendezvous
from dflash_ops.spec import LOCAL, PROXMOX, Host, Launched, Runbook, RunSpec, Target, local_state_dir
from dflash_ops.ssh import transport

PORT_CANDIDATES = 16
SLACK_S = 90.0       # beyond each node's own timeouts: a node still busy past this is reported, not waited for


# -- which nodes ----------------------------------------------------------------------------------------------
def _endpoint(host: Host) -> tuple[str, int] | None:
    """(address, port) dflash-ops reaches `host` at (ssh config's HostName and Port for an alias): what tells
    machines apart; None for this machine."""
    if host.transport == LOCAL:
        return None
    address, port, _user, _key = transport.resolve_endpoint(host)
    return address, port


def resolve(inv: inventory.Inventory, specs: Sequence[str]) -> tuple[tuple[nodespec.NodeRef, ...], tuple[Target, ...]]:
    """`--node` specs -> node refs and their targets, rank order. Refused (exit 2), before anything connects: a
    malformed spec, an unknown host, a Proxmox host without its container, one target named twice (also as two
    names of one machine)."""
    refs = nodespec.parse_nodes(specs, inv.group_map())
    targets = []
    for ref in refs:
        try:
            host = inventory.resolve_host(inv, ref.host, with_ct=ref.ct is not None)
            if ref.ct is None and host.transport == PROXMOX:
                listed = ", ".join(f"{ref.host}:{c.ctid}" for c in host.containers) or f"{ref.host}:200"
                raise UsageError(f"{host.name!r} is a Proxmox host: name one of its containers ({listed})")
            targets.append(inventory.resolve_target(inv, ref.host, ref.ct))
        except UsageError as exc:
            raise UsageError(f"node {ref.spec}: {exc.message}", hint=exc.hint) from None
    seen: dict[tuple, str] = {}
    for ref, t in zip(refs, targets):
        key = (_endpoint(t.host), t.container.ctid if t.container else None)
        if key in seen:
            same = "container" if t.container else "host"
            raise UsageError(f"nodes {seen[key]} and {ref.spec} are the same {same}")
        seen[key] = ref.spec
    return refs, tuple(targets)


def targets_of(inv: inventory.Inventory, run: NodeRun) -> tuple[Target, ...]:
    out = []
    for n in run.nodes:
        try:
            out.append(inventory.resolve_target(inv, n.host, n.ct))
        except UsageError as exc:
            raise UsageError(f"node {n.rank} ({n.spec}) of {run.run_id}: {exc.message}", hint=exc.hint) from None
    return tuple(out)


# -- plan -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodePlan:
    """Everything about a launch but the port, which is checked on rank 0's node once it is reached."""

    book: Runbook
    refs: tuple[nodespec.NodeRef, ...]
    sessions: tuple[Session, ...]          # by rank
    name: str
    run_id: str
    address: str                           # the rendezvous host: rank 0's node
    extra_args: tuple[str, ...]
    extra_env: tuple[tuple[str, str], ...]
    rdzv_timeout_s: int
    port_candidates: tuple[int, ...]

    def run(self, port: int) -> NodeRun:
        return NodeRun(run_id=self.run_id, nodes=tuple(Node(i, r.host, r.ct) for i, r in enumerate(self.refs)),
                       rendezvous=Rendezvous(address=self.address, port=port, rdzv_id=self.run_id,
                                             timeout_s=self.rdzv_timeout_s))

    def specs(self, run: NodeRun) -> tuple[RunSpec, ...]:
        return tuple(replace(lifecycle.plan(s, self.book, name=self.name, extra_args=self.extra_args,
                                            extra_env=self.extra_env + run.node_env(i), run_id=run.run_id),
                             multinode=run, node_rank=i)
                     for i, s in enumerate(self.sessions))

    def close(self) -> None:
        for s in self.sessions:
            s.transport.close()


def plan(inv: inventory.Inventory, book: Runbook, specs: Sequence[str], *, name: str | None,
         extra_args: tuple[str, ...] = (), extra_env: tuple[tuple[str, str], ...] = (),
         rdzv_timeout_s: int = noderun.DEFAULT_RDZV_TIMEOUT_S) -> NodePlan:
    """Validate everything that needs no connection: the runbook, the nodes, the rendezvous address, each
    node's command."""
    noderun.check_runbook(book)
    noderun.check_env(extra_env)
    refs, targets = resolve(inv, specs)
    address = noderun.rendezvous_address(targets, [_endpoint(t.host) for t in targets])
    name = names.run_name(book.name if name is None else name)
    rng = secrets.SystemRandom()
    p = NodePlan(book=book, refs=refs, sessions=tuple(Session(t, transport.for_host(t.host)) for t in targets),
                 name=name, run_id=names.new_run_id(name), address=address, extra_args=extra_args,
                 extra_env=extra_env, rdzv_timeout_s=int(rdzv_timeout_s),
                 port_candidates=tuple(rng.sample(range(*noderun.PORT_RANGE), PORT_CANDIDATES)))
    p.specs(p.run(p.port_candidates[0]))     # every node's command is valid (lifecycle.plan's checks)
    return p


def dry_run(p: NodePlan, *, wait_s: float | None = None) -> tuple[NodeRun, tuple[lifecycle.DryRun, ...]]:
    """Every node's exact command, with the first candidate port (a dry run reaches no host to check it)."""
    run = p.run(p.port_candidates[0])
    return run, tuple(lifecycle.dry_run(s, spec, wait_s=wait_s) for s, spec in zip(p.sessions, p.specs(run)))


# -- the record on this machine -------------------------------------------------------------------------------
def record_path(run_id: str) -> Path:
    return local_state_dir() / "nodes" / f"{names.run_id(run_id)}.json"


def save_record(run: NodeRun) -> None:
    path = record_path(run.run_id)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".tmp")
        part.write_text(json.dumps(run.as_dict()) + "\n")
        os.replace(part, path)
    except OSError as exc:
        raise OpsError(f"cannot write the record of {run.run_id} to {path}: {exc.strerror or exc}") from None


def load_record(run_id: str) -> NodeRun | None:
    """The record of a multi-node run launched from this machine; None when there is none."""
    path = record_path(run_id)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OpsError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        run = noderun.from_dict(json.loads(text))
    except json.JSONDecodeError:
        run = None
    if run is None or run.run_id != run_id:
        raise ConfigError(f"{path}: not a valid multi-node run record", hint="remove it, or restore it")
    return run


# -- launch ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodesLaunched:
    run: NodeRun
    launched: tuple[Launched, ...]         # by rank


def _together(keys: Sequence, fn: Callable, *, deadline_s: float, describe: Callable[[object], str]) -> list[Outcome]:
    """fan_out, with an error that is not an OpsError (a bug) raised with its traceback."""
    outcomes = fan_out(list(keys), fn, deadline_s=deadline_s, describe=describe)
    for o in outcomes:
        if o.error is not None and not isinstance(o.error, OpsError):
            raise o.error
    return outcomes


def free_port(s: Session, candidates: Sequence[int]) -> int:
    done = s.run(shellcmd.free_port_script(candidates), "finding a free port", ok=(0, 1))
    words = parse.tagged(done.out, "DFLASH_PORT")
    if done.exit_code != 0 or not words or not names.is_digits(words[0]):
        raise RemoteFailed(f"no free port for the rendezvous on {s.target.label} (tried {len(candidates)} in "
                           f"{noderun.PORT_RANGE[0]}-{noderun.PORT_RANGE[1] - 1})", hint="launch again")
    return int(words[0])


def launch(p: NodePlan, *, force: bool = False, wait_s: float | None = None, grace_s: float = 10.0,
           on_started: Callable[[int, int], None] = lambda rank, pid: None) -> NodesLaunched:
    """Reach every node, check a port on rank 0's, write the record, then launch every node at once, each with
    lifecycle.launch's checks (duplicate refusal, pre steps, liveness). If any node fails, every node that may
    have started is stopped and the error names the node that failed (the lowest rank of those that did) and
    says what became of the others. `on_started(rank, pid)` as each node's job starts."""
    ranks = range(len(p.sessions))

    def describe(i: int) -> str:
        return f"node {i} ({p.sessions[i].target.label})"

    connect_s = max(s.target.host.connect_timeout_s for s in p.sessions) * 3 + SLACK_S
    failed = [o for o in _together(ranks, lambda i: p.sessions[i].connect(), deadline_s=connect_s,
                                   describe=describe) if not o.ok]
    if failed:
        raise _node_error(p, failed[0], "nothing was launched")
    run = p.run(free_port(p.sessions[0], p.port_candidates))
    specs = p.specs(run)
    save_record(run)
    started: set[int] = set()

    def one(i: int) -> Launched:
        def seen(pid: int) -> None:
            started.add(i)
            on_started(i, pid)
        return lifecycle.launch(p.sessions[i], specs[i], force=force, wait_s=wait_s, grace_s=grace_s,
                                on_started=seen)

    live = specs[0].liveness
    wait = live.wait_s if wait_s is None else wait_s
    deadline = max(wait, live.timeout_s or 0.0) + (grace_s + 30 if force else 0) + 60 + SLACK_S   # past its own
    outcomes = _together(ranks, one, deadline_s=deadline, describe=describe)
    failed = [o for o in outcomes if not o.ok]
    if not failed:
        return NodesLaunched(run=run, launched=tuple(o.value for o in outcomes))
    # What may have started: every node that said so or succeeded, and any whose connection dropped mid-launch
    may_run = [o.key for o in outcomes if o.ok or o.key in started or isinstance(o.error, HostUnreachable)]
    loc = Located(run.run_id, run.nodes, tuple(s.target for s in p.sessions), run)
    stopped = stop(loc, grace_s=grace_s, ranks=may_run)
    report = "; ".join(f"node {r.node.rank} ({r.label}) {r.text}" for r in stopped)
    raise _node_error(p, failed[0], f"stopped the others: {report}" if report else "no other node had started",
                      keep_hint=isinstance(failed[0].error, Refused))


def _node_error(p: NodePlan, o: Outcome, aftermath: str, *, keep_hint: bool = True) -> OpsError:
    """The failed node's error, of its class (so its exit code), saying which node it was and what was done."""
    err: OpsError = o.error
    target = p.sessions[o.key].target
    if isinstance(err, HostUnreachable):
        hint = f"check that {target.host.name} is up and accepts SSH, then launch again"
    else:
        hint = err.hint if keep_hint else None
    detail = "\n".join(x for x in (err.detail, aftermath) if x)
    return type(err)(f"node {o.key} ({target.label}) of {p.run_id}: {err.message}", hint=hint, detail=detail)


# -- read and stop --------------------------------------------------------------------------------------------
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
        ref = nodespec.parse_node(text)
        for n in self.nodes:
            if (n.host, n.ct) == (ref.host, ref.ct):
                return n.rank
        known = ", ".join(f"{n.rank} ({n.spec})" for n in self.nodes)
        raise UsageError(f"--node {text}: not a node of {self.run_id} (its nodes: {known})")


def _each(loc: Located, fn: Callable[[Session], object], *, ranks: Sequence[int] | None = None,
          deadline_s: float = 60.0) -> list[Outcome]:
    """`fn(session)` on each node (of `ranks`, default all) at once; each connection closed after."""
    keys = list(range(len(loc.targets)) if ranks is None else ranks)

    def work(i: int):
        s = Session(loc.targets[i], transport.for_host(loc.targets[i].host))
        try:
            return fn(s)
        finally:
            s.transport.close()

    return _together(keys, work, deadline_s=deadline_s, describe=lambda i: f"node {i} ({loc.targets[i].label})")


def _state(loc: Located, rank: int, status=None, error: OpsError | None = None) -> NodeState:
    why = None if error is None else "no run there" if isinstance(error, RunNotFound) else error.message
    return NodeState(node=loc.nodes[rank], label=loc.targets[rank].label, status=status, error=why,
                     exit_code=0 if error is None else error.exit_code)


def read_states(loc: Located, *, deadline_s: float = 60.0) -> list[NodeState]:
    """Each node's state of the run, read at once; a node that cannot be read says why."""
    outcomes = _each(loc, lambda s: lifecycle.find_run(s, loc.run_id), deadline_s=deadline_s)
    return [_state(loc, o.key, o.value, o.error) for o in outcomes]


@dataclass(frozen=True)
class NodeRow:
    state: NodeState
    row: hoststatus.RunRow | None = None   # its latest metrics and the GPUs it holds


def status_rows(loc: Located, gpu: hoststatus.GpuSettings, *, timeout_s: float) -> list[NodeRow]:
    """`status` of the run's nodes: one query per host (its nodes' containers together), all hosts at once."""
    by_host: dict[str, list[int]] = {}
    for i, t in enumerate(loc.targets):
        by_host.setdefault(t.host.name, []).append(i)
    hosts = {t.host.name: t.host for t in loc.targets}
    part = max(1, int(timeout_s) - 3)
    outcomes = _together(by_host, lambda h: hoststatus.query_host(
        hosts[h], [loc.targets[i] for i in by_host[h]], gpu, part_timeout_s=part),
        deadline_s=timeout_s, describe=lambda h: f"host {h}")
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


@dataclass(frozen=True)
class NodeStopped:
    node: Node
    label: str
    how: str                                # terminated | killed | not_running | not_there | failed
    stopped: lifecycle.Stopped | None = None
    error: OpsError | None = None

    @property
    def text(self) -> str:
        if self.how == "failed":
            return f"could not be stopped: {self.error.message}"
        if self.how == "not_there":
            return "had no run"
        state = self.stopped.status.state_text
        if self.how == "not_running":
            return f"was not running ({state})"
        signal = "SIGTERM" if self.how == "terminated" else "SIGKILL after the grace period"
        return f"stopped with {signal}; state: {state}"


def stop(loc: Located, *, grace_s: float = 10.0, ranks: Sequence[int] | None = None) -> list[NodeStopped]:
    """Every node (of `ranks`) at once: SIGTERM, `grace_s`, SIGKILL (lifecycle.stop). A node already ended, or
    without the run, is reported as such; one that cannot be reached does not keep the others from stopping."""
    def one(s: Session) -> lifecycle.Stopped | None:
        try:
            found = lifecycle.find_run(s, loc.run_id)
        except RunNotFound:
            return None
        return lifecycle.stop(s, found, grace_s=grace_s)

    out = []
    for o in _each(loc, one, ranks=ranks, deadline_s=grace_s + 30 + SLACK_S):
        node, label = loc.nodes[o.key], loc.targets[o.key].label
        if not o.ok:
            out.append(NodeStopped(node, label, "failed", error=o.error))
        elif o.value is None:
            out.append(NodeStopped(node, label, "not_there"))
        else:
            out.append(NodeStopped(node, label, o.value.how, stopped=o.value))
    return out
