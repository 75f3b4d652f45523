"""tail: byte-exact following to the end, resuming after dropped connections, Ctrl-C leaves the run alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from dflash_ops import inventory
from dflash_ops.errors import HostUnreachable
from dflash_ops.runs import follow, lifecycle
from dflash_ops.ssh import local


def _launch(env, *job_args: str) -> dict:
    done = env.sub("launch", "job", "--json", "--", *job_args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_tail_follows_to_the_end_with_every_line_once(ops_env):
    run = _launch(ops_env, "--lines", "40", "--every", "0.03", "--rc", "0")
    done = ops_env.sub("tail", run["run_id"], "-n", "1000")
    assert done.returncode == 0, done.stderr
    log = (ops_env.run_dirs()[-1] / "output.log").read_text()
    assert done.stdout == log and log.count("\n") == 41
    # the verdict counts the processes left now, not those alive when tailing began (the job, its wrapper)
    assert done.stderr.splitlines()[-1] == f"run {run['run_id']} exited 0", done.stderr


def test_tail_exit_4_when_the_run_fails_and_no_follow_returns_at_once(ops_env):
    run = _launch(ops_env, "--lines", "30", "--every", "0.1", "--rc", "9")
    done = ops_env.sub("tail", "job", "-n", "2")
    assert done.returncode == 4 and "exited 9" in done.stderr
    log = (ops_env.run_dirs()[-1] / "output.log").read_text()
    assert len(done.stdout.splitlines()) >= 2 and log.endswith(done.stdout)  # a contiguous suffix, no dup
    again = ops_env.sub("tail", "--no-follow", "-n", "1")  # latest run by default
    assert again.returncode == 4 and again.stdout == "step 29 x\n"


class FlakyTransport:
    """A real LocalTransport whose connection "drops" on every other call, half the time AFTER the command ran
    (its output is lost in flight), so follow must re-read from the same offset."""

    def __init__(self) -> None:
        self.real, self.calls, self.reconnects, self.label = local.LocalTransport(), 0, 0, "flaky"

    def run(self, argv, *, timeout_s=None):
        self.calls += 1
        if self.calls % 4 == 1:
            raise HostUnreachable("dropped before sending")
        done = self.real.run(argv, timeout_s=timeout_s)
        if self.calls % 4 == 3:
            raise HostUnreachable("dropped while reading")
        return done

    def describe(self, argv):
        return self.real.describe(argv)

    def reconnect(self) -> None:
        self.reconnects += 1

    def close(self) -> None:
        pass


def test_follow_resumes_at_the_byte_offset_across_drops(ops_env):
    run = _launch(ops_env, "--lines", "60", "--every", "0.02")
    target = inventory.resolve_target(inventory.Inventory(), None, None)
    flaky = FlakyTransport()
    s = lifecycle.Session(target=target, transport=flaky)
    status = next(r for r in lifecycle.list_runs(lifecycle.Session(target, local.LocalTransport()))
                  if r.run_id == run["run_id"])
    got: list[bytes] = []
    final = follow.follow(s, status, start=0, emit=got.append, poll_s=0.01, sleep=lambda s: time.sleep(min(s, 0.01)))
    log = (ops_env.run_dirs()[-1] / "output.log").read_bytes()
    assert b"".join(got) == log and len(got) == 61
    assert final.state == "exited" and final.exit_code == 0
    assert flaky.reconnects >= 2


def test_ctrl_c_stops_tailing_only(ops_env):
    run = _launch(ops_env, "--hold")
    # as from a terminal: SIGINT at its default even when pytest itself runs in the background (where the shell
    # sets it to SIG_IGN, and Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_ops", "tail", run["run_id"]], env=ops_env.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline() == "job started\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130
    assert f"stopped tailing; run {run['run_id']} goes on" in err
    assert ops_env.pid_alive(run["pid"])
    assert ops_env.runs_json()[-1]["state"] == "running"


class DeadTransport(FlakyTransport):
    def run(self, argv, *, timeout_s=None):
        raise HostUnreachable("host is gone")


def test_follow_gives_up_after_its_reconnect_budget(ops_env):
    import pytest

    run = _launch(ops_env, "--hold")
    target = inventory.resolve_target(inventory.Inventory(), None, None)
    status = next(r for r in lifecycle.list_runs(lifecycle.Session(target, local.LocalTransport()))
                  if r.run_id == run["run_id"])
    dead = DeadTransport()
    notes: list[str] = []
    with pytest.raises(HostUnreachable):
        follow.follow(lifecycle.Session(target, dead), status, start=0, emit=lambda line: None,
                         sleep=lambda s: None, reconnect_budget_s=0.3, notify=notes.append)
    assert dead.reconnects >= 1 and len(notes) == 1 and "resuming at byte 0" in notes[0]


def _ended(env, run_id: str) -> None:
    deadline = time.monotonic() + 300
    while next(r for r in env.runs_json() if r["run_id"] == run_id)["state"] == "running":
        assert time.monotonic() < deadline, f"{run_id} did not end"
        time.sleep(0.1)


def test_tail_is_byte_exact_when_the_log_ends_without_a_newline(ops_env):
    run = _launch(ops_env, "--lines", "3", "--every", "0.01", "--partial", "no newline at the end")
    _ended(ops_env, run["run_id"])
    log = (ops_env.run_dirs()[-1] / "output.log").read_text()
    assert log.endswith("step 2 xx\nno newline at the end")
    for mode in ("--follow", "--no-follow"):
        done = ops_env.sub("tail", run["run_id"], "-n", "1000", mode)
        assert done.returncode == 0, done.stderr
        assert done.stdout == log, mode
        last = ops_env.sub("tail", run["run_id"], "-n", "1", mode)
        assert last.stdout == "no newline at the end", mode
        # the partial last line is a line: -n 0 shows nothing of an ended run
        none = ops_env.sub("tail", run["run_id"], "-n", "0", mode)
        assert none.returncode == 0 and none.stdout == "", mode


def _session_and_status(run_id: str):
    target = inventory.resolve_target(inventory.Inventory(), None, None)
    s = lifecycle.Session(target, local.LocalTransport())
    return s, next(r for r in lifecycle.list_runs(s) if r.run_id == run_id)


def test_tail_n0_of_a_running_run_does_not_cut_the_line_being_written(ops_env, tmp_path):
    gate = tmp_path / "gate"
    run = _launch(ops_env, "--lines", "2", "--every", "0.01", "--partial", "half", "--gate", str(gate),
                  "--then", " and done\nlast\n")
    log_path = ops_env.run_dirs()[-1] / "output.log"
    deadline = time.monotonic() + 300
    while not log_path.read_bytes().endswith(b"half"):
        assert time.monotonic() < deadline, log_path.read_bytes()
        time.sleep(0.02)
    s, status = _session_and_status(run["run_id"])
    start = follow.tail_start(s, status, 0)
    assert ops_env.sub("tail", run["run_id"], "-n", "0", "--no-follow").stdout == ""
    gate.write_text("go")
    got: list[bytes] = []
    final = follow.follow(s, status, start=start, emit=got.append, poll_s=0.02)
    assert got == [b"half and done\n", b"last\n"]
    assert final.state == "exited" and final.exit_code == 0


def _human_view(log: str, run_dir: str, steps: int) -> str:
    """What a person is shown of the --metrics job's log: every line but the machine lines, DFLASH_DONE in words."""
    kept = [line for line in log.splitlines(keepends=True) if not line.startswith("DFLASH_METRICS ")]
    assert kept[-1].startswith("DFLASH_DONE ")
    return "".join(kept[:-1]) + f"done at step {steps}; export {run_dir}/export\n"


def test_tail_shows_the_human_lines_by_default_and_raw_the_exact_bytes(ops_env):
    run = _launch(ops_env, "--lines", "2", "--every", "0.01", "--metrics", "6")
    _ended(ops_env, run["run_id"])
    log = (ops_env.run_dirs()[-1] / "output.log").read_text()
    assert log.count("DFLASH_METRICS ") == 6 and log.count("\nstep 60/? loss 3.4000\n") == 1
    view = _human_view(log, run["run_dir"], 60)
    for mode in ("--follow", "--no-follow"):
        shown = ops_env.sub("tail", run["run_id"], "-n", "1000", mode)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout == view and "DFLASH_" not in shown.stdout, mode
        raw = ops_env.sub("tail", run["run_id"], "-n", "1000", "--raw", mode)
        assert raw.stdout == log, mode
        # -n counts the lines shown: the last 3 of the view, not 3 raw lines (of which 1 or 2 are hidden)
        last = ops_env.sub("tail", run["run_id"], "-n", "3", mode)
        assert last.stdout == "".join(view.splitlines(keepends=True)[-3:]), mode
        assert ops_env.sub("tail", run["run_id"], "-n", "2", "--raw", mode).stdout == \
            "".join(log.splitlines(keepends=True)[-2:]), mode


def test_the_human_view_loses_and_repeats_no_line_across_drops(ops_env, capsysbinary):
    """The CLI's default view over a connection that drops on every other call, half the time after the command
    ran: every human line once, in order."""
    from dflash_ops.cli import tail as tail_cli

    run = _launch(ops_env, "--metrics", "40", "--every", "0.1")   # 4 s: still running when followed, however loaded
    s, status = _session_and_status(run["run_id"])
    flaky = FlakyTransport()
    tail_cli.follow_run(lifecycle.Session(s.target, flaky), status, start=0)   # returns: the run exited 0
    assert flaky.reconnects >= 2
    log = (ops_env.run_dirs()[-1] / "output.log").read_text()
    assert capsysbinary.readouterr().out.decode() == _human_view(log, run["run_dir"], 400)


def test_a_reader_that_goes_away_ends_tail_with_the_pipes_code_and_the_run_goes_on(ops_env):
    """`dflash-ops tail run | head -1`: the write after the reader closed fails with EPIPE; tail exits 141 (the
    shell's code for a writer to a closed pipe) without a traceback, and the run is untouched."""
    run = _launch(ops_env, "--lines", "100000", "--every", "0.01")
    proc = subprocess.Popen([sys.executable, "-m", "dflash_ops", "tail", run["run_id"], "-n", "0"], env=ops_env.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"step ")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "Error" not in err, err
    assert ops_env.pid_alive(run["pid"])
    assert ops_env.runs_json()[-1]["state"] == "running"
    assert ops_env.sub("stop", run["run_id"]).returncode == 0


def test_a_closed_pipe_is_141_through_rich_output_too_and_a_real_failure_keeps_its_code(ops_env):
    """`runs` prints through Rich, whose broken-pipe rule is exit 1 too. A command that fails without writing to
    the closed stdout keeps its code: `tail` of an unknown run 3, and an exit 1 stays 1 (a command added to the real
    app for the test, run through the real main())."""
    import os

    _launch(ops_env, "--lines", "1", "--every", "0.01")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    try:
        listed = subprocess.run([sys.executable, "-m", "dflash_ops", "runs"], env=ops_env.env, stdout=write,
                                stderr=subprocess.PIPE, timeout=60)
        missing = subprocess.run([sys.executable, "-m", "dflash_ops", "tail", "nosuch-20260101T000000-abcd"],
                                 env=ops_env.env, stdout=write, stderr=subprocess.PIPE, timeout=60)
        code = ("import sys; from dflash_ops import cli; cli.app.command('fail')(lambda: sys.exit(1)); "
                "sys.argv = ['dflash-ops', 'fail']; cli.main()")
        failed = subprocess.run([sys.executable, "-c", code], env=ops_env.env, stdout=write, stderr=subprocess.PIPE,
                                timeout=60)
    finally:
        os.close(write)
    assert listed.returncode == 141, listed.stderr
    assert b"Traceback" not in listed.stderr
    assert missing.returncode == 3, missing.stderr
    assert failed.returncode == 1, failed.stderr
