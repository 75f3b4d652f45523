"""Launching a multi-node run (a plan.NodePlan): reach every node, find the rendezvous on rank 0's, write the
record, launch every node at once and wait until they met; all or none: a launch that fails is rolled back by
stopping every node (watch.stop). runs/lifecycle.py does each node's part.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from dflash_ops import names, wire
from dflash_ops.errors import HostUnreachable, OpsError, Refused, RemoteFailed, RunFailed
from dflash_ops.fanout import Outcome, fan_out
from dflash_ops.multinode import recordfile, rendezvous
from dflash_ops.multinode.fan import SLACK_S, connect_s, raise_bugs, together
from dflash_ops.multinode.plan import NodePlan
from dflash_ops.multinode.record import NodeRun
from dflash_ops.multinode.watch import Located, NodeStopped, stop
from dflash_ops.runs import launch_scripts, lifecycle, parse, read_scripts
from dflash_ops.spec import Launched, RunSpec

JOIN_SLACK_S = 10.0  # beyond --rdzv-timeout: for torchrun's line to reach the log and a poll to read it
JOIN_POLL_S = (0.25, 1.0)   # the rendezvous is polled every 0.25 s at first, backing off to every 1 s
# A rolled-back launch's nodes have not met at the rendezvous, so no node has trained: no checkpoint to wait for.
ROLLBACK_GRACE_S = 10.0


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


def find_rendezvous(p: NodePlan) -> NodeRun:
    """The run's record, from what rank 0's node says (rank 0 connected): a port free there, and rank 0's
    address when it is to be found in its container."""
    s = p.sessions[0]
    done = s.run(launch_scripts.rendezvous_script(p.port_candidates, find_address=p.address is None),
                 "checking the rendezvous port", ok=(0, 1))
    words = parse.tagged(done.out, wire.PORT)
    if done.exit_code != 0 or not words or not names.is_digits(words[0]):
        raise RemoteFailed(f"no free port for the rendezvous on {s.target.label} (tried {len(p.port_candidates)} "
                           f"in {rendezvous.PORT_RANGE[0]}-{rendezvous.PORT_RANGE[1] - 1})", hint="launch again")
    return p.run(int(words[0]), p.address or rendezvous.found_address(done.out, s.target))


def launch(p: NodePlan, *, force: bool = False, wait_s: float | None = None, grace_s: float = wire.STOP_GRACE_S,
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
    failed = [o for o in together(ranks, lambda i: p.sessions[i].connect(), deadline_s=connect_s(targets),
                                  describe=describe) if not o.ok]
    if failed:
        raise _node_error(p, failed[0], "nothing was launched")
    run = find_rendezvous(p)
    specs = p.specs(run)
    # A node that would refuse (a live run of the name unless --force, the cache in use) refuses before any node
    # starts or has its run stopped.
    refused = [o for o in together(ranks, lambda i: lifecycle.check_launch(p.sessions[i], specs[i], forced=force),
                                   deadline_s=connect_s(targets), describe=describe) if not o.ok]
    if refused:
        raise _node_error(p, refused[0], "nothing was launched")
    recordfile.save(run)

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
        raise_bugs(outcomes)
        failed = [o for o in outcomes if not o.ok]
        if not failed:
            on_waiting(run)
            missing = await_rendezvous(p, specs, run)
            if not missing:
                return NodesLaunched(run=run, launched=tuple(o.value for o in outcomes))
    except BaseException as exc:
        stopped = roll_back(p, run, grace_s=ROLLBACK_GRACE_S, in_flight=in_flight)
        if isinstance(exc, KeyboardInterrupt):
            raise LaunchInterrupted(run.run_id, stopped) from None
        raise
    aftermath = _aftermath(run, roll_back(p, run, grace_s=ROLLBACK_GRACE_S, in_flight=in_flight))
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
        recordfile.forget(run.run_id)
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
    """Wait until every node's log shows the rendezvous complete (rendezvous.JOINED_ERE), at most --rdzv-timeout
    (+ JOIN_SLACK_S): the nodes' liveness line comes before they meet. Static rendezvous completes on every node or
    on none, so the wait ends as soon as a node ends without it. Returns the nodes that did not join: (rank, why,
    the last lines of its log)."""
    ended = threading.Event()
    limit = time.monotonic() + run.rendezvous.timeout_s + JOIN_SLACK_S

    def one(i: int) -> tuple[str, list[str]] | None:
        s, spec = p.sessions[i], specs[i]
        poll = JOIN_POLL_S[0]
        while True:
            done = s.run(read_scripts.joined_script(spec.run_dir, rendezvous.JOINED_ERE), f"checking {spec.run_id}")
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

    outcomes = together(range(len(specs)), one, deadline_s=run.rendezvous.timeout_s + JOIN_SLACK_S + SLACK_S,
                        describe=lambda i: f"node {i} ({p.labels[i]})")
    missing = []
    for o in outcomes:
        if not o.ok:
            missing.append((o.key, f"could not be checked: {o.error.message}", []))
        elif o.value is not None:
            missing.append((o.key, *o.value))
    return missing
