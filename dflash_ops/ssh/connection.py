"""SSH to a host: one paramiko connection, reached directly, through a chain of jump hosts (each a `direct-tcpip`
channel of the one before, each host key checked) or through a ProxyCommand (routing.py, proxy.py); host keys
checked against known_hosts as OpenSSH reads it (hostkeys.py: unknown, changed and revoked keys refused),
keepalive, connect timeout, no agent forwarding. `SshTransport` sends `command_string(argv)` over one exec channel
per call; `fetch_host_key` is the handshake alone, for `trust-host`.
"""

from __future__ import annotations

import functools
import os
import shlex
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from dflash_ops.errors import AuthFailed, ConfigError, HostUnreachable, RemoteFailed
from dflash_ops.spec import Completed, Host
from dflash_ops.ssh.common import (DEFAULT_TIMEOUT_S, OnStdout, SourceLost, command_string, copy_hashed, open_local,
                                   shut_error)
from dflash_ops.ssh.endpoint import resolve_endpoint, resolve_route
from dflash_ops.ssh.hostkeys import (HostKeyRefused, HostKeyUnknown, RejectUnknown, forget_key_command, hop_trust_hint,
                                     host_key_entry, known_hosts_path, read_known_hosts, target_trust_hint)
from dflash_ops.ssh.proxy import proxy_class
from dflash_ops.ssh.routing import Endpoint


class SshTransport:
    """One lazily opened paramiko connection to `host`; `run` opens one exec channel per call. The route (jump
    hosts, proxy command: routing.py) is resolved at construction, so bad settings fail before anything runs."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.label = host.name
        self._client = None
        self._hops: list = []      # connected jump hosts, first first: each carries the next one's channel
        self._proxy = None         # the running proxy command, if the route has one
        self._sftp = None          # an SFTP session on the same connection, opened by the first fetch
        self._shut = False         # shut(): never connect again
        self._lock = threading.Lock()
        self._endpoint = resolve_endpoint(host)
        self.route = resolve_route(host, self._endpoint)

    # -- connection -----------------------------------------------------------------------------------------
    def _connect(self):
        import paramiko  # lazy: only when a connection is really made

        if self._shut:
            raise shut_error(self.label)
        address, port, user, key = self._endpoint
        sock = self.tunnel()
        to = Endpoint(address, port, user, key, self.host.name)
        client = _client(paramiko, self.host, to)
        self._connect_one(paramiko, client, to, sock, where=f"{user}@{address}:{port}", trust=target_trust_hint)
        client.get_transport().set_keepalive(self.host.keepalive_s)
        with self._lock:       # a shut() while this connected wins: the connection carries nothing
            if not self._shut:
                self._client = client
                return client
        client.close()
        self.close()
        raise shut_error(self.label)

    def tunnel(self):
        """What carries the connection to the host's endpoint: None (direct TCP), the proxy command's pipes, or
        a `direct-tcpip` channel from the last jump host, each jump host connected through the one before it
        and its host key checked like any other. Everything opened here lives until `close()`."""
        import paramiko

        sock = self._start_proxy() if self.route.proxy_command else None
        hops = self.route.hops
        targets = [*hops[1:], Endpoint(*self._endpoint, self.host.name)]
        for i, (hop, nxt) in enumerate(zip(hops, targets)):
            where = _hop_label(hop, i, len(hops))
            client = _client(paramiko, self.host, hop)
            self._hops.append(client)
            self._connect_one(paramiko, client, hop, sock, where=where,
                                trust=functools.partial(hop_trust_hint, before=hops[:i], hop=hop))
            client.get_transport().set_keepalive(self.host.keepalive_s)
            try:
                sock = client.get_transport().open_channel("direct-tcpip", (nxt.address, nxt.port),
                                                           ("127.0.0.1", 0), timeout=self.host.connect_timeout_s)
            except (paramiko.SSHException, OSError) as exc:
                self.close()
                raise HostUnreachable(f"{where} cannot reach {nxt.address}:{nxt.port}: {exc}") from None
        return sock

    def _start_proxy(self):
        # The command string is the user's own ssh config line (they could run anything as themselves anyway,
        # as ssh would): only the %-token values are ours to quote, and routing.expand_proxy_command did.
        # ssh runs it as `$SHELL -c "exec CMD"`; paramiko.ProxyCommand shlex-splits its argument back to that argv.
        shell = os.environ.get("SHELL") or "/bin/sh"
        try:
            self._proxy = proxy_class()(shlex.join([shell, "-c", "exec " + self.route.proxy_command]))
        except OSError as exc:
            raise HostUnreachable(f"cannot start ProxyCommand {self.route.proxy_command!r}: "
                                  f"{exc.strerror or exc}") from None
        return self._proxy

    def _connect_one(self, paramiko, client, to: Endpoint, sock, *, where: str, trust) -> None:
        """Connect `client`; when `sock` is the proxy command and it died, say so (its exit code, last stderr)."""
        try:
            _connect_client(paramiko, client, self.host, to, sock, where=where, trust=trust)
        except (HostUnreachable, AuthFailed) as exc:
            # an AuthFailed went through a working proxy (the handshake happened): only a dead one is news
            dead = isinstance(exc, HostUnreachable) and sock is not None and sock is self._proxy
            proxy = self._proxy if dead else None
            code = proxy.exited(within_s=1.0) if proxy is not None else None
            said = proxy.last_words() if code is not None else ""
            self.close()
            if code is None:
                raise
            raise HostUnreachable(f"ProxyCommand for {where} exited with code {code}"
                                  f"{f' ({said})' if said else ''}: {self.route.proxy_command}",
                                  hint="run that command by hand: it must connect its stdin/stdout to the "
                                       "host's sshd") from None

    def run(self, argv: Sequence[str], *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
            on_stdout: OnStdout | None = None) -> Completed:
        import paramiko

        command = command_string(argv)
        client = self._client or self._connect()
        try:
            chan = client.get_transport().open_session(timeout=self.host.connect_timeout_s)
            chan.exec_command(command)  # no get_pty, no agent forwarding, no env= (never user values)
            out, err, code = _drain(chan, timeout_s, on_stdout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self.close()
            raise HostUnreachable(f"connection to {self.label} lost: {exc or type(exc).__name__}",
                                  hint="check the network; `tail` reconnects by itself") from None
        return Completed(command=command, exit_code=code, stdout=out, stderr=err)

    def describe(self, argv: Sequence[str]) -> str:
        address, port, user, _ = self._endpoint
        route = self.route.describe()
        via = f" (via {route})" if route else ""
        return f"ssh {user}@{address}:{port}{via}: {command_string(argv)}"

    def connect(self) -> None:
        """Connect now (else the first `run` does): a host that cannot be reached fails before anything is sent."""
        if self._client is None:
            self._connect()

    def fetch(self, remote: str, local: Path, size: int) -> str:
        """The first `size` bytes of `remote`, a regular file (a symbolic link is refused, never followed), into
        `local` over SFTP on this same connection (its host key was checked when it was made); their SHA-256."""
        import stat

        import paramiko

        client = self._client or self._connect()
        try:
            if self._sftp is None:
                self._sftp = client.open_sftp()
            if not stat.S_ISREG(self._sftp.lstat(remote).st_mode or 0):
                raise RemoteFailed(f"{remote} on {self.label} is not a regular file (a symbolic link?); not pulled")
            src = self._sftp.open(remote, "rb")
        except (paramiko.SSHException, EOFError, socket.timeout) as exc:
            self.close()
            raise HostUnreachable(f"SFTP to {self.label} failed: {exc or type(exc).__name__}") from None
        except OSError as exc:  # the server's answer (no such file, permission denied)
            raise RemoteFailed(f"cannot read {remote} on {self.label}: {exc.strerror or exc}") from None
        try:
            with src, open_local(local) as dst:
                src.prefetch(size)  # pipelined reads: SFTP's round trips would otherwise bound the rate
                return copy_hashed(src, dst, size, f"{remote} on {self.label}", local)
        except SourceLost as exc:
            self.close()
            raise HostUnreachable(f"connection to {self.label} lost while pulling {remote}: {exc}") from None

    def reconnect(self) -> None:
        self.close()
        self._connect()

    def shut(self) -> None:
        """Close, and never connect again: whatever another thread was about to send through this transport is
        not sent (a command already running on the host goes on there)."""
        with self._lock:
            self._shut = True
        self.close()

    def close(self) -> None:
        # target first, then the hops from the last one back: each carries the connection after it
        for c in (self._sftp, self._client, *reversed(self._hops), self._proxy):
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - closing a dead connection must never mask the real error
                    pass
        self._sftp, self._client, self._hops, self._proxy = None, None, [], None


def _client(paramiko, host: Host, to: Endpoint):
    """A client that trusts for `to` the plain keys `host`'s known_hosts records for it, read as OpenSSH reads the
    file (hostkeys.read_known_hosts: paramiko's own reader raises on a line it cannot parse and does not match
    patterns), revoked keys left out; any other key is refused (hostkeys.RejectUnknown). paramiko holds one key per
    type for a host: of several recorded keys of one type the first line's counts (OpenSSH accepts any of them)."""
    _quiet_paramiko()
    client = paramiko.SSHClient()
    known = read_known_hosts(known_hosts_path(host))
    entry = host_key_entry(to.address, to.port)    # the name paramiko looks the server's key up under
    first: dict[str, object] = {}
    for key in known.plain_keys(entry):
        first.setdefault(key.get_name(), key)
    for key_type, key in first.items():
        client.get_host_keys().add(entry, key_type, key)
    client.set_missing_host_key_policy(RejectUnknown(known))
    return client


@functools.cache
def _quiet_paramiko() -> None:
    """paramiko's transport thread logs failures (a traceback for a dead proxy's missing banner) that Python
    prints to stderr when nothing handles them; every failure reaches the user as one OpsError instead."""
    import logging

    logging.getLogger("paramiko").addHandler(logging.NullHandler())


def _connect_client(paramiko, client, host: Host, to: Endpoint, sock, *, where: str, trust) -> None:
    """Connect `client` to `to` (host key checked against `host`'s known_hosts). `where` names it in errors;
    `trust(host)` is the hint that says how to record its key."""
    kh, entry = known_hosts_path(host), host_key_entry(to.address, to.port)
    try:
        client.connect(to.address, port=to.port, username=to.user, key_filename=to.identity,
                       timeout=host.connect_timeout_s, banner_timeout=host.connect_timeout_s,
                       auth_timeout=host.connect_timeout_s, sock=sock, look_for_keys=to.identity is None,
                       allow_agent=True)
    except HostKeyRefused as exc:
        raise AuthFailed(f"host key of {where} {exc.reason}", hint=exc.hint or trust(host)) from None
    except HostKeyUnknown:
        raise AuthFailed(f"host key of {where} is unknown (not in {kh})", hint=trust(host)) from None
    except paramiko.BadHostKeyException as exc:
        # a key of a type known_hosts records, but not the one recorded: revoked (listed @revoked), else changed
        refused = read_known_hosts(kh).refusal(entry, exc.key)
        if refused is not None:
            raise AuthFailed(f"host key of {where} {refused.reason}", hint=refused.hint or trust(host)) from None
        raise AuthFailed(f"host key of {where} CHANGED (does not match {kh})",
                         hint=f"if the change is expected: {forget_key_command(entry, kh)}, then "
                              f"{trust(host, changed=True)}") from None
    except paramiko.AuthenticationException as exc:
        raise AuthFailed(f"authentication to {where} failed: {exc}",
                         hint="check user and identity_file in the inventory") from None
    except paramiko.SSHException as exc:
        raise HostUnreachable(f"SSH to {where} failed: {exc}") from None
    except (socket.timeout, TimeoutError):
        raise HostUnreachable(f"connect to {where} timed out after {host.connect_timeout_s:g} s") from None
    except FileNotFoundError as exc:  # paramiko opening the key file (an ssh config IdentityFile): no network here
        raise ConfigError(f"identity file {exc.filename} for {where} does not exist",
                          hint="fix IdentityFile in ~/.ssh/config, or set identity_file in the inventory") from None
    except OSError as exc:
        raise HostUnreachable(f"cannot connect to {where}: {exc.strerror or exc}") from None
    except UnicodeError:  # the resolver's IDNA codec (an empty or over-long label, e.g. an ssh config HostName a..b)
        raise HostUnreachable(f"cannot connect to {where}: {to.address!r} is not a valid host name") from None


def _hop_label(hop: Endpoint, index: int, count: int) -> str:
    """`jump host user@addr:port`, plus how the user named it and which hop it is when that says more."""
    extra = [hop.name] if hop.name != hop.label else []
    if count > 1:
        extra.append(f"hop {index + 1} of {count}")
    return f"jump host {hop.label}" + (f" ({', '.join(extra)})" if extra else "")


def _drain(chan, timeout_s: float | None, on_stdout: OnStdout | None = None) -> tuple[bytes, bytes, int]:
    """Read stdout and stderr together until the command exits (no deadlock on a full stderr window)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    out, err = bytearray(), bytearray()
    chan.settimeout(0.05)

    def take() -> None:
        chunk = chan.recv(65536)
        out.extend(chunk)
        if on_stdout is not None and chunk:
            on_stdout(chunk)

    while True:
        got = False
        while chan.recv_ready():
            take()
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
        take()
    while chan.recv_stderr_ready():
        err += chan.recv_stderr(65536)
    code = chan.recv_exit_status()
    chan.close()
    if code == -1:  # paramiko's "closed without an exit status": the connection dropped mid-command
        raise EOFError("channel closed without an exit status")
    return bytes(out), bytes(err), code


def fetch_host_key(address: str, port: int, timeout_s: float = 10.0, sock=None):
    """Handshake only (no auth): the server's host key, for `trust-host`. `sock`: an open channel to it (through
    a jump host, see SshTransport.tunnel), else a direct TCP connection."""
    import paramiko

    if sock is None:
        try:
            sock = socket.create_connection((address, port), timeout=timeout_s)
        except OSError as exc:
            raise HostUnreachable(f"cannot connect to {address}:{port}: {exc.strerror or exc}") from None
        except UnicodeError:  # the resolver's IDNA codec: an empty or over-long label
            raise HostUnreachable(f"cannot connect to {address}:{port}: {address!r} is not a valid host name") from None
    t = paramiko.Transport(sock)
    try:
        t.start_client(timeout=timeout_s)
        return t.get_remote_server_key()
    except (paramiko.SSHException, EOFError, OSError) as exc:
        raise HostUnreachable(f"SSH handshake with {address}:{port} failed: {exc}") from None
    finally:
        t.close()

