"""Batched generation with graph replay on CUDA (run on the H200: `python3 -m pytest -m gpu tests/trainer/decode`):
the replayed steps give HF `generate`'s greedy answers (fp32 targets of three families: plain, sliding-window,
soft-capped), and a sampled batch replays exactly what the same batch computes eagerly."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_generate import LENGTHS, prompts_of, stops_inside
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
