"""Pure parsers and the byte-exact line assembler behind `tail`."""

from __future__ import annotations

import random

import pytest

from dflash_ops.runs import parse


def test_state_line_and_states():
    raw = parse.state_line("DFLASH_RUN a-20260101T000000-abcd 0 123 3 0 1700000100 42")
    assert raw == parse.RawState("a-20260101T000000-abcd", False, 123, 3, False, 1700000100.0, 42)
    assert parse.state_of(raw) == "exited"
    assert parse.state_of(raw.__class__(**{**raw.__dict__, "alive": True})) == "running"
    assert parse.state_of(raw.__class__(**{**raw.__dict__, "exit_code": 137})) == "killed"
    assert parse.state_of(raw.__class__(**{**raw.__dict__, "exit_code": None, "stopped": True})) == "killed"
    assert parse.state_of(raw.__class__(**{**raw.__dict__, "exit_code": None})) == "lost"
    # its log's DFLASH_STOPPED line (kept_step): the trainer's 143 / 130, and torchrun's 1 after it forwarded a SIGTERM
    for code in (143, 130, 1):
        assert parse.state_of(raw.__class__(**{**raw.__dict__, "exit_code": code}), kept_step=8) == "stopped"
    assert parse.state_of(raw.__class__(**{**raw.__dict__, "exit_code": 3}), kept_step=8) == "exited"
    assert parse.state_line("DFLASH_RUN ../etc 0 1 - 0 - 0") is None
    assert parse.state_line("garbage") is None


def test_run_list_sorts_by_stamp_and_reads_run_json():
    text = ("DFLASH_NOW 1700000200\n"
            "DFLASH_RUN b-20260102T000000-0000 1 7 - 0 - 5\n"
            'DFLASH_JSON {"name": "b", "started_at": 1700000000, "argv": ["x"]}\n'
            "DFLASH_RUN a-20260101T000000-ffff 0 - - 0 - 0\n"
            "DFLASH_JSON \n")
    runs = parse.run_list(text, "/r")
    assert [r.run_id for r in runs] == ["a-20260101T000000-ffff", "b-20260102T000000-0000"]
    assert runs[0].name == "a" and runs[0].state == "lost" and runs[0].pid is None
    assert runs[1].duration_s == 200 and runs[1].argv == ("x",) and runs[1].run_dir == "/r/b-20260102T000000-0000"


def test_probe_splits_header_and_log_bytes():
    p = parse.probe(b"DFLASH_NOW 5\nDFLASH_RUN a-20260101T000000-abcd 1 9 - 0 - 3\nDFLASH_LOG\nhi\nDFLASH_LOG\n")
    assert p.raw.alive and p.now == 5 and p.log_tail == b"hi\nDFLASH_LOG\n"


def test_assembler_releases_only_complete_lines_once():
    a = parse.LineAssembler(offset=0)
    assert a.feed(0, b"ab") == []
    assert a.feed(2, b"c\nde") == [b"abc\n"]
    assert a.feed(3, b"\nde\nf") == [b"de\n"]   # overlapping resend: the repeated bytes are dropped
    assert a.offset == 8 and a.flush() == [b"f"] and a.flush() == []  # the last bytes as they are


def test_assembler_refuses_a_gap():
    a = parse.LineAssembler(offset=10)
    with pytest.raises(ValueError):
        a.feed(11, b"x")


@pytest.mark.parametrize("seed", range(20))
def test_assembler_any_chunking_with_resends_gives_each_line_once(seed):
    rng = random.Random(seed)
    lines = [("line %d " % i + "\u00e9" * rng.randrange(5) + "x" * rng.randrange(30) + "\n").encode() for i in range(200)]
    blob = b"".join(lines)
    a, out, pos = parse.LineAssembler(offset=0), [], 0
    while pos < len(blob):
        start = max(0, a.offset - rng.randrange(0, 8))   # a reconnect may re-read a few bytes
        end = min(len(blob), start + rng.randrange(1, 97))
        out += a.feed(start, blob[start:end])
        pos = a.offset
    assert out + a.flush() == lines
