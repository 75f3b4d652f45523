"""Pure parts of a multi-node run: node specs, inventory groups and rendezvous addresses, the record, the torchrun
variables, the runbook checks, the run's overall state, and the free-port script (run by bash for real)."""
from __future__ import annotations

import json
import socket
import subprocess

import pytest

from dflash_ops import inventory, nodespec
from dflash_ops.errors import ConfigError, UsageError
from dflash_ops.runs import noderun, nodes, shellcmd
from dflash_ops.runs.noderun import Node, NodeRun, NodeState, Rendezvous
from dflash_ops.spec import Container, Host, Liveness, Runbook, RunStatus, Target

RUN_ID = "pair-20260101T120000-ab12"


def test_node_specs_are_host_and_optional_container():
    assert nodespec.parse_node("pve1") == nodespec.NodeRef("pve1")
    assert nodespec.parse_node("pve1:200") == nodespec.NodeRef("pve1", "200")
    assert nodespec.parse_node("root@10.1.2.6:200") == nodespec.NodeRef("root@10.1.2.6", "200")
    assert nodespec.parse_node("[fd00::5]:201").spec == "[fd00::5]:201"


@pytest.mark.parametrize("hostile", ["h;x:200", ":abc", ":200", "pve1:abc", "pve1:0", "pve1:200:1", "", "$(id):200",
                                     "`id`", "a b", "-rf", "pve1:200 ", "pve1\n:200", "pve1:200;", "pve1:'200'",
                                     "x|y", "../x", "pve1:1234567890"])
def test_hostile_node_specs_are_refused_with_the_form(hostile):
    with pytest.raises(UsageError) as exc:
        nodespec.parse_node(hostile)
    assert exc.value.message == f"invalid node {hostile!r}: expected {nodespec.FORM}" and exc.value.hint is None


def test_groups_expand_in_order_and_a_node_named_twice_is_refused():
    groups = {"pair": ("pve1:200", "pve2:200")}
    assert [n.spec for n in nodespec.parse_nodes(["pair", "pve3"], groups)] == ["pve1:200", "pve2:200", "pve3"]
    for specs in (["pve1:200", "pve1:200"], ["pair", "pve2:200"]):
        with pytest.raises(UsageError, match="node pve.:200 is given twice"):
            nodespec.parse_nodes(specs, groups)
    with pytest.raises(UsageError, match="no nodes given"):
        nodespec.parse_nodes([], groups)


INVENTORY = """\
hosts:
  pve1:
    address: 10.1.2.6
    rdzv_address: 192.168.7.6
    containers:
      200: {rdzv_address: "fd00::20"}
      201: {}
  pve2: {address: 10.1.2.7}
groups:
  pair: ["pve1:200", "pve2:200"]
"""


def test_inventory_groups_and_rendezvous_addresses(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    inv = inventory.load_inventory(path)
    assert inv.group_map() == {"pair": ("pve1:200", "pve2:200")}
    assert inventory.resolve_target(inv, "pve1", "200").rdzv_address == "fd00::20"   # the container's own
    assert inventory.resolve_target(inv, "pve1", "201").rdzv_address == "192.168.7.6"
    assert inventory.resolve_target(inv, "pve2", "200").rdzv_address is None


@pytest.mark.parametrize("bad, line, says", [
    ('  pair: ["pve1:200", "h;x"]\n', 10, "group 'pair': invalid node 'h;x'"),
    ("  pve1: [pve2]\n", 10, "group 'pve1' has the name of a host"),
    ("  pair: []\n", 10, "must be a non-empty list"),
    ('  pair: ["pve2", "pve2"]\n', 10, "names a node twice"),
    ("  pair: [200]\n", 10, "each node is a string"),
])
def test_bad_groups_are_config_errors_with_their_line(tmp_path, bad, line, says):
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY.split("groups:\n")[0] + "groups:\n" + bad)
    with pytest.raises(ConfigError) as exc:
        inventory.load_inventory(path)
    assert exc.value.message.startswith(f"{path}:{line}: ") and says in exc.value.message


@pytest.mark.parametrize("bad", ["10.0.0.1:29500", "x;y", "[host]", "-a.b", "a..b", "fe80::1%eth0", "[fe80::1%1]",
                                 "10.0.0.256", "h\x07", "h\u00e9", "h\n"])
def test_a_bad_rdzv_address_is_a_config_error(tmp_path, bad):
    path = tmp_path / "inv.yaml"
    path.write_text(f"hosts:\n  pve1:\n    address: 10.1.2.6\n    rdzv_address: {json.dumps(bad)}\n")
    with pytest.raises(ConfigError, match=r"inv.yaml:4: host 'pve1': invalid rendezvous address"):
        inventory.load_inventory(path)


def proxmox(name: str, ct: str = "200", **host) -> Target:
    return Target(Host(name=name, transport="proxmox", **host), Container(ct))


LOCAL_CT = Target(Host(name="local", transport="local"), Container("200"))


def test_the_rendezvous_address_is_rank_0s_as_the_other_nodes_reach_it():
    two, a, b = [proxmox("a"), proxmox("b")], ("10.0.0.1", 22), ("10.0.0.2", 22)
    assert noderun.rendezvous_address(two, [a, b]) == "10.0.0.1"
    assert noderun.rendezvous_address([proxmox("a", rdzv_address="192.168.1.5"), two[1]], [a, b]) == "192.168.1.5"
    # one machine: its loopback serves (two containers of one host; two local containers)
    here = ("127.0.0.1", 2222)
    assert noderun.rendezvous_address([proxmox("a"), proxmox("a", "201")], [here, here]) == "127.0.0.1"
    assert noderun.rendezvous_address([LOCAL_CT, Target(LOCAL_CT.host, Container("201"))], [None, None]) == "127.0.0.1"
    for targets, endpoints in (([proxmox("a"), proxmox("b")], [here, b]),
                               ([proxmox("a"), proxmox("b")], [here, ("127.0.0.1", 2223)]),   # two port forwards
                               ([LOCAL_CT, proxmox("b")], [None, b]),
                               ([proxmox("a"), proxmox("b")], [("localhost", 22), b])):
        with pytest.raises(UsageError, match="which the other nodes cannot reach") as exc:
            noderun.rendezvous_address(targets, endpoints)
        assert "rdzv_address:" in exc.value.hint


RUN = NodeRun(RUN_ID, (Node(0, "pve1", "200"), Node(1, "root@10.1.2.7", "200")),
              Rendezvous("fd00::5", 29511, RUN_ID, timeout_s=120))


def test_each_node_gets_torchruns_rendezvous_variables():
    assert dict(RUN.node_env(1)) == {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_RDZV_BACKEND": "static",
                                     "PET_RDZV_ENDPOINT": "[fd00::5]:29511", "PET_RDZV_ID": RUN_ID,
                                     "PET_RDZV_CONF": "timeout=120"}
    assert {k for k, _ in RUN.node_env(0)} == set(noderun.RDZV_ENV)


def test_the_record_round_trips_and_a_tampered_one_is_not_a_record():
    doc = RUN.as_dict()
    assert noderun.from_dict(doc) == RUN
    for key, value in (("host", "pve1;id"), ("ct", "abc"), ("rank", 3)):
        bad = RUN.as_dict()
        bad["nodes"][0][key] = value
        assert noderun.from_dict(bad) is None
    for key, value in (("port", 0), ("port", "29511"), ("address", "a b"), ("backend", "c10d"), ("timeout_s", 0)):
        bad = RUN.as_dict()
        bad["rendezvous"][key] = value
        assert noderun.from_dict(bad) is None
    assert noderun.from_dict(None) is None and noderun.from_dict({"nodes": []}) is None


def book(command=("{python}", "-m", "torch.distributed.run", "-m", "trainer"), nodes=True) -> Runbook:
    return Runbook(name="b", command=tuple(command), nodes=nodes, liveness=Liveness())


def test_only_a_nodes_runbook_without_rendezvous_flags_spans_nodes():
    noderun.check_runbook(book())
    with pytest.raises(UsageError, match="runs on one node: --node needs a runbook with `nodes: true`"):
        noderun.check_runbook(book(nodes=False))
    for flag in ("--standalone", "--nnodes=2", "--rdzv_endpoint", "--master-addr"):
        with pytest.raises(UsageError, match=f"gives torchrun {flag}"):
            noderun.check_runbook(book(command=("{python}", "-m", "torch.distributed.run", flag)))
    with pytest.raises(UsageError, match="--env PET_RDZV_ENDPOINT: with --node, dflash-ops sets the rendezvous"):
        noderun.check_env([("HF_HOME", "/x"), ("PET_RDZV_ENDPOINT", "h:1")])


def status(state: str, exit_code=None, ended=None, stopped=False) -> RunStatus:
    return RunStatus(run_id=RUN_ID, name="pair", state=state, pid=1, exit_code=exit_code, started_at=0.0,
                     ended_at=ended, now=100.0, run_dir="/r", stopped=stopped)


def states(*statuses) -> list[NodeState]:
    return [NodeState(Node(i, f"h{i}"), f"h{i}", s, None if s else "unreachable", 0 if s else 69)
            for i, s in enumerate(statuses)]


def test_the_runs_state_names_the_node_that_failed_first():
    run, done = status("running"), status("exited", 0, 50.0)
    assert noderun.overall(states(run, run)).text == "running"
    assert noderun.overall(states(done, run)).state == "running"           # rank 0 finished a moment sooner
    assert noderun.overall(states(done, done)).text == "exited 0"
    late, early = status("exited", 1, 60.0), status("killed", 137, 40.0)
    o = noderun.overall(states(late, early, run))
    assert (o.state, o.first.node.rank, o.text) == ("failed", 1, "failed: node 1 (h1) first: killed (137)")
    lost = status("lost")                                                   # no exit recorded: it went first
    assert noderun.overall(states(late, lost)).first.node.rank == 1
    cut = status("killed", 143, 70.0, stopped=True)
    assert noderun.overall(states(cut, done)).text == "stopped"
    assert noderun.overall(states(cut, run)).state == "failed"             # one node stopped under the others
    assert noderun.overall(states(run, None)).text == "unknown: node 1 (h1): unreachable"
    assert noderun.overall(states(late, None)).state == "failed"


def test_the_free_port_script_skips_ports_in_use():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        found = subprocess.run(["bash", "-c", shellcmd.free_port_script([busy, free])], capture_output=True, text=True)
        assert (found.returncode, found.stdout) == (0, f"DFLASH_PORT {free}\n"), found.stderr
        none = subprocess.run(["bash", "-c", shellcmd.free_port_script([busy])], capture_output=True, text=True)
        assert (none.returncode, none.stdout) == (1, "DFLASH_ERROR no free port\n")


def test_tail_node_picks_a_rank_or_a_node_as_launched():
    loc = nodes.Located(RUN_ID, RUN.nodes, (proxmox("pve1"), proxmox("b")), RUN)
    assert [loc.pick(x) for x in (None, "0", "1", "pve1:200", "root@10.1.2.7:200")] == [0, 0, 1, 0, 1]
    for bad in ("2", "pve1:201", "pve1"):
        with pytest.raises(UsageError, match=f"--node {bad}: not a node of {RUN_ID}"):
            loc.pick(bad)
    with pytest.raises(UsageError, match="invalid node '\u00b2'"):     # a digit to str.isdigit, not to int()
        loc.pick("\u00b2")
    single = nodes.Located.single(RUN_ID, proxmox("pve1"))
    assert single.pick(None) == 0
    with pytest.raises(UsageError, match="is not a multi-node run"):
        single.pick("1")
