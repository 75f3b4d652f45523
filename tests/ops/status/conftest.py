"""Fixtures for status / gpu-reset tests: a fake nvidia-smi over real holder processes, fake device nodes, and
holders placed in an emulated container (PID namespace + cgroup `lxc/<ctid>`, as PVE lays them out)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "tests"))  # `support`, as tests/conftest.py imports it
from support import fake_nvidia_smi  # noqa: E402

HOLDER = HERE / "gpu_holder.py"
CGROUP_ROOTS = ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")


@dataclass
class FakeGpus:
    bin_dir: Path
    nvidia_smi: Path
    state: Path
    dev_dir: Path

    def hold(self, gpu: int, mib: int) -> str:
        """FAKE_NVIDIA_HOLD value: `mib` MiB on `gpu` of this fake only (other tests' holders never leak in)."""
        return f"{gpu}:{mib}:{self.state.resolve()}"

    @property
    def dev_glob(self) -> str:
        return f"{self.dev_dir}/nvidia*"

    def dev(self, name: str) -> str:
        return str(self.dev_dir / name)


@pytest.fixture
def fake_gpus(tmp_path: Path) -> FakeGpus:
    dev_dir = tmp_path / "dev"
    dev_dir.mkdir()
    for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"]:
        (dev_dir / name).write_bytes(b"")
    smi = fake_nvidia_smi.install(tmp_path / "bin", tmp_path / "gpus.json", n_gpus=8)
    return FakeGpus(bin_dir=tmp_path / "bin", nvidia_smi=smi, state=tmp_path / "gpus.json", dev_dir=dev_dir)


def _ct_cgroup_dir(ctid: int) -> Path | None:
    for root in CGROUP_ROOTS:
        path = Path(root) / "lxc" / str(ctid)
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path / "cgroup.procs", os.W_OK):
                return path
        except OSError:
            continue
    return None


class Holders:
    """Starts holder processes and reaps them (so a killed holder never lingers as a zombie)."""

    def __init__(self, tmp: Path, gpus: FakeGpus):
        self.tmp, self.gpus, self.procs, self.cgroups = tmp, gpus, [], []
        self.count = 0

    def start(self, gpu: int, mib: int, *, child: str | None = None, ignore_term: bool = False,
              ctid: int | None = None, new_session: bool = True, bystander: Path | None = None) -> int:
        """Start a holder; returns its host PID once it (and its child) hold. ctid: inside an emulated CT."""
        self.count += 1
        ready = self.tmp / f"holder{self.count}.ready"
        argv = [sys.executable, str(HOLDER), "--hold", self.gpus.hold(gpu, mib), "--ready", str(ready),
                "--dev", self.gpus.dev(f"nvidia{gpu}"), "--dev", self.gpus.dev("nvidiactl")]
        argv += ["--child", self.gpus.hold(*map(int, child.split(":")))] if child else []
        argv += ["--ignore-term"] if ignore_term else []
        argv += ["--bystander", str(bystander)] if bystander else []
        env = {k: v for k, v in os.environ.items() if k != "FAKE_NVIDIA_HOLD"}
        if ctid is not None:
            cg = _ct_cgroup_dir(ctid)
            assert cg is not None, "no writable cgroup hierarchy to emulate lxc/<ctid>"
            self.cgroups.append(cg)
            # PID 1 of the namespace is a shell that reaps; the holder is its child and leads its own session there,
            # as a run launched with `nohup setsid` under CT init.
            procs = shlex.quote(str(cg / "cgroup.procs"))
            inner = "setsid \"$@\" & wait"
            argv = ["sh", "-c", f"echo $$ > {procs} && exec unshare --pid --fork sh -c {shlex.quote(inner)} sh "
                    + shlex.join(argv)]
        proc = subprocess.Popen(argv, env=env, start_new_session=new_session)
        self.procs.append(proc)
        threading.Thread(target=proc.wait, daemon=True).start()
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert time.monotonic() < deadline, "holder did not start"
            time.sleep(0.01)
        return host_pid_of(ready)

    def stop_all(self) -> None:
        for proc in self.procs:
            for pid in _tree(proc.pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.wait(timeout=10)


def host_pid_of(ready: Path) -> int:
    """The holder wrote its own PID, which is namespace-local inside a CT: find the host PID by its ready path."""
    token = str(ready).encode()
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(cmd) > 3 and cmd[1] == str(HOLDER).encode() and token in cmd:
            return int(pid)
    raise AssertionError(f"no process for {ready}")


def _tree(root: int) -> list[int]:
    out = [root]
    for pid in os.listdir("/proc"):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == root:
            out += _tree(int(pid))
    return out


@pytest.fixture
def holders(tmp_path: Path, fake_gpus: FakeGpus):
    h = Holders(tmp_path, fake_gpus)
    yield h
    h.stop_all()
    for cg in h.cgroups:
        try:
            cg.rmdir()
        except OSError:
            pass


TRAINER = HERE / "fake_trainer.py"


def trainer_runbook(runbooks: Path, fake: FakeGpus, *, gpu: int, mib: int, child_mib: int | None = None,
                    name: str = "ft", ignore_term: bool = False, slow_term_s: float | None = None) -> str:
    """A runbook whose job is fake_trainer.py holding `mib` MiB of GPU `gpu` (and a child holding `child_mib`);
    with `ignore_term` the job outlives SIGTERM, so only SIGKILL ends it and its wrapper; with `slow_term_s`
    SIGTERM makes it write a checkpoint (`{run_dir}/ckpt`) in that many seconds, then exit 143."""
    import json

    runbooks.mkdir(parents=True, exist_ok=True)
    command = ["{python}", str(TRAINER), "--dev", fake.dev(f"nvidia{gpu}"), "--dev", fake.dev("nvidiactl")]
    command += ["--child", fake.hold(gpu, child_mib)] if child_mib else []
    command += ["--ignore-term"] if ignore_term else []
    command += ["--slow-term", str(slow_term_s), "--ckpt", "{run_dir}/ckpt"] if slow_term_s is not None else []
    (runbooks / f"{name}.yaml").write_text(
        f"description: fake trainer\ncommand: {json.dumps(command)}\n"
        f"env:\n  PYTHONUNBUFFERED: \"1\"\n  FAKE_NVIDIA_HOLD: \"{fake.hold(gpu, mib)}\"\n"
        "liveness:\n  wait_s: 0.3\n  pattern: DFLASH_METRICS\n  timeout_s: 20\n")
    return name


def cli(*args: str, env: dict | None = None, input: str | None = None):
    """The CLI in-process (typer's CliRunner); stdout and stderr apart."""
    from typer.testing import CliRunner

    from dflash_ops.cli import app

    return CliRunner().invoke(app, list(args), env=env, input=input, catch_exceptions=False)
