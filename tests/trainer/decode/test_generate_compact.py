"""The refilling batch generator's compacted tail steps (trainer/decode/generate.py): once no prompt waits and at
most half the rows are live, a step covers the live rows and a few ended ones only. On CPU under Triton's
interpreter (the per-row kernel path, where compaction runs), real tiny targets (dense, hybrid): the answers are
token for token those of the generator without compaction and HF generate's, and `last_run` counts the compacted
steps at the widths the host loop's rule gives. tests/trainer/decode/test_generate_compact_gpu.py replays them.
The targets have two layers (tests/trainer/conftest.py `two_layer_dirs`; the hybrid's: one linear-attention, one
full-attention): the interpreter's cost is per layer, and one layer of each kind is what compaction must serve."""
from __future__ import annotations

import pytest

from tests.trainer.decode.test_generate import prompts_of
from tests.trainer.families import load_two_layers
from trainer.decode.generate import BatchGenerator, Sampling, hf_generate
from trainer.decode.stops import cut_at_stop

TAIL_LENGTHS = (5, 9, 3, 12, 7, 4, 10, 6, 8, 2)  # 10 prompts through 8 rows: one refill, then the tail
MAX_NEW = 40
# the sampled pair: past the first check (step 15), where compaction starts; sampled answers run long
SAMPLED_MAX_NEW = 24


def tail_workload(target):
    """-> (prompts, stop ids, HF's answers): stop ids that the first answers of prompts 2.. reach early and prompts
    0 and 1 never do, so two rows stay live for MAX_NEW tokens while most end within a few."""
    prompts = prompts_of(target, TAIL_LENGTHS, seed=7)
    free = hf_generate(target.model, prompts, Sampling(max_new_tokens=MAX_NEW), [], target.tokenizer.pad_token_id)
    stops = sorted({row[j] for row in free[2:] for j in range(1, 4)} - set(free[0]) - set(free[1]))
    return prompts, stops, [cut_at_stop(row, stops) for row in free]


# the hybrid (Gated DeltaNet states gathered and scattered by row); the dense target is the next test's, and an
# MoE layer holds no per-row state (each family's run costs a minute or more of the interpreter)
@pytest.mark.parametrize("family", ["qwen3_5"])
def test_compacted_tail_steps_answer_as_every_row_steps(interpreter, two_layer_dirs, family):
    target = load_two_layers(two_layer_dirs[family])
    prompts, stops, want = tail_workload(target)
    assert [len(a) for a in want[:2]] == [MAX_NEW] * 2 and sum(len(a) < 8 for a in want) >= 6
    greedy = Sampling(max_new_tokens=MAX_NEW)
    gen = BatchGenerator(target, rows=8, max_len=60, stop_ids=stops, compact_floor=1)
    assert gen.static.row_kernel and gen.widths == [4, 2, 1]
    streamed = list(gen.generate_stream(prompts, greedy))
    assert [a for _, a in sorted(streamed)] == want
    run = gen.last_run
    assert run.steps == MAX_NEW - 1 and run.compact_steps > 0  # as many steps as every row's (the longest answer's)
    # no step before the first check (CHECK_EVERY - 1 = 15) compacts; compacted steps are 4 or 2 rows wide here
    narrow = run.slot_steps - (run.steps - run.compact_steps) * 8
    assert 2 * run.compact_steps <= narrow <= 4 * run.compact_steps and run.compact_steps <= MAX_NEW - 1 - 15
    # Sampled, on the same generator and on one whose every row steps (greedy, that one answers as HF does:
    # tests/trainer/decode/test_step_inputs.py): the compacted steps draw what every row's steps draw, in as many
    # steps, with the same live share of the full grid and a larger one of the rows computed.
    hot = Sampling(max_new_tokens=SAMPLED_MAX_NEW, temperature=1.0, top_p=0.9, seed=3)
    full = BatchGenerator(target, rows=8, max_len=60, stop_ids=stops, compact=False)
    assert full.widths == [] and gen.generate(prompts, hot) == full.generate(prompts, hot)
    every, run = full.last_run, gen.last_run
    assert every.compact_steps == 0 and every.slot_steps == every.steps * 8
    assert run.compact_steps > 0 and run.steps == every.steps and run.busy_computed > run.busy == every.busy


def test_the_widths_follow_the_live_rows(interpreter, two_layer_dirs):
    """Dense qwen3 on this workload: the check at step 15 leaves rows 0, 1 live and the two refilled rows held (their
    prompts' answers ended at their prefill's choice, which only the next check sees): width 4 until the check at
    step 31 leaves two live rows, width 2 to the end (step 39). The floor (16 by default) keeps 8 rows whole."""
    target = load_two_layers(two_layer_dirs["qwen3"])
    prompts, stops, want = tail_workload(target)
    assert [len(a) for a in want] == [MAX_NEW] * 2 + [1] * 8
    gen = BatchGenerator(target, rows=8, max_len=60, stop_ids=stops, compact_floor=2)
    assert gen.widths == [4, 2] and gen.generate(prompts, Sampling(max_new_tokens=MAX_NEW)) == want
    run = gen.last_run
    assert (run.steps, run.compact_steps, run.slot_steps) == (39, 24, 15 * 8 + 16 * 4 + 8 * 2)
    assert run.as_dict()["busy_computed"] == round((2 * (MAX_NEW - 1)) / run.slot_steps, 4)
    assert BatchGenerator(target, rows=8, max_len=60, stop_ids=stops).widths == []
