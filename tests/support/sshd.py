"""A real OpenSSH `sshd` on 127.0.0.1 for tests: generated keys, pinned known_hosts, restartable on the same port.

Contract (what end-to-end tests may rely on):
- `Sshd(workdir).start()` generates an ed25519 host key and client key under `workdir` (once: a restart reuses them),
  picks a free port on 127.0.0.1, starts `/usr/sbin/sshd -D -e -f /dev/null -o …` and returns once the server has
  sent its SSH banner. Only public-key login of `user` (the current user) with `client_key` is accepted.
- `known_hosts` is a file pinning exactly this server's host key as `[127.0.0.1]:PORT ssh-ed25519 …`; an empty
  known_hosts (see `empty_known_hosts()`) makes a strict client refuse the server.
- Sessions get `PATH=<bin_dir>:<sshd default PATH>`: drop executables into `bin_dir` (a fake `nvidia-smi`, …) and
  they are found by name in every later SSH session. No other environment crosses the connection.
- `restart()` stops the server and starts it again on the same port with the same host key. By default it also drops
  the established connections (as a host reboot or network cut would), so clients must reconnect; commands started
  through those connections are not killed by the fixture (a detached job keeps running).
- `stop()` is idempotent and leaves no sshd process started by this object behind.
- sshd's own log is `log_path` (appended across restarts); `log_tail()` returns its last lines for failure messages.
"""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from . import procfs

SSHD_BIN = Path("/usr/sbin/sshd")
HOST = "127.0.0.1"
# What sessions get after `bin_dir` on PATH (set explicitly through SetEnv, so every distro's sshd behaves the same;
# root's ~/.bashrc may still prepend its own entries).
SSHD_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SshdError(RuntimeError):
    """sshd could not be prepared, started or stopped; the message carries the reason and sshd's log tail."""


def missing_prerequisites() -> list[str]:
    """Reasons why a real sshd cannot run here (empty when it can). Fixtures fail with these, never skip."""
    reasons = []
    if not SSHD_BIN.is_file():
        reasons.append(f"{SSHD_BIN} not found: install openssh-server (apt-get install -y openssh-server)")
    if shutil.which("ssh-keygen") is None:
        reasons.append("ssh-keygen not found: install openssh-client")
    return reasons


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def keygen(path: Path, comment: str) -> None:
    """Write an unencrypted ed25519 key pair at `path` and `path`.pub."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True, stdin=subprocess.DEVNULL, capture_output=True,
    )


def sshd_argv(*, port: int, host_key: Path, authorized_keys: Path, pid_file: Path, user: str, path_env: str) -> list[str]:
    """The sshd command line: no system config, loopback only, key auth for one user, sessions get `path_env`."""
    options = {
        "Port": str(port),
        "ListenAddress": HOST,
        "HostKey": str(host_key),
        "AuthorizedKeysFile": str(authorized_keys),
        "PidFile": str(pid_file),
        "AllowUsers": user,
        "PubkeyAuthentication": "yes",
        "PasswordAuthentication": "no",
        "KbdInteractiveAuthentication": "no",
        "PermitRootLogin": "prohibit-password",
        "UsePAM": "no",  # PAM would pull in the distro's session stack; key auth needs none of it
        "StrictModes": "no",  # the tmp dir's permissions are the test runner's business
        "UseDNS": "no",
        "PrintMotd": "no",
        "PrintLastLog": "no",
        "PermitUserEnvironment": "no",
        "SetEnv": f"PATH={path_env}",
        "MaxStartups": "64",  # 8 containers queried in parallel open up to 8 connections at once
        "MaxSessions": "64",
        "LogLevel": "VERBOSE",
        "Subsystem": "sftp internal-sftp",
    }
    argv = [str(SSHD_BIN), "-D", "-e", "-f", "/dev/null"]
    for key, value in options.items():
        argv += ["-o", f"{key}={value}"]
    return argv


class Sshd:
    """One sshd process on 127.0.0.1 and the key material to talk to it (see the module docstring)."""

    def __init__(self, workdir: Path, *, user: str | None = None) -> None:
        self.workdir = Path(workdir)
        self.user = user or getpass.getuser()
        self.host_key = self.workdir / "ssh_host_ed25519_key"
        self.client_key = self.workdir / "client_ed25519"
        self.authorized_keys = self.workdir / "authorized_keys"
        self.known_hosts = self.workdir / "known_hosts"
        self.log_path = self.workdir / "sshd.log"
        self.bin_dir = self.workdir / "bin"
        self.port: int | None = None
        self._pid_file = self.workdir / "sshd.pid"
        self._proc: subprocess.Popen | None = None

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self, *, timeout_s: float = 120.0) -> "Sshd":
        """Start sshd (keys and port are made on first start, reused afterwards) and wait until it serves a banner."""
        if self._proc is not None:
            raise SshdError("sshd already started")
        if reasons := missing_prerequisites():
            raise SshdError("; ".join(reasons))
        self._prepare()
        first_start = self.port is None
        for _attempt in range(3 if first_start else 1):
            if first_start:
                self.port = free_port()
            self._spawn()
            if self._wait_ready(timeout_s):
                self._write_known_hosts()
                return self
            self._kill_listener()
            if not (first_start and "Address already in use" in self.log_tail()):
                break  # only a lost race for a fresh port is worth another try
        raise SshdError(f"sshd on {HOST}:{self.port} did not become ready\n{self.log_tail()}")

    def stop(self, *, drop_connections: bool = True) -> None:
        """Stop the listener; with `drop_connections` also the per-connection sshd processes it forked."""
        if self._proc is None:
            return
        if drop_connections:
            # Only processes sshd itself forked (its per-connection monitors); user commands are their children.
            # They go first, while the listener still runs to reap them: orphaned, they would wait on the
            # machine's init, which in some sandboxes never reaps.
            sessions = procfs.children(self._proc.pid)
            for pid in sessions:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            _wait_gone(sessions, timeout_s=5.0)
        self._kill_listener()

    def restart(self, *, drop_connections: bool = True) -> "Sshd":
        """Stop and start again on the same port with the same host key (see the module docstring)."""
        self.stop(drop_connections=drop_connections)
        return self.start()

    def __enter__(self) -> "Sshd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def install_executable(self, name: str, text: str) -> Path:
        """Write an executable `bin_dir/name` (e.g. a fake `nvidia-smi`) that later SSH sessions find by name."""
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"not a plain file name: {name!r}")
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        path = self.bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
        return path

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"Sshd({self.user}@{HOST}:{self.port}, {state}, workdir={self.workdir})"

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def host_key_line(self) -> str:
        """The known_hosts line pinning this server: `[127.0.0.1]:PORT ssh-ed25519 AAAA…`."""
        if self.port is None:
            raise SshdError("sshd has no port before its first start")
        key_type, key_b64 = self.host_key.with_suffix(".pub").read_text().split()[:2]
        return f"[{HOST}]:{self.port} {key_type} {key_b64}"

    @property
    def host(self) -> str:
        return HOST

    def empty_known_hosts(self) -> Path:
        """An existing, empty known_hosts file: a strict client using it must refuse this server."""
        path = self.workdir / "known_hosts.empty"
        path.write_text("")
        return path

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no sshd log)"
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------------------------------------------ effects
    def _prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.bin_dir.mkdir(exist_ok=True)
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege-separation dir, required as root
        if not self.host_key.exists():
            keygen(self.host_key, "dflash-ops-test-host")
        if not self.client_key.exists():
            keygen(self.client_key, "dflash-ops-test-client")
            shutil.copyfile(self.client_key.with_suffix(".pub"), self.authorized_keys)
            self.authorized_keys.chmod(0o600)

    def _spawn(self) -> None:
        argv = sshd_argv(
            port=self.port, host_key=self.host_key, authorized_keys=self.authorized_keys, pid_file=self._pid_file,
            user=self.user, path_env=f"{self.bin_dir}:{SSHD_DEFAULT_PATH}",
        )
        with open(self.log_path, "ab") as log:
            log.write(f"--- starting sshd on {HOST}:{self.port}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def _wait_ready(self, timeout_s: float) -> bool:
        """Poll until a TCP connect yields an SSH banner; False if sshd died or the deadline passed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                with socket.create_connection((HOST, self.port), timeout=1.0) as sock:
                    if sock.recv(64).startswith(b"SSH-2.0-"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def _write_known_hosts(self) -> None:
        self.known_hosts.write_text(self.host_key_line + "\n")

    def _kill_listener(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _wait_gone(pids: list[int], *, timeout_s: float) -> None:
    """Wait until every one of `pids` has exited and been reaped; SIGKILL the still-living at the deadline."""
    deadline = time.monotonic() + timeout_s
    while any(procfs.state(p) is not None for p in pids):
        if time.monotonic() > deadline:
            for pid in pids:
                if procfs.is_alive(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            return
        time.sleep(0.02)
