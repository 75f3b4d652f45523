"""A multi-node run as one object, through the CLI over real SSH into two emulated containers of one Proxmox host
(two nodes): `launch --node` wires torchrun's rendezvous into every node, all or none; `runs`, `status`, `tail`
and `stop` take the run id. The containers share the host's network, so rank 0's address is 127.0.0.1.

The training test runs the real trainer under the real torchrun on CPU (gloo) across the two nodes: the losses
and the final replica SHA-256 equal one node's with the same global batch, and a resume through one command picks
up the checkpoints that only rank 0's node holds.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e_bed import REPO, marked_processes, wait_for

pytestmark = pytest.mark.ssh
CONTAINERS = 2
TRAIN_SETS = ("data.seq_len=96", "data.rows_per_step=2", "data.num_anchors=8", "optim.max_steps=4", "log.every=1",
              "ckpt.every=2", "ckpt.keep=2", "eval_at_end=false", "threads=1")


@pytest.fixture(scope="module")
def nodes_bed(bed):
    """The bed with `nodesjob` (the JOB script as a `nodes: true` runbook) and `trainnodes` (the shipped
    graphwarm-nodes as a CPU box runs it: one process per node, the smoke recipe, no graphs, the inductor cache
    pre-step on a cache dir of the bed's)."""
    job = yaml.safe_load((bed.runbooks / "job.yaml").read_text())
    (bed.runbooks / "nodesjob.yaml").write_text(yaml.safe_dump(dict(job, nodes=True)))
    shipped = yaml.safe_load((REPO / "runbooks" / "graphwarm-nodes.yaml").read_text())
    command = list(shipped["command"])
    assert shipped["nodes"] is True and command[-2:] == ["--set", "step.mode=compile+graph"]
    command = command[:-2]
    command[command.index("--nproc-per-node") + 1] = "1"
    command[command.index("--recipe") + 1] = "smoke"
    env = dict(shipped["env"], TORCHINDUCTOR_CACHE_DIR=str(bed.cache_dir))
    (bed.runbooks / "trainnodes.yaml").write_text(yaml.safe_dump(dict(shipped, command=command, env=env)))
    return bed


def nodes_of(bed) -> list[str]:
    return [f"{bed.tb.host}:{bed.ct(i)}" for i in range(CONTAINERS)]


def node_args(bed, n: int = CONTAINERS) -> list[str]:
    return [x for spec in nodes_of(bed)[:n] for x in ("--node", spec)]


def cli_json(bed, *args: str, code: int = 0) -> dict:
    """The command's --json document (given before any `--`); fails the test unless it exits `code`."""
    cut = args.index("--") if "--" in args else len(args)
    done = bed.cli(*args[:cut], "--json", *args[cut:])
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    return json.loads(done.stdout)


def environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(i.decode().split("=", 1) for i in items if b"=" in i)


def test_the_nodes_get_one_run_id_and_the_rendezvous_and_status_tail_stop_cover_a_dead_node(nodes_bed):
    bed = nodes_bed
    gate = bed.gate("nodes-alive")
    doc = cli_json(bed, "launch", "nodesjob", *node_args(bed), "--name", "pair", "--", "--gate", str(gate),
                   "--metrics", "2")
    run_id, rdzv = doc["run_id"], doc["multinode"]["rendezvous"]
    assert [n["rank"] for n in doc["nodes"]] == [0, 1] and {n["run_id"] for n in doc["nodes"]} == {run_id}
    assert [n["target"] for n in doc["nodes"]] == [f"{bed.tb.host}/ct{bed.ct(i)}" for i in range(2)]
    assert (rdzv["address"], rdzv["id"], rdzv["backend"]) == ("127.0.0.1", run_id, "static")
    for i, node in enumerate(doc["nodes"]):
        [job] = [p for p in marked_processes(bed.container(i), run_id)
                 if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[1:2] == [str(bed.job).encode()]]
        env = environ(job)   # what the wrapper exported for the job
        assert {k: env[k] for k in env if k.startswith("PET_")} == {
            "PET_NNODES": "2", "PET_NODE_RANK": str(i), "PET_RDZV_BACKEND": "static",
            "PET_RDZV_ENDPOINT": f"127.0.0.1:{rdzv['port']}", "PET_RDZV_ID": run_id, "PET_RDZV_CONF": "timeout=600"}
        record = json.loads((bed.tb.runs_dirs[bed.ct(i)] / run_id / "run.json").read_text())
        assert (record["node_rank"], record["multinode"]) == (i, doc["multinode"])

    # Node 1 dies outright (its whole process group killed: no exit status recorded). Nothing stops node 0 here:
    # the state says which node failed first, and `status` finds the run from either node's --host/--ct.
    node1 = bed.container(1).host_pid(doc["nodes"][1]["pid"])
    os.killpg(node1, signal.SIGKILL)
    wait_for(lambda: marked_processes(bed.container(1), run_id) == [], "node 1's processes to go")
    status = cli_json(bed, "status", run_id, *bed.target(bed.ct(1)))
    node1 = {"rank": 1, "target": f"{bed.tb.host}/ct{bed.ct(1)}"}
    assert (status["state"], status["first_failed"]) == ("failed", node1)
    assert [n["run"]["state"] for n in status["nodes"]] == ["running", "lost"]
    assert status["state_text"] == f"failed: node 1 ({bed.tb.host}/ct{bed.ct(1)}) first: lost"
    runs = cli_json(bed, "runs", run_id)
    assert [(n["rank"], n["status"]["state_text"]) for n in runs["nodes"]] == [(0, "running"), (1, "lost")]

    tail0 = bed.cli("tail", run_id, "--no-follow")
    assert (tail0.returncode, tail0.stdout) == (0, b"job started\n"), tail0.stderr
    assert f"node 0 of {run_id} ({bed.tb.host}/ct{bed.ct(0)})".encode() in tail0.stderr
    tail1 = bed.cli("tail", run_id, "--node", nodes_of(bed)[1], "--no-follow")
    assert (tail1.returncode, tail1.stdout) == (4, b"job started\n"), tail1.stderr
    assert bed.cli("tail", run_id, "--node", "7").returncode == 2

    stop = cli_json(bed, "stop", run_id, "--grace", "5")
    assert [(n["rank"], n["action"]) for n in stop["nodes"]] == [(0, "terminated"), (1, "not_running")]
    assert marked_processes(bed.container(0), run_id) == []
    after = cli_json(bed, "status", run_id)
    assert after["state"] == "failed" and [n["run"]["state"] for n in after["nodes"]] == ["killed", "lost"]


def test_a_launch_that_fails_on_one_node_leaves_nothing_running(nodes_bed, tmp_path):
    bed = nodes_bed
    # The second node unreachable (another "machine": a port nothing listens on; rank 0 names its own rendezvous
    # address, as a real one would): nothing is launched anywhere.
    dead = bed.inventory_with("dead-node", rdzv_address="127.0.0.1")
    doc = yaml.safe_load(dead.read_text())
    doc["hosts"]["dead"] = dict(doc["hosts"][bed.tb.host], port=sshd_free_port())
    dead.write_text(yaml.safe_dump(doc))
    done = bed.cli("launch", "nodesjob", "--node", nodes_of(bed)[0], "--node", f"dead:{bed.ct(1)}", "--name", "half",
                   inventory=dead)
    assert done.returncode == 69, done.stderr
    assert f"error: node 1 (dead/ct{bed.ct(1)}) of half-".encode() in done.stderr
    assert b"nothing was launched" in done.stderr
    assert bed.run_dirs(bed.ct(0), "half") == []

    # The second node refuses (a run of that name lives there): the first, which started, is stopped.
    gate = bed.gate("dup-holds")
    single = bed.launch(bed.ct(1), "--gate", str(gate), name="dup")
    done = bed.cli("launch", "nodesjob", *node_args(bed), "--name", "dup", "--", "--gate", str(gate))
    assert done.returncode == 5, done.stderr
    err = done.stderr.decode()
    assert f"error: node 1 ({bed.tb.host}/ct{bed.ct(1)}) of dup-" in err
    assert f"run {single['run_id']} of that name is alive" in err
    [first] = [d for d in bed.run_dirs(bed.ct(0), "dup")]
    assert marked_processes(bed.container(0), first.name) == []
    assert json.loads((first / "run.json").read_text())["node_rank"] == 0 and (first / "stopped").is_file()
    assert f"stopped the others: node 0 ({bed.tb.host}/ct{bed.ct(0)}) stopped with SIGTERM" in err
    assert bed.cli("stop", single["run_id"], *bed.target(bed.ct(1))).returncode == 0

    # Once nothing is in the way, the same launch succeeds; --follow follows rank 0 to its end.
    done = bed.cli("launch", "nodesjob", *node_args(bed), "--name", "dup", "--follow", "--", "--lines", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(b"job started\nline 0\nline 1\n"), done.stdout


def sshd_free_port() -> int:
    from support.sshd import free_port

    return free_port()


def _records(log: str, prefix: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in log.splitlines() if line.startswith(prefix)]


def _science(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s", "elapsed_s", "world")}
            for r in records]


def _train(bed, n: int, *args: str) -> tuple[dict, list[str]]:
    """Launch `trainnodes` on the first n nodes with the trainer args; wait for every node to end -> (launch
    document, each node's output.log)."""
    doc = cli_json(bed, "launch", "trainnodes", *node_args(bed, n), "--", *args)
    run_id = doc["run_id"]
    wait_for(lambda: all(not n["status"]["state"] == "running" for n in cli_json(bed, "runs", run_id)["nodes"]),
             f"{run_id} to end", timeout_s=600)
    status = cli_json(bed, "status", run_id)
    logs = [(bed.tb.runs_dirs[bed.ct(i)] / run_id / "output.log").read_text() for i in range(n)]
    assert status["state"] == "exited 0", (status, logs)
    return doc, logs


@pytest.fixture(scope="module")
def train_sets(nodes_bed) -> list[str]:
    """The trainer arguments of the training tests, on a tiny target made once (on real nodes: the same path on
    every node)."""
    target = nodes_bed.work / "target"
    made = subprocess.run([sys.executable, "-m", "trainer", "make-tiny-target", str(target)], capture_output=True,
                          text=True, env=nodes_bed.env())
    assert made.returncode == 0, made.stderr
    return [x for s in (f"model.target={target}", *TRAIN_SETS) for x in ("--set", s)]


@pytest.mark.slow
@pytest.mark.timeout(1200)   # torch starts 6 times on 2 cores; every wait below ends on an event
def test_two_nodes_train_one_model_as_one_node_does_and_resume_from_the_node_that_kept_the_checkpoints(
        nodes_bed, train_sets):
    bed, sets = nodes_bed, train_sets

    one, [one_log] = _train(bed, 1, *sets, "--set", "optim.accum_steps=2")
    two, logs = _train(bed, 2, *sets)
    straight, done = _records(logs[0], "DFLASH_METRICS "), _records(logs[0], "DFLASH_DONE ")
    assert _records(logs[1], "DFLASH_METRICS ") == [] and _records(logs[1], "DFLASH_DONE ") == []  # rank 0 reports
    assert [r["step"] for r in straight] == [1, 2, 3, 4] and {r["world"] for r in straight} == {2}
    assert _science(straight) == _science(_records(one_log, "DFLASH_METRICS "))       # bit for bit
    assert done[0]["replica_sha256"] == _records(one_log, "DFLASH_DONE ")[0]["replica_sha256"] * 2

    # As if the job died after the step-2 checkpoint. Only rank 0's node (the first) holds checkpoints; resuming,
    # every node points at its own earlier run dir (`../<run id>`, beside the new one) and node 1, without them,
    # receives them from node 0.
    dirs = [bed.tb.runs_dirs[bed.ct(i)] / two["run_id"] for i in range(2)]
    assert (dirs[0] / "ckpt").is_dir() and not (dirs[1] / "ckpt").exists()
    shutil.rmtree(dirs[0] / "ckpt" / "step_4")
    shutil.rmtree(dirs[0] / "export")
    _again, logs = _train(bed, 2, *sets, "--run-dir", f"../{two['run_id']}", "--resume")
    resumed = _records(logs[0], "DFLASH_METRICS ")
    assert [r["step"] for r in resumed] == [3, 4]
    assert _science(resumed) == _science(straight[2:])
    assert _records(logs[0], "DFLASH_DONE ")[0]["replica_sha256"] == done[0]["replica_sha256"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_node_that_dies_mid_run_ends_the_others_and_the_run_says_which_node_failed_first(nodes_bed, train_sets):
    bed = nodes_bed
    doc = cli_json(bed, "launch", "trainnodes", *node_args(bed), "--name", "crash", "--",
                   *train_sets, "--set", "optim.max_steps=100000", "--set", "ckpt.every=0")
    run_id, log0 = doc["run_id"], bed.tb.runs_dirs[bed.ct(0)] / doc["run_id"] / "output.log"
    wait_for(lambda: "DFLASH_METRICS" in log0.read_text(), "the first training step", timeout_s=300)
    for pid in marked_processes(bed.container(1), run_id):   # node 1 crashes: torchrun and its rank, at once
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: cli_json(bed, "runs", run_id)["nodes"][0]["status"]["state"] != "running",
             "node 0 to end by itself", timeout_s=300)
    status = cli_json(bed, "status", run_id)
    assert status["state"] == "failed" and status["first_failed"]["rank"] == 1, status
    assert [n["run"]["state_text"] for n in status["nodes"]] == ["exited 1", "lost"]
    assert marked_processes(bed.container(0), run_id) == []
