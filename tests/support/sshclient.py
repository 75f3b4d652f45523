"""A strict paramiko client for the test sshd: pinned known_hosts, RejectPolicy, the generated client key only.

Used by the test-bed tests to prove the harness independently of the CLI under test.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import paramiko

from .sshd import Sshd


@dataclass(frozen=True)
class Result:
    """Outcome of one remote command: exit status (-1 if the server reported none) and raw output bytes."""

    exit_code: int
    stdout: bytes
    stderr: bytes


def connect(sshd: Sshd, *, known_hosts: Path | None = None, timeout_s: float = 10.0) -> paramiko.SSHClient:
    """Open a connection that refuses any host key not in `known_hosts` (default: the server's pinned file)."""
    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts or sshd.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(
            sshd.host, port=sshd.port, username=sshd.user, key_filename=str(sshd.client_key),
            allow_agent=False, look_for_keys=False, timeout=timeout_s, banner_timeout=timeout_s,
            auth_timeout=timeout_s,
        )
    except BaseException:
        client.close()
        raise
    return client


def run(client: paramiko.SSHClient, command: str, *, timeout_s: float = 300.0) -> Result:
    """Run one command string (parsed by the remote login shell) and wait for it to finish."""
    _stdin, stdout, stderr = client.exec_command(command, timeout=timeout_s)
    _stdin.close()
    out = stdout.read()
    err = stderr.read()
    return Result(stdout.channel.recv_exit_status(), out, err)
