"""`dflash-ops runs`: the runs of a host/container with state, start and duration."""

from __future__ import annotations

import typer

from dflash_ops.cli._common import CtOpt, HostOpt, JsonOpt, open_session, rendered_errors


def runs(ctx: typer.Context, host: HostOpt = None, ct: CtOpt = None, json_out: JsonOpt = False) -> None:
    """List runs: name, run id, state (running, exited N, killed, lost), pid, start, duration."""
    from dflash_ops.cli import render
    from dflash_ops.runs import lifecycle

    with rendered_errors(json_out):
        session = open_session(ctx, host, ct)
        try:
            render.runs_table(lifecycle.list_runs(session), target=session.target.label, json_out=json_out)
        finally:
            session.transport.close()
