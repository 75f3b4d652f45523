"""The run directory: what a run leaves on disk and how it is read back.

    <run_dir>/config.json    the resolved TrainCfg (written once the run is built; a resume must match it)
    <run_dir>/metrics.jsonl  one record per log interval (trainer/metrics.py)
    <run_dir>/bad_lines.txt  every malformed data line (`path:line: reason`), when there is one
    <run_dir>/ckpt/step_N/   full training state (trainer/checkpoint.py)
    <run_dir>/export/        the drafter as serving stacks load it (trainer/export.py)
    <run_dir>/tiny_target/   only with model.allow_tiny_target and an empty model.target: the tiny test target

A start that fails on its config or data creates nothing here, except bad_lines.txt, which its error names.
A fresh start (no --resume) refuses a directory holding anything but dflash-ops's launch files and bad_lines.txt.
No torch import: the CLI checks a run directory before torch is loaded.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

from dflash_ops.wire import LAUNCH_FILES
from trainer import checkpoint
from trainer.config import TrainCfg, from_dict, to_dict
from trainer.errors import ConfigError
from trainer.targetdir import check_target


def run_config_file(run_dir: Path) -> Path | None:
    """The config a run was trained with: its config.json, or, in a run directory holding only checkpoints (copied
    out of the run's: `dflash-ops pull --what ckpt`), the newest checkpoint's copy. None when neither is there."""
    path = config_path(run_dir)
    if path.is_file():
        return path
    found = checkpoint.list_checkpoints(run_dir)
    if found and (found[-1][1] / checkpoint.CONFIG_FILE).is_file():
        return found[-1][1] / checkpoint.CONFIG_FILE
    return None


def recorded_config(run_dir: Path, cfg: TrainCfg) -> dict:
    """What a checkpoint records as the run's config: the config.json the run started with (a resume may change
    only RESUME_MAY_CHANGE in memory), else this config."""
    path = run_config_file(run_dir)
    if path is not None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return to_dict(cfg)


def config_path(run_dir: Path) -> Path:
    return Path(run_dir) / "config.json"


def export_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "export"


def tiny_target_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "tiny_target"


def bad_lines_path(run_dir: Path) -> Path:
    return Path(run_dir) / "bad_lines.txt"


def with_target(cfg: TrainCfg, run_dir: Path) -> TrainCfg:
    """The empty-target rule (targetdir.check_target), then the target the run uses: model.target, or, where the tiny
    test target is allowed, <run_dir>/tiny_target (absolute). Pure."""
    check_target(cfg)
    if cfg.model.target:
        return cfg
    path = tiny_target_dir(Path(run_dir).resolve())
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, target=str(path)))


# What dflash-ops has written into a run directory when the job it launches there starts (the runbooks pass that
# directory as --run-dir): the wire protocol's LAUNCH_FILES.
OPS_LAUNCH_FILES = LAUNCH_FILES
# A start refused for bad data leaves bad_lines.txt (its error names it); the next start rewrites or removes it.
FRESH_START_KEEPS = OPS_LAUNCH_FILES | {"bad_lines.txt"}


def check_location(run_dir: Path) -> None:
    """--run-dir, or the nearest of its parents that exists, must be a directory: the run creates it (after the data
    is tokenized) with mkdir, which a file in the way fails with a traceback."""
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            if not path.is_dir():
                where = "is" if path == run_dir else f"is inside {path}, which is"
                raise ConfigError(f"--run-dir {run_dir} {where} an existing file, not a directory: choose another "
                                  "--run-dir")
            return


def check_fresh(run_dir: Path) -> None:
    """A fresh start (no --resume) takes an empty or missing directory, or a dflash-ops run directory as launched:
    anything else there (an earlier run's config.json, metrics.jsonl, export/, ckpt/, or files of the user's) would
    be overwritten, appended to or deleted by the run."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return
    try:
        found = sorted(p.name for p in run_dir.iterdir() if p.name not in FRESH_START_KEEPS)
    except OSError as e:
        raise ConfigError(f"cannot read --run-dir {run_dir}: {e.strerror}",
                          hint="use a new or empty --run-dir") from None
    if not found:
        return
    if checkpoint.list_checkpoints(run_dir):
        raise ConfigError(f"{run_dir} already holds checkpoints",
                          hint="pass --resume to continue it, or use a new or empty --run-dir")
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    raise ConfigError(f"{run_dir} is not empty ({shown}): a fresh start would overwrite what is there",
                      hint="use a new or empty --run-dir (it holds no checkpoint to --resume from)")


def check_start(cfg: TrainCfg, run_dir: Path, resume: bool, world: int = 1) -> None:
    """Before anything is built (rank 0): the run directory is one, or can be made (check_location); a fresh run
    needs one with nothing it could overwrite (check_fresh); a resume must keep the config it started with and, in one process, needs a checkpoint made by
    one process. (Under torchrun the newest checkpoint may be on another node: `checkpoint.read_latest_any_rank`
    checks it collectively.)"""
    run_dir = Path(run_dir)
    check_location(run_dir)
    if not resume:
        check_fresh(run_dir)
        return
    recorded = run_config_file(run_dir)
    if recorded is not None:
        diffs = config_diff(json.loads(recorded.read_text()), to_dict(cfg), skip=RESUME_MAY_CHANGE)
        if diffs:
            raise ConfigError(f"--resume with a different config: {', '.join(diffs)}",
                              hint="resume with the same recipe and --set values as the original run (only "
                                   f"{', '.join(RESUME_MAY_CHANGE)} may change)")
    check_same_data(cfg, run_dir)
    if world > 1:
        return
    cursor = checkpoint.newest_cursor(run_dir)
    if cursor is None:
        # the run stopped before its first checkpoint: a fresh start there would overwrite its config.json and
        # metrics.jsonl, so it is refused too (check_fresh); say how out of both
        started = recorded is not None or (run_dir / "metrics.jsonl").is_file()
        raise ConfigError(f"--resume: no complete checkpoint under {checkpoint.ckpt_root(run_dir)}"
                          + (f" (the run stopped before its first, at ckpt.every={cfg.ckpt.every} steps)"
                             if started else ""),
                          hint=f"start afresh in a new --run-dir, or remove {run_dir} first" if started else
                          "start without --resume, or point --run-dir at the run to continue")
    if cursor.world != world:
        raise ConfigError(f"--resume with {world} data-parallel rank(s); the run was checkpointed with "
                          f"{cursor.world} (its data cursor counts per-rank micro-batches)",
                          hint=f"relaunch with --nproc-per-node {cursor.world}")


def write_config(cfg: TrainCfg, run_dir: Path, resume: bool) -> None:
    """config.json and data.json (`data_record`), atomically; a resumed run keeps the ones it started with."""
    for path, record in ((config_path(run_dir), to_dict(cfg)), (data_record_path(run_dir), data_record(cfg))):
        if resume and path.is_file():
            continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)


def data_record_path(run_dir: Path) -> Path:
    return Path(run_dir) / "data.json"


def data_record(cfg: TrainCfg) -> dict:
    """The size of every data file the run reads: the data order and the schedule's length follow from the data, so
    a resume over grown or replaced files (a regenerate still appending, say) would train another run silently."""
    from trainer.data.source import resolve_path

    def size(raw: str) -> int | None:
        try:
            return resolve_path(raw).stat().st_size
        except OSError:
            return None

    return {"files": {raw: size(raw) for raw in (*cfg.data.paths, *cfg.data.eval_paths)}}


def check_same_data(cfg: TrainCfg, run_dir: Path) -> None:
    """A resume reads the data files the run started with, at the sizes they had (where data.json recorded them)."""
    path = data_record_path(run_dir)
    if not path.is_file():
        return
    try:
        was = json.loads(path.read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return
    now = data_record(cfg)["files"]
    changed = [f"{raw} ({was[raw]} -> {now[raw]} bytes)" for raw in now if raw in was and was[raw] != now[raw]]
    if changed:
        raise ConfigError(f"--resume: data changed since the run started: {', '.join(changed)}; the resumed data "
                          "order and schedule would not be the run's",
                          hint="resume with the files as they were, or start a new run on the new data")


# Settings a resume may change: how often the run logs and checkpoints, how many checkpoints it keeps, its CPU
# threads, whether it evaluates at the end. None of them changes what is trained (the data order, the schedule, the
# steps). The run's config.json keeps the values it started with.
RESUME_MAY_CHANGE = ("log.every", "ckpt.every", "ckpt.keep", "threads", "eval_at_end")


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


def config_diff(a, b, prefix: str = "", skip: tuple[str, ...] = ()) -> list[str]:
    """Pure: the leaves where a recorded config `a` and a new one `b` differ, as `key (old -> new)`, but the dotted
    keys in `skip`. A key the recorded config does not have (added to the trainer after that run started) is not a
    difference: old runs stay resumable."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a:
                continue
            out += config_diff(a.get(k), b.get(k), f"{prefix}{k}.", skip)
        return out
    key = prefix[:-1]
    return [] if a == b or key in skip else [f"{key} ({a!r} -> {b!r})"]


def load_run_config(run_dir: Path) -> TrainCfg:
    path = run_config_file(run_dir)
    if path is None:
        raise ConfigError(f"{run_dir} has no config.json", hint="point --run-dir at a trainer run directory")
    return from_dict(TrainCfg, json.loads(path.read_text()))


def require_export(run_dir: Path) -> Path:
    """The run's export directory, or one ConfigError saying how to make it."""
    path = export_dir(run_dir)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{run_dir} has no export/",
                          hint=f"run `python -m trainer export --run-dir {run_dir}` first")
    return path


def newest_checkpoint(run_dir: Path) -> Path:
    found = checkpoint.list_checkpoints(Path(run_dir))
    if not found:
        raise ConfigError(f"{run_dir} has no complete checkpoint")
    return found[-1][1]
