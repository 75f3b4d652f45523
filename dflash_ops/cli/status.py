"""`dflash-ops status`: every host and container in scope, queried in parallel; runs, metrics and GPUs."""
from __future__ import annotations

import time
from typing import Annotated, Optional

import typer

from dflash_ops.cli._common import RUN_HELP, CtOpt, HostOpt, JsonOpt, locate, rendered_errors, settings
from dflash_ops.names import SECONDS_MAX

WatchOpt = Annotated[bool, typer.Option("--watch", "-w", help="Refresh in place until Ctrl-C.")]
IntervalOpt = Annotated[float, typer.Option(
    "--interval", min=0.2, max=SECONDS_MAX, help="Seconds between refreshes with --watch.")]
TimeoutOpt = Annotated[float, typer.Option(
    "--timeout", min=1.0, max=SECONDS_MAX, help="Give up on a host after this many seconds (it shows as unreachable).")]


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
    from dflash_ops.gpus import facts

    gpu = facts.GpuSettings.from_env()
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
           run: Annotated[Optional[str], typer.Argument(help=RUN_HELP)] = None,
           host: HostOpt = None, ct: CtOpt = None, watch: WatchOpt = False,
           interval: IntervalOpt = 2.0, json_out: JsonOpt = False, timeout: TimeoutOpt = 15.0) -> None:
    """Runs (state, pid, uptime, exit code, latest step/loss/tokens/s/acc) and GPUs (memory, utilization,
    holders mapped to runs) of every host and container in scope. Exit 0 when every host and container answered,
    else the first failed host's code (69 unreachable, 77 host key/auth), else 69 (a container down).

    With RUN: that run alone, a row per node (state, pid, uptime, GPUs; rank 0's metrics) and the run's state
    (running, exited 0, stopped, failed: the node that failed first, unknown); exit as above, per node, else 4
    when the run failed."""
    from dflash_ops.cli import status_view

    with rendered_errors(json_out):
        if run is not None:
            t0 = time.monotonic()
            finder = _Finder(timeout)
            loc, session, _ = locate(ctx, run, host, ct, find=finder)
            try:
                report = _run_report(loc, timeout, reuse=session.transport if session is not None else None,
                                     known=finder.known, t0=t0)
                last = _show(report, status_view.node_report_dict, status_view.node_report_renderable,
                             watch=watch, interval=interval, json_out=json_out)
            finally:
                if session is not None:
                    session.transport.close()
            if last is not None:
                from dflash_ops.multinode import state

                raise typer.Exit(state.verdict_code(last[1], [r.state for r in last[2]]))
            return
        pairs = scope(ctx, host, ct)
        last = _show(lambda: collect(pairs, timeout), status_view.report_dict, status_view.report_renderable,
                     watch=watch, interval=interval, json_out=json_out)
        if last is not None:
            raise typer.Exit(status_view.exit_code(last[0]))


class _Finder:
    """`status RUN`'s way to find the run on its target: the target's status query (runs, metrics, GPUs), whose
    answer is kept (`known`, by host) for the first report, so that the run's host is asked once."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s, self.known = timeout_s, {}

    def __call__(self, session, ref: str | None):
        from dflash_ops import hoststatus
        from dflash_ops.errors import RemoteFailed
        from dflash_ops.gpus import facts
        from dflash_ops.multinode import watch
        from dflash_ops.runs import lifecycle

        lifecycle.check_ref(ref)
        target = session.target
        session.connect()               # an unreachable host fails here, with the hint that names --host/--ct
        hs = hoststatus.query_host(target.host, [target], facts.GpuSettings.from_env(),
                                   part_timeout_s=watch.part_timeout_s(self.timeout_s), transport=session.transport,
                                   also=ref)    # listed even when older than the finished runs shown
        (there,) = hs.targets
        if there.error is not None:
            raise RemoteFailed(f"listing runs on {there.label} failed: {there.error}",
                               hint="check the host, the container (`pct status CT`) and the runs dir")
        self.known[target.host.name] = hs
        return lifecycle.pick_run([row.status for row in there.runs], ref, target)


def _run_report(loc, timeout: float, *, reuse=None, known=None, t0: float | None = None):
    """`status RUN`'s report maker: (run id, overall state, a row per node, elapsed s). The first report uses
    what `known` holds (the query that found the run, from `t0`); later ones (--watch) ask again."""
    from dflash_ops.gpus import facts
    from dflash_ops.multinode import state, watch

    gpu = facts.GpuSettings.from_env()
    first = {"known": dict(known or {}), "t0": t0}

    def report() -> tuple:
        start = first["t0"] if first["t0"] is not None else time.monotonic()
        rows = watch.status_rows(loc, gpu, timeout_s=timeout, reuse=reuse, known=first["known"])
        first.update(known={}, t0=None)
        return loc.run_id, state.overall([r.state for r in rows]), rows, time.monotonic() - start

    return report


def _show(report, as_dict, as_renderable, *, watch: bool, interval: float, json_out: bool) -> tuple | None:
    """Print `report()` once (and return it), or with --watch refresh it until Ctrl-C (Rich Live in place; with
    --json one document per line per refresh) and return None. `as_dict(*report)` is its JSON,
    `as_renderable(*report, width)` its text, wrapped to the console's width (the terminal's, else $COLUMNS,
    else 80 for a pipe; status_view wraps between values, never inside one)."""
    import json

    from rich.console import Console

    console = Console(soft_wrap=True)

    def show(args) -> None:
        if json_out:
            typer.echo(json.dumps(as_dict(*args)))
        else:
            console.print(as_renderable(*args, console.width))

    if not watch:
        args = report()
        show(args)
        return args
    try:
        if json_out:
            while True:
                show(report())
                time.sleep(interval)
        from rich.live import Live

        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                live.update(as_renderable(*report(), console.width), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        return None
