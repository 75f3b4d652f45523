"""`gpu-reset`'s questions with stdin at its end (no terminal): "no", never click's "Aborted!". Declining the kill
exits 1 with nothing killed (docs/gpu-reset.md); an unanswered `--hard` reset is skipped and the result shown.
The real CLI process, a real holder process and the fake nvidia-smi over it (tests/support/fake_nvidia_smi.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from support import fake_nvidia_smi, procfs


@pytest.fixture
def gpu(tmp_path):
    """One fake GPU held by a `sleep` in a session of its own (gpu-reset signals the holder's process group)."""
    state = tmp_path / "gpus.json"
    smi = fake_nvidia_smi.install(tmp_path / "bin", state, n_gpus=1)
    (tmp_path / "dev").mkdir()
    env = dict(os.environ, DFLASH_OPS_NVIDIA_SMI=str(smi), DFLASH_OPS_NVIDIA_DEV_GLOB=f"{tmp_path}/dev/nvidia*")
    holder = subprocess.Popen(["sleep", "300"], env=dict(os.environ, FAKE_NVIDIA_HOLD=f"0:500:{state.resolve()}"),
                              start_new_session=True)
    threading.Thread(target=holder.wait, daemon=True).start()  # reaped once killed: a zombie holds nothing
    try:
        yield env, holder.pid, state
    finally:
        if holder.poll() is None:
            holder.kill()


def gpu_reset(env: dict, *args: str, answers: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_ops", "gpu-reset", "--host", "local", "--grace", "0.2",
                           "--wait", "10", *args], input=answers, capture_output=True, text=True, env=env, timeout=120)


def test_no_answer_to_the_kill_question_kills_nothing(gpu):
    env, pid, _ = gpu
    done = gpu_reset(env)
    assert done.returncode == 1, done.stderr
    assert "Aborted" not in done.stderr and done.stderr == ""
    assert done.stdout.rstrip().endswith("Kill 1 process(es)? [y/N]:")
    time.sleep(0.2)
    assert procfs.is_alive(pid)


def test_no_answer_to_a_hard_reset_skips_it_and_shows_the_result(gpu):
    env, pid, state = gpu
    done = gpu_reset(env, "--hard", answers="y\n")  # yes to the kill, then stdin ends at the reset question
    assert done.returncode == 0, done.stdout + done.stderr  # "Aborted!", exit 1 and no result before
    assert "Aborted" not in done.stderr and not procfs.is_alive(pid)
    assert "skipped: not confirmed" in done.stdout and "before -> after" in done.stdout
    assert json.loads(state.read_text())["resets"] == []
