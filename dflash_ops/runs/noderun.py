"""PURE: a multi-node run as one object. Its record (nodes in rank order, the rendezvous), the torchrun variables
each node gets, the choice of the rendezvous address, and the run's overall state from its nodes' states.

The wiring is torchrun's own static rendezvous: node i gets `--node-rank i` (PET_NODE_RANK), every node
`--nnodes N` and `--rdzv-endpoint ADDR:PORT` of rank 0's node, whose torchrun hosts the store on that port. Fixed
node ranks (unlike c10d's, which sorts the nodes by hostname) put rank 0, and so its metrics lines, checkpoints
and export, on the first node named; only one port, checked free beforehand, has to be open, on that node.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from dflash_ops import names, nodespec
from dflash_ops.errors import UsageError
from dflash_ops.spec import EXITED, LOCAL, RUNNING, RunStatus, Runbook, Target

BACKEND = "static"
DEFAULT_RDZV_TIMEOUT_S = 600      # torchrun's own default: how long the nodes wait for each other to join
PORT_RANGE = (20000, 32768)       # below Linux's ephemeral ports (32768-60999), so no outgoing connection takes it
RDZV_ENV = ("PET_NNODES", "PET_NODE_RANK", "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_RDZV_ID", "PET_RDZV_CONF")
# torchrun flags that would override the variables above (a flag wins over its PET_ variable) or end the
# rendezvous before it starts (--standalone)
RDZV_FLAGS = ("--standalone", "--nnodes", "--node-rank", "--node_rank", "--rdzv-backend", "--rdzv_backend",
              "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf", "--rdzv_conf",
              "--master-addr", "--master_addr", "--master-port", "--master_port")


@dataclass(frozen=True)
class Node:
    rank: int
    host: str            # as named at launch: an inventory host or a bare address, resolved again when used
    ct: str | None = None

    @property
    def spec(self) -> str:
        return nodespec.NodeRef(self.host, self.ct).spec


@dataclass(frozen=True)
class Rendezvous:
    address: str         # rank 0's node as the other nodes reach it
    port: int
    rdzv_id: str
    timeout_s: int = DEFAULT_RDZV_TIMEOUT_S
    backend: str = BACKEND

    @property
    def endpoint(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


@dataclass(frozen=True)
class NodeRun:
    run_id: str
    nodes: tuple[Node, ...]
    rendezvous: Rendezvous

    def node_env(self, rank: int) -> tuple[tuple[str, str], ...]:
        """What node `rank`'s torchrun reads its rendezvous from (it takes a flag's value from PET_<FLAG>)."""
        r = self.rendezvous
        return (("PET_NNODES", str(len(self.nodes))), ("PET_NODE_RANK", str(rank)), ("PET_RDZV_BACKEND", r.backend),
                ("PET_RDZV_ENDPOINT", r.endpoint), ("PET_RDZV_ID", r.rdzv_id),
                ("PET_RDZV_CONF", f"timeout={r.timeout_s}"))

    def as_dict(self) -> dict:
        r = self.rendezvous
        return {"run_id": self.run_id, "nodes": [{"rank": n.rank, "host": n.host, "ct": n.ct} for n in self.nodes],
                "rendezvous": {"backend": r.backend, "address": r.address, "port": r.port, "id": r.rdzv_id,
                               "timeout_s": r.timeout_s}}


def from_dict(doc: object) -> NodeRun | None:
    """A record as `as_dict` wrote it, every value checked again (it comes back from a remote run.json or a local
    file); None when it is not one."""
    try:
        run_id, rdzv = names.run_id(doc["run_id"]), doc["rendezvous"]
        nodes = []
        for i, n in enumerate(doc["nodes"]):
            ref = nodespec.parse_node(n["host"] if n.get("ct") is None else f"{n['host']}:{n['ct']}")
            if n["rank"] != i:
                return None
            nodes.append(Node(rank=i, host=ref.host, ct=ref.ct))
        port, timeout = rdzv["port"], rdzv["timeout_s"]
        if (not nodes or rdzv["backend"] != BACKEND or type(port) is not int or not 0 < port < 65536
                or type(timeout) is not int or timeout <= 0):
            return None
        return NodeRun(run_id=run_id, nodes=tuple(nodes),
                       rendezvous=Rendezvous(address=names.rdzv_address(rdzv["address"]), port=port,
                                             rdzv_id=names.run_id(rdzv["id"]), timeout_s=timeout))
    except (KeyError, TypeError, AttributeError, UsageError):
        return None


def check_runbook(book: Runbook) -> None:
    """A runbook spans nodes only when it says so (`nodes: true`) and leaves the rendezvous to us."""
    if not book.nodes:
        raise UsageError(f"runbook {book.name!r} runs on one node: --node needs a runbook with `nodes: true` "
                         "(its command is torchrun without rendezvous flags, e.g. graphwarm-nodes)")
    flags = [a for a in book.command if a.split("=", 1)[0] in RDZV_FLAGS]
    if flags:
        raise UsageError(f"runbook {book.name!r} gives torchrun {flags[0]}: with --node, dflash-ops sets the "
                         "rendezvous (remove it from the runbook's command)")


def check_env(extra_env: Sequence[tuple[str, str]]) -> None:
    for key, _ in extra_env:
        if key in RDZV_ENV:
            raise UsageError(f"--env {key}: with --node, dflash-ops sets the rendezvous itself")


def _loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def rendezvous_address(targets: Sequence[Target], ssh_endpoints: Sequence[tuple[str, int] | None]) -> str:
    """Rank 0's address as the other nodes reach it: its inventory `rdzv_address`, else the address dflash-ops
    reaches its host by (`ssh_endpoints[i]`: node i's host as (address, port), None for this machine). A
    loopback address (or this machine) serves only when every node is on that one machine (one SSH endpoint)."""
    first = targets[0]
    if first.rdzv_address:
        return first.rdzv_address
    one_machine = len({None if t.host.transport == LOCAL else e for t, e in zip(targets, ssh_endpoints)}) == 1
    address = ssh_endpoints[0][0] if first.host.transport != LOCAL and ssh_endpoints[0] else None
    if address is None and one_machine:
        return "127.0.0.1"
    if address is None or (_loopback(address) and not one_machine):
        shown = address or "this machine"
        where = f"hosts.{first.host.name}" + (f".containers.{first.container.ctid}" if first.container else "")
        raise UsageError(f"rank 0's node {first.label} is reached at {shown}, which the other nodes cannot reach",
                         hint=f"give it its address on the nodes' network: `rdzv_address:` under {where} in the "
                              "inventory")
    try:
        return names.rdzv_address(address)
    except UsageError:
        raise UsageError(f"rank 0's node {first.label} has no usable rendezvous address ({address!r})",
                         hint="set `rdzv_address:` for it in the inventory") from None


# -- the run's state from its nodes' ---------------------------------------------------------------------------
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
    `stopped` when every node ended and those that did not exit 0 were stopped, else `exited 0`."""
    read = [s for s in states if s.status is not None]
    running = [s for s in read if s.status.state == RUNNING]
    bad = [s for s in read if s.status.state != RUNNING and not (s.status.state == EXITED and s.status.exit_code == 0)]
    if bad and (running or not all(s.status.stopped for s in bad)):
        first = min(bad, key=lambda s: (s.status.ended_at is not None, s.status.ended_at or 0.0, s.node.rank))
        return Overall("failed", f"failed: node {first.node.rank} ({first.label}) first: {first.status.state_text}",
                       first)
    if len(read) < len(states):
        lost = next(s for s in states if s.status is None)
        return Overall("unknown", f"unknown: node {lost.node.rank} ({lost.label}): {lost.error}")
    if running:
        return Overall(RUNNING, RUNNING)
    return Overall("stopped", "stopped") if bad else Overall(f"{EXITED} 0", f"{EXITED} 0")
