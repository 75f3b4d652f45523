"""`dflash-ops stop RUN`: SIGTERM every process of the run, wait, SIGKILL what is left."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dflash_ops.cli._common import CtOpt, HostOpt, JsonOpt, locate, rendered_errors
from dflash_ops.names import SECONDS_MAX
from dflash_ops.wire import STOP_GRACE_S


def stop(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="Run id, or run name (its latest run on --host/--ct). A multi-node "
                                            "run's id alone finds it when it was launched from this machine.")],
    host: HostOpt = None,
    ct: CtOpt = None,
    grace: Annotated[Optional[float], typer.Option(
        "--grace", min=0, max=SECONDS_MAX, show_default=False,
        help=f"Seconds between SIGTERM and SIGKILL [default: {STOP_GRACE_S:g}, enough for the trainer to write a "
             "checkpoint of an 8B-shape drafter].")] = None,
    now: Annotated[bool, typer.Option("--now", help="SIGKILL at once, no grace: the work since the last "
                                                    "checkpoint is lost.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Stop a run: SIGTERM every process of it, wait up to --grace seconds, SIGKILL what is left.

    On SIGTERM the trainer trains on to its next log step (`log.every`), writes a checkpoint there and exits 143:
    the run then reads `stopped at step N`, and `dflash-ops resume RUN_ID` (with the same --host/--ct; the line
    after the stop names it) continues it as the same run. --now skips that: SIGKILL at once.

    A run's processes are those carrying its marker (DFLASH_OPS_RUN_ID) in their environment, wherever their
    process group or session, and also when the run's directory is gone; a reused pid is never hit. Stopping a
    run with nothing left is a no-op (exit 0).

    A multi-node run: every node at once, each reported (the run is marked stopped on every node before any is
    signalled); exit 0 when every node answered, 3 when no node had the run, else the first failed node's code.
    """
    from dflash_ops.cli import render
    from dflash_ops.errors import RunNotFound
    from dflash_ops.multinode import state, watch
    from dflash_ops.runs import lifecycle

    with rendered_errors(json_out):
        from dflash_ops.errors import UsageError

        if now and grace is not None:
            raise UsageError("--now kills at once: not with --grace")
        grace_s = STOP_GRACE_S if grace is None else grace
        loc, session, status = locate(ctx, run, host, ct)
        if session is None:
            results = watch.stop(loc, grace_s=grace_s, now=now)
            render.nodes_stopped(loc.run_id, results, json_out=json_out)
            none_there = all(r.how == "not_there" for r in results)
            raise typer.Exit(RunNotFound.exit_code if none_there else state.exit_code(results))
        try:
            result = lifecycle.stop(session, status, grace_s=grace_s, now=now)
            render.stopped(status.run_id, result.how, result.status, json_out=json_out,
                           target_args=session.target.cli_args)
        finally:
            session.transport.close()
