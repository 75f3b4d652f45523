"""Data parallel on GPUs through the real launcher (torchrun, NCCL): 2 ranks x R rows == 1 rank x R rows x 2
accumulation micro-steps, bit for bit (see tests/trainer/test_ddp.py for why; NCCL AVG over 2 ranks is a sum and an
exact halving), in graph mode (all-reduce between the captured backward and update graphs) and through the pipeline."""
import pytest
import torch

from tests.trainer.test_ddp import lines, run, science, trainer_cmd

pytestmark = pytest.mark.gpu
GPU = ("device=auto", "step.attn=flex", "step.loss_chunk=100", "data.seq_len=128")


@pytest.mark.parametrize("extra", [(), ("pipeline.enabled=true",)], ids=["graph", "graph+pipeline"])
def test_two_gpu_ranks_equal_one_gpu_accumulating(tmp_path, tiny_target_dir, extra):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (nvidia-h200-x2)")
    sets = (*GPU, "step.mode=graph", *extra)
    one = run(trainer_cmd(tiny_target_dir, tmp_path / "one", 1, *sets, "optim.accum_steps=2"))
    two = run(trainer_cmd(tiny_target_dir, tmp_path / "two", 2, *sets, "optim.accum_steps=1"))
    for p in (one, two):
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    m1, m2 = lines(one.stdout, "DFLASH_METRICS "), lines(two.stdout, "DFLASH_METRICS ")
    assert len(m2) == 4 and science(m2) == science(m1)
    d1, d2 = lines(one.stdout, "DFLASH_DONE ")[0], lines(two.stdout, "DFLASH_DONE ")[0]
    assert d2["replica_sha256"] == d1["replica_sha256"] * 2
