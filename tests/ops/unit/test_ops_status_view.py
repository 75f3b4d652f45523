"""status's text layout: lines break between values only, and stay inside the width whenever a value fits."""
from __future__ import annotations

from dflash_ops.cli.status_view import wrap


def _text(lines) -> list[str]:
    return [" " * pad + "  ".join(c for c, _ in cells) for pad, cells in lines]


def test_wrap_breaks_between_cells_with_a_hanging_indent():
    cells = [(w, "") for w in ("job-20261130T101500-1a2b", "running", "pid 4242", "up 1h02m", "gpus 0,1")]
    assert _text(wrap(cells, 80, 4, 8)) == ["    job-20261130T101500-1a2b  running  pid 4242  up 1h02m  gpus 0,1"]
    narrow = _text(wrap(cells, 40, 4, 8))
    assert narrow == ["    job-20261130T101500-1a2b  running", "        pid 4242  up 1h02m  gpus 0,1"]
    assert all(len(line) <= 40 for line in narrow)


def test_a_cell_wider_than_the_line_is_kept_whole_on_its_own_line():
    long_id = "x" * 90
    assert _text(wrap([("a", ""), (long_id, ""), ("b", "")], 80, 2, 4)) == ["  a", "    " + long_id, "    b"]
