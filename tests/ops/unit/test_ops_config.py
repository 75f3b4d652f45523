"""inventory.yaml and runbooks/*.yaml -> validated values; errors carry file:line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dflash_ops import inventory
from dflash_ops.errors import ConfigError, UsageError
from dflash_ops.runs import runbooks
from dflash_ops.spec import Container, Host, Target

REPO = Path(__file__).resolve().parents[3]


def test_repo_inventory_is_valid_and_local_works_out_of_the_box():
    inv = inventory.load_inventory(REPO / "inventory.yaml")
    assert inv.default_host == "local"
    target = inventory.resolve_target(inventory.Inventory(), None, None)
    assert target.host.transport == "local" and target.python == sys.executable


def test_full_host_entry(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text("default_host: pve1\nhosts:\n  pve1:\n    transport: proxmox\n    address: 10.1.2.6\n"
                 "    user: ops\n    port: 2222\n    identity_file: ~/.ssh/k\n    known_hosts: /kh\n"
                 "    jump: me@bastion.example:22\n    pct: /opt/pct\n    containers:\n"
                 "      200: {runs_dir: /workspace/runs/, python: /opt/venv/bin/python, env: {HF_HOME: /w/hf}}\n")
    inv = inventory.load_inventory(p)
    t = inventory.resolve_target(inv, None, "200")
    assert t.host == Host(name="pve1", transport="proxmox", address="10.1.2.6", user="ops", port=2222,
                          identity_file="~/.ssh/k", known_hosts="/kh", jump="me@bastion.example:22", pct="/opt/pct",
                          containers=(Container("200", "/workspace/runs", "/opt/venv/bin/python",
                                                (("HF_HOME", "/w/hf"),)),), containers_listed=True)
    assert t.runs_dir == "/workspace/runs" and t.label == "pve1/ct200"


def test_bare_address_with_ct_is_a_proxmox_target_without_inventory():
    t = inventory.resolve_target(inventory.Inventory(), "root@10.1.2.6:2222", 200)
    assert (t.host.transport, t.host.address, t.host.user, t.host.port) == ("proxmox", "10.1.2.6", "root", 2222)
    assert t.container == Container("200") and t.runs_dir == "/root/dflash-runs" and t.python == "python3"
    plain = inventory.resolve_target(inventory.Inventory(), "gpu.example.org", None)
    assert plain.host.transport == "ssh" and plain.container is None


@pytest.mark.parametrize("text,line", [
    ("hosts:\n  a:\n    transport: telnet\n", 3),
    ("hosts:\n  a:\n    address: 'x;y'\n", 3),
    ("hosts:\n  a:\n    containers:\n      abc: {}\n", 4),
    ("hosts:\n  a:\n    bogus: 1\n", 3),
    ("hosts: [1, 2\n", 2),
    ("default_host: nope\n", 1),
    ("hosts:\n  a:\n    env: {'1X': y}\n", 3),
    ("hosts:\n  a:\n    keepalive_s: .inf\n", 3),       # OverflowError from int() before
    ("hosts:\n  a:\n    keepalive_s: .nan\n", 3),       # ValueError from int() before
    ("hosts:\n  a:\n    keepalive_s: 0.5\n", 3),        # int() made it 0: keepalive off
    ("hosts:\n  a:\n    connect_timeout_s: 0\n", 3),    # every connect would fail
    ("hosts:\n  a:\n    connect_timeout_s: .nan\n", 3),
    ("hosts:\n  a:\n    connect_timeout_s: 1.0e+12\n", 3),  # past what a socket timeout takes
    ("hosts:\n  a:\n    user: 'a;b'\n", 3),             # `--host a;b@h` is refused too
    ("hosts:\n  a:\n    user: -oProxyCommand=x\n", 3),
    ("hosts:\n  a:\n    containers:\n      0200: {}\n", 4),  # YAML 1.1: octal 128
    ("hosts:\n  a:\n    address: \xff\n", 3),           # not UTF-8
])
def test_inventory_errors_name_the_line(tmp_path, text, line):
    p = tmp_path / "inv.yaml"
    p.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError) as exc:
        inventory.load_inventory(p)
    assert f"{p}:{line}:" in exc.value.message


def test_inventory_timeouts_and_user_in_range_are_kept(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text("hosts:\n  a:\n    transport: ssh\n    user: _ops-1.x\n    connect_timeout_s: 2.5\n"
                 "    keepalive_s: 30\n")
    host = inventory.load_inventory(p).host("a")
    assert (host.user, host.connect_timeout_s, host.keepalive_s) == ("_ops-1.x", 2.5, 30)


def test_bundled_runbooks_are_valid():
    names = runbooks.available(runbooks.BUNDLED)
    assert {"smoke", "graphwarm", "fixedshape", "cudagraph", "eager"} <= set(names)
    books = {name: runbooks.load_runbook(runbooks.BUNDLED, name) for name in names}  # every one loads
    assert all(any("{run_dir}" in a for a in book.command) for book in books.values())
    modes = {}
    for name in ("smoke", "eager", "fixedshape", "cudagraph", "graphwarm", "graphwarm-ddp", "graphwarm-nodes"):
        book = books[name]
        cmd = book.command
        launcher = cmd[:3] == ("{python}", "-m", "torch.distributed.run")  # torchrun runs `-m trainer` per rank
        first = cmd.index("trainer") - 1 if launcher else 1
        assert cmd[0] == "{python}" and cmd[first:first + 2] == ("-m", "trainer") and "{run_dir}" in cmd
        modes[name] = next((a for a in book.command if a.startswith("step.mode=")), None)
    assert modes == {"smoke": None, "eager": "step.mode=eager", "fixedshape": "step.mode=eager",
                     "cudagraph": "step.mode=graph", "graphwarm": "step.mode=compile+graph",
                     "graphwarm-ddp": "step.mode=compile+graph", "graphwarm-nodes": "step.mode=compile+graph"}
    ddp = runbooks.load_runbook(runbooks.BUNDLED, "graphwarm-ddp").command
    assert ddp[:6] == ("{python}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "gpu")
    nodes = runbooks.load_runbook(runbooks.BUNDLED, "graphwarm-nodes")
    assert "--standalone" not in nodes.command and nodes.command[3:5] == ("--nproc-per-node", "gpu")
    assert ("LOGLEVEL", "INFO") in nodes.env and "Starting elastic_operator" in nodes.liveness.pattern
    assert nodes.nodes and not any(book.nodes for name, book in books.items() if name != "graphwarm-nodes")
    assert runbooks.load_runbook(runbooks.BUNDLED, "graphwarm").pre == ("clear_inductor_cache",)
    assert runbooks.load_runbook(runbooks.BUNDLED, "smoke").liveness.pattern == "DFLASH_METRICS|step "
    regen = books["regenerate"]  # target and prompts come after `--`; a later --out there replaces this one
    assert regen.command == ("{python}", "-m", "trainer", "regenerate", "--out", "{run_dir}/regen.jsonl")
    assert regen.liveness.pattern == "DFLASH_PROGRESS"


def test_placeholders_are_exact_tokens_and_extra_args_are_verbatim(tmp_path):
    (tmp_path / "r.yaml").write_text('command: ["{python}", "{run_dir}/x", "{other}", "{{name}}", "{run_id}"]\n'
                                     'env: {D: "{run_dir}"}\nliveness: {pattern: "."}\n')
    book = runbooks.load_runbook(tmp_path, "r")
    t = Target(Host(name="pve", transport="proxmox"), Container("200", runs_dir="/r", python="/py"))
    s = runbooks.run_spec(book, t, name="n", run_id="n-20260101T000000-abcd", extra_args=("{python}",))
    assert s.argv == ("/py", "/r/n-20260101T000000-abcd/x", "{other}", "{n}", "n-20260101T000000-abcd", "{python}")
    assert s.env == (("D", "/r/n-20260101T000000-abcd"),) and s.ct == "200"


def test_unknown_pre_step_and_bad_regex(tmp_path):
    (tmp_path / "a.yaml").write_text('command: [x]\npre: [format_disk]\nliveness: {pattern: "."}\n')
    (tmp_path / "b.yaml").write_text('command: [x]\nliveness:\n  pattern: "(["\n')
    with pytest.raises(ConfigError, match=r"a\.yaml:2: .*format_disk"):
        runbooks.load_runbook(tmp_path, "a")
    with pytest.raises(ConfigError, match=r"b\.yaml:3: .*regex"):
        runbooks.load_runbook(tmp_path, "b")
    with pytest.raises(UsageError, match="unknown runbook"):
        runbooks.load_runbook(tmp_path, "c")


def test_yaml_booleans_are_refused_where_strings_are_expected(tmp_path):
    (tmp_path / "a.yaml").write_text('command: [x]\nenv:\n  FLAG: yes\nliveness: {pattern: "."}\n')
    (tmp_path / "b.yaml").write_text('command: [x, on]\nliveness: {pattern: "."}\n')
    (tmp_path / "c.yaml").write_text('command: [x, 3, 0.5]\nenv: {N: 1}\nliveness: {pattern: "."}\n')
    with pytest.raises(ConfigError, match=r"a\.yaml:3: .*FLAG must be a string"):
        runbooks.load_runbook(tmp_path, "a")
    with pytest.raises(ConfigError, match=r"b\.yaml:1: "):
        runbooks.load_runbook(tmp_path, "b")
    c = runbooks.load_runbook(tmp_path, "c")
    assert c.command == ("x", "3", "0.5") and c.env == (("N", "1"),)
