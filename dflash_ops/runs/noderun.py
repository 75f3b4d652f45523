"""PURE: a multi-node run as one object. Its record (nodes in rank order, the rendezvous), the torchrun variables
each node gets, the choice of the rendezvous address, the checks a launch makes before it connects, and the run's
overall state from its nodes' states.

The wiring is torchrun's own static rendezvous: node i gets `--node-rank i` (PET_NODE_RANK), every node
`--nnodes N` and `--rdzv-endpoint ADDR:PORT` of rank 0's node, whose torchrun hosts the store on that port. Fixed
node ranks (unlike c10d's, which sorts the nodes by hostname) put rank 0, and so its metrics lines, checkpoints
and export, on the first node named. What keeps two runs apart is the port: one checked free on rank 0's node, that
only this run's nodes are given. PET_RDZV_ID (the run id) is the prefix of the store's keys and every worker's
TORCHELASTIC_RUN_ID; with the static backend it makes no rendezvous unique by itself.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from dflash_ops import names, nodespec
from dflash_ops.errors import ConfigError, UsageError
from dflash_ops.spec import EXITED, RUNNING, RunStatus, Runbook, Target

BACKEND = "static"
DEFAULT_RDZV_TIMEOUT_S = 600      # torchrun's own default: how long the nodes wait for each other to join
PORT_RANGE = (20000, 32768)       # below Linux's ephemeral ports (32768-60999), so no outgoing connection takes it
# torchrun's options that set the rendezvous or end it before it starts (--standalone); each is a flag
# (`--node-rank`, `--node_rank`) and a PET_<DEST> variable (a flag wins over its variable)
RDZV_DESTS = ("standalone", "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
              "master_addr", "master_port")
RDZV_FLAGS = tuple(sorted({f"--{d}" for d in RDZV_DESTS} | {f"--{d.replace('_', '-')}" for d in RDZV_DESTS}))
RDZV_ENV = tuple(f"PET_{d.upper()}" for d in RDZV_DESTS)
# On every node, the rendezvous is complete once its log shows torchrun's line (torch/distributed/elastic/agent/
# server/api.py `_rendezvous`, logged at INFO) or the trainer's first metrics line (ERE, for grep -E)
JOINED_ERE = "Rendezvous complete for workers|^DFLASH_METRICS "
JOIN_LOGLEVELS = ("INFO", "DEBUG")    # torchrun's LOGLEVEL at which that line is logged (exact names)


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


def _rdzv_flag(arg: str) -> bool:
    """`arg` gives torchrun a rendezvous option: one of RDZV_FLAGS, `=value` or not, or an abbreviation of one
    (argparse expands an unambiguous prefix: `--nnode`, `--stand`)."""
    flag = arg.split("=", 1)[0]
    return len(flag) > 2 and flag.startswith("--") and any(f.startswith(flag) for f in RDZV_FLAGS)


def check_runbook(book: Runbook) -> None:
    """A runbook spans nodes only when it says so (`nodes: true`) and leaves the rendezvous to us."""
    if not book.nodes:
        raise UsageError(f"runbook {book.name!r} runs on one node: --node needs a runbook with `nodes: true` "
                         "(its command is torchrun without rendezvous flags, e.g. graphwarm-nodes)")
    flags = [a for a in book.command if _rdzv_flag(a)]
    if flags:
        raise UsageError(f"runbook {book.name!r} gives torchrun {flags[0]}: with --node, dflash-ops sets the "
                         "rendezvous (remove it from the runbook's command)")


def check_env(env: Sequence[tuple[str, str]], where: str) -> None:
    """No rendezvous variable in an environment a node's job gets (`where`: whose it is, e.g. `--env`)."""
    for key, _ in env:
        if key in RDZV_ENV:
            raise UsageError(f"{where} sets {key}: with --node, dflash-ops sets the rendezvous itself")


def check_loglevel(env: Sequence[tuple[str, str]], book: Runbook) -> None:
    """The job's environment (its last LOGLEVEL wins) makes torchrun log the line the launch waits for."""
    level = dict(env).get("LOGLEVEL")
    if level not in JOIN_LOGLEVELS:
        now = "is not set" if level is None else f"is {level!r}"
        raise UsageError(f"runbook {book.name!r}: LOGLEVEL {now}; a multi-node launch waits for torchrun's "
                         "'Rendezvous complete' line on every node, which torchrun logs at LOGLEVEL=INFO",
                         hint="set `LOGLEVEL: INFO` in the runbook's env (graphwarm-nodes does)")


@dataclass(frozen=True)
class Machine:
    """How dflash-ops reaches a node's host, which tells machines apart: the SSH address and port, and the route
    to them (two jump hosts may each lead to a private network that reuses one address). All None: this
    machine."""

    address: str | None = None
    port: int | None = None
    route: str | None = None             # jump hosts / proxy command (routing.Route.describe); None: direct


def _loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _inventory_key(target: Target) -> str:
    return f"hosts.{target.host.name}" + (f".containers.{target.container.ctid}" if target.container else "")


def rendezvous_address(targets: Sequence[Target], machines: Sequence[Machine]) -> str | None:
    """Rank 0's address as the other nodes reach it (`machines[i]`: how node i's host is reached):
    - its inventory `rdzv_address` (a container's own, or a bare host's), always;
    - else, for a container: None, to be found inside it at launch (`found_address`). A container has a network
      namespace of its own: neither its host's address nor loopback reaches it;
    - else, for a bare host, the address dflash-ops reaches it by; loopback (or this machine) only when every
      node is a bare host on that one machine.
    Refused (exit 2): a rank 0 reached through a jump host or a proxy command (its address there is what the jump
    host sees, not necessarily what the other nodes reach), or at an address the other nodes cannot reach."""
    first, reach = targets[0], machines[0]
    if first.rdzv_address:
        return first.rdzv_address
    hint = (f"give it its address on the nodes' network: `rdzv_address:` under {_inventory_key(first)} in the "
            "inventory")
    if reach.route is not None:
        raise UsageError(f"rank 0's node {first.label} is reached through {reach.route}: the other nodes may not "
                         "reach it at the address that route takes", hint=hint)
    if first.container is not None:
        return None
    one_machine = all(t.container is None for t in targets) and len(set(machines)) == 1
    if reach.address is None or _loopback(reach.address):
        if one_machine:
            return "127.0.0.1"
        raise UsageError(f"rank 0's node {first.label} is reached at {reach.address or 'this machine'}, which the "
                         "other nodes cannot reach", hint=hint)
    try:
        return names.rdzv_address(reach.address)
    except UsageError:
        raise UsageError(f"rank 0's node {first.label} has no usable rendezvous address ({reach.address!r})",
                         hint=hint) from None


_IPV4_RE = re.compile(r"[0-9]{1,3}(?:\.[0-9]{1,3}){3}")


def own_ipv4(text: str) -> str | None:
    """The container's own address, from what shellcmd.rendezvous_script printed there: the first global IPv4
    of `ip -4 -o addr show scope global` (`DFLASH_IP4 2: eth0    inet 10.0.0.5/24 brd ... scope global eth0`),
    else the first one `hostname -I` lists (`DFLASH_HOSTIPS 10.0.0.5 fd00::5`); None when there is none.
    Loopback, link-local, multicast and unspecified addresses never count."""
    ip, listed = [], []
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["DFLASH_IP4"] and "inet" in words[1:-1]:
            ip.append(words[words.index("inet") + 1].split("/", 1)[0])
        elif words[:1] == ["DFLASH_HOSTIPS"]:
            listed += words[1:]
    for word in ip + listed:
        if not _IPV4_RE.fullmatch(word):
            continue
        try:
            address = ipaddress.IPv4Address(word)
        except ValueError:
            continue
        if not (address.is_loopback or address.is_link_local or address.is_multicast or address.is_unspecified):
            return str(address)
    return None


def found_address(text: str, target: Target) -> str:
    """Rank 0's address found in its container (`own_ipv4`), else ConfigError (exit 78) naming the setting."""
    address = own_ipv4(text)
    if address is None:
        raise ConfigError(f"rank 0's node {target.label} has no global IPv4 address in its container "
                          "(`ip -4 addr show scope global` and `hostname -I` list none)",
                          hint=f"set the address the other nodes reach it by: `rdzv_address:` under "
                               f"{_inventory_key(target)} in the inventory")
    return address


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


def exit_code(items) -> int:
    """`runs`, `status` and `stop` of a multi-node run: 0 when every node answered, else the first failed node's
    exit code (`items`: NodeState or nodewatch.NodeStopped, in rank order; each has an `exit_code`)."""
    return next((x.exit_code for x in items if x.exit_code), 0)
