"""A multi-node run as one object, through the CLI over real SSH into two emulated containers (the two nodes, the
second one under a second inventory name of the same Proxmox host): `launch --node` wires torchrun's rendezvous
into every node, all or none; `runs`, `status`, `tail` and `stop` take the run id. The containers share the host's
network, so the inventory gives each `rdzv_address: 127.0.0.1`.

The training test runs the real trainer under the real torchrun on CPU (gloo) across the two nodes: the losses
and the final replica SHA-256 equal one node's with the same global batch, and a resume through one command picks
up the checkpoints that only rank 0's node holds. The real torchrun also shows a rendezvous that cannot complete
rolled back, and a node dying mid-run ending the other.
"""
from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e_bed import REPO, marked_processes, wait_for
from support import fake_nvidia_smi
from support.sshd import free_port

pytestmark = pytest.mark.ssh
CONTAINERS = 2
HOST_B = "pve-b"          # the test host under a second name: node 1's, so that it alone can be made unreachable
# A data-parallel worker at its smallest: gloo all-reduces until a peer is gone (then it raises, as the trainer does)
GLOO_WORKER = r'''
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t, step = torch.ones(1), 0
while True:
    dist.all_reduce(t)
    step += 1
    if step == 1 and dist.get_rank() == 0:
        print('DFLASH_METRICS {"step": 1, "loss": 1.0}', flush=True)
    time.sleep(0.05)
'''
TRAIN_SETS = ("data.seq_len=96", "data.rows_per_step=2", "data.num_anchors=8", "optim.max_steps=4", "log.every=1",
              "ckpt.every=2", "ckpt.keep=2", "eval_at_end=false", "threads=1")


def _inventory(bed, label: str, *, python: dict[int, str] | None = None, port_b: int | None = None) -> Path:
    """The bed's inventory with every container's `rdzv_address: 127.0.0.1`, node 1's container under HOST_B;
    `python`: a container's python replaced (ctid -> path), `port_b`: HOST_B's SSH port replaced."""
    original = bed.work / "inventory-bed.yaml"
    if not original.exists():
        shutil.copyfile(bed.inventory, original)
    doc = yaml.safe_load(original.read_text())
    host = doc["hosts"][bed.tb.host]
    for ctid, ct in host["containers"].items():
        ct.update(rdzv_address="127.0.0.1", **({"python": python[ctid]} if python and ctid in python else {}))
    doc["hosts"][HOST_B] = dict(host, containers={bed.ct(1): host["containers"].pop(bed.ct(1))},
                                **({"port": port_b} if port_b else {}))
    path = bed.work / f"inventory-{label}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _script(bed, name: str, text: str) -> str:
    path = bed.work / name
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def nodes_bed(bed):
    """The bed with its nodes inventory (`bed.nodes_inventory`), and the runbooks
    - `nodesjob`: the JOB script as a `nodes: true` runbook standing in for torchrun (it prints torchrun's
      rendezvous line at once); `nodesjob-brief`: the same with 2 s to prove alive, `nodesjob-patient` with an
      hour;
    - `torchjob`, `gloojob`: the real torchrun running, one process per node, the JOB script, or GLOO_WORKER;
    - `trainnodes`: the shipped graphwarm-nodes as a CPU box runs it (one process per node, the smoke recipe, no
      graphs, the inductor cache pre-step on a cache dir of the bed's); `trainone`: its trainer on one node, as
      one process."""
    job = yaml.safe_load((bed.runbooks / "job.yaml").read_text())
    env = dict(job["env"], LOGLEVEL="INFO")
    nodes_job = dict(job, nodes=True, env=env, command=job["command"] + ["--joined"])
    (bed.runbooks / "nodesjob.yaml").write_text(yaml.safe_dump(nodes_job))
    brief = dict(job["liveness"], timeout_s=2)
    (bed.runbooks / "nodesjob-brief.yaml").write_text(yaml.safe_dump(dict(nodes_job, liveness=brief)))
    patient = dict(job["liveness"], timeout_s=3600)
    (bed.runbooks / "nodesjob-patient.yaml").write_text(yaml.safe_dump(dict(nodes_job, liveness=patient)))
    torchrun = ["{python}", "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    started = {"wait_s": 0.5, "pattern": "Starting elastic_operator", "timeout_s": 120}
    gloo = bed.work / "gloo_worker.py"
    gloo.write_text(GLOO_WORKER)
    for name, script in (("torchjob", bed.job), ("gloojob", gloo)):
        (bed.runbooks / f"{name}.yaml").write_text(yaml.safe_dump(dict(
            job, nodes=True, env=dict(env, OMP_NUM_THREADS="1"), command=torchrun + [str(script)], liveness=started)))
    shipped = yaml.safe_load((REPO / "runbooks" / "graphwarm-nodes.yaml").read_text())
    command = list(shipped["command"])
    assert shipped["nodes"] is True and command[-2:] == ["--set", "step.mode=compile+graph"]
    command = command[:-2]
    command[command.index("--nproc-per-node") + 1] = "1"
    command[command.index("--recipe") + 1] = "smoke"
    env = dict(shipped["env"], TORCHINDUCTOR_CACHE_DIR=str(bed.cache_dir))
    (bed.runbooks / "trainnodes.yaml").write_text(yaml.safe_dump(dict(shipped, command=command, env=env)))
    one = [command[0]] + command[command.index("--nproc-per-node") + 2:]      # the trainer without torchrun
    (bed.runbooks / "trainone.yaml").write_text(yaml.safe_dump(dict(shipped, command=one, env=env, nodes=False)))
    bed.inventory.write_text(_inventory(bed, "nodes").read_text())   # every command of this module uses it
    return bed


def nodes_of(bed) -> list[str]:
    return [f"{bed.tb.host}:{bed.ct(0)}", f"{HOST_B}:{bed.ct(1)}"]


def node_args(bed, n: int = CONTAINERS) -> list[str]:
    return [x for spec in nodes_of(bed)[:n] for x in ("--node", spec)]


def labels(bed) -> list[str]:
    return [f"{bed.tb.host}/ct{bed.ct(0)}", f"{HOST_B}/ct{bed.ct(1)}"]


def cli_json(bed, *args: str, code: int = 0, inventory: Path | None = None) -> dict:
    """The command's --json document (given before any `--`); fails the test unless it exits `code`."""
    cut = args.index("--") if "--" in args else len(args)
    done = bed.cli(*args[:cut], "--json", *args[cut:], inventory=inventory)
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    return json.loads(done.stdout)


def environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(i.decode().split("=", 1) for i in items if b"=" in i)


def run_dir(bed, i: int, run_id: str) -> Path:
    return bed.tb.runs_dirs[bed.ct(i)] / run_id


def kill_node(bed, i: int, run_id: str) -> None:
    """Node i dies outright: every process group of its run SIGKILLed at once (no exit status recorded)."""
    groups = set()
    for pid in marked_processes(bed.container(i), run_id):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: marked_processes(bed.container(i), run_id) == [], f"node {i}'s processes to go")


def nothing_runs(bed, prefix: str) -> None:
    """No process of any run named `prefix...` is left on either node."""
    def idle() -> bool:
        return all(marked_processes(bed.container(i), d.name) == [] for i in range(CONTAINERS)
                   for d in bed.run_dirs(bed.ct(i), prefix))
    wait_for(idle, f"no process of {prefix} runs to be left")


def records(prefix: str) -> list[Path]:
    """The multi-node records on this machine of runs named `prefix`."""
    from dflash_ops.multinode import recordfile

    return sorted(recordfile.path(f"{prefix}-20260101T000000-0000").parent.glob(f"{prefix}-*.json"))


@pytest.mark.slow
def test_the_nodes_get_one_run_id_and_the_rendezvous_and_status_tail_stop_cover_a_dead_node(nodes_bed, monkeypatch):
    bed = nodes_bed
    gpus = fake_nvidia_smi.install(bed.work / "gpu-bin", bed.work / "gpus.json", n_gpus=2)
    monkeypatch.setenv("DFLASH_OPS_NVIDIA_SMI", str(gpus))
    (bed.work / "no-devices").mkdir()
    monkeypatch.setenv("DFLASH_OPS_NVIDIA_DEV_GLOB", str(bed.work / "no-devices" / "nvidia*"))
    hold = f"0:1024:{(bed.work / 'gpus.json').resolve()}"       # every node's job holds GPU 0 of the fake
    doc = cli_json(bed, "launch", "nodesjob", *node_args(bed), "--name", "pair", "--env", f"FAKE_NVIDIA_HOLD={hold}",
                   "--", "--metrics", "2", "--end-gate", str(bed.gate("pair-end")))
    run_id, rdzv = doc["run_id"], doc["multinode"]["rendezvous"]
    assert [n["rank"] for n in doc["nodes"]] == [0, 1] and {n["run_id"] for n in doc["nodes"]} == {run_id}
    assert [n["target"] for n in doc["nodes"]] == labels(bed)
    assert (rdzv["address"], rdzv["id"], rdzv["backend"]) == ("127.0.0.1", run_id, "static")
    for i, node in enumerate(doc["nodes"]):
        [job] = [p for p in marked_processes(bed.container(i), run_id)
                 if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[1:2] == [str(bed.job).encode()]]
        env = environ(job)   # what the wrapper exported for the job
        assert {k: env[k] for k in env if k.startswith("PET_")} == {
            "PET_NNODES": "2", "PET_NODE_RANK": str(i), "PET_RDZV_BACKEND": "static",
            "PET_RDZV_ENDPOINT": f"127.0.0.1:{rdzv['port']}", "PET_RDZV_ID": run_id, "PET_RDZV_CONF": "timeout=600"}
        record = json.loads((run_dir(bed, i, run_id) / "run.json").read_text())
        assert (record["node_rank"], record["multinode"]) == (i, doc["multinode"])

    # A row per node, each with its GPUs, and rank 0's metrics (step, tok/s) under it.
    log0 = run_dir(bed, 0, run_id) / "output.log"
    wait_for(lambda: '"step": 2' in log0.read_text(), "rank 0's second metrics line")
    human = bed.cli("status", run_id, "--timeout", "60").stdout.decode().splitlines()
    assert human[0] == f"{run_id}  running" and human[-1].startswith("2 node(s) in "), human
    pids = [node["pid"] for node in doc["nodes"]]
    assert [line.split("  up ")[0] for line in human[1:4:2]] == [
        f"  node {i}  {labels(bed)[i]}  running  pid {pids[i]}" for i in range(2)], human
    assert human[1].endswith("  gpus 0") and human[3].endswith("  gpus 0"), human
    assert human[2] == "    step 2  loss 3.8000  tok/s 200", human          # rank 0's line; rank 1 prints none

    # Node 1 dies outright. Nothing stops node 0 here: the state says which node failed first (exit 4: a script
    # reads a failed run), and the run is found from either node's --host/--ct too.
    kill_node(bed, 1, run_id)
    status = cli_json(bed, "status", run_id, "--timeout", "60", code=4)
    assert (status["state"], status["first_failed"]) == ("failed", {"rank": 1, "target": labels(bed)[1]})
    assert [n["run"]["state"] for n in status["nodes"]] == ["running", "lost"]
    assert status["state_text"] == f"failed: node 1 ({labels(bed)[1]}) first: lost"
    runs = cli_json(bed, "runs", run_id, "--host", HOST_B, "--ct", str(bed.ct(1)))
    assert [(n["rank"], n["status"]["state_text"]) for n in runs["nodes"]] == [(0, "running"), (1, "lost")]

    tail0 = bed.cli("tail", run_id, "--no-follow", "--lines", "1")
    assert (tail0.returncode, tail0.stdout) == (0, b"step 2 loss 3.8\n"), tail0.stderr
    assert f"node 0 of {run_id} ({labels(bed)[0]})".encode() in tail0.stderr
    tail1 = bed.cli("tail", run_id, "--node", nodes_of(bed)[1], "--no-follow")
    assert tail1.returncode == 4 and tail1.stdout.startswith(b"job started\n"), tail1.stderr
    assert bed.cli("tail", run_id, "--node", "7").returncode == 2

    # `stop` while node 1's host cannot be reached: node 0 is stopped all the same, node 1 reported (exit 69).
    dead_b = _inventory(bed, "dead-b", port_b=free_port())
    stop = cli_json(bed, "stop", run_id, "--grace", "30", code=69, inventory=dead_b)
    assert [(n["rank"], n["action"]) for n in stop["nodes"]] == [(0, "terminated"), (1, "failed")]
    assert stop["nodes"][1]["error"]["code"] == "unreachable"
    wait_for(lambda: marked_processes(bed.container(0), run_id) == [], "node 0's processes to go")
    after = cli_json(bed, "runs", run_id)
    assert after["state"] == "failed" and [n["status"]["state"] for n in after["nodes"]] == ["killed", "lost"]
    for i in range(CONTAINERS):                 # a run no node has any more: exit 3, as for one node
        shutil.rmtree(run_dir(bed, i, run_id))
    assert cli_json(bed, "stop", run_id, code=3)["nodes"][0]["action"] == "not_there"


def test_stop_marks_every_node_stopped_before_it_signals_any(nodes_bed):
    """Node 1 exits 1 as soon as node 0 gets SIGTERM (as a rank whose collective lost its peer): the run reads
    `stopped`, not `failed`, as node 1 was marked stopped before node 0 was signalled."""
    bed = nodes_bed
    doc = cli_json(bed, "launch", "nodesjob", *node_args(bed), "--name", "peers", "--",
                   "--peers", str(bed.gate("peers")))
    stop = cli_json(bed, "stop", doc["run_id"], "--grace", "30")
    assert [n["action"] for n in stop["nodes"]][0] == "terminated"    # node 1: the same, or it ended first
    runs = cli_json(bed, "runs", doc["run_id"])
    assert runs["state"] == "stopped" and (run_dir(bed, 1, doc["run_id"]) / "stopped").is_file(), runs


@pytest.mark.slow
def test_a_launch_that_fails_on_one_node_leaves_nothing_running(nodes_bed):
    bed = nodes_bed
    # The second node unreachable (a port nothing listens on): nothing is launched anywhere, no record is kept.
    dead = _inventory(bed, "dead-node", port_b=free_port())
    done = bed.cli("launch", "nodesjob", *node_args(bed), "--name", "half", inventory=dead)
    assert done.returncode == 69, done.stderr
    assert f"error: node 1 ({labels(bed)[1]}) of half-".encode() in done.stderr
    assert b"nothing was launched" in done.stderr
    assert bed.run_dirs(bed.ct(0), "half") == [] and records("half") == []

    # The second node would refuse (a run of that name lives there): every node is asked before any starts, so
    # nothing starts on the first (its cache is not cleared, no torchrun begins).
    gate = bed.gate("dup-holds")
    node1 = ["--host", HOST_B, "--ct", str(bed.ct(1))]
    single = cli_json(bed, "launch", "job", *node1, "--name", "dup", "--", "--gate", str(gate))
    done = bed.cli("launch", "nodesjob", *node_args(bed), "--name", "dup", "--", "--gate", str(gate))
    assert done.returncode == 5, done.stderr
    err = done.stderr.decode()
    assert f"error: node 1 ({labels(bed)[1]}) of dup-" in err and "nothing was launched" in err
    assert f"run {single['run_id']} of that name is alive" in err
    assert bed.run_dirs(bed.ct(0), "dup") == [] and records("dup") == []
    assert bed.cli("stop", single["run_id"], *node1).returncode == 0

    # The second node starts but never proves alive (its python: silent): it is stopped too, as is the first.
    mute = _inventory(bed, "mute", python={bed.ct(1): _script(bed, "mute-python", "#!/bin/sh\nexec sleep 300\n")})
    done = bed.cli("launch", "nodesjob-brief", *node_args(bed), "--name", "mute", "--", "--gate", str(gate),
                   inventory=mute)
    assert done.returncode == 4, done.stderr
    err = done.stderr.decode()     # node 1's failure (or node 0's too, on a box too loaded to start it in 2 s)
    assert "error: node " in err and "no log line matched" in err, err
    assert f"node 1 ({labels(bed)[1]}) stopped with SIGTERM" in err, err
    nothing_runs(bed, "mute")
    assert all((d / "stopped").is_file() for i in range(CONTAINERS) for d in bed.run_dirs(bed.ct(i), "mute"))
    assert records("mute") == []

    # Once nothing is in the way, the same launch succeeds; --follow follows rank 0 to its end.
    done = bed.cli("launch", "nodesjob", *node_args(bed), "--name", "dup", "--follow", "--", "--lines", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(b"job started\n[default] Rendezvous complete for workers. Result:\nline 0\nline 1\n")


def test_ctrl_c_or_a_bug_during_a_launch_stops_the_nodes_that_started(nodes_bed):
    bed = nodes_bed
    mute = _inventory(bed, "mute-ctrl-c", python={bed.ct(1): _script(bed, "mute-python2", "#!/bin/sh\nexec sleep 300\n")})
    # node 1 waits for a liveness line that never comes, for longer than any test runs: only the Ctrl-C ends the
    # launch, however slowly a loaded machine brings node 1 up
    proc = subprocess.Popen(bed.argv("launch", "nodesjob-patient", *node_args(bed), "--name", "ctrlc",
                                     inventory=mute),
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=bed.env(), cwd=bed.work)
    said = b""
    while b"started node 1 of ctrlc-" not in said:
        line = proc.stderr.readline()
        assert line, said
        said += line
    proc.send_signal(signal.SIGINT)
    said += proc.communicate(timeout=300)[1]
    assert proc.returncode == 130, said
    assert b"interrupted; rolled back ctrlc-" in said and b"stopped with SIGTERM" in said, said
    nothing_runs(bed, "ctrlc")
    assert records("ctrlc") == []

    # A bug (here: in what the caller does when a node has started) is raised with its traceback, once the nodes
    # that started are stopped.
    from dflash_ops import inventory
    from dflash_ops.multinode import launch, plan
    from dflash_ops.runs import runbooks

    def broken(rank: int, pid: int) -> None:
        if rank == 1:
            raise ZeroDivisionError("a bug")

    p = plan.plan(inventory.load_inventory(bed.inventory), runbooks.load_runbook(bed.runbooks, "nodesjob"),
                  nodes_of(bed), name="bug", extra_args=("--gate", str(bed.gate("bug"))))
    try:
        with pytest.raises(ZeroDivisionError, match="a bug"):
            launch.launch(p, on_started=broken)
    finally:
        p.close()
    nothing_runs(bed, "bug")
    assert [len(bed.run_dirs(bed.ct(i), "bug")) for i in range(CONTAINERS)] == [1, 1] and records("bug") == []


@pytest.mark.slow
def test_nodes_that_do_not_meet_at_the_rendezvous_are_rolled_back(nodes_bed):
    """The real torchrun on both nodes; node 1's is given a wrong endpoint and a 1 s timeout (its python sets
    PET_RDZV_ENDPOINT and PET_RDZV_CONF): both torchruns start and prove alive, and never meet. Node 1 gives up;
    node 0 would wait its 600 s, were it not rolled back."""
    bed = nodes_bed
    astray = _script(bed, "astray-python", "#!/bin/sh\nPET_RDZV_ENDPOINT=127.0.0.1:1 PET_RDZV_CONF=timeout=1 "
                                           f'exec {sys.executable} "$@"\n')
    done = bed.cli("launch", "torchjob", *node_args(bed), "--name", "astray",
                   inventory=_inventory(bed, "astray", python={bed.ct(1): astray}))
    assert done.returncode == 4, done.stderr
    err = done.stderr.decode()
    assert "error: the nodes of astray-" in err and "did not meet at the rendezvous 127.0.0.1:" in err, err
    assert f"node 1 ({labels(bed)[1]}) ended (exited 1) before it completed" in err, err
    assert f"node 0 ({labels(bed)[0]}) stopped with SIGTERM" in err, err
    nothing_runs(bed, "astray")
    assert records("astray") == []


def _records(log: str, prefix: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in log.splitlines() if line.startswith(prefix)]


def _science(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s", "elapsed_s", "world")}
            for r in records]


def _train(bed, n: int, *args: str) -> tuple[dict, list[str]]:
    """Launch `trainnodes` on the first n nodes (n == 1: `trainone` on the first) with the trainer args; wait for
    every node to end -> (launch document, each node's output.log)."""
    where = ["--host", bed.tb.host, "--ct", str(bed.ct(0))] if n == 1 else []
    doc = cli_json(bed, "launch", *(["trainone", *where] if n == 1 else ["trainnodes", *node_args(bed, n)]),
                   "--", *args)
    run_id = doc["run_id"]
    wait_for(lambda: all((run_dir(bed, i, run_id) / "exit_code").exists() for i in range(n)), f"{run_id} to end",
             timeout_s=600, poll_s=0.2)
    runs = cli_json(bed, "runs", run_id, *where)
    logs = [(run_dir(bed, i, run_id) / "output.log").read_text() for i in range(n)]
    assert runs["state"] == "exited 0", (runs, logs)
    return doc, logs


@pytest.fixture(scope="module")
def train_sets(tiny_target_dir) -> list[str]:
    """The trainer arguments of the training tests, on the session's tiny target (on real nodes: the same path on
    every node)."""
    return [x for s in (f"model.target={tiny_target_dir}", *TRAIN_SETS) for x in ("--set", s)]


@pytest.mark.slow
@pytest.mark.timeout(1200)   # torch starts 6 times on 2 cores; every wait below ends on an event
def test_two_nodes_train_one_model_as_one_node_does_and_resume_from_the_node_that_kept_the_checkpoints(
        nodes_bed, train_sets):
    bed, sets = nodes_bed, train_sets

    one, [one_log] = _train(bed, 1, *sets, "--set", "optim.accum_steps=2")       # one process: the reference
    two, logs = _train(bed, 2, *sets)       # the launch returned once torchrun's rendezvous completed on each node
    assert all("Rendezvous complete for workers" in log for log in logs)
    straight, done = _records(logs[0], "DFLASH_METRICS "), _records(logs[0], "DFLASH_DONE ")
    assert _records(logs[1], "DFLASH_METRICS ") == [] and _records(logs[1], "DFLASH_DONE ") == []  # rank 0 reports
    assert [r["step"] for r in straight] == [1, 2, 3, 4] and {r["world"] for r in straight} == {2}
    assert _science(straight) == _science(_records(one_log, "DFLASH_METRICS "))       # bit for bit
    assert done[0]["replica_sha256"] == _records(one_log, "DFLASH_DONE ")[0]["replica_sha256"] * 2

    # As if the job died after the step-2 checkpoint. Only rank 0's node (the first) holds checkpoints; resuming,
    # every node points at its own earlier run dir (`../<run id>`, beside the new one) and node 1, without them,
    # receives them from node 0.
    dirs = [run_dir(bed, i, two["run_id"]) for i in range(2)]
    assert (dirs[0] / "ckpt").is_dir() and not (dirs[1] / "ckpt").exists()
    shutil.rmtree(dirs[0] / "ckpt" / "step_4")
    shutil.rmtree(dirs[0] / "export")
    _again, logs = _train(bed, 2, *sets, "--run-dir", f"../{two['run_id']}", "--resume")
    resumed = _records(logs[0], "DFLASH_METRICS ")
    assert [r["step"] for r in resumed] == [3, 4]
    assert _science(resumed) == _science(straight[2:])
    assert _records(logs[0], "DFLASH_DONE ")[0]["replica_sha256"] == done[0]["replica_sha256"]


@pytest.mark.slow
def test_a_node_that_dies_mid_run_ends_the_others_and_the_run_says_which_node_failed_first(nodes_bed):
    bed = nodes_bed
    doc = cli_json(bed, "launch", "gloojob", *node_args(bed), "--name", "crash")
    run_id, log0 = doc["run_id"], run_dir(bed, 0, doc["run_id"]) / "output.log"
    ended0 = run_dir(bed, 0, run_id) / "exit_code"
    wait_for(lambda: "DFLASH_METRICS" in log0.read_text() or ended0.exists(), "the first all-reduce", poll_s=0.2)
    assert "DFLASH_METRICS" in log0.read_text(), log0.read_text()[-3000:]
    kill_node(bed, 1, run_id)                   # node 1 crashes: torchrun and its rank, at once
    wait_for(ended0.exists, "node 0 to end by itself", timeout_s=120, poll_s=0.2)
    runs = cli_json(bed, "runs", run_id)
    assert runs["state_text"] == f"failed: node 1 ({labels(bed)[1]}) first: lost", runs
    assert [n["status"]["state_text"] for n in runs["nodes"]] == ["exited 1", "lost"]
    wait_for(lambda: marked_processes(bed.container(0), run_id) == [], "node 0's processes to go")
