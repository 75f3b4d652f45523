"""Effects only: run an argv on a host and get a Completed back. The ONLY module that imports paramiko.

`LocalTransport` runs the argv with subprocess (no shell). `SshTransport` sends `shlex.join(argv)` over one
paramiko connection: host keys checked against known_hosts with RejectPolicy (unknown and changed keys refused),
keepalive, connect timeout, no agent forwarding, optional jump host through a `direct-tcpip` channel.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from dflash_ops.errors import AuthFailed, HostUnreachable, UsageError
from dflash_ops.shellcmd import command_string
from dflash_ops.spec import LOCAL, Completed, Host

DEFAULT_TIMEOUT_S = 60.0


class Transport(Protocol):
    label: str

    def run(self, argv: Sequence[str], *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> Completed: ...

    def describe(self, argv: Sequence[str]) -> str: ...

    def reconnect(self) -> None: ...

    def close(self) -> None: ...


class LocalTransport:
    """This machine. Each call is one subprocess; nothing to connect."""

    def __init__(self, label: str = "local") -> None:
        self.label = label

    def run(self, argv: Sequence[str], *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> Completed:
        try:
            proc = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s,
                                  check=False)
        except FileNotFoundError as exc:
            raise UsageError(f"cannot run {argv[0]!r} on this machine: {exc.strerror}",
                             hint="check the `pct:` path of this host in the inventory") from None
        except subprocess.TimeoutExpired:
            raise HostUnreachable(f"local command timed out after {timeout_s} s") from None
        return Completed(command=command_string(argv), exit_code=proc.returncode, stdout=proc.stdout,
                         stderr=proc.stderr)

    def describe(self, argv: Sequence[str]) -> str:
        return command_string(argv)

    def reconnect(self) -> None:
        return None

    def close(self) -> None:
        return None


def known_hosts_path(host: Host) -> Path:
    return Path(os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts"))


def host_key_entry(address: str, port: int) -> str:
    """known_hosts spelling: `addr` on port 22, else `[addr]:port` (OpenSSH convention)."""
    return address if port == 22 else f"[{address}]:{port}"


class SshTransport:
    """One lazily opened paramiko connection to `host`; `run` opens one exec channel per call."""

    def __init__(self, host: Host) -> None:
        jump = host.jump or config_jump(host)
        self.host = host if jump == host.jump else replace(host, jump=jump)  # messages name the jump as given
        self.label = host.name
        self._client = None
        self._jump = None
        self._endpoint = resolve_endpoint(host)
        self._jump_endpoint = resolve_jump(jump, self._endpoint) if jump else None

    # -- connection -----------------------------------------------------------------------------------------
    def _connect(self):
        import paramiko  # lazy: only when a connection is really made

        address, port, user, key = self._endpoint
        sock = self.tunnel() if self._jump_endpoint else None
        client = _client(paramiko, self.host)
        _connect_client(paramiko, client, self.host, address, port, user, key, sock)
        client.get_transport().set_keepalive(self.host.keepalive_s)
        self._client = client
        return client

    def tunnel(self):
        """A `direct-tcpip` channel from the jump host to the host's endpoint (a socket for paramiko.Transport).
        The jump connection (its host key checked like any other) lives until `close()`."""
        import paramiko

        if self._jump_endpoint is None:
            raise UsageError(f"host {self.host.name!r} has no jump host")
        address, port = self._endpoint[:2]
        jump = _client(paramiko, self.host)
        _connect_client(paramiko, jump, self.host, *self._jump_endpoint, None, is_jump=True)
        jump.get_transport().set_keepalive(self.host.keepalive_s)
        self._jump = jump
        try:
            return jump.get_transport().open_channel("direct-tcpip", (address, port), ("127.0.0.1", 0),
                                                     timeout=self.host.connect_timeout_s)
        except (paramiko.SSHException, OSError) as exc:
            raise HostUnreachable(f"jump host {self.host.jump} cannot reach {address}:{port}: {exc}") from None

    def run(self, argv: Sequence[str], *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> Completed:
        import paramiko

        command = command_string(argv)
        client = self._client or self._connect()
        try:
            chan = client.get_transport().open_session(timeout=self.host.connect_timeout_s)
            chan.exec_command(command)  # no get_pty, no agent forwarding, no env= (never user values)
            out, err, code = _drain(chan, timeout_s)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self.close()
            raise HostUnreachable(f"connection to {self.label} lost: {exc or type(exc).__name__}",
                                  hint="check the network; `tail` reconnects by itself") from None
        return Completed(command=command, exit_code=code, stdout=out, stderr=err)

    def describe(self, argv: Sequence[str]) -> str:
        address, port, user, _ = self._endpoint
        via = f" (via {self.host.jump})" if self.host.jump else ""
        return f"ssh {user}@{address}:{port}{via}: {command_string(argv)}"

    def reconnect(self) -> None:
        self.close()
        self._connect()

    def close(self) -> None:
        for c in (self._client, self._jump):
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - closing a dead connection must never mask the real error
                    pass
        self._client = self._jump = None


def resolve_endpoint(host: Host) -> tuple[str, int, str, str | None]:
    """(address, port, user, identity file): inventory values first, then ~/.ssh/config (with its Includes),
    then defaults. A broken ssh config (an Include cycle, an unparsable line) raises ConfigError."""
    cfg = _ssh_config(host.address or host.name)
    address = cfg.get("hostname", host.address or host.name)
    port = host.port or int(cfg.get("port", 22))
    user = host.user or cfg.get("user") or "root"
    identity = host.identity_file or (cfg.get("identityfile") or [None])[0]
    return address, port, user, os.path.expanduser(identity) if identity else None


def config_jump(host: Host) -> str | None:
    """~/.ssh/config's `ProxyJump` for a host whose inventory entry names no `jump:` (None for none / `none`).
    Only one `[user@]host[:port]` hop is supported: a list of hops or an ssh:// URI is a UsageError (exit 2)."""
    from dflash_ops.names import ADDRESS_RE

    if host.transport == LOCAL or host.jump:
        return None
    value = _ssh_config(host.address or host.name).get("proxyjump")
    if not value or value.strip().lower() == "none":
        return None
    if ADDRESS_RE.fullmatch(value.strip()) is None:
        raise UsageError(f"~/.ssh/config ProxyJump {value!r} of {host.address or host.name!r}: dflash-ops supports "
                         f"one [user@]host[:port] hop only",
                         hint="give the host an inventory entry with `jump: user@host:port` (one hop)")
    return value.strip()


def resolve_jump(jump: str, target: tuple[str, int, str, str | None]) -> tuple[str, int, str, str | None]:
    """(address, port, user, identity file) of the jump host `jump` (`[user@]host[:port]`, host maybe an
    ~/.ssh/config alias): the spec's user and port first, then the jump host's ssh config, then port 22 and the
    TARGET's user and identity file. A jump host that itself needs a jump (more than one hop) is a UsageError."""
    from dflash_ops.names import ADDRESS_RE

    m = ADDRESS_RE.fullmatch(jump)
    if m is None:
        raise UsageError(f"invalid jump host {jump!r}")
    name = m.group("host").strip("[]")
    cfg = _ssh_config(name)
    if (cfg.get("proxyjump") or "none").strip().lower() != "none":
        raise UsageError(f"jump host {jump!r} has a ProxyJump of its own in ~/.ssh/config: dflash-ops supports "
                         f"one hop only", hint="reach the target through one jump host, or set `ProxyJump none` "
                                               f"for {name} in ~/.ssh/config")
    identity = (cfg.get("identityfile") or [None])[0]
    return (cfg.get("hostname", name), int(m.group("port") or cfg.get("port", 22)),
            m.group("user") or cfg.get("user") or target[2],
            os.path.expanduser(identity) if identity else target[3])


def _ssh_config(alias: str) -> dict:
    """~/.ssh/config's settings for `alias`, its `Include`s followed (sshconfig.py); {} without a config."""
    from dflash_ops import sshconfig

    return sshconfig.read().lookup(alias)


def _client(paramiko, host: Host):
    client = paramiko.SSHClient()
    kh = known_hosts_path(host)
    if kh.is_file():
        client.load_host_keys(str(kh))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    return client


def _connect_client(paramiko, client, host: Host, address: str, port: int, user: str, key: str | None, sock, *,
                    is_jump: bool = False) -> None:
    """Connect `client` (host key checked); `is_jump`: `address` is `host`'s jump host (errors say so)."""
    where = f"{'jump host ' if is_jump else ''}{user}@{address}:{port}"
    kh, entry = known_hosts_path(host), host_key_entry(address, port)
    try:
        client.connect(address, port=port, username=user, key_filename=key, timeout=host.connect_timeout_s,
                       banner_timeout=host.connect_timeout_s, auth_timeout=host.connect_timeout_s, sock=sock,
                       look_for_keys=key is None, allow_agent=True)
    except paramiko.BadHostKeyException:
        record = _jump_trust_hint(host) if is_jump else f"dflash-ops trust-host {host.name}"
        raise AuthFailed(f"host key of {where} CHANGED (does not match {kh})",
                         hint=f"if the change is expected: ssh-keygen -R '{entry}' -f {kh}, then {record}") from None
    except paramiko.AuthenticationException as exc:
        raise AuthFailed(f"authentication to {where} failed: {exc}",
                         hint="check user and identity_file in the inventory") from None
    except paramiko.SSHException as exc:
        if "known_hosts" in str(exc):
            raise AuthFailed(f"host key of {where} is unknown (not in {kh})",
                             hint=_jump_trust_hint(host) if is_jump else
                             f"verify and record it: dflash-ops trust-host {host.name}") from None
        raise HostUnreachable(f"SSH to {where} failed: {exc}") from None
    except (socket.timeout, TimeoutError):
        raise HostUnreachable(f"connect to {where} timed out after {host.connect_timeout_s:g} s") from None
    except OSError as exc:
        raise HostUnreachable(f"cannot connect to {where}: {exc.strerror or exc}") from None


def _jump_trust_hint(host: Host) -> str:
    """How to trust `host`'s jump host: `trust-host` reaches `host` THROUGH it, so it must be trusted first."""
    kh = known_hosts_path(host)
    how = (f"dflash-ops trust-host {host.jump}" if kh == Path(os.path.expanduser("~/.ssh/known_hosts")) else
           f"give it an inventory entry with known_hosts: {kh}, then dflash-ops trust-host <that entry>")
    return (f"record the jump host's key in {kh} first ({how}; compare its fingerprint), "
            f"then dflash-ops trust-host {host.name}")


def _drain(chan, timeout_s: float | None) -> tuple[bytes, bytes, int]:
    """Read stdout and stderr together until the command exits (no deadlock on a full stderr window)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    out, err = bytearray(), bytearray()
    chan.settimeout(0.05)
    while True:
        got = False
        while chan.recv_ready():
            out += chan.recv(65536)
            got = True
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
            got = True
        # the exit status may arrive before the last output: finish only after EOF (or close) as well
        finished = chan.exit_status_ready() and (chan.eof_received or chan.closed)
        if finished and not chan.recv_ready() and not chan.recv_stderr_ready():
            break
        if chan.closed and not got and not chan.exit_status_ready():
            raise EOFError("channel closed before the command exited")
        if deadline is not None and time.monotonic() > deadline:
            chan.close()
            raise socket.timeout(f"remote command did not finish within {timeout_s} s")
        if not got:
            time.sleep(0.005)
    # the exit status can arrive before the last data: drain once more
    while chan.recv_ready():
        out += chan.recv(65536)
    while chan.recv_stderr_ready():
        err += chan.recv_stderr(65536)
    code = chan.recv_exit_status()
    chan.close()
    if code == -1:  # paramiko's "closed without an exit status": the connection dropped mid-command
        raise EOFError("channel closed without an exit status")
    return bytes(out), bytes(err), code


def for_host(host: Host) -> Transport:
    return LocalTransport(host.name) if host.transport == LOCAL else SshTransport(host)


def fetch_host_key(address: str, port: int, timeout_s: float = 10.0, sock=None):
    """Handshake only (no auth): the server's host key, for `trust-host`. `sock`: an open channel to it (through
    a jump host, see SshTransport.tunnel), else a direct TCP connection."""
    import paramiko

    if sock is None:
        try:
            sock = socket.create_connection((address, port), timeout=timeout_s)
        except OSError as exc:
            raise HostUnreachable(f"cannot connect to {address}:{port}: {exc.strerror or exc}") from None
    t = paramiko.Transport(sock)
    try:
        t.start_client(timeout=timeout_s)
        return t.get_remote_server_key()
    except (paramiko.SSHException, EOFError, OSError) as exc:
        raise HostUnreachable(f"SSH handshake with {address}:{port} failed: {exc}") from None
    finally:
        t.close()


def key_fingerprint(key) -> str:
    """OpenSSH-style `SHA256:<base64, no padding>` of a paramiko PKey."""
    import base64
    import hashlib

    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def known_key_status(path: Path, entry: str, key) -> str:
    """'same' (already trusted), 'changed' (a different key of that type is recorded) or 'new'."""
    import paramiko

    if not path.is_file():
        return "new"
    recorded = paramiko.HostKeys(str(path)).lookup(entry)
    if recorded is None or key.get_name() not in recorded:
        return "new"
    return "same" if recorded[key.get_name()] == key else "changed"


def append_known_host(path: Path, entry: str, key) -> None:
    """Append `entry type base64` (never rewrites existing lines)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="ascii") as f:
        f.write(f"{entry} {key.get_name()} {key.get_base64()}\n")
