"""Use cases of a multi-node run (noderun.py: the record, the wiring): plan it, launch every node at once (all or
none), find it from its run id, read its nodes, stop every node. lifecycle.py does each node's part, fanout.py
runs the nodes together.

Where a run is found: its record is written on this machine (`local_state_dir()/nodes/<run id>.json`) before any
node starts (and removed when the launch is rolled back), and into every node's run.json, so `stop RUN_ID` works
from the run id alone on the launching machine and with the `--host/--ct` of any one of its nodes elsewhere.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_ops import hoststatus, inventory, names, nodespec
from dflash_ops.errors import ConfigError, HostUnreachable, OpsError, Refused, RemoteFailed, RunFailed, RunNotFound, UsageError
from dflash_ops.fanout import Outcome, fan_out
from dflash_ops.runs import lifecycle, noderun, parse, shellcmd
from dflash_ops.runs.lifecycle import Session
from dflash_ops.runs.noderun import Machine, Node, NodeRun, NodeState, Rendezvous
from dflash_ops.spec import LOCAL, PROXMOX, Host, Launched, Runbook, RunSpec, RunStatus, Target, local_state_dir
from dflash_ops.ssh import transport

PORT_CANDIDATES = 16
SLACK_S = 90.0       # beyond each node's own timeouts: a node still busy past this is reported, not waited for
JOIN_SLACK_S = 10.0  # beyond --rdzv-timeout: for torchrun's line to reach the log and a poll to read it
JOIN_POLL_S = (0.25, 1.0)   # the rendezvous is polled every 0.25 s at first, backing off to every 1 s
DRY_RUN_ADDRESS = "<rank-0-address>"   # a dry run reaches no container to find rank 0's address in


# -- which nodes ----------------------------------------------------------------------------------------------
def machine(host: Host) -> Machine:
    """How dflash-ops reaches `host` (ssh config's HostName and Port for an alias, and the route: jump hosts, a
    proxy command): what tells machines apart."""
    if host.transport == LOCAL:
        return Machine()
    endpoint = transport.resolve_endpoint(host)
    return Machine(endpoint[0], endpoint[1], transport.resolve_route(host, endpoint).describe())


def _same_place(t: Target) -> tuple[Machine, str | None]:
    return machine(t.host), t.container.ctid if t.container else None


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
        key = _same_place(t)
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
    """Everything about a launch but the port (and, for a container without `rdzv_address`, rank 0's address),
    which are found on rank 0's node once it is reached."""

    book: Runbook
    refs: tuple[nodespec.NodeRef, ...]
    sessions: tuple[Session, ...]          # by rank
    name: str
    run_id: str
    address: str | None                    # the rendezvous host: rank 0's node; None: found in its container
    extra_args: tuple[str, ...]
    extra_env: tuple[tuple[str, str], ...]
    rdzv_timeout_s: int
    port_candidates: tuple[int, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(s.target.label for s in self.sessions)

    def run(self, port: int, address: str | None = None) -> NodeRun:
        return NodeRun(run_id=self.run_id, nodes=tuple(Node(i, r.host, r.ct) for i, r in enumerate(self.refs)),
                       rendezvous=Rendezvous(address=address or self.address or DRY_RUN_ADDRESS, port=port,
                                             rdzv_id=self.run_id, timeout_s=self.rdzv_timeout_s))

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
    """Validate everything that needs no connection: the runbook, the nodes, the environments, the rendezvous
    address, each node's command."""
    noderun.check_runbook(book)
    noderun.check_env(book.env, f"runbook {book.name!r}")
    noderun.check_env(extra_env, "--env")
    refs, targets = resolve(inv, specs)
    for i, t in enumerate(targets):
        noderun.check_env(t.env, f"the inventory's env of node {i} ({t.label})")
    address = noderun.rendezvous_address(targets, [machine(t.host) for t in targets])
    name = names.run_name(book.name if name is None else name)
    rng = secrets.SystemRandom()
    p = NodePlan(book=book, refs=refs, sessions=tuple(map(Session.of, targets)), name=name,
                 run_id=names.new_run_id(name), address=address, extra_args=extra_args, extra_env=extra_env,
                 rdzv_timeout_s=int(rdzv_timeout_s),
                 port_candidates=tuple(rng.sample(range(*noderun.PORT_RANGE), PORT_CANDIDATES)))
    for spec in p.specs(p.run(p.port_candidates[0])):      # every node's command is valid (lifecycle.plan's checks)
        noderun.check_loglevel(spec.env, book)
    return p


def dry_run(p: NodePlan, *, wait_s: float | None = None) -> tuple[NodeRun, tuple[lifecycle.DryRun, ...]]:
    """Every node's exact command, with the first candidate port (a dry run reaches no host to check it) and, for
    rank 0 in a container without `rdzv_address`, DRY_RUN_ADDRESS for the address found there at launch."""
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


def forget_record(run_id: str) -> None:
    try:
        record_path(run_id).unlink(missing_ok=True)
    except OSError:
        pass      # a record left behind names a run no node has: `stop` says so


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


class LaunchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a multi-node launch, after the nodes it had started were stopped (`stopped`: what became of
    each node)."""

    def __init__(self, run_id: str, stopped: list[NodeStopped]) -> None:
        super().__init__(run_id)
        self.run_id, self.stopped = run_id, stopped


def _raise_bugs(outcomes: Sequence[Outcome]) -> None:
    """An error that is not an OpsError (a bug) is raised with its traceback."""
    for o in outcomes:
        if o.error is not None and not isinstance(o.error, OpsError):
            raise o.error


def _together(keys: Sequence, fn: Callable, *, deadline_s: float, describe: Callable[[object], str]) -> list[Outcome]:
    outcomes = fan_out(list(keys), fn, deadline_s=deadline_s, describe=describe)
    _raise_bugs(outcomes)
    return outcomes


def _connect_s(targets: Sequence[Target]) -> float:
    return max(t.host.connect_timeout_s for t in targets) * 3 + SLACK_S


def rendezvous(p: NodePlan) -> NodeRun:
    """The run's record, from what rank 0's node says (rank 0 connected): a port free there, and rank 0's
    address when it is to be found in its container."""
    s = p.sessions[0]
    done = s.run(shellcmd.rendezvous_script(p.port_candidates, find_address=p.address is None),
                 "checking the rendezvous port", ok=(0, 1))
    words = parse.tagged(done.out, "DFLASH_PORT")
    if done.exit_code != 0 or not words or not names.is_digits(words[0]):
        raise RemoteFailed(f"no free port for the rendezvous on {s.target.label} (tried {len(p.port_candidates)} "
                           f"in {noderun.PORT_RANGE[0]}-{noderun.PORT_RANGE[1] - 1})", hint="launch again")
    return p.run(int(words[0]), p.address or noderun.found_address(done.out, s.target))


def launch(p: NodePlan, *, force: bool = False, wait_s: float | None = None, grace_s: float = 10.0,
           on_started: Callable[[int, int], None] = lambda rank, pid: None,
           on_waiting: Callable[[NodeRun], None] = lambda run: None) -> NodesLaunched:
    """All or none. Reach every node, find the rendezvous on rank 0's, write the record; then launch every node
    at once, each with lifecycle.launch's checks (duplicate refusal, pre steps, liveness), and wait until
    torchrun's rendezvous completed on every node (`await_rendezvous`). If a node fails, does not join, or the
    launch is interrupted (Ctrl-C: LaunchInterrupted) or hits a bug, every node is stopped (`roll_back`) before
    the error is raised: the failed node's (the lowest rank that failed), saying what became of each node.
    `on_started(rank, pid)` as each node's job starts; `on_waiting(run)` once every node is up."""
    ranks = range(len(p.sessions))

    def describe(i: int) -> str:
        return f"node {i} ({p.labels[i]})"

    targets = [s.target for s in p.sessions]
    failed = [o for o in _together(ranks, lambda i: p.sessions[i].connect(), deadline_s=_connect_s(targets),
                                   describe=describe) if not o.ok]
    if failed:
        raise _node_error(p, failed[0], "nothing was launched")
    run = rendezvous(p)
    specs = p.specs(run)
    save_record(run)

    def one(i: int) -> Launched:
        return lifecycle.launch(p.sessions[i], specs[i], force=force, wait_s=wait_s, grace_s=grace_s,
                                on_started=lambda pid: on_started(i, pid))

    live = specs[0].liveness
    wait = live.wait_s if wait_s is None else wait_s
    deadline = max(wait, live.timeout_s or 0.0) + (grace_s + 30 if force else 0) + 60 + SLACK_S   # past its own
    in_flight: Collection[int] = ranks      # a launch that may still reach its node: all, until their outcomes are in
    try:
        outcomes = fan_out(list(ranks), one, deadline_s=deadline, describe=describe)
        in_flight = [o.key for o in outcomes if o.timed_out]
        _raise_bugs(outcomes)
        failed = [o for o in outcomes if not o.ok]
        if not failed:
            on_waiting(run)
            missing = await_rendezvous(p, specs, run)
            if not missing:
                return NodesLaunched(run=run, launched=tuple(o.value for o in outcomes))
    except BaseException as exc:
        stopped = roll_back(p, run, grace_s=grace_s, in_flight=in_flight)
        if isinstance(exc, KeyboardInterrupt):
            raise LaunchInterrupted(run.run_id, stopped) from None
        raise
    aftermath = _aftermath(run, roll_back(p, run, grace_s=grace_s, in_flight=in_flight))
    if failed:
        raise _node_error(p, failed[0], aftermath, keep_hint=isinstance(failed[0].error, Refused))
    r = run.rendezvous
    raise RunFailed(f"the nodes of {run.run_id} did not meet at the rendezvous {r.endpoint}: "
                    + "; ".join(f"node {i} ({p.labels[i]}) {why}" for i, why, _ in missing),
                    hint=f"every node must reach {r.endpoint}, and the nodes each other (docs/cli.md, Multi-node "
                         "runs: the network)",
                    detail="\n".join([f"node {i}: {line}" for i, _, tail in missing for line in tail] + [aftermath]))


def roll_back(p: NodePlan, run: NodeRun, *, grace_s: float, in_flight: Collection[int]) -> list[NodeStopped]:
    """Stop every node of a launch that failed. First each node's connection is shut, so that nothing more is
    sent through it (a node's thread past its deadline cannot start its job afterwards); a node whose launch may
    still be on its way is fenced (lifecycle.fence). The record is forgotten once no node may hold the run."""
    for s in p.sessions:
        s.transport.shut()
    stopped = stop(Located(run.run_id, run.nodes, tuple(s.target for s in p.sessions), run), grace_s=grace_s,
                   fence=in_flight)
    if all(r.how != "failed" for r in stopped):
        forget_record(run.run_id)
    return stopped


def _aftermath(run: NodeRun, stopped: list[NodeStopped]) -> str:
    done = "; ".join(f"node {r.node.rank} ({r.label}) {r.text}" for r in stopped if r.how != "not_there")
    text = f"rolled back: {done}" if done else "rolled back: no node had started"
    if any(r.how == "failed" for r in stopped):
        text += f"; its record is kept: `dflash-ops stop {run.run_id}` once every node can be reached"
    return text


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


LAST_LINES = 5


def await_rendezvous(p: NodePlan, specs: Sequence[RunSpec], run: NodeRun) -> list[tuple[int, str, list[str]]]:
    """Wait until every node's log shows the rendezvous complete (noderun.JOINED_ERE), at most --rdzv-timeout
    (+ JOIN_SLACK_S): the nodes' liveness line comes before they meet. Static rendezvous completes on every node or
    on none, so the wait ends as soon as a node ends without it. Returns the nodes that did not join: (rank, why,
    the last lines of its log)."""
    ended = threading.Event()
    limit = time.monotonic() + run.rendezvous.timeout_s + JOIN_SLACK_S

    def one(i: int) -> tuple[str, list[str]] | None:
        s, spec = p.sessions[i], specs[i]
        poll = JOIN_POLL_S[0]
        while True:
            done = s.run(shellcmd.joined_script(spec.run_dir, noderun.JOINED_ERE), f"checking {spec.run_id}")
            probe = parse.probe(done.stdout)
            tail = probe.log_tail.decode("utf-8", "replace").splitlines()[-LAST_LINES:]
            if parse.joined(done.stdout):
                return None
            if probe.raw is None or not probe.raw.alive:
                ended.set()
                state = parse.status(probe.raw, {}, probe.now, spec.runs_dir).state_text if probe.raw else "gone"
                return f"ended ({state}) before it completed", tail
            if ended.is_set():
                return "had not joined when another node ended", tail
            if time.monotonic() >= limit:
                return f"had not joined after {run.rendezvous.timeout_s} s", tail
            ended.wait(poll)
            poll = min(poll * 1.25, JOIN_POLL_S[1])

    outcomes = _together(range(len(specs)), one, deadline_s=run.rendezvous.timeout_s + JOIN_SLACK_S + SLACK_S,
                         describe=lambda i: f"node {i} ({p.labels[i]})")
    missing = []
    for o in outcomes:
        if not o.ok:
            missing.append((o.key, f"could not be checked: {o.error.message}", []))
        elif o.value is not None:
            missing.append((o.key, *o.value))
    return missing


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
            if _same_place(targets[rank]) != _same_place(target):
                why = f"its node {rank} is {record.nodes[rank].spec}, not {target.label}"
    if why is not None:
        return Located.single(status.run_id, target), (
            f"warning: the record of {status.run_id}'s nodes in its run.json on {target.label} is not followed "
            f"({why}); showing {target.label} alone")
    return Located(record.run_id, record.nodes, targets, record), None


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
    return _together(keys, lambda i: fn(i, sessions[i]), deadline_s=deadline_s,
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


def status_rows(loc: Located, gpu: hoststatus.GpuSettings, *, timeout_s: float,
                reuse: transport.Transport | None = None) -> list[NodeRow]:
    """`status` of the run's nodes: one query per host (its nodes' containers together), all hosts at once.
    `reuse`: an open transport to the host of a one-node run (so `status RUN` connects once)."""
    by_host: dict[str, list[int]] = {}
    for i, t in enumerate(loc.targets):
        by_host.setdefault(t.host.name, []).append(i)
    hosts = {t.host.name: t.host for t in loc.targets}
    part = max(1, int(timeout_s) - 3)
    outcomes = _together(by_host, lambda h: hoststatus.query_host(
        hosts[h], [loc.targets[i] for i in by_host[h]], gpu, part_timeout_s=part,
        transport=reuse if len(by_host) == 1 else None),
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
    how: str                                # terminated | killed | not_running | not_there | fenced | failed
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
        signal = "SIGTERM" if self.how == "terminated" else "SIGKILL after the grace period"
        return f"stopped with {signal}; state: {state}"


_ABSENT = object()


def stop(loc: Located, *, grace_s: float = 10.0, fence: Collection[int] = ()) -> list[NodeStopped]:
    """Every node at once, in two phases: first the run is marked stopped on every node, then each node gets
    lifecycle.stop's ladder (SIGTERM, `grace_s`, SIGKILL). Marking first makes a node that fails because another
    was signalled (its collective lost a peer) read as stopped, not failed. A node already ended, or without the
    run, is reported as such; one that cannot be reached does not keep the others from stopping. The ranks of
    `fence` (a launch may still be on its way there) are stopped with lifecycle.fence."""
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
            lifecycle.stop(s, marked[i], grace_s=grace_s)

    out: dict[int, NodeStopped] = {}
    with _Sessions(loc, ranks) as sessions:
        marked = {}
        for o in _at_once(loc, sessions, ranks, mark, _connect_s(loc.targets)):
            node, label = loc.nodes[o.key], loc.targets[o.key].label
            if not o.ok:
                out[o.key] = NodeStopped(node, label, "failed", error=o.error)
            elif o.value is _ABSENT:
                out[o.key] = NodeStopped(node, label, "not_there")
            else:
                marked[o.key] = o.value
        for o in _at_once(loc, sessions, list(marked), signal, grace_s + 60 + SLACK_S):
            node, label = loc.nodes[o.key], loc.targets[o.key].label
            if not o.ok:
                out[o.key] = NodeStopped(node, label, "not_there" if isinstance(o.error, RunNotFound) else "failed",
                                         error=None if isinstance(o.error, RunNotFound) else o.error)
            else:
                out[o.key] = NodeStopped(node, label, o.value.how, stopped=o.value)
    return [out[i] for i in ranks]
