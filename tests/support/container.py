"""Emulated Proxmox containers: a PID-1 reaper in its own PID, mount and UTS namespaces, reached through a `pct` shim.

Contract:
- `EmulatedContainer(ctid, state_dir).start()` writes `<state_dir>/<ctid>.conf`, starts
  `unshare --pid --fork --mount --uts --mount-proc --kill-child=SIGKILL python3 ct_init.py ct<ctid>`, waits for its
  "ready" line, and records the init's host PID in `<state_dir>/<ctid>.init`. Inside, the init is PID 1, the
  hostname is `ct<ctid>`, and /proc is the container's own (so `kill -0`, `/proc/PID/environ`, `ps` see container
  PIDs). The filesystem is the host's (a private copy of the mount table), so paths under the test's tmp dir are
  the same inside and out.
- `state_dir/pct` (see `install_pct_shim`) is the `pct` executable for every container in that state dir; give its
  absolute path to the code under test (the inventory's `pct:` field). It needs no environment variable.
- `stop()` ends the container like `pct stop`: PID 1 exits and the kernel kills every process inside. The `.conf`
  stays, so `pct exec` then fails with "container '<ctid>' not running!". `destroy()` also removes the `.conf`.
- If the test process dies without teardown, the containers die with it (PDEATHSIG on `unshare`, which
  `--kill-child` passes on to the init). Start containers from the main thread: PDEATHSIG follows the starting thread.
- `start_containers(ctids, state_dir)` starts many at once (spawn all, then wait for all): cheap enough for 8.
Needs root (or CAP_SYS_ADMIN) for the namespaces; `missing_prerequisites()` says what is missing.
"""
from __future__ import annotations

import ctypes
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import procfs

SUPPORT_DIR = Path(__file__).resolve().parent
PCT_SHIM_SOURCE = SUPPORT_DIR / "pct"
CT_INIT = SUPPORT_DIR / "ct_init.py"
_PR_SET_PDEATHSIG = 1


class ContainerError(RuntimeError):
    """A container could not be started or stopped; the message carries the reason and the init's log."""


def missing_prerequisites() -> list[str]:
    """Reasons why emulated containers cannot run here (empty when they can). Fixtures fail with these, never skip."""
    reasons = []
    if os.geteuid() != 0:
        reasons.append("emulated containers need root (unshare --pid --mount --uts); run the ssh tier as root")
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            reasons.append(f"{tool} not found: install util-linux")
    return reasons


def install_pct_shim(state_dir: Path) -> Path:
    """Copy the `pct` shim into `state_dir` (idempotent) and return its absolute path.

    The shim finds its containers next to itself, so nothing has to reach it through the environment (which does
    not cross SSH).
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    shim = state_dir.resolve() / "pct"
    if not shim.exists():
        shutil.copyfile(PCT_SHIM_SOURCE, shim)
        shim.chmod(0o755)
    return shim


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the thread that started it dies (no leaked containers)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class EmulatedContainer:
    """One emulated container (see the module docstring)."""

    def __init__(self, ctid: int, state_dir: Path, *, hostname: str | None = None) -> None:
        if not (100 <= int(ctid) <= 999_999_999):
            raise ValueError(f"ctid {ctid!r} is not a Proxmox VMID (100..999999999)")
        self.ctid = int(ctid)
        self.state_dir = Path(state_dir).resolve()
        self.hostname = hostname or f"ct{self.ctid}"
        self.pct = install_pct_shim(self.state_dir)
        self.conf_path = self.state_dir / f"{self.ctid}.conf"
        self.init_file = self.state_dir / f"{self.ctid}.init"
        self.log_path = self.state_dir / f"{self.ctid}.log"
        self.init_pid: int | None = None  # host PID of the container's PID 1 while it runs
        self._unshare: subprocess.Popen | None = None

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self, *, timeout_s: float = 120.0) -> "EmulatedContainer":
        """Start the container and return once its PID 1 is ready."""
        self._spawn()
        self._await_ready(timeout_s)
        return self

    def stop(self, *, timeout_s: float = 5.0) -> None:
        """Stop the container (idempotent): SIGTERM to PID 1, SIGKILL to `unshare` if that is not enough."""
        proc, self._unshare = self._unshare, None
        self.init_file.unlink(missing_ok=True)
        if self.init_pid is not None and procfs.is_alive(self.init_pid):
            try:
                os.kill(self.init_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.init_pid = None
        if proc is None:
            return
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()  # --kill-child passes SIGKILL on to the init, which takes the namespace down
            proc.wait(timeout=timeout_s)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def destroy(self) -> None:
        """Stop the container and forget it: `pct` then reports that its configuration does not exist."""
        self.stop()
        self.conf_path.unlink(missing_ok=True)

    def __enter__(self) -> "EmulatedContainer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmulatedContainer({self.ctid}, init_pid={self.init_pid}, state_dir={self.state_dir})"

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def running(self) -> bool:
        return self.init_pid is not None and procfs.is_alive(self.init_pid)

    def host_pid(self, container_pid: int) -> int | None:
        """Host PID of the process that is `container_pid` inside this container, or None."""
        if self.init_pid is None:
            return None
        return procfs.host_pid_of(self.init_pid, container_pid)

    def container_pid(self, host_pid: int) -> int | None:
        """PID inside this container of host PID `host_pid`, or None if it is not one of this container's."""
        if self.init_pid is None:
            return None
        try:
            same_ns = os.readlink(f"/proc/{host_pid}/ns/pid") == os.readlink(f"/proc/{self.init_pid}/ns/pid")
        except (FileNotFoundError, ProcessLookupError):
            return None
        chain = procfs.nspid(host_pid)
        return chain[-1] if same_ns and chain else None

    def pct_exec(self, *argv: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
        """Run `pct exec CTID -- argv…` locally through the shim (for test setup; the CLI goes through SSH)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([str(self.pct), "exec", str(self.ctid), "--", *argv], timeout=timeout, **kwargs)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no init log)"

    # ------------------------------------------------------------------------------------------------ effects
    def _spawn(self) -> None:
        if self._unshare is not None:
            raise ContainerError(f"container {self.ctid} already started")
        if reasons := missing_prerequisites():
            raise ContainerError("; ".join(reasons))
        if self.init_file.exists():
            raise ContainerError(f"{self.init_file} exists: another container {self.ctid} uses this state dir")
        self.conf_path.write_text(f"hostname: {self.hostname}\narch: amd64\n")
        argv = [
            "unshare", "--pid", "--fork", "--mount", "--uts", "--mount-proc", "--kill-child=SIGKILL",
            sys.executable, str(CT_INIT), self.hostname,
        ]
        with open(self.log_path, "ab") as log:
            self._unshare = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                preexec_fn=_die_with_parent, cwd="/",
            )

    def _await_ready(self, timeout_s: float) -> None:
        """Read the init's "ready 1" line, then find its host PID (the only child of `unshare`) and record it."""
        line = _read_line(self._unshare, timeout_s)
        if line != "ready 1":
            self.stop()
            raise ContainerError(f"container {self.ctid} did not start (got {line!r})\n{self.log_tail()}")
        kids = procfs.children(self._unshare.pid)
        if len(kids) != 1 or (procfs.nspid(kids[0]) or ())[-1:] != (1,):
            self.stop()
            raise ContainerError(f"container {self.ctid}: cannot find its PID 1 among {kids}")
        self.init_pid = kids[0]
        self.init_file.write_text(f"{self.init_pid}\n")


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """One line from `proc`'s stdout, or "" on EOF or deadline (never blocks past `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return ""
            chunk = os.read(proc.stdout.fileno(), 256)
            if not chunk:
                return ""
            buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


def start_containers(ctids: list[int], state_dir: Path, *, timeout_s: float = 120.0) -> list[EmulatedContainer]:
    """Start one container per ctid, all spawned before any is awaited; on any failure stop them all and raise."""
    cts = [EmulatedContainer(ctid, state_dir) for ctid in ctids]
    try:
        for ct in cts:
            ct._spawn()
        for ct in cts:
            ct._await_ready(timeout_s)
    except BaseException:
        for ct in cts:
            ct.stop()
        raise
    return cts
