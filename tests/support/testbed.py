"""The assembled test bed: one sshd, N emulated containers behind one pct shim, and an inventory naming them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .container import EmulatedContainer
from .inventory import ContainerEntry, ProxmoxHostEntry, write_inventory
from .sshd import Sshd

DEFAULT_HOST_NAME = "pve-test"


@dataclass(frozen=True)
class Testbed:
    """Everything an end-to-end test needs to drive the CLI against the emulated Proxmox host.

    `inventory` lists `host` (transport proxmox, 127.0.0.1:sshd.port, pinned known_hosts, client key, the pct shim)
    with one entry per container; `runs_dirs[ctid]` is that container's runs_dir (created, empty).
    """

    __test__ = False  # not a pytest test class, despite the name

    host: str
    inventory: Path
    sshd: Sshd
    containers: tuple[EmulatedContainer, ...]
    pct: Path
    runs_dirs: dict[int, Path]

    def container(self, ctid: int) -> EmulatedContainer:
        return next(ct for ct in self.containers if ct.ctid == ctid)


def host_entry(sshd: Sshd, containers: list[EmulatedContainer], runs_root: Path) -> ProxmoxHostEntry:
    """The inventory entry for `containers` behind `sshd`; each container's runs_dir is `runs_root/<ctid>/runs`."""
    if not containers:
        raise ValueError("a Proxmox test host needs at least one container")
    shims = {ct.pct for ct in containers}
    if len(shims) != 1:
        raise ValueError(f"containers of one host must share one state dir (one pct shim), got {sorted(shims)}")
    return ProxmoxHostEntry(
        address=sshd.host,
        port=sshd.port,
        user=sshd.user,
        identity_file=sshd.client_key,
        known_hosts=sshd.known_hosts,
        pct=shims.pop(),
        containers=tuple(ContainerEntry(ct.ctid, runs_root / str(ct.ctid) / "runs") for ct in containers),
    )


def build_testbed(
    sshd: Sshd, containers: list[EmulatedContainer], workdir: Path, *, host: str = DEFAULT_HOST_NAME,
    default_host: str = "local",
) -> Testbed:
    """Create the runs dirs, write `workdir/inventory.yaml`, and return the assembled `Testbed`."""
    entry = host_entry(sshd, containers, workdir / "cts")
    runs_dirs = {ct.ctid: ct.runs_dir for ct in entry.containers}
    for path in runs_dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    inventory = write_inventory(workdir / "inventory.yaml", {host: entry}, default_host=default_host)
    return Testbed(host, inventory, sshd, tuple(containers), entry.pct, runs_dirs)
