"""`python -m bench.checkpoint` (how long a stop's checkpoint takes) at the tiny shape on a CPU: it times the
trainer's own save, says the size it wrote, and leaves nothing behind."""
from __future__ import annotations

import json

import pytest

from bench.checkpoint import main
from tests.trainer.bench.refusals import assert_refused


def test_it_times_real_saves_of_the_shapes_drafter_and_cleans_up(tmp_path, capsys):
    assert main(["--shape", "tiny", "--layers", "2", "--repeat", "2", "--dir", str(tmp_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    saves = [json.loads(x[len("CHECKPOINT "):]) for x in out if x.startswith("CHECKPOINT ")]
    assert len(saves) == 2 and all(s["seconds"] > 0 and s["device"] == "cpu" for s in saves)
    # fp32 weights and AdamW's two moments: at least 12 bytes a parameter
    assert all(s["bytes"] >= 12 * s["params"] for s in saves) and saves[0]["bytes"] == saves[1]["bytes"]
    assert out[-1].startswith("checkpoint of the tiny drafter (2 layers, ") and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["--shape", "nope"], "unknown --shape 'nope'"),
    (["--repeat", "0"], "--layers and --repeat must be >= 1"),
    (["--dir", "/nonexistent/x"], "--dir /nonexistent/x is not a directory"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    assert_refused(main, argv, message, capsys)
