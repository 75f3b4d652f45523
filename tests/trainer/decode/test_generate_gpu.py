"""Batched generation with graph replay on CUDA (run on the H200: `python3 -m pytest -m gpu tests/trainer/decode`):
the replayed steps give HF `generate`'s greedy answers (fp32 targets of three families: plain, sliding-window,
soft-capped), a sampled batch replays exactly what the same batch computes eagerly, and refilled slots under graph
replay (the one-token steps through the per-row decode kernel) answer as the eager engine and HF do, and count
what it counts (`last_run`), timed by CUDA events."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_generate import LENGTHS, REFILL_LENGTHS, prompts_of, stops_inside
from trainer.decode.generate import BatchGenerator, Sampling, hf_generate
from trainer.model.target import load_target

pytestmark = pytest.mark.gpu


def cuda_family(family_dirs, family: str):
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    return load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), device="cuda", dtype="float32",
                       truncate=False)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma2"])
def test_graph_replay_equals_hf_generate(family, family_dirs):
    target = cuda_family(family_dirs, family)
    prompts = prompts_of(target, LENGTHS + (90,))  # 90: the steps cross from the 128-slot span into the 160 one
    stops = stops_inside(target, prompts, 60)
    gen = BatchGenerator(target, rows=4, max_len=160, stop_ids=stops)
    got = gen.generate(prompts, Sampling(max_new_tokens=60))
    assert got == hf_generate(target.model, prompts, Sampling(max_new_tokens=60), stops,
                              target.tokenizer.pad_token_id)
    assert gen.programs and all(p.graph is not None for p in gen.programs.values())


def test_sampled_replay_equals_the_eager_run(family_dirs):
    target = cuda_family(family_dirs, "gemma3")
    prompts = prompts_of(target, LENGTHS)
    hot = Sampling(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=11)
    replayed = BatchGenerator(target, rows=3, max_len=64, stop_ids=[]).generate(prompts, hot)
    eager = BatchGenerator(target, rows=3, max_len=64, stop_ids=[], graphs=False).generate(prompts, hot)
    assert replayed == eager


@pytest.mark.parametrize("family", ["qwen3", "mistral"])  # mistral: a sliding window, so masked SDPA steps
def test_refilled_slots_under_graph_replay_equal_the_eager_engine_and_hf(family, family_dirs):
    """Eight prompts of 2..30 tokens (and one of 90, so spans change) through 3 rows, each row refilled: the
    replayed engine's greedy answers are HF's and the eager engine's; sampled, replay and eager draw the same."""
    target = cuda_family(family_dirs, family)
    prompts = prompts_of(target, REFILL_LENGTHS + (90,), seed=3)
    stops = stops_inside(target, prompts, 40)
    greedy = Sampling(max_new_tokens=40)
    gen = BatchGenerator(target, rows=3, max_len=160, stop_ids=stops, row_kernel=True)
    got = gen.generate(prompts, greedy)
    assert gen.refilled >= 6 and all(p.graph is not None for p in gen.programs.values())
    assert gen.static.row_kernel == (family == "qwen3")
    assert got == hf_generate(target.model, prompts, greedy, stops, target.tokenizer.pad_token_id)
    eager = BatchGenerator(target, rows=3, max_len=160, stop_ids=stops, graphs=False, row_kernel=True)
    assert eager.generate(prompts, greedy) == got
    hot = Sampling(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=11)
    assert gen.generate(prompts, hot) == eager.generate(prompts, hot)


def test_a_replayed_runs_counts_and_times(family_dirs):
    """Under graph replay `last_run` counts what the eager run counts (the same host loop) and times the prefills
    and the steps by CUDA events, read after the loop: each positive, together within the call's wall."""
    import time

    target = cuda_family(family_dirs, "qwen3")
    prompts = prompts_of(target, REFILL_LENGTHS + (90,), seed=3)
    stops = stops_inside(target, prompts, 40)
    gen = BatchGenerator(target, rows=3, max_len=160, stop_ids=stops)
    gen.generate(prompts, Sampling(max_new_tokens=40))  # captures
    torch.cuda.synchronize()
    start = time.perf_counter()
    gen.generate(prompts, Sampling(max_new_tokens=40))
    wall = time.perf_counter() - start
    run = gen.last_run
    eager = BatchGenerator(target, rows=3, max_len=160, stop_ids=stops, graphs=False)
    eager.generate(prompts, Sampling(max_new_tokens=40))
    counted = ("steps", "checks", "fills", "prefills", "prefill_tokens", "prefill_positions", "generated")
    assert [getattr(run, k) for k in counted] == [getattr(eager.last_run, k) for k in counted]
    assert run.steps == gen.replays and run.prefill_tokens == sum(REFILL_LENGTHS) + 90
    assert 0 < run.prefill_s and 0 < run.step_s and run.prefill_s + run.step_s <= wall
