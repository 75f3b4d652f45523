"""The 2026 families through the HF-cache reference decoder (the engine eval and the quality pipeline fall back to for
targets the static engine does not serve): speculative decoding equals the target alone, token for token, for MoE
and attention-sink targets and for hybrids, whose recurrent layers are rolled back by a copy of their state.
Real tiny models of each family, saved to disk and loaded through `load_target`."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.decode.test_reference import PROMPTS, CorruptedOracle, _drafter, _prompt_ids
from trainer.decode.reference import (DFlashProposer, generate_speculative, generate_target_only, is_hybrid,
                                      keep_accepted, new_cache, target_forward)
from trainer.model.target import load_target

FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe", "gpt_oss", "qwen3_moe")


@pytest.fixture(scope="module")
def targets(family_dirs):
    return {f: load_target(family_dirs[f], num_draft_layers=2, layer_ids=(1, 3), truncate=False) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_target_only(targets, family):
    target = targets[family]
    assert is_hybrid(target) == (family in ("qwen3_5", "qwen3_next", "qwen3_5_moe"))
    for text in PROMPTS[:2]:
        ids = _prompt_ids(target, text)
        want = generate_target_only(target, ids, 23)
        for proposer in (DFlashProposer(target, _drafter(target), 5), CorruptedOracle(target, 5, wrong_at=3)):
            got = generate_speculative(target, proposer, ids, 23)
            assert got.tokens == want, (family, text, type(proposer).__name__)
        assert set(generate_speculative(target, CorruptedOracle(target, 5, wrong_at=3), ids, 23).accepted) == {2}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_hybrid_cache_keeps_exactly_the_accepted_tokens(targets, family):
    """After a verify of 5 tokens with 2 accepted, the kept cache continues as a prefill of the 3 tokens does; the
    verified cache itself (what cropping would leave of a recurrent state) does not."""
    target = targets[family]
    ids = torch.tensor([_prompt_ids(target, PROMPTS[0])])
    start, block = ids.shape[1] - 5, ids[:, -5:]
    nxt = torch.tensor([[7]])

    def prefilled(n: int):
        cache = new_cache(target)
        target_forward(target, ids[:, :start + n], cache, 0, want_features=False)
        return cache

    want, _ = target_forward(target, nxt, prefilled(3), start + 3, want_features=False)
    cache = prefilled(0)
    before = copy.deepcopy(cache)
    target_forward(target, block, cache, start, want_features=False)
    kept = keep_accepted(target, cache, before, block, 2, start)
    got, _ = target_forward(target, nxt, kept, start + 3, want_features=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    verified = prefilled(0)
    target_forward(target, block, verified, start, want_features=False)
    wrong, _ = target_forward(target, nxt, verified, start + 3, want_features=False)
    assert not torch.allclose(wrong, want, atol=1e-3)
