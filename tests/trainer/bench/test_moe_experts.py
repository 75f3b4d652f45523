"""`python -m bench.moe_experts` without a GPU: bad arguments are refused in one line (exit 2) and a machine without
CUDA is told so before any model is built; the kernels' figures come from the H200 (docs/benchmarks.md)."""
from __future__ import annotations

import pytest
import torch

from bench import moe_experts


@pytest.mark.parametrize("argv, needle", [
    (["--shape", "qwen3-8b"], "choose an MoE shape"),
    (["--rows", "0"], "--rows and --reps must be >= 1"),
    (["--tiles", "64,128,4"], "--tiles takes BN,BK,STAGES,WARPS"),
    (["--tiles", "64,128,4,0"], "--tiles takes BN,BK,STAGES,WARPS"),
])
def test_bad_arguments_are_refused_in_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        moe_experts.main(argv)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_tile_settings_parse_as_lists_of_four():
    assert moe_experts._tiles("64,128,4,4; 32,64,3,8") == [(64, 128, 4, 4), (32, 64, 3, 8)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_says_so():
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        moe_experts.main(["--shape", "qwen3-30b-a3b"])
