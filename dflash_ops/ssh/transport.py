"""The transport contract: run an argv on a host and get a Completed back, and `for_host`, which picks this
machine's (local.py) or SSH (connection.py) for a host."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from dflash_ops.spec import LOCAL, Completed, Host
from dflash_ops.ssh.common import DEFAULT_TIMEOUT_S, OnStdout
from dflash_ops.ssh.connection import SshTransport
from dflash_ops.ssh.local import LocalTransport


class Transport(Protocol):
    label: str

    def run(self, argv: Sequence[str], *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
            on_stdout: OnStdout | None = None) -> Completed: ...

    def describe(self, argv: Sequence[str]) -> str: ...

    def connect(self) -> None: ...

    def fetch(self, remote: str, local: Path, size: int) -> str: ...

    def reconnect(self) -> None: ...

    def close(self) -> None: ...

    def shut(self) -> None: ...


def for_host(host: Host) -> Transport:
    return LocalTransport(host.name) if host.transport == LOCAL else SshTransport(host)

