"""PURE: the nodes of a multi-node run as the user names them (`launch --node H[:CT]`, inventory `groups:`), strictly
validated before anything connects.

A node is `HOST[:CT]`: HOST an inventory host name, `local`, or a bare `[user@]address`; CT a container id. The
`:` belongs to the container, so a bare address cannot carry a port here (give such a host an inventory entry).
A name that is an inventory group stands for its nodes, in the group's order. Node rank = position in the list.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dflash_ops.errors import UsageError

# HOST: an inventory name or a DNS name / IPv4 (the union of names.HOST_NAME_RE and names.ADDRESS_RE's host, no
# port), or a bracketed IPv6; an optional user; CT as names.CTID_RE. Nothing else: no shell metacharacter passes.
NODE_RE = re.compile(
    r"(?P<host>(?:[A-Za-z_][A-Za-z0-9._-]{0,31}@)?(?:[A-Za-z0-9][A-Za-z0-9._-]{0,252}|\[[0-9A-Fa-f:.]+\]))"
    r"(?::(?P<ct>[1-9][0-9]{0,8}))?"
)
FORM = "HOST[:CT] (an inventory host, `local` or [user@]address; CT a container id) or an inventory group"


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
