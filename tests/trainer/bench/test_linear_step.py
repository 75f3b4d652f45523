"""`python -m bench.linear_step` without a GPU: bad arguments are refused in one line (exit 2) and a machine without
CUDA is told so before any model is built; the figures come from the H200 (docs/benchmarks.md)."""
from __future__ import annotations

import pytest
import torch

from bench import linear_step
from tests.trainer.bench.refusals import assert_needs_a_gpu, assert_refused


@pytest.mark.parametrize("argv, needle", [
    (["--shape", "qwen3-30b-a3b"], "choose a hybrid shape"),
    (["--rows", "0"], "--rows and --reps must be >= 1"),
    (["--tiles", "32"], "--tiles takes BV,WARPS"),
    (["--tiles", "24,4"], "--tiles takes BV,WARPS"),
    (["--tiles", "32,32"], "--tiles takes BV,WARPS"),
])
def test_bad_arguments_are_refused_in_one_line(argv, needle, capsys):
    assert_refused(linear_step.main, argv, needle, capsys)


def test_tile_settings_parse_as_pairs():
    assert linear_step._tiles("32,4; 64,8;16,2") == [(32, 4), (64, 8), (16, 2)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_says_so():
    assert_needs_a_gpu(linear_step.main, ["--shape", "qwen3.5-9b"])
