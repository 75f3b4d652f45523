"""`dflash-ops resume RUN`: continue a run that ended, in its own run directory, under the same tracking."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dflash_ops.cli._common import CtOpt, HostOpt, JsonOpt, open_session, rendered_errors, runbooks_dir
from dflash_ops.names import SECONDS_MAX


def resume(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="The run id of a run that ended (stopped, killed, failed).")],
    host: HostOpt = None,
    ct: CtOpt = None,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Show the log as it comes: this attempt's start-up while it is proven alive, then "
                               "`tail` on.")] = False,
    wait: Annotated[Optional[float], typer.Option(
        "--wait", min=0, max=SECONDS_MAX, help="Liveness wait in seconds [default: runbook].")] = None,
    env: Annotated[Optional[list[str]], typer.Option(
        "--env", "-e", metavar="KEY=VALUE",
        help="Set a variable in the job's environment (repeatable), as `launch --env`: the run's own values of "
             "such variables are not kept, so give them again.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Continue the run RUN (its id) in its own run directory, as the same run: the runbook's command as the run
    recorded it, with `--resume` added to the trainer's `train`, detached and proven alive as `launch` does.
    `runs`, `status`, `tail` and `stop` then see it under the same id. The log is appended to, after a
    DFLASH_RESUMED line; the last attempt's run.json, pid, exit_code and stopped are kept in attempts/N/.

    Refused: a run id that is not one (exit 2), a multi-node run (2: not supported), a run not there (3), a run
    still running or one that exited 0 (5), a trainer run whose run dir holds no checkpoint (5).

    Example: dflash-ops resume graphwarm-20261130T101500-1a2b --host pve1 --ct 200
    """
    from dflash_ops import names
    from dflash_ops.cli import render
    from dflash_ops.runs import lifecycle, runbooks
    from dflash_ops.runs import resume as resume_mod

    with rendered_errors(json_out):
        from dflash_ops.errors import UsageError

        extra_env = tuple(names.env_assignment(item) for item in env or ())
        if json_out and follow:  # --json promises one document on stdout; a followed log is not one
            raise UsageError("--json and --follow do not go together: --json prints one document",
                             hint="drop --follow and run `dflash-ops tail RUN` after, or drop --json")
        resume_mod.check_run_id(run)
        session = open_session(ctx, host, ct)
        try:
            status, meta = resume_mod.resumable(session, run)
            book = runbooks.load_runbook(runbooks_dir(ctx), status.runbook or str(meta.get("runbook", "")))
            spec = runbooks.resume_spec(book, session.target, meta, run_id=run, extra_env=extra_env)
            from dflash_ops.cli.tail import follow_run, show_line

            echo = lifecycle.LogEcho(show_line) if follow else None
            done = _resume(session, spec, runbooks.trainer_run_dir(spec.argv, spec.workdir), wait, echo)
            render.resumed(done, json_out=json_out)
            if echo is not None and done.launched.status is not None:
                follow_run(session, done.launched.status, start=done.log_start + echo.shown)
        finally:
            session.transport.close()


def _resume(session, spec, checkpoints: str | None, wait_s: float | None, echo):
    """runs.resume.resume, saying what it waits for once the job has started; Ctrl-C exits 130 and leaves the run
    alone."""
    from dflash_ops.cli import render
    from dflash_ops.runs import resume as resume_mod

    try:
        return resume_mod.resume(session, spec, checkpoints=checkpoints, wait_s=wait_s, echo=echo,
                                on_started=lambda pid: render.started(spec, session.target.label, pid, wait_s))
    except KeyboardInterrupt:
        where = session.target.cli_args
        render.info(f"interrupted; if {spec.run_id} started again it goes on "
                    f"(`dflash-ops runs {where}`, `dflash-ops stop {spec.run_id} {where}`)")
        raise typer.Exit(130) from None
