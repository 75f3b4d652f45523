"""End-to-end helpers: drive the dflash-ops CLI, as a real `python -m dflash_ops` process (or through CliRunner),
against the session's real sshd and emulated Proxmox containers reached through the `pct` shim.

- `E2E` (built by the module-scoped `bed` fixture in conftest.py): one `Testbed` per test module, its containers
  shared by the module's tests (each test owns the container it uses: `E2E.ct(i)`), and a runbook directory:
  `job` (the JOB script below, liveness `job started`) and `cachejob` (the same with `pre: [clear_inductor_cache]`
  and TORCHINDUCTOR_CACHE_DIR=`bed.cache_dir`). Containers are stopped when the module ends (that ends every job
  inside them, as stopping a real container does).
- JOB flags: `--joined` (then print torchrun's "Rendezvous complete" line: a stand-in for torchrun on a node of a
  multi-node run), `--gate FILE` (after `job started`, wait until FILE exists), `--lines N` `--every S` (print
  `line I` N times), `--metrics N` (N intervals as the trainer prints them: a `DFLASH_METRICS` line, then a
  human line `step I loss L`; as the trainer, only on rank 0 of a multi-node run), `--end-gate FILE` (at the end,
  wait until FILE exists), `--peers FILE` (as the ranks of a data-parallel run: rank 0 creates FILE when it gets
  SIGTERM and exits 143; any other rank exits 1 once FILE exists, as if its collective had lost a peer),
  `--child FILE` (spawn `sleep 300` in the job's group, write its container pid),
  `--setsid-child FILE` (the same in a session and group of its own: only its environment's marker ties it to the run),
  `--export KIB` (write export/, metrics.jsonl, ckpt/step_2 and ckpt/step_10 into the run dir, as the trainer does,
  plus an awkwardly named file and a symlink `export/leak` to `--leak PATH`),
  `--argv FILE` (write the job's argv as NUL-joined bytes), `--env FILE` (write $HOSTILE's bytes), `--echo` (print
  every argument after `--echo` raw, one per line), `--rc N` (exit status), `--slow-term S` (as the trainer: on
  SIGTERM take S seconds to write ckpt/step_7/state, print `DFLASH_STOPPED {"step": 7}`, exit 143). Files are
  written via tmp+rename.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from typer.testing import CliRunner

from support import container as ct_mod
from support import procfs
from support.testbed import Testbed

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR_NAME = "inductor-cache"   # under the bed's work dir; `cachejob` sets TORCHINDUCTOR_CACHE_DIR to it
JOB = r'''
import os, subprocess, sys, time
args = sys.argv[1:]
def opt(flag, default=None):
    return args[args.index(flag) + 1] if flag in args else default
def put(path, data):
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
if opt("--slow-term"):
    import signal
    def slow_stop(*_):
        time.sleep(float(opt("--slow-term")))
        os.makedirs("ckpt/step_7.tmp")
        put("ckpt/step_7.tmp/state", b"weights at step 7\n")
        os.replace("ckpt/step_7.tmp", "ckpt/step_7")
        print('DFLASH_STOPPED {"step": 7, "checkpoint": "ckpt/step_7"}', flush=True)
        os._exit(143)
    signal.signal(signal.SIGTERM, slow_stop)
print("job started", flush=True)
rank = os.environ.get("PET_NODE_RANK", "0")
if "--joined" in args:
    print("[default] Rendezvous complete for workers. Result:", flush=True)
if opt("--argv"):
    put(opt("--argv"), b"\0".join(os.fsencode(a) for a in sys.argv[1:]))
if opt("--env"):
    put(opt("--env"), os.environb.get(b"HOSTILE", b"<unset>"))
if "--echo" in args:
    for a in args[args.index("--echo") + 1:]:
        sys.stdout.buffer.write(os.fsencode(a) + b"\n")
    sys.stdout.buffer.flush()
if opt("--child"):
    child = subprocess.Popen(["sleep", "300"])
    put(opt("--child"), str(child.pid).encode())
if opt("--export"):   # what the trainer leaves in its run dir (cwd), with awkward names and a symlink out
    os.makedirs("export", exist_ok=True)
    put("export/config.json", b'{"architectures": ["DFlashDraftModel"]}\n')
    put("export/model.safetensors", os.urandom(1024 * int(opt("--export"))))
    put("export/it's \"odd\" $(touch x).bin", b"odd\n")
    os.symlink(opt("--leak", "/etc/hostname"), "export/leak")
    put("metrics.jsonl", b'{"step": 2, "loss": 3.0}\n{"step": 10, "loss": 2.5}\n')
    for step in (2, 10):
        os.makedirs(f"ckpt/step_{step}", exist_ok=True)
        put(f"ckpt/step_{step}/drafter.pt", b"weights at step %d\n" % step)
    print("exported", flush=True)
if opt("--setsid-child"):
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    put(opt("--setsid-child"), str(child.pid).encode())
gate, deadline = opt("--gate"), time.monotonic() + 120
while gate and not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.02)
for i in range(int(opt("--lines", "0"))):
    print(f"line {i}", flush=True)
    time.sleep(float(opt("--every", "0.02")))
for i in range(1, int(opt("--metrics", "0")) + 1 if rank == "0" else 0):   # an interval: machine line, human line
    print('DFLASH_METRICS {"step": %d, "loss": %.1f, "tokens_per_s": %d, "acc_by_pos": [%s]}'
          % (i, 4 - i / 10, 100 * i, ", ".join(["0.5"] * 15)), flush=True)
    print(f"step {i} loss {4 - i / 10:.1f}", flush=True)
    time.sleep(float(opt("--every", "0.02")))
if opt("--peers") and rank == "0":
    import signal
    def term(*_):
        put(opt("--peers"), b"rank 0 stopped")
        os._exit(143)
    signal.signal(signal.SIGTERM, term)
    while True:
        time.sleep(1)
gate = opt("--end-gate") or (opt("--peers") if rank != "0" else None)
deadline = time.monotonic() + 120
while gate and not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(1 if opt("--peers") else int(opt("--rc", "0")))
'''

RUNBOOK = """\
description: e2e test job
command: ["{{python}}", "{job}"]
env:
  PYTHONUNBUFFERED: "1"
  HOSTILE: {hostile}
liveness:
  wait_s: 0.2
  pattern: "job started"
  timeout_s: 20
"""

# Every injection attempt in here would create the canary file if any layer (login shell, bash -c, bash -c,
# pct, nsenter) ever evaluated it.
HOSTILE_TEMPLATE = ["it's", '"dq"', "$(touch {c})", "`touch {c}`", "a; touch {c}", "x && touch {c} #",
                    "' ; touch {c} ; '", '" ; touch {c} ; "', "new\nline; touch {c}", "  two  spaces  ", "",
                    "tab\there", "\u4e2d\u6587 \u00e9\U0001f600", "back\\slash", "$HOME ${PATH} $$ $!", "*", "-rf",
                    "|| touch {c}", "> {c}", "\\$(touch {c})"]


def hostile_values(canary: Path) -> list[str]:
    return [s.replace("{c}", str(canary)) for s in HOSTILE_TEMPLATE]


@dataclass(frozen=True)
class Done:
    """What one CLI invocation left: exit status and the raw bytes of stdout and stderr."""

    returncode: int
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True)
class E2E:
    """One module's test bed and the ways to drive the CLI against it."""

    tb: Testbed
    runbooks: Path
    job: Path
    work: Path
    canary: Path           # must never exist: every hostile value tries to create it

    @property
    def cache_dir(self) -> Path:
        return self.work / CACHE_DIR_NAME

    @property
    def inventory(self) -> Path:
        return self.tb.inventory

    def inventory_with(self, label: str, **fields) -> Path:
        """A copy of the inventory whose test host has `fields` changed (e.g. known_hosts=..., port=...)."""
        doc = yaml.safe_load(self.inventory.read_text())
        doc["hosts"][self.tb.host].update({k: str(v) if isinstance(v, Path) else v for k, v in fields.items()})
        path = self.work / f"inventory-{label}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def ct(self, index: int) -> int:
        return self.tb.containers[index].ctid

    def container(self, index: int) -> ct_mod.EmulatedContainer:
        return self.tb.containers[index]

    def target(self, ctid: int) -> list[str]:
        return ["--host", self.tb.host, "--ct", str(ctid)]

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(REPO)}

    def argv(self, *args: str, inventory: Path | None = None) -> list[str]:
        return [sys.executable, "-m", "dflash_ops", "--inventory", str(inventory or self.inventory),
                "--runbooks", str(self.runbooks), *args]

    def proc(self, *args: str, inventory: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        """A real `python -m dflash_ops` process; stdout and stderr are bytes."""
        return subprocess.run(self.argv(*args, inventory=inventory), capture_output=True, env=self.env(),
                              cwd=self.work, timeout=timeout, stdin=subprocess.DEVNULL)

    def cli(self, *args: str, inventory: Path | None = None, input: str | None = None) -> Done:
        """In-process through typer's CliRunner (no interpreter start-up: most calls go this way)."""
        from dflash_ops.cli import app

        result = CliRunner().invoke(app, ["--inventory", str(inventory or self.inventory),
                                          "--runbooks", str(self.runbooks), *args], input=input)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception  # a bug in the CLI, not an exit code: show its traceback
        return Done(result.exit_code, result.stdout_bytes, result.stderr_bytes)

    def launch(self, ctid: int, *job_args: str, name: str | None = None, runbook: str = "job",
               real: bool = False, inventory: Path | None = None) -> dict:
        """Launch (in a real process with `real`) and return the `--json` document; fails the test unless exit 0."""
        named = ["--name", name] if name else []
        done = (self.proc if real else self.cli)("launch", runbook, *self.target(ctid), *named, "--json", "--",
                                                 *job_args, inventory=inventory)
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
        return json.loads(done.stdout)

    def runs(self, ctid: int) -> list[dict]:
        done = self.cli("runs", *self.target(ctid), "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def run_dirs(self, ctid: int, name: str | None = None) -> list[Path]:
        """Run directories of `ctid` (of one run name), read on this machine: the container shares our files."""
        root = self.tb.runs_dirs[ctid]
        return sorted(p for p in root.iterdir() if p.is_dir() and (name is None or p.name.startswith(name + "-")))

    def gate(self, label: str) -> Path:
        return self.work / f"gate-{label}"

    def file(self, label: str) -> Path:
        return self.work / label


def wait_for(predicate, what: str, timeout_s: float = 300.0, poll_s: float = 0.1) -> None:
    """Poll `predicate` (something cheap: a file, /proc; not the CLI over SSH) every `poll_s` until it holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def marked_processes(container: ct_mod.EmulatedContainer, run_id: str) -> list[int]:
    """Host pids of the live processes inside `container` whose environment carries the run's marker."""
    marker = f"DFLASH_OPS_RUN_ID={run_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if container.container_pid(pid) is None or not procfs.is_alive(pid):
                continue
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or a process this sandbox hides from us (never one of the container's)
        if marker in environ.split(b"\0"):
            found.append(pid)
    return found


class LineReader:
    """Reads a process's stdout line by line on a thread, so a test can wait for a line with a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.seen: list[bytes] = []
        self._thread = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        for line in iter(stream.readline, b""):
            self.lines.put(line)
        self.lines.put(b"")

    def until(self, wanted: bytes, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while wanted not in self.seen:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            assert line, f"stream ended before {wanted!r}; got {self.seen[-5:]!r}"
            self.seen.append(line)

    def rest(self, timeout_s: float = 300.0) -> bytes:
        self._thread.join(timeout_s)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return b"".join(self.seen)
