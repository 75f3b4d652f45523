"""The run-directory contract (docs/contracts.md): the ops CLI launches the REAL trainer through the shipped `smoke`
runbook, and reads back what the trainer wrote: its exit code, its state, and its metrics lines."""
import json
import os
import subprocess
import sys

import pytest

from tests.trainer.conftest import REPO_ROOT


def ops(*args):
    """Run to exit (the session's pytest timeout guards hangs)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "dflash_ops", *args], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT)


@pytest.mark.slow
def test_ops_cli_launches_the_trainer_and_parses_what_it_writes(tiny_target_dir):
    overrides = [f"model.target={tiny_target_dir}", "optim.max_steps=4", "log.every=2", "ckpt.every=0",
                 "data.seq_len=128", "eval_at_end=false"]
    extra = [a for o in overrides for a in ("--set", o)]
    launched = ops("launch", "smoke", "--host", "local", "--name", "contract", "--follow", "--", *extra)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    # --follow streamed the trainer's log to its end, in the human view: the DFLASH_DONE line as words.
    assert "done at step 4; export " in launched.stdout and "step 4/4 epoch 0 loss " in launched.stdout

    runs = json.loads(ops("runs", "--host", "local", "--json").stdout)
    (run,) = [r for r in runs if r["name"] == "contract"]
    assert run["state"] == "exited" and run["exit_code"] == 0
    run_dir = run["run_dir"]

    # What the trainer recorded, per the contract: metrics.jsonl in the run dir the runbook handed it.
    recorded = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in recorded] == [2, 4]

    # What the ops side parses out of the log (the same parser `status` uses) must agree with it.
    from dflash_ops.metrics_line import latest

    with open(os.path.join(run_dir, "output.log"), encoding="utf-8") as log:
        parsed = latest(log)
    assert parsed is not None and parsed.done
    assert parsed.step == 4 and parsed.loss == pytest.approx(recorded[-1]["loss"])
    assert parsed.tokens_per_s == pytest.approx(recorded[-1]["tokens_per_s"])
    assert parsed.acc == pytest.approx(recorded[-1]["acc"])


def test_the_trainers_hints_seen_through_launch_name_the_launch_form():
    """Under `dflash-ops launch` the trainer's arguments follow `--`: its hint says `-- --set`, not `--set`."""
    launched = ops("launch", "smoke", "--host", "local", "--name", "hinted", "--", "--set",
                   "model.allow_tiny_target=false")
    assert launched.returncode == 4, launched.stdout + launched.stderr
    log = launched.stderr
    assert "| error: model.target is empty: set model.target=DIR" in log, log
    assert "| hint: e.g. -- --set model.target=/models/Qwen3-8B" in log, log
