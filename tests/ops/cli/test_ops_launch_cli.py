"""launch / runs / stop / tail through the CLI on the local transport: real processes, real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest



def _wait_state(env, run_id: str, want: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        run = next(r for r in env.runs_json() if r["run_id"] == run_id)
        if run["state_text"] == want or time.monotonic() > deadline:
            return run
        time.sleep(0.1)


def test_launch_proves_alive_and_records_exit_code(ops_env):
    done = ops_env.sub("launch", "job", "--json", "--", "--lines", "30", "--every", "0.1", "--rc", "3")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["state"] == "running" and out["matched_line"] == "job started"
    run_dir = Path(out["run_dir"])
    assert int((run_dir / "pid").read_text()) == out["pid"]
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["run_id"] == out["run_id"] and meta["runbook"] == "job" and meta["ct"] is None
    assert meta["argv"][-6:] == ["--lines", "30", "--every", "0.1", "--rc", "3"]
    assert isinstance(meta["started_at"], int) and meta["env_keys"] == ["PYTHONUNBUFFERED"]
    run = _wait_state(ops_env, out["run_id"], "exited 3")
    assert run["state"] == "exited" and run["exit_code"] == 3
    assert (run_dir / "exit_code").read_text() == "3\n"
    assert b"step 29" in (run_dir / "output.log").read_bytes()


def test_launch_reports_a_run_that_dies_during_the_wait(ops_env):
    # a pattern the job never prints: launch keeps probing until the job is dead, however slow this box is
    (ops_env.runbooks / "dies.yaml").write_text((ops_env.runbooks / "job.yaml").read_text().replace(
        'pattern: "job started"', 'pattern: "never printed"').replace("timeout_s: 10", "timeout_s: 60"))
    done = ops_env.sub("launch", "dies", "--", "--rc", "7")
    assert done.returncode == 4, done.stderr
    assert "exited 7" in done.stderr and "job started" in done.stderr


def test_a_job_that_dies_at_once_is_reported_as_soon_as_it_exits(ops_env):
    """The liveness wait (here 120 s) proves a job survives that long; one that has already ended is reported then,
    not after the wait."""
    (ops_env.runbooks / "brief.yaml").write_text((ops_env.runbooks / "job.yaml").read_text().replace(
        "wait_s: 0.3", "wait_s: 120"))
    t0 = time.monotonic()
    done = ops_env.sub("launch", "brief", "--", "--rc", "7", timeout=240)
    took = time.monotonic() - t0
    assert done.returncode == 4, done.stderr
    assert "exited 7 during its liveness check" in done.stderr and "job started" in done.stderr
    assert took < 60, took          # far less than the wait: it ended at once (a loaded box: a few seconds)


def test_on_this_machine_a_relative_path_after_dashes_is_the_callers(ops_env, tmp_path):
    """The job runs in the directory `launch` ran in: `--out out.json` lands there, as in the caller's shell."""
    (ops_env.root / "sub").mkdir()
    done = ops_env.sub("launch", "job", "--json", "--", "--out", "sub/out.json")
    assert done.returncode == 0, done.stderr
    ops_env.wait_for(ops_env.root / "sub" / "out.json")
    got = json.loads((ops_env.root / "sub" / "out.json").read_text())
    assert got["cwd"] == str(ops_env.root)
    run = json.loads(done.stdout)
    assert json.loads((Path(run["run_dir"]) / "run.json").read_text())["workdir"] == str(ops_env.root)
    assert not (Path(run["run_dir"]) / "sub").exists()


def test_launch_without_the_pattern_fails_with_4(ops_env):
    (ops_env.runbooks / "quiet.yaml").write_text(
        'command: ["sleep", "30"]\nliveness: {wait_s: 0.2, pattern: "never-printed", timeout_s: 0.6}\n')
    done = ops_env.sub("launch", "quiet")
    assert done.returncode == 4 and "no log line matched" in done.stderr
    assert ops_env.sub("stop", "quiet", "--grace", "1").returncode == 0


def test_duplicate_is_refused_and_force_replaces_it(ops_env):
    first = ops_env.cli("launch", "job", "--json", "--", "--hold")
    assert first.exit_code == 0, first.output
    first_id = json.loads(first.stdout)["run_id"]
    again = ops_env.cli("launch", "job", "--", "--hold")
    assert again.exit_code == 5 and first_id in again.stderr and "--force" in again.stderr
    forced = ops_env.sub("launch", "job", "--force", "--json", "--", "--hold")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["stopped_first"] == [first_id]
    states = {r["run_id"]: r["state"] for r in ops_env.runs_json()}
    assert states[first_id] == "killed" and list(states.values()).count("running") == 1
    # another name may run next to it
    assert ops_env.sub("launch", "job", "--name", "job-2", "--", "--hold").returncode == 0


def test_stop_kills_the_whole_group_child_included(ops_env, tmp_path):
    child_file = tmp_path / "child.pid"
    done = ops_env.sub("launch", "job", "--json", "--", "--child", str(child_file), "--hold")
    assert done.returncode == 0, done.stderr
    pid = json.loads(done.stdout)["pid"]
    ops_env.wait_for(child_file)
    child = int(child_file.read_text())
    assert ops_env.pid_alive(pid) and ops_env.pid_alive(child) and os.getpgid(child) == pid
    stop = ops_env.sub("stop", "job", "--grace", "2")
    assert stop.returncode == 0, stop.stderr
    assert "stopped job-" in stop.stdout
    assert not ops_env.pid_alive(pid) and not ops_env.pid_alive(child)
    run = ops_env.runs_json()[-1]
    assert run["state"] == "killed"
    again = ops_env.sub("stop", "job")  # idempotent
    assert again.returncode == 0 and "not running" in again.stdout


def test_stop_never_hits_a_reused_pid(ops_env):
    """A run record whose pid now belongs to an unrelated process (no marker): nothing is signalled."""
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its own group: pgid == pid
    try:
        run_dir = ops_env.runs_dir / "old-20260101T000000-abcd"
        run_dir.mkdir(parents=True)
        (run_dir / "pid").write_text(f"{stranger.pid}\n")
        (run_dir / "run.json").write_text(json.dumps({"run_id": run_dir.name, "name": "old", "started_at": 1}))
        assert ops_env.runs_json()[0]["state"] == "lost"
        done = ops_env.sub("stop", "old", "--grace", "0")
        assert done.returncode == 0 and "not running" in done.stdout
        time.sleep(0.2)
        assert stranger.poll() is None, "the unrelated process was signalled"
        assert not (run_dir / "stopped").exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_sigterm_lets_the_wrapper_record_the_status(ops_env):
    done = ops_env.sub("launch", "job", "--json", "--", "--hold")
    pid = json.loads(done.stdout)["pid"]
    os.killpg(pid, signal.SIGTERM)  # as someone else would (no `stopped` file)
    run = _wait_state(ops_env, json.loads(done.stdout)["run_id"], "killed (143)")
    assert run["exit_code"] == 143 and run["state"] == "killed"


def test_dry_run_runs_nothing_and_prints_the_command(ops_env):
    import shlex

    done = ops_env.sub("launch", "job", "--dry-run", "--", "--rc", "1")
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout.strip())
    assert argv[:2] == ["bash", "-c"] and "nohup setsid bash -c" in argv[2]
    assert ops_env.run_dirs() == [] and not ops_env.runs_dir.exists()


def test_dry_run_into_a_container_shows_pct_exec(ops_env):
    import shlex

    inv = ops_env.root / "inv.yaml"
    inv.write_text("hosts:\n  box:\n    transport: local\n    pct: /opt/fake/pct\n")
    done = ops_env.sub("--inventory", str(inv), "launch", "job", "--host", "box", "--ct", "200", "--dry-run")
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout.strip())
    assert argv[:8] == ["/opt/fake/pct", "exec", "200", "--", "env", "-i", "HOME=/root", argv[7]]
    assert argv[8:10] == ["bash", "-c"] and "/root/dflash-runs/job-" in argv[10]


def test_a_run_whose_child_outlives_it_is_exited_and_stop_cleans_the_leftover(ops_env, tmp_path):
    child_file = tmp_path / "child.pid"
    done = ops_env.sub("launch", "job", "--json", "--", "--child", str(child_file), "--lines", "5", "--rc", "0")
    assert done.returncode == 0, done.stderr
    run_id = json.loads(done.stdout)["run_id"]
    tail = ops_env.sub("tail", run_id)  # ends when the job's main process ends, not when its leftovers do
    assert tail.returncode == 0, tail.stderr
    child = int(child_file.read_text())
    assert ops_env.pid_alive(child)
    run = _wait_state(ops_env, run_id, "exited 0, 1 leftover")
    assert (run["state"], run["leftovers"]) == ("exited", 1)
    stop = ops_env.sub("stop", run_id, "--grace", "2")
    assert stop.returncode == 0 and "leftover" in stop.stdout
    assert not ops_env.pid_alive(child)
    assert _wait_state(ops_env, run_id, "exited 0")["state_text"] == "exited 0"  # its state is kept


def test_text_summary_and_runs_table(ops_env):
    done = ops_env.cli("launch", "job", "--", "--hold")
    assert done.exit_code == 0, done.output
    run_dir = ops_env.run_dirs()[-1]
    pid = (run_dir / "pid").read_text().strip()
    assert f"launched {run_dir.name}" in done.stdout and f"pid       {pid}" in done.stdout
    assert f"log       {run_dir}/output.log" in done.stdout and "host      local" in done.stdout
    table = ops_env.cli("runs")
    assert table.exit_code == 0
    row = next(line for line in table.stdout.splitlines() if run_dir.name in line)
    assert "running" in row and pid in row and "job" in row


def test_runs_piped_or_at_80_columns_cuts_nothing(ops_env):
    """`runs | cat` is 80 columns wide, as `status` is (not one 250-column table); a long name that leaves no room
    for the table's columns wraps its rows between values: no cell cut to `exite…`, the pid there."""
    done = ops_env.sub("launch", "job", "--name", "graphwarm-ddp-b16-lr3e-4-long-name", "--json")
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)
    _wait_state(ops_env, run["run_id"], "exited 0")
    env = {k: v for k, v in ops_env.env.items() if k != "COLUMNS"}
    piped = subprocess.run([sys.executable, "-m", "dflash_ops", "--runbooks", str(ops_env.runbooks), "runs"],
                           capture_output=True, text=True, env=env, cwd=ops_env.root, timeout=60)
    assert piped.returncode == 0, piped.stderr
    lines = piped.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in piped.stdout, piped.stdout
    assert any(line.split()[:1] == [run["run_id"]] for line in lines)
    assert f"pid {run['pid']}" in piped.stdout and "exited 0" in piped.stdout


def test_stop_waits_for_the_checkpoint_and_the_run_reads_stopped(ops_env):
    """A job that, like the trainer, takes a while after SIGTERM to write its checkpoint (12 s, well inside the 120 s
    default grace) is given that time by `stop`'s default grace, and then reads `stopped at step 7`, not failed."""
    done = ops_env.sub("launch", "job", "--json", "--", "--slow-term", "12", "--hold")
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)
    run_dir = Path(run["run_dir"])
    t0 = time.monotonic()
    stopped = ops_env.sub("stop", run["run_id"], "--json", timeout=240)
    assert stopped.returncode == 0, stopped.stderr
    assert time.monotonic() - t0 >= 12
    doc = json.loads(stopped.stdout)
    assert doc["action"] == "terminated" and doc["status"]["state"] == "stopped", doc
    assert doc["status"]["state_text"] == "stopped at step 7" and doc["status"]["stopped_step"] == 7
    assert doc["resume"] == f"dflash-ops resume {run['run_id']} --host local"     # the same run, tracked
    assert (run_dir / "ckpt" / "step_7" / "state").read_text() == "weights at step 7\n"
    assert (run_dir / "exit_code").read_text() == "143\n"
    [listed] = [r for r in ops_env.runs_json() if r["run_id"] == run["run_id"]]
    assert (listed["state"], listed["stopped_step"], listed["exit_code"]) == ("stopped", 7, 143)
    table = ops_env.sub("runs")
    assert any(line.split()[:1] == [run["run_id"]] and "stopped at step 7" in line
               for line in table.stdout.splitlines()), table.stdout
    text = ops_env.sub("stop", run["run_id"])
    assert text.stdout == f"run {run['run_id']} is not running (stopped at step 7); nothing to stop\n"
    tail = ops_env.sub("tail", run["run_id"], "--no-follow")
    assert tail.returncode == 4 and tail.stderr.splitlines()[-1] == f"run {run['run_id']} stopped at step 7"


def test_stop_now_kills_at_once_and_the_checkpoint_is_never_written(ops_env):
    done = ops_env.sub("launch", "job", "--json", "--", "--slow-term", "60", "--hold")
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)
    refused = ops_env.sub("stop", run["run_id"], "--now", "--grace", "5")
    assert refused.returncode == 2 and "--now kills at once: not with --grace" in refused.stderr
    t0 = time.monotonic()
    killed = ops_env.sub("stop", run["run_id"], "--now", timeout=120)
    assert killed.returncode == 0, killed.stderr
    assert time.monotonic() - t0 < 30            # no grace: far less than the job's 60 s "checkpoint"
    assert killed.stdout == f"stopped {run['run_id']} with SIGKILL at once (--now); state: killed\n"
    assert not (Path(run["run_dir"]) / "ckpt").exists()
    assert not ops_env.pid_alive(run["pid"])
