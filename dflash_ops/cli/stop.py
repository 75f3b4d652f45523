"""`dflash-ops stop RUN`: SIGTERM every process of the run, wait, SIGKILL what is left."""

from __future__ import annotations

from typing import Annotated

import typer

from dflash_ops.cli._common import CtOpt, HostOpt, JsonOpt, open_session, rendered_errors


def stop(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="Run id, or run name (its latest run).")],
    host: HostOpt = None,
    ct: CtOpt = None,
    grace: Annotated[float, typer.Option("--grace", min=0, help="Seconds between SIGTERM and SIGKILL.")] = 10.0,
    json_out: JsonOpt = False,
) -> None:
    """Stop a run: SIGTERM every process of it, wait --grace seconds, SIGKILL what is left.

    A run's processes are those carrying its marker (DFLASH_OPS_RUN_ID) in their environment, wherever their
    process group or session, and also when the run's directory is gone; a reused pid is never hit. Stopping a
    run with nothing left is a no-op (exit 0).
    """
    from dflash_ops.cli import render
    from dflash_ops.runs import lifecycle

    with rendered_errors(json_out):
        session = open_session(ctx, host, ct)
        try:
            status = lifecycle.find_run(session, run)
            result = lifecycle.stop(session, status, grace_s=grace)
            render.stopped(status.run_id, result.how, result.status, json_out=json_out)
        finally:
            session.transport.close()
