"""The stop's resume command (trainer/resumeline.resume_fields, the DFLASH_STOPPED record and its human lines): a run
dflash-ops launched (its marker in the environment) is resumed as the same tracked run, `dflash-ops resume <run
id>`, with the trainer's own command kept as `resume_in_place`; any other run gets the trainer's command alone. The
line stays what dflash-ops reads (parse.kept_steps: its step)."""
from __future__ import annotations

import io
import json
import shlex
import sys

from dflash_ops import wire
from dflash_ops.runs import parse
from trainer import resumeline
from trainer.metrics import MetricsSink

RUN_ID = "smoke-20261203T101500-1a2b"


def test_a_run_launched_by_dflash_ops_resumes_under_dflash_ops_and_keeps_the_trainer_command(tmp_path):
    bare = shlex.join([sys.executable, "-m", "trainer", "train", "--run-dir", str(tmp_path), "--resume"])
    assert resumeline.resume_fields(tmp_path, environ={}) == {"resume": bare}
    assert resumeline.resume_fields(tmp_path, environ={wire.MARKER_VAR: ""}) == {"resume": bare}
    assert resumeline.resume_fields(tmp_path, environ={wire.MARKER_VAR: RUN_ID}) == {
        "resume": f"dflash-ops resume {RUN_ID}", "resume_in_place": bare}
    odd = "it's $(x)"   # whatever the environment holds, the command is one quoted word of it
    assert shlex.split(resumeline.resume_fields(tmp_path, environ={wire.MARKER_VAR: odd})["resume"]) == \
        ["dflash-ops", "resume", odd]


def test_a_data_parallel_run_on_one_node_resumes_under_dflash_ops_and_one_of_several_nodes_does_not(tmp_path):
    marked = {wire.MARKER_VAR: RUN_ID}
    ddp = resumeline.resume_fields(tmp_path, world=2, nodes=1, environ=marked)
    assert ddp["resume"] == f"dflash-ops resume {RUN_ID}"
    assert "torch.distributed.run" in ddp["resume_in_place"] and "--nproc-per-node 2" in ddp["resume_in_place"]
    nodes = resumeline.resume_fields(tmp_path, world=4, nodes=2, environ=marked)
    assert nodes == {"resume": resumeline.resume_command(tmp_path, 4, 2)} and "dflash-ops" not in nodes["resume"]


def test_the_stopped_line_says_the_tracked_resume_and_dflash_ops_still_reads_its_step(tmp_path):
    for environ, said in (({wire.MARKER_VAR: RUN_ID}, f"resume with: dflash-ops resume {RUN_ID} (where it was "
                                                      "launched from, with its --host/--ct)"),
                          ({}, f"resume with: {resumeline.resume_command(tmp_path)}")):
        out = io.StringIO()
        record = {"step": 40, "total_steps": 300, "checkpoint": "ckpt/step_40", "signal": "SIGTERM",
                  **resumeline.resume_fields(tmp_path, environ=environ)}
        MetricsSink(tmp_path / "metrics.jsonl", stream=out).stopped(record)
        first, *human = out.getvalue().splitlines()
        assert first.startswith(wire.STOPPED_PREFIX) and json.loads(first[len(wire.STOPPED_PREFIX):]) == record
        assert human == ["stopped by SIGTERM after 40 of 300 optimizer steps: checkpoint ckpt/step_40", said]
        assert not any("step " in line for line in human)   # a liveness pattern never takes it for training
        assert parse.kept_steps(f"{wire.KEPT} {RUN_ID} {first[len(wire.STOPPED_PREFIX):]}") == {RUN_ID: 40}
