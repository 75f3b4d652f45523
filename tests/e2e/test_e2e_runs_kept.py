"""No run is lost or orphaned, over real SSH into emulated containers: processes are found by the run's marker
(DFLASH_OPS_RUN_ID in their environment), not by their process group alone, so a child that called setsid, a run
that exited but left a child, and a run whose directory was deleted are all still the run's: `runs` says so, a
launch of the same name and the inductor-cache clear are refused, and `stop` ends every one of those processes.

Each test owns one container of the module's bed (ct0: setsid child, ct1: exited with a child, ct2: deleted runs
dir)."""
from __future__ import annotations

import json
import shlex
import shutil

import pytest

from support import procfs

from e2e_bed import marked_processes, wait_for

pytestmark = pytest.mark.ssh
CONTAINERS = 3


def one_run(bed, ctid: int, run_id: str) -> dict:
    [run] = [r for r in bed.runs(ctid) if r["run_id"] == run_id]
    return run


def test_stop_ends_a_child_that_left_the_process_group_with_setsid(bed):
    ctid, ct, child_file = bed.ct(0), bed.container(0), bed.file("setsid-child")
    doc = bed.launch(ctid, "--setsid-child", str(child_file), "--gate", str(bed.gate("setsid")), name="setsid")
    wait_for(child_file.exists, "the job's setsid child")
    child = ct.host_pid(int(child_file.read_text()))
    assert child is not None and procfs.is_alive(child)
    assert child in marked_processes(ct, doc["run_id"])

    stop = bed.cli("stop", "setsid", *bed.target(ctid), "--grace", "10", "--json")
    assert stop.returncode == 0, stop.stderr
    assert json.loads(stop.stdout)["status"]["state"] == "killed"
    wait_for(lambda: not procfs.is_alive(child), "the setsid child to die", timeout_s=120)
    assert marked_processes(ct, doc["run_id"]) == []


def test_a_run_that_exited_but_left_a_setsid_child_holds_its_name_until_stopped(bed):
    ctid, ct, child_file = bed.ct(0), bed.container(0), bed.file("left-child")
    doc = bed.launch(ctid, "--setsid-child", str(child_file), name="leftover")
    wait_for(lambda: (bed.tb.runs_dirs[ctid] / doc["run_id"] / "exit_code").exists(), "the job's main process to end")
    child = ct.host_pid(int(child_file.read_text()))
    assert procfs.is_alive(child)

    run = one_run(bed, ctid, doc["run_id"])
    assert (run["state_text"], run["leftovers"], run["procs"]) == ("exited 0, 1 leftover", 1, 1)
    table = bed.cli("runs", *bed.target(ctid))
    hint = f"{doc['run_id']} exited but 1 of its processes live on: `dflash-ops stop {doc['run_id']} "
    assert f"{hint}{shlex.join(bed.target(ctid))}` ends them".encode() in table.stderr, table.stderr  # pasteable
    dup = bed.cli("launch", "job", *bed.target(ctid), "--name", "leftover")
    assert dup.returncode == 5 and f"run {doc['run_id']} of that name is alive".encode() in dup.stderr
    assert [p.name for p in bed.run_dirs(ctid, "leftover")] == [doc["run_id"]]

    stop = bed.cli("stop", doc["run_id"], *bed.target(ctid), "--grace", "5")  # the hint's command
    assert stop.returncode == 0 and b"killed leftover processes" in stop.stdout, stop.stdout
    assert not procfs.is_alive(child)
    assert one_run(bed, ctid, doc["run_id"])["state_text"] == "exited 0"     # its own status is kept
    bed.launch(ctid, "--lines", "1", name="leftover")


def test_a_leftover_in_the_group_of_an_exited_run_blocks_the_cache_clear_and_the_name(bed):
    ctid, ct, child_file, cache = bed.ct(1), bed.container(1), bed.file("cache-child"), bed.cache_dir
    doc = bed.launch(ctid, "--child", str(child_file), name="cacheleft", runbook="cachejob")
    wait_for(lambda: (bed.tb.runs_dirs[ctid] / doc["run_id"] / "exit_code").exists(), "the job's main process to end")
    child = ct.host_pid(int(child_file.read_text()))
    assert procfs.is_alive(child) and one_run(bed, ctid, doc["run_id"])["state_text"] == "exited 0, 1 leftover"

    cache.mkdir(parents=True, exist_ok=True)
    (cache / "kernel.so").write_bytes(b"in use by the leftover")
    refused = bed.cli("launch", "cachejob", *bed.target(ctid), "--name", "other")
    assert refused.returncode == 5, refused.stderr
    assert f"not clearing the inductor cache: run {doc['run_id']} is alive".encode() in refused.stderr
    same = bed.cli("launch", "job", *bed.target(ctid), "--name", "cacheleft")
    assert same.returncode == 5 and f"run {doc['run_id']} of that name is alive".encode() in same.stderr
    assert (cache / "kernel.so").read_bytes() == b"in use by the leftover"
    assert bed.run_dirs(ctid, "other") == []

    assert bed.cli("stop", doc["run_id"], *bed.target(ctid), "--grace", "5").returncode == 0
    assert not procfs.is_alive(child)
    bed.launch(ctid, "--lines", "1", name="other", runbook="cachejob")
    assert not cache.exists()


def test_a_live_run_whose_runs_dir_was_deleted_is_still_listed_refused_and_stoppable(bed):
    ctid, ct, child_file = bed.ct(2), bed.container(2), bed.file("gone-child")
    doc = bed.launch(ctid, "--setsid-child", str(child_file), "--gate", str(bed.gate("never")), name="gone")
    wait_for(child_file.exists, "the job's setsid child")
    pids = marked_processes(ct, doc["run_id"])
    assert len(pids) >= 2
    shutil.rmtree(bed.tb.runs_dirs[ctid])                   # the whole runs dir, as `rm -rf ~/dflash-runs` would

    run = one_run(bed, ctid, doc["run_id"])
    assert (run["state"], run["dir_missing"], run["pid"]) == ("running", True, doc["pid"])
    assert run["state_text"] == "running (run dir gone)" and run["procs"] == len(pids)
    dup = bed.cli("launch", "job", *bed.target(ctid), "--name", "gone")
    assert dup.returncode == 5 and f"run {doc['run_id']} of that name is alive".encode() in dup.stderr
    assert not (bed.tb.runs_dirs[ctid] / doc["run_id"]).exists()

    stop = bed.cli("stop", "gone", *bed.target(ctid), "--grace", "5")
    assert stop.returncode == 0, stop.stderr
    assert all(not procfs.is_alive(p) for p in pids)
    assert [r for r in bed.runs(ctid) if r["run_id"] == doc["run_id"]] == []
    bed.launch(ctid, "--lines", "1", name="gone")
