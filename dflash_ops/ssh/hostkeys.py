"""known_hosts: where it is, how a host is spelled in it, the file read as OpenSSH reads it (`read_known_hosts`:
hashed hosts, patterns with `*` `?` and `!`, `[host]:port`, comments, the `@revoked` and `@cert-authority`
markers; a line OpenSSH skips is skipped, never an error), what it records for a host, why it refuses a key beyond
its being unknown or changed (`KnownHosts.refusal`), the missing-host-key policy connection.py gives paramiko,
appending a key, the fingerprints `trust-host` shows, and the hints that say how to trust a host or a jump host.

paramiko parses the keys (lazily imported); it does not read the file: its reader raises on a line it cannot parse.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash_ops.errors import ConfigError
from dflash_ops.spec import Host
from dflash_ops.ssh.routing import Endpoint


def known_hosts_path(host: Host) -> Path:
    return Path(os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts"))


def host_key_entry(address: str, port: int) -> str:
    """known_hosts spelling: `addr` on port 22, else `[addr]:port` (OpenSSH convention)."""
    return address if port == 22 else f"[{address}]:{port}"


def forget_key_command(entry: str, known_hosts: Path) -> str:
    """The `ssh-keygen -R` line that drops `entry`'s keys from `known_hosts`, quoted to paste as it is."""
    return shlex.join(["ssh-keygen", "-R", entry, "-f", str(known_hosts)])


def target_trust_hint(host: Host, changed: bool = False) -> str:
    how = f"dflash-ops trust-host {host.name}"
    return how if changed else f"verify and record it: {how}"


def hop_trust_hint(host: Host, changed: bool = False, *, before: Sequence[Endpoint], hop: Endpoint) -> str:
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


def key_fingerprint(key) -> str:
    """OpenSSH-style `SHA256:<base64, no padding>` of a paramiko PKey."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def known_key_status(path: Path, entry: str, key) -> str:
    """'revoked' (a matching @revoked line lists it: never trusted), 'same' (already trusted), 'changed' (keys of
    that type are recorded, none this one), 'other_type' (keys of other types are recorded for the host, none of
    this type: OpenSSH warns here) or 'new'."""
    known = read_known_hosts(path)
    if known.revoked(entry, key) is not None:
        return "revoked"
    recorded = known.plain_keys(entry)
    if not recorded:
        return "new"
    same_type = [k for k in recorded if k.get_name() == key.get_name()]
    if not same_type:
        return "other_type"
    return "same" if key in same_type else "changed"


def known_keys(path: Path, entry: str) -> list[tuple[str, str]]:
    """(type, SHA256 fingerprint) of every key `path` records for `entry` (unmarked, not revoked)."""
    return [(k.get_name(), key_fingerprint(k)) for k in read_known_hosts(path).plain_keys(entry)]


def append_known_host(path: Path, entry: str, key) -> None:
    """Append `entry type base64` (never rewrites existing lines)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="ascii") as f:
        f.write(f"{entry} {key.get_name()} {key.get_base64()}\n")


# -- known_hosts read as OpenSSH reads it ---------------------------------------------------------------------
# sshd(8) "SSH_KNOWN_HOSTS FILE FORMAT": `[@marker] hostnames keytype base64-key [comment]`. paramiko's own reader
# raises on a line it cannot parse (a marker, a truncated key) and makes every command a traceback; OpenSSH skips
# such a line and goes on. This reader skips what OpenSSH skips and keeps the markers for the checks below.
CERT_AUTHORITY, REVOKED = "@cert-authority", "@revoked"
_HASH_MAGIC = "|1|"   # OpenSSH's hashed host: |1|base64(salt)|base64(HMAC-SHA1(salt, host))


@dataclass(frozen=True)
class KnownLine:
    """One usable line: its number, marker (None, CERT_AUTHORITY or REVOKED), host field as written (comma-
    separated patterns, or one hashed host) and key (a paramiko PKey)."""

    lineno: int
    marker: str | None
    hosts: str
    key: object

    def matches(self, name: str) -> bool:
        """Whether `name` (`host` or `[host]:port`, as host_key_entry spells it) is one of this line's hosts, by
        OpenSSH's rules: a hashed host by its HMAC; else patterns with `*` and `?`, compared without case, and a
        matching `!pattern` excludes the host whatever else matches."""
        name = name.lower()
        if self.hosts.startswith(_HASH_MAGIC):
            salt, digest = _hashed(self.hosts)
            return hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), digest)
        found = False
        for pattern in self.hosts.split(","):
            negated = pattern.startswith("!")
            if _pattern_re(pattern[1:] if negated else pattern).fullmatch(name):
                if negated:
                    return False
                found = True
        return found


@dataclass(frozen=True)
class KnownHosts:
    """The usable lines of one known_hosts file (none when it does not exist)."""

    path: Path
    lines: tuple[KnownLine, ...] = ()

    def plain_keys(self, name: str) -> list:
        """The keys recorded for `name` by unmarked lines, less any that a matching @revoked line revokes."""
        return [ln.key for ln in self._for(name, None) if self.revoked(name, ln.key) is None]

    def revoked(self, name: str, key) -> KnownLine | None:
        """The @revoked line that revokes `key` for `name`, if one does."""
        return next((ln for ln in self._for(name, REVOKED) if ln.key == key), None)

    def refusal(self, name: str, key) -> HostKeyRefused | None:
        """Why known_hosts itself refuses `key` for `name`, beyond its being unknown or changed: the key is
        @revoked, or the host is vouched for only by an @cert-authority line (paramiko does not check host
        certificates, so that line cannot make the key trusted). None otherwise."""
        line = self.revoked(name, key)
        if line is not None:
            return HostKeyRefused(
                f"({key.get_name()} {key_fingerprint(key)}) is REVOKED at {self.path}:{line.lineno}",
                hint="a revoked key is never trusted: find out why it was revoked, and get the host's new key "
                     "from its administrator")
        ca = next(iter(self._for(name, CERT_AUTHORITY)), None)
        if ca is not None and not self.plain_keys(name):
            return HostKeyRefused(
                f"is vouched for only by the @cert-authority line {self.path}:{ca.lineno}, and dflash-ops does not "
                f"check host certificates")
        return None

    def _for(self, name: str, marker: str | None) -> list[KnownLine]:
        return [ln for ln in self.lines if ln.marker == marker and ln.matches(name)]


class HostKeyRefused(Exception):
    """known_hosts refuses a host's key: `reason` completes "host key of WHERE ..."; `hint` what to do (None: how to
    pin the host's plain key, which the caller knows)."""

    def __init__(self, reason: str, hint: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.hint = reason, hint


class HostKeyUnknown(Exception):
    """No line of known_hosts records a key for the host (RejectPolicy's case)."""


class RejectUnknown:
    """paramiko's missing-host-key policy (it is called when no plain key is known for the host): the refusal of
    `known` if it has one, else HostKeyUnknown. Never accepts."""

    def __init__(self, known: KnownHosts) -> None:
        self.known = known

    def missing_host_key(self, client, hostname: str, key) -> None:
        refused = self.known.refusal(hostname, key)
        raise refused if refused is not None else HostKeyUnknown()


def read_known_hosts(path: Path) -> KnownHosts:
    """`path`'s usable lines; a missing file has none. Skipped as OpenSSH skips them, never an error: blank lines,
    `#` comments, an unknown `@marker`, a line of fewer than three fields, a malformed hashed host, a key that does
    not decode or parse (a truncated line) or of a type paramiko does not know."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return KnownHosts(path)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    return KnownHosts(path, tuple(ln for i, raw in enumerate(text.splitlines(), 1)
                                  if (ln := parse_known_line(raw, i)) is not None))


def parse_known_line(raw: str, lineno: int) -> KnownLine | None:
    """One line as OpenSSH reads it, or None where OpenSSH skips it (read_known_hosts says when)."""
    import paramiko

    fields = raw.split()
    if not fields or fields[0].startswith("#"):
        return None
    marker = None
    if fields[0].startswith("@"):
        if fields[0] not in (CERT_AUTHORITY, REVOKED):
            return None
        marker, fields = fields[0], fields[1:]
    if len(fields) < 3:
        return None
    hosts, key_type, data = fields[:3]
    try:
        if hosts.startswith(_HASH_MAGIC):
            _hashed(hosts)
        blob = base64.b64decode(data, validate=True)
        key = paramiko.PKey.from_type_string(key_type, blob)
    except Exception:  # noqa: BLE001 - binascii, paramiko and its crypto backends raise several kinds: all mean "skip"
        return None
    # paramiko pads a short blob with zeros and ignores trailing bytes: a truncated line would read as some other
    # key. OpenSSH refuses both, so a key counts only when it is exactly the bytes written.
    return KnownLine(lineno, marker, hosts, key) if key.asbytes() == blob else None


def _hashed(hosts: str) -> tuple[bytes, bytes]:
    """(salt, HMAC) of a `|1|salt|hmac` host; ValueError when it is not one."""
    parts = hosts[len(_HASH_MAGIC):].split("|")
    if len(parts) != 2:
        raise ValueError(f"not a hashed host: {hosts!r}")
    salt, digest = (base64.b64decode(p, validate=True) for p in parts)
    if len(digest) != hashlib.sha1().digest_size:
        raise ValueError(f"not a hashed host: {hosts!r}")
    return salt, digest


@functools.cache
def _pattern_re(pattern: str) -> re.Pattern:
    """OpenSSH's match_pattern: `*` any run, `?` any one character, nothing else special; without case."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower()),
                      re.DOTALL)
