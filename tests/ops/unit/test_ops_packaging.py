"""What `pip install dflash-ops` (not editable) installs: the CLI finds its bundled runbooks, and their trainer,
from any directory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def tracked_copy(dest: Path) -> Path:
    """The checkout's tracked files (links kept as links), as a clone has them: setuptools builds in the source
    tree, which must not gain a build/ directory from a test."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        src, dst = REPO / name, dest / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        elif src.is_file():
            shutil.copy2(src, dst)
    return dest


@pytest.mark.slow
def test_a_wheel_install_ships_the_runbooks_and_the_trainers_recipes(tmp_path):
    # setuptools is a dev dependency: the wheel builds offline, as pip builds it for a user
    source = tracked_copy(tmp_path / "src")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=600,
                           cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("dflash_ops-*.whl")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_OPS_RUNBOOKS", "PYTHONPATH")}
    env |= {"PYTHONPATH": str(site), "HOME": str(tmp_path)}
    probe = ("import dflash_ops, trainer.config as c, sys; print(dflash_ops.__file__); "
             "print(c.load_config('gpu').step.mode)")
    where = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=elsewhere,
                           timeout=120)
    assert where.returncode == 0, where.stderr
    assert where.stdout.splitlines()[0].startswith(str(site)), where.stdout  # the installed copy, not this checkout
    assert where.stdout.splitlines()[1] == "compile+graph"                   # the recipes travel with the trainer
    dry = subprocess.run([sys.executable, "-m", "dflash_ops", "launch", "graphwarm", "--host", "local", "--dry-run",
                          "--json"], capture_output=True, text=True, env=env, cwd=elsewhere, timeout=120)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    command = json.loads(dry.stdout)["argv"]
    assert command[1:5] == ["-m", "trainer", "train", "--recipe"], command
