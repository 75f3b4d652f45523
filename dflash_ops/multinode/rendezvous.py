"""PURE: how the nodes of a run meet. The torchrun variables' rules, the checks a launch makes before it connects,
and the choice of the rendezvous address.

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

from dflash_ops import names, wire
from dflash_ops.errors import ConfigError, UsageError
from dflash_ops.spec import Runbook, Target

PORT_RANGE = (20000, 32768)       # below Linux's ephemeral ports (32768-60999), so no outgoing connection takes it
# torchrun's options that set the rendezvous or end it before it starts (--standalone); each is a flag
# (`--node-rank`, `--node_rank`) and a PET_<DEST> variable (a flag wins over its variable)
RDZV_DESTS = ("standalone", "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
              "master_addr", "master_port")
RDZV_FLAGS = tuple(sorted({f"--{d}" for d in RDZV_DESTS} | {f"--{d.replace('_', '-')}" for d in RDZV_DESTS}))
RDZV_ENV = tuple(f"PET_{d.upper()}" for d in RDZV_DESTS)
# On every node, the rendezvous is complete once its log shows torchrun's line (torch/distributed/elastic/agent/
# server/api.py `_rendezvous`, logged at INFO) or the trainer's first metrics line (ERE, for grep -E)
JOINED_ERE = f"Rendezvous complete for workers|^{wire.METRICS_PREFIX}"
JOIN_LOGLEVELS = ("INFO", "DEBUG")    # torchrun's LOGLEVEL at which that line is logged (exact names)


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
    """The container's own address, from what launch_scripts.rendezvous_script printed there: the first global IPv4
    of `ip -4 -o addr show scope global` (`DFLASH_IP4 2: eth0    inet 10.0.0.5/24 brd ... scope global eth0`),
    else the first one `hostname -I` lists (`DFLASH_HOSTIPS 10.0.0.5 fd00::5`); None when there is none.
    Loopback, link-local, multicast and unspecified addresses never count."""
    ip, listed = [], []
    for line in text.splitlines():
        words = line.split()
        if words[:1] == [wire.IP4] and "inet" in words[1:-1]:
            ip.append(words[words.index("inet") + 1].split("/", 1)[0])
        elif words[:1] == [wire.HOSTIPS]:
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
