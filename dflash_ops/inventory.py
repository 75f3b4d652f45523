"""inventory.yaml -> validated Host values, and `--host/--ct` -> a Target.

Resolution order for `--host H`: an inventory name; the built-in `local`; a bare address
(`[user@]host[:port]`, an IP or dotted name, or an ~/.ssh/config alias): a Proxmox host with `--ct`, a plain
SSH host without. Anything else is an unknown host (exit 2).

`groups:` names ordered lists of nodes (`HOST[:CT]`, noderecord.py) that `launch --node GROUP` spans.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from dflash_ops import names, noderecord
from dflash_ops.errors import UsageError
from dflash_ops.spec import DEFAULT_CT_RUNS_DIR, DEFAULT_PCT, LOCAL, PROXMOX, SSH, TRANSPORTS, Container, Host, Target
from dflash_ops.yamlsrc import Fields, Node, load

HOST_KEYS = {"transport", "address", "user", "port", "identity_file", "known_hosts", "jump", "pct", "runs_dir",
             "python", "env", "containers", "connect_timeout_s", "keepalive_s", "rdzv_address"}
CONTAINER_KEYS = {"runs_dir", "python", "env", "rdzv_address"}
LOCAL_HOST = Host(name="local", transport=LOCAL, pct="pct")


@dataclass(frozen=True)
class Inventory:
    hosts: tuple[Host, ...] = (LOCAL_HOST,)
    default_host: str = "local"
    source: str = "(built-in)"
    groups: tuple[tuple[str, tuple[str, ...]], ...] = ()    # (name, node specs in rank order)

    def host(self, name: str) -> Host | None:
        return next((h for h in self.hosts if h.name == name), None)

    def group_map(self) -> dict[str, tuple[str, ...]]:
        return dict(self.groups)


def default_path() -> Path | None:
    """`$DFLASH_OPS_INVENTORY`, else ./inventory.yaml, else ~/.config/dflash-ops/inventory.yaml, else none."""
    env = os.environ.get("DFLASH_OPS_INVENTORY")
    if env:
        return Path(env)
    for candidate in (Path("inventory.yaml"), Path.home() / ".config" / "dflash-ops" / "inventory.yaml"):
        if candidate.is_file():
            return candidate
    return None


def load_inventory(path: Path | None) -> Inventory:
    if path is None:
        return Inventory()
    if not path.is_file():
        raise UsageError(f"inventory file not found: {path}")
    top = Fields.of(load(path), "inventory")
    top.check_keys({"default_host", "hosts", "groups"})
    hosts_node = top.get("hosts")
    hosts: list[Host] = []
    if hosts_node is not None:
        if not isinstance(hosts_node.value, dict):
            raise hosts_node.fail("inventory: 'hosts' must be a mapping of name: host")
        hosts = [_host(str(name), node) for name, node in hosts_node.value.items()]
    if not any(h.name == "local" for h in hosts):
        hosts.append(LOCAL_HOST)
    default = top.str("default_host", "local")
    if not any(h.name == default for h in hosts):
        raise top.require("default_host").fail(f"default_host {default!r} is not a host of this inventory")
    return Inventory(hosts=tuple(hosts), default_host=default, source=str(path), groups=_groups(top, hosts))


def _groups(top: Fields, hosts: list[Host]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`groups: {name: [HOST[:CT], ...]}`: each entry a valid node spec, no group named like a host."""
    node = top.get("groups")
    if node is None:
        return ()
    if not isinstance(node.value, dict):
        raise node.fail("inventory: 'groups' must be a mapping of name: [HOST[:CT], ...]")
    out = []
    for name, gnode in node.value.items():
        name = str(name)
        if not names.HOST_NAME_RE.fullmatch(name):
            raise gnode.fail(f"invalid group name {name!r}")
        if any(h.name == name for h in hosts):
            raise gnode.fail(f"group {name!r} has the name of a host (`--node {name}` would mean both)")
        if not isinstance(gnode.value, list) or not gnode.value:
            raise gnode.fail(f"group {name!r} must be a non-empty list of HOST[:CT]")
        for item in gnode.value:
            if not isinstance(item.value, str):
                raise item.fail(f"group {name!r}: each node is a string HOST[:CT] (quote it)")
            try:
                noderecord.parse_node(item.value)
            except UsageError as exc:
                raise item.fail(f"group {name!r}: {exc.message}") from None
        items = tuple(item.value for item in gnode.value)
        if len(set(items)) != len(items):
            raise gnode.fail(f"group {name!r} names a node twice")
        out.append((name, items))
    return tuple(out)


def _host(name: str, node: Node) -> Host:
    if not names.HOST_NAME_RE.fullmatch(name):
        raise node.fail(f"invalid host name {name!r}")
    f = Fields.of(node if node.value is not None else Node({}, node.line, node.path), f"host {name!r}")
    f.check_keys(HOST_KEYS)
    transport = f.str("transport", LOCAL if name == "local" else PROXMOX)
    if transport not in TRANSPORTS:
        raise f.require("transport").fail(f"host {name!r}: transport must be one of {', '.join(TRANSPORTS)}")
    address = f.str("address", None if transport == LOCAL else name, required=False)
    if transport != LOCAL and not names.ADDRESS_RE.fullmatch(address or ""):
        raise (f.get("address") or node).fail(f"host {name!r}: invalid address {address!r}")
    port = f.number("port")
    if port is not None and not (0 < port < 65536 and port == int(port)):
        raise f.require("port").fail(f"host {name!r}: port must be 1..65535")
    user = f.str("user")
    if user is not None and not names.USER_RE.fullmatch(user):  # the rule of `--host user@...`
        raise f.require("user").fail(f"host {name!r}: invalid user {user!r}")
    # a zero connect timeout fails every connect; a keepalive of 0 switches keepalive off
    keepalive = f.number("keepalive_s", 15.0, positive=True, most=names.SECONDS_MAX)
    if keepalive != int(keepalive):
        raise f.require("keepalive_s").fail(f"host {name!r}: keepalive_s must be a whole number of seconds")
    return Host(
        name=name, transport=transport, address=address, user=user,
        port=int(port) if port is not None else None, identity_file=f.str("identity_file"),
        known_hosts=f.str("known_hosts"), jump=_jump(f), pct=f.str("pct", DEFAULT_PCT if transport != LOCAL else "pct"),
        runs_dir=_abs_dir(f, "runs_dir"), python=f.str("python"), env=f.str_map("env"),
        containers=_containers(f), containers_listed=f.get("containers") is not None,
        connect_timeout_s=f.number("connect_timeout_s", 10.0, positive=True, most=names.SECONDS_MAX),
        keepalive_s=int(keepalive), rdzv_address=_rdzv(f),
    )


def _rdzv(f: Fields) -> str | None:
    value = f.str("rdzv_address")
    if value is None:
        return None
    try:
        return names.rdzv_address(value)
    except UsageError as exc:
        raise f.require("rdzv_address").fail(f"{f.what}: {exc.message} (a DNS name or IP address, no port)") from None


def _jump(f: Fields) -> str | None:
    """`jump:`: one hop or a comma list of hops, each `[user@]host[:port]` or `ssh://[user@]host[:port]`."""
    from dflash_ops.ssh import routing

    jump = f.str("jump")
    if jump is not None:
        try:
            routing.parse_jump(jump, "jump")
        except UsageError as exc:
            raise f.require("jump").fail(f"{f.what}: {exc.message} (jump is user@host:port, or a comma list of "
                                         f"them, first hop first)") from None
    return jump


def _abs_dir(f: Fields, key: str) -> str | None:
    value = f.str(key)
    if value is not None and (not value.startswith(("/", "~/")) and value != "~" or "\n" in value):
        raise f.require(key).fail(f"{f.what}: {key} must be an absolute path or start with ~/ (the login's home)")
    return value.rstrip("/") or "/" if value else value


def _containers(f: Fields) -> tuple[Container, ...]:
    node = f.get("containers")
    if node is None:
        return ()
    if not isinstance(node.value, dict):
        raise node.fail(f"{f.what}: 'containers' must be a mapping of ctid: settings")
    out = []
    for ctid, cnode in node.value.items():
        if not names.CTID_RE.fullmatch(str(ctid)):
            raise cnode.fail(f"{f.what}: invalid container id {ctid!r}")
        cf = Fields.of(cnode if cnode.value is not None else Node({}, cnode.line, cnode.path),
                       f"container {ctid}")
        cf.check_keys(CONTAINER_KEYS)
        out.append(Container(ctid=str(ctid), runs_dir=_abs_dir(cf, "runs_dir") or DEFAULT_CT_RUNS_DIR,
                             python=cf.str("python", "python3"), env=cf.str_map("env"), rdzv_address=_rdzv(cf)))
    return tuple(out)


def resolve_target(inv: Inventory, host: str | None, ct: str | int | None) -> Target:
    """`--host`/`--ct` -> Target; unknown names raise UsageError (exit 2)."""
    ctid = names.ctid(ct) if ct is not None else None
    found = resolve_host(inv, host or inv.default_host, with_ct=ctid is not None)
    if ctid is None:
        if found.transport == PROXMOX:
            listed = ", ".join(c.ctid for c in found.containers) or "e.g. 200"
            raise UsageError(f"host {found.name!r} is a Proxmox host: pass --ct ({listed})")
        return Target(found)
    container = found.container(ctid)
    if container is None:
        if found.containers_listed:
            listed = ", ".join(c.ctid for c in found.containers) or "none"
            raise UsageError(f"unknown container {ctid} on host {found.name!r} (inventory lists: {listed})",
                             hint=f"add it under hosts.{found.name}.containers in {inv.source}")
        container = Container(ctid=ctid)
    return Target(found, container)


def resolve_host(inv: Inventory, text: str, *, with_ct: bool) -> Host:
    known = inv.host(text)
    if known is not None:
        return known
    m = names.ADDRESS_RE.fullmatch(text)
    if m is None or not _looks_like_address(text, m.group("host")):
        hosts = ", ".join(h.name for h in inv.hosts)
        raise UsageError(f"unknown host {text!r} (inventory {inv.source} has: {hosts})",
                         hint="pass an inventory name, an IP address / dotted host name, or an ~/.ssh/config alias")
    port = int(m.group("port")) if m.group("port") else None
    if port is not None and not 0 < port < 65536:
        raise UsageError(f"invalid port in {text!r}")
    return Host(name=text, transport=PROXMOX if with_ct else SSH, address=m.group("host").strip("[]"),
                user=m.group("user"), port=port)


def _looks_like_address(text: str, host: str) -> bool:
    if "@" in text or "." in host or host.startswith("["):
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return _ssh_config_has(host)


def _ssh_config_has(alias: str) -> bool:
    """`alias` is named by a non-wildcard `Host` pattern of ~/.ssh/config or a file it includes (`Host *` and
    `!alias` name nothing)."""
    from dflash_ops.ssh import config

    return config.read().has_alias(alias)
