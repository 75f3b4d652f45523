"""Inventory YAML for the test bed: a Proxmox host at 127.0.0.1:<port> whose containers are emulated ones.

The schema is the repository's `inventory.yaml` (see docs/contracts.md): `default_host`, `hosts: {name: {transport,
address, port, user, identity_file, known_hosts, pct, containers: {ctid: {runs_dir, python, env}}}}`.
`proxmox_host_entry` is pure (builds the mapping); `write_inventory` is the only effect.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ContainerEntry:
    """What the inventory says about one container: where runs go, which python runs them, extra job env."""

    ctid: int
    runs_dir: Path
    python: str = sys.executable
    # The job runs `python -m trainer …` from its run dir: the repository must be importable there even when the
    # package is not installed (CI installs it; local runs do not).
    env: dict[str, str] = field(default_factory=lambda: {"PYTHONPATH": str(REPO_ROOT)})

    def as_yaml(self) -> dict:
        return {"runs_dir": str(self.runs_dir), "python": self.python, "env": dict(self.env)}


@dataclass(frozen=True)
class ProxmoxHostEntry:
    """One `transport: proxmox` host of the inventory (all paths absolute)."""

    address: str
    port: int
    user: str
    identity_file: Path
    known_hosts: Path
    pct: Path
    containers: tuple[ContainerEntry, ...]

    def as_yaml(self) -> dict:
        return {
            "transport": "proxmox",
            "address": self.address,
            "port": self.port,
            "user": self.user,
            "identity_file": str(self.identity_file),
            "known_hosts": str(self.known_hosts),
            "pct": str(self.pct),
            "containers": {ct.ctid: ct.as_yaml() for ct in self.containers},
        }


def inventory_document(hosts: dict[str, ProxmoxHostEntry], *, default_host: str = "local") -> dict:
    """The whole inventory mapping: the given Proxmox hosts plus the `local` host."""
    doc_hosts: dict[str, dict] = {"local": {"transport": "local"}}
    doc_hosts.update({name: entry.as_yaml() for name, entry in hosts.items()})
    if default_host not in doc_hosts:
        raise ValueError(f"default_host {default_host!r} is not one of {sorted(doc_hosts)}")
    return {"default_host": default_host, "hosts": doc_hosts}


def write_inventory(path: Path, hosts: dict[str, ProxmoxHostEntry], *, default_host: str = "local") -> Path:
    """Write the inventory YAML to `path` and return `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(inventory_document(hosts, default_host=default_host), sort_keys=False))
    return path
