"""The real CLI process with a ~/.ssh/config split over `Include`d files: aliases found there are hosts, their
HostName/Port/User reach the SSH command, and a broken Include is one `error:` line with exit 78 (config)."""

from __future__ import annotations

import json
from pathlib import Path


def _ssh_dir(env) -> Path:
    ssh = env.root / "home" / ".ssh"
    (ssh / "config.d").mkdir(parents=True, exist_ok=True)
    return ssh


def test_alias_from_an_included_file_reaches_the_ssh_command(ops_env):
    ssh = _ssh_dir(ops_env)
    (ssh / "config").write_text("Include config.d/*.conf\nHost *\n  User nobody-default\n")
    (ssh / "config.d" / "lab.conf").write_text("Host gpubox\n  HostName 10.9.8.7\n  Port 2200\n  User bob\n")
    done = ops_env.sub("launch", "job", "--host", "gpubox", "--ct", "200", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ssh bob@10.9.8.7:2200: ")

    inv = ops_env.root / "inv.yaml"  # an inventory `address:` may name the alias too
    inv.write_text("hosts:\n  lab:\n    transport: ssh\n    address: gpubox\n    user: alice\n")
    named = ops_env.sub("--inventory", str(inv), "launch", "job", "--host", "lab", "--dry-run")
    assert named.returncode == 0, named.stderr
    assert named.stdout.startswith("ssh alice@10.9.8.7:2200: ")  # the inventory's user wins over ssh config


def test_host_star_does_not_make_a_word_a_host(ops_env):
    ssh = _ssh_dir(ops_env)
    (ssh / "config").write_text("Include config.d/*\nHost *\n  User everyone\n")
    (ssh / "config.d" / "w.conf").write_text("Host pve* !pve-old\n  Port 2200\n")
    for word in ("randomword", "pve-old", "pve1"):
        done = ops_env.sub("runs", "--host", word)
        assert done.returncode == 2, (word, done.stderr)
        assert done.stderr.startswith(f"error: unknown host {word!r}")


def test_include_cycle_is_exit_78_with_one_line(ops_env):
    ssh = _ssh_dir(ops_env)
    (ssh / "config").write_text("Host gpubox\n  HostName 10.9.8.7\nInclude config.d/loop.conf\n")
    (ssh / "config.d" / "loop.conf").write_text("Include ~/.ssh/config\n")
    done = ops_env.sub("runs", "--host", "gpubox")
    assert done.returncode == 78, done.stderr
    first, *rest = done.stderr.splitlines()
    assert first == (f"error: {ssh}/config.d/loop.conf:1: ssh config Include cycle: {ssh}/config -> "
                     f"{ssh}/config.d/loop.conf -> {ssh}/config")
    assert rest == ["hint: remove the Include that leads back to a file already being read"]
    as_json = ops_env.sub("runs", "--host", "10.1.2.3", "--json")  # an address still resolves through the config
    assert as_json.returncode == 78
    assert json.loads(as_json.stdout)["error"]["code"] == "config"


def test_single_hop_proxyjump_is_the_jump_host_unless_the_inventory_names_one(ops_env):
    ssh = _ssh_dir(ops_env)
    (ssh / "config").write_text("Include config.d/*\n")
    (ssh / "config.d" / "j.conf").write_text(
        "Host gpubox\n  HostName 10.9.8.7\n  ProxyJump bastion\n"
        "Host direct\n  HostName 10.9.8.8\n  ProxyJump none\n"
        "Host twohops\n  HostName 10.9.8.9\n  ProxyJump bastion,other\n"
        "Host chained\n  HostName 10.9.8.10\n  ProxyJump gpubox\n")
    dry = ops_env.sub("launch", "job", "--host", "gpubox", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.startswith("ssh root@10.9.8.7:22 (via bastion): "), dry.stderr
    direct = ops_env.sub("launch", "job", "--host", "direct", "--dry-run")
    assert direct.returncode == 0 and direct.stdout.startswith("ssh root@10.9.8.8:22: "), direct.stderr

    two = ops_env.sub("launch", "job", "--host", "twohops", "--dry-run")
    assert two.returncode == 2
    assert two.stderr.splitlines()[0] == ("error: ~/.ssh/config ProxyJump 'bastion,other' of 'twohops': dflash-ops "
                                          "supports one [user@]host[:port] hop only")
    chained = ops_env.sub("launch", "job", "--host", "chained", "--dry-run")
    assert chained.returncode == 2
    assert chained.stderr.startswith("error: jump host 'gpubox' has a ProxyJump of its own in ~/.ssh/config")

    inv = ops_env.root / "inv.yaml"
    inv.write_text("hosts:\n  lab:\n    transport: ssh\n    address: gpubox\n    jump: ops@10.0.0.2:2222\n")
    named = ops_env.sub("--inventory", str(inv), "launch", "job", "--host", "lab", "--dry-run")
    assert named.returncode == 0 and named.stdout.startswith("ssh root@10.9.8.7:22 (via ops@10.0.0.2:2222): ")
