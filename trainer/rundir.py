"""The run directory: what a run leaves on disk and how it is read back.

    <run_dir>/config.json    the resolved TrainCfg (written once the run is built; a resume must match it)
    <run_dir>/data.json      what the run read: each data file's size, the target's fingerprint (`data_record`)
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
    """Before anything is built (rank 0): the run directory is one, or can be made (check_location), and so is the
    tracking directory (tracking.check_tracking_dir); a fresh run needs one with nothing it could overwrite
    (check_fresh); a resume must keep the config it started with, read the same target and data where they were or
    moved to (check_same_inputs) and, in one process, needs a checkpoint made by one process. (Under torchrun the
    newest checkpoint may be on another node: `checkpoint.read_latest_any_rank` checks it collectively.)"""
    from trainer.tracking import check_tracking_dir

    run_dir = Path(run_dir)
    check_location(run_dir)
    check_tracking_dir(cfg.track, run_dir, resume)
    if not resume:
        check_fresh(run_dir)
        return
    recorded = run_config_file(run_dir)
    tree = _json_object(recorded, hint="resume a run directory that this trainer wrote") if recorded else {}
    diffs = config_diff(tree, to_dict(cfg), skip=RESUME_MAY_CHANGE + RESUME_MAY_MOVE)
    if diffs:
        raise ConfigError(f"--resume with a different config: {', '.join(diffs)}", hint=RESUME_HINT)
    check_same_inputs(cfg, run_dir, tree)
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


def write_config(cfg: TrainCfg, run_dir: Path, resume: bool) -> list[str]:
    """config.json and data.json (`data_record`), atomically. A resumed run keeps the ones it started with, but where
    its target or data moved (RESUME_MAY_MOVE, checked by `check_same_inputs`): both then name the new places, so
    the next resume, eval and export find them. -> the moves, `key (old -> new)`."""
    moved: list[str] = []
    tree = to_dict(cfg)
    if resume and config_path(run_dir).is_file():
        tree, now = json.loads(config_path(run_dir).read_text()), tree
        for key in RESUME_MAY_MOVE:
            section, leaf = key.split(".")
            if tree.get(section, {}).get(leaf) != now[section][leaf]:
                moved.append(f"{key} ({tree.get(section, {}).get(leaf)!r} -> {now[section][leaf]!r})")
                tree.setdefault(section, {})[leaf] = now[section][leaf]
    for path, record in ((config_path(run_dir), tree), (data_record_path(run_dir), data_record(cfg))):
        if resume and path.is_file() and not moved:
            continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    return moved


def data_record_path(run_dir: Path) -> Path:
    return Path(run_dir) / "data.json"


def file_size(raw: str) -> int | None:
    """A data path's size in bytes (`bundled:NAME` included), None when it is not there."""
    from trainer.data.source import resolve_path

    try:
        return resolve_path(raw).stat().st_size
    except OSError:
        return None


def target_record(path: str) -> dict | None:
    """Which target a directory holds: its config.json's sha256 and its weights' fingerprint (targetdir), None where
    it has no config.json (the tiny target before it is built)."""
    import hashlib

    from trainer.targetdir import weights_fingerprint

    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return {"config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
            "weights_fingerprint": weights_fingerprint(path)}


def data_record(cfg: TrainCfg) -> dict:
    """What the run reads: the size of every data file (the data order and the schedule's length follow from the
    data, so a resume over grown or replaced files, a regenerate still appending say, would train another run
    silently) and which target it is (`target_record`), so that a resume may find both where they moved."""
    record: dict = {"files": {raw: file_size(raw) for raw in (*cfg.data.paths, *cfg.data.eval_paths)}}
    target = target_record(cfg.model.target) if cfg.model.target else None
    if target is not None:
        record["target"] = target
    return record


def check_target_there(cfg: TrainCfg, run_dir: Path) -> None:
    """A resumed run's model.target is there (or is this run's tiny target, rebuilt when missing): where it is not,
    it moved or was removed since the run started, and the resume may name where it is now."""
    target = cfg.model.target
    if not target or (Path(target) / "config.json").is_file() or \
            Path(target) == tiny_target_dir(Path(run_dir).resolve()):
        return
    raise ConfigError(f"--resume: the run's target {target} is not there (moved or removed since the run started)",
                      hint="resume with --set model.target=DIR: the same target where it is now (its config.json "
                           "and weights are checked against the run's)")


def read_data_record(run_dir: Path) -> dict:
    """The run's data.json (the target's fingerprint, each data file's size), {} where it has none."""
    try:
        record = json.loads(data_record_path(run_dir).read_text())
    except (OSError, ValueError):
        record = {}
    return record if isinstance(record, dict) else {}


def is_the_runs_target(record: dict, target: str) -> bool:
    """`target` holds what data.json fingerprinted (its config.json and weights); True where it recorded none."""
    return record.get("target") is None or target_record(target) == record["target"]


def check_same_inputs(cfg: TrainCfg, run_dir: Path, recorded: dict, what: str = "--resume") -> None:
    """A resume (or `what`: eval run) reads the target and the data files the run started with (`recorded`: its
    config.json), where they were or where they moved to (RESUME_MAY_MOVE): the target with the config.json and
    weights data.json fingerprinted, each data file, in order, at the size data.json recorded. What data.json did
    not record (a run that started before it did) is not checked, and may not move."""
    record = read_data_record(run_dir)
    files = record.get("files") if isinstance(record.get("files"), dict) else {}
    resuming = what == "--resume"  # a resume may name where files moved; eval run reads the run's config as it is
    check_target_there(cfg, run_dir)
    was, now = (recorded.get("model") or {}).get("target", cfg.model.target), cfg.model.target
    if record.get("target") is None and now != was:
        raise ConfigError(f"{what} with model.target={now}: the run started with {was} and recorded no "
                          "fingerprint of it to check another copy against", hint=f"put the target back at {was}")
    if not is_the_runs_target(record, now):
        raise ConfigError(f"{what}: the target {now} is not the one the run started with"
                          f"{f' ({was})' if now != was else ''}: its config.json or its weights differ",
                          hint="use the run's own target (another target is another run)")
    missing, changed = [], []
    for key in ("paths", "eval_paths"):
        new = list(getattr(cfg.data, key))
        old = list((recorded.get("data") or {}).get(key, new))
        if len(old) != len(new):
            raise ConfigError(f"--resume with a different config: data.{key} ({old!r} -> {new!r})", hint=RESUME_HINT)
        for raw_was, raw in zip(old, new):
            if raw_was not in files:
                if raw != raw_was:
                    raise ConfigError(f"--resume with data.{key} naming {raw} for {raw_was}: the run recorded no "
                                      f"size of {raw_was} to check it against", hint=f"put it back at {raw_was}")
                continue
            size, label = file_size(raw), raw if raw == raw_was else f"{raw} (for {raw_was})"
            if size is None:
                missing.append(f"{label}, which had {files[raw_was]} bytes")
            elif size != files[raw_was]:
                changed.append(f"{label} ({files[raw_was]} -> {size} bytes)")
    if missing:
        raise ConfigError(f"{what}: data file missing since the run started: {'; '.join(missing)}",
                          hint="if it moved, resume with --set 'data.paths=[...]' (or data.eval_paths) naming where "
                               "each file is now, in the same order: their sizes are checked against the run's"
                          if resuming else "put it back where the run read it")
    if changed:
        raise ConfigError(f"{what}: data changed since the run started: {', '.join(changed)}; the "
                          + ("resumed data order and schedule would not be the run's" if resuming else
                             "held-out split would not be the run's (rows it trained on among them)"),
                          hint="put the files back as they were" + (", or start a new run on the new data"
                                                                    if resuming else ""))


# Settings a resume may change: how often the run logs and checkpoints, how many checkpoints it keeps, its CPU
# threads, whether it evaluates at the end. None of them changes what is trained (the data order, the schedule, the
# steps). The run's config.json keeps the values it started with.
RESUME_MAY_CHANGE = ("log.every", "ckpt.every", "ckpt.keep", "threads", "eval_at_end")
# Settings a resume may point at another place: the target and the data files, moved since the run started. The
# resume checks that they are what the run read (`check_same_inputs`) and records where they are now (`write_config`).
RESUME_MAY_MOVE = ("model.target", "data.paths", "data.eval_paths")
RESUME_HINT = (f"a resume continues with the run's own config.json: drop the --set values that change it (only "
               f"{', '.join(RESUME_MAY_CHANGE)} may change, and {', '.join(RESUME_MAY_MOVE)} where the files moved)")


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


def _json_object(path: Path, hint: str) -> dict:
    """A JSON object file, or one ConfigError naming it (cut short, not UTF-8, not an object)."""
    try:
        tree = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0][:160]})",
                          hint=hint) from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path} is not a JSON object", hint=hint)
    return tree


def load_run_config(run_dir: Path) -> TrainCfg:
    """The config a run was trained with (`run_config_file`), or one ConfigError. No torch."""
    run_dir = Path(run_dir)
    path = run_config_file(run_dir)
    if path is None:
        what = "does not exist" if not Path(run_dir).exists() else "has no config.json"
        raise ConfigError(f"--run-dir {run_dir} {what}", hint="point --run-dir at a trainer run directory")
    return from_dict(TrainCfg, _json_object(path, hint="point --run-dir at a run directory this trainer wrote"))


def read_export_config(path: Path) -> dict:
    """A drafter export directory's config.json, checked with the files a load needs (config.json, a JSON object,
    and model.safetensors) -> the config.json's object, or one ConfigError. No torch: the CLI checks it first."""
    path, hint = Path(path), "point at a drafter export directory (config.json + model.safetensors)"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is a file, not a drafter export directory", hint=hint)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} has no config.json{'' if path.exists() else ' (it does not exist)'}", hint=hint)
    config = _json_object(path / "config.json", hint)
    if not (path / "model.safetensors").is_file():
        raise ConfigError(f"{path} has config.json but no model.safetensors", hint=hint)
    return config


def require_export(run_dir: Path) -> Path:
    """The run's export directory (checked: `read_export_config`), or one ConfigError saying how to make it."""
    path = export_dir(run_dir)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{run_dir} has no export/",
                          hint=f"run `python -m trainer export --run-dir {run_dir}` first")
    read_export_config(path)
    return path


def newest_checkpoint(run_dir: Path) -> Path:
    found = checkpoint.list_checkpoints(Path(run_dir))
    if not found:
        raise ConfigError(f"{run_dir} has no complete checkpoint")
    return found[-1][1]


def export_source(run_dir: Path, target: str | None = None) -> tuple[TrainCfg, Path]:
    """What `trainer export` rebuilds, checked before torch: the run's config on the CPU (`on_cpu`) with its target,
    or `target` (where it is now, if it moved: checked against the run's shape, then its config.json and weights
    against the run's data.json), and the newest checkpoint."""
    from trainer.config import on_cpu
    from trainer.targetdir import check_target_loads

    cfg = on_cpu(load_run_config(run_dir))
    if target is not None:
        check_target_loads(cfg.model, target)  # there, and of the run's shape; then the very target
        if not is_the_runs_target(read_data_record(run_dir), target):
            raise ConfigError(f"--target {target} is not the target the run trained with ({cfg.model.target}): its "
                              "config.json or its weights differ",
                              hint="pass the run's own target where it is now (a drafter serves the target it "
                                   "learned from)")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, target=target))
    elif not (Path(cfg.model.target) / "config.json").is_file():
        raise ConfigError(f"the run's target {cfg.model.target} is not there (moved or removed since the run)",
                          hint="pass --target DIR: the same target where it is now")
    else:
        check_target_loads(cfg.model, cfg.model.target)
    return cfg, newest_checkpoint(run_dir)
