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
