"""The test bed's inventory document, as pure data (no sshd, no root)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from support.inventory import ContainerEntry, ProxmoxHostEntry, inventory_document, write_inventory


def entry(*ctids: int) -> ProxmoxHostEntry:
    return ProxmoxHostEntry(
        address="127.0.0.1", port=2222, user="root", identity_file=Path("/k/id"), known_hosts=Path("/k/kh"),
        pct=Path("/s/pct"), containers=tuple(ContainerEntry(c, Path(f"/r/{c}"), python="/py", env={}) for c in ctids),
    )


def test_document_follows_the_inventory_schema():
    doc = inventory_document({"pve-test": entry(200, 201)})
    assert doc == {
        "default_host": "local",
        "hosts": {
            "local": {"transport": "local"},
            "pve-test": {
                "transport": "proxmox", "address": "127.0.0.1", "port": 2222, "user": "root",
                "identity_file": "/k/id", "known_hosts": "/k/kh", "pct": "/s/pct",
                "containers": {200: {"runs_dir": "/r/200", "python": "/py", "env": {}},
                               201: {"runs_dir": "/r/201", "python": "/py", "env": {}}},
            },
        },
    }


def test_written_yaml_reads_back_with_integer_ctids(tmp_path):
    path = write_inventory(tmp_path / "inv.yaml", {"pve-test": entry(200)}, default_host="pve-test")
    doc = yaml.safe_load(path.read_text())
    assert doc["default_host"] == "pve-test"
    assert list(doc["hosts"]["pve-test"]["containers"]) == [200]


def test_unknown_default_host_is_rejected():
    with pytest.raises(ValueError, match="default_host 'nope'"):
        inventory_document({"pve-test": entry(200)}, default_host="nope")
