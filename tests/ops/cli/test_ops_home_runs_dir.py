"""Plain SSH hosts keep their runs under the LOGIN user's home: the default runs dir is `~/dflash-runs`, expanded by
the remote shell (`"$HOME"/dflash-runs`), so a non-root login (a `User` from ~/.ssh/config) can create it.
Containers keep `/root/dflash-runs` (`pct exec` runs as root)."""

from __future__ import annotations

import json
import shlex
import sys

from dflash_ops import inventory
from dflash_ops.runs import follow, lifecycle, runbooks
from dflash_ops.spec import SSH, Host, Target
from dflash_ops.ssh import transport


def _ssh_config(env, text: str) -> None:
    ssh = env.root / "home" / ".ssh"
    ssh.mkdir(exist_ok=True)
    (ssh / "config").write_text(text)


def test_ssh_config_user_gets_a_runs_dir_under_the_remote_home(ops_env):
    _ssh_config(ops_env, "Host gpubox\n  HostName 10.9.8.7\n  User bob\n")
    done = ops_env.sub("launch", "job", "--host", "gpubox", "--dry-run")
    assert done.returncode == 0, done.stderr
    prefix = "ssh bob@10.9.8.7:22: "
    assert done.stdout.startswith(prefix)
    argv = shlex.split(done.stdout[len(prefix):])
    assert argv[:2] == ["bash", "-c"]
    assert 'RUNS="$HOME"/dflash-runs\n' in argv[2] and "/root/dflash-runs" not in argv[2]
    ct = ops_env.sub("launch", "job", "--host", "gpubox", "--ct", "200", "--dry-run")
    assert ct.returncode == 0 and "RUNS=/root/dflash-runs\n" in shlex.split(ct.stdout[len(prefix):])[10]


def test_home_runs_dir_is_expanded_by_the_remote_shell_for_every_command(ops_env, tmp_path):
    """A plain-SSH target's scripts run by real bash (local transport) with HOME as the login would set it."""
    home = ops_env.root / "home"
    target = Target(Host(name="box", transport=SSH, python=sys.executable))
    assert target.runs_dir == "~/dflash-runs"
    s = lifecycle.Session(target, transport.LocalTransport())
    book = runbooks.load_runbook(ops_env.runbooks, "job")
    out = tmp_path / "out.json"
    spec = lifecycle.plan(s, book, name="homejob", extra_args=("--out", str(out), "--lines", "3", "--every", "0.01"))
    assert spec.run_dir.startswith("~/dflash-runs/homejob-")
    launched = lifecycle.launch(s, spec)
    real = home / "dflash-runs" / spec.run_id
    assert (real / "run.json").is_file() and (real / "pid").is_file()
    # the job got the absolute run dir (docs/contracts.md: `{run_dir}` is absolute) and runs in it
    got = json.loads(out.read_text())
    assert got["argv"][:2] == ["--run-dir", str(real)] and got["cwd"] == str(real)
    chunks: list[bytes] = []
    final = follow.follow(s, launched.status, start=0, emit=chunks.append, poll_s=0.02)
    assert final.state == "exited" and final.exit_code == 0
    assert b"".join(chunks) == (real / "output.log").read_bytes() and (real / "exit_code").read_text() == "0\n"
    [listed] = lifecycle.list_runs(s)
    assert listed.run_id == spec.run_id and listed.run_dir == spec.run_dir and listed.state == "exited"
    assert lifecycle.stop(s, listed).how == "not_running"
    assert not ops_env.runs_dir.exists()  # nothing landed in the local runs dir


def test_inventory_accepts_a_home_relative_runs_dir(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text("hosts:\n  box:\n    transport: ssh\n    user: bob\n    runs_dir: ~/work/runs/\n"
                 "  pve:\n    transport: proxmox\n")
    inv = inventory.load_inventory(p)
    assert inventory.resolve_target(inv, "box", None).runs_dir == "~/work/runs"
    assert Target(inv.host("pve")).runs_dir == "~/dflash-runs"   # on the PVE host itself (e.g. `status`)
    assert inventory.resolve_target(inv, "pve", "200").runs_dir == "/root/dflash-runs"
