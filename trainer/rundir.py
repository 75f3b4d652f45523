"""The run directory: what a run leaves on disk and how it is read back.

    <run_dir>/config.json    the resolved TrainCfg (written at start; a resume must match it)
    <run_dir>/metrics.jsonl  one record per log interval (trainer/metrics.py)
    <run_dir>/ckpt/step_N/   full training state (trainer/checkpoint.py)
    <run_dir>/export/        the drafter as serving stacks load it (trainer/export.py)
    <run_dir>/tiny_target/   only when model.target is empty: the tiny test target built for the run
"""
from __future__ import annotations

import json
from pathlib import Path

from trainer import checkpoint
from trainer.config import TrainCfg, from_dict, to_dict
from trainer.errors import ConfigError


def config_path(run_dir: Path) -> Path:
    return Path(run_dir) / "config.json"


def export_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "export"


def tiny_target_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "tiny_target"


def write_or_check_config(cfg: TrainCfg, run_dir: Path, resume: bool) -> None:
    """Fresh run: write config.json. Resume: refuse a config that differs from the one the run started with."""
    path = config_path(run_dir)
    current = to_dict(cfg)
    if resume and path.is_file():
        diffs = config_diff(json.loads(path.read_text()), current)
        if diffs:
            raise ConfigError(f"--resume with a different config: {', '.join(diffs)}",
                              hint="resume with the same recipe and --set values as the original run")
        return
    if not resume and checkpoint.list_checkpoints(run_dir):
        raise ConfigError(f"{run_dir} already holds checkpoints",
                          hint="pass --resume to continue it, or use a new --run-dir")
    path.write_text(json.dumps(current, indent=2) + "\n")


def config_diff(a, b, prefix: str = "") -> list[str]:
    """Pure: the leaves where two config dicts differ, as `key (old -> new)`."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += config_diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]} ({a!r} -> {b!r})"]


def load_run_config(run_dir: Path) -> TrainCfg:
    path = config_path(run_dir)
    if not path.is_file():
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
