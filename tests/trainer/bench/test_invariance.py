"""`python -m bench.invariance`: the op-by-op count behind docs/quality.md's "Exact bf16" table."""
from __future__ import annotations

import json

import pytest

from bench.invariance import main


def test_counts_every_op_over_all_its_outputs(capsys):
    assert main(["--device", "cpu", "--blocks", "1", "--dtypes", "float32"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("INVARIANCE ")
    report = json.loads(line.split(" ", 1)[1])
    counts = report["float32"]
    # One block of 16 tokens through 8 layers of the quality shape (hidden 512, 8 heads of 64, vocab 8192).
    assert counts["q_proj"].endswith("/65536") and counts["k_proj"].endswith("/32768")
    assert counts["lm_head"].endswith("/131072") and counts["sdpa (GQA)"].endswith("/65536")
    for name, value in counts.items():
        differing, total = map(int, value.split("/"))
        assert 0 <= differing <= total, name


@pytest.mark.parametrize("argv", [["--blocks", "0"], ["--dtypes", "float16"]])
def test_bad_arguments_are_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", *argv])
    assert exc.value.code == 2
    assert "--blocks must be" in capsys.readouterr().err
