"""`python -m bench.train` on the CPU: a real `trainer train` run per mode, its figures read from metrics.jsonl."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_one_mode_through_the_real_trainer(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="")
    # the gpu recipe cut to what the plumbing needs (its 5 drafter layers, 4 rows x 4 micro-steps cost minutes on a CPU)
    smaller = ["data.num_anchors=8", "data.rows_per_step=1", "optim.accum_steps=1", "model.num_draft_layers=1"]
    proc = subprocess.run([sys.executable, "-m", "bench.train", "--shape", "tiny", "--seq", "64", "--modes", "eager",
                           "--steps", "4", "--every", "2", "--workdir", str(tmp_path), "--set", "step.attn=sdpa",
                           *[x for item in smaller for x in ("--set", item)]],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TRAIN_BENCH "))
    r = json.loads(line.split(" ", 1)[1])
    assert r["mode"] == "eager" and r["tokens_per_s"] > 0 and r["intervals"] == 1
    records = [json.loads(x) for x in (tmp_path / "run-eager" / "metrics.jsonl").read_text().splitlines()]
    assert r["tokens_per_s"] == records[1]["tokens_per_s"] and records[-1]["step"] == 4


def test_bad_arguments_are_one_line():
    proc = subprocess.run([sys.executable, "-m", "bench.train", "--modes", "turbo"], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: unknown mode(s) ['turbo']; use eager, compile, graph, compile+graph"]
