"""The refilling batch generator's compacted tail steps under graph replay on CUDA (run on the H200: `python3 -m
pytest -m gpu tests/trainer/decode/test_generate_compact_gpu.py`): fp32 tiny targets (dense Qwen3, hybrid Qwen3.5)
on a tail-heavy workload, every width's graph captured at the call's start; the replayed compacted steps answer
token for token as the replayed steps of every row, the eager compacted run and HF generate, and `last_run` counts
them."""
from __future__ import annotations

import pytest

from tests.trainer.decode.test_generate_compact import MAX_NEW, tail_workload
from tests.trainer.decode.test_generate_gpu import cuda_family
from trainer.decode.generate import BatchGenerator, Sampling

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_replayed_compacted_steps_equal_every_rows_steps(family, family_dirs):
    target = cuda_family(family_dirs, family)
    prompts, stops, want = tail_workload(target)
    greedy = Sampling(max_new_tokens=MAX_NEW)
    full = BatchGenerator(target, rows=8, max_len=60, stop_ids=stops, compact=False)
    gen = BatchGenerator(target, rows=8, max_len=60, stop_ids=stops, compact_floor=1)
    assert gen.static.row_kernel and gen.widths == [4, 2, 1]
    got = gen.generate(prompts, greedy)
    assert {key[2] for key in gen.programs} == {None, 4, 2, 1}  # every width captured before any prefill
    assert all(p.graph is not None for p in gen.programs.values())
    assert got == full.generate(prompts, greedy) == want
    assert gen.last_run.compact_steps > 0 and gen.last_run.slot_steps < full.last_run.slot_steps
    eager = BatchGenerator(target, rows=8, max_len=60, stop_ids=stops, graphs=False, compact_floor=1)
    assert eager.generate(prompts, greedy) == got
    hot = Sampling(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.9, seed=11)
    assert gen.generate(prompts, hot) == full.generate(prompts, hot)
