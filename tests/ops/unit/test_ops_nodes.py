"""Pure parts of a multi-node run: node specs, inventory groups and rendezvous addresses (and rank 0's found in its
container), the record and when a node's copy of it is followed, the torchrun variables, the runbook and
environment checks, the run's overall state, the rendering of hosts' text; and two scripts run by bash for real:
the free-port check and the fenced stop."""
from __future__ import annotations

import json
import socket
import subprocess
from dataclasses import replace

import pytest

from dflash_ops import inventory
from dflash_ops.errors import ConfigError, UsageError
from dflash_ops.multinode import record, rendezvous, watch
from dflash_ops.multinode import state as nodestate
from dflash_ops.multinode.record import Node, NodeRun, Rendezvous
from dflash_ops.multinode.rendezvous import Machine
from dflash_ops.multinode.state import NodeState
from dflash_ops.runs import launch_scripts, parse, runbooks, stop_scripts
from dflash_ops.spec import Container, Host, Liveness, Runbook, RunStatus, Target

RUN_ID = "pair-20260101T120000-ab12"


def test_node_specs_are_host_and_optional_container():
    assert record.parse_node("pve1") == record.NodeRef("pve1")
    assert record.parse_node("pve1:200") == record.NodeRef("pve1", "200")
    assert record.parse_node("root@10.1.2.6:200") == record.NodeRef("root@10.1.2.6", "200")
    assert record.parse_node("[fd00::5]:201").spec == "[fd00::5]:201"


@pytest.mark.parametrize("hostile", ["h;x:200", ":abc", ":200", "pve1:abc", "pve1:0", "pve1:200:1", "", "$(id):200",
                                     "`id`", "a b", "-rf", "pve1:200 ", "pve1\n:200", "pve1:200;", "pve1:'200'",
                                     "x|y", "../x", "pve1:1234567890"])
def test_hostile_node_specs_are_refused_with_the_form(hostile):
    with pytest.raises(UsageError) as exc:
        record.parse_node(hostile)
    assert exc.value.message == f"invalid node {hostile!r}: expected {record.FORM}" and exc.value.hint is None


def test_groups_expand_in_order_and_a_node_named_twice_is_refused():
    groups = {"pair": ("pve1:200", "pve2:200")}
    assert [n.spec for n in record.parse_nodes(["pair", "pve3"], groups)] == ["pve1:200", "pve2:200", "pve3"]
    for specs in (["pve1:200", "pve1:200"], ["pair", "pve2:200"]):
        with pytest.raises(UsageError, match="node pve.:200 is given twice"):
            record.parse_nodes(specs, groups)
    with pytest.raises(UsageError, match="no nodes given"):
        record.parse_nodes([], groups)


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
    assert inventory.resolve_target(inv, "pve1", "201").rdzv_address is None         # its host's is not its
    assert Target(inventory.resolve_host(inv, "pve1", with_ct=False)).rdzv_address == "192.168.7.6"


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


def bare(name: str, **host) -> Target:
    return Target(Host(name=name, transport="ssh", **host))


A, B, HERE = Machine("10.0.0.1", 22), Machine("10.0.0.2", 22), Machine("127.0.0.1", 2222)


def test_the_rendezvous_address_is_rank_0s_as_the_other_nodes_reach_it():
    assert rendezvous.rendezvous_address([bare("a"), bare("b")], [A, B]) == "10.0.0.1"
    assert rendezvous.rendezvous_address([bare("a", rdzv_address="192.168.1.5"), bare("b")], [A, B]) == "192.168.1.5"
    assert rendezvous.rendezvous_address([bare("a")], [HERE]) == "127.0.0.1"        # a bare host alone: its loopback
    # A container has a network of its own: its own rdzv_address, else found inside it at launch (None) -- never
    # its host's address, nor loopback, even with every node on one machine.
    assert rendezvous.rendezvous_address([proxmox("a", rdzv_address="192.168.1.5"), proxmox("b")], [A, B]) is None
    assert rendezvous.rendezvous_address([proxmox("a"), proxmox("a", "201")], [HERE, HERE]) is None
    own = Target(Host(name="a", transport="proxmox"), Container("200", rdzv_address="10.5.0.20"))
    assert rendezvous.rendezvous_address([own, proxmox("b")], [A, B]) == "10.5.0.20"
    via = Machine("10.0.0.1", 22, route="ops@bastion:22")
    for targets, machines, says in (
            ([bare("a"), bare("b")], [HERE, B], "is reached at 127.0.0.1, which the other nodes cannot reach"),
            ([bare("a"), bare("b")], [HERE, Machine("127.0.0.1", 2223)], "cannot reach"),   # two port forwards
            ([bare("a"), proxmox("a")], [HERE, HERE], "cannot reach"),        # a container cannot reach its loopback
            ([Target(Host(name="local")), bare("b")], [Machine(), B], "is reached at this machine"),
            ([bare("a"), bare("b")], [via, B], "is reached through ops@bastion:22"),
            ([proxmox("a"), proxmox("b")], [via, B], "is reached through ops@bastion:22")):
        with pytest.raises(UsageError, match=says) as exc:
            rendezvous.rendezvous_address(targets, machines)
        assert f"`rdzv_address:` under hosts.{targets[0].host.name}" in exc.value.hint
    assert rendezvous.rendezvous_address([bare("a", rdzv_address="10.9.0.1"), bare("b")], [via, B]) == "10.9.0.1"


IP_O = ("DFLASH_IP4 1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n"
        "DFLASH_IP4 3: eth1    inet 169.254.3.4/16 brd 169.254.255.255 scope global eth1\\       valid_lft forever\n"
        "DFLASH_IP4 4: eth0    inet 10.5.0.20/24 brd 10.5.0.255 scope global eth0\\       valid_lft forever\n"
        "DFLASH_HOSTIPS 10.9.9.9 fd00::2\n")


def test_rank_0s_address_in_its_container_is_its_first_global_ipv4_else_the_launch_is_refused():
    assert rendezvous.own_ipv4(IP_O) == "10.5.0.20"              # loopback and link-local skipped
    assert rendezvous.own_ipv4("DFLASH_HOSTIPS fd00::2 169.254.1.1 10.9.9.9 \n") == "10.9.9.9"   # no `ip`: hostname -I
    for none in ("", "DFLASH_HOSTIPS \n", "DFLASH_IP4 2: eth0 inet 300.1.1.1/24 scope global eth0\n",
                 "DFLASH_HOSTIPS 010.1.1.1 1.2.3.4;id ::1\n", "DFLASH_PORT 20001\n"):
        assert rendezvous.own_ipv4(none) is None, none
    ct = proxmox("pve1")
    assert rendezvous.found_address(IP_O, ct) == "10.5.0.20"
    with pytest.raises(ConfigError, match=r"rank 0's node pve1/ct200 has no global IPv4 address in its container") as e:
        rendezvous.found_address("DFLASH_HOSTIPS \n", ct)
    assert e.value.exit_code == 78 and "`rdzv_address:` under hosts.pve1.containers.200" in e.value.hint


RUN = NodeRun(RUN_ID, (Node(0, "pve1", "200"), Node(1, "root@10.1.2.7", "200")),
              Rendezvous("fd00::5", 29511, RUN_ID, timeout_s=120))


def test_each_node_gets_torchruns_rendezvous_variables():
    assert dict(RUN.node_env(1)) == {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_RDZV_BACKEND": "static",
                                     "PET_RDZV_ENDPOINT": "[fd00::5]:29511", "PET_RDZV_ID": RUN_ID,
                                     "PET_RDZV_CONF": "timeout=120"}
    assert {k for k, _ in RUN.node_env(0)} < set(rendezvous.RDZV_ENV)
    assert {"PET_STANDALONE", "PET_MASTER_ADDR", "PET_MASTER_PORT"} < set(rendezvous.RDZV_ENV)


def test_the_record_round_trips_and_a_tampered_one_is_not_a_record():
    doc = RUN.as_dict()
    assert record.from_dict(doc) == RUN
    for key, value in (("host", "pve1;id"), ("ct", "abc"), ("rank", 3)):
        bad = RUN.as_dict()
        bad["nodes"][0][key] = value
        assert record.from_dict(bad) is None
    for key, value in (("port", 0), ("port", "29511"), ("address", "a b"), ("backend", "c10d"), ("timeout_s", 0)):
        bad = RUN.as_dict()
        bad["rendezvous"][key] = value
        assert record.from_dict(bad) is None
    assert record.from_dict(None) is None and record.from_dict({"nodes": []}) is None


def book(command=("{python}", "-m", "torch.distributed.run", "-m", "trainer"), nodes=True) -> Runbook:
    return Runbook(name="b", command=tuple(command), nodes=nodes, liveness=Liveness())


def test_only_a_nodes_runbook_without_rendezvous_flags_spans_nodes():
    rendezvous.check_runbook(book(command=("{python}", "-m", "torch.distributed.run", "--nproc-per-node", "gpu",
                                        "--no-python", "-m", "trainer", "--recipe", "x", "--run-dir", "d", "--set")))
    with pytest.raises(UsageError, match="runs on one node: --node needs a runbook with `nodes: true`"):
        rendezvous.check_runbook(book(nodes=False))
    # the flags, and the abbreviations torchrun's argparse expands to them
    for flag in ("--standalone", "--nnodes=2", "--rdzv_endpoint", "--master-addr", "--nnode", "--stand", "--rdzv",
                 "--node_r", "--master_p=1"):
        with pytest.raises(UsageError, match=f"gives torchrun {flag}"):
            rendezvous.check_runbook(book(command=("{python}", "-m", "torch.distributed.run", flag)))


def test_no_environment_a_node_gets_may_set_the_rendezvous_and_torchrun_must_log_it_joining():
    for key in ("PET_RDZV_ENDPOINT", "PET_STANDALONE", "PET_MASTER_ADDR", "PET_MASTER_PORT"):
        with pytest.raises(UsageError, match=f"^--env sets {key}: with --node, dflash-ops sets the rendezvous"):
            rendezvous.check_env([("HF_HOME", "/x"), (key, "h:1")], "--env")
    rendezvous.check_env([("PET_NPROC_PER_NODE", "2")], "--env")
    b = book()
    rendezvous.check_loglevel([("LOGLEVEL", "WARNING"), ("LOGLEVEL", "INFO")], b)     # the last one wins, as exported
    for env, now in (([], "is not set"), ([("LOGLEVEL", "info")], "is 'info'"), ([("LOGLEVEL", "20")], "is '20'")):
        with pytest.raises(UsageError, match=f"runbook 'b': LOGLEVEL {now}; a multi-node launch waits") as exc:
            rendezvous.check_loglevel(env, b)
        assert exc.value.hint == "set `LOGLEVEL: INFO` in the runbook's env (graphwarm-nodes does)"


def status(state: str, exit_code=None, ended=None, stopped=False) -> RunStatus:
    return RunStatus(run_id=RUN_ID, name="pair", state=state, pid=1, exit_code=exit_code, started_at=0.0,
                     ended_at=ended, now=100.0, run_dir="/r", stopped=stopped)


def states(*statuses) -> list[NodeState]:
    return [NodeState(Node(i, f"h{i}"), f"h{i}", s, None if s else "unreachable", 0 if s else 69)
            for i, s in enumerate(statuses)]


def test_the_runs_state_names_the_node_that_failed_first():
    run, done = status("running"), status("exited", 0, 50.0)
    assert nodestate.overall(states(run, run)).text == "running"
    assert nodestate.overall(states(done, run)).state == "running"           # rank 0 finished a moment sooner
    assert nodestate.overall(states(done, done)).text == "exited 0"
    late, early = status("exited", 1, 60.0), status("killed", 137, 40.0)
    o = nodestate.overall(states(late, early, run))
    assert (o.state, o.first.node.rank, o.text) == ("failed", 1, "failed: node 1 (h1) first: killed (137)")
    lost = status("lost")                                                   # no exit recorded: it went first
    assert nodestate.overall(states(late, lost)).first.node.rank == 1
    cut = status("killed", 143, 70.0, stopped=True)
    assert nodestate.overall(states(cut, done)).text == "stopped"
    assert nodestate.overall(states(cut, run)).state == "failed"             # one node stopped under the others
    assert nodestate.overall(states(run, None)).text == "unknown: node 1 (h1): unreachable"
    assert nodestate.overall(states(late, None)).state == "failed"


def test_status_of_a_run_exits_4_when_it_failed_and_with_the_node_error_first():
    run, done, failed = status("running"), status("exited", 0, 50.0), status("exited", 1, 60.0)
    cut = status("killed", 143, 70.0, stopped=True)
    for nodes, code in (((run, run), 0), ((done, done), 0), ((cut, done), 0), ((failed,), 4), ((failed, run), 4),
                        ((run, None), 69), ((failed, None), 69)):
        st = states(*nodes)
        assert nodestate.verdict_code(nodestate.overall(st), st) == code, nodes


def test_the_free_port_script_skips_ports_in_use():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        others = [p for p in range(*rendezvous.PORT_RANGE)][:8]     # whatever this machine does with them meanwhile
        found = subprocess.run(["bash", "-c", launch_scripts.rendezvous_script([busy, *others])], capture_output=True,
                               text=True)
        assert found.returncode in (0, 1) and f"DFLASH_PORT {busy}\n" not in found.stdout, found.stderr
        none = subprocess.run(["bash", "-c", launch_scripts.rendezvous_script([busy])], capture_output=True, text=True)
        assert (none.returncode, none.stdout) == (1, "DFLASH_ERROR no free port\n")


def test_a_fenced_stop_keeps_a_late_launch_from_starting_its_job(tmp_path):
    """Rolling back a launch whose node did not answer in time: the run dir the late launch script would create
    is made first, marked stopped, so that script cannot start the job."""
    target = Target(Host(name="local", transport="local", runs_dir=str(tmp_path / "runs")))
    spec = runbooks.run_spec(Runbook(name="late", command=("touch", str(tmp_path / "started")), liveness=Liveness()),
                             target, name="late", run_id=RUN_ID)
    fenced = subprocess.run(["bash", "-c", stop_scripts.stop_script(target.runs_dir, RUN_ID, 1, fence=True)],
                            capture_output=True, text=True)
    assert fenced.returncode == 0 and "DFLASH_STOP fenced\n" in fenced.stdout, fenced.stderr
    late = subprocess.run(["bash", "-c", launch_scripts.launch_script(spec)], capture_output=True, text=True)
    assert late.returncode == 1 and "DFLASH_ERROR" in late.stdout and "DFLASH_LAUNCHED" not in late.stdout
    assert not (tmp_path / "started").exists() and (tmp_path / "runs" / RUN_ID / "stopped").is_file()
    state = parse.state_line(next(ln for ln in fenced.stdout.splitlines() if ln.startswith("DFLASH_RUN ")))
    assert parse.state_of(state) == "killed" and state.stopped


def test_tail_node_picks_a_rank_or_a_node_as_launched():
    loc = watch.Located(RUN_ID, RUN.nodes, (proxmox("pve1"), proxmox("b")), RUN)
    assert [loc.pick(x) for x in (None, "0", "1", "pve1:200", "root@10.1.2.7:200")] == [0, 0, 1, 0, 1]
    for bad in ("2", "pve1:201", "pve1"):
        with pytest.raises(UsageError, match=f"--node {bad}: not a node of {RUN_ID}"):
            loc.pick(bad)
    with pytest.raises(UsageError, match="invalid node '\u00b2'"):     # a digit to str.isdigit, not to int()
        loc.pick("\u00b2")
    single = watch.Located.single(RUN_ID, proxmox("pve1"))
    assert single.pick(None) == 0
    with pytest.raises(UsageError, match="is not a multi-node run"):
        single.pick("1")


def test_a_record_read_from_a_node_is_followed_only_when_it_names_that_node_and_inventory_hosts(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    inv = inventory.load_inventory(path)
    here = inventory.resolve_target(inv, "pve2", "200")
    group = NodeRun(RUN_ID, (Node(0, "pve1", "200"), Node(1, "pve2", "200")), Rendezvous("10.0.0.1", 29511, RUN_ID))

    def read_here(record: NodeRun, rank: int):
        return watch.located_from(inv, replace(status("running"), multinode=record, node_rank=rank), here)

    loc, warning = read_here(group, 1)
    assert warning is None and loc.multinode == group and [t.label for t in loc.targets] == ["pve1/ct200", "pve2/ct200"]
    foreign = replace(group, nodes=(Node(0, "root@203.0.113.9", "200"), Node(1, "pve2", "200")))
    for record, rank, why in ((group, 0, "its node 0 is pve1:200, not pve2/ct200"),
                              (foreign, 1, "it names root@203.0.113.9:200, not an inventory host")):
        loc, warning = read_here(record, rank)
        assert loc.multinode is None and loc.targets == (here,)
        assert warning == (f"warning: the record of {RUN_ID}'s nodes in its run.json on pve2/ct200 is not followed "
                           f"({why}); showing pve2/ct200 alone")


def test_text_from_hosts_is_never_taken_for_rich_markup(capsys):
    from dflash_ops.cli import render

    hostile = "[bold]x[/bold] [link=file:///etc/passwd]y[/link] [/]"
    failed = [NodeState(Node(0, "h0"), "h0[0]", None, hostile, 1)]
    render.node_runs(RUN_ID, failed, nodestate.overall(failed), json_out=False)
    render.runs_table([replace(status("running"), name=hostile)], target="[fd00::5]", json_out=False)
    out = capsys.readouterr().out
    assert out.count(hostile) == 2 and "h0[0]" in out and "runs on [fd00::5]" in out


def test_a_shut_transport_sends_nothing_more(tmp_path):
    """What a rolled-back launch does to each node's connection first: a node's thread still holding it (past
    its deadline) can run nothing through it, and does not connect again."""
    from dflash_ops.errors import HostUnreachable
    from dflash_ops.ssh import transport

    here = transport.LocalTransport()
    far = transport.SshTransport(Host(name="far", transport="proxmox", address="127.0.0.1", port=9))
    for t in (here, far):
        t.shut()
        with pytest.raises(HostUnreachable, match="connection shut"):
            t.run(["touch", str(tmp_path / "ran")])
    assert not (tmp_path / "ran").exists()
