"""Hostile run names and arguments through the CLI, SSH, `pct exec` and three shell parses: every argument and
environment value arrives byte-exact, nothing in them is ever executed, and invalid names are refused up front."""
from __future__ import annotations

import json
import sys

import pytest

from e2e_bed import hostile_values, wait_for

pytestmark = pytest.mark.ssh
CONTAINERS = 1


def test_hostile_arguments_and_env_round_trip_byte_exact_and_execute_nothing(bed):
    ctid, nasty = bed.ct(0), hostile_values(bed.canary)
    argv_file, env_file = bed.file("hostile-argv"), bed.file("hostile-env")
    job_args = ["--argv", str(argv_file), "--env", str(env_file), "--echo", *nasty]
    doc = bed.launch(ctid, *job_args, name="hostile", real=True)
    run_dir = bed.tb.runs_dirs[ctid] / doc["run_id"]
    wait_for((run_dir / "exit_code").exists, "the hostile run to end")

    assert argv_file.read_bytes() == b"\0".join(a.encode() for a in job_args)
    assert env_file.read_bytes() == "".join(nasty).encode()
    tail = bed.proc("tail", doc["run_id"], *bed.target(ctid), "-n", "1000")
    assert tail.returncode == 0, tail.stderr
    assert tail.stdout == b"job started\n" + b"".join(a.encode() + b"\n" for a in nasty)
    [run] = [r for r in bed.runs(ctid) if r["run_id"] == doc["run_id"]]
    assert run["argv"] == [sys.executable, str(bed.job), *job_args]   # read back from run.json over SSH
    assert json.loads((run_dir / "run.json").read_bytes())["argv"] == run["argv"]
    assert not bed.canary.exists()


@pytest.mark.parametrize("flag", ["--name", "tail"])
def test_hostile_run_names_are_refused_and_create_nothing(bed, flag):
    ctid, c = bed.ct(0), bed.canary
    before = bed.run_dirs(ctid)
    for name in [f"x;touch {c}", f"$(touch {c})", f"`touch {c}`", "a b", "new\nline", "\u4e2d", "'q'", "../up",
                 "-rf", "", "a" * 65, f"ok\ntouch {c}"]:
        if flag == "--name":
            done = bed.cli("launch", "job", *bed.target(ctid), "--name", name)
        else:
            done = bed.cli("tail", *bed.target(ctid), "--no-follow", "--", name)
        assert done.returncode == 2, (name, done.stderr)
        assert done.stderr.startswith(b"error: invalid run name "), done.stderr
    assert bed.run_dirs(ctid) == before
    assert not c.exists()


def test_hostile_container_ids_and_hosts_are_refused(bed):
    c = bed.canary
    for ct in [f"300;touch {c}", f"$(touch {c})", "0", "-1", "300 301", "３００"]:
        done = bed.cli("runs", "--host", bed.tb.host, "--ct", ct)
        assert done.returncode == 2 and done.stderr.startswith(b"error: invalid container id"), (ct, done.stderr)
    for host in [f"127.0.0.1;touch {c}", f"$(touch {c})", "-oProxyCommand=touch", "a b"]:
        done = bed.cli("runs", "--host", host, "--ct", "300")
        assert done.returncode == 2 and done.stderr.startswith(b"error: unknown host"), (host, done.stderr)
    assert not c.exists()
