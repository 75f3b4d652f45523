"""A ProxyCommand as paramiko's socket: the process that carries an SSH connection on its stdin/stdout."""

from __future__ import annotations

import functools
import os
import socket
import subprocess


@functools.cache
def proxy_class():
    """paramiko.ProxyCommand made to notice its command's end (paramiko's `recv` spins on a closed stdout until
    the banner timeout; this one returns b"", which paramiko reads as EOF, so a dead proxy fails at once) and to
    reap it on close. Built on first use: paramiko is imported lazily."""
    import select

    import paramiko

    class ProxyProcess(paramiko.ProxyCommand):
        def recv(self, size: int) -> bytes:
            ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
            if not ready:
                raise socket.timeout()
            return os.read(self.process.stdout.fileno(), size)

        def close(self) -> None:
            if self.process.poll() is None:
                self.process.terminate()  # our own child, by its pid
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

        def exited(self, within_s: float) -> int | None:
            """Its exit code once it has exited (waiting up to `within_s`), else None."""
            try:
                return self.process.wait(timeout=within_s)
            except subprocess.TimeoutExpired:
                return None

        def last_words(self) -> str:
            """Its last stderr line so far (never blocks: a child it left behind may hold the pipe open)."""
            fd = self.process.stderr.fileno()
            os.set_blocking(fd, False)
            try:
                said = os.read(fd, 65536)
            except (BlockingIOError, OSError):
                said = b""
            lines = said.decode(errors="replace").strip().splitlines()
            return lines[-1] if lines else ""

    return ProxyProcess

