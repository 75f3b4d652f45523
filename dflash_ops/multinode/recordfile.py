"""The records of the multi-node runs launched from this machine: `local_state_dir()/nodes/<run id>.json`.

A launch writes its run's record here before any node starts (and removes it when the launch is rolled back), as
well as into every node's run.json, so `stop RUN_ID` works from the run id alone on the launching machine and with
the `--host/--ct` of any one of its nodes elsewhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_ops import names, noderecord
from dflash_ops.errors import ConfigError, OpsError
from dflash_ops.noderecord import NodeRun
from dflash_ops.spec import local_state_dir


def path(run_id: str) -> Path:
    return local_state_dir() / "nodes" / f"{names.run_id(run_id)}.json"


def save(run: NodeRun) -> None:
    where = path(run.run_id)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        part = where.with_name(where.name + ".tmp")
        part.write_text(json.dumps(run.as_dict()) + "\n")
        os.replace(part, where)
    except OSError as exc:
        raise OpsError(f"cannot write the record of {run.run_id} to {where}: {exc.strerror or exc}") from None


def forget(run_id: str) -> None:
    try:
        path(run_id).unlink(missing_ok=True)
    except OSError:
        pass      # a record left behind names a run no node has: `stop` says so


def load(run_id: str) -> NodeRun | None:
    """The record of a multi-node run launched from this machine; None when there is none."""
    where = path(run_id)
    try:
        text = where.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OpsError(f"cannot read {where}: {exc.strerror or exc}") from None
    try:
        run = noderecord.from_dict(json.loads(text))
    except json.JSONDecodeError:
        run = None
    if run is None or run.run_id != run_id:
        raise ConfigError(f"{where}: not a valid multi-node run record", hint="remove it, or restore it")
    return run
