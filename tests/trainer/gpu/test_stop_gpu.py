"""A SIGTERM stops a real `python -m trainer train` process in the captured step modes and through the threaded
pipeline (its consumer thread writes the stop's checkpoint) as it does on the CPU (tests/trainer/test_stop.py): exit
143, one checkpoint at a log step, and the printed resume command gives the losses of an uninterrupted run."""
import shlex
import signal
import subprocess
import sys

import pytest

from tests.trainer.conftest import REPO_ROOT
from tests.trainer.test_stop import env, records, science, stop_mid_run, train_cmd

pytestmark = pytest.mark.gpu

CUDA = ("device=cuda", "threads=0", "step.attn=flex", "data.seq_len=128", "optim.max_steps=400", "step.loss_chunk=100")


@pytest.mark.parametrize("sets", [("step.mode=graph",), ("step.mode=compile+graph",),
                                  ("step.mode=graph", "pipeline.enabled=true", "pipeline.slots=2"),
                                  ("step.mode=eager", "pipeline.enabled=true", "pipeline.slots=2")],
                         ids=["graph", "compile+graph", "pipeline-graph", "pipeline-eager"])
def test_a_sigterm_stops_every_step_mode_with_a_checkpoint_that_resumes_exactly(tiny_target_dir, tmp_path, sets):
    sets = (*CUDA, *sets)
    whole = subprocess.run(train_cmd(tiny_target_dir, tmp_path / "whole", *sets), capture_output=True, text=True,
                           env=env(), cwd=REPO_ROOT)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run_dir = tmp_path / "stopped"
    code, out = stop_mid_run(tiny_target_dir, run_dir, signal.SIGTERM, tmp_path, *sets)
    assert code == 143, out[-3000:]
    (stop,) = records(out, "DFLASH_STOPPED ")
    assert stop["step"] < 400 and sorted(p.name for p in (run_dir / "ckpt").iterdir()) == [f"step_{stop['step']}"]
    again = subprocess.run([sys.executable, *shlex.split(stop["resume"])[1:]], capture_output=True, text=True,
                           env=env(), cwd=REPO_ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert science(run_dir / "metrics.jsonl") == science(tmp_path / "whole" / "metrics.jsonl")
