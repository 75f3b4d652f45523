"""An ~/.ssh/config alias defined ONLY in an `Include`d file, used through the real CLI against the real loopback
sshd: the alias resolves to 127.0.0.1 and the fixture's port (trust-host records `[127.0.0.1]:PORT`), and the
fixture's user and key (the only login it accepts) come from the included file too. No inventory entry.
The same sshd is also the jump host of an alias whose `ProxyJump` names another included alias."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ssh
ALIAS = "pve-loop"
JUMPED = "pve-jumped"


def _cli(repo_root, cwd, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(repo_root), "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "dflash_ops", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def _split_config(home, sshd):
    ssh = home / ".ssh"
    (ssh / "config.d").mkdir(parents=True, mode=0o700)
    (ssh / "config").write_text("Include config.d/*.conf\nHost *\n  User nobody\n  Port 1\n")
    login = f"  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n  IdentityFile {sshd.client_key}\n"
    (ssh / "config.d" / "lab.conf").write_text(f"Host {ALIAS} jumpbox\n{login}")
    (ssh / "config.d" / "jumped.conf").write_text(f"Host {JUMPED}\n  ProxyJump jumpbox\n{login}")
    return ssh


def test_alias_from_an_included_file_connects(sshd, isolated_env, repo_root, tmp_path):
    ssh = _split_config(isolated_env, sshd)

    unknown = _cli(repo_root, tmp_path, "runs", "--host", ALIAS)
    assert unknown.returncode == 77 and "is unknown" in unknown.stderr, unknown.stderr
    trusted = _cli(repo_root, tmp_path, "trust-host", ALIAS, "--yes")
    assert trusted.returncode == 0, trusted.stderr
    assert (ssh / "known_hosts").read_text() == sshd.host_key_line + "\n"

    dry = _cli(repo_root, tmp_path, "launch", "smoke", "--host", ALIAS, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"ssh {sshd.user}@127.0.0.1:{sshd.port}: ")
    runs = _cli(repo_root, tmp_path, "runs", "--host", ALIAS, "--json")
    assert runs.returncode == 0, runs.stderr
    assert isinstance(json.loads(runs.stdout), list)


def test_proxyjump_from_an_included_file_carries_the_connection(sshd, isolated_env, repo_root, tmp_path):
    ssh = _split_config(isolated_env, sshd)
    (ssh / "known_hosts").write_text(sshd.host_key_line + "\n")  # jump host and target: the same sshd
    dry = _cli(repo_root, tmp_path, "launch", "smoke", "--host", JUMPED, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"ssh {sshd.user}@127.0.0.1:{sshd.port} (via jumpbox): ")

    logins = sshd.log_path.read_text().count("Accepted publickey")
    runs = _cli(repo_root, tmp_path, "runs", "--host", JUMPED, "--json")
    assert runs.returncode == 0, runs.stderr
    # one login to the jump host, one through its direct-tcpip channel to the target
    assert sshd.log_path.read_text().count("Accepted publickey") == logins + 2
    trusted = _cli(repo_root, tmp_path, "trust-host", JUMPED, "--yes")
    assert trusted.returncode == 0 and "already trusted" in trusted.stderr, trusted.stderr
    assert sshd.log_path.read_text().count("Accepted publickey") == logins + 3  # its handshake went via jumpbox


def _hops_config(home, sshd, *extra: str):
    """Aliases hop1, hop2 (127.0.0.1) and hop-lh (`localhost`: a known_hosts entry of its own) for the one sshd,
    and targets reached through them."""
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700, exist_ok=True)
    login = f"  Port {sshd.port}\n  User {sshd.user}\n  IdentityFile {sshd.client_key}\n"
    (ssh / "config").write_text(
        f"Host hop1 hop2 pve-2hop pve-via-chain\n  HostName 127.0.0.1\n{login}"
        f"Host hop-lh pve-lh\n  HostName localhost\n{login}"
        "Host pve-2hop\n  ProxyJump hop1,hop2\n"
        "Host pve-via-chain\n  ProxyJump hop2\nHost hop2\n  ProxyJump hop1\n"   # hop2's own ProxyJump applies
        "Host pve-lh\n  ProxyJump hop1,hop2\n" + "".join(extra))
    (ssh / "known_hosts").write_text(sshd.host_key_line + "\n")
    return ssh


def _logins(sshd) -> int:
    return sshd.log_path.read_text().count("Accepted publickey")


def test_two_hops_make_three_logins_each_key_checked(sshd, isolated_env, repo_root, tmp_path):
    ssh = _hops_config(isolated_env, sshd, "Host pve-badhop\n  HostName 127.0.0.1\n  ProxyJump hop1,hop-lh\n")
    for alias, via in (("pve-2hop", "hop1,hop2"), ("pve-via-chain", "hop1,hop2")):
        dry = _cli(repo_root, tmp_path, "launch", "smoke", "--host", alias, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert dry.stdout.startswith(f"ssh {sshd.user}@127.0.0.1:{sshd.port} (via {via}): ")
        before = _logins(sshd)
        runs = _cli(repo_root, tmp_path, "runs", "--host", alias, "--json")
        assert runs.returncode == 0, runs.stderr
        assert isinstance(json.loads(runs.stdout), list)
        assert _logins(sshd) == before + 3, alias  # hop 1, hop 2 through hop 1's channel, the target through hop 2's

    before = _logins(sshd)  # the second hop's key is unknown (`[localhost]:PORT` is not recorded): refused there
    refused = _cli(repo_root, tmp_path, "runs", "--host", "pve-badhop")
    assert refused.returncode == 77, refused.stderr
    assert refused.stderr.splitlines()[0] == (f"error: host key of jump host {sshd.user}@localhost:{sshd.port} "
                                              f"(hop-lh, hop 2 of 2) is unknown (not in {ssh / 'known_hosts'})")
    assert "-J hop1" in refused.stderr  # the hint reaches hop 2 through hop 1
    assert _logins(sshd) == before + 1  # hop 1 only: nothing logged in to the unchecked host


def test_trust_host_through_two_hops_records_only_the_target(sshd, isolated_env, repo_root, tmp_path):
    ssh = _hops_config(isolated_env, sshd)
    unknown = _cli(repo_root, tmp_path, "runs", "--host", "pve-lh")
    assert unknown.returncode == 77 and f"host key of {sshd.user}@localhost:{sshd.port} is unknown" in unknown.stderr
    before = _logins(sshd)
    trusted = _cli(repo_root, tmp_path, "trust-host", "pve-lh", "--yes")
    assert trusted.returncode == 0, trusted.stderr
    assert "(via hop1,hop2)" in trusted.stderr
    assert _logins(sshd) == before + 2  # the two hops; the target only shook hands
    entry = sshd.host_key_line.replace(f"[127.0.0.1]:{sshd.port}", f"[localhost]:{sshd.port}", 1)
    assert (ssh / "known_hosts").read_text() == f"{sshd.host_key_line}\n{entry}\n"
    assert _cli(repo_root, tmp_path, "runs", "--host", "pve-lh", "--json").returncode == 0
    assert _logins(sshd) == before + 5


BRIDGE = """\
import os, socket, sys, threading
host, port, user, name, pct, marker = sys.argv[1:]
with open(marker, "a") as f:
    f.write(" ".join(sys.argv[1:6]) + "\\n")
sock = socket.create_connection(("127.0.0.1", int(port)))  # wherever %h points: only this proxy reaches the sshd


def upstream():
    while data := os.read(0, 65536):
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)


threading.Thread(target=upstream, daemon=True).start()
while data := sock.recv(65536):
    os.write(1, data)
"""


def test_proxycommand_carries_the_connection_and_trust_host(sshd, isolated_env, repo_root, tmp_path):
    """`HostName pve-proxied.invalid` cannot be reached directly: only the ProxyCommand (a real process that
    bridges its stdin/stdout to the sshd and records the expanded tokens) gets there. The host key is recorded
    under the HostName, as ssh records it."""
    bridge, marker = tmp_path / "bridge.py", tmp_path / "proxied"
    bridge.write_text(BRIDGE)
    ssh = isolated_env / ".ssh"
    ssh.mkdir(mode=0o700)
    (ssh / "config").write_text(
        f"Host pve-proxied\n  HostName pve-proxied.invalid\n  Port {sshd.port}\n  User {sshd.user}\n"
        f"  IdentityFile {sshd.client_key}\n  ProxyCommand {sys.executable} {bridge} %h %p %r %n 100%% {marker}\n"
        "  ProxyJump ignored-because-later\n")
    command = f"{sys.executable} {bridge} pve-proxied.invalid {sshd.port} {sshd.user} pve-proxied 100% {marker}"
    dry = _cli(repo_root, tmp_path, "launch", "smoke", "--host", "pve-proxied", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"ssh {sshd.user}@pve-proxied.invalid:{sshd.port} (via ProxyCommand: {command}): ")

    unknown = _cli(repo_root, tmp_path, "runs", "--host", "pve-proxied")
    assert unknown.returncode == 77, unknown.stderr
    assert f"host key of {sshd.user}@pve-proxied.invalid:{sshd.port} is unknown" in unknown.stderr
    trusted = _cli(repo_root, tmp_path, "trust-host", "pve-proxied", "--yes")
    assert trusted.returncode == 0, trusted.stderr
    entry = sshd.host_key_line.replace(f"[127.0.0.1]:{sshd.port}", f"[pve-proxied.invalid]:{sshd.port}", 1)
    assert (ssh / "known_hosts").read_text() == entry + "\n"

    before = _logins(sshd)
    runs = _cli(repo_root, tmp_path, "runs", "--host", "pve-proxied", "--json")
    assert runs.returncode == 0, runs.stderr
    assert isinstance(json.loads(runs.stdout), list)
    assert _logins(sshd) == before + 1
    expanded = f"pve-proxied.invalid {sshd.port} {sshd.user} pve-proxied 100%"
    assert marker.read_text().splitlines() == [expanded] * 3  # the refused run, trust-host, runs


def test_a_proxycommand_that_dies_is_one_line_with_its_words_exit_69(sshd, isolated_env, repo_root, tmp_path):
    ssh = isolated_env / ".ssh"
    ssh.mkdir(mode=0o700)
    (ssh / "config").write_text(
        "Host pve-noproxy\n  HostName gone.invalid\n"
        "  ProxyCommand sh -c 'echo \"no route to $0\" >&2; exit 3' %h\n"
        f"Host pve-hop-by-cmd\n  HostName 127.0.0.1\n  ProxyJump cmdhop\n"
        "Host cmdhop\n  ProxyCommand sh -c 'exit 4'\n")
    done = _cli(repo_root, tmp_path, "runs", "--host", "pve-noproxy")
    assert done.returncode == 69, done.stderr
    assert done.stderr.splitlines()[0] == ("error: ProxyCommand for root@gone.invalid:22 exited with code 3 (no route "
                                           "to gone.invalid): sh -c 'echo \"no route to $0\" >&2; exit 3' gone.invalid")
    hop = _cli(repo_root, tmp_path, "runs", "--host", "pve-hop-by-cmd")
    assert hop.returncode == 69, hop.stderr
    assert hop.stderr.startswith("error: ProxyCommand for jump host root@cmdhop:22 (cmdhop) exited with code 4: ")


def test_inventory_jump_list_with_an_ssh_uri_hop(sshd, isolated_env, repo_root, tmp_path):
    """No ssh config at all: the inventory's `jump:` names two hops (the second an ssh:// URI); the identity and
    known_hosts of the entry serve every hop."""
    known = tmp_path / "known_hosts"
    lh = sshd.host_key_line.replace(f"[127.0.0.1]:{sshd.port}", f"[localhost]:{sshd.port}", 1)
    known.write_text(f"{sshd.host_key_line}\n{lh}\n")
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"hosts:\n  lab:\n    transport: ssh\n    address: 127.0.0.1\n    port: {sshd.port}\n"
                   f"    user: {sshd.user}\n    identity_file: {sshd.client_key}\n    known_hosts: {known}\n"
                   f"    jump: 127.0.0.1:{sshd.port},ssh://{sshd.user}@localhost:{sshd.port}\n")
    before = _logins(sshd)
    runs = _cli(repo_root, tmp_path, "--inventory", str(inv), "runs", "--host", "lab", "--json")
    assert runs.returncode == 0, runs.stderr
    assert _logins(sshd) == before + 3
