"""`dflash-ops pull RUN`: bring a run's export, metrics, log or newest checkpoint to this machine, checked."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from dflash_ops.cli._common import CtOpt, HostOpt, JsonOpt, open_session, rendered_errors


class What(str, enum.Enum):   # the keys of runs.manifest.WHAT (not imported here: --help imports nothing heavy)
    export = "export"
    metrics = "metrics"
    log = "log"
    ckpt = "ckpt"


def pull(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="Run id, or run name (its latest run).")],
    what: Annotated[What, typer.Option("--what", help="export (the drafter as serving stacks load it), metrics "
                                                      "(metrics.jsonl), log (output.log), ckpt (the newest "
                                                      "checkpoint).")] = What.export,
    to: Annotated[Optional[Path], typer.Option("--to", help="Local directory [default: ./RUN_ID].")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite files that are already there.")] = False,
    host: HostOpt = None,
    ct: CtOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Copy a run's files to this machine (SFTP on the connection whose host key was checked; from a container
    through `pct pull` on the Proxmox host). Every file's size and SHA-256 is checked against what the target
    computed; nothing is overwritten without --force (exit 5)."""
    from dflash_ops.cli import render
    from dflash_ops.runs import lifecycle
    from dflash_ops.runs.pull import pull_files

    with rendered_errors(json_out):
        session = open_session(ctx, host, ct)
        try:
            status = lifecycle.find_run(session, run)
            dest = to if to is not None else Path(status.run_id)
            done = pull_files(session, status, what.value, dest, force=force,
                              on_file=render.pulled_file if not json_out else lambda f, d: None)
            render.pulled(done, json_out=json_out)
        finally:
            session.transport.close()
