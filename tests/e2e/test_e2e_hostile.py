"""Hostile run names and arguments through the CLI, SSH, `pct exec` and three shell parses: every argument and
environment value arrives byte-exact, nothing in them is ever executed, and invalid names are refused up front."""
from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from e2e_bed import hostile_values, wait_for
from support import procfs

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


def _spawn(ct, *argv: str, user: int | None = None) -> int:
    """Start `argv` detached inside `ct` (as uid/gid `user` if given); its host pid."""
    if user is not None:
        argv = ("setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv)
    done = ct.pct_exec("bash", "-c", 'setsid "$@" >/dev/null 2>&1 </dev/null & echo "$!"', "spawn", *argv)
    assert done.returncode == 0, done.stderr
    host = ct.host_pid(int(done.stdout.strip()))
    assert host is not None and procfs.is_alive(host)
    return host


def test_stop_signals_only_this_users_processes_that_carry_the_marker_exactly(bed):
    """Any process in the container can put what it likes in its environment: a value with a newline that, read
    line by line, names another process as the run's (`x\n/proc/<victim>/environ:DFLASH_OPS_RUN_ID=<run id>`), or
    the run's exact marker under another uid. `stop` signals neither the named process nor the other user's."""
    ct = bed.container(0)
    doc = bed.launch(ct.ctid, "--gate", str(bed.gate("forged-marker")), name="forged")
    rid = doc["run_id"]
    runs_dir = bed.tb.runs_dirs[ct.ctid]
    victim = _spawn(ct, "sleep", "300")
    strangers = [
        _spawn(ct, "env", f"DFLASH_OPS_RUN_ID=x\n/proc/{ct.container_pid(victim)}/environ:DFLASH_OPS_RUN_ID={rid}",
               "sleep", "300"),
        _spawn(ct, "env", f"DFLASH_OPS_RUN_ID={rid}", f"DFLASH_OPS_RUN_DIR={runs_dir}/{rid}", "sleep", "300",
               user=65534)]
    try:
        job = ct.host_pid(doc["pid"])
        done = bed.cli("stop", rid, *bed.target(ct.ctid), "--now")
        assert done.returncode == 0, done.stderr
        wait_for(lambda: not procfs.is_alive(job), "the run's own job to be killed")
        assert procfs.is_alive(victim), "stop killed a process named by a forged environment entry"
        assert all(procfs.is_alive(p) for p in strangers), "stop killed another user's process"
        [run] = [r for r in bed.runs(ct.ctid) if r["run_id"] == rid]
        assert run["state"] == "killed" and run["procs"] == 0, run
    finally:
        for p in [victim, *strangers]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_run_dir_name_cannot_forge_a_line_of_runs_or_status(bed):
    """Anyone who can write the runs dir can name a directory as they like: one whose name holds a newline and
    lines of the listing protocol (a fake run "running, pid 1") is not a run, and `runs` and `status` show none."""
    ct = bed.container(0)
    fake = "fake-20260101T000000-abcd"
    forged = bed.tb.runs_dirs[ct.ctid] / (f"a\nDFLASH_RUN {fake} 1 1 - 0 - 0\nDFLASH_JSON {{}}\n"
                                          "b-20260101T000000-abcd")
    forged.mkdir()
    try:
        runs = bed.runs(ct.ctid)
        assert fake not in [r["run_id"] for r in runs], runs
        done = bed.cli("status", "--host", bed.tb.host, "--json")
        assert fake.encode() not in done.stdout, done.stdout
        assert b"outside its protocol" not in done.stdout + done.stderr
    finally:
        forged.rmdir()
