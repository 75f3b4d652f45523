"""What a stopped run prints to be continued: the resume command of its DFLASH_STOPPED record and human line
(train.py). Pure: no torch, no disk."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from dflash_ops.wire import MARKER_VAR


def resume_command(run_dir: Path, world: int = 1, nodes: int = 1, python: str = sys.executable) -> str:
    """The command that continues a run from its newest checkpoint, for a person to paste anywhere (shlex-quoted):
    the interpreter that ran it and the run directory as absolute paths. A data-parallel run resumes with as many
    ranks as it had (its data cursor counts per-rank micro-batches)."""
    train = ["-m", "trainer", "train", "--run-dir", str(Path(run_dir).absolute()), "--resume"]
    if world == 1:
        return shlex.join([python, *train])
    if nodes == 1:
        return shlex.join([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                           *train])
    return f"on each of the {nodes} nodes, the job's torchrun command with {shlex.join(train)}"


def resume_fields(run_dir: Path, world: int = 1, nodes: int = 1, environ=os.environ,
                  python: str = sys.executable) -> dict:
    """The DFLASH_STOPPED record's resume fields. Under `dflash-ops launch` (the job's marker, wire.MARKER_VAR, names
    its run), a one-node run resumes as the same tracked run: `resume` is `dflash-ops resume <run id>` (run where it
    was launched from, with its --host/--ct, which this process cannot know) and `resume_in_place` the trainer's
    own command (`resume_command`), which would continue it untracked. Otherwise `resume` is that command alone."""
    here = resume_command(run_dir, world, nodes, python)
    run_id = environ.get(MARKER_VAR)
    if not run_id or nodes > 1:   # dflash-ops resume takes one-node runs
        return {"resume": here}
    return {"resume": shlex.join(["dflash-ops", "resume", run_id]), "resume_in_place": here}
