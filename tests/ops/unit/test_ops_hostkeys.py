"""known_hosts handling behind `trust-host` and RejectPolicy, with real keys from ssh-keygen."""

from __future__ import annotations

import subprocess

import paramiko
import pytest

from dflash_ops.spec import Host
from dflash_ops.ssh import connection, endpoint, hostkeys


def _key(tmp_path, name: str) -> paramiko.PKey:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    return paramiko.Ed25519Key.from_private_key_file(str(tmp_path / name))


def test_entry_spelling_follows_openssh():
    assert hostkeys.host_key_entry("10.1.2.6", 22) == "10.1.2.6"
    assert hostkeys.host_key_entry("127.0.0.1", 2222) == "[127.0.0.1]:2222"


def test_new_then_same_then_changed(tmp_path):
    kh = tmp_path / "ssh" / "known_hosts"
    key, other = _key(tmp_path, "a"), _key(tmp_path, "b")
    assert hostkeys.known_key_status(kh, "[h]:2222", key) == "new"
    hostkeys.append_known_host(kh, "[h]:2222", key)
    assert kh.stat().st_mode & 0o777 == 0o600 and (kh.parent.stat().st_mode & 0o777) == 0o700
    assert hostkeys.known_key_status(kh, "[h]:2222", key) == "same"
    assert hostkeys.known_key_status(kh, "[h]:2222", other) == "changed"
    assert hostkeys.known_key_status(kh, "[h]:2223", other) == "new"
    # what paramiko's RejectPolicy client will load is what we wrote
    assert paramiko.HostKeys(str(kh)).lookup("[h]:2222")["ssh-ed25519"] == key


def test_a_key_of_a_type_not_pinned_beside_a_pinned_one_is_its_own_status(tmp_path):
    kh = tmp_path / "known_hosts"
    pinned = _key(tmp_path, "ed")
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(tmp_path / "ec")], check=True)
    ecdsa = paramiko.ECDSAKey.from_private_key_file(str(tmp_path / "ec"))
    hostkeys.append_known_host(kh, "[h]:2222", pinned)
    assert hostkeys.known_key_status(kh, "[h]:2222", ecdsa) == "other_type"
    assert hostkeys.known_keys(kh, "[h]:2222") == [("ssh-ed25519", hostkeys.key_fingerprint(pinned))]


def test_fingerprint_matches_ssh_keygen(tmp_path):
    key = _key(tmp_path, "k")
    want = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(tmp_path / "k.pub")], check=True,
                          capture_output=True, text=True).stdout.split()[1]
    assert hostkeys.key_fingerprint(key) == want


def test_endpoint_defaults_and_inventory_values(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert endpoint.resolve_endpoint(Host(name="10.1.2.6", transport="proxmox", address="10.1.2.6")) == \
        ("10.1.2.6", 22, "root", None)
    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    (ssh / "config").write_text("Host pve1\n  HostName 10.9.9.9\n  Port 2200\n  User ops\n  IdentityFile ~/.ssh/k\n")
    assert endpoint.resolve_endpoint(Host(name="pve1", transport="proxmox", address="pve1")) == \
        ("10.9.9.9", 2200, "ops", str(tmp_path / ".ssh" / "k"))
    assert endpoint.resolve_endpoint(Host(name="pve1", transport="proxmox", address="pve1", port=22, user="root"))[1:3] \
        == (22, "root")


def test_unreachable_host_is_exit_69_class():
    from dflash_ops.errors import HostUnreachable

    with pytest.raises(HostUnreachable):
        connection.fetch_host_key("127.0.0.1", 1, timeout_s=2)
