"""known_hosts handling behind `trust-host` and the host key checks, with real keys from ssh-keygen and OpenSSH's own
lookup (`ssh-keygen -F`) to compare the reader with."""

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


# -- known_hosts read as OpenSSH reads it ---------------------------------------------------------------------
def _pub(tmp_path, name: str, kind: str = "ed25519") -> str:
    """`type base64` of a fresh key from ssh-keygen."""
    if not (tmp_path / f"{name}.pub").exists():
        subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(tmp_path / name)], check=True)
    return " ".join((tmp_path / f"{name}.pub").read_text().split()[:2])


def _openssh_finds(path, name: str) -> dict[int, str]:
    """line number -> "" / "CA" / "REVOKED": the lines OpenSSH's own lookup (`ssh-keygen -F`) matches for `name`."""
    out = subprocess.run(["ssh-keygen", "-F", name, "-f", str(path)], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        if line.startswith(f"# Host {name} found: line "):
            number, _, mark = line.removeprefix(f"# Host {name} found: line ").partition(" ")
            found[int(number)] = mark.strip()
    return found


def test_host_patterns_negation_ports_hashes_and_markers_match_as_openssh_matches_them(tmp_path):
    a, b, c = _pub(tmp_path, "a"), _pub(tmp_path, "b"), _pub(tmp_path, "c", "ecdsa")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"# a comment\n\n@cert-authority *.example.com {a}\n@revoked *.lab {b}\n[127.0.0.1]:2222 {a}\n"
                  f"*.lab,!bad.lab {b}\nh?,10.0.0.* {c}\nfoo.lab {a}\n  Spaced.Lab {c} a comment\n"
                  f"[10.1.2.6]:* {a}\n")
    hashed = tmp_path / "hashed_known_hosts"
    hashed.write_text(kh.read_text())
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(hashed)], check=True, capture_output=True)
    assert "|1|" in hashed.read_text()
    names = ["[127.0.0.1]:2222", "127.0.0.1", "x.lab", "bad.lab", "foo.lab", "hz", "h", "10.0.0.7",
             "a.example.com", "spaced.lab", "[10.1.2.6]:2200", "10.1.2.6", "other"]
    for path in (kh, hashed):
        known = hostkeys.read_known_hosts(path)
        for name in names:
            ours = {ln.lineno: {None: "", hostkeys.CERT_AUTHORITY: "CA", hostkeys.REVOKED: "REVOKED"}[ln.marker]
                    for ln in known.lines if ln.matches(name)}
            assert ours == _openssh_finds(path, name), (path.name, name)
        # ssh lowercases the host name before its lookup (`ssh-keygen -F` does not, so it is not asked here)
        assert [ln.matches("FOO.LAB") for ln in known.lines] == [ln.matches("foo.lab") for ln in known.lines]


def test_lines_openssh_skips_are_skipped_and_no_line_is_a_traceback(tmp_path):
    a = _pub(tmp_path, "a")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"@cert-authority * {a}\n@revoked * {a[:-8]}\nhost {a[:40]}\n@bogus host {a}\nhost ssh-ed25519\n"
                  f"host ssh-unknown-type AAAA\n|1|notbase64|x {a}\nhost ssh-rsa {a.split()[1]}\n\n# host {a}\n"
                  f"host {a}\n")
    known = hostkeys.read_known_hosts(kh)
    assert [(ln.lineno, ln.marker) for ln in known.lines] == [(1, hostkeys.CERT_AUTHORITY), (11, None)]
    assert hostkeys.read_known_hosts(tmp_path / "missing").lines == ()
    # paramiko's own reader raises on the first line: what every command did with such a file
    with pytest.raises(paramiko.hostkeys.InvalidHostKey):
        paramiko.HostKeys(str(kh))


def test_a_revoked_key_is_refused_and_a_ca_only_host_says_certificates_are_not_checked(tmp_path):
    a, b = _pub(tmp_path, "a"), _pub(tmp_path, "b")
    key_a = paramiko.Ed25519Key.from_private_key_file(str(tmp_path / "a"))
    kh = tmp_path / "known_hosts"
    kh.write_text(f"h {a}\n@revoked * {a}\n@cert-authority ca.lab {b}\n")
    known = hostkeys.read_known_hosts(kh)
    assert known.plain_keys("h") == []
    assert str(known.refusal("h", key_a)) == f"({key_a.get_name()} {hostkeys.key_fingerprint(key_a)}) is REVOKED " \
                                             f"at {kh}:2"
    ca = known.refusal("ca.lab", paramiko.Ed25519Key.from_private_key_file(str(tmp_path / "b")))
    assert ca.reason.startswith(f"is vouched for only by the @cert-authority line {kh}:3") and ca.hint is None
    assert known.refusal("other", key_a) is not None and known.refusal("other", key_a).reason.endswith(":2")
    kh.write_text(f"h {a}\n@revoked other {a}\n")
    assert hostkeys.read_known_hosts(kh).plain_keys("h") == [key_a] and \
        hostkeys.read_known_hosts(kh).refusal("h", key_a) is None
    assert hostkeys.known_key_status(kh, "other", key_a) == "revoked"
