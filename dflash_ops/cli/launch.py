"""`dflash-ops launch RUNBOOK`: start a named run detached and prove it alive."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dflash_ops.cli._common import CtOpt, HostOpt, JsonOpt, open_session, rendered_errors, runbooks_dir


def launch(
    ctx: typer.Context,
    runbook: Annotated[str, typer.Argument(help="Runbook name (runbooks/<name>.yaml).")],
    args: Annotated[Optional[list[str]], typer.Argument(help="Extra arguments after `--`, appended to the command.")] = None,
    host: HostOpt = None,
    ct: CtOpt = None,
    name: Annotated[Optional[str], typer.Option("--name", "-n", help="Run name [default: the runbook name].")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Continue into `tail` once the run is alive.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the exact remote command; run nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Stop a live run of the same name first.")] = False,
    wait: Annotated[Optional[float], typer.Option("--wait", min=0, help="Liveness wait in seconds [default: runbook].")] = None,
    env: Annotated[Optional[list[str]], typer.Option(
        "--env", "-e", metavar="KEY=VALUE",
        help="Set a variable in the job's environment (repeatable; replaces the runbook's or inventory's value).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Launch RUNBOOK detached (survives the connection closing) and prove it alive.

    Example: dflash-ops launch graphwarm --host pve1 --ct 200 -- --set optim.max_steps=100
    """
    from dflash_ops import names
    from dflash_ops.cli import render
    from dflash_ops.runs import lifecycle, runbooks

    with rendered_errors(json_out):
        extra_env = tuple(names.env_assignment(item) for item in env or ())
        session = open_session(ctx, host, ct)
        book = runbooks.load_runbook(runbooks_dir(ctx), runbook)
        spec = lifecycle.plan(session, book, name=name, extra_args=tuple(args or ()), extra_env=extra_env)
        if dry_run:
            render.dry_run(spec, lifecycle.dry_run(session, spec, wait_s=wait).command, json_out=json_out)
            return
        try:
            launched = _launch(session, spec, force=force, wait_s=wait)
            render.launched(launched, json_out=json_out)
            if follow and launched.status is not None:
                from dflash_ops.cli.tail import follow_run

                follow_run(session, launched.status, start=0)
        finally:
            session.transport.close()


def _launch(session, spec, *, force: bool, wait_s: float | None):
    """lifecycle.launch, saying what it waits for once the job has started; Ctrl-C exits 130 and leaves the run
    alone."""
    from dflash_ops.cli import render
    from dflash_ops.runs import lifecycle

    try:
        return lifecycle.launch(session, spec, force=force, wait_s=wait_s,
                                on_started=lambda pid: render.started(spec, session.target.label, pid, wait_s))
    except KeyboardInterrupt:
        where = session.target.cli_args
        render.info(f"interrupted; if {spec.run_id} started it goes on "
                    f"(`dflash-ops runs {where}`, `dflash-ops stop {spec.run_id} {where}`)")
        raise typer.Exit(130) from None
