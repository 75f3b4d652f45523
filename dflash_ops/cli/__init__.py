"""Root Typer app: global options, then one module per command (launch, tail, stop, runs, trust-host, status,
gpu-reset, pull)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dflash_ops.cli import gpu_reset, launch, pull, runs, status, stop, tail, trust
from dflash_ops.cli._common import Settings

app = typer.Typer(
    name="dflash-ops",
    help="Launch, watch and stop DFlash training runs on this machine, SSH hosts and Proxmox containers.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain click help: rich_utils costs ~150 ms of imports on every --help
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def root(
    ctx: typer.Context,
    inventory: Annotated[Optional[Path], typer.Option(
        "--inventory", "-i", envvar="DFLASH_OPS_INVENTORY",
        help="Inventory YAML [default: ./inventory.yaml, then ~/.config/dflash-ops/inventory.yaml].")] = None,
    runbooks: Annotated[Optional[Path], typer.Option(
        "--runbooks", envvar="DFLASH_OPS_RUNBOOKS",
        help="Directory of runbook YAML files [default: ./runbooks, then the bundled ones].")] = None,
) -> None:
    """Every value that reaches a remote shell is quoted; host keys are checked against known_hosts."""
    ctx.obj = Settings(inventory=inventory, runbooks=runbooks)


app.command("launch")(launch.launch)
app.command("tail")(tail.tail)
app.command("stop")(stop.stop)
app.command("runs")(runs.runs)
app.command("trust-host")(trust.trust_host)
app.command("status")(status.status)
app.command("gpu-reset")(gpu_reset.gpu_reset)
app.command("pull")(pull.pull)


def main() -> None:
    app()
