"""A multi-node run before it starts: which nodes (`--node` specs -> their targets, rank order), and the plan of a
launch (every node's command, checked before anything connects) and its dry run. launch.py launches a plan.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dflash_ops import inventory, names
from dflash_ops.errors import UsageError
from dflash_ops.multinode import rendezvous
from dflash_ops.noderecord import DEFAULT_RDZV_TIMEOUT_S, Node, NodeRef, NodeRun, Rendezvous, parse_nodes
from dflash_ops.multinode.rendezvous import Machine
from dflash_ops.runs import lifecycle
from dflash_ops.runs.lifecycle import Session
from dflash_ops.spec import LOCAL, PROXMOX, Host, Runbook, RunSpec, Target
from dflash_ops.ssh import endpoint

PORT_CANDIDATES = 16
DRY_RUN_ADDRESS = "<rank-0-address>"   # a dry run reaches no container to find rank 0's address in


# -- which nodes ----------------------------------------------------------------------------------------------
def machine(host: Host) -> Machine:
    """How dflash-ops reaches `host` (ssh config's HostName and Port for an alias, and the route: jump hosts, a
    proxy command): what tells machines apart."""
    if host.transport == LOCAL:
        return Machine()
    found = endpoint.resolve_endpoint(host)
    return Machine(found[0], found[1], endpoint.resolve_route(host, found).describe())


def same_place(t: Target) -> tuple[Machine, str | None]:
    """Where `t` is: its machine and its container (two nodes of a run are never at one place)."""
    return machine(t.host), t.container.ctid if t.container else None


def resolve(inv: inventory.Inventory, specs: Sequence[str]) -> tuple[tuple[NodeRef, ...], tuple[Target, ...]]:
    """`--node` specs -> node refs and their targets, rank order. Refused (exit 2), before anything connects: a
    malformed spec, an unknown host, a Proxmox host without its container, one target named twice (also as two
    names of one machine)."""
    refs = parse_nodes(specs, inv.group_map())
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
        key = same_place(t)
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
    refs: tuple[NodeRef, ...]
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
         rdzv_timeout_s: int = DEFAULT_RDZV_TIMEOUT_S) -> NodePlan:
    """Validate everything that needs no connection: the runbook, the nodes, the environments, the rendezvous
    address, each node's command."""
    rendezvous.check_runbook(book)
    rendezvous.check_env(book.env, f"runbook {book.name!r}")
    rendezvous.check_env(extra_env, "--env")
    refs, targets = resolve(inv, specs)
    for i, t in enumerate(targets):
        rendezvous.check_env(t.env, f"the inventory's env of node {i} ({t.label})")
    address = rendezvous.rendezvous_address(targets, [machine(t.host) for t in targets])
    name = names.run_name(book.name if name is None else name)
    rng = secrets.SystemRandom()
    p = NodePlan(book=book, refs=refs, sessions=tuple(map(Session.of, targets)), name=name,
                 run_id=names.new_run_id(name), address=address, extra_args=extra_args, extra_env=extra_env,
                 rdzv_timeout_s=int(rdzv_timeout_s),
                 port_candidates=tuple(rng.sample(range(*rendezvous.PORT_RANGE), PORT_CANDIDATES)))
    for spec in p.specs(p.run(p.port_candidates[0])):      # every node's command is valid (lifecycle.plan's checks)
        rendezvous.check_loglevel(spec.env, book)
    return p


def dry_run(p: NodePlan, *, wait_s: float | None = None) -> tuple[NodeRun, tuple[lifecycle.DryRun, ...]]:
    """Every node's exact command, with the first candidate port (a dry run reaches no host to check it) and, for
    rank 0 in a container without `rdzv_address`, DRY_RUN_ADDRESS for the address found there at launch."""
    run = p.run(p.port_candidates[0])
    return run, tuple(lifecycle.dry_run(s, spec, wait_s=wait_s) for s, spec in zip(p.sessions, p.specs(run)))
