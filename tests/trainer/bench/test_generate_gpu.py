"""On CUDA (run on the H200: `bash tests/gpu_tier.sh 2`): the mixed workload's chain target holds in bf16 (every
answer ends on the stop id where it was drawn, in both engines), and regenerate's memory estimate of a row is not
below what a row of the static engine takes."""
from __future__ import annotations

import gc
import json

import pytest
import torch

from bench import generate as bench

pytestmark = pytest.mark.gpu


def cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    return torch.device("cuda")


def test_the_mixed_workload_holds_in_bf16(capsys):
    cuda()
    assert bench.main(["--shape", "small", "--workload", "mixed", "--batch", "8", "--prompts", "12",
                       "--prompt-tokens", "256", "--min-prompt-tokens", "64", "--new-tokens", "300",
                       "--mean-new-tokens", "64", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    lines = [json.loads(x.split(" ", 1)[1]) for x in out.splitlines() if x.startswith("GENERATE_BENCH ")]
    assert [r["engine"] for r in lines] == ["static", "hf"] and all(r["dtype"] == "bfloat16" for r in lines)
    assert all(r["answers_as_drawn"] == 1.0 for r in lines), lines
    assert all(0 < r["floor_ms"] < r["ms_per_token_step"] for r in lines)


def test_the_memory_estimate_of_a_row_covers_the_static_engine(tmp_path):
    from trainer.decode.generate import BatchGenerator, Sampling
    from trainer.regen import memory

    device = cuda()
    slots, prompt = 1024, 256
    target = bench.random_target("small", slots, device, "bfloat16")
    est = memory.row_bytes(target.model.config.to_dict(), slots, prompt, 2)
    prompts = bench.bench_prompts(20, prompt, target.embed_tokens.weight.shape[0])

    def peak(rows: int) -> int:
        """The engine's peak above what was allocated before it (a graph's pool is freed only with the engine, and
        the engine only by the collector: its programs refer back to it)."""
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        gen = BatchGenerator(target, rows, slots, stop_ids=[])
        gen.generate(prompts[:rows], Sampling(max_new_tokens=64))
        torch.cuda.synchronize()
        used = torch.cuda.max_memory_allocated() - before
        del gen
        return used

    with torch.no_grad():
        per_row = (peak(20) - peak(4)) / 16
    assert 0 < per_row <= sum(est.values()), (per_row, est)
