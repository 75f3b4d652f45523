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
