"""This machine as a transport: each call one subprocess (no shell), stdout and stderr read together."""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from dflash_ops.errors import HostUnreachable, RemoteFailed, UsageError
from dflash_ops.spec import Completed
from dflash_ops.ssh.common import (DEFAULT_TIMEOUT_S, OnStdout, SourceLost, command_string, copy_hashed, open_local,
                                   shut_error)


class LocalTransport:
    """This machine. Each call is one subprocess; nothing to connect."""

    def __init__(self, label: str = "local") -> None:
        self.label = label
        self._shut = False

    def run(self, argv: Sequence[str], *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
            on_stdout: OnStdout | None = None) -> Completed:
        if self._shut:
            raise shut_error(self.label)
        try:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
        except FileNotFoundError as exc:
            raise UsageError(f"cannot run {argv[0]!r} on this machine: {exc.strerror}",
                             hint="check the `pct:` path of this host in the inventory") from None
        with proc:
            try:
                out, err = _read_both(proc, timeout_s, on_stdout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise HostUnreachable(f"local command timed out after {timeout_s} s") from None
        return Completed(command=command_string(argv), exit_code=proc.returncode, stdout=out, stderr=err)

    def describe(self, argv: Sequence[str]) -> str:
        return command_string(argv)

    def connect(self) -> None:
        return None

    def fetch(self, remote: str, local: Path, size: int) -> str:
        """The first `size` bytes of the regular file `remote` (on this machine; a symbolic link is refused, never
        followed) into `local`; their SHA-256."""
        try:
            src = os.fdopen(os.open(remote, os.O_RDONLY | os.O_NOFOLLOW), "rb")
        except OSError as exc:
            raise RemoteFailed(f"cannot read {remote}: {exc.strerror or exc}") from None
        try:
            with src, open_local(local) as dst:
                return copy_hashed(src, dst, size, remote, local)
        except SourceLost as exc:
            raise RemoteFailed(f"reading {remote} failed: {exc}") from None

    def reconnect(self) -> None:
        return None

    def close(self) -> None:
        return None

    def shut(self) -> None:
        """Run nothing more (a command already running goes on)."""
        self._shut = True


def _read_both(proc: subprocess.Popen, timeout_s: float | None, on_stdout: OnStdout | None) -> tuple[bytes, bytes]:
    """stdout and stderr of `proc` until both close and it exits (stdout chunks to `on_stdout` as they come)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    got = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as sel:
        for stream in got:
            sel.register(stream, selectors.EVENT_READ)
        while sel.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout_s)
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                got[key.fileobj] += chunk
                if key.fileobj is proc.stdout and on_stdout is not None:
                    on_stdout(chunk)
    proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return bytes(got[proc.stdout]), bytes(got[proc.stderr])

