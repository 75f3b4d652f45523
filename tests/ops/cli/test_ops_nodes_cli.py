"""`launch --node` refuses what it cannot run before it connects anywhere, and `--dry-run` prints every node's
exact command. The inventory's hosts point at a listening socket of this test: every refusal here must leave it
without a single connection."""
from __future__ import annotations

import json
import shlex
import socket

import pytest
import yaml


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.1 that is never served: a connection attempt would show up in its backlog."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        s.setblocking(False)
        yield s


def untouched(listener) -> bool:
    try:
        listener.accept()[0].close()
    except BlockingIOError:
        return True
    return False


@pytest.fixture
def nodes_env(ops_env, listener):
    """ops_env with a `nodesjob` runbook (`nodes: true`, LOGLEVEL=INFO) and an inventory of hosts at the listener:
    Proxmox hosts `far` (containers 200, 201) and `alias` (the same machine), the plain SSH host `bare` (the same
    machine too), `other` (another machine; its container 200's rendezvous address is 10.9.8.7), and `j1`, `j1b`,
    `j2`: one address behind jump hosts, j1 and j1b through the same one (one machine), j2 through another."""
    job = yaml.safe_load((ops_env.runbooks / "job.yaml").read_text())
    job["env"]["LOGLEVEL"] = "INFO"
    (ops_env.runbooks / "nodesjob.yaml").write_text(yaml.safe_dump(dict(job, nodes=True)))
    port = listener.getsockname()[1]
    inv = ops_env.root / "inventory.yaml"
    behind = {"transport": "proxmox", "address": "10.1.1.1", "containers": {200: {}}}
    inv.write_text(yaml.safe_dump({"hosts": {
        "far": {"transport": "proxmox", "address": "127.0.0.1", "port": port, "containers": {200: {}, 201: {}}},
        "alias": {"transport": "proxmox", "address": "127.0.0.1", "port": port},
        "bare": {"transport": "ssh", "address": "127.0.0.1", "port": port, "env": {"PET_MASTER_PORT": "1"}},
        "other": {"transport": "proxmox", "address": "10.9.8.7", "containers": {200: {"rdzv_address": "10.9.8.7"}}},
        "j1": dict(behind, jump=f"ops@127.0.0.1:{port}"), "j1b": dict(behind, jump=f"ops@127.0.0.1:{port}"),
        "j2": dict(behind, jump=f"ops@localhost:{port}"),
    }, "groups": {"pair": ["far:200", "far:201"]}}))
    return ops_env, inv


@pytest.mark.parametrize("specs, message", [
    (["far:200", "h;x:200"], "error: invalid node 'h;x:200': expected HOST[:CT]"),
    (["far:200", ":abc"], "error: invalid node ':abc': expected HOST[:CT]"),
    (["far:200", "far:200"], "error: node far:200 is given twice"),
    (["pair", "far:201"], "error: node far:201 is given twice"),
    (["far:200", "alias:200"], "error: nodes far:200 and alias:200 are the same container"),
    (["other:200", "j1:200", "j1b:200"], "error: nodes j1:200 and j1b:200 are the same container"),
    (["far:200", "far"], "error: node far: 'far' is a Proxmox host: name one of its containers (far:200, far:201)"),
    (["far:200", "nowhere:200"], "error: node nowhere:200: unknown host 'nowhere'"),
    (["j1:200", "other:200"], "error: rank 0's node j1/ct200 is reached through ops@127.0.0.1:"),
    (["other:200", "bare"], "error: the inventory's env of node 1 (bare) sets PET_MASTER_PORT: with --node"),
])
def test_bad_nodes_are_refused_in_one_line_before_any_connection(nodes_env, listener, specs, message):
    env, inv = nodes_env
    done = env.cli("--inventory", str(inv), "launch", "nodesjob", *[x for s in specs for x in ("--node", s)])
    assert done.exit_code == 2, done.output
    lines = done.stderr.splitlines()
    assert lines[0].startswith(message) and all(ln.startswith("hint: ") for ln in lines[1:]), done.stderr
    assert untouched(listener)


@pytest.mark.parametrize("args, message", [
    (["launch", "job", "--node", "far:200"], "error: runbook 'job' runs on one node: --node needs a runbook with "
                                             "`nodes: true`"),
    (["launch", "nodesjob", "--node", "far:200", "--host", "far"], "error: --node names every node: not with "
                                                                   "--host/--ct"),
    (["launch", "nodesjob", "--node", "far:200", "--env", "PET_NNODES=3"], "error: --env sets PET_NNODES: with "
                                                                           "--node, dflash-ops sets the rendezvous"),
    (["launch", "nodesjob", "--node", "far:200", "--env", "LOGLEVEL=WARNING"], "error: runbook 'nodesjob': LOGLEVEL "
                                                                               "is 'WARNING'; a multi-node launch"),
    (["launch", "job", "--host", "far", "--ct", "200", "--rdzv-timeout", "9"], "error: --rdzv-timeout is for a "
                                                                               "multi-node launch (--node)"),
])
def test_what_a_multi_node_launch_cannot_take_is_refused_before_any_connection(nodes_env, listener, args, message):
    env, inv = nodes_env
    done = env.cli("--inventory", str(inv), *args)
    assert done.exit_code == 2 and done.stderr.splitlines()[0].startswith(message), done.stderr
    assert untouched(listener)


@pytest.mark.parametrize("bad", ["a..b", "x." + "a" * 64 + ".com"])
def test_a_node_whose_host_is_no_dns_name_is_refused_by_a_dry_run_too(nodes_env, listener, bad):
    """Empty and over-long labels passed as addresses before (a dry run printed their commands; a launch met the
    resolver's UnicodeError)."""
    env, inv = nodes_env
    done = env.cli("--inventory", str(inv), "launch", "nodesjob", "--node", "far:200", "--node", f"{bad}:200",
                   "--dry-run")
    assert done.exit_code == 2, done.output
    assert done.stderr.splitlines()[0].startswith(f"error: node {bad}:200: unknown host {bad!r}")
    assert untouched(listener)


def test_dry_run_prints_every_nodes_exact_command_and_connects_nowhere(nodes_env, listener):
    env, inv = nodes_env
    done = env.cli("--inventory", str(inv), "launch", "nodesjob", "--node", "pair", "--dry-run", "--rdzv-timeout",
                   "90", "--", "--lines", "1")
    assert done.exit_code == 0, done.stderr
    out = done.stdout.splitlines()
    heads = [i for i, line in enumerate(out) if line.startswith("# node ")]
    assert [out[i] for i in heads] == ["# node 0: far/ct200", "# node 1: far/ct201"]
    commands = ["\n".join(out[a + 1:b]) for a, b in zip(heads, heads[1:] + [len(out)])]
    # two containers of one machine: rank 0's address is its container's own, found there at launch
    assert "rank 0's address, <rank-0-address> here, is found in its container at launch" in done.stderr
    port = int(done.stderr.split("rendezvous <rank-0-address>:")[1].split()[0])
    for rank, (ct, command) in enumerate(zip(("200", "201"), commands)):
        assert command.startswith(f"ssh root@127.0.0.1:{listener.getsockname()[1]}: /usr/sbin/pct exec {ct} -- ")
        argv = shlex.split(command.split(": ", 1)[1])
        script = argv[-1]
        for line in ("export PET_NNODES=2", f"export PET_NODE_RANK={rank}", "export PET_RDZV_BACKEND=static",
                     "export PET_RDZV_CONF=timeout=90"):
            assert line in script
        assert f"export PET_RDZV_ENDPOINT='\"'\"'<rank-0-address>:{port}'\"'\"'" in script   # quoted twice
    assert "nothing was run" in done.stderr
    assert untouched(listener)


def test_rank_0s_inventory_rdzv_address_is_the_endpoint(nodes_env, listener):
    """...also for nodes behind jump hosts: one address through two jump hosts is two machines."""
    env, inv = nodes_env
    done = env.cli("--inventory", str(inv), "launch", "nodesjob", "--node", "other:200", "--node", "far:200",
                   "--node", "j1:200", "--node", "j2:200", "--dry-run", "--json")
    assert done.exit_code == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["multinode"]["rendezvous"]["address"] == "10.9.8.7"
    assert [n["target"] for n in doc["nodes"]] == ["other/ct200", "far/ct200", "j1/ct200", "j2/ct200"]
    port = doc["multinode"]["rendezvous"]["port"]
    assert all(f"export PET_RDZV_ENDPOINT=10.9.8.7:{port}" in shlex.split(n["command"].split(": ", 1)[1])[-1]
               for n in doc["nodes"])
    assert untouched(listener)
