"""`dflash-ops launch RUNBOOK`: start a named run detached and prove it alive."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dflash_ops.cli._common import CtOpt, HostOpt, JsonOpt, open_session, rendered_errors, runbooks_dir
from dflash_ops.names import SECONDS_MAX


def launch(
    ctx: typer.Context,
    runbook: Annotated[str, typer.Argument(help="Runbook name (runbooks/<name>.yaml).")],
    args: Annotated[Optional[list[str]], typer.Argument(help="Extra arguments after `--`, appended to the command.")] = None,
    host: HostOpt = None,
    ct: CtOpt = None,
    name: Annotated[Optional[str], typer.Option("--name", "-n", help="Run name [default: the runbook name].")] = None,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Show the log as it comes: the start-up while the run is proven alive, then `tail` "
                               "on (with --node: `tail` of rank 0 once every node is alive).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the exact remote command; run nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Stop a live run of the same name first.")] = False,
    wait: Annotated[Optional[float], typer.Option(
        "--wait", min=0, max=SECONDS_MAX, help="Liveness wait in seconds [default: runbook].")] = None,
    env: Annotated[Optional[list[str]], typer.Option(
        "--env", "-e", metavar="KEY=VALUE",
        help="Set a variable in the job's environment (repeatable; replaces the runbook's or inventory's value).")] = None,
    node: Annotated[Optional[list[str]], typer.Option(
        "--node", metavar="HOST[:CT]",
        help="A node of a multi-node run, in rank order (repeat it), or an inventory group of them; the runbook "
             "must say `nodes: true`. Not with --host/--ct.")] = None,
    rdzv_timeout: Annotated[Optional[int], typer.Option(
        "--rdzv-timeout", min=1, max=int(SECONDS_MAX), show_default=False,
        help="With --node: seconds the nodes wait for each other at the rendezvous [default: 600, torchrun's]."
    )] = None,
    json_out: JsonOpt = False,
) -> None:
    """Launch RUNBOOK detached (survives the connection closing) and prove it alive; with --node, on every node
    at once as one run (torchrun's rendezvous wired: rank 0 on the first node), or on none: a node that fails,
    nodes that do not meet at the rendezvous, or Ctrl-C stop every node.

    Example: dflash-ops launch graphwarm --host pve1 --ct 200 -- --set model.target=/models/Qwen3-8B
    --set 'data.paths=["/data/chat.jsonl"]'

    Two nodes: dflash-ops launch graphwarm-nodes --node pve1:200 --node pve2:200 -- (the same --set)
    """
    from dflash_ops import names
    from dflash_ops.cli import render
    from dflash_ops.runs import lifecycle, runbooks

    with rendered_errors(json_out):
        from dflash_ops.errors import UsageError

        extra_env = tuple(names.env_assignment(item) for item in env or ())
        if not node and rdzv_timeout is not None:
            raise UsageError("--rdzv-timeout is for a multi-node launch (--node)")
        if json_out and follow and not dry_run:  # --json promises one document on stdout; a followed log is not one
            raise UsageError("--json and --follow do not go together: --json prints one document",
                             hint="drop --follow and run `dflash-ops tail NAME` after, or drop --json")
        if node:
            if host is not None or ct is not None:
                raise UsageError("--node names every node: not with --host/--ct")
            _launch_nodes(ctx, runbook, node, name=name, args=tuple(args or ()), extra_env=extra_env,
                          rdzv_timeout=rdzv_timeout, follow=follow, dry_run=dry_run, force=force, wait=wait,
                          json_out=json_out)
            return
        session = open_session(ctx, host, ct)
        book = runbooks.load_runbook(runbooks_dir(ctx), runbook)
        spec = lifecycle.plan(session, book, name=name, extra_args=tuple(args or ()), extra_env=extra_env)
        if dry_run:
            render.dry_run(spec, lifecycle.dry_run(session, spec, wait_s=wait).command, json_out=json_out)
            return
        from dflash_ops.cli.tail import follow_run, show_line

        echo = lifecycle.LogEcho(show_line) if follow else None
        try:
            launched = _launch(session, spec, force=force, wait_s=wait, echo=echo)
            render.launched(launched, json_out=json_out)
            if echo is not None and launched.status is not None:
                follow_run(session, launched.status, start=echo.shown)
        finally:
            session.transport.close()


def _launch(session, spec, *, force: bool, wait_s: float | None, echo=None):
    """lifecycle.launch, saying what it waits for once the job has started; Ctrl-C exits 130 and leaves the run
    alone."""
    from dflash_ops.cli import render
    from dflash_ops.runs import lifecycle

    try:
        return lifecycle.launch(session, spec, force=force, wait_s=wait_s, echo=echo,
                                on_started=lambda pid: render.started(spec, session.target.label, pid, wait_s))
    except KeyboardInterrupt:
        where = session.target.cli_args
        render.info(f"interrupted; if {spec.run_id} started it goes on "
                    f"(`dflash-ops runs {where}`, `dflash-ops stop {spec.run_id} {where}`)")
        raise typer.Exit(130) from None


def _launch_nodes(ctx, runbook: str, specs: list[str], *, name, args, extra_env, rdzv_timeout: int | None,
                  follow: bool, dry_run: bool, force: bool, wait: float | None, json_out: bool) -> None:
    """The multi-node launch (multinode/plan.py plans it, multinode/launch.py launches it). Ctrl-C stops the nodes that
    started (a second one leaves them: the line names the `stop`) and exits 130."""
    from dflash_ops.cli import render
    from dflash_ops.cli._common import inventory_of
    from dflash_ops.multinode import launch as nodelaunch
    from dflash_ops import noderecord
    from dflash_ops.multinode import plan
    from dflash_ops.runs import runbooks

    book = runbooks.load_runbook(runbooks_dir(ctx), runbook)
    p = plan.plan(inventory_of(ctx), book, specs, name=name, extra_args=args, extra_env=extra_env,
                  rdzv_timeout_s=noderecord.DEFAULT_RDZV_TIMEOUT_S if rdzv_timeout is None else rdzv_timeout)
    try:
        if dry_run:
            render.nodes_dry_run(*plan.dry_run(p, wait_s=wait), p.labels, json_out=json_out)
            return
        try:
            done = nodelaunch.launch(
                p, force=force, wait_s=wait, on_waiting=render.nodes_waiting,
                on_started=lambda rank, pid: render.node_started(p.run_id, rank, p.labels[rank], pid))
        except nodelaunch.LaunchInterrupted as exc:
            render.nodes_interrupted(exc.run_id, exc.stopped)
            raise typer.Exit(130) from None
        except KeyboardInterrupt:
            render.info(f"interrupted; if a node of {p.run_id} started it may go on (`dflash-ops stop {p.run_id}`)")
            raise typer.Exit(130) from None
        render.nodes_launched(done, json_out=json_out)
        if follow:
            from dflash_ops.cli.tail import follow_run

            follow_run(p.sessions[0], done.launched[0].status, start=0)
    finally:
        p.close()
