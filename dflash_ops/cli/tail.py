"""`dflash-ops tail [RUN]`: show a run's log; follow it until the run ends, across dropped connections."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from dflash_ops.cli._common import CtOpt, HostOpt, open_session, rendered_errors


def tail(
    ctx: typer.Context,
    run: Annotated[Optional[str], typer.Argument(help="Run id or run name [default: the latest run].")] = None,
    host: HostOpt = None,
    ct: CtOpt = None,
    lines: Annotated[int, typer.Option("-n", "--lines", min=0, help="Start with the last N lines.")] = 20,
    follow: Annotated[bool, typer.Option("--follow/--no-follow", help="Keep following until the run ends.")] = True,
) -> None:
    """Print a run's log and follow it until the run ends.

    Following ends by itself when the run ends (exit 0 if it exited 0, else 4); it survives dropped connections.
    Ctrl-C stops tailing only (exit 130); the run goes on.
    """
    from dflash_ops.runs import lifecycle

    with rendered_errors():
        session = open_session(ctx, host, ct)
        try:
            status = lifecycle.find_run(session, run)
            start = lifecycle.tail_start(session, status, lines, follow=follow)
            follow_run(session, status, start=start, keep_following=follow)
        finally:
            session.transport.close()


def follow_run(session, status, *, start: int, keep_following: bool = True) -> None:
    """Stream the log to stdout; exits the program with the run's verdict when following ends."""
    from dflash_ops.cli import render
    from dflash_ops.runs import lifecycle

    out = sys.stdout.buffer

    def emit(line: bytes) -> None:
        out.write(line)
        out.flush()

    try:
        final = lifecycle.follow(session, status, start=start, emit=emit, keep_following=keep_following,
                                 notify=render.info)
    except KeyboardInterrupt:
        render.info(f"stopped tailing; run {status.run_id} goes on")
        raise typer.Exit(130) from None
    if not keep_following and final.state == "running":
        return
    render.info(f"run {final.run_id} {final.state_text}")
    if final.state != "exited" or final.exit_code != 0:
        raise typer.Exit(4)
