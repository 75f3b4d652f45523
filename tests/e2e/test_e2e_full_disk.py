"""A full disk, for real: the runs dirs live on a 1 MiB tmpfs (mounted before the emulated container starts, so
the container sees it too), filled to ENOSPC. A launch that cannot write its files leaves nothing behind (no
phantom `lost` run), and a run that ends while the disk is full keeps its exit code."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from e2e_bed import JOB, REPO, wait_for

pytestmark = pytest.mark.ssh


@pytest.fixture
def small_disk(tmp_path):
    """`tmp_path/testbed` (where the `testbed` factory puts the inventory and the runs dirs) on a 1 MiB tmpfs."""
    mnt = tmp_path / "testbed"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path) -> None:
    """Write zeros to `path` until the filesystem says ENOSPC."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        with open(path.parent / "probe", "wb", buffering=0) as f:
            f.write(b"x")


def _cli(tb, runbooks, *args):
    return subprocess.run([sys.executable, "-m", "dflash_ops", "--inventory", str(tb.inventory), "--runbooks",
                           str(runbooks), *args], capture_output=True, text=True, timeout=90,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def _runbooks(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    books = tmp_path / "runbooks"
    books.mkdir()
    (books / "job.yaml").write_text(f'command: ["{{python}}", "{job}"]\nenv: {{PYTHONUNBUFFERED: "1"}}\n'
                                    'liveness: {wait_s: 0.2, pattern: "job started", timeout_s: 20}\n')
    return books


def test_a_launch_on_a_full_disk_leaves_nothing_behind_and_says_why(small_disk, testbed, tmp_path):
    tb = testbed(1)
    ctid, runs_dir = tb.containers[0].ctid, tb.runs_dirs[tb.containers[0].ctid]
    books = _runbooks(tmp_path)
    fill(small_disk / "filler")
    done = _cli(tb, books, "launch", "job", "--host", tb.host, "--ct", str(ctid), "--name", "full")
    assert done.returncode == 1, done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert error.startswith("error: launching full-") and error.endswith(
        f"on {tb.host}/ct{ctid} failed: cannot write run.json: No space left on device"), error
    assert "started" not in done.stderr
    assert sorted(p.name for p in runs_dir.iterdir()) == [".launch.lock"]          # no run dir, no run.json.tmp
    runs = _cli(tb, books, "runs", "--host", tb.host, "--ct", str(ctid), "--json")
    assert runs.returncode == 0 and runs.stdout.strip() == "[]", runs.stdout

    (small_disk / "filler").unlink()
    again = _cli(tb, books, "launch", "job", "--host", tb.host, "--ct", str(ctid), "--name", "full", "--json")
    assert again.returncode == 0, again.stderr + again.stdout  # --json: an error's account is on stdout


def test_a_run_that_ends_on_a_full_disk_keeps_its_exit_code(small_disk, testbed, tmp_path):
    tb = testbed(1)
    ctid, runs_dir = tb.containers[0].ctid, tb.runs_dirs[tb.containers[0].ctid]
    books, gate = _runbooks(tmp_path), tmp_path / "gate"          # the gate is off the small disk
    done = _cli(tb, books, "launch", "job", "--host", tb.host, "--ct", str(ctid), "--name", "ends", "--json",
                "--", "--gate", str(gate), "--rc", "3")
    assert done.returncode == 0, done.stderr
    run_dir = runs_dir / json.loads(done.stdout)["run_id"]
    fill(small_disk / "filler")
    gate.touch()
    wait_for((run_dir / "exit_code").exists, "the exit code to be written on the full disk")
    assert (run_dir / "exit_code").read_bytes() == b"3\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["exit_code", "output.log", "pid", "run.json"]
    runs = json.loads(_cli(tb, books, "runs", "--host", tb.host, "--ct", str(ctid), "--json").stdout)
    assert [(r["run_id"], r["state_text"]) for r in runs] == [(run_dir.name, "exited 3")]


def test_a_launch_that_cannot_record_its_pid_never_runs_the_job(small_disk, testbed, tmp_path):
    """The disk has room for the run dir, run.json and the reserve, but no inode for the pid file. The
    job must not run at all: a kill after it started races its forks (here a child that leaves the process group
    at once, as torchrun's ranks do), and a job that ran may have written elsewhere. Launched several times, as a
    race shows itself only sometimes."""
    tb = testbed(1)
    ctid, runs_dir = tb.containers[0].ctid, tb.runs_dirs[tb.containers[0].ctid]
    canary, children = tmp_path / "ran", tmp_path / "children"       # off the small disk
    books = tmp_path / "runbooks"
    books.mkdir()
    job = f"echo ran >> {canary}; setsid sleep 300 & echo $! >> {children}; wait"
    (books / "racer.yaml").write_text(f"command: {json.dumps(['bash', '-c', job])}\n"
                                      'liveness: {wait_s: 0.2, pattern: "never", timeout_s: 5}\n')
    (runs_dir / ".launch.lock").touch()
    st = os.statvfs(small_disk)
    used = st.f_files - st.f_ffree
    # the run dir, run.json, .exit_code.reserve; not pid.tmp
    subprocess.run(["mount", "-o", f"remount,nr_inodes={used + 3}", str(small_disk)], check=True)
    for i in range(5):
        done = _cli(tb, books, "launch", "racer", "--host", tb.host, "--ct", str(ctid), "--name", f"racer{i}")
        assert done.returncode == 1, done.stderr
        [error] = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert error.endswith("failed: cannot write the pid file: No space left on device"), error
        assert not canary.exists(), "the job ran although its launch failed"
        assert sorted(p.name for p in runs_dir.iterdir()) == [".launch.lock"]
    assert not children.exists()


def test_a_launch_with_room_for_its_files_but_not_its_log_starts_nothing(small_disk, testbed, tmp_path):
    """Room for run.json, the exit status's reserve and the pid file, and not one page more: the job could never
    write a line of its log. The launch proves the log writable before the job starts: one line saying so (the
    disk is full), exit 1, nothing left behind, and the job never ran."""
    tb = testbed(1)
    ctid, runs_dir = tb.containers[0].ctid, tb.runs_dirs[tb.containers[0].ctid]
    canary = tmp_path / "ran"                                        # off the small disk
    books = tmp_path / "runbooks"
    books.mkdir()
    job = f"echo ran >> {canary}; echo job started; sleep 300"
    (books / "quiet.yaml").write_text(f"command: {json.dumps(['bash', '-c', job])}\n"
                                      'liveness: {wait_s: 0.2, pattern: "job started", timeout_s: 5}\n')
    (runs_dir / ".launch.lock").touch()
    filler = small_disk / "filler"
    fill(filler)
    os.truncate(filler, filler.stat().st_size - 3 * os.sysconf("SC_PAGE_SIZE"))    # one page per file, none for the log
    done = _cli(tb, books, "launch", "quiet", "--host", tb.host, "--ct", str(ctid), "--name", "nolog")
    assert done.returncode == 1, done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert error.endswith(f"on {tb.host}/ct{ctid} failed: cannot write the log: No space left on device"), error
    assert not canary.exists(), "the job ran although its log cannot be written"
    assert sorted(p.name for p in runs_dir.iterdir()) == [".launch.lock"]

    os.truncate(filler, filler.stat().st_size - os.sysconf("SC_PAGE_SIZE"))       # and now one for the log
    again = _cli(tb, books, "launch", "quiet", "--host", tb.host, "--ct", str(ctid), "--name", "nolog", "--json")
    assert again.returncode == 0, again.stderr
    run = json.loads(again.stdout)
    assert (runs_dir / run["run_id"] / "output.log").read_bytes() == b"job started\n"
    assert _cli(tb, books, "stop", run["run_id"], "--host", tb.host, "--ct", str(ctid), "--now").returncode == 0
