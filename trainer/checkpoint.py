"""Checkpoints: full training state under `<run_dir>/ckpt/step_N/`, written atomically (temp dir + os.replace): a
process killed mid-save (a second SIGTERM, trainer/signals.py) leaves only a `step_N.tmp` that nothing reads.

Contents: drafter.pt (state_dict), optimizer.pt, rng.pt (torch CPU/CUDA, python random), trainer.json (step, micro-batch
cursor). The data order and anchors are pure functions of (seed, micro-batch cursor), so the cursor restores them.

torch is imported by the functions that need it: the CLI lists and reads checkpoints before torch is loaded.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import ConfigError

if TYPE_CHECKING:
    import torch

_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Cursor:
    step: int  # optimizer steps done
    micro: int  # micro-batches consumed (per rank)
    world: int = 1  # data-parallel ranks that consumed them (the cursor means nothing under another world size)


def cursor_of(trainer_json: str | bytes) -> Cursor:
    """A checkpoint's trainer.json -> its Cursor (`world` is absent from checkpoints older than data parallelism).
    Raises ValueError / KeyError / TypeError on a file cut short or not the trainer's."""
    meta = json.loads(trainer_json)
    return Cursor(step=meta["step"], micro=meta["micro"], world=meta.get("world", 1))


def ckpt_root(run_dir: Path) -> Path:
    return run_dir / "ckpt"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first (temp dirs are ignored: a crash mid-save leaves the previous one intact)."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and _complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def _rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        # one state per GPU visible at the save; a resume that sees fewer (another container, a rank 0 on a smaller
        # node) sets those it has (set_rng_state_all would index past them)
        saved = state["cuda"]
        for index in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[index], index)


def save(run_dir: Path, cursor: Cursor, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
         keep: int, config: dict | None = None) -> Path:
    """Write step_N atomically. `config`: the run's config.json, copied in, so that a checkpoint copied out of its
    run directory (`dflash-ops pull --what ckpt`) still says what it was trained with."""
    import torch

    root = ckpt_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{cursor.step}"
    if _holds(final, cursor):  # the same position saved already (a stop at a checkpoint step): the same state
        return final
    tmp = root / f"step_{cursor.step}.tmp"
    for stale in (*root.glob("step_*.tmp"), *root.glob("step_*.old"), *root.glob("step_*.gone")):  # cut short by a kill
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    torch.save(drafter.state_dict(), tmp / "drafter.pt")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "trainer.json").write_text(json.dumps({"step": cursor.step, "micro": cursor.micro, "world": cursor.world}))
    names = CKPT_FILES
    if config is not None:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        names += (CONFIG_FILE,)
    # on disk before the rename makes it the newest: after a power loss the newest is whole, or not there
    for path in (*(tmp / n for n in names), tmp):
        _fsync(path)
    # Re-saving a step: the old copy is moved aside, not deleted, until the new one is in place (a process killed
    # between the renames leaves the checkpoints before it, never a torn one).
    old = root / f"step_{cursor.step}.old"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(root)
    shutil.rmtree(old, ignore_errors=True)
    for _step, old in list_checkpoints(run_dir)[:-keep]:
        _remove(old)
    return final


def _complete(step_dir: Path) -> bool:
    """`step_dir` holds every checkpoint file (a delete or copy cut short leaves some out)."""
    return all((step_dir / name).is_file() for name in CKPT_FILES)


def _holds(step_dir: Path, cursor: Cursor) -> bool:
    """`step_dir` is a complete checkpoint of exactly `cursor`: re-saving it would only open a moment with no copy."""
    if not _complete(step_dir):
        return False
    try:
        return cursor_of((step_dir / "trainer.json").read_text()) == cursor
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return False


def _remove(step_dir: Path) -> None:
    """Delete a checkpoint so that no moment shows it torn: renamed out of the step_N namespace first (one atomic
    step), then deleted; a kill mid-delete leaves a step_N.gone that the next save sweeps."""
    gone = step_dir.with_name(step_dir.name + ".gone")
    os.replace(step_dir, gone)
    shutil.rmtree(gone, ignore_errors=True)


CKPT_FILES = ("drafter.pt", "optimizer.pt", "rng.pt", "trainer.json")
CONFIG_FILE = "config.json"  # the run's, in each step_N (not in CKPT_FILES: checkpoints made before it have none)


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def newest_cursor(run_dir: Path) -> Cursor | None:
    """The newest complete checkpoint's cursor (its trainer.json alone), None when there is none."""
    found = list_checkpoints(run_dir)
    if not found:
        return None
    try:
        return cursor_of((found[-1][1] / "trainer.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume: {found[-1][1] / 'trainer.json'} cannot be read ({type(e).__name__})",
                          hint="move that step_N directory out of ckpt/ to resume from the one before it") from None


def newest_step(run_dir: Path) -> int:
    """The newest complete checkpoint's step, -1 when there is none."""
    found = list_checkpoints(run_dir)
    return found[-1][0] if found else -1


def read_latest(run_dir: Path) -> dict[str, bytes]:
    """The newest complete checkpoint's files as bytes (what `restore` takes; what a rank without the checkpoint
    receives from one that has it); raise ConfigError when there is none."""
    found = list_checkpoints(run_dir)
    if not found:
        raise ConfigError(f"--resume: no complete checkpoint under {ckpt_root(run_dir)}",
                          hint="start without --resume, or point --run-dir at the run to continue")
    return {name: (found[-1][1] / name).read_bytes() for name in CKPT_FILES}


def read_latest_any_rank(run_dir: Path) -> dict[str, bytes]:
    """`read_latest`, collective under torchrun: the files of the newest checkpoint any rank holds. When every rank
    holds it (one node, or a shared filesystem) each reads its own disk; otherwise (another node's run dir, no shared
    filesystem) the lowest rank that has it reads it once and sends the bytes to all. Every rank raises the same
    ConfigError when no rank has one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return read_latest(run_dir)
    steps: list = [None] * dist.get_world_size()
    dist.all_gather_object(steps, newest_step(run_dir))
    best = max(steps)
    if best < 0:
        raise ConfigError(f"--resume: no rank holds a complete checkpoint (looked under {ckpt_root(run_dir)} on "
                          f"every node)", hint="start without --resume, or point --run-dir at the run to continue")
    if all(s == best for s in steps):
        return read_latest(run_dir)  # one node, or a shared filesystem: nothing to send
    src = steps.index(best)
    box = [read_latest(run_dir) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)  # SYNC: once, at resume; every rank now holds the files
    return box[0]


def restore(files: dict[str, bytes], drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
            lr_: torch.Tensor) -> Cursor:
    """Load a checkpoint's files (`read_latest`) into the drafter, optimizer and RNGs in place -> its cursor."""
    import io

    import torch

    device = next(drafter.parameters()).device
    name = "trainer.json"
    try:  # a file cut short (a disk that filled, a copy that stopped) fails here: one line, not a traceback
        cursor = cursor_of(files[name])
        name = "drafter.pt"
        drafter_state = torch.load(io.BytesIO(files[name]), map_location=device)
        name = "optimizer.pt"
        optimizer_state = torch.load(io.BytesIO(files[name]), map_location=device)
        name = "rng.pt"
        rng_state = torch.load(io.BytesIO(files[name]), weights_only=False)
    except READ_ERRORS as e:
        raise unreadable(name, e, "--resume", "resume") from None
    drafter.load_state_dict(drafter_state)
    optimizer.load_state_dict(optimizer_state)
    for group in optimizer.param_groups:
        group["lr"] = lr_  # keep the one device LR tensor the schedule fills (load_state_dict rebinds it)
    _set_rng_state(rng_state)
    return cursor


# What torch.load and json raise on a file cut short or not a checkpoint's.
READ_ERRORS = (EOFError, OSError, RuntimeError, ValueError, KeyError, TypeError, pickle.UnpicklingError)


def unreadable(name: str, e: BaseException, command: str, verb: str) -> ConfigError:
    """The one line for a newest checkpoint whose file `name` cannot be read, and how to get past it."""
    return ConfigError(f"{command}: the newest checkpoint's {name} cannot be read ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:160] if str(e) else 'no detail'})",
                       hint=f"move that step_N directory out of ckpt/ to {verb} from the one before it")


def load_drafter(step_dir: Path) -> dict:
    """A checkpoint's drafter weights (CPU), or one ConfigError (`unreadable`) for a file cut short: the export's."""
    import torch

    try:
        return torch.load(Path(step_dir) / "drafter.pt", map_location="cpu")
    except READ_ERRORS as e:
        raise unreadable("drafter.pt", e, "export", "export") from None


def load_latest(run_dir: Path, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
                lr_: torch.Tensor) -> Cursor:
    """Restore the newest complete checkpoint in place; raise ConfigError when there is none."""
    return restore(read_latest(run_dir), drafter, optimizer, lr_)
