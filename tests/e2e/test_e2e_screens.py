"""What a person reads around a launch, over real SSH into emulated containers: the `started ...` line comes only
once the job has started (never for a refused or unreachable launch), and every hint that names a follow-up
command names the target's --host/--ct, so pasting it acts on the same container."""
from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest

from support.sshd import free_port

from e2e_bed import LineReader, wait_for

pytestmark = pytest.mark.ssh
CONTAINERS = 2


def lines_of(stderr: bytes) -> list[str]:
    return stderr.decode().splitlines()


def test_a_launch_says_started_once_with_its_pid_then_proves_it_alive(bed):
    ctid = bed.ct(0)
    done = bed.cli("launch", "job", *bed.target(ctid), "--name", "said", "--json", "--", "--lines", "1")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    [line] = [ln for ln in lines_of(done.stderr) if doc["run_id"] in ln]
    assert line == (f"started {doc['run_id']} on {bed.tb.host}/ct{ctid} (pid {doc['pid']}); proving it alive: "
                    "wait 0.2 s, then /job started/ in the log (up to 20 s)")


def test_a_refused_launch_says_nothing_of_a_run_and_its_hint_names_the_target(bed):
    ctid = bed.ct(0)
    first = bed.launch(ctid, "--gate", str(bed.gate("refused")), name="refused")
    dup = bed.cli("launch", "job", *bed.target(ctid), "--name", "refused")
    assert dup.returncode == 5, dup.stderr
    target = f"--host {bed.tb.host} --ct {ctid}"
    assert lines_of(dup.stderr) == [
        f"error: run {first['run_id']} of that name is alive on {bed.tb.host}/ct{ctid}",
        f"hint: stop it (`dflash-ops stop {first['run_id']} {target}`) or pass --force, or choose another --name"]
    assert [p.name for p in bed.run_dirs(ctid, "refused")] == [first["run_id"]]
    bed.gate("refused").touch()


def test_an_unreachable_launch_says_nothing_was_started_and_names_the_target(bed):
    ctid = bed.ct(0)
    inv = bed.inventory_with("closed-screens", port=free_port())
    done = bed.cli("launch", "job", *bed.target(ctid), "--name", "nowhere", inventory=inv)
    assert done.returncode == 69, done.stderr
    [error, hint] = lines_of(done.stderr)
    assert error.startswith("error: cannot connect to ")
    assert hint == (f"hint: check that {bed.tb.host} is up and accepts SSH, then retry with "
                    f"--host {bed.tb.host} --ct {ctid}")
    assert bed.run_dirs(ctid, "nowhere") == []
    runs = bed.cli("runs", *bed.target(ctid), inventory=inv)
    assert runs.returncode == 69 and lines_of(runs.stderr)[1] == hint


def test_a_connection_lost_after_the_start_says_the_run_goes_on_and_how_to_follow_it(bed):
    """sshd restarts during the liveness wait (after `started`): exit 69, and the hint is the tail command."""
    ctid, gate = bed.ct(1), bed.gate("dropped")
    proc = subprocess.Popen(bed.argv("launch", "job", *bed.target(ctid), "--name", "dropped", "--wait", "30",
                                     "--", "--gate", str(gate)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=bed.env(), cwd=bed.work)
    try:
        errs = LineReader(SimpleNamespace(stdout=proc.stderr))
        wait_for(lambda: any((d / "pid").exists() for d in bed.run_dirs(ctid, "dropped")), "the job to start")
        [run_dir] = bed.run_dirs(ctid, "dropped")
        pid = (run_dir / "pid").read_text().strip()
        errs.until(f"started {run_dir.name} on {bed.tb.host}/ct{ctid} (pid {pid}); proving it alive: wait 30 s, "
                   "then /job started/ in the log (up to 20 s)\n".encode())
        bed.tb.sshd.restart()
        assert proc.wait(timeout=60) == 69
        err = errs.rest().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert f"hint: {run_dir.name} started (pid {pid}) and goes on: " \
           f"`dflash-ops tail {run_dir.name} --host {bed.tb.host} --ct {ctid}`" in err.splitlines(), err
    assert [r["state"] for r in bed.runs(ctid) if r["run_id"] == run_dir.name] == ["running"]
    gate.touch()
