"""`probe_script` run by real bash (and through `pct exec` into an emulated container, as the CLI's one SSH string):
a run directory whose path holds spaces, quotes, `$(...)`, backquotes, globs, `;`, `&`, `|`, backslashes, tabs and
non-ASCII text probes exactly that directory -- its state line, its log -- and runs none of it. Each odd path has a
decoy directory where a broken quoting would land (the path cut at its first odd character, or a glob's match)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dflash_ops import wire
from dflash_ops.runs import parse
from dflash_ops.runs.read_scripts import probe_script
from dflash_ops.runs.shellcmd import target_argv
from dflash_ops.ssh.common import command_string
from dflash_ops.spec import Container, Host, Target

RUN_ID = "odd-20260101T000000-abcd"
ODD_ROOTS = [
    "runs with spaces",
    "runs 'single' \"double\"",
    "runs $(touch CANARY_SUBST)",
    "runs `touch CANARY_BACKQUOTE`",
    "runs; touch CANARY_SEMI && echo x | cat &",
    "runs * ? [ab]",
    "runs \\ back\\slash \\n",
    "runs\ttab",
    "runs $HOME ${PATH} $((1+1)) !! ~x",
    "-runs-leading-dash",
    "runs é ü 中",
]


def lay_out(root: Path, odd: str) -> tuple[str, bytes]:
    """The odd run directory with a pid file and a log of its own, and decoys; -> (its path, its log)."""
    run = root / odd / RUN_ID
    run.mkdir(parents=True)
    log = f"the log of {odd!r}\n".encode()
    (run / "output.log").write_bytes(log)
    (run / "exit_code").write_text("7\n")
    cut = min((odd.index(c) for c in " ;$`*\\\t" if c in odd), default=len(odd))
    for decoy in {odd[:cut] or "decoy", "runs", "runsa", "runsb"}:
        d = root / decoy / RUN_ID
        if not d.exists():
            d.mkdir(parents=True)
            (d / "output.log").write_bytes(b"DECOY\n")
            (d / "exit_code").write_text("9\n")
    return str(run), log


def canaries(root: Path) -> list[str]:
    return [p.name for p in root.rglob("CANARY*")]


def check(stdout: bytes, log: bytes) -> None:
    got = parse.probe(stdout)
    assert got.raw is not None, stdout
    assert got.raw.run_id == RUN_ID and got.raw.exit_code == 7 and got.raw.log_size == len(log), stdout
    assert got.log_tail == log and b"DECOY" not in stdout
    head = stdout.partition(wire.LOG.encode() + b"\n")[0]
    assert [line.split(b" ")[0] for line in head.splitlines()] == [wire.NOW.encode(), wire.STATE.encode()], stdout


@pytest.mark.parametrize("odd", ODD_ROOTS)
def test_probe_script_probes_an_odd_run_dir_and_runs_nothing_of_it(tmp_path, odd):
    root = tmp_path / "work"
    run, log = lay_out(root, odd)
    done = subprocess.run(["bash", "-c", probe_script(run)], capture_output=True, cwd=root,
                          env={**os.environ, "HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stderr
    check(done.stdout, log)
    assert canaries(tmp_path) == []


@pytest.mark.parametrize("odd", ["odd dir $(touch CANARY) 'q'", "a*b; c"])
def test_a_home_relative_odd_run_dir_is_under_home_and_nowhere_else(tmp_path, odd):
    home = tmp_path / "home"
    run, log = lay_out(home, odd)
    lay_out(tmp_path / "work", odd)  # the same path relative to the working directory: a decoy too
    (Path(run) / "output.log").write_bytes(log)
    relative = "~/" + str(Path(run).relative_to(home))
    done = subprocess.run(["bash", "-c", probe_script(relative)], capture_output=True, cwd=tmp_path / "work",
                          env={**os.environ, "HOME": str(home)})
    assert done.returncode == 0, done.stderr
    check(done.stdout, log)
    assert canaries(tmp_path) == []


def test_a_missing_odd_run_dir_is_missing_not_a_neighbour(tmp_path):
    root = tmp_path / "work"
    lay_out(root, "runs")  # "runs/<id>" exists; "runs $(x)/<id>" does not
    done = subprocess.run(["bash", "-c", probe_script(str(root / "runs $(touch CANARY)" / RUN_ID))],
                          capture_output=True, cwd=root)
    assert done.returncode == wire.EXIT_MISSING and wire.MISSING.encode() in done.stdout.split(b"\n")
    assert b"DECOY" not in done.stdout and canaries(tmp_path) == []


@pytest.mark.ssh
def test_probe_script_through_pct_exec_in_a_container_probes_the_odd_run_dir(tmp_path, container):
    """The CLI's own layers: target_argv (pct exec ... env -i ... bash -c SCRIPT), joined into the one string the
    remote login shell parses (command_string), here parsed by a local bash."""
    root = tmp_path / "work"
    odd = "runs 'q' \"dq\" $(touch CANARY) `touch CANARY2`; *"
    run, log = lay_out(root, odd)
    target = Target(host=Host(name="h", pct=str(container.pct)), container=Container(ctid=str(container.ctid)))
    line = command_string(target_argv(target, probe_script(run)))
    done = subprocess.run(["bash", "-c", line], capture_output=True, cwd=root, timeout=60)
    assert done.returncode == 0, done.stderr
    check(done.stdout, log)
    assert canaries(tmp_path) == []
