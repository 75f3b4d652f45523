"""Where a host's SSH connection goes: its endpoint (address, port, user, identity file: the inventory first, then
~/.ssh/config with its Includes, then defaults) and its route (routing.py: jump hosts or a ProxyCommand). Reads the
ssh config files; connects nowhere."""

from __future__ import annotations

import os

from dflash_ops.errors import ConfigError
from dflash_ops.spec import LOCAL, Host
from dflash_ops.ssh import config, routing
from dflash_ops.ssh.routing import Endpoint, Route


def resolve_endpoint(host: Host) -> tuple[str, int, str, str | None]:
    """(address, port, user, identity file): inventory values first, then ssh config (with its Includes),
    then defaults. A broken ssh config (an Include cycle, an unparsable line, a bad Port) or an inventory
    identity_file that is not there raises ConfigError."""
    name = host.address or host.name
    cfg = _ssh_config(name)
    address = cfg.get("hostname", name)
    port = host.port or routing.config_port(cfg, name)
    user = host.user or cfg.get("user") or "root"
    if host.identity_file:
        # checked here: paramiko's FileNotFoundError would read as "cannot connect" (exit 69, "is the host up?")
        identity = os.path.expanduser(host.identity_file)
        if not os.path.isfile(identity):
            raise ConfigError(f"host {host.name!r}: identity_file {identity} does not exist (or is not a file)",
                              hint="fix identity_file of that host in the inventory")
        return address, port, user, identity
    identity = (cfg.get("identityfile") or [None])[0]
    return address, port, user, os.path.expanduser(identity) if identity else None


def resolve_route(host: Host, target: tuple[str, int, str, str | None] | None = None) -> Route:
    """How `host` is reached (routing.resolve): its inventory `jump:`, else ssh config's ProxyJump or
    ProxyCommand (first found wins). A local host has no route."""
    if host.transport == LOCAL:
        return Route()
    endpoint = Endpoint(*(target or resolve_endpoint(host)), host.name)
    return routing.resolve(host.address or host.name, endpoint, host.jump, _ssh_config)


def _ssh_config(alias: str) -> dict:
    """ssh config's settings for `alias`, `Include`s followed (config.py); {} without a config."""
    return config.read().lookup(alias)

