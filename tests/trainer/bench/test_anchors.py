"""`python -m bench.anchors`: the anchor coverage of one epoch per setting (docs/quality.md, "Anchor density")."""
from __future__ import annotations

import json

import pytest

from bench.anchors import main


def test_coverage_of_each_setting(capsys):
    # 6 samples of 4 prompt + 8 answer tokens, 2 per 24-token row: 3 rows of 16 supervised tokens, 14 candidates
    assert main(["--synthetic", "4:8:6", "--seq-len", "24", "--rows-per-step", "3",
                 "--setting", "8", "--setting", "8:0.25"]) == 0
    line = capsys.readouterr().out.strip()
    report = json.loads(line.split(" ", 1)[1])
    assert report["rows"] == 3 and report["supervised"] == 48
    per_row, scaled = report["settings"]["8"], report["settings"]["8:0.25"]
    assert per_row == {"anchors": 24, "of_supervised": 0.5, "of_candidates": round(24 / 42, 4), "slots_used": 1.0}
    assert scaled == {"anchors": 12, "of_supervised": 0.25, "of_candidates": round(12 / 42, 4), "slots_used": 0.5}


@pytest.mark.parametrize("argv", [["--setting", "8:1.5"], ["--setting", "0"], []])
def test_bad_arguments_are_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--seq-len", "24", *(["--synthetic", "4:8:6"] if argv else []), *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("python -m bench.anchors: error: ")
