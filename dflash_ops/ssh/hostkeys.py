"""known_hosts: where it is, how a host is spelled in it, what it records for a host, appending a key, the
fingerprints `trust-host` shows, and the hints that say how to trust a host or a jump host."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

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

