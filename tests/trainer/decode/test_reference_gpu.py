"""Speculative decoding on CUDA (run on the H200 machine: `python3 -m pytest -m gpu tests/trainer/decode`)."""
from __future__ import annotations

import pytest
import torch

from trainer.decode.reference import DFlashProposer, OracleProposer, generate_speculative, generate_target_only
from trainer.decode.rounds import acceptance_stats
from tests.trainer.decode.test_reference import PROMPTS, CorruptedOracle, _drafter, _prompt_ids

pytestmark = pytest.mark.gpu



def test_lossless_on_cuda_fp32(cuda_target):
    drafter = _drafter(cuda_target).cuda()
    for block_size in (4, 16):
        for proposer in (DFlashProposer(cuda_target, drafter, block_size), CorruptedOracle(cuda_target, block_size, 3)):
            for text in PROMPTS:
                ids = _prompt_ids(cuda_target, text)
                want = generate_target_only(cuda_target, ids, 29)
                assert generate_speculative(cuda_target, proposer, ids, 29).tokens == want


def test_perfect_drafter_on_cuda(cuda_target):
    results = [generate_speculative(cuda_target, OracleProposer(cuda_target, 16), _prompt_ids(cuda_target, t), 33)
               for t in PROMPTS]
    assert acceptance_stats(results, 16)["tau"] == 16
