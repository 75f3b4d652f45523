"""`python -m bench.swiglu` (the FP8 MLP's SwiGLU quantization) on a CPU: its forms and its refusals, before torch
runs anything. The kernels' correctness: tests/trainer/test_fp8_mlp.py (interpreter) and the GPU tier."""
from __future__ import annotations

import pytest

from bench.swiglu import forms, main
from tests.trainer.bench.refusals import assert_needs_a_gpu, assert_refused
from trainer.model.fp8_target import ROW_KERNEL_MAX


def test_the_row_kernel_is_offered_only_for_widths_it_takes():
    assert {"inductor", "row", "row-w16", "looped-b2048-w8"} <= set(forms(12288))
    wide = forms(ROW_KERNEL_MAX * 2)
    assert "inductor" in wide and not any(name.startswith("row") for name in wide)
    assert wide["looped-b4096-w16"] == {"looped_block": 4096, "warps": 16}


@pytest.mark.parametrize("argv, message", [
    (["--shape", "nope"], "unknown --shape 'nope'"),
    (["--only", "row,zz"], "unknown --only form(s) ['zz']"),
    (["--tokens", "0"], "--tokens and --reps must be >= 1"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    assert_refused(main, argv, message, capsys)


def test_without_a_gpu_it_says_so_and_exits_1():
    assert_needs_a_gpu(main, ["--only", "row"])
