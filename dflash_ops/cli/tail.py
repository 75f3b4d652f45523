"""`dflash-ops tail [RUN]`: show a run's log; follow it until the run ends, across dropped connections."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from dflash_ops.cli._common import CtOpt, HostOpt, NodeOpt, locate, rendered_errors
from dflash_ops.wire import METRICS_PREFIX


def tail(
    ctx: typer.Context,
    run: Annotated[Optional[str], typer.Argument(help="Run id or run name [default: the latest run].")] = None,
    host: HostOpt = None,
    ct: CtOpt = None,
    lines: Annotated[int, typer.Option("-n", "--lines", min=0, max=10**9, help="Start with the last N lines.")] = 20,
    follow: Annotated[bool, typer.Option("--follow/--no-follow", help="Keep following until the run ends.")] = True,
    raw: Annotated[bool, typer.Option("--raw", help=f"The log's exact bytes, machine lines ({METRICS_PREFIX}...) "
                                                     "included.")] = False,
    node: NodeOpt = None,
) -> None:
    """Print a run's log and follow it until the run ends.

    Shows the human lines: the trainer's machine lines (DFLASH_METRICS, DFLASH_EVAL) are hidden and DFLASH_DONE
    is said in words; --raw prints the exact bytes. Following ends by itself when the run ends; it survives
    dropped connections. Ctrl-C stops tailing only (exit 130); the run goes on.

    A multi-node run: rank 0's log, or that of --node.

    Exit, with or without --follow: once the run has ended, its verdict (0 if it exited 0, else 4);
    --no-follow on a run still running: 0.
    """
    from dflash_ops import logview
    from dflash_ops.cli import render
    from dflash_ops.runs import follow as following
    from dflash_ops.runs import lifecycle

    with rendered_errors():
        loc, session, status = locate(ctx, run, host, ct)
        try:
            rank = loc.pick(node)
            if session is None:
                session = lifecycle.Session.of(loc.targets[rank])
                status = lifecycle.find_run(session, loc.run_id)
                render.info(f"node {rank} of {loc.run_id} ({loc.targets[rank].label}):")
            start = following.tail_start(session, status, lines, follow=follow,
                                         hidden_ere=None if raw else logview.HIDDEN_ERE)
            follow_run(session, status, start=start, keep_following=follow, raw=raw)
        finally:
            if session is not None:
                session.transport.close()


def show_line(line: bytes, *, raw: bool = False) -> None:
    """One log line on stdout: its human view (logview), or the bytes as they are with `raw`."""
    from dflash_ops import logview

    shown = line if raw else logview.human_line(line)
    if shown is not None:
        sys.stdout.buffer.write(shown)
        sys.stdout.buffer.flush()


def follow_run(session, status, *, start: int, keep_following: bool = True, raw: bool = False) -> None:
    """Stream the log to stdout (its human view unless `raw`); exits the program with the run's verdict when
    following ends."""
    from dflash_ops.cli import render
    from dflash_ops.runs import follow

    try:
        final = follow.follow(session, status, start=start, emit=lambda line: show_line(line, raw=raw),
                              keep_following=keep_following,
                              notify=render.info)
    except KeyboardInterrupt:
        render.info(f"stopped tailing; run {status.run_id} goes on")
        raise typer.Exit(130) from None
    if not keep_following and final.state == "running":
        return
    render.info(f"run {final.run_id} {final.state_text}")
    if final.state != "exited" or final.exit_code != 0:
        raise typer.Exit(4)
