"""tail's human view (pure) and the remote count behind `tail -n N` of that view (real bash on a real file)."""
from __future__ import annotations

import subprocess

from dflash_ops import logview
from dflash_ops.runs import read_scripts


def test_machine_lines_are_hidden_done_is_said_in_words_and_the_rest_is_kept():
    assert logview.human_line(b'DFLASH_METRICS {"step": 10, "loss": 3.2}\n') is None
    assert logview.human_line(b'DFLASH_EVAL {"tau": 2.1}\n') is None
    assert logview.human_line(b"step 10/100 epoch 0 loss 3.2000\n") == b"step 10/100 epoch 0 loss 3.2000\n"
    done = b'DFLASH_DONE {"step": 100, "export": "/r/export", "eval": {"tau": 2.7}, "replica_sha256": ["ab"]}\n'
    assert logview.human_line(done) == b"done at step 100; export /r/export; tau 2.7\n"
    assert logview.human_line(b'DFLASH_DONE {"step": 4}') == b"done at step 4"          # unterminated stays so
    assert logview.human_line(b"DFLASH_DONE {cut\n") == b"DFLASH_DONE {cut\n"           # not JSON: as it is
    assert logview.human_line(b"  DFLASH_METRICS {}\n") == b"  DFLASH_METRICS {}\n"      # only at a line's start
    assert logview.human_line(b"\xff\xfe bytes\n") == b"\xff\xfe bytes\n"


def test_a_progress_job_is_hidden_the_same_way_and_its_done_said_in_words():
    assert logview.human_line(b'DFLASH_PROGRESS {"job": "regenerate", "done": 3, "total": 9}\n') is None
    done = b'DFLASH_DONE {"job": "regenerate", "done": 9, "total": 9, "out": "/d/regen.jsonl"}\n'
    assert logview.human_line(done) == b"done: regenerate 9/9; out /d/regen.jsonl\n"
    assert logview.human_line(b'DFLASH_DONE {"other": 1}\n') == b'DFLASH_DONE {"other": 1}\n'


def _start(tmp_path, log: bytes, n: int) -> int:
    run = tmp_path / "r-20260101T000000-abcd"
    run.mkdir(exist_ok=True)
    (run / "output.log").write_bytes(log)
    out = subprocess.run(["bash", "-c", read_scripts.tail_start_script(str(run), n, hidden_ere=logview.HIDDEN_ERE)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[1])


def test_tail_n_counts_the_lines_the_view_shows(tmp_path):
    log = b"a\nDFLASH_METRICS {}\nb\nDFLASH_EVAL {}\nDFLASH_METRICS {}\nc"
    assert log[_start(tmp_path, log, 1):] == b"c"
    assert log[_start(tmp_path, log, 2):] == b"b\nDFLASH_EVAL {}\nDFLASH_METRICS {}\nc"
    assert _start(tmp_path, log, 3) == 0 and _start(tmp_path, log, 30) == 0
    only_machine = b"DFLASH_METRICS {}\nDFLASH_METRICS {}\n"
    assert _start(tmp_path, only_machine, 5) == len(only_machine)                          # nothing to show
    assert _start(tmp_path, b"", 5) == 0
