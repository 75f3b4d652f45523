"""`dflash-ops ... --json` replaces click's `UsageError.show` (cli/__init__.py says why Typer's public API cannot do
it). These tests pin what that patch assumes of the installed Typer and click, so an upgrade that moves or changes
it fails here rather than printing click's text where a JSON document is promised."""
from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys

import typer.core

from dflash_ops.cli import USAGE_ERROR_MODULES


def _typers_click():
    """The click typer's own command runner catches errors of: its vendored copy, else click."""
    return getattr(typer.core, "_click", None) or importlib.import_module("click")


def test_the_patched_usage_error_is_the_one_typer_raises_and_show_has_the_expected_signature():
    click = _typers_click()
    patched = []
    for module in USAGE_ERROR_MODULES:
        try:
            patched.append(importlib.import_module(module).UsageError)
        except ImportError:
            continue
    assert click.exceptions.UsageError in patched
    assert issubclass(click.exceptions.UsageError, click.exceptions.ClickException)
    assert list(inspect.signature(click.exceptions.UsageError.show).parameters) == ["self", "file"]
    # typer's runner renders a usage error by calling .show() (plain text mode) before exiting with its exit_code
    source = inspect.getsource(typer.core._main)
    assert "e.show()" in source and "sys.exit(e.exit_code)" in source


def test_a_usage_error_under_json_is_our_one_line_and_exit_code_2():
    done = subprocess.run([sys.executable, "-m", "dflash_ops", "runs", "--bogus", "--json"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1
    err = json.loads(lines[0])["error"]
    assert err["code"] == "usage" and err["exit_code"] == 2 and err["message"].startswith("No such option: --bogus")
    plain = subprocess.run([sys.executable, "-m", "dflash_ops", "runs", "--bogus"], capture_output=True, text=True,
                           timeout=60)
    assert plain.returncode == 2 and plain.stdout == "" and "No such option: --bogus" in plain.stderr
