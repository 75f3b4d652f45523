"""Batched static-cache greedy continuations equal HF's greedy decoding, row by row."""
from __future__ import annotations

import pytest
import torch

from trainer.decode.batch import BatchGreedy
from trainer.decode.reference import generate_target_only


def test_each_row_is_the_targets_own_greedy_continuation(full_target):
    torch.manual_seed(0)
    vocab = full_target.embed_tokens.weight.shape[0]
    prompts = torch.randint(0, vocab - 1, (5, 7))
    gen = BatchGreedy(full_target, rows=4, prompt_len=7, new_tokens=9)
    first, last = gen.generate(prompts[:4]), gen.generate(prompts[4:])  # a full batch, then a padded one
    assert first.shape == (4, 9) and last.shape == (1, 9)
    got = torch.cat([first, last]).tolist()
    for row, prompt in zip(got, prompts.tolist()):
        assert row == generate_target_only(full_target, prompt, 9)


def test_shapes_that_do_not_fit_are_refused(full_target):
    gen = BatchGreedy(full_target, rows=2, prompt_len=4, new_tokens=3)
    with pytest.raises(ValueError, match="do not fit"):
        gen.generate(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="do not fit"):
        gen.generate(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError):
        BatchGreedy(full_target, rows=0, prompt_len=4, new_tokens=3)
