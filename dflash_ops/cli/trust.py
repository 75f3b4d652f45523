"""`dflash-ops trust-host HOST`: the explicit first contact that records a host key in known_hosts."""

from __future__ import annotations

from typing import Annotated

import typer

from dflash_ops.cli._common import rendered_errors, resolve_host


def trust_host(
    ctx: typer.Context,
    host: Annotated[str, typer.Argument(help="Inventory name or bare address ([user@]host[:port]).")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask; trust the key shown.")] = False,
) -> None:
    """Fetch HOST's SSH key, show its SHA256 fingerprint, and append it to known_hosts after confirmation.

    Refuses (exit 77) when a DIFFERENT key is already recorded for that host: remove it explicitly first.
    """
    from dflash_ops import transport
    from dflash_ops.cli import render
    from dflash_ops.errors import AuthFailed, UsageError

    with rendered_errors():
        found = resolve_host(ctx, host)
        if found.transport == "local":
            raise UsageError(f"host {host!r} is local: there is no SSH key to trust")
        address, port, _, _ = transport.resolve_endpoint(found)
        entry = transport.host_key_entry(address, port)
        path = transport.known_hosts_path(found)
        key = transport.fetch_host_key(address, port, timeout_s=found.connect_timeout_s)
        fingerprint = transport.key_fingerprint(key)
        state = transport.known_key_status(path, entry, key)
        if state == "same":
            render.info(f"{entry} is already trusted ({key.get_name()} {fingerprint})")
            return
        if state == "changed":
            raise AuthFailed(f"{entry} presents {key.get_name()} {fingerprint}, but {path} records a DIFFERENT key",
                             hint=f"if you know why it changed: ssh-keygen -R '{entry}' -f {path}, then retry")
        render.info(f"{entry} presents {key.get_name()} key {fingerprint}")
        if not yes and not typer.confirm(f"trust it and add it to {path}?", default=False, err=True):
            raise UsageError("not trusted; nothing written")
        transport.append_known_host(path, entry, key)
        render.info(f"added {entry} to {path}")
