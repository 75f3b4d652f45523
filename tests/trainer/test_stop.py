"""A stopped run keeps its work: a real `python -m trainer train` process, signalled mid-run, finishes its step,
writes a checkpoint at its next log step, prints DFLASH_STOPPED and the resume command, and exits 143 (SIGTERM) /
130 (SIGINT); the resume command it printed continues to the losses of a run that was never stopped."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.conftest import REPO_ROOT

SETS = ("data.seq_len=96", "data.rows_per_step=2", "data.num_anchors=8", "optim.max_steps=60", "log.every=2",
        "ckpt.every=0", "eval_at_end=false", "threads=1")
# What a metrics line measures rather than computes: a resumed run differs there (its clocks, and its peak memory,
# which counts the checkpoint it loaded), never in the science.
TIMING = ("tokens_per_s", "step_time_s", "elapsed_s", "peak_mem_gib")
HANG_GUARD_S = 600  # only a hang reaches it; every wait below ends on an event


def env() -> dict:
    out = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # DFLASH_OPS_RUN_ID too: under dflash-ops the resume command is `dflash-ops resume` (test_stop_message.py)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DFLASH_OPS_RUN_ID"):
        out.pop(key, None)
    return out


def train_cmd(target: Path, run_dir: Path, *sets: str) -> list[str]:
    args = [sys.executable, "-m", "trainer", "train", "--recipe", "smoke", "--run-dir", str(run_dir)]
    for item in (f"model.target={target}", *SETS, *sets):
        args += ["--set", item]
    return args


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env(), cwd=REPO_ROOT,
                                start_new_session=True)


def wait_for(log: Path, proc: subprocess.Popen, needle: str) -> None:
    """Until the log holds `needle` (an event of the run); fails if the process ends first."""
    deadline = time.monotonic() + HANG_GUARD_S
    while needle not in log.read_text():
        assert proc.poll() is None, f"exited {proc.returncode} before {needle!r}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def newest_step_dir(run_dir: Path) -> int:
    """The highest N of a `ckpt/step_N` there now (0 if none). With ckpt.keep a given step_N lives only a few
    steps, shorter than a poll on a loaded machine, so a wait asks for any step at or past N, never for one name."""
    try:
        names = os.listdir(run_dir / "ckpt")
    except FileNotFoundError:
        return 0
    return max((int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit()), default=0)


def records(text: str, prefix: str) -> list[dict]:
    return [json.loads(x[len(prefix):]) for x in text.splitlines() if x.startswith(prefix)]


def science(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in path.read_text().splitlines()]


def stop_mid_run(target: Path, run_dir: Path, signum: int, tmp_path: Path, *sets: str) -> tuple[int, str]:
    log = tmp_path / f"{run_dir.name}.log"
    proc = start(train_cmd(target, run_dir, *sets), log)
    try:
        wait_for(log, proc, 'DFLASH_METRICS {"step": 2,')  # training, with steps to go
        proc.send_signal(signum)
        return proc.wait(timeout=HANG_GUARD_S), log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # only the process this test started, by its group


@pytest.mark.slow
def test_a_sigterm_mid_run_checkpoints_and_its_resume_command_gives_the_uninterrupted_losses(tiny_target_dir,
                                                                                                tmp_path):
    """SIGTERM as `dflash-ops stop` sends it: to the job's process group and then to each of its processes (torchrun,
    too, forwards its own), so the trainer gets it twice a moment apart, and once more while it stops. The repeats
    are not a request to drop the checkpoint: the run stops once, at a log step, and resumes to the losses of a run
    that was never stopped."""
    whole = subprocess.run(train_cmd(tiny_target_dir, tmp_path / "whole"), capture_output=True, text=True,
                           env=env(), cwd=REPO_ROOT)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run_dir, log = tmp_path / "stopped", tmp_path / "stopped.log"
    proc = start(train_cmd(tiny_target_dir, run_dir), log)
    try:
        wait_for(log, proc, 'DFLASH_METRICS {"step": 2,')  # training, with steps to go
        os.killpg(proc.pid, signal.SIGTERM)  # the group (start_new_session: its id is the trainer's pid) ...
        os.kill(proc.pid, signal.SIGTERM)  # ... and the process, as the stop script does
        wait_for(log, proc, "SIGTERM: stopping at the next log step")
        proc.send_signal(signal.SIGTERM)  # and once more while it stops
        code, out = proc.wait(timeout=HANG_GUARD_S), log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # only the process this test started, by its group
    assert code == 143, out[-3000:]
    (stop,) = records(out, "DFLASH_STOPPED ")
    step = stop["step"]
    assert 2 <= step < 60 and step % 2 == 0  # a log step (log.every=2), before the end
    assert stop["signal"] == "SIGTERM" and stop["exit_code"] == 143 and stop["world"] == 1
    assert stop["checkpoint"] == str(run_dir / "ckpt" / f"step_{step}")
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == [f"step_{step}"]  # ckpt.every=0: the stop's
    assert not (run_dir / "export").exists()
    resume = shlex.join([sys.executable, "-m", "trainer", "train", "--run-dir", str(run_dir), "--resume"])
    assert stop["resume"] == resume
    assert out.splitlines()[-2:] == [f"stopped by SIGTERM after {step} of 60 optimizer steps: checkpoint "
                                     f"{run_dir / 'ckpt' / f'step_{step}'}", f"resume with: {resume}"]
    assert [r["step"] for r in science(run_dir / "metrics.jsonl")] == list(range(2, step + 1, 2))

    again = subprocess.run(shlex.split(stop["resume"]), capture_output=True, text=True, env=env(), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert science(run_dir / "metrics.jsonl") == science(tmp_path / "whole" / "metrics.jsonl")
    done = [records(p.stdout, "DFLASH_DONE ")[0] for p in (again, whole)]
    assert done[0]["replica_sha256"] == done[1]["replica_sha256"]  # the same drafter, bit for bit


@pytest.mark.slow
def test_ctrl_c_mid_run_checkpoints_and_exits_130(tiny_target_dir, tmp_path):
    run_dir = tmp_path / "run"
    code, out = stop_mid_run(tiny_target_dir, run_dir, signal.SIGINT, tmp_path)
    assert code == 130, out[-3000:]
    (stop,) = records(out, "DFLASH_STOPPED ")
    assert stop["signal"] == "SIGINT" and stop["exit_code"] == 130
    from trainer.checkpoint import CKPT_FILES, list_checkpoints

    assert [s for s, _ in list_checkpoints(run_dir)] == [stop["step"]]
    assert all((run_dir / "ckpt" / f"step_{stop['step']}" / name).is_file() for name in CKPT_FILES)
    assert "interrupted" not in out and "Traceback" not in out


@pytest.mark.slow
def test_ctrl_c_during_the_stop_ends_the_run_at_once_and_leaves_no_torn_checkpoint(tiny_target_dir, tmp_path):
    """ckpt.every=1: a save is under way most of the time. A Ctrl-C sent as soon as the SIGTERM is acknowledged
    ends the process by SIGINT itself (no handler left to delay it); every checkpoint directory left is complete,
    and a resume starts from the newest."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(train_cmd(tiny_target_dir, run_dir, "ckpt.every=1", "ckpt.keep=2", "log.every=50",
                           "optim.max_steps=2000"), log)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while newest_step_dir(run_dir) < 2:  # saving at every step, many steps before the stop's
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        wait_for(log, proc, "SIGTERM: stopping at the next log step")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=HANG_GUARD_S) == -signal.SIGINT
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "DFLASH_STOPPED" not in log.read_text()
    import torch

    from trainer.checkpoint import CKPT_FILES, list_checkpoints

    kept = list_checkpoints(run_dir)
    assert kept, sorted(p.name for p in (run_dir / "ckpt").iterdir())
    for _step, path in kept:
        for name in CKPT_FILES:
            if name.endswith(".pt"):
                torch.load(path / name, weights_only=False)  # whole: a torn file would not load
    resumed = start([sys.executable, "-m", "trainer", "train", "--run-dir", str(run_dir), "--resume"], log)
    try:
        wait_for(log, resumed, "restoring the newest checkpoint: ")
        assert f"({kept[-1][0]} optimizer steps done)" in log.read_text()
        wait_for(log, resumed, "DFLASH_METRICS ")
        resumed.send_signal(signal.SIGTERM)
        assert resumed.wait(timeout=HANG_GUARD_S) == 143, log.read_text()[-3000:]
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)


@pytest.mark.parametrize("args, message", [
    (("--run-dir", "R"), "error: train needs --recipe NAME|PATH.yaml (or --run-dir D --resume to continue a run)"),
    (("--resume",), "error: --resume needs --run-dir D: the run directory to continue"),
    (("--run-dir", "R", "--resume"), "error: --resume: R holds no config.json (nor a checkpoint's copy of it)"),
])
def test_train_without_a_recipe_resumes_or_says_what_it_needs_in_one_line(tmp_path, args, message):
    p = subprocess.run([sys.executable, "-m", "trainer", "train", *args], capture_output=True, text=True, env=env(),
                       cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.splitlines()[0] == message, p.stderr


@pytest.mark.slow
def test_ctrl_c_through_a_tee_that_dies_with_it_still_checkpoints_and_exits_130(tiny_target_dir, tmp_path):
    """`train ... 2>&1 | tee log`: the terminal's Ctrl-C ends tee too, so the run's next console write meets a
    broken pipe. The run must still reach its stop's checkpoint and exit 130 (the console is lost, not the work)."""
    run_dir, log = tmp_path / "run", tmp_path / "tee.log"
    log.touch()  # read before tee may have opened it
    proc = subprocess.Popen(train_cmd(tiny_target_dir, run_dir, "optim.max_steps=2000"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env(), cwd=REPO_ROOT, start_new_session=True)
    tee = subprocess.Popen(["tee", str(log)], stdin=proc.stdout, stdout=subprocess.DEVNULL)
    proc.stdout.close()  # tee holds the pipe's only read end
    try:
        wait_for(log, proc, 'DFLASH_METRICS {"step": 2,')
        tee.kill()
        tee.wait()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=HANG_GUARD_S) == 130
    finally:
        for p in (proc, tee):
            if p.poll() is None:
                p.kill()
    from trainer.checkpoint import list_checkpoints

    (step, _path), = list_checkpoints(run_dir)
    assert 2 <= step < 2000 and json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step
