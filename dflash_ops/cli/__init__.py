"""Root Typer app: global options, then one module per command (launch, resume, tail, stop, runs, trust-host,
status, gpu-reset, pull)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dflash_ops.cli import gpu_reset, launch, pull, resume, runs, status, stop, tail, trust
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


def _print_version(on: bool) -> None:
    """`--version`: the installed distribution's version (package metadata), exit 0."""
    if not on:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("dflash-ops")
    except PackageNotFoundError:  # a bare checkout on PYTHONPATH, never installed
        found = "unknown (not installed)"
    typer.echo(f"dflash-ops {found}")
    raise typer.Exit(0)


@app.callback()
def root(
    ctx: typer.Context,
    inventory: Annotated[Optional[Path], typer.Option(
        "--inventory", "-i", envvar="DFLASH_OPS_INVENTORY",
        help="Inventory YAML [default: ./inventory.yaml, then ~/.config/dflash-ops/inventory.yaml].")] = None,
    runbooks: Annotated[Optional[Path], typer.Option(
        "--runbooks", envvar="DFLASH_OPS_RUNBOOKS",
        help="Directory of runbook YAML files [default: ./runbooks, then the bundled ones].")] = None,
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, expose_value=False, callback=_print_version,
        help="Print 'dflash-ops <version>' and exit.")] = False,
) -> None:
    """Every value that reaches a remote shell is quoted; host keys are checked against known_hosts."""
    ctx.obj = Settings(inventory=inventory, runbooks=runbooks)


app.command("launch")(launch.launch)
app.command("resume")(resume.resume)
app.command("tail")(tail.tail)
app.command("stop")(stop.stop)
app.command("runs")(runs.runs)
app.command("trust-host")(trust.trust_host)
app.command("status")(status.status)
app.command("gpu-reset")(gpu_reset.gpu_reset)
app.command("pull")(pull.pull)


# The shell's code for a writer killed by SIGPIPE (128 + 13): what `cat`, `grep` or `tail` exit with under `| head`.
EXIT_READER_GONE = 141


def main() -> None:
    import sys

    if "--json" in sys.argv[1:]:
        _usage_errors_as_json()
    pipe = _stdout_pipe()
    try:
        app()
    except SystemExit as done:
        # A write to stdout after its reader went away (`tail RUN | head`) ends the command with exit 1, by click's
        # rule or Rich's. That is no failure of the command, and the run goes on: say so with the pipe's own code,
        # as the coreutils do. Any other exit 1 (a GPU still held, a remote failure) stays 1.
        if done.code == 1 and pipe is not None and _broke_on(pipe):
            raise SystemExit(EXIT_READER_GONE) from None
        raise


def _stdout_pipe() -> tuple[int, int] | None:
    """(device, inode) of stdout when it is a pipe, else None."""
    import os
    import stat

    try:
        st = os.fstat(1)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISFIFO(st.st_mode) else None


def _broke_on(pipe: tuple[int, int]) -> bool:
    """A write to the stdout pipe failed with EPIPE: click then wraps sys.stdout in its PacifyFlushWrapper (typer
    vendors click, so by name), and Rich's Console points fd 1 at /dev/null."""
    import os
    import sys

    if type(sys.stdout).__name__ == "PacifyFlushWrapper":
        return True
    try:
        st = os.fstat(1)
    except OSError:
        return True
    return (st.st_dev, st.st_ino) != pipe


# The patched names: typer's copy of click (recent typer vendors it as typer._click), and click itself (older typer
# imports it). tests/ops/unit/test_ops_usage_json.py fails when the one typer uses stops being what this assumes.
USAGE_ERROR_MODULES = ("typer._click.exceptions", "click.exceptions")


def _usage_errors_as_json() -> None:
    """With --json, the command line's own usage errors (an unknown option, --wait -1) keep their exit code 2 but
    print as the JSON error document on stdout, as every other error does. They are click's UsageError: typer's
    copy of click where it vendors one, click's own otherwise.

    Why a patch of `UsageError.show`: Typer offers no public way to print these errors otherwise. In standalone
    mode its `core._main` catches the ClickException, calls `e.show()` (rich_markup_mode only picks rich or plain
    text) and exits with `e.exit_code`; `app(standalone_mode=False)` would hand the exception to us, but typer does
    not export UsageError, and we would have to repeat click's standalone handling of Abort, Exit, EOF, Ctrl-C and
    a broken pipe. Replacing `show` alone keeps all of that, and happens only in a `--json` process."""
    import importlib

    from dflash_ops.cli import render
    from dflash_ops.errors import UsageError

    def show(self, file=None) -> None:
        hint = f"{self.ctx.command_path} --help" if self.ctx is not None else None
        render.error(UsageError(self.format_message(), hint=hint), json_out=True)

    for module in USAGE_ERROR_MODULES:
        try:
            importlib.import_module(module).UsageError.show = show
        except ImportError:
            continue
