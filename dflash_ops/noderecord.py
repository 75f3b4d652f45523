"""PURE: a multi-node run's record, and the node names it is made of.

A node is `HOST[:CT]` as the user names it (`launch --node H[:CT]`, inventory `groups:`): HOST an inventory host
name, `local`, or a bare `[user@]address`; CT a container id. The `:` belongs to the container, so a bare address
cannot carry a port here (give such a host an inventory entry). A name that is an inventory group stands for its
nodes, in the group's order. Node rank = position in the list.

The record (`NodeRun`: the nodes in rank order and the rendezvous) is what every node's run.json and the launching
machine keep (docs/contracts.md section 2); `from_dict` checks every value of one read back. It is a top-level
values module, beside spec.py, not in multinode/: `spec.RunSpec` and `spec.RunStatus` carry it, and runs/parse.py
and inventory.py read it, so it sits below every folder that uses it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dflash_ops import names
from dflash_ops.errors import UsageError

BACKEND = "static"
DEFAULT_RDZV_TIMEOUT_S = 600      # torchrun's own default: how long the nodes wait for each other to join

# HOST: an inventory name or a DNS name / IPv4 (the union of names.HOST_NAME_RE and names.ADDRESS_RE's host, no
# port), or a bracketed IPv6; an optional user; CT as names.CTID_RE. Nothing else: no shell metacharacter passes.
NODE_RE = re.compile(
    r"(?P<host>(?:[A-Za-z_][A-Za-z0-9._-]{0,31}@)?(?:[A-Za-z0-9][A-Za-z0-9._-]{0,252}|\[[0-9A-Fa-f:.]+\]))"
    r"(?::(?P<ct>[1-9][0-9]{0,8}))?"
)
FORM = "HOST[:CT] (an inventory host, `local` or [user@]address; CT a container id) or an inventory group"


# -- node names -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeRef:
    host: str
    ct: str | None = None

    @property
    def spec(self) -> str:
        return self.host if self.ct is None else f"{self.host}:{self.ct}"


def parse_node(text: str) -> NodeRef:
    """One `HOST[:CT]`; anything else is a UsageError (exit 2) naming it."""
    m = NODE_RE.fullmatch(text)
    if m is None:
        raise UsageError(f"invalid node {text!r}: expected {FORM}")
    return NodeRef(host=m.group("host"), ct=m.group("ct"))


def parse_nodes(specs: Sequence[str], groups: Mapping[str, Sequence[str]]) -> tuple[NodeRef, ...]:
    """Every spec in order, a group name replaced by its nodes; a node named twice is refused."""
    if not specs:
        raise UsageError("no nodes given", hint="name each node: --node HOST[:CT] (repeat it), or --node GROUP")
    nodes: list[NodeRef] = []
    for text in specs:
        nodes += [parse_node(t) for t in groups[text]] if text in groups else [parse_node(text)]
    seen: set[NodeRef] = set()
    for node in nodes:
        if node in seen:
            raise UsageError(f"node {node.spec} is given twice")
        seen.add(node)
    return tuple(nodes)


# -- the record -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Node:
    rank: int
    host: str            # as named at launch: an inventory host or a bare address, resolved again when used
    ct: str | None = None

    @property
    def spec(self) -> str:
        return NodeRef(self.host, self.ct).spec


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
            ref = parse_node(n["host"] if n.get("ct") is None else f"{n['host']}:{n['ct']}")
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
