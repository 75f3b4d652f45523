"""Every runtime dependency pyproject.toml declares for the operator is imported by it (a declared, unused one is
installed on every operator's machine for nothing; Fabric was one: docs/cli.md says why it is not used)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MODULE = {"pyyaml": "yaml"}    # distribution name -> the module it installs, where they differ


def test_every_declared_dependency_is_imported_by_dflash_ops():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in deps]
    source = "\n".join(p.read_text() for p in (REPO / "dflash_ops").rglob("*.py"))
    unused = [n for n in names if not re.search(rf"^\s*(import|from) {MODULE.get(n, n)}\b", source, flags=re.M)]
    assert unused == [], f"declared in pyproject.toml, imported nowhere in dflash_ops: {unused}"
