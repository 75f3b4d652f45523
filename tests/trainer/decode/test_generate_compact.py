"""The refilling batch generator's compacted tail steps (trainer/decode/generate.py): once no prompt waits and at
most half the rows are live, a step covers the live rows and a few ended ones only. On CPU under Triton's
interpreter (the per-row kernel path, where compaction runs), real tiny targets (dense, hybrid): the answers are
token for token those of the generator without compaction and HF generate's, and `last_run` counts the compacted
steps at the widths the host loop's rule gives. tests/trainer/decode/test_generate_compact_gpu.py replays them."""
from __future__ import annotations

import pytest

from tests.trainer.decode.test_generate import family_target, prompts_of
from trainer.decode.generate import BatchGenerator, Sampling, hf_generate
from trainer.decode.stops import cut_at_stop

TAIL_LENGTHS = (5, 9, 3, 12, 7, 4, 10, 6, 8, 2)  # 10 prompts through 8 rows: one refill, then the tail
MAX_NEW = 40


def tail_workload(target):
    """-> (prompts, stop ids, HF's answers): stop ids that the first answers of prompts 2.. reach early and prompts
    0 and 1 never do, so two rows stay live for MAX_NEW tokens while most end within a few."""
    prompts = prompts_of(target, TAIL_LENGTHS, seed=7)
    free = hf_generate(target.model, prompts, Sampling(max_new_tokens=MAX_NEW), [], target.tokenizer.pad_token_id)
    stops = sorted({row[j] for row in free[2:] for j in range(1, 4)} - set(free[0]) - set(free[1]))
    return prompts, stops, [cut_at_stop(row, stops) for row in free]


# the hybrid (Gated DeltaNet states gathered and scattered by row); the dense target is the next test's, and an
# MoE layer holds no per-row state (each family's run takes about 3 minutes of the interpreter)
@pytest.mark.parametrize("family", ["qwen3_5"])
def test_compacted_tail_steps_answer_as_every_row_steps(interpreter, family_dirs, family):
    target = family_target(family_dirs, family)
    prompts, stops, want = tail_workload(target)
    assert [len(a) for a in want[:2]] == [MAX_NEW] * 2 and sum(len(a) < 8 for a in want) >= 6
    greedy = Sampling(max_new_tokens=MAX_NEW)
    full = BatchGenerator(target, rows=8, max_len=60, stop_ids=stops, compact=False)
    assert full.generate(prompts, greedy) == want and full.widths == []
    assert full.last_run.compact_steps == 0 and full.last_run.slot_steps == full.last_run.steps * 8
    gen = BatchGenerator(target, rows=8, max_len=60, stop_ids=stops, compact_floor=1)
    assert gen.static.row_kernel and gen.widths == [4, 2, 1]
    streamed = list(gen.generate_stream(prompts, greedy))
    assert [a for _, a in sorted(streamed)] == want
    run = gen.last_run
    assert run.steps == full.last_run.steps == MAX_NEW - 1 and run.compact_steps > 0
    # no step before the first check (CHECK_EVERY - 1 = 15) compacts; compacted steps are 4 or 2 rows wide here
    narrow = run.slot_steps - (run.steps - run.compact_steps) * 8
    assert 2 * run.compact_steps <= narrow <= 4 * run.compact_steps and run.compact_steps <= MAX_NEW - 1 - 15
    assert run.busy_computed > run.busy == full.last_run.busy
    # again on the same generator, sampled: the compacted steps draw what every row's steps draw
    hot = Sampling(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=3)
    assert gen.generate(prompts, hot) == full.generate(prompts, hot)


def test_the_widths_follow_the_live_rows(interpreter, family_dirs):
    """Dense qwen3 on this workload: the check at step 15 leaves rows 0, 1 live and the two refilled rows held (their
    prompts' answers ended at their prefill's choice, which only the next check sees): width 4 until the check at
    step 31 leaves two live rows, width 2 to the end (step 39). The floor (16 by default) keeps 8 rows whole."""
    target = family_target(family_dirs, "qwen3")
    prompts, stops, want = tail_workload(target)
    assert [len(a) for a in want] == [MAX_NEW] * 2 + [1] * 8
    gen = BatchGenerator(target, rows=8, max_len=60, stop_ids=stops, compact_floor=2)
    assert gen.widths == [4, 2] and gen.generate(prompts, Sampling(max_new_tokens=MAX_NEW)) == want
    run = gen.last_run
    assert (run.steps, run.compact_steps, run.slot_steps) == (39, 24, 15 * 8 + 16 * 4 + 8 * 2)
    assert run.as_dict()["busy_computed"] == round((2 * (MAX_NEW - 1)) / run.slot_steps, 4)
    assert BatchGenerator(target, rows=8, max_len=60, stop_ids=stops).widths == []
