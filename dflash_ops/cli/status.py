"""`dflash-ops status`: every host and container in scope, queried in parallel; runs, metrics and GPUs."""
from __future__ import annotations

import time
from typing import Annotated, Optional

import typer

from dflash_ops.cli._common import CtOpt, HostOpt, JsonOpt, locate, rendered_errors, settings

WatchOpt = Annotated[bool, typer.Option("--watch", "-w", help="Refresh in place until Ctrl-C.")]
IntervalOpt = Annotated[float, typer.Option("--interval", min=0.2, help="Seconds between refreshes with --watch.")]
TimeoutOpt = Annotated[float, typer.Option(
    "--timeout", min=1.0, help="Give up on a host after this many seconds (it shows as unreachable).")]


def scope(ctx: typer.Context, host: str | None, ct: str | None) -> list:
    """(Host, [Target]) pairs in scope: the whole inventory by default, or --host (and --ct)."""
    from dflash_ops import hoststatus, inventory

    inv = inventory.load_inventory(settings(ctx).inventory or inventory.default_path())
    if ct is not None:
        target = inventory.resolve_target(inv, host, ct)
        return [(target.host, [target])]
    hosts = [inventory.resolve_host(inv, host, with_ct=False)] if host else list(inv.hosts)
    return [(h, hoststatus.targets_of(h)) for h in hosts]


def collect(pairs: list, timeout_s: float) -> tuple[list, float]:
    """Query every host at once; one Outcome per host, never more than `timeout_s` in total."""
    from dflash_ops import hoststatus
    from dflash_ops.fanout import fan_out

    gpu = hoststatus.GpuSettings.from_env()
    targets = {h.name: ts for h, ts in pairs}
    part = max(1, int(timeout_s) - 3)
    t0 = time.monotonic()
    outcomes = fan_out([h for h, _ in pairs],
                       lambda h: hoststatus.query_host(h, targets[h.name], gpu, part_timeout_s=part),
                       deadline_s=timeout_s, describe=lambda h: f"host {h.name}")
    for o in outcomes:
        if o.error is not None and not _is_ops_error(o.error):
            raise o.error          # a bug: keep its traceback
    return outcomes, time.monotonic() - t0


def _is_ops_error(exc: BaseException) -> bool:
    from dflash_ops.errors import OpsError

    return isinstance(exc, OpsError)


def status(ctx: typer.Context,
           run: Annotated[Optional[str], typer.Argument(
               help="A run id or name: that run alone, a row per node of a multi-node run.")] = None,
           host: HostOpt = None, ct: CtOpt = None, watch: WatchOpt = False,
           interval: IntervalOpt = 2.0, json_out: JsonOpt = False, timeout: TimeoutOpt = 15.0) -> None:
    """Runs (state, pid, uptime, exit code, latest step/loss/tokens/s/acc) and GPUs (memory, utilization,
    holders mapped to runs) of every host and container in scope. Exit 0 when every host answered, else the
    first failed host's code (69 unreachable, 77 host key/auth).

    With RUN: that run, a row per node (state, pid, uptime, GPUs; rank 0's metrics) and the run's state
    (running, exited 0, stopped, failed: the node that failed first, unknown); exit as above, per node."""
    with rendered_errors(json_out):
        if run is not None:
            loc, session, _ = locate(ctx, run, host, ct)
            if session is not None:
                session.transport.close()
            _run_status(loc, watch, interval, timeout, json_out)
            return
        pairs = scope(ctx, host, ct)
        if watch:
            _watch(pairs, interval, timeout, json_out)
            return
        outcomes, elapsed = collect(pairs, timeout)
        _print(outcomes, elapsed, json_out)
        from dflash_ops.cli.status_view import exit_code

        raise typer.Exit(exit_code(outcomes))


def _print(outcomes: list, elapsed: float, json_out: bool) -> None:
    from dflash_ops.cli import status_view

    if json_out:
        import json

        typer.echo(json.dumps(status_view.report_dict(outcomes, elapsed)))
        return
    from rich.console import Console

    # the width is the terminal's, else $COLUMNS, else 80 (a pipe); status_view wraps between values, never in one
    console = Console(soft_wrap=True)
    console.print(status_view.report_renderable(outcomes, elapsed, console.width))


def _watch(pairs: list, interval: float, timeout: float, json_out: bool) -> None:
    """Refresh in place (Rich Live) or, with --json, one JSON document per line per refresh. Ctrl-C ends it."""
    from dflash_ops.cli import status_view

    try:
        if json_out:
            while True:
                _print(*collect(pairs, timeout), json_out=True)
                time.sleep(interval)
        from rich.console import Console
        from rich.live import Live

        console = Console(soft_wrap=True)
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                live.update(status_view.report_renderable(*collect(pairs, timeout), console.width), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        return


def _run_status(loc, watch: bool, interval: float, timeout: float, json_out: bool) -> None:
    """`status RUN`: a row per node, once or (--watch) until Ctrl-C."""
    from dflash_ops import hoststatus
    from dflash_ops.cli import status_view
    from dflash_ops.runs import noderun, nodes

    gpu = hoststatus.GpuSettings.from_env()

    def report() -> tuple:
        t0 = time.monotonic()
        rows = nodes.status_rows(loc, gpu, timeout_s=timeout)
        return loc.run_id, noderun.overall([r.state for r in rows]), rows, time.monotonic() - t0

    if json_out:
        import json

        def show(args) -> None:
            typer.echo(json.dumps(status_view.node_report_dict(*args)))
    else:
        from rich.console import Console

        console = Console(soft_wrap=True)

        def show(args) -> None:
            console.print(status_view.node_report_renderable(*args, console.width))
    if not watch:
        args = report()
        show(args)
        raise typer.Exit(next((r.state.exit_code for r in args[2] if r.state.status is None), 0))
    try:
        if json_out:
            while True:
                show(report())
                time.sleep(interval)
        from rich.live import Live

        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                live.update(status_view.node_report_renderable(*report(), console.width), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        return
