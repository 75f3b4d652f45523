"""Two "nodes" of one data-parallel run, each started by `dflash-ops launch` with the rendezvous given through
`--env PET_*` (torchrun reads its flags from those variables), as the graphwarm-nodes runbook is used on real nodes.
Both nodes are local processes here (CPU, gloo); each has its own run directory, as separate machines would."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support.sshd import free_port

REPO = Path(__file__).resolve().parents[3]
TRAIN_SETS = ("data.seq_len=96", "data.rows_per_step=2", "data.num_anchors=8", "optim.max_steps=3", "log.every=1",
              "ckpt.every=0", "eval_at_end=false", "threads=1")


@pytest.mark.slow
def test_two_nodes_rendezvous_through_launch_env_and_train_one_model(ops_env, tmp_path):
    target = tmp_path / "target"  # on real nodes: the same path on every node
    made = subprocess.run([sys.executable, "-m", "trainer", "make-tiny-target", str(target)], env=ops_env.env,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    shipped = yaml.safe_load((REPO / "runbooks" / "graphwarm-nodes.yaml").read_text())
    book = dict(shipped, pre=[])
    # The shipped command with what a CPU box can run: one process per node, the smoke recipe, no graphs.
    command = list(shipped["command"])
    assert command[-2:] == ["--set", "step.mode=graph"]
    command = command[:-2]
    command[command.index("--nproc-per-node") + 1] = "1"
    command[command.index("--recipe") + 1] = "smoke"
    book["command"] = command
    (ops_env.runbooks / "nodes.yaml").write_text(yaml.safe_dump(book))
    port = free_port()
    rdzv = ("--env", "PET_NNODES=2", "--env", "PET_RDZV_BACKEND=c10d", "--env", f"PET_RDZV_ENDPOINT=127.0.0.1:{port}",
            "--env", "PET_RDZV_ID=nodes-test")
    sets = [x for s in (f"model.target={target}", *TRAIN_SETS) for x in ("--set", s)]
    cmd = [sys.executable, "-m", "dflash_ops", "--runbooks", str(ops_env.runbooks), "launch", "nodes", "--json"]
    nodes = [subprocess.Popen([*cmd, "--name", f"node{i}", *rdzv, "--", *sets], env=ops_env.env, cwd=ops_env.root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    launched = []
    for p in nodes:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        launched.append(json.loads(out))
    assert all(run["state"] == "running" for run in launched)
    deadline = time.monotonic() + 300
    while True:
        runs = {r["run_id"]: r for r in ops_env.runs_json()}
        states = [runs[run["run_id"]]["state_text"] for run in launched]
        if all(s.startswith("exited") for s in states) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    logs = [(Path(run["run_dir"]) / "output.log").read_text() for run in launched]
    assert states == ["exited 0", "exited 0"], logs
    done = [json.loads(line.split(" ", 1)[1]) for log in logs for line in log.splitlines()
            if line.startswith("DFLASH_DONE ")]
    assert len(done) == 1 and done[0]["world"] == 2  # rank 0 (on whichever node) reports for both
    assert len(done[0]["replica_sha256"]) == 2 and len(set(done[0]["replica_sha256"])) == 1
    assert all("PET_NNODES" in json.loads((Path(r["run_dir"]) / "run.json").read_text())["env_keys"]
               for r in launched)
