"""Configuration errors: one clear line naming file:line, and the documented exit code."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

REPO = Path(__file__).resolve().parents[3]


def test_malformed_runbook_yaml_names_file_and_line(ops_env):
    (ops_env.runbooks / "bad.yaml").write_text('command: ["a"]\nliveness:\n  pattern: "x"\n  wait_s: [1\n')
    done = ops_env.cli("launch", "bad")
    assert done.exit_code == 78
    first = done.stderr.splitlines()[0]
    assert first.startswith("error: ") and f"{ops_env.runbooks / 'bad.yaml'}:" in first and "malformed YAML" in first


def test_missing_field_names_the_field_and_line(ops_env):
    (ops_env.runbooks / "nocmd.yaml").write_text('description: x\n\nliveness: {pattern: "x"}\n')
    done = ops_env.cli("launch", "nocmd")
    assert done.exit_code == 78
    assert "nocmd.yaml:1" in done.stderr and "'command'" in done.stderr


def test_unknown_field_points_at_its_line(ops_env):
    (ops_env.runbooks / "typo.yaml").write_text('command: ["a"]\nliveness: {pattern: "x"}\nenviron: {A: "1"}\n')
    done = ops_env.cli("launch", "typo")
    assert done.exit_code == 78 and "typo.yaml:3" in done.stderr and "'environ'" in done.stderr


def test_malformed_inventory_names_file_and_line(ops_env):
    inv = ops_env.root / "inv.yaml"
    inv.write_text("hosts:\n  pve1:\n    transport: proxmox\n    port: 99999\n")
    done = ops_env.cli("--inventory", str(inv), "runs", "--host", "pve1", "--ct", "200")
    assert done.exit_code == 78 and f"{inv}:4" in done.stderr


def test_unknown_runbook_host_and_container_exit_2(ops_env):
    inv = ops_env.root / "inv.yaml"
    inv.write_text("hosts:\n  pve1:\n    transport: proxmox\n    address: 10.1.2.6\n    containers:\n      200: {}\n")
    assert ops_env.cli("launch", "nope").exit_code == 2
    unknown_host = ops_env.cli("--inventory", str(inv), "runs", "--host", "pve2")
    assert unknown_host.exit_code == 2 and "unknown host 'pve2'" in unknown_host.stderr
    unknown_ct = ops_env.cli("--inventory", str(inv), "runs", "--host", "pve1", "--ct", "201")
    assert unknown_ct.exit_code == 2 and "unknown container 201" in unknown_ct.stderr
    no_ct = ops_env.cli("--inventory", str(inv), "runs", "--host", "pve1")
    assert no_ct.exit_code == 2 and "--ct" in no_ct.stderr


def test_json_errors_are_one_object_on_stdout(ops_env):
    done = ops_env.cli("runs", "--host", "nosuchhost", "--json")
    assert done.exit_code == 2
    err = json.loads(done.stdout)["error"]
    assert err["code"] == "usage" and err["exit_code"] == 2 and "nosuchhost" in err["message"]


def test_run_not_found_exit_3(ops_env):
    assert ops_env.cli("stop", "ghost").exit_code == 3
    assert ops_env.cli("tail").exit_code == 3


def test_help_imports_no_torch_fabric_paramiko_yaml():
    code = ("import sys, runpy; sys.argv = ['dflash-ops', '--help']\n"
            "try:\n    runpy.run_module('dflash_ops', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'fabric', 'paramiko', 'invoke', 'yaml', 'rich') if m in sys.modules]\n"
            "assert not heavy, heavy\nprint('clean')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("clean") and "launch" in done.stdout


def test_trust_host_takes_a_proxmox_host_without_ct_and_reports_unreachable(ops_env):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inv = ops_env.root / "inv.yaml"
    inv.write_text(f"hosts:\n  pve1:\n    transport: proxmox\n    address: 127.0.0.1\n    port: {port}\n")
    done = ops_env.cli("--inventory", str(inv), "trust-host", "pve1", "--yes")
    assert done.exit_code == 69 and f"127.0.0.1:{port}" in done.stderr
    assert ops_env.cli("trust-host", "local").exit_code == 2


def test_a_broken_inventory_file_is_one_line_exit_78_never_a_traceback(ops_env):
    inv = ops_env.root / "inv.yaml"
    for data, line in [(b"hosts:\n  pve1:\n    address: \xff\n", "inv.yaml:3: not UTF-8 text (byte 0xff)"),
                       (b'hosts:\n  pve1:\n    address: "\x07"\n', "inv.yaml:3: malformed YAML: character U+0007"),
                       (b"hosts: &a [*a]\n", "inv.yaml:1: the value anchored here contains an alias of itself"),
                       (b"hosts:\n  pve1:\n    keepalive_s: .inf\n", "inv.yaml:3: host 'pve1': 'keepalive_s' must be"),
                       (b"hosts:\n  pve1:\n    containers:\n      0200: {}\n", "inv.yaml:4: key '0200' reads as 128")]:
        inv.write_bytes(data)
        done = ops_env.sub("--inventory", str(inv), "runs", "--host", "pve1", "--ct", "128")
        assert done.returncode == 78, done.stderr
        assert done.stderr.startswith(f"error: {ops_env.root}/{line}") and "Traceback" not in done.stderr, data


def test_a_missing_identity_file_is_a_config_error_not_an_unreachable_host(ops_env):
    import socket

    with socket.socket() as s:  # a port nobody listens on: the old code tried it and said "is the host up?"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inv = ops_env.root / "inv.yaml"
    inv.write_text(f"hosts:\n  box:\n    transport: ssh\n    address: 127.0.0.1\n    port: {port}\n"
                   "    identity_file: ~/.ssh/no_such_key\n")
    for args in (["runs", "--host", "box"], ["launch", "job", "--host", "box", "--dry-run"]):
        done = ops_env.cli("--inventory", str(inv), *args)
        assert done.exit_code == 78, done.output
        assert done.stderr.splitlines() == [
            f"error: host 'box': identity_file {ops_env.root}/home/.ssh/no_such_key does not exist (or is not a file)",
            "hint: fix identity_file of that host in the inventory"]
