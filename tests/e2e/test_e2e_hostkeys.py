"""Reaching the host: unknown and changed host keys are refused (77) and start nothing, `trust-host` records the key
on first contact, a closed port is unreachable (69) at once, and a stopped or missing container is one clear error."""
from __future__ import annotations

import subprocess
import time

import pytest
import yaml

from support.sshd import free_port, keygen

pytestmark = pytest.mark.ssh
CONTAINERS = 2


def fingerprint(pub: str) -> str:
    """The SHA256 fingerprint as OpenSSH prints it, for comparison with what trust-host shows."""
    out = subprocess.run(["ssh-keygen", "-lf", pub], capture_output=True, text=True, check=True).stdout
    return out.split()[1]


def error_line(stderr: bytes) -> str:
    """The one `error: ...` line (launch first says what it is about to do)."""
    [line] = [ln for ln in stderr.decode().splitlines() if ln.startswith("error: ")]
    return line


def test_unknown_host_key_is_refused_and_nothing_starts(bed):
    ctid, sshd = bed.ct(0), bed.tb.sshd
    inv = bed.inventory_with("unknown", known_hosts=sshd.empty_known_hosts())
    before = bed.run_dirs(ctid)
    for args in (["launch", "job", *bed.target(ctid), "--name", "nokey"], ["runs", *bed.target(ctid)]):
        done = bed.cli(*args, inventory=inv)
        assert done.returncode == 77, done.stderr
        assert error_line(done.stderr).startswith(f"error: host key of {sshd.user}@{sshd.host}:{sshd.port} is unknown")
        assert b"hint: verify and record it: dflash-ops trust-host pve-test" in done.stderr
    assert bed.run_dirs(ctid) == before
    assert sshd.empty_known_hosts().read_bytes() == b""


def test_trust_host_on_first_contact_then_launch_works(bed):
    ctid, sshd = bed.ct(0), bed.tb.sshd
    known = bed.work / "first-contact" / "known_hosts"
    inv = bed.inventory_with("first", known_hosts=known)
    assert bed.cli("runs", *bed.target(ctid), inventory=inv).returncode == 77

    declined = bed.cli("trust-host", bed.tb.host, inventory=inv, input="n\n")
    assert declined.returncode == 2 and not known.exists()

    trusted = bed.proc("trust-host", bed.tb.host, "--yes", inventory=inv)
    assert trusted.returncode == 0, trusted.stderr
    assert fingerprint(str(sshd.host_key.with_suffix(".pub"))).encode() in trusted.stderr
    assert known.read_text() == sshd.host_key_line + "\n"

    doc = bed.launch(ctid, "--lines", "1", name="trusted", inventory=inv)
    assert doc["matched_line"] == "job started"
    again = bed.cli("trust-host", bed.tb.host, "--yes", inventory=inv)
    assert again.returncode == 0 and b"already trusted" in again.stderr
    assert known.read_text() == sshd.host_key_line + "\n"


def test_changed_host_key_is_refused_with_77_and_trust_host_will_not_overwrite_it(bed):
    ctid, sshd = bed.ct(0), bed.tb.sshd
    impostor = bed.work / "impostor_key"
    keygen(impostor, "impostor")
    key_type, key_b64 = impostor.with_suffix(".pub").read_text().split()[:2]
    known = bed.work / "changed_known_hosts"
    known.write_text(f"[{sshd.host}]:{sshd.port} {key_type} {key_b64}\n")
    recorded = known.read_bytes()
    inv = bed.inventory_with("changed", known_hosts=known)
    before = bed.run_dirs(ctid)

    done = bed.proc("launch", "job", *bed.target(ctid), "--name", "changed", inventory=inv)
    assert done.returncode == 77, done.stderr
    assert f"host key of {sshd.user}@{sshd.host}:{sshd.port} CHANGED".encode() in done.stderr
    assert bed.run_dirs(ctid) == before

    refused = bed.cli("trust-host", bed.tb.host, "--yes", inventory=inv)
    assert refused.returncode == 77 and b"records a DIFFERENT key" in refused.stderr
    assert known.read_bytes() == recorded


def test_closed_port_is_unreachable_69_without_waiting_for_the_connect_timeout(bed):
    ctid = bed.ct(0)
    inv = bed.inventory_with("closed", port=free_port(), connect_timeout_s=60)
    port = yaml.safe_load(inv.read_text())["hosts"][bed.tb.host]["port"]
    for args in (["runs", *bed.target(ctid)], ["launch", "job", *bed.target(ctid), "--name", "closed"]):
        t0 = time.monotonic()
        done = bed.proc(*args, inventory=inv)
        elapsed = time.monotonic() - t0
        assert done.returncode == 69, done.stderr
        assert error_line(done.stderr) == f"error: cannot connect to root@127.0.0.1:{port}: " \
                                          f"Unable to connect to port {port} on 127.0.0.1"
        assert elapsed < 30, f"a refused connection took {elapsed:.1f} s (the connect timeout is 60 s)"
    assert bed.run_dirs(ctid, "closed") == []


def test_stopped_and_missing_containers_are_one_clear_error(bed):
    ct = bed.container(1)
    ctid = ct.ctid
    ct.stop()
    for args, what in ((["runs", *bed.target(ctid)], "listing runs"),
                       (["launch", "job", *bed.target(ctid), "--name", "down"], "launching down-")):
        done = bed.cli(*args)
        assert done.returncode == 1, done.stderr
        err = done.stderr.decode()
        assert error_line(done.stderr).startswith(f"error: {what}")
        assert error_line(done.stderr).endswith(f"on pve-test/ct{ctid} failed with exit code 255")
        assert f"  | container '{ctid}' not running!" in err.splitlines()
        assert "Traceback" not in err
    assert bed.run_dirs(ctid) == []

    ct.destroy()
    done = bed.cli("runs", *bed.target(ctid))
    assert done.returncode == 1
    assert f"  | Configuration file 'nodes/pve/lxc/{ctid}.conf' does not exist" in done.stderr.decode().splitlines()


def test_jump_host_carries_launch_and_runs_with_its_key_checked_too(bed):
    ctid, sshd = bed.ct(0), bed.tb.sshd
    inv = bed.inventory_with("jump", jump=f"{sshd.user}@{sshd.host}:{sshd.port}")
    logins = sshd.log_path.read_text().count("Accepted publickey")
    runs = bed.cli("runs", *bed.target(ctid), "--json", inventory=inv)
    assert runs.returncode == 0, runs.stderr
    # one login to the jump host, one through its direct-tcpip channel to the target
    assert sshd.log_path.read_text().count("Accepted publickey") == logins + 2

    doc = bed.launch(ctid, "--lines", "1", name="jumped", inventory=inv)
    assert doc["matched_line"] == "job started"
    unknown = bed.inventory_with("jump-unknown", jump=f"{sshd.user}@{sshd.host}:{sshd.port}",
                                 known_hosts=sshd.empty_known_hosts())
    refused = bed.cli("runs", *bed.target(ctid), inventory=unknown)
    assert refused.returncode == 77 and b"is unknown" in refused.stderr


def test_trust_host_goes_through_the_jump_host_whose_key_must_be_trusted_first(bed):
    """The target is `localhost` (its own known_hosts entry) reached through the jump host 127.0.0.1: trust-host
    logs in to the jump host (one `Accepted publickey`; a direct handshake logs in nowhere) and records the
    target's key only; with the jump host's key unknown it says so, names the fix, and writes nothing."""
    ctid, sshd = bed.ct(0), bed.tb.sshd
    jump = f"{sshd.user}@{sshd.host}:{sshd.port}"
    target_entry = f"[localhost]:{sshd.port}"
    known = bed.work / "jump-trust" / "known_hosts"
    known.parent.mkdir()
    known.write_text(sshd.host_key_line + "\n")                  # the jump host (127.0.0.1) only
    inv = bed.inventory_with("jump-trust", address="localhost", jump=jump, known_hosts=known)
    assert bed.cli("runs", *bed.target(ctid), inventory=inv).returncode == 77   # localhost itself is unknown

    logins = sshd.log_path.read_text().count("Accepted publickey")
    trusted = bed.proc("trust-host", bed.tb.host, "--yes", inventory=inv)
    assert trusted.returncode == 0, trusted.stderr
    assert sshd.log_path.read_text().count("Accepted publickey") == logins + 1
    assert f"{target_entry} presents".encode() in trusted.stderr and f"via {jump}".encode() in trusted.stderr
    assert known.read_text() == sshd.host_key_line + "\n" + sshd.host_key_line.replace(
        f"[{sshd.host}]:{sshd.port}", target_entry, 1) + "\n"
    assert bed.launch(ctid, "--lines", "1", name="jumptrust", inventory=inv)["matched_line"] == "job started"

    untrusted = bed.work / "jump-untrusted" / "known_hosts"
    untrusted.parent.mkdir()
    untrusted.write_text("")
    inv2 = bed.inventory_with("jump-untrusted", address="localhost", jump=jump, known_hosts=untrusted)
    refused = bed.cli("trust-host", bed.tb.host, "--yes", inventory=inv2)
    assert refused.returncode == 77, refused.stderr
    assert error_line(refused.stderr).startswith(f"error: host key of jump host {jump} is unknown")
    assert f"hint: record the jump host's key in {untrusted} first".encode() in refused.stderr
    assert untrusted.read_text() == ""


def test_trust_host_yes_will_not_add_a_key_of_a_new_type_beside_a_pinned_one_unless_told(bed):
    """known_hosts pins an ecdsa key for the host, which presents ed25519: OpenSSH warns here, so trust-host
    refuses (77) with one line naming the flag, writes nothing, and with the flag adds the key beside the pin."""
    sshd = bed.tb.sshd
    pinned = bed.work / "pinned_ecdsa"
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(pinned)], check=True)
    key_type, key_b64 = pinned.with_suffix(".pub").read_text().split()[:2]
    known = bed.work / "other_type_known_hosts"
    known.write_text(f"[{sshd.host}]:{sshd.port} {key_type} {key_b64}\n")
    recorded = known.read_bytes()
    inv = bed.inventory_with("other-type", known_hosts=known)

    refused = bed.cli("trust-host", bed.tb.host, "--yes", inventory=inv)
    assert refused.returncode == 77, refused.stderr
    err = refused.stderr.decode()
    assert error_line(refused.stderr).startswith(f"error: [{sshd.host}]:{sshd.port} presents a ssh-ed25519 key")
    assert f"pins a key of another type for it ({key_type} {fingerprint(str(pinned.with_suffix('.pub')))})" in err
    assert "hint: if the host really has this key too, pass --accept-new-key-type to add it" in err.splitlines()
    assert known.read_bytes() == recorded

    added = bed.cli("trust-host", bed.tb.host, "--yes", "--accept-new-key-type", inventory=inv)
    assert added.returncode == 0, added.stderr
    assert b"warning: " in added.stderr
    assert known.read_text() == recorded.decode() + sshd.host_key_line + "\n"
    assert bed.cli("runs", *bed.target(bed.ct(0)), inventory=inv).returncode == 0


def _pub(bed, name: str) -> str:
    """`type base64` of a fresh ed25519 key."""
    keygen(bed.work / name, name)
    return " ".join((bed.work / f"{name}.pub").read_text().split()[:2])


def test_known_hosts_markers_and_a_truncated_line_are_read_as_openssh_reads_them(bed):
    """An @cert-authority line, an @revoked line (another key), a truncated copy of the host's line, an unknown
    marker and comments, then the host's right key: OpenSSH connects, and so does every command (paramiko's own
    reader raised on the first marker: exit 1 and a traceback); trust-host reads the file the same way."""
    ctid, sshd = bed.ct(0), bed.tb.sshd
    known = bed.work / "marked_known_hosts"
    known.write_text(f"# markers first\n@cert-authority *.example.com {_pub(bed, 'ca')}\n"
                     f"@revoked * {_pub(bed, 'revoked')}\n{sshd.host_key_line[:60]}\n@bogus * {_pub(bed, 'bogus')}\n"
                     f"\n{sshd.host_key_line}\n")
    inv = bed.inventory_with("marked", known_hosts=known)
    done = bed.proc("runs", *bed.target(ctid), "--json", inventory=inv)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    again = bed.cli("trust-host", bed.tb.host, "--yes", inventory=inv)
    assert again.returncode == 0 and b"already trusted" in again.stderr, again.stderr
    assert bed.launch(ctid, "--lines", "1", name="marked", inventory=inv)["matched_line"] == "job started"


def test_a_revoked_host_key_is_refused_in_one_line_even_beside_its_plain_line(bed):
    ctid, sshd = bed.ct(0), bed.tb.sshd
    key_type, key_b64 = sshd.host_key_line.split()[1:3]
    known = bed.work / "revoked_known_hosts"
    known.write_text(f"{sshd.host_key_line}\n@revoked * {key_type} {key_b64}\n")
    recorded = known.read_bytes()
    inv = bed.inventory_with("revoked", known_hosts=known)
    before = bed.run_dirs(ctid)
    want = f"({key_type} {fingerprint(str(sshd.host_key.with_suffix('.pub')))}) is REVOKED at {known}:2"
    for args in (["runs", *bed.target(ctid)], ["launch", "job", *bed.target(ctid), "--name", "revoked"]):
        done = bed.proc(*args, inventory=inv)
        assert done.returncode == 77, done.stderr
        assert error_line(done.stderr) == f"error: host key of {sshd.user}@{sshd.host}:{sshd.port} {want}"
        assert b"Traceback" not in done.stderr
    assert bed.run_dirs(ctid) == before
    refused = bed.cli("trust-host", bed.tb.host, "--yes", inventory=inv)
    assert refused.returncode == 77 and b"lists as @revoked; nothing written" in refused.stderr, refused.stderr
    assert known.read_bytes() == recorded


def test_a_host_vouched_for_only_by_a_cert_authority_is_refused_naming_the_line_until_trust_host_pins_it(bed):
    """paramiko does not check host certificates: the @cert-authority line cannot make the host's key trusted, so
    the error names that line and the hint the fix (`trust-host` pins the plain key, after which it connects)."""
    ctid, sshd = bed.ct(0), bed.tb.sshd
    known = bed.work / "ca_known_hosts"
    known.write_text(f"@cert-authority [{sshd.host}]:* {_pub(bed, 'host-ca')}\n")
    inv = bed.inventory_with("ca-only", known_hosts=known)
    done = bed.proc("runs", *bed.target(ctid), inventory=inv)
    assert done.returncode == 77, done.stderr
    assert error_line(done.stderr) == (f"error: host key of {sshd.user}@{sshd.host}:{sshd.port} is vouched for only "
                                       f"by the @cert-authority line {known}:1, and dflash-ops does not check host "
                                       f"certificates")
    assert b"hint: verify and record it: dflash-ops trust-host pve-test" in done.stderr
    assert bed.cli("trust-host", bed.tb.host, "--yes", inventory=inv).returncode == 0
    assert known.read_text().endswith(sshd.host_key_line + "\n")
    assert bed.cli("runs", *bed.target(ctid), inventory=inv).returncode == 0
