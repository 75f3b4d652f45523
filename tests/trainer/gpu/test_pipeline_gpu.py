"""The threaded pipeline (loader -> target producer -> ring -> drafter consumer) trains exactly like the sequential
loop: same batches, same order, bit-identical parameters. A missed event (slot overwritten while read) would show."""
import pytest
import torch

from trainer.pipeline.standin import TINY, Workload, build, make_batch
from trainer.pipeline.threads import Devices, Pipeline
from trainer.step.graph import StepGraph

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda:0")
W = Workload(TINY, batch=2, seq=256, anchors=16, accum=1, ce_chunk=200)
STEPS = 12


def cpu_batches():
    return [make_batch(W, "cpu", seed=50 + k) for k in range(STEPS)]


def captured(seed=0):
    target, drafter, opt, st = build(W, DEV, seed=seed)
    first = {k: v.to(DEV) for k, v in cpu_batches()[0].items()}
    sample = dict(first, taps=target.taps(first["input_ids"]))
    sg = StepGraph(st.forward_backward, st.optimizer_step, st.params, opt, sample)
    sg.capture()
    return target, st, sg, sample


def test_pipeline_matches_sequential_bit_exact():
    target, st, sg, _ = captured()
    for b in cpu_batches():
        b = {k: v.to(DEV) for k, v in b.items()}
        sg.step(dict(b, taps=target.taps(b["input_ids"])))
    torch.cuda.synchronize()
    want = [p.detach().clone() for p in st.params]

    target, st, sg, sample = captured()
    seen = []
    feed = iter(cpu_batches())
    pipe = Pipeline(Devices(DEV, DEV), lambda: feed, lambda b: {"taps": target.taps(b["input_ids"])}, sg, sample,
                    slots=2, on_interval=seen.append, interval=4)
    res = pipe.run(STEPS // 2)  # two runs through one ring: it must be reusable
    res2 = pipe.run(STEPS - STEPS // 2)
    assert seen == [4, 4]
    res = type(res)(res.losses + res2.losses, res.step_s + res2.step_s, res.elapsed_s + res2.elapsed_s)
    assert len(res.losses) == STEPS and len(set(res.losses)) == STEPS
    for p, q in zip(st.params, want):
        assert torch.equal(p, q)


def test_pipeline_surfaces_a_thread_error():
    target, st, sg, sample = captured()

    def bad_target(ids):
        raise ValueError("boom in the producer")

    pipe = Pipeline(Devices(DEV, DEV), lambda: iter(cpu_batches()), lambda b: {"taps": bad_target(b["input_ids"])},
                    sg, sample)
    with pytest.raises(RuntimeError, match="boom in the producer"):
        pipe.run(3)
