"""`python -m trainer train` with pipeline.enabled: the target forward in the producer thread, the drafter step in the
consumer thread, every capture in the main thread first. It must train exactly like the sequential loop (flex is
deterministic, so bit for bit), resume exactly, surface a consumer-side NonFiniteLoss as itself, and give the same
result with the target on a second GPU."""
import json

import pytest
import torch

from tests.trainer.conftest import small_cfg
from trainer import checkpoint
from trainer.errors import NonFiniteLoss
from trainer.build import build
from trainer.loop import StopRule, TrainLoop

pytestmark = pytest.mark.gpu

SETS = ("device=cuda", "data.seq_len=128", "data.num_anchors=8", "data.rows_per_step=2", "optim.accum_steps=2",
        "optim.max_steps=6", "step.loss_chunk=100", "step.attn=flex")
PIPE = ("pipeline.enabled=true", "pipeline.slots=2")


def train(tmp_path, target_dir, name, *sets, stop_at=0, resume=False):
    run = build(small_cfg(target_dir, *SETS, *sets), tmp_path / name, resume=resume)
    TrainLoop(run).run(StopRule(steps=stop_at))
    torch.cuda.synchronize()
    return run


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def params(run):
    return {n: p.detach().clone() for n, p in run.state.drafter.named_parameters()}


def same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("mode", ["eager", "graph", "compile+graph"])
def test_pipeline_trains_like_the_sequential_loop(tmp_path, tiny_target_dir, mode):
    seq = train(tmp_path, tiny_target_dir, "seq", f"step.mode={mode}")
    pip = train(tmp_path, tiny_target_dir, "pip", f"step.mode={mode}", *PIPE)
    assert pip.runner is None and pip.pipe is not None
    assert losses(tmp_path / "pip") == losses(tmp_path / "seq")
    assert len(set(losses(tmp_path / "pip"))) > 1
    assert same(params(seq), params(pip))


def test_pipeline_resume_is_exact(tmp_path, tiny_target_dir):
    sets = ("step.mode=graph", "ckpt.every=3", *PIPE)
    full = train(tmp_path, tiny_target_dir, "full", *sets)
    train(tmp_path, tiny_target_dir, "split", *sets, stop_at=3)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "split")] == [3]
    second = train(tmp_path, tiny_target_dir, "split", *sets, resume=True)
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    assert same(params(full), params(second))


def test_nonfinite_loss_in_the_consumer_thread_is_reported_as_such(tmp_path, tiny_target_dir):
    run = build(small_cfg(tiny_target_dir, *SETS, "step.mode=graph", "log.every=2", *PIPE), tmp_path / "r")
    loop = TrainLoop(run)
    loop.run(StopRule(steps=2))
    with torch.no_grad():
        run.state.drafter.fc.weight.fill_(float("nan"))  # in place: the captured graph reads it on the next replay
    with pytest.raises(NonFiniteLoss, match="non-finite loss"):
        loop.run()


def test_target_on_a_second_gpu_matches_one_gpu(tmp_path, tiny_target_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (nvidia-h200-x2)")
    one = train(tmp_path, tiny_target_dir, "one", "step.mode=graph", "device=cuda:0", *PIPE)
    two = train(tmp_path, tiny_target_dir, "two", "step.mode=graph", "device=cuda:0", "pipeline.target_device=cuda:1",
                *PIPE)
    assert two.state.target.device == torch.device("cuda:1") and two.state.head is not None
    assert next(two.state.drafter.parameters()).device == torch.device("cuda:0")
    assert losses(tmp_path / "two") == losses(tmp_path / "one")
    assert same(params(one), params(two))
