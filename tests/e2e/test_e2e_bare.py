"""`--host 127.0.0.1 --ct N` with NO inventory entry for that address: port, user and identity come from
~/.ssh/config (or `user@host:port` and ~/.ssh/id_ed25519), the host key from `trust-host` into ~/.ssh/known_hosts,
and the container defaults (pct /usr/sbin/pct, runs dir /root/dflash-runs, python3) apply. The server is a
PveSshd (see pve_sshd.py), the container's /root a bind mount of a test directory, so this machine's /root is
never written.
"""
from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from pve_sshd import PveSshd

pytestmark = pytest.mark.ssh
CONTAINERS = 1
NO_HOSTS = "default_host: local\nhosts:\n  local: {transport: local}\n"


@pytest.fixture(scope="module")
def pve(bed):
    """A PveSshd for the bed's containers, and the container's /root bound to `bed.work/ct-root`."""
    server = PveSshd(bed.work / "pve-sshd", bed.tb.pct)
    ct_root = bed.work / "ct-root"
    ct_root.mkdir()
    mounted = bed.container(0).pct_exec("mount", "--bind", str(ct_root), "/root")
    assert mounted.returncode == 0, mounted.stderr
    try:
        yield server.start(), ct_root
    finally:
        server.stop()


def test_bare_address_with_ssh_config_trust_host_launch_tail_runs(bed, pve, isolated_env):
    server, ct_root = pve
    ctid, gate = str(bed.ct(0)), bed.gate("bare")
    inv = bed.work / "no-hosts.yaml"
    inv.write_text(NO_HOSTS)
    ssh_dir = isolated_env / ".ssh"
    ssh_dir.mkdir(mode=0o700)
    (ssh_dir / "config").write_text(f"Host 127.0.0.1\n  Port {server.port}\n  User {server.user}\n"
                                    f"  IdentityFile {server.client_key}\n")
    bare = ["--host", "127.0.0.1", "--ct", ctid]

    unknown = bed.cli("runs", *bare, inventory=inv)
    assert unknown.returncode == 77 and b"is unknown" in unknown.stderr
    trusted = bed.cli("trust-host", "127.0.0.1", "--yes", inventory=inv)
    assert trusted.returncode == 0, trusted.stderr
    assert (ssh_dir / "known_hosts").read_text() == server.host_key_line + "\n"

    dry = bed.cli("launch", "job", *bare, "--dry-run", inventory=inv)
    prefix = f"ssh {server.user}@127.0.0.1:{server.port}: ".encode()
    assert dry.returncode == 0 and dry.stdout.startswith(prefix)
    assert shlex.split(dry.stdout[len(prefix):-1].decode())[:4] == ["/usr/sbin/pct", "exec", ctid, "--"]

    launched = bed.proc("launch", "job", *bare, "--json", "--", "--gate", str(gate), "--lines", "3", inventory=inv)
    assert launched.returncode == 0, launched.stderr
    doc = json.loads(launched.stdout)
    run_id = doc["run_id"]
    assert (doc["host"], doc["ct"], doc["run_dir"]) == ("127.0.0.1", ctid, f"/root/dflash-runs/{run_id}")
    assert json.loads((ct_root / "dflash-runs" / run_id / "run.json").read_text())["argv"][0] == "python3"
    assert not (Path("/root/dflash-runs") / run_id).exists()

    gate.touch()
    tail = bed.proc("tail", run_id, *bare, "-n", "100", inventory=inv)
    assert tail.returncode == 0, tail.stderr
    assert tail.stdout == b"job started\nline 0\nline 1\nline 2\n"

    # No ~/.ssh/config at all: `user@host:port` and the default identity file reach the same runs.
    (ssh_dir / "config").unlink()
    shutil.copyfile(server.client_key, ssh_dir / "id_ed25519")
    (ssh_dir / "id_ed25519").chmod(0o600)
    runs = bed.cli("runs", "--host", f"{server.user}@127.0.0.1:{server.port}", "--ct", ctid, "--json",
                   inventory=inv)
    assert runs.returncode == 0, runs.stderr
    assert [(r["run_id"], r["state_text"]) for r in json.loads(runs.stdout)] == [(run_id, "exited 0")]
