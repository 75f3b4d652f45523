"""What both transports share: the default timeout, the one string an argv becomes, and the hashed copy of a
`fetch`. No paramiko, no process: the transports (local.py, connection.py) do the effects."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from pathlib import Path

from dflash_ops.errors import HostUnreachable, OpsError, RemoteFailed

DEFAULT_TIMEOUT_S = 60.0
FETCH_CHUNK = 1 << 20

OnStdout = Callable[[bytes], None]   # sees the command's stdout as it arrives, chunk by chunk


def command_string(argv: Sequence[str]) -> str:
    """The one string sent over SSH (parsed once by the remote login shell)."""
    return shlex.join(argv)


def open_local(local: Path):
    try:
        return open(local, "wb")  # noqa: SIM115 -- the caller's with closes it
    except OSError as exc:
        raise OpsError(f"cannot write {local}: {exc.strerror or exc}") from None


class SourceLost(Exception):
    """Reading the source failed mid-copy (for SSH: the connection dropped)."""


def copy_hashed(src, dst, size: int, what: str, local: Path) -> str:
    """Copy exactly `size` bytes from `src` to `dst`; their SHA-256 (hex). A shorter source is RemoteFailed, a
    failed read SourceLost, a failed local write one OpsError line (a full disk here)."""
    import hashlib

    digest, left = hashlib.sha256(), size
    while left > 0:
        try:
            chunk = src.read(min(left, FETCH_CHUNK))
        except Exception as exc:  # noqa: BLE001 - paramiko raises several kinds; the caller says which it was
            raise SourceLost(str(exc) or type(exc).__name__) from exc
        if not chunk:
            raise RemoteFailed(f"{what} is shorter than listed ({size - left} of {size} bytes); nothing kept")
        try:
            dst.write(chunk)
        except OSError as exc:
            raise OpsError(f"cannot write {local}: {exc.strerror or exc}") from None
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()


def shut_error(label: str) -> HostUnreachable:
    return HostUnreachable(f"{label}: connection shut (what it was doing is being rolled back)")

