"""Speculative decoding is lossless: its greedy output is the target's greedy output, token for token.

Real components only: the session's tiny Qwen3 target (saved to disk, loaded through `load_target`), a real
`Drafter`, and proposers that are real modules running the target itself.
"""
from __future__ import annotations

import pytest
import torch

from trainer.model.attention import make_layout
from trainer.model.drafter import Drafter, DrafterConfig
from trainer.decode.rounds import SpecResult, acceptance_stats
from trainer.decode.reference import (DFlashProposer, DraftContextCache, OracleProposer, crop_cache,
                                 draft_block_hidden, generate_speculative, generate_target_only, new_cache,
                                 target_forward)

PROMPTS = ("count from 3 to 40", "repeat twice : cat dog fish", "reverse : sun moon star road", "add 12 and 30")


def _prompt_ids(target, text: str) -> list[int]:
    tok = target.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def _drafter(target, seed: int = 0, layers: int = 2) -> Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(target.hf_config, num_layers=layers, num_taps=len(target.layer_ids))
    return Drafter(cfg).eval()


class CorruptedOracle(OracleProposer):
    """The target's own greedy block with draft token `wrong_at` (1-based block position) replaced by another token:
    every round must then accept exactly wrong_at - 1 drafts."""

    def __init__(self, target, block_size: int, wrong_at: int) -> None:
        super().__init__(target, block_size)
        self.wrong_at = wrong_at

    def propose(self, new_feats, committed):
        draft = super().propose(new_feats, committed).clone()
        draft[self.wrong_at - 1] = (draft[self.wrong_at - 1] + 1) % self.target.embed_tokens.weight.shape[0]
        return draft


def test_cached_block_draft_equals_training_forward(full_target):
    """The inference forward (context K/V cached over two rounds) == Drafter.forward with the training layout."""
    drafter = _drafter(full_target, seed=3)
    T_D = len(full_target.layer_ids) * full_target.hf_config.hidden_size
    S, B = 11, 4
    torch.manual_seed(1)
    feats = torch.randn(1, S + 1, T_D)  # the feature at the anchor (index S) must stay invisible
    block = torch.randn(1, B, full_target.hf_config.hidden_size)
    cache = DraftContextCache(len(drafter.layers))
    draft_block_hidden(drafter, cache, feats[:, :5], block)  # round 1: context 0..4 (its block output is discarded)
    got = draft_block_hidden(drafter, cache, feats[:, 5:S], block)  # round 2: context 5..10, anchor at 11
    assert cache.length == S and cache.k[0].shape[2] == S
    pos = torch.arange(S + 1)[None]
    layout = make_layout(pos, torch.zeros(1, S + 1, dtype=torch.long), torch.tensor([[S]]),
                         torch.tensor([[True]]), B)
    want = drafter(feats, block, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_crop_cache_keeps_prefix(full_target):
    cache = new_cache(full_target)
    ids = torch.tensor([_prompt_ids(full_target, PROMPTS[0])])
    target_forward(full_target, ids, cache, 0, want_features=False)
    crop_cache(cache, 4)
    assert cache.get_seq_length() == 4
    crop_cache(cache, 4)  # no-op
    assert cache.get_seq_length() == 4
    with pytest.raises(ValueError):
        crop_cache(cache, 5)


@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_speculative_equals_target_only(full_target, block_size):
    """Random drafter (rejects nearly everything) and a briefly-wrong oracle (accepts part of each block): the
    output never changes; max_new values are not multiples of the block size."""
    random_drafter = DFlashProposer(full_target, _drafter(full_target), block_size)
    partial = CorruptedOracle(full_target, block_size, wrong_at=max(1, block_size // 2))
    for text in PROMPTS:
        ids = _prompt_ids(full_target, text)
        for max_new in (1, 7, 23):
            want = generate_target_only(full_target, ids, max_new)
            assert len(want) == max_new
            for proposer in (random_drafter, partial):
                got = generate_speculative(full_target, proposer, ids, max_new)
                assert got.tokens == want, (text, max_new, type(proposer).__name__)
        got = generate_speculative(full_target, partial, ids, 23)
        assert set(got.accepted) == {partial.wrong_at - 1}


def test_eos_stops_both_paths_at_the_same_token(full_target):
    """EOS inside a block: both paths stop right after it; nothing past it is emitted."""
    ids = _prompt_ids(full_target, PROMPTS[0])
    free = generate_target_only(full_target, ids, 30)
    eos = free[6]  # a token the target emits mid-stream; declare it the end-of-sequence token
    first = free.index(eos)
    want = generate_target_only(full_target, ids, 30, stops=(eos,))
    assert want == free[:first + 1]
    for proposer in (DFlashProposer(full_target, _drafter(full_target), 16), OracleProposer(full_target, 16),
                     CorruptedOracle(full_target, 4, wrong_at=3)):
        assert generate_speculative(full_target, proposer, ids, 30, stops=(eos,)).tokens == want


def test_perfect_drafter_reaches_tau_equal_block_size(full_target):
    for block_size in (4, 16):
        results = [generate_speculative(full_target, OracleProposer(full_target, block_size),
                                        _prompt_ids(full_target, text), 37) for text in PROMPTS]
        stats = acceptance_stats(results, block_size)
        assert stats["tau"] == block_size
        assert stats["accept_by_pos"] == [1.0] * (block_size - 1)
        assert stats["rounds"] == len(PROMPTS) * -(-(37 - 1) // block_size)  # first token comes from the prefill


def test_acceptance_stats_by_position():
    stats = acceptance_stats([SpecResult([1], accepted=[0, 3]), SpecResult([2], accepted=[1])], 4)
    assert stats == {"tau": round((1 + 4 + 2) / 3, 4), "rounds": 3, "accept_by_pos": [round(2 / 3, 4), round(1 / 3, 4),
                                                                            round(1 / 3, 4)]}


def test_host_time_split_covers_every_round(full_target):
    """host_s splits each round into draft / verify / accept, adds up across calls, and changes nothing decoded."""
    ids = _prompt_ids(full_target, PROMPTS[0])
    proposer = DFlashProposer(full_target, _drafter(full_target), 4)
    plain = generate_speculative(full_target, proposer, ids, 20)
    spent: dict[str, float] = {}
    timed = generate_speculative(full_target, proposer, ids, 20, host_s=spent)
    assert timed == plain and set(spent) == {"draft", "verify", "accept"} and all(v > 0 for v in spent.values())
    once = dict(spent)
    generate_speculative(full_target, proposer, ids, 20, host_s=spent)
    assert all(spent[k] > once[k] for k in once)
