"""`trust-host` and host key hints against the real sshd: stdin at its end answers the prompt "no" (exit 2, nothing
written), the `ssh-keygen -R` hints work pasted into a shell with a space in the known_hosts path, and an ssh config
IdentityFile that is not there is a config error (78), not an unreachable host."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ssh


def ops(*args: str) -> subprocess.CompletedProcess:
    """The real CLI process, stdin at its end as under cron or `< /dev/null` (no terminal)."""
    return subprocess.run([sys.executable, "-m", "dflash_ops", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=dict(os.environ), timeout=60)


@pytest.fixture
def box(sshd, tmp_path):
    """An inventory host `box` at the sshd whose known_hosts lies under a directory with a space in its name."""
    kh = tmp_path / "my keys" / "known_hosts"
    kh.parent.mkdir()
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  box:\n    transport: ssh\n    address: 127.0.0.1\n    port: {sshd.port}\n"
                   f"    user: {sshd.user}\n    identity_file: {sshd.client_key}\n    known_hosts: {kh}\n")
    return inv, kh, f"[127.0.0.1]:{sshd.port}"


def _other_key_line(tmp_path, entry: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    kind, b64 = (tmp_path / "other.pub").read_text().split()[:2]
    return f"{entry} {kind} {b64}\n"


def test_stdin_at_its_end_answers_no(box, sshd):
    inv, kh, entry = box
    done = ops("--inventory", str(inv), "trust-host", "box")
    assert done.returncode == 2, done.stderr  # click's "Aborted!" and exit 1 before
    assert done.stderr.splitlines()[-1] == "error: not trusted; nothing written"
    assert "Aborted" not in done.stderr and not kh.exists()
    assert f"{entry} presents ssh-ed25519 key SHA256:" in done.stderr
    trusted = ops("--inventory", str(inv), "trust-host", "box", "--yes")
    assert trusted.returncode == 0, trusted.stderr
    assert kh.read_text().split()[:2] == sshd.host_key_line.split()[:2]


def _hint_command(stderr: str, before: str, after: str) -> str:
    hint = next(line for line in stderr.splitlines() if line.startswith("hint: "))
    return hint.split(before, 1)[1].split(after, 1)[0]


@pytest.mark.parametrize("args, before, after", [
    (["runs", "--host", "box"], "if the change is expected: ", ", then "),         # transport's hint
    (["trust-host", "box", "--yes"], "if you know why it changed: ", ", then retry"),  # trust-host's
])
def test_the_ssh_keygen_hint_works_pasted_with_a_space_in_the_path(box, tmp_path, args, before, after):
    inv, kh, entry = box
    kh.write_text(_other_key_line(tmp_path, entry))
    refused = ops("--inventory", str(inv), *args)
    assert refused.returncode == 77, refused.stderr
    command = _hint_command(refused.stderr, before, after)
    assert command == shlex.join(["ssh-keygen", "-R", entry, "-f", str(kh)])
    pasted = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30)
    assert pasted.returncode == 0, pasted.stderr
    assert entry not in kh.read_text()


def test_a_missing_ssh_config_identity_file_is_exit_78(sshd, isolated_env):
    """ssh skips a missing IdentityFile; paramiko raises FileNotFoundError, which read as "cannot connect" (69)."""
    ssh = isolated_env / ".ssh"
    ssh.mkdir()
    (ssh / "known_hosts").write_text(sshd.host_key_line + "\n")
    (ssh / "config").write_text(f"Host boxalias\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
                                "  IdentityFile ~/.ssh/no_such_key\n")
    done = ops("runs", "--host", "boxalias")
    assert done.returncode == 78, done.stderr
    assert done.stderr.splitlines() == [
        f"error: identity file {ssh}/no_such_key for {sshd.user}@127.0.0.1:{sshd.port} does not exist",
        "hint: fix IdentityFile in ~/.ssh/config, or set identity_file in the inventory"]
