"""The wire protocol (dflash_ops/wire.py) is the one home of every DFLASH_ tag, exit code and job variable that
passes between the trainer, the remote scripts and the CLI, and the trainer can import it for nothing."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# DFLASH_OPS_* settings of the CLI itself (the user's environment and the tests'), not passed to anyone
CLI_SETTINGS = {"DFLASH_OPS_INVENTORY", "DFLASH_OPS_RUNBOOKS", "DFLASH_OPS_NVIDIA_SMI", "DFLASH_OPS_NVIDIA_DEV_GLOB",
                "DFLASH_OPS_SSH_SYSTEM_CONFIG"}


def _code_strings(path: Path) -> list[str]:
    """Every string literal of `path`'s code (f-string pieces included), docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_importing_the_wire_module_loads_nothing_but_the_standard_library():
    code = ("import sys; before = set(sys.modules); import dflash_ops.wire; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    loaded = {m for m in done.stdout.split() if m.split(".")[0] not in sys.stdlib_module_names}
    assert loaded == {"dflash_ops", "dflash_ops.wire"}, done.stdout


def test_every_dflash_tag_is_spelled_in_the_wire_module_alone():
    spelled = {}
    for package in ("dflash_ops", "trainer"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "dflash_ops" / "wire.py":
                continue
            found = [s for s in _code_strings(path) if "DFLASH_" in s and s.strip() not in CLI_SETTINGS]
            if found:
                spelled[str(path.relative_to(REPO))] = found
    assert spelled == {}


def test_the_script_exit_codes_are_the_cli_s_own_for_the_same_outcome():
    from dflash_ops import errors, wire

    assert (wire.EXIT_MISSING, wire.EXIT_REFUSED) == (errors.RunNotFound.exit_code, errors.Refused.exit_code)
    assert wire.EXIT_FAILED == errors.RemoteFailed.exit_code


def test_a_trainer_hint_under_launch_reads_as_the_launch_is_typed():
    from dflash_ops.wire import launch_hint

    launched = {"DFLASH_OPS_RUN_ID": "smoke-20260101T000000-abcd"}
    assert launch_hint("e.g. --set model.target=/models/Qwen3-8B", launched) == \
        "e.g. -- --set model.target=/models/Qwen3-8B"
    assert launch_hint("name them with --set 'data.paths=[...]'; or --set device=cpu", launched) == \
        "name them with -- --set 'data.paths=[...]'; or -- --set device=cpu"
    assert launch_hint("resume with the same --set values; -- --set a=1", launched) == \
        "resume with the same --set values; -- --set a=1"          # no key=value: no argument to rewrite
    assert launch_hint("e.g. --set model.target=/m", {}) == "e.g. --set model.target=/m"      # not launched
