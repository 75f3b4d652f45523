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
    """ops_env with a `nodesjob` runbook (`nodes: true`) and an inventory of Proxmox hosts at the listener: `far`
    (containers 200, 201), `alias` (the same machine) and `other` (another one, rendezvous address 10.9.8.7)."""
    job = yaml.safe_load((ops_env.runbooks / "job.yaml").read_text())
    (ops_env.runbooks / "nodesjob.yaml").write_text(yaml.safe_dump(dict(job, nodes=True)))
    port = listener.getsockname()[1]
    inv = ops_env.root / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {
        "far": {"transport": "proxmox", "address": "127.0.0.1", "port": port, "containers": {200: {}, 201: {}}},
        "alias": {"transport": "proxmox", "address": "127.0.0.1", "port": port},
        "other": {"transport": "proxmox", "address": "10.9.8.7", "rdzv_address": "10.9.8.7", "containers": {200: {}}},
    }, "groups": {"pair": ["far:200", "far:201"]}}))
    return ops_env, inv


@pytest.mark.parametrize("specs, message", [
    (["far:200", "h;x:200"], "error: invalid node 'h;x:200': expected HOST[:CT]"),
    (["far:200", ":abc"], "error: invalid node ':abc': expected HOST[:CT]"),
    (["far:200", "far:200"], "error: node far:200 is given twice"),
    (["pair", "far:201"], "error: node far:201 is given twice"),
    (["far:200", "alias:200"], "error: nodes far:200 and alias:200 are the same container"),
    (["far:200", "far"], "error: node far: 'far' is a Proxmox host: name one of its containers (far:200, far:201)"),
    (["far:200", "nowhere:200"], "error: node nowhere:200: unknown host 'nowhere'"),
    (["far:200", "other:200"], "error: rank 0's node far/ct200 is reached at 127.0.0.1, which the other nodes "
                               "cannot reach"),
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
    (["launch", "nodesjob", "--node", "far:200", "--env", "PET_NNODES=3"], "error: --env PET_NNODES: with --node, "
                                                                           "dflash-ops sets the rendezvous itself"),
])
def test_what_a_multi_node_launch_cannot_take_is_refused_before_any_connection(nodes_env, listener, args, message):
    env, inv = nodes_env
    done = env.cli("--inventory", str(inv), *args)
    assert done.exit_code == 2 and done.stderr.splitlines()[0].startswith(message), done.stderr
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
    port = int(done.stderr.split("rendezvous 127.0.0.1:")[1].split()[0])
    for rank, (ct, command) in enumerate(zip(("200", "201"), commands)):
        assert command.startswith(f"ssh root@127.0.0.1:{listener.getsockname()[1]}: /usr/sbin/pct exec {ct} -- ")
        argv = shlex.split(command.split(": ", 1)[1])
        script = argv[-1]
        for line in ("export PET_NNODES=2", f"export PET_NODE_RANK={rank}", "export PET_RDZV_BACKEND=static",
                     f"export PET_RDZV_ENDPOINT=127.0.0.1:{port}", "export PET_RDZV_CONF=timeout=90"):
            assert line in script
    assert "nothing was run" in done.stderr
    assert untouched(listener)


def test_rank_0s_inventory_rdzv_address_is_the_endpoint(nodes_env, listener):
    env, inv = nodes_env
    done = env.cli("--inventory", str(inv), "launch", "nodesjob", "--node", "other:200", "--node", "far:200",
                   "--dry-run", "--json")
    assert done.exit_code == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["multinode"]["rendezvous"]["address"] == "10.9.8.7"
    assert [n["target"] for n in doc["nodes"]] == ["other/ct200", "far/ct200"]
    port = doc["multinode"]["rendezvous"]["port"]
    assert all(f"export PET_RDZV_ENDPOINT=10.9.8.7:{port}" in shlex.split(n["command"].split(": ", 1)[1])[-1]
               for n in doc["nodes"])
    assert untouched(listener)
