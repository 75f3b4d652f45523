"""`dflash-ops trust-host HOST`: the explicit first contact that records a host key in known_hosts."""

from __future__ import annotations

from typing import Annotated

import typer

from dflash_ops.cli._common import confirmed, rendered_errors, resolve_host


def trust_host(
    ctx: typer.Context,
    host: Annotated[str, typer.Argument(help="Inventory name or bare address ([user@]host[:port]).")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask; trust the key shown.")] = False,
    new_key_type: Annotated[bool, typer.Option(
        "--accept-new-key-type",
        help="Add a key of a type not yet pinned for HOST beside the pinned one(s).")] = False,
) -> None:
    """Fetch HOST's SSH key, show its SHA256 fingerprint, and append it to known_hosts after confirmation.

    Refuses (exit 77) when a DIFFERENT key is already recorded for that host: remove it explicitly first; when
    known_hosts lists the key @revoked; and when keys of other types are pinned for it but not this one (pass
    --accept-new-key-type if that is expected).
    A host with jump hosts is reached through them (their keys must already be trusted), a ProxyCommand through it.
    """
    from dflash_ops.cli import render
    from dflash_ops.errors import AuthFailed, UsageError
    from dflash_ops.ssh import endpoint, hostkeys

    with rendered_errors():
        found = resolve_host(ctx, host)
        if found.transport == "local":
            raise UsageError(f"host {host!r} is local: there is no SSH key to trust")
        address, port, _, _ = endpoint.resolve_endpoint(found)
        entry = hostkeys.host_key_entry(address, port)
        path = hostkeys.known_hosts_path(found)
        route = endpoint.resolve_route(found).describe()
        key = _fetch_key(found, address, port)
        fingerprint = hostkeys.key_fingerprint(key)
        state = hostkeys.known_key_status(path, entry, key)
        via = f" (via {route})" if route else ""
        if state == "same":
            render.info(f"{entry} is already trusted ({key.get_name()} {fingerprint}){via}")
            return
        if state == "revoked":
            raise AuthFailed(f"{entry} presents {key.get_name()} {fingerprint}, which {path} lists as @revoked; "
                             "nothing written", hint="a revoked key is never trusted: find out why it was revoked")
        if state == "changed":
            raise AuthFailed(f"{entry} presents {key.get_name()} {fingerprint}, but {path} records a DIFFERENT key",
                             hint=f"if you know why it changed: {hostkeys.forget_key_command(entry, path)}, "
                                  "then retry")
        if state == "other_type":
            pinned = ", ".join(f"{name} {fp}" for name, fp in hostkeys.known_keys(path, entry))
            if not new_key_type:
                raise AuthFailed(f"{entry} presents a {key.get_name()} key ({fingerprint}), but {path} pins a key "
                                 f"of another type for it ({pinned}); nothing written",
                                 hint="if the host really has this key too, pass --accept-new-key-type to add it")
            render.info(f"warning: {path} pins {pinned} for {entry}; adding a {key.get_name()} key beside it")
        render.info(f"{entry} presents {key.get_name()} key {fingerprint}{via}")
        if not yes and not confirmed(f"trust it and add it to {path}?", err=True):
            raise UsageError("not trusted; nothing written")
        hostkeys.append_known_host(path, entry, key)
        render.info(f"added {entry} to {path}")


def _fetch_key(host, address: str, port: int):
    """The host's key, fetched the way every other command reaches it: directly, through its jump hosts (the
    inventory's `jump:`, else ssh config's ProxyJump; those connections check each jump host's key, so they must
    be trusted first), or through its ssh config ProxyCommand."""
    from dflash_ops.ssh.connection import SshTransport, fetch_host_key

    via = SshTransport(host)
    try:
        return fetch_host_key(address, port, timeout_s=host.connect_timeout_s, sock=via.tunnel())
    finally:
        via.close()
