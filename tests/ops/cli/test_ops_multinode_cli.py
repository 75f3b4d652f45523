"""Two "nodes" of one data-parallel run, each started by `dflash-ops launch` with the rendezvous given through
`--env PET_*` (torchrun reads its flags from those variables), as the graphwarm-nodes runbook is used on real nodes.
Both nodes are local processes here (CPU, gloo); each has its own run directory, as separate machines would, so
only the node that held rank 0 has the checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support.sshd import free_port

REPO = Path(__file__).resolve().parents[3]
TRAIN_SETS = ("data.seq_len=96", "data.rows_per_step=2", "data.num_anchors=8", "optim.max_steps=4", "log.every=1",
              "ckpt.every=2", "ckpt.keep=2", "eval_at_end=false", "threads=1")


def _records(log: str, prefix: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in log.splitlines() if line.startswith(prefix)]


def _science(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s", "elapsed_s")} for r in records]


def _launch_nodes(ops_env, tag: str, per_node_args: list[list[str]]) -> list[tuple[dict, str]]:
    """Launch one node per entry of per_node_args (trainer args after `--`) at the same time, as an operator does on
    several hosts; wait until every run exited -> [(launch JSON, output.log)]."""
    port = free_port()
    rdzv = ("--env", f"PET_NNODES={len(per_node_args)}", "--env", "PET_RDZV_BACKEND=c10d",
            "--env", f"PET_RDZV_ENDPOINT=127.0.0.1:{port}", "--env", f"PET_RDZV_ID={tag}")
    cmd = [sys.executable, "-m", "dflash_ops", "--runbooks", str(ops_env.runbooks), "launch", "nodes", "--json"]
    procs = [subprocess.Popen([*cmd, "--name", f"{tag}{i}", *rdzv, "--", *args], env=ops_env.env, cwd=ops_env.root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, args in enumerate(per_node_args)]
    launched = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        launched.append(json.loads(out))
    assert all(run["state"] == "running" for run in launched)
    deadline = time.monotonic() + 900
    while True:
        runs = {r["run_id"]: r for r in ops_env.runs_json()}
        states = [runs[run["run_id"]]["state_text"] for run in launched]
        if all(s.startswith("exited") for s in states) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    logs = [(Path(run["run_dir"]) / "output.log").read_text() for run in launched]
    assert states == ["exited 0"] * len(launched), logs
    return list(zip(launched, logs))


@pytest.mark.slow
@pytest.mark.timeout(1800)   # torch starts 5 times on 2 cores; each wait below ends on an event, bounded generously
def test_two_nodes_train_one_model_and_resume_from_the_node_that_kept_the_checkpoints(ops_env, tmp_path):
    target = tmp_path / "target"  # on real nodes: the same path on every node
    made = subprocess.run([sys.executable, "-m", "trainer", "make-tiny-target", str(target)], env=ops_env.env,
                          capture_output=True, text=True)  # to its exit: the session's pytest timeout guards hangs
    assert made.returncode == 0, made.stderr
    shipped = yaml.safe_load((REPO / "runbooks" / "graphwarm-nodes.yaml").read_text())
    # The shipped runbook with what a CPU box can run: one process per node, the smoke recipe, no graphs.
    command = list(shipped["command"])
    assert command[-2:] == ["--set", "step.mode=compile+graph"]
    command = command[:-2]
    command[command.index("--nproc-per-node") + 1] = "1"
    command[command.index("--recipe") + 1] = "smoke"
    (ops_env.runbooks / "nodes.yaml").write_text(yaml.safe_dump(dict(shipped, command=command, pre=[])))
    sets = [x for s in (f"model.target={target}", *TRAIN_SETS) for x in ("--set", s)]

    first = _launch_nodes(ops_env, "node", [sets, sets])
    assert all("PET_NNODES" in json.loads((Path(run["run_dir"]) / "run.json").read_text())["env_keys"]
               for run, _log in first)
    done = [r for _run, log in first for r in _records(log, "DFLASH_DONE ")]
    assert len(done) == 1 and done[0]["world"] == 2  # rank 0 (on whichever node) reports for both
    assert len(done[0]["replica_sha256"]) == 2 and len(set(done[0]["replica_sha256"])) == 1
    straight = [r for _run, log in first for r in _records(log, "DFLASH_METRICS ")]
    assert [r["step"] for r in straight] == [1, 2, 3, 4]

    # As if the job died after the step-2 checkpoint. Only rank 0's node holds checkpoints; resuming, each node
    # points at its own old run directory and the node without them receives them from the one with them.
    dirs = [Path(run["run_dir"]) for run, _log in first]
    with_ckpt = [d for d in dirs if (d / "ckpt").is_dir()]
    assert len(with_ckpt) == 1
    shutil.rmtree(with_ckpt[0] / "ckpt" / "step_4")
    shutil.rmtree(with_ckpt[0] / "export")
    second = _launch_nodes(ops_env, "again", [[*sets, "--run-dir", str(d), "--resume"] for d in dirs])
    resumed = [r for _run, log in second for r in _records(log, "DFLASH_METRICS ")]
    assert [r["step"] for r in resumed] == [3, 4]
    assert _science(resumed) == _science(straight[2:])
    done_again = [r for _run, log in second for r in _records(log, "DFLASH_DONE ")]
    assert len(done_again) == 1 and done_again[0]["replica_sha256"] == done[0]["replica_sha256"]
