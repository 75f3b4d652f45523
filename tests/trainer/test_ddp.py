"""Data parallel on CPU through the real launcher: `python -m torch.distributed.run --nproc-per-node 2 -m trainer
train` (gloo), against the same trainer as one process.

Why 2 ranks x R rows must equal 1 rank x R rows x 2 accumulation micro-steps bit for bit: rank r of 2 takes micro-batch
2s+r of the 1-rank order (same rows, same anchor seed; `EpochBatches`); the 1-rank step accumulates 0.5*g_a + 0.5*g_b
(scaling by 0.5 is exact), 2 ranks all-reduce g_a + g_b then divide by 2 (exact): the same rounding, so the same
grads, clip, AdamW update and parameters. Logged losses are summed over ranks before the mean, in the same order.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ops.wire import STOP_EXITS
from support.procfs import is_alive as alive

REPO = Path(__file__).resolve().parents[2]
BASE = ("data.seq_len=96", "data.rows_per_step=2", "data.num_anchors=8", "optim.max_steps=4", "log.every=1",
        "ckpt.every=2", "eval_at_end=false", "threads=1")
TIMING = ("tokens_per_s", "step_time_s", "elapsed_s", "world")


def trainer_cmd(target: Path, run_dir: Path, nproc: int, *sets: str, resume: bool = False) -> list[str]:
    launcher = []
    if nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    args = ["-m", "trainer", "train", "--recipe", "smoke", "--run-dir", str(run_dir)]
    for item in (f"model.target={target}", *BASE, *sets):
        args += ["--set", item]
    return [sys.executable, *launcher, *args, *(["--resume"] if resume else [])]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run to exit (the session's pytest timeout guards hangs)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)


def lines(text: str, prefix: str) -> list[dict]:
    return [json.loads(x[len(prefix):]) for x in text.splitlines() if x.startswith(prefix)]


def science(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.fixture(scope="module")
def runs(tiny_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    one = run(trainer_cmd(tiny_target_dir, root / "one", 1, "optim.accum_steps=2"))
    two = run(trainer_cmd(tiny_target_dir, root / "two", 2, "optim.accum_steps=1"))
    for p in (one, two):
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return root, one, two


@pytest.mark.slow
def test_two_ranks_equal_one_rank_accumulating_both_shards(runs):
    root, one, two = runs
    m1, m2 = lines(one.stdout, "DFLASH_METRICS "), lines(two.stdout, "DFLASH_METRICS ")
    assert [r["step"] for r in m2] == [1, 2, 3, 4]
    assert science(m2) == science(m1)  # loss, acc, acc_by_pos, lr, epoch: bit-identical
    assert len({r["loss"] for r in m2}) == 4
    assert {r["world"] for r in m1} == {1} and {r["world"] for r in m2} == {2}
    d1, d2 = lines(one.stdout, "DFLASH_DONE ")[0], lines(two.stdout, "DFLASH_DONE ")[0]
    assert d2["replica_sha256"] == d1["replica_sha256"] * 2  # both replicas = the one-process drafter, bit for bit


def test_both_ranks_end_with_bit_identical_drafters(runs):
    root, _one, two = runs
    digests = lines(two.stdout, "DFLASH_DONE ")[0]["replica_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1]
    import torch

    from trainer.distributed import state_digest

    saved = torch.load(root / "two" / "ckpt" / "step_4" / "drafter.pt")
    assert state_digest(saved) == digests[0]  # the checkpoint rank 0 wrote is that drafter


def test_only_rank_zero_writes_and_prints(runs):
    """Both ranks share the console (as under `dflash-ops launch`): one rank's lines, never two."""
    root, _one, two = runs
    assert len(lines(two.stdout, "DFLASH_METRICS ")) == 4 and len(lines(two.stdout, "DFLASH_DONE ")) == 1
    assert len([x for x in two.stdout.splitlines() if x.startswith("step ")]) == 4
    assert len((root / "two" / "metrics.jsonl").read_text().splitlines()) == 4
    assert sorted(p.name for p in (root / "two" / "ckpt").iterdir()) == ["step_2", "step_4"]
    assert sorted(p.name for p in (root / "two").iterdir()) == ["ckpt", "config.json", "data.json", "export",
                                                                 "metrics.jsonl"]


@pytest.mark.slow
def test_two_rank_resume_is_exact(runs, tiny_target_dir):
    root, _one, two = runs
    split = root / "split"
    shutil.copytree(root / "two", split)
    shutil.rmtree(split / "ckpt" / "step_4")  # as if the job died after the step-2 checkpoint
    shutil.rmtree(split / "export")
    again = run(trainer_cmd(tiny_target_dir, split, 2, "optim.accum_steps=1", resume=True))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = lines(again.stdout, "DFLASH_METRICS ")
    assert [r["step"] for r in resumed] == [3, 4]
    assert science(resumed) == science(lines(two.stdout, "DFLASH_METRICS ")[2:])
    done = [lines(p.stdout, "DFLASH_DONE ")[0] for p in (again, two)]
    assert done[0]["replica_sha256"] == done[1]["replica_sha256"]


def test_pipeline_on_cpu_is_one_clear_line_and_exit_2(tiny_target_dir, tmp_path):
    p = run(trainer_cmd(tiny_target_dir, tmp_path / "r", 1, "pipeline.enabled=true"))
    assert p.returncode == 2
    assert p.stderr.splitlines()[0] == ("error: pipeline.enabled needs CUDA (device=cpu); "
                                        "use --set pipeline.enabled=false")
    auto = run(trainer_cmd(tiny_target_dir, tmp_path / "a", 1, "pipeline.enabled=true", "device=auto"))
    assert auto.returncode == 2 and "pipeline.enabled needs a CUDA device (this run is on cpu)" in auto.stderr


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_said_once_and_keeps_its_exit_code(tiny_target_dir, tmp_path):
    """Every rank meets the same config error, before or after torch is loaded; rank 0 alone says it, each rank
    exits 2 (torchrun then exits 1 with its own failure report), and nothing is left on disk."""
    early = run(trainer_cmd(tiny_target_dir, tmp_path / "a", 2, "optim.lrr=1"))
    late = run(trainer_cmd(tiny_target_dir, tmp_path / "b", 2, "step.mode=graph"))
    for p, message in ((early, "error: unknown config key 'optim.lrr' (did you mean 'optim.lr'?); valid keys here: lr,"),
                       (late, "error: step.mode=graph needs a CUDA device (this run is on cpu)")):
        errors = [x for x in p.stderr.splitlines() if x.startswith(("error:", "hint:"))]
        assert len(errors) <= 2 and errors[0].startswith(message), p.stderr[-3000:]
        assert p.returncode == 1 and "exitcode  : 2" in p.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # fields after "(comm)": state, ppid, ...
            found.append(int(stat.parent.name))
    return found



@pytest.mark.slow
def test_ranks_die_with_a_killed_launcher(tiny_target_dir, tmp_path):
    """torchrun puts each rank in its own session: a SIGKILL of the launcher's group (what `dflash-ops stop`
    escalates to) must not leave ranks behind (they get SIGTERM through PR_SET_PDEATHSIG)."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = tmp_path / "out.log"
    cmd = trainer_cmd(tiny_target_dir, tmp_path / "r", 2, "optim.max_steps=100000", "ckpt.every=0")
    with log.open("w") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                    start_new_session=True)
    ranks: list[int] = []
    try:
        while "DFLASH_METRICS" not in log.read_text() and launcher.poll() is None:  # training, or it ended
            time.sleep(0.5)
        ranks = children_of(launcher.pid)
        assert len(ranks) == 2, log.read_text()[-2000:]
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 120  # SIGTERM reaches them at once; a loaded machine may take a while to exit
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(alive(p) for p in ranks)
    finally:
        for p in ranks:  # only the ranks this test started, by pid
            if alive(p):
                os.kill(p, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_resume_under_another_world_size_is_refused(runs, tiny_target_dir):
    root, _one, _two = runs
    other = root / "other"
    shutil.copytree(root / "two", other)
    p = run(trainer_cmd(tiny_target_dir, other, 1, "optim.accum_steps=1", resume=True))
    assert p.returncode == 2
    assert p.stderr.splitlines()[:2] == [
        "error: --resume with 1 data-parallel rank(s); the run was checkpointed with 2 (its data cursor counts "
        "per-rank micro-batches)", "hint: relaunch with --nproc-per-node 2"]


@pytest.mark.slow
def test_a_sigterm_to_torchrun_stops_both_ranks_at_one_step_with_one_checkpoint(tiny_target_dir, tmp_path):
    """`dflash-ops stop` signals torchrun, which forwards SIGTERM to each rank: the ranks agree on the stop step
    (an all-reduce of the signal at a log step), rank 0 alone writes the one checkpoint and prints DFLASH_STOPPED
    once, both exit, and the printed resume command (2 ranks) continues to the losses of one process accumulating
    both shards (test_two_ranks_equal_one_rank_accumulating_both_shards)."""
    import shlex
    import signal
    import time

    sets = ("optim.max_steps=40", "ckpt.every=0")  # log.every=1 (BASE): per-step losses sum in the same order
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log, run_dir = tmp_path / "out.log", tmp_path / "r"
    with log.open("w") as out:
        launcher = subprocess.Popen(trainer_cmd(tiny_target_dir, run_dir, 2, "optim.accum_steps=1", *sets),
                                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 600  # a hang guard: the waits end on events
        while 'DFLASH_METRICS {"step": 2,' not in log.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        ranks = children_of(launcher.pid)
        assert len(ranks) == 2
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=600)
        while any(alive(p) for p in ranks):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for p in ranks:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    text = log.read_text()
    # what dflash-ops reads as "stopped" beside the DFLASH_STOPPED line (torchrun: 1, its SignalException)
    assert launcher.returncode in STOP_EXITS, (launcher.returncode, text[-3000:])
    stops = lines(text, "DFLASH_STOPPED ")
    assert len(stops) == 1, text[-3000:]
    step = stops[0]["step"]
    assert stops[0]["world"] == 2 and stops[0]["signal"] == "SIGTERM" and 2 <= step < 40
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == [f"step_{step}"]
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1] == step
    argv = shlex.split(stops[0]["resume"])
    assert argv[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    again = run(argv)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    one = run(trainer_cmd(tiny_target_dir, tmp_path / "one", 1, "optim.accum_steps=2", *sets))
    assert one.returncode == 0, one.stderr[-3000:]
    resumed = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert science(resumed) == science(lines(one.stdout, "DFLASH_METRICS "))
