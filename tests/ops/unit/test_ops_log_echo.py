"""launch --follow's echo of the start-up (runs.lifecycle.LogEcho): each complete line of the log once, in order, as
the liveness probes bring the log's last LOG_TAIL_BYTES; nothing more once the log outgrows that window."""
from __future__ import annotations

from dflash_ops.runs import lifecycle
from dflash_ops.runs.read_scripts import LOG_TAIL_BYTES


def test_each_complete_line_is_shown_once_as_the_probes_bring_it():
    shown: list[bytes] = []
    echo = lifecycle.LogEcho(shown.append)
    for log in (b"", b"check", b"checking the config\nloading tor", b"checking the config\nloading torch\n",
                b"checking the config\nloading torch\n"):
        echo.feed(log)
    assert shown == [b"checking the config\n", b"loading torch\n"] and echo.shown == len(b"checking the config\n"
                                                                                         b"loading torch\n")


def test_a_log_past_one_probes_window_is_left_to_tail_from_what_was_shown():
    shown: list[bytes] = []
    echo = lifecycle.LogEcho(shown.append)
    echo.feed(b"start\n")
    echo.feed(b"x" * (LOG_TAIL_BYTES - 1) + b"\n")  # a window: where it starts in the log is unknown
    echo.feed(b"start\nmore\n")
    assert shown == [b"start\n"] and echo.shown == len(b"start\n") and echo.blind
