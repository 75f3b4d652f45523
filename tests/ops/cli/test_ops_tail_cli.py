"""tail: byte-exact following to the end, resuming after dropped connections, Ctrl-C leaves the run alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from dflash_ops import inventory, ops, transport
from dflash_ops.errors import HostUnreachable


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
    assert f"run {run['run_id']} exited 0" in done.stderr


def test_tail_exit_4_when_the_run_fails_and_no_follow_returns_at_once(ops_env):
    run = _launch(ops_env, "--lines", "10", "--every", "0.1", "--rc", "9")
    done = ops_env.sub("tail", "job", "-n", "2")
    assert done.returncode == 4 and "exited 9" in done.stderr
    log = (ops_env.run_dirs()[-1] / "output.log").read_text()
    assert len(done.stdout.splitlines()) >= 2 and log.endswith(done.stdout)  # a contiguous suffix, no dup
    again = ops_env.sub("tail", "--no-follow", "-n", "1")  # latest run by default
    assert again.returncode == 4 and again.stdout == "step 9 xx\n"


class FlakyTransport:
    """A real LocalTransport whose connection "drops" on every other call, half the time AFTER the command ran
    (its output is lost in flight), so follow must re-read from the same offset."""

    def __init__(self) -> None:
        self.real, self.calls, self.reconnects, self.label = transport.LocalTransport(), 0, 0, "flaky"

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
    s = ops.Session(target=target, transport=flaky)
    status = next(r for r in ops.list_runs(ops.Session(target, transport.LocalTransport())) if r.run_id == run["run_id"])
    got: list[bytes] = []
    final = ops.follow(s, status, start=0, emit=got.append, poll_s=0.01, sleep=lambda s: time.sleep(min(s, 0.01)))
    log = (ops_env.run_dirs()[-1] / "output.log").read_bytes()
    assert b"".join(got) == log and len(got) == 61
    assert final.state == "exited" and final.exit_code == 0
    assert flaky.reconnects >= 2


def test_ctrl_c_stops_tailing_only(ops_env):
    run = _launch(ops_env, "--hold")
    proc = subprocess.Popen([sys.executable, "-m", "dflash_ops", "tail", run["run_id"]], env=ops_env.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "job started\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert f"stopped tailing; run {run['run_id']} goes on" in err
    assert ops_env.pid_alive(run["pid"])
    assert ops_env.runs_json()[-1]["state"] == "running"
