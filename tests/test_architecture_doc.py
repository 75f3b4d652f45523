"""docs/architecture.md names every module of `trainer/` and `dflash_ops/`: a module added without its line on the
page fails here.

A module is named by its path under its package (`model/drafter.py`, `cli/launch.py`) in its package's section of
the page (`## The trainer`, `## The operator CLI`), by its full path (`trainer/model/drafter.py`) anywhere on it, or
by its file name on its folder's row of the section's picture (a line starting `cli/`, and the indented lines that
continue it); a package's `__init__.py` by its directory (`model/`, `trainer/`)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DOC = REPO_ROOT / "docs" / "architecture.md"
SECTIONS = {"trainer": "## The trainer", "dflash_ops": "## The operator CLI"}


def section(text: str, heading: str) -> str:
    """The page from `heading` to the next `## ` heading."""
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def modules(package: str, root: Path = REPO_ROOT) -> list[str]:
    """Every module of `package`, as its path under the package ('model/drafter.py', '__init__.py')."""
    base = root / package
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*.py") if "__pycache__" not in p.parts)


def spelling(package: str, rel: str) -> str:
    """What names the module: its path, or for an `__init__.py` its directory (with a trailing slash)."""
    return rel[: -len("__init__.py")] or f"{package}/" if rel.endswith("__init__.py") else rel


def folder_rows(text: str) -> dict[str, str]:
    """A picture's folder rows: a line that starts with `dir/` and the indented lines that continue it."""
    rows: dict[str, str] = {}
    folder = None
    for line in text.splitlines():
        if line[:1].strip():
            first = line.split(maxsplit=1)[0]
            folder = first if first.endswith("/") else None
            if folder:
                rows[folder] = rows.get(folder, "")
        if folder:
            rows[folder] += line + "\n"
    return rows


def named(text: str, package: str, rel: str) -> bool:
    """`rel` named in its package's section (not as the tail of a longer path), `package/rel` anywhere, or a
    folder's module by its file name on its folder's row of the section's picture (`cli/   ... render.py`)."""
    name = spelling(package, rel)
    full = name if name == f"{package}/" else f"{package}/{name}"
    pattern = r"(?<![\w./-]){}(?![\w-])"
    if re.search(pattern.format(re.escape(full)), text):
        return True
    part = section(text, SECTIONS[package])
    if re.search(pattern.format(re.escape(name)), part):
        return True
    folder, _, base = name.rpartition("/")
    row = folder_rows(part).get(folder + "/", "") if folder and base else ""
    return bool(re.search(pattern.format(re.escape(base)), row))


def unnamed(text: str, package: str, root: Path = REPO_ROOT) -> list[str]:
    return [f"{package}/{rel}" for rel in modules(package, root) if not named(text, package, rel)]


@pytest.mark.parametrize("package", sorted(SECTIONS))
def test_architecture_names_every_module(package):
    missing = unnamed(DOC.read_text(), package)
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_a_module_the_page_does_not_name_is_found(tmp_path):
    """The check itself: a new module fails it; naming it in its section, or by its full path, passes; a name in
    the other package's section, or as the tail of a longer path, does not count."""
    for rel in ("trainer/__init__.py", "trainer/model/__init__.py", "trainer/model/drafter.py",
                "dflash_ops/__init__.py", "dflash_ops/wire.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    page = "## The operator CLI\n`dflash_ops/` wire.py\n## The trainer\n`trainer/`: model/ {}\n## Benchmarks\n"
    assert unnamed(page.format(""), "trainer", tmp_path) == ["trainer/model/drafter.py"]
    assert unnamed(page.format("x/model/drafter.py"), "trainer", tmp_path) == ["trainer/model/drafter.py"]
    assert unnamed(page.format("model/drafter.pyc"), "trainer", tmp_path) == ["trainer/model/drafter.py"]
    assert unnamed(page.format("model/drafter.py"), "trainer", tmp_path) == []
    assert unnamed(page.format("") + "trainer/model/drafter.py", "trainer", tmp_path) == []
    assert unnamed(page.format("").replace("wire.py", ""), "dflash_ops", tmp_path) == ["dflash_ops/wire.py"]
    assert unnamed(page.format("wire.py").replace("` wire.py", "`"), "dflash_ops", tmp_path) == ["dflash_ops/wire.py"]
    (tmp_path / "dflash_ops" / "cli").mkdir()
    (tmp_path / "dflash_ops" / "cli" / "__init__.py").write_text("")
    (tmp_path / "dflash_ops" / "cli" / "tail.py").write_text("")
    rows = "## The operator CLI\n`dflash_ops/` wire.py\n```\ncli/   the commands:\n       {}\nssh/   {}\n```\n"
    assert unnamed(rows.format("tail.py", ""), "dflash_ops", tmp_path) == []
    assert unnamed(rows.format("", "tail.py"), "dflash_ops", tmp_path) == ["dflash_ops/cli/tail.py"]
