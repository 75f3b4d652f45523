"""Shared CLI plumbing: settings, option aliases, opening a Session, and the ONE error boundary."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from dflash_ops.errors import OpsError


@dataclass(frozen=True)
class Settings:
    inventory: Path | None = None
    runbooks: Path | None = None


HostOpt = Annotated[Optional[str], typer.Option(
    "--host", "-H", help="Inventory name, `local`, or a bare address ([user@]host[:port], ~/.ssh/config alias).")]
CtOpt = Annotated[Optional[str], typer.Option("--ct", help="Proxmox container id: run inside it via `pct exec`.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout (errors too).")]


def settings(ctx: typer.Context) -> Settings:
    return ctx.obj if isinstance(ctx.obj, Settings) else Settings()


def _inventory(ctx: typer.Context):
    from dflash_ops import inventory

    return inventory.load_inventory(settings(ctx).inventory or inventory.default_path())


def open_session(ctx: typer.Context, host: str | None, ct: str | None):
    """Resolve --host/--ct through the inventory into a Session (no connection is made yet)."""
    from dflash_ops import inventory
    from dflash_ops.runs.lifecycle import Session
    from dflash_ops.ssh import transport

    target = inventory.resolve_target(_inventory(ctx), host, ct)
    return Session(target=target, transport=transport.for_host(target.host))


def resolve_host(ctx: typer.Context, host: str):
    """--host alone (no container) -> Host, through the inventory."""
    from dflash_ops import inventory

    return inventory.resolve_host(_inventory(ctx), host, with_ct=False)


def runbooks_dir(ctx: typer.Context) -> Path:
    from dflash_ops.runs import runbooks

    return settings(ctx).runbooks or runbooks.default_dir()


@contextmanager
def rendered_errors(json_out: bool = False) -> Iterator[None]:
    """The error boundary: an OpsError becomes `error: ...` / `hint: ...` on stderr (or a JSON object on stdout)
    and its exit code. Other exceptions are bugs and keep their traceback."""
    from dflash_ops.cli import render

    try:
        yield
    except OpsError as exc:
        render.error(exc, json_out=json_out)
        raise typer.Exit(exc.exit_code) from None
