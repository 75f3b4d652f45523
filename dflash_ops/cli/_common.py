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
# `tail --node`: one node of a run (`launch --node`, which names every node of a new run, is its own option)
NodeOpt = Annotated[Optional[str], typer.Option(
    "--node", metavar="RANK|HOST[:CT]", help="For a multi-node run: this node (its rank, or as launched) "
                                             "[default: rank 0].")]
RUN_HELP = ("A run id or a run name (its latest run). A multi-node run's id alone finds it when it was "
            "launched from this machine; otherwise, and for a name, give --host/--ct [default: the inventory's "
            "default host]. A multi-node run: a row per node.")
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout (errors too).")]


def confirmed(question: str, *, err: bool = False) -> bool:
    """The user's yes/no (default no). Stdin at its end (no terminal, `< /dev/null`) answers no: click's Abort would
    print "Aborted!" and exit 1, past the command's documented answer to a no and before what was already done is
    shown. Ctrl-C still ends the command."""
    try:
        return typer.confirm(question, default=False, err=err)
    except typer.Abort as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise
        typer.echo(err=err)  # end the prompt's line: what follows starts its own
        return False


def settings(ctx: typer.Context) -> Settings:
    return ctx.obj if isinstance(ctx.obj, Settings) else Settings()


def inventory_of(ctx: typer.Context):
    from dflash_ops import inventory

    return inventory.load_inventory(settings(ctx).inventory or inventory.default_path())


def open_session(ctx: typer.Context, host: str | None, ct: str | None):
    """Resolve --host/--ct through the inventory into a Session (no connection is made yet)."""
    from dflash_ops import inventory
    from dflash_ops.runs.lifecycle import Session

    return Session.of(inventory.resolve_target(inventory_of(ctx), host, ct))


def locate(ctx: typer.Context, ref: str | None, host: str | None, ct: str | None, *, find=None):
    """The run `ref` names (a run id or name; None: the latest run of the target) -> (Located, session, status).

    A run id with neither --host nor --ct is first looked up among the multi-node runs launched from this
    machine; otherwise the run is found on --host/--ct (a name: its latest run there) as always, and if it is a
    node of a multi-node run whose record can be followed (multinode/watch.located_from; else a warning line says
    why not), the whole run is meant. For a multi-node run session and status are None; else they are the run's
    target's (the caller closes the session). `find(session, ref) -> RunStatus` finds the run on the target
    (default: lifecycle.find_run, one listing of its runs)."""
    from dflash_ops import names
    from dflash_ops.cli import render
    from dflash_ops.multinode import recordfile, watch
    from dflash_ops.runs import lifecycle

    if host is None and ct is None and ref is not None and names.is_run_id(ref):
        record = recordfile.load(ref)
        if record is not None:
            return watch.Located.of(inventory_of(ctx), record), None, None
    session = open_session(ctx, host, ct)
    try:
        status = (find or lifecycle.find_run)(session, ref)
        loc, warning = watch.located_from(inventory_of(ctx), status, session.target)
    except BaseException:
        session.transport.close()
        raise
    if warning is not None:
        render.info(warning)
    if loc.multinode is not None:
        session.transport.close()
        return loc, None, None
    return loc, session, status


def resolve_host(ctx: typer.Context, host: str):
    """--host alone (no container) -> Host, through the inventory."""
    from dflash_ops import inventory

    return inventory.resolve_host(inventory_of(ctx), host, with_ct=False)


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
