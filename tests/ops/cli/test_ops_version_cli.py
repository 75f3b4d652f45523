"""`dflash-ops --version`: the installed distribution's version, from its package metadata, exit 0."""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_version_prints_the_package_metadata_version_and_exits_0():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "dflash_ops", "--version"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"dflash-ops {version('dflash-ops')}\n"
    assert done.stderr == ""


def test_version_runs_before_any_command_and_is_listed_in_help():
    from typer.testing import CliRunner

    from dflash_ops.cli import app

    done = CliRunner().invoke(app, ["--version", "launch", "no-such-runbook"])   # eager: the command never runs
    assert done.exit_code == 0 and done.output.startswith("dflash-ops "), done.output
    assert "--version" in CliRunner().invoke(app, ["--help"]).output
