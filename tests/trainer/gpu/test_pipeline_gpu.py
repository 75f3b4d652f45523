"""The threaded pipeline (loader -> target producer -> ring -> drafter consumer) over the trainer's own target and
step trains exactly like the same captured step driven in one thread: same batches, same order, bit-identical
parameters. A missed event (slot overwritten while read) would show."""
import pytest
import torch

from tests.trainer.gpu.gpu_bed import DEV, fresh, params
from trainer.config import StepCfg
from trainer.pipeline import train_pipe
from trainer.pipeline.threads import Devices, Pipeline
from trainer.step.slots import encode, target_keys

pytestmark = pytest.mark.gpu
STEPS = 12


def captured(target_dir):
    """A fresh state and its pipeline pieces, captured in this (the main) thread."""
    _cfg, state, batches = fresh(target_dir)
    built = train_pipe.build(state, [batches.batch(0)], step=StepCfg(mode="graph"), target_device=DEV,
                             drafter_device=DEV, grad_sync=None, slots=2, prefetch=2)
    return state, batches, built


def cpu_steps(batches) -> list[dict[str, torch.Tensor]]:
    return [encode([batches.batch(k)]) for k in range(STEPS)]


def consumer(built):
    return train_pipe.ConsumerStep(built.stepper, 1, lambda: None, lambda outs: None)


def test_pipeline_matches_one_thread_bit_exact(tiny_target_dir):
    state, batches, built = captured(tiny_target_dir)
    for inputs in cpu_steps(batches):
        slot = {k: v.to(DEV) for k, v in inputs.items()}
        slot.update({k: v.clone() for k, v in built.target_fn({k: slot[k] for k in target_keys(1)}).items()})
        built.stepper.step(slot)
    torch.cuda.synchronize()
    want = [p.detach().clone() for p in params(state)]

    state, batches, built = captured(tiny_target_dir)
    seen = []
    feed = iter(cpu_steps(batches))
    pipe = Pipeline(Devices(DEV, DEV), lambda: feed, built.target_fn, consumer(built), built.example,
                    target_keys=target_keys(1), slots=2, on_interval=seen.append, interval=4)
    res = pipe.run(STEPS // 2)  # two runs through one ring: it must be reusable
    res2 = pipe.run(STEPS - STEPS // 2)
    assert seen == [4, 4]
    losses = res.losses + res2.losses
    assert len(losses) == STEPS and len(set(losses)) == STEPS
    for p, q in zip(params(state), want):
        assert torch.equal(p, q)


def test_pipeline_surfaces_a_thread_error(tiny_target_dir):
    _state, batches, built = captured(tiny_target_dir)

    def bad_target(inputs):
        raise ValueError("boom in the producer")

    pipe = Pipeline(Devices(DEV, DEV), lambda: iter(cpu_steps(batches)), bad_target, consumer(built), built.example,
                    target_keys=target_keys(1))
    with pytest.raises(RuntimeError, match="boom in the producer"):
        pipe.run(3)
