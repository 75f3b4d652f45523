"""`dflash-ops runs [RUN]`: the runs of a host/container with state, start and duration; or one run, a row per node."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dflash_ops.cli._common import RUN_HELP, CtOpt, HostOpt, JsonOpt, locate, open_session, rendered_errors

PruneOpt = Annotated[bool, typer.Option("--prune", help="Remove finished runs' directories (a dry run that lists "
                                                        "them, unless --yes). Never a live run.")]
KeepOpt = Annotated[Optional[int], typer.Option("--keep", min=0, max=10**9, show_default=False,
                                                help="With --prune: keep the newest N finished runs [default: 0].")]
OlderOpt = Annotated[Optional[float], typer.Option(
    "--older-than", min=0, max=100000, metavar="DAYS", show_default=False,
    help="With --prune: only runs that ended more than DAYS days ago.")]
LimitOpt = Annotated[int, typer.Option("--limit", min=0, max=10**9, metavar="N",
                                        help="List the live runs and the newest N others; the older ones are "
                                             "counted on stderr.")]
AllOpt = Annotated[bool, typer.Option("--all", help="List every run (reads every run dir: slow with thousands).")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="With --prune: remove them (else only list them).")]


def runs(ctx: typer.Context,
         run: Annotated[Optional[str], typer.Argument(help=RUN_HELP)] = None,
         host: HostOpt = None, ct: CtOpt = None, json_out: JsonOpt = False, prune: PruneOpt = False,
         keep: KeepOpt = None, older_than: OlderOpt = None, yes: YesOpt = False, limit: LimitOpt = 50,
         all_runs: AllOpt = False) -> None:
    """List runs (the live ones and the newest --limit others, or --all): run id (its name first), state
    (running, exited N, stopped at step N, killed, lost), pid, start, duration; sized
    to the terminal (80 columns piped), a run's values wrapped, never cut, when the table does not fit.

    With RUN: that run, a row per node (a multi-node run: every node, read at once, and the run's state); exit 0
    when every node answered, else the first failed node's code.
    """
    from dflash_ops.cli import render
    from dflash_ops.multinode import state, watch
    from dflash_ops.runs import lifecycle

    with rendered_errors(json_out):
        from dflash_ops.errors import UsageError

        if not prune and (keep is not None or older_than is not None or yes):
            raise UsageError("--keep, --older-than and --yes go with --prune")
        if prune and run is not None:
            raise UsageError("--prune removes finished runs of --host/--ct: not with RUN")
        if prune:
            _prune(ctx, host, ct, keep=keep or 0, older_than=older_than, yes=yes, json_out=json_out)
            return
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
            listed, older = (lifecycle.list_runs(session), 0) if all_runs else lifecycle.list_newest(session, limit)
            render.runs_table(listed, target=session.target.label, json_out=json_out, where=session.target.cli_args)
        finally:
            session.transport.close()
        if older:
            render.info(f"and {older} older run(s) not listed: --all lists them, `dflash-ops runs --prune` removes "
                        "finished ones")


def _prune(ctx: typer.Context, host, ct, *, keep: int, older_than: float | None, yes: bool, json_out: bool) -> None:
    import json
    import time

    from dflash_ops.cli import render
    from dflash_ops.runs import lifecycle, prune

    session = open_session(ctx, host, ct)
    try:
        gone = prune.select(lifecycle.list_runs(session), keep=keep, older_than_days=older_than, now=time.time())
        ids = [r.run_id for r in gone]
        done = lifecycle.prune(session, ids) if yes and ids else prune.Pruned((), ())
    finally:
        session.transport.close()
    label, where = session.target.label, session.target.cli_args
    if json_out:
        render.out(json.dumps({"target": label, "dry_run": not yes, "runs": ids, "removed": list(done.removed),
                               "spared": list(done.spared)}))
        return
    if not yes:
        for rid in ids:
            render.out(rid)
        render.info(f"{len(ids)} finished run(s) on {label} would be removed: "
                    f"`dflash-ops runs --prune --yes {where}` removes them" if ids else f"nothing to prune on {label}")
        return
    for rid in done.removed:
        render.out(f"removed {rid}")
    for rid in done.spared:
        render.info(f"kept {rid}: it is alive")
    render.info(f"removed {len(done.removed)} finished run(s) on {label}")
