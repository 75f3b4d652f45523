"""Batched generation over the static cache (`trainer.decode.generate`): greedy output equals HF `generate` for
every supported family, on prompts of different lengths stopping at different points, and with more prompts than
rows (slots refilled several times, answers streamed as they end); sampling is deterministic
for a seed, differs for another, draws from the softmax and stays inside HF's top-p nucleus. Real tiny models of
each family (tests/trainer/families.py), saved to disk and loaded through `load_target`. On CPU the graph flag only
picks eager runs; tests/trainer/decode/test_generate_gpu.py replays the graphs."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.families import STATIC_ENGINE_FAMILIES as FAMILIES
from trainer.decode.generate import CHECK_EVERY, BatchGenerator, Sampling, gumbel_noise, hf_generate
from trainer.decode.stops import cut_at_stop
from trainer.model.target import load_target

LENGTHS = (3, 11, 7)


def family_target(family_dirs, family: str):
    return load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), truncate=False)


def prompts_of(target, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = target.embed_tokens.weight.shape[0]
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


def stops_inside(target, prompts, n: int) -> list[int]:
    """Two stop ids the target's own greedy answers reach early in different rows (HF's answers without stops)."""
    free = hf_generate(target.model, prompts, Sampling(max_new_tokens=n), [], target.tokenizer.pad_token_id)
    return [free[0][3], free[1][8]]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(family, family_dirs):
    """Three prompts of 3, 11 and 7 tokens in a batch of 4 rows, then a second batch of two other lengths on the
    same generator (its cache holds the first batch's K/V): each answer is HF's, row for row, and rows stop at
    their own first stop id."""
    target = family_target(family_dirs, family)
    pad = target.tokenizer.pad_token_id
    prompts = prompts_of(target, LENGTHS)
    stops = stops_inside(target, prompts, 20)
    gen = BatchGenerator(target, rows=4, max_len=40, stop_ids=stops)
    got = gen.generate(prompts, Sampling(max_new_tokens=20))
    assert got == hf_generate(target.model, prompts, Sampling(max_new_tokens=20), stops, pad)
    assert min(map(len, got)) <= 4 and got[0][-1] in stops  # a row really stopped, through its stop id
    again = prompts_of(target, (14, 2), seed=2)
    assert gen.generate(again, Sampling(max_new_tokens=25)) == hf_generate(target.model, again,
                                                                           Sampling(max_new_tokens=25), stops, pad)


@pytest.mark.parametrize("graphs", [True, False])  # on CPU both run eagerly; the flag must not matter there
def test_the_batch_ends_at_the_first_check_after_every_row_stopped(graphs, family_dirs):
    target = family_target(family_dirs, "qwen3")
    prompts = prompts_of(target, LENGTHS)
    free = hf_generate(target.model, prompts, Sampling(max_new_tokens=40), [], 0)
    stops = sorted({row[2] for row in free})  # every row stops by its third token
    gen = BatchGenerator(target, rows=3, max_len=60, stop_ids=stops, graphs=graphs)
    got = gen.generate(prompts, Sampling(max_new_tokens=40))
    assert got == [cut_at_stop(row, stops) for row in free] and max(map(len, got)) <= 3
    assert gen.replays == CHECK_EVERY - 1  # not 39: the host saw "all stopped" at its first check
    endless = BatchGenerator(target, rows=3, max_len=60, stop_ids=[], graphs=graphs)  # every step runs
    assert endless.generate(prompts, Sampling(max_new_tokens=40)) == free and endless.replays == 39


REFILL_LENGTHS = (2, 30, 5, 17, 9, 3, 25, 12)


@pytest.mark.parametrize("family", FAMILIES)
def test_refilled_slots_answer_as_hf_generate(family, family_dirs):
    """Eight prompts of 2..30 tokens through 3 rows: rows end at different stop ids and at max_new_tokens at
    different times and take the next prompt; every answer is HF's for its prompt, streamed once per prompt."""
    target = family_target(family_dirs, family)
    prompts = prompts_of(target, REFILL_LENGTHS, seed=3)
    stops = stops_inside(target, prompts, 24)
    gen = BatchGenerator(target, rows=3, max_len=60, stop_ids=stops)
    streamed = list(gen.generate_stream(prompts, Sampling(max_new_tokens=24)))
    want = hf_generate(target.model, prompts, Sampling(max_new_tokens=24), stops, target.tokenizer.pad_token_id)
    assert sorted(i for i, _ in streamed) == list(range(8))
    assert [answer for _, answer in sorted(streamed)] == want
    assert gen.refilled >= 5  # 8 prompts in 3 rows, each row refilled, some several times
    assert {len(a) for a in want} > {24} and any(len(a) == 24 for a in want)  # stop ids and max_new both ended rows
    # the same generator again: the cache holds the last call's rows, every answer is still HF's
    assert gen.generate(prompts[::-1], Sampling(max_new_tokens=24)) == want[::-1]


def test_a_refill_prefills_prompts_longer_than_a_chunk(family_dirs, monkeypatch):
    """A refill's prefill in several chunks (whole-prompt forwards of at most 32 positions: each prompt but the
    shortest alone, in chunks of 16), some of which end no prompt (every prompt still in it goes on): the answers
    are HF's."""
    from trainer.decode import prefill_plan

    monkeypatch.setattr(prefill_plan, "PREFILL_CHUNK", 16)
    monkeypatch.setattr(prefill_plan, "PREFILL_TOKENS", 32)
    target = family_target(family_dirs, "qwen3")
    prompts = prompts_of(target, (40, 45, 3, 37), seed=6)
    gen = BatchGenerator(target, rows=2, max_len=64, stop_ids=[])
    want = hf_generate(target.model, prompts, Sampling(max_new_tokens=8), [], target.tokenizer.pad_token_id)
    assert gen.generate(prompts, Sampling(max_new_tokens=8)) == want


def test_a_refilled_prompt_samples_what_it_samples_alone(family_dirs):
    """Sampling noise is keyed by (stream, the token's index in its answer): a prompt refilled into a busy batch, at
    another slot and time, samples the tokens it samples in a batch of one."""
    target = family_target(family_dirs, "qwen3")
    prompts = prompts_of(target, REFILL_LENGTHS, seed=4)
    hot = Sampling(max_new_tokens=20, temperature=1.0, top_p=0.95, seed=5)
    stops = stops_inside(target, prompts, 20)
    streams = [100 + i for i in range(len(prompts))]
    busy = BatchGenerator(target, rows=3, max_len=60, stop_ids=stops)
    together = busy.generate(prompts, hot, streams=streams)
    assert busy.refilled >= 5
    alone = BatchGenerator(target, rows=1, max_len=60, stop_ids=stops)
    for i in (0, 4, 7):  # the first prompt and two that waited for a slot
        assert alone.generate([prompts[i]], hot, streams=[streams[i]]) == [together[i]]
    assert len({tuple(a) for a in together}) == len(prompts)


def test_sampling_is_seeded(family_dirs):
    target = family_target(family_dirs, "gemma3")
    prompts = prompts_of(target, LENGTHS)
    gen = BatchGenerator(target, rows=3, max_len=40, stop_ids=[])
    hot = Sampling(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    first = gen.generate(prompts, hot)
    greedy = gen.generate(prompts, Sampling(max_new_tokens=16))
    assert gen.generate(prompts, hot) == first  # same seed, same tokens (after another batch ran)
    assert gen.generate(prompts, Sampling(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=8)) != first
    assert first != greedy and all(len(row) == 16 for row in first)
    # A named stream follows its prompt into another batch (another padding, another row).
    mixed = gen.generate(prompts, hot, streams=[40, 41, 42])
    moved = gen.generate([prompts[2], prompts[0]], hot, streams=[42, 40])  # padded to 7 tokens, not 11
    assert moved == [mixed[2], mixed[0]] and mixed != first


def nucleus_misses(target, prompts, answers, temperature: float, top_p: float) -> int:
    """How many sampled tokens lie outside HF's own top-p nucleus (TopPLogitsWarper after the temperature) of the
    target's distribution at their position, recomputed by HF's forward of each row alone."""
    from transformers.generation.logits_process import TopPLogitsWarper

    warp = TopPLogitsWarper(top_p)
    misses = 0
    for prompt, answer in zip(prompts, answers):
        ids = torch.tensor([prompt + answer])
        logits = target.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
        kept = warp(ids, logits) > float("-inf")
        misses += int((~kept[torch.arange(len(answer)), torch.tensor(answer)]).sum())
    return misses


def test_sampled_tokens_stay_inside_the_top_p_nucleus(family_dirs):
    """At top_p 0.3 every token is inside HF's nucleus; the same check on top_p 1 samples fails (it can fail)."""
    target = family_target(family_dirs, "llama")
    prompts = prompts_of(target, LENGTHS)
    gen = BatchGenerator(target, rows=3, max_len=40, stop_ids=[])
    narrow = gen.generate(prompts, Sampling(max_new_tokens=12, temperature=0.7, top_p=0.3, seed=3))
    assert nucleus_misses(target, prompts, narrow, 0.7, 0.3) == 0
    wide = gen.generate(prompts, Sampling(max_new_tokens=12, temperature=0.7, top_p=1.0, seed=3))
    assert nucleus_misses(target, prompts, wide, 0.7, 0.3) > 3


def test_gumbel_max_draws_from_the_softmax():
    """One draw over 4,000 rows (each row its own stream) from fixed logits: each token's frequency is its
    probability (+-0.025, ~5 standard deviations); the next draw of the same rows is another one."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    seed, streams, vocab = torch.tensor(12345), torch.arange(4000), torch.arange(4)

    def draw(d: int) -> torch.Tensor:
        return (probs.log() + gumbel_noise(seed, torch.tensor(d), streams, vocab)).argmax(-1)

    first = draw(0)
    freq = torch.bincount(first, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.025), freq
    assert (draw(1) != first).float().mean() > 0.5


def test_bad_settings_and_batches_are_one_line_errors(family_dirs):
    for bad, needle in ((dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
                        (dict(top_p=0.0), "top_p"), (dict(temperature=float("nan")), "temperature")):
        with pytest.raises(ValueError, match=needle):
            Sampling(**bad)
    gen = BatchGenerator(family_target(family_dirs, "qwen3"), rows=2, max_len=10, stop_ids=[0])
    for prompts, needle in (([], "no prompts"), ([[1], []], "empty"), ([[1] * 6], "exceeds max_len 10"),
                            ([[1]] * 5 + [[1] * 6], "a prompt of 6 tokens \\+ max_new_tokens 5 exceeds max_len 10")):
        with pytest.raises(ValueError, match=needle):
            gen.generate_stream(prompts, Sampling(max_new_tokens=5))  # refused before any answer is asked for
    with pytest.raises(ValueError, match="one id in 0..2"):
        gen.generate([[1], [2]], Sampling(max_new_tokens=5), streams=[3])
