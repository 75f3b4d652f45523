"""`dflash-ops resume RUN` over real SSH into emulated containers: a stopped run continues in its own run directory
as the same tracked run, and a run that cannot be resumed is refused in one line.

ct0: the real trainer on CPU (the smoke recipe at its smallest) is launched, stopped (it writes a checkpoint and
prints `dflash-ops resume <run id>`), resumed (it restores that checkpoint and trains on from its step, seen by
`runs`, `status` and `tail` under the same id, its log appended to), and stopped again. ct1: the refusals, with the
bed's stand-in job and a stand-in `trainer` package (a command of the trainer's shape, that runs in no time).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_ops import noderecord

from e2e_bed import marked_processes, wait_for

pytestmark = pytest.mark.ssh
CONTAINERS = 2
TRAIN_SETS = ("data.seq_len=96", "data.rows_per_step=2", "data.num_anchors=8", "optim.max_steps=100000",
              "log.every=2", "ckpt.every=0", "eval_at_end=false", "threads=1")
# A package named `trainer` that stands in for it: a command of the trainer's `train` shape that prints its
# arguments, then with --resume exits 0, else waits for the file after --gate and exits 1.
FAKE_TRAINER = """import os, sys, time
args = sys.argv[1:]
print("job started", *args, flush=True)
if "--resume" in args:
    sys.exit(0)
gate, deadline = args[args.index("--gate") + 1], time.monotonic() + 120
while not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(1)
"""


def _records(text: str, prefix: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]


@pytest.fixture(scope="module")
def resume_bed(bed):
    """The bed with the runbooks `trainer` (the real trainer's `train`, smoke recipe, proven alive at its first
    metrics line) and `faketrainer` (FAKE_TRAINER as `python -m trainer train --run-dir {run_dir}`)."""
    job = yaml.safe_load((bed.runbooks / "job.yaml").read_text())
    train = ["{python}", "-m", "trainer", "train", "--recipe", "smoke", "--run-dir", "{run_dir}"]
    (bed.runbooks / "trainer.yaml").write_text(yaml.safe_dump({
        "command": train, "env": {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        "liveness": {"wait_s": 0.5, "pattern": "DFLASH_METRICS", "timeout_s": 600}}))
    fake = bed.work / "fake" / "trainer"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_TRAINER)
    (bed.runbooks / "faketrainer.yaml").write_text(yaml.safe_dump(dict(
        job, command=["{python}", "-m", "trainer", "train", "--run-dir", "{run_dir}"],
        env={"PYTHONPATH": str(fake.parent)})))
    return bed


@pytest.mark.slow
@pytest.mark.timeout(1200)   # the trainer starts twice on a loaded 2-core box; every wait ends on an event
def test_a_stopped_run_resumes_as_the_same_tracked_run_from_its_checkpoint(resume_bed, monkeypatch, tmp_path):
    bed = resume_bed
    ctid, where = bed.ct(0), resume_bed.target(bed.ct(0))
    sets = [x for s in TRAIN_SETS for x in ("--set", s)]
    run_id = bed.launch(ctid, *sets, runbook="trainer", name="tr")["run_id"]
    run_dir = bed.tb.runs_dirs[ctid] / run_id
    log = run_dir / "output.log"

    stopped = bed.proc("stop", run_id, *where, "--json", timeout=300)
    assert stopped.returncode == 0, stopped.stderr
    doc = json.loads(stopped.stdout)
    step = doc["status"]["stopped_step"]
    assert doc["status"]["state"] == "stopped" and step >= 2, doc
    assert doc["resume"] == f"dflash-ops resume {run_id} --host {bed.tb.host} --ct {ctid}"
    first = log.read_bytes()
    (said,) = _records(first.decode(), "DFLASH_STOPPED ")       # the trainer knows the run, not its host
    assert said["step"] == step and said["resume"] == f"dflash-ops resume {run_id}"
    assert said["resume_in_place"].endswith(f"-m trainer train --run-dir {run_dir} --resume")
    assert f"resume with: dflash-ops resume {run_id} (where it was launched from".encode() in first

    resumed = bed.proc("resume", run_id, *where, "--json", timeout=700)
    assert resumed.returncode == 0, resumed.stderr
    again = json.loads(resumed.stdout)
    assert (again["run_id"], again["resumed"], again["state"]) == (run_id, True, "running")
    assert again["log_start"] > len(first) and again["matched_line"].startswith("DFLASH_METRICS ")
    now = log.read_bytes()
    assert now.startswith(first)                                # the first attempt's lines are all kept
    assert now[len(first):].startswith(b'DFLASH_RESUMED {"attempt": 2, ')
    new = now[again["log_start"]:].decode()
    assert "restoring the newest checkpoint: " in new
    assert _records(new, "DFLASH_METRICS ")[0]["step"] == step + 2    # on from the stopped step (log.every=2)
    attempt = run_dir / "attempts" / "1"
    assert (attempt / "exit_code").read_text() == "143\n" and (attempt / "stopped").is_file()
    assert json.loads((attempt / "run.json").read_text())["argv"][-1] != "--resume"
    assert json.loads((run_dir / "run.json").read_text())["argv"][-1] == "--resume"

    [row] = [r for r in bed.runs(ctid) if r["run_id"] == run_id]
    assert row["state"] == "running" and row["pid"] == again["pid"]
    monkeypatch.setenv("DFLASH_OPS_NVIDIA_SMI", str(tmp_path / "no-nvidia-smi"))
    status = json.loads(bed.cli("status", *where, "--json").stdout)
    [row] = [r for t in status["hosts"][0]["targets"] for r in t["runs"] if r["run_id"] == run_id]
    assert row["state"] == "running"
    tail = bed.cli("tail", run_id, *where, "--no-follow", "-n", "100000")
    assert tail.returncode == 0 and b"resumed: attempt 2\n" in tail.stdout and b"stopped by SIGTERM" in tail.stdout

    second = bed.proc("stop", run_id, *where, "--json", timeout=300)
    assert second.returncode == 0, second.stderr
    doc = json.loads(second.stdout)
    assert doc["status"]["state"] == "stopped" and doc["status"]["stopped_step"] > step, doc
    assert marked_processes(bed.container(0), run_id) == []
    assert (run_dir / "ckpt" / f"step_{doc['status']['stopped_step']}").is_dir()


def test_resume_refuses_in_one_line_what_it_cannot_resume(resume_bed):
    bed = resume_bed
    ctid, where = bed.ct(1), resume_bed.target(bed.ct(1))

    def refused(*args: str) -> tuple[int, str]:
        done = bed.cli("resume", *args)
        err = done.stderr.decode()
        assert err.startswith("error: ") and len(err.splitlines()) <= 2, err      # one line, and its hint
        return done.returncode, err.splitlines()[0]

    # not a run id: refused before anything connects (the host named does not exist)
    assert refused("tr", "--host", "no-such-host") == (2, "error: 'tr' is not a run id (NAME-YYYYMMDDTHHMMSS-xxxx): "
                                                          "resume takes the id of one run")
    code, line = refused("tr-20261203T000000-abcd", *where)
    assert code == 3 and "no run 'tr-20261203T000000-abcd'" in line

    gate = bed.gate("resume-alive")
    alive = bed.launch(ctid, "--gate", str(gate), name="alive")["run_id"]
    code, line = refused(alive, *where)
    assert (code, line) == (5, f"error: run {alive} is still running on {bed.tb.host}/ct{ctid}: only a run that "
                               "ended can be resumed")
    assert marked_processes(bed.container(1), alive) != []      # untouched
    gate.touch()
    wait_for((bed.tb.runs_dirs[ctid] / alive / "exit_code").exists, "the gated job to end")
    code, line = refused(alive, *where)
    assert code == 5 and "exited 0: it finished, there is nothing to resume" in line

    gate = bed.gate("resume-fake")
    fake = bed.launch(ctid, "--gate", str(gate), runbook="faketrainer", name="fake")["run_id"]
    fake_dir = bed.tb.runs_dirs[ctid] / fake
    gate.touch()
    wait_for((fake_dir / "exit_code").exists, "the stand-in trainer to end")      # exit 1, no checkpoint
    code, line = refused(fake, *where)
    assert (code, line) == (5, f"error: run {fake} on {bed.tb.host}/ct{ctid} holds no checkpoint to resume from "
                               "(it ended before its first)")
    assert not (fake_dir / "attempts").exists() and (fake_dir / "exit_code").read_text() == "1\n"   # as it was
    (fake_dir / "ckpt" / "step_4").mkdir(parents=True)
    done = bed.cli("resume", fake, *where, "--follow")      # follows this attempt to its end: exit 0 (--resume)
    resumed_line = f"job started train --run-dir {fake_dir} --gate {gate} --resume\n".encode()
    assert done.returncode == 0, done.stderr
    assert f"resumed {fake}\n".encode() in done.stdout      # after the start-up lines shown while proven alive
    assert [ln for ln in done.stdout.splitlines(keepends=True) if ln.startswith(b"job started")] == [resumed_line]
    assert (fake_dir / "exit_code").read_text() == "0\n"
    assert (fake_dir / "output.log").read_bytes().endswith(resumed_line)
    assert (fake_dir / "attempts" / "1" / "exit_code").read_text() == "1\n"

    node_run = "nodes-20261203T000000-abcd"      # one node of a multi-node run: not resumed (not supported)
    nodes = [{"rank": 0, "host": bed.tb.host, "ct": str(ctid)}, {"rank": 1, "host": "pve-b", "ct": "302"}]
    record = {"run_id": node_run, "nodes": nodes, "rendezvous": {"backend": noderecord.BACKEND, "address": "127.0.0.1",
                                                                 "port": 29500, "id": node_run, "timeout_s": 600}}
    node_dir: Path = bed.tb.runs_dirs[ctid] / node_run
    node_dir.mkdir()
    (node_dir / "run.json").write_text(json.dumps({"run_id": node_run, "name": "nodes", "runbook": "job",
                                                   "argv": ["x"], "workdir": "/", "env_keys": [],
                                                   "node_rank": 0, "multinode": record, "started_at": 1}))
    (node_dir / "exit_code").write_text("1\n")
    code, line = refused(node_run, *where)
    assert (code, line) == (2, f"error: run {node_run} is one node of a multi-node run: resume does not take "
                               "multi-node runs")
