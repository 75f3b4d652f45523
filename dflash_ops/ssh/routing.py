"""How a host is reached: the jump hosts in connection order and the proxy command that carries the first
connection, resolved the way `ssh` resolves them (ssh_config(5), ssh.c). Pure: ssh config is read only through
the `lookup` function passed in (alias -> paramiko-style dict, see config.SshConfig.lookup).

- The route comes from the inventory's `jump:` when it has one, else from the target's ssh config, where
  `ProxyJump` and `ProxyCommand` compete: the first one found wins, and `none` (either) means direct.
- `ProxyJump a,b,c`: connect to a, open `direct-tcpip` to b through it, run SSH over that channel, and so on; each
  hop is `[user@]host[:port]` or `ssh://[user@]host[:port]`, host maybe an ssh config alias (its HostName, Port,
  User, IdentityFile apply; the hop's own user/port win). ssh reaches hop b with `ssh -J a -W ... b`, so only
  the FIRST hop's own ProxyJump / ProxyCommand applies (recursively); later hops' are ignored, as ssh ignores them.
- More than MAX_HOPS jump hosts, a ProxyJump cycle, or a list naming one jump host twice (a loop) is refused
  with one line.
- A `ProxyCommand` has `%h %p %r %n %%` expanded (the tokens ssh_config(5) allows there); every value is
  validated and `shlex.quote`d where it lands.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from dflash_ops.errors import ConfigError, UsageError
from dflash_ops.names import ADDRESS_RE, is_digits

MAX_HOPS = 8
_HOP_RE = re.compile(r"(?P<uri>ssh://)?" + ADDRESS_RE.pattern + r"(?(uri)/?)")
# what may land in a proxy command (quoted anyway: defence in depth, a hostile HostName is refused outright)
_SAFE_TOKEN_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:-]*")

Lookup = Callable[[str], dict]


@dataclass(frozen=True)
class Hop:
    """One entry of a jump list as written: `spec` verbatim, `host` maybe an ssh config alias."""

    spec: str
    host: str
    user: str | None = None
    port: int | None = None


@dataclass(frozen=True)
class Endpoint:
    """Where one SSH connection goes. `name`: how the user called it (hop spec or alias), for messages."""

    address: str
    port: int
    user: str
    identity: str | None
    name: str

    @property
    def label(self) -> str:
        return f"{self.user}@{self.address}:{self.port}"


@dataclass(frozen=True)
class Route:
    """`hops`: jump hosts, first connected first (empty: the target directly). `proxy_command`: a shell command
    whose stdin/stdout carry the first connection (to hops[0], else to the target); None: plain TCP."""

    hops: tuple[Endpoint, ...] = ()
    proxy_command: str | None = None

    def describe(self) -> str | None:
        """`b,a`, `ProxyCommand: CMD`, both, or None for a direct route (what `(via ...)` shows)."""
        hops = ",".join(h.name for h in self.hops) or None
        if self.proxy_command is None:
            return hops
        command = f"ProxyCommand: {self.proxy_command}"
        return f"{command}, then {hops}" if hops else command


def parse_jump(value: str, where: str) -> tuple[Hop, ...]:
    """A ProxyJump / inventory `jump:` value -> its hops. `where` starts the error line (names the source)."""
    hops = []
    for number, raw in enumerate(value.split(","), 1):
        spec = raw.strip()
        m = _HOP_RE.fullmatch(spec)
        if m is None:
            raise UsageError(f"{where}: hop {number} {spec!r} is not [user@]host[:port] or ssh://[user@]host[:port]")
        port = int(m.group("port")) if m.group("port") else None
        if port is not None and not 0 < port < 65536:
            raise UsageError(f"{where}: hop {number} {spec!r} has an invalid port")
        hops.append(Hop(spec=spec, host=m.group("host").strip("[]"), user=m.group("user"), port=port))
    if len(hops) > MAX_HOPS:
        raise UsageError(f"{where}: {len(hops)} jump hosts, more than {MAX_HOPS}")
    return tuple(hops)


def proxy_setting(cfg: dict) -> tuple[str, str] | None:
    """("jump", value) or ("command", value) for the ProxyJump / ProxyCommand ssh found first; None for
    neither or `none`."""
    for kind, key in (("jump", "proxyjump"), ("command", "proxycommand")):
        value = cfg.get(key)
        if value is not None:
            return None if value.strip().lower() == "none" else (kind, value.strip())
    return None


def resolve(name: str, target: Endpoint, jump: str | None, lookup: Lookup) -> Route:
    """The route to `target`, which the user called `name` (an alias or address: ssh config is looked up under
    it, and it is `%n`). `jump`: the inventory's `jump:` (wins over ssh config). Unusable settings raise
    UsageError naming the source and the hop."""
    if jump:
        hops, where = parse_jump(jump, f"jump {jump!r}"), "jump"
    else:
        setting = proxy_setting(lookup(name))
        if setting is None:
            return Route()
        kind, value = setting
        if kind == "command":
            return Route(proxy_command=expand_proxy_command(value, target, name))
        hops, where = parse_jump(value, f"ssh config ProxyJump {value!r} of {name!r}"), "ProxyJump"
    chain, command = _chain(hops, target, lookup, (name,))
    _check_chain(chain, name, where)
    return Route(hops=tuple(e for _, e in chain), proxy_command=command)


def _chain(hops: tuple[Hop, ...], target: Endpoint, lookup: Lookup,
           stack: tuple[str, ...]) -> tuple[list[tuple[str, Endpoint]], str | None]:
    """(host, endpoint) pairs of `hops` preceded by whatever the first hop's own ssh config puts before it, and
    the proxy command that carries the first connection. `stack`: hosts whose ProxyJump led here."""
    ends = [(h.host, endpoint(h, lookup(h.host), target)) for h in hops]
    setting = proxy_setting(lookup(hops[0].host))
    if setting is None:
        return ends, None
    kind, value = setting
    if kind == "command":
        return ends, expand_proxy_command(value, ends[0][1], hops[0].host)
    if hops[0].host in stack:
        raise UsageError(f"ssh config ProxyJump loop: {' -> '.join((*stack, hops[0].host))}",
                         hint="set `ProxyJump none` (or a route that ends) for one of these hosts")
    if len(stack) > MAX_HOPS:
        raise UsageError(f"ssh config ProxyJump chain {' -> '.join(stack)} is longer than {MAX_HOPS} hops")
    before, command = _chain(parse_jump(value, f"ssh config ProxyJump {value!r} of {hops[0].host!r}"), target,
                             lookup, (*stack, hops[0].host))
    return before + ends, command


def _check_chain(chain: list[tuple[str, Endpoint]], name: str, where: str) -> None:
    hosts = [h for h, _ in chain]
    if len(chain) > MAX_HOPS:
        raise UsageError(f"{where} route to {name!r} has {len(chain)} jump hosts ({','.join(hosts)}), "
                         f"more than {MAX_HOPS}")
    # by name: two aliases of one machine are two hops (and a jump host may be the target's own sshd)
    seen: set[str] = set()
    for host in hosts:
        if host in seen:
            raise UsageError(f"{where} route to {name!r} visits {host!r} twice ({','.join(hosts)} -> {name}): a loop",
                             hint="name each jump host once")
        seen.add(host)


def endpoint(hop: Hop, cfg: dict, target: Endpoint) -> Endpoint:
    """The hop's spec first, then its ssh config, then port 22 and the target's user and identity file."""
    identity = (cfg.get("identityfile") or [None])[0]
    port = hop.port or config_port(cfg, hop.host)
    return Endpoint(address=cfg.get("hostname", hop.host), port=port, user=hop.user or cfg.get("user") or target.user,
                    identity=os.path.expanduser(identity) if identity else target.identity, name=hop.spec)


def config_port(cfg: dict, name: str) -> int:
    """ssh config's `Port` for `name` (22 when it sets none). Anything but 1..65535 is a ConfigError (exit 78):
    ssh refuses that line too."""
    value = cfg.get("port")
    if value is None:
        return 22
    if not is_digits(value) or not 0 < int(value) < 65536:
        raise ConfigError(f"ssh config: Port {value!r} of {name!r} is not a port number (1..65535)",
                          hint="fix that Port line in ~/.ssh/config (or /etc/ssh/ssh_config, or a file they include)")
    return int(value)


def expand_proxy_command(command: str, to: Endpoint, name: str) -> str:
    """`command` with `%h` (HostName), `%p`, `%r` (user), `%n` (the name as typed) replaced by `shlex.quote`d
    values and `%%` by `%`. An unknown token, a lone `%`, or a value that is not a plain host/user/port word is
    a UsageError (ssh refuses unknown tokens too)."""
    values = {"h": to.address, "p": str(to.port), "r": to.user, "n": name}
    out: list[str] = []
    i = 0
    while i < len(command):
        if command[i] != "%":
            out.append(command[i])
            i += 1
            continue
        token = command[i + 1:i + 2]
        if token == "%":
            out.append("%")
        elif token in values:
            if not _SAFE_TOKEN_RE.fullmatch(values[token]):
                raise UsageError(f"ProxyCommand for {name!r}: refusing to put %{token} = {values[token]!r} into a "
                                 f"shell command")
            out.append(shlex.quote(values[token]))
        else:
            raise UsageError(f"ProxyCommand for {name!r}: unknown token %{token or ''} in {command!r}",
                             hint="ProxyCommand accepts %h %p %r %n and %% (write %% for a literal %)")
        i += 2
    return "".join(out)
