"""`python -m bench.decode_attention` on a CPU: its refusals, before torch runs anything. The kernel's correctness:
tests/trainer/decode/test_step_kernel.py (interpreter) and the GPU tier."""
from __future__ import annotations

import pytest

from bench.decode_attention import main
from tests.trainer.bench.refusals import assert_needs_a_gpu, assert_refused


@pytest.mark.parametrize("argv, message", [
    (["--shape", "nope"], "unknown --shape 'nope'"),
    (["--slots", "64", "--min-pos", "64"], "0 <= --min-pos < --slots"),
    (["--reps", "0"], "--rows, --slots and --reps must be >= 1"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    assert_refused(main, argv, message, capsys)


def test_without_a_gpu_it_says_so_and_exits_1():
    assert_needs_a_gpu(main, ["--rows", "4"])
