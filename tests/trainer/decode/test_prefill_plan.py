"""The batch generator's prefill plan (trainer/decode/prefill_plan.py), pure: which prompts share a forward, from
where, how wide; and the whole-prompt forward's attention (causal SDPA over its own keys) against the masked one over
the cache, on a real tiny target."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_generate import family_target, prompts_of
from trainer.decode import prefill_plan
from trainer.decode.generate import BatchGenerator, Sampling
from trainer.decode.prefill_plan import (PREFILL_TOKENS, SPLIT_PADDING, Forward, chunked_forwards, prefill_forwards,
                                         whole_forwards, whole_width)


def span_of(n: int) -> int:
    return 1 << max(6, (n - 1).bit_length())


def covered(lengths, forwards) -> list[list[int]]:
    """Each prompt's positions the forwards compute, in order."""
    seen: list[list[int]] = [[] for _ in lengths]
    for f in forwards:
        for i in f.prompts:
            seen[i].extend(range(f.start, min(f.start + f.width, lengths[i])))
    return seen


@pytest.mark.parametrize("whole", [True, False])
def test_every_prompt_position_is_computed_once_in_order(whole):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 3000, (200,), generator=gen).tolist() + [PREFILL_TOKENS + 100]
    forwards = prefill_forwards(lengths, whole, 32, span_of)
    assert covered(lengths, forwards) == [list(range(n)) for n in lengths]
    for f in forwards:
        assert list(f.prompts) == sorted(f.prompts)  # ascending: the cache rows a forward takes
        assert all(n > f.start for n in (lengths[i] for i in f.prompts))  # no prompt in a forward past its end


def test_whole_prompts_go_longest_first_within_the_budget_and_the_padding_limit():
    lengths = [300, 1000, 990, 40, 700, 1000]
    forwards = whole_forwards(lengths, 32, span_of)
    # 1000, 1000, 990 share a 1000-wide forward (3 x 1000 within PREFILL_TOKENS); 700 is more than SPLIT_PADDING
    # shorter than that: a forward of its own; so are 300 against 704 and 40 against 304
    assert forwards == [Forward((1, 2, 5), 0, 1000), Forward((4,), 0, 704), Forward((0,), 0, 304),
                        Forward((3,), 0, 40)]
    assert all(f.width == whole_width(max(lengths[i] for i in f.prompts)) for f in forwards)
    many = [200] * 100
    budget = whole_forwards(many, 32, span_of)
    per = PREFILL_TOKENS // whole_width(200)
    assert [len(f.prompts) for f in budget] == [per] * (100 // per) + [100 % per]
    near = [1000, 1000 - SPLIT_PADDING, 1000 - SPLIT_PADDING - 1]  # the width is 1000
    assert [f.prompts for f in whole_forwards(near, 32, span_of)] == [(0, 1), (2,)]


def test_a_prompt_longer_than_a_whole_forward_goes_alone_in_chunks():
    lengths = [5, PREFILL_TOKENS + 1, 7]
    forwards = whole_forwards(lengths, 32, span_of)
    long = [f for f in forwards if f.prompts == (1,)]
    assert long == chunked_forwards(lengths, [1], 32, span_of) and len(long) > 1 and long[0].start == 0
    assert Forward((0, 2), 0, whole_width(7)) in forwards


def test_the_chunks_plan_takes_the_rows_together_within_the_score_budget():
    lengths = [700, 30, 520]
    forwards = chunked_forwards(lengths, range(3), 32, span_of)
    assert [f.start for f in forwards] == [0, 512] and forwards[0].prompts == (0, 1, 2)
    assert forwards[1] == Forward((0, 2), 512, 192)
    wide = chunked_forwards([1000] * 64, range(64), 32, span_of)  # 64 x 32 heads x chunk x 1024 slots <= 2^28
    assert {f.width for f in wide} == {128}


def test_a_whole_prompt_forward_computes_what_the_masked_one_does(family_dirs, monkeypatch):
    """The same prompts prefilled whole (causal SDPA over the forward's own keys) and through the masked path (every
    prompt in chunks that read the cache): equal first-token logits, equal caches, and the answers agree."""
    target = family_target(family_dirs, "qwen3")
    prompts = prompts_of(target, (37, 12, 30), seed=9)
    whole = BatchGenerator(target, rows=3, max_len=64, stop_ids=[], graphs=False)
    assert whole.static.whole_prefill
    want = whole.generate(prompts, Sampling(max_new_tokens=6))
    monkeypatch.setattr(prefill_plan, "PREFILL_TOKENS", 8)  # every prompt longer: chunks of 16 over the cache
    monkeypatch.setattr(prefill_plan, "PREFILL_CHUNK", 16)
    chunked = BatchGenerator(target, rows=3, max_len=64, stop_ids=[], graphs=False)
    assert chunked.generate(prompts, Sampling(max_new_tokens=6)) == want
    assert chunked.last_run.prefills > whole.last_run.prefills
    for layer_w, layer_c in zip(whole.static.k, chunked.static.k):
        for r, p in enumerate(prompts):  # the prompts' keys (the answers' went in after)
            torch.testing.assert_close(layer_w[r, :, :len(p)], layer_c[r, :, :len(p)], rtol=1e-5, atol=1e-5)
