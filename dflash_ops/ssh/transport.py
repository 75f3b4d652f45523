"""Effects only: run an argv on a host and get a Completed back. The ONLY module that imports paramiko.

`LocalTransport` runs the argv with subprocess (no shell). `SshTransport` sends `shlex.join(argv)` over one
paramiko connection: host keys checked against known_hosts with RejectPolicy (unknown and changed keys refused),
keepalive, connect timeout, no agent forwarding; reached directly, through a chain of jump hosts (each a
`direct-tcpip` channel of the one before, each host key checked), or through a ProxyCommand (routing.py).
"""

from __future__ import annotations

import functools
import os
import selectors
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from dflash_ops.errors import AuthFailed, ConfigError, HostUnreachable, OpsError, RemoteFailed, UsageError
from dflash_ops.spec import LOCAL, Completed, Host
from dflash_ops.ssh import routing
from dflash_ops.ssh.routing import Endpoint, Route

DEFAULT_TIMEOUT_S = 60.0


def command_string(argv: Sequence[str]) -> str:
    """The one string sent over SSH (parsed once by the remote login shell)."""
    return shlex.join(argv)


OnStdout = Callable[[bytes], None]   # sees the command's stdout as it arrives, chunk by chunk


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


FETCH_CHUNK = 1 << 20


def _open_local(local: Path):
    try:
        return open(local, "wb")  # noqa: SIM115 -- the caller's with closes it
    except OSError as exc:
        raise OpsError(f"cannot write {local}: {exc.strerror or exc}") from None


class _SourceLost(Exception):
    """Reading the source failed mid-copy (for SSH: the connection dropped)."""


def _copy_hashed(src, dst, size: int, what: str, local: Path) -> str:
    """Copy exactly `size` bytes from `src` to `dst`; their SHA-256 (hex). A shorter source is RemoteFailed, a
    failed read _SourceLost, a failed local write one OpsError line (a full disk here)."""
    import hashlib

    digest, left = hashlib.sha256(), size
    while left > 0:
        try:
            chunk = src.read(min(left, FETCH_CHUNK))
        except Exception as exc:  # noqa: BLE001 - paramiko raises several kinds; the caller says which it was
            raise _SourceLost(str(exc) or type(exc).__name__) from exc
        if not chunk:
            raise RemoteFailed(f"{what} is shorter than listed ({size - left} of {size} bytes); nothing kept")
        try:
            dst.write(chunk)
        except OSError as exc:
            raise OpsError(f"cannot write {local}: {exc.strerror or exc}") from None
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()


class LocalTransport:
    """This machine. Each call is one subprocess; nothing to connect."""

    def __init__(self, label: str = "local") -> None:
        self.label = label
        self._shut = False

    def run(self, argv: Sequence[str], *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
            on_stdout: OnStdout | None = None) -> Completed:
        if self._shut:
            raise _shut_error(self.label)
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
            with src, _open_local(local) as dst:
                return _copy_hashed(src, dst, size, remote, local)
        except _SourceLost as exc:
            raise RemoteFailed(f"reading {remote} failed: {exc}") from None

    def reconnect(self) -> None:
        return None

    def close(self) -> None:
        return None

    def shut(self) -> None:
        """Run nothing more (a command already running goes on)."""
        self._shut = True


def _shut_error(label: str) -> HostUnreachable:
    return HostUnreachable(f"{label}: connection shut (what it was doing is being rolled back)")


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


def known_hosts_path(host: Host) -> Path:
    return Path(os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts"))


def host_key_entry(address: str, port: int) -> str:
    """known_hosts spelling: `addr` on port 22, else `[addr]:port` (OpenSSH convention)."""
    return address if port == 22 else f"[{address}]:{port}"


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
            raise _shut_error(self.label)
        address, port, user, key = self._endpoint
        sock = self.tunnel()
        client = _client(paramiko, self.host)
        self._connect_one(paramiko, client, Endpoint(address, port, user, key, self.host.name), sock,
                            where=f"{user}@{address}:{port}", trust=_target_trust)
        client.get_transport().set_keepalive(self.host.keepalive_s)
        with self._lock:       # a shut() while this connected wins: the connection carries nothing
            if not self._shut:
                self._client = client
                return client
        client.close()
        self.close()
        raise _shut_error(self.label)

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
            client = _client(paramiko, self.host)
            self._hops.append(client)
            self._connect_one(paramiko, client, hop, sock, where=where,
                                trust=functools.partial(_hop_trust_hint, before=hops[:i], hop=hop))
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
            self._proxy = _proxy_class()(shlex.join([shell, "-c", "exec " + self.route.proxy_command]))
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
            with src, _open_local(local) as dst:
                src.prefetch(size)  # pipelined reads: SFTP's round trips would otherwise bound the rate
                return _copy_hashed(src, dst, size, f"{remote} on {self.label}", local)
        except _SourceLost as exc:
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


@functools.cache
def _proxy_class():
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


def resolve_endpoint(host: Host) -> tuple[str, int, str, str | None]:
    """(address, port, user, identity file): inventory values first, then ssh config (with its Includes),
    then defaults. A broken ssh config (an Include cycle, an unparsable line, a bad Port) or an inventory
    identity_file that is not there raises ConfigError."""
    name = host.address or host.name
    cfg = _ssh_config(name)
    address = cfg.get("hostname", name)
    port = host.port or routing.config_port(cfg, name)
    user = host.user or cfg.get("user") or "root"
    if host.identity_file:
        # checked here: paramiko's FileNotFoundError would read as "cannot connect" (exit 69, "is the host up?")
        identity = os.path.expanduser(host.identity_file)
        if not os.path.isfile(identity):
            raise ConfigError(f"host {host.name!r}: identity_file {identity} does not exist (or is not a file)",
                              hint="fix identity_file of that host in the inventory")
        return address, port, user, identity
    identity = (cfg.get("identityfile") or [None])[0]
    return address, port, user, os.path.expanduser(identity) if identity else None


def resolve_route(host: Host, target: tuple[str, int, str, str | None] | None = None) -> Route:
    """How `host` is reached (routing.resolve): its inventory `jump:`, else ssh config's ProxyJump or
    ProxyCommand (first found wins). A local host has no route."""
    if host.transport == LOCAL:
        return Route()
    endpoint = Endpoint(*(target or resolve_endpoint(host)), host.name)
    return routing.resolve(host.address or host.name, endpoint, host.jump, _ssh_config)


def _ssh_config(alias: str) -> dict:
    """ssh config's settings for `alias`, `Include`s followed (config.py); {} without a config."""
    from dflash_ops.ssh import config

    return config.read().lookup(alias)


def _client(paramiko, host: Host):
    _quiet_paramiko()
    client = paramiko.SSHClient()
    kh = known_hosts_path(host)
    if kh.is_file():
        client.load_host_keys(str(kh))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
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
    except paramiko.BadHostKeyException:
        raise AuthFailed(f"host key of {where} CHANGED (does not match {kh})",
                         hint=f"if the change is expected: {forget_key_command(entry, kh)}, then "
                              f"{trust(host, changed=True)}") from None
    except paramiko.AuthenticationException as exc:
        raise AuthFailed(f"authentication to {where} failed: {exc}",
                         hint="check user and identity_file in the inventory") from None
    except paramiko.SSHException as exc:
        if "known_hosts" in str(exc):
            raise AuthFailed(f"host key of {where} is unknown (not in {kh})", hint=trust(host)) from None
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


def forget_key_command(entry: str, known_hosts: Path) -> str:
    """The `ssh-keygen -R` line that drops `entry`'s keys from `known_hosts`, quoted to paste as it is."""
    return shlex.join(["ssh-keygen", "-R", entry, "-f", str(known_hosts)])


def _hop_label(hop: Endpoint, index: int, count: int) -> str:
    """`jump host user@addr:port`, plus how the user named it and which hop it is when that says more."""
    extra = [hop.name] if hop.name != hop.label else []
    if count > 1:
        extra.append(f"hop {index + 1} of {count}")
    return f"jump host {hop.label}" + (f" ({', '.join(extra)})" if extra else "")


def _target_trust(host: Host, changed: bool = False) -> str:
    how = f"dflash-ops trust-host {host.name}"
    return how if changed else f"verify and record it: {how}"


def _hop_trust_hint(host: Host, changed: bool = False, *, before: Sequence[Endpoint], hop: Endpoint) -> str:
    """How to trust a jump host's key: `trust-host` reaches `host` THROUGH it, so it must be trusted first. The
    first hop is reached directly (`trust-host` it); a later one only through the hops before it."""
    kh = known_hosts_path(host)
    if before:
        via = ",".join(h.name for h in before)
        how = "e.g. " + shlex.join(["ssh", "-o", f"UserKnownHostsFile={kh}", "-J", via, "-p", str(hop.port),
                                    f"{hop.user}@{hop.address}", "true"])
    elif kh == Path(os.path.expanduser("~/.ssh/known_hosts")):
        how = f"dflash-ops trust-host {hop.name}"
    else:
        how = f"give it an inventory entry with known_hosts: {kh}, then dflash-ops trust-host <that entry>"
    return (f"record the jump host's key in {kh} first ({how}; compare its fingerprint), "
            f"then dflash-ops trust-host {host.name}")


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


def key_fingerprint(key) -> str:
    """OpenSSH-style `SHA256:<base64, no padding>` of a paramiko PKey."""
    import base64
    import hashlib

    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def known_key_status(path: Path, entry: str, key) -> str:
    """'same' (already trusted), 'changed' (a different key of that type is recorded), 'other_type' (keys of
    other types are recorded for the host, none of this type: OpenSSH warns here) or 'new'."""
    import paramiko

    if not path.is_file():
        return "new"
    recorded = paramiko.HostKeys(str(path)).lookup(entry)
    if not recorded:
        return "new"
    if key.get_name() not in recorded:
        return "other_type"
    return "same" if recorded[key.get_name()] == key else "changed"


def known_keys(path: Path, entry: str) -> list[tuple[str, str]]:
    """(type, SHA256 fingerprint) of every key `path` records for `entry`."""
    import paramiko

    recorded = paramiko.HostKeys(str(path)).lookup(entry) if path.is_file() else None
    return [(name, key_fingerprint(recorded[name])) for name in (recorded or {})]


def append_known_host(path: Path, entry: str, key) -> None:
    """Append `entry type base64` (never rewrites existing lines)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="ascii") as f:
        f.write(f"{entry} {key.get_name()} {key.get_base64()}\n")
