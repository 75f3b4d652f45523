"""What a `BatchGenerator` call did (`last_run`, trainer/decode/run_stats.py): on a chain target (bench.generate's:
every answer ends on the stop id after a chosen number of tokens) through 2 rows, the step replays, checks, fills,
prefill forwards, tokens and positions are the counts worked out by hand from the host loop's rule and the prefill
plan (prefill_plan.py), and the answers stay HF's."""
from __future__ import annotations

import pytest

from bench.generate import make_chain, mixed_prompts
from tests.trainer.decode.test_generate import family_target, prompts_of
from trainer.decode import prefill_plan
from trainer.decode.generate import CHECK_EVERY, BatchGenerator, Sampling, hf_generate
from trainer.decode.prefill_plan import chunk_width
from trainer.decode.run_stats import RunStats

# (prompt tokens, answer tokens) of five prompts, in queue order
LENGTHS = [(6, 3), (5, 18), (4, 2), (3, 5), (2, 1)]


def test_the_counts_of_a_refilled_run_are_the_host_loops(family_dirs):
    """max_new_tokens 20: a row filled at step t must have ended by t + 19 (the `due` check). Rows 0, 1 take
    prompts 0, 1 at step 0; the check at step 15 (CHECK_EVERY - 1) finds row 0 ended (3 tokens: 2 steps) and
    refills it with prompt 2; `due` = 0 + 19 checks at step 19: prompt 1 (18 tokens, 17 steps) and prompt 2 (2
    tokens) ended, rows 0, 1 take prompts 3, 4 (prompt 4's first token, from its prefill, is the stop id); the
    check at step 31 finds both ended and the queue empty. Each fill is one forward, 8 positions a row. Both
    rows hold a prompt in every step (62 slot-steps occupied, 24 of them live: 29 tokens, 5 chosen by prefills);
    the 12 steps from 19 on are the tail (no prompt waits)."""
    assert CHECK_EVERY == 16
    target = family_target(family_dirs, "qwen3")
    order = make_chain(target.model, seed=4)
    prompts = mixed_prompts(LENGTHS, order, seed=4)
    gen = BatchGenerator(target, rows=2, max_len=40, stop_ids=[order[0]])
    answers = gen.generate(prompts, Sampling(max_new_tokens=20))
    assert [len(a) for a in answers] == [n for _, n in LENGTHS] and all(a[-1] == order[0] for a in answers)
    run = gen.last_run
    assert isinstance(run, RunStats) and run.steps == gen.replays == 31
    assert (run.rows, run.prompts, run.generated) == (2, 5, 29)
    assert (run.checks, run.fills, run.refilled) == (3, 3, 3) and run.refilled == gen.refilled
    assert (run.prefills, run.prefill_tokens, run.prefill_positions) == (3, 20, 2 * 8 + 8 + 2 * 8)
    assert run.busy == pytest.approx((29 - 5) / (31 * 2))  # each answer's first token is its prefill's
    assert (run.occupied, run.held, run.tail_steps) == (62, 1.0, 12)
    # no per-row kernel here (CPU, no interpreter): no step compacts, each computes both rows
    assert (run.compact_steps, run.slot_steps, run.busy_computed) == (0, 62, run.busy)
    assert run.prefill_s > 0 and run.step_s > 0  # CPU: the host's time around the prefills and the replays
    shown = run.as_dict()
    assert shown["busy"] == round(24 / 62, 4) and shown["steps"] == 31 and shown["prefill_positions"] == 40
    # another call starts from zero
    gen.generate(prompts[:1], Sampling(max_new_tokens=20))
    again = gen.last_run  # one prompt in 2 rows: the other slot is empty from the start, every step is the tail
    assert (again.prompts, again.fills, again.generated, again.steps, again.occupied, again.tail_steps) == \
        (1, 1, 3, 15, 15, 15) and again.held == 0.5 and again.busy == pytest.approx(2 / 30)


def test_a_stream_left_unfinished_leaves_no_counts(family_dirs):
    target = family_target(family_dirs, "qwen3")
    order = make_chain(target.model, seed=4)
    gen = BatchGenerator(target, rows=2, max_len=40, stop_ids=[order[0]])
    stream = gen.generate_stream(mixed_prompts(LENGTHS, order, seed=4), Sampling(max_new_tokens=20))
    next(stream)
    assert gen.last_run is None


def test_a_prefill_forward_is_as_wide_as_the_tails_need():
    """Under PREFILL_ALIGN (64) the tail rounds to a power of two (at least 16), above it to a multiple of 64; never
    past the chunk."""
    assert [chunk_width(t, 512) for t in (1, 6, 16, 17, 40, 64, 65, 88, 300, 512, 600)] == \
           [16, 16, 16, 32, 64, 64, 128, 128, 320, 512, 512]
    assert chunk_width(40, 32) == 32 and chunk_width(300, 256) == 256


def test_a_refill_of_long_prompts_computes_the_tails_not_whole_chunks(family_dirs, monkeypatch):
    """Whole-prompt forwards of at most 64 positions and chunks of 64: a 70-token prompt takes a 64-wide chunk and
    a 16-wide one (80 positions, not 128); by default, prompts of 150 and 130 tokens fill in one 152-wide forward.
    Answers: HF's."""
    target = family_target(family_dirs, "qwen3")
    pad = target.tokenizer.pad_token_id
    monkeypatch.setattr(prefill_plan, "PREFILL_CHUNK", 64)
    monkeypatch.setattr(prefill_plan, "PREFILL_TOKENS", 64)
    prompts = prompts_of(target, (70,), seed=7)
    gen = BatchGenerator(target, rows=1, max_len=200, stop_ids=[])
    assert gen.generate(prompts, Sampling(max_new_tokens=3)) == hf_generate(target.model, prompts,
                                                                            Sampling(max_new_tokens=3), [], pad)
    assert (gen.last_run.prefills, gen.last_run.prefill_tokens, gen.last_run.prefill_positions) == (2, 70, 80)
    monkeypatch.undo()
    prompts = prompts_of(target, (150, 130, 5, 100), seed=8)
    gen = BatchGenerator(target, rows=2, max_len=200, stop_ids=[])
    assert gen.static.whole_prefill
    assert gen.generate(prompts, Sampling(max_new_tokens=4)) == hf_generate(target.model, prompts,
                                                                            Sampling(max_new_tokens=4), [], pad)
    # both rows end at step 3 together: fills (150, 130) -> 2 x 152, then (100, 5) -> 2 x 104
    run = gen.last_run
    assert (run.fills, run.prefills, run.prefill_tokens, run.prefill_positions) == (2, 2, 385, 2 * 152 + 2 * 104)
