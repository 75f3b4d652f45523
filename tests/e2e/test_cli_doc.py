"""docs/cli.md documents every command the CLI has, and every option of each (read from the CLI itself)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main

from dflash_ops.cli import app

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
COMMANDS = typer.main.get_command(app).commands
SHARED = {"--host", "-H", "--ct", "--json", "--help", "-h"}   # documented once, under "Options shared by ..."


def section(name: str) -> str:
    """The text of the `## \\`NAME ...\\`` section of docs/cli.md (up to the next `## `)."""
    text = DOC.read_text()
    m = re.search(rf"^## `{re.escape(name)}\b.*?$(.*?)(?=^## )", text, flags=re.M | re.S)
    assert m, f"docs/cli.md has no section for `{name}`"
    return m.group(1)


def test_the_commands_are_the_documented_ones():
    documented = set(re.findall(r"^## `([a-z-]+)", DOC.read_text(), flags=re.M))
    assert documented == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_of_a_command_is_documented_in_its_section(name):
    text = section(name)
    flags = {opt for p in COMMANDS[name].params if p.param_type_name == "option" for opt in p.opts + p.secondary_opts}
    missing = sorted(f for f in flags - SHARED if not re.search(rf"`[^`]*{re.escape(f)}\b", text))
    assert missing == [], f"docs/cli.md section `{name}` does not mention {missing}"


def test_tail_exit_status_is_documented_as_it_behaves(tmp_path, monkeypatch):
    """`tail --no-follow` of an ended run exits with the run's verdict (4 for a failure), in the code, in
    `tail --help` and in docs/cli.md (which once said `--no-follow` always exits 0)."""
    import json
    import os
    import subprocess
    import sys

    repo = DOC.parents[1]
    books = tmp_path / "runbooks"
    books.mkdir()
    (books / "fails.yaml").write_text('command: ["sh", "-c", "echo started; exit 3"]\n'
                                      'liveness: {wait_s: 0, pattern: "started", timeout_s: 20}\n')
    env = {**os.environ, "PYTHONPATH": str(repo), "XDG_STATE_HOME": str(tmp_path / "state")}

    def ops(*args):
        return subprocess.run([sys.executable, "-m", "dflash_ops", "--runbooks", str(books), *args],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)

    launched = ops("launch", "fails", "--json")
    run_id = json.loads(launched.stdout)["run_id"] if launched.returncode == 0 else None
    if run_id is None:   # it may already have failed during its liveness check: that is exit 4 too
        assert launched.returncode == 4, launched.stderr
    done = ops("tail", "fails", "--no-follow")
    assert (done.returncode, done.stdout) == (4, "started\n"), done.stderr
    text = " ".join(section("tail").split())
    assert "with and without `--follow`: the run's verdict once it has ended (0 if it exited 0, else 4" in text
    assert "`--no-follow` on a run that is still running exits 0" in text
    assert "else 4); --no-follow on a run still running: 0" in " ".join(ops("tail", "--help").stdout.split())
