"""`dflash-ops runs [RUN]`: the runs of a host/container with state, start and duration; or one run, a row per node."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dflash_ops.cli._common import RUN_HELP, CtOpt, HostOpt, JsonOpt, locate, open_session, rendered_errors


def runs(ctx: typer.Context,
         run: Annotated[Optional[str], typer.Argument(help=RUN_HELP)] = None,
         host: HostOpt = None, ct: CtOpt = None, json_out: JsonOpt = False) -> None:
    """List runs: run id (its name first), state (running, exited N, stopped at
    step N, killed, lost), pid, start, duration; sized
    to the terminal (80 columns piped), a run's values wrapped, never cut, when the table does not fit.

    With RUN: that run, a row per node (a multi-node run: every node, read at once, and the run's state); exit 0
    when every node answered, else the first failed node's code.
    """
    from dflash_ops.cli import render
    from dflash_ops.multinode import state, watch
    from dflash_ops.runs import lifecycle

    with rendered_errors(json_out):
        if run is not None:
            loc, session, status = locate(ctx, run, host, ct)
            if session is not None:
                session.transport.close()
                states = [state.NodeState(node=loc.nodes[0], label=loc.targets[0].label, status=status)]
            else:
                states = watch.read_states(loc)
            render.node_runs(loc.run_id, states, state.overall(states), json_out=json_out)
            raise typer.Exit(state.exit_code(states))
        session = open_session(ctx, host, ct)
        try:
            render.runs_table(lifecycle.list_runs(session), target=session.target.label, json_out=json_out,
                              where=session.target.cli_args)
        finally:
            session.transport.close()
