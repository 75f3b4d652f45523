"""Fixtures for the dflash-ops tests: an isolated HOME/XDG state, test runbooks whose job is a small Python
script, and two ways to drive the CLI (typer's CliRunner in-process, and a real `python -m dflash_ops` process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import procfs

REPO = Path(__file__).resolve().parents[2]

# The job the test runbooks launch. Flags: --out FILE (argv + env as JSON), --lines N, --every S, --metrics N (N
# intervals as the trainer prints them: a DFLASH_METRICS line, then a human line; then DFLASH_DONE), --child FILE
# (spawn `sleep` in the same process group, write its pid), --rc N, --hold (sleep until killed), then
# --partial TEXT (write TEXT with no newline), --gate FILE (wait until FILE exists), --then TEXT (write TEXT raw);
# --slow-term S: on SIGTERM take S seconds to write a checkpoint (<run dir>/ckpt/step_7/state, by tmp + rename),
# print `DFLASH_STOPPED {"step": 7, ...}` and exit 143, as the trainer does.
JOB = r'''
import json, os, subprocess, sys, time
args = sys.argv[1:]
def opt(flag, default=None):
    return args[args.index(flag) + 1] if flag in args else default
if opt("--slow-term"):
    import signal
    def stop(*_):
        time.sleep(float(opt("--slow-term")))
        done = os.path.join(opt("--run-dir"), "ckpt", "step_7")
        os.makedirs(done + ".tmp")
        with open(os.path.join(done + ".tmp", "state"), "w") as f:
            f.write("weights at step 7\n")
        os.replace(done + ".tmp", done)
        print("DFLASH_STOPPED " + json.dumps({"step": 7, "checkpoint": done}), flush=True)
        os._exit(143)
    signal.signal(signal.SIGTERM, stop)
print("job started", flush=True)
out = opt("--out")
if out:
    env = {k: os.environ.get(k) for k in ("HOSTILE", "DFLASH_OPS_RUN_ID")}
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"argv": sys.argv[1:], "env": env, "cwd": os.getcwd()}, f)
    os.replace(out + ".tmp", out)
child = opt("--child")
if child:
    p = subprocess.Popen(["sleep", "300"])
    with open(child + ".tmp", "w") as f:
        f.write(str(p.pid))
    os.replace(child + ".tmp", child)
for i in range(int(opt("--lines", "0"))):
    print(f"step {i} " + "x" * (i % 7), flush=True)
    time.sleep(float(opt("--every", "0.05")))
for i in range(1, int(opt("--metrics", "0")) + 1):   # as the trainer prints an interval: machine line, human line
    print("DFLASH_METRICS " + json.dumps({"step": 10 * i, "loss": 4 - i / 10, "acc_by_pos": [0.5] * 15}), flush=True)
    print(f"step {10 * i}/? loss {4 - i / 10:.4f}", flush=True)
    time.sleep(float(opt("--every", "0.05")))
if opt("--metrics"):
    print("DFLASH_DONE " + json.dumps({"step": 10 * int(opt("--metrics")), "export": opt("--run-dir") + "/export",
                                       "replica_sha256": ["0" * 64]}), flush=True)
if "--hold" in args:
    time.sleep(300)
if opt("--partial"):
    sys.stdout.write(opt("--partial")); sys.stdout.flush()
gate, deadline = opt("--gate"), time.monotonic() + 120
while gate and not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.02)
if opt("--then"):
    sys.stdout.write(opt("--then")); sys.stdout.flush()
sys.exit(int(opt("--rc", "0")))
'''

RUNBOOK = """\
description: test job
command: ["{{python}}", "{job}", "--run-dir", "{{run_dir}}"]
env:
  PYTHONUNBUFFERED: "1"
liveness:
  wait_s: {wait}
  pattern: "job started"
  timeout_s: 10
"""


@dataclass(frozen=True)
class Env:
    root: Path
    runbooks: Path
    state: Path
    env: dict

    @property
    def runs_dir(self) -> Path:
        return self.state / "dflash-ops" / "runs"

    def run_dirs(self) -> list[Path]:
        return sorted(self.runs_dir.glob("*-*T*-*")) if self.runs_dir.is_dir() else []

    def cli(self, *args: str):
        """In-process through typer's CliRunner."""
        from typer.testing import CliRunner

        from dflash_ops.cli import app

        return CliRunner().invoke(app, ["--runbooks", str(self.runbooks), *args], env=self.env)

    def sub(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """A real `python -m dflash_ops` process."""
        return subprocess.run([sys.executable, "-m", "dflash_ops", "--runbooks", str(self.runbooks), *args],
                              capture_output=True, text=True, env=self.env, cwd=self.root, timeout=timeout)

    def wait_for(self, path: Path, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert time.monotonic() < deadline, f"{path} did not appear"
            time.sleep(0.05)

    @staticmethod
    def pid_alive(pid: int) -> bool:
        return pid_alive(pid)

    def runs_json(self) -> list[dict]:
        done = self.sub("runs", "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie (PID 1 here may not reap orphans)."""
    return procfs.is_alive(pid)


@pytest.fixture
def ops_env(tmp_path, monkeypatch) -> Env:
    home, state = tmp_path / "home", tmp_path / "state"
    home.mkdir()
    rb = tmp_path / "runbooks"
    rb.mkdir()
    job = tmp_path / "job.py"
    job.write_text(JOB)
    (rb / "job.yaml").write_text(RUNBOOK.format(job=job, wait=0.3))
    env = {**os.environ, "HOME": str(home), "XDG_STATE_HOME": str(state), "PYTHONPATH": str(REPO),
           "DFLASH_OPS_INVENTORY": "", "NO_COLOR": "1"}
    env.pop("DFLASH_OPS_RUNBOOKS", None)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)  # no ./inventory.yaml, no ./runbooks from the repo
    e = Env(root=tmp_path, runbooks=rb, state=state, env=env)
    yield e
    _stop_leftovers(e)


def _stop_leftovers(e: Env) -> None:
    """Kill any test job still alive (by its recorded process group, after checking our marker)."""
    for d in e.run_dirs():
        try:
            pid = int((d / "pid").read_text())
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except (OSError, ValueError):
            continue
        if f"DFLASH_OPS_RUN_ID={d.name}".encode() in environ.split(b"\0"):
            try:
                os.killpg(pid, 9)
            except OSError:
                pass
