"""The stepper both paths share (trainer/step/stepper.py), on CPU (the pipeline's threads and the captured stepper need
CUDA: tests/trainer/gpu): the sequential `Runner` trains exactly like the step functions driven one micro-batch at a
time, and the pipeline's drafter side -- one ring slot (the step's micro-batches + the target features a producer
computed) through `build_stepper(with_feats=True)` -- exactly like the sequential `Runner`, which runs the target
itself."""
import pytest
import torch

from tests.trainer.conftest import make_state
from trainer.config import StepCfg
from trainer.data.batching import StaticBatch
from trainer.pipeline.train_pipe import ConsumerStep
from trainer.step.slots import decode_outs, encode, encode_out, micro_batch, target_keys
from trainer.step.step import forward_backward, optimizer_step
from trainer.step.stepper import EagerStep, Runner, build_stepper


def batches(target, n=2, rows=2, seq=48, anchors=6):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        b = StaticBatch.empty(rows, seq, anchors)
        ids = torch.randint(5, target.embed_tokens.weight.shape[0] - 5, (rows, seq), generator=g)
        out.append(StaticBatch(input_ids=ids, position_ids=b.position_ids,
                               doc_ids=torch.zeros(rows, seq, dtype=torch.long),
                               loss_mask=torch.ones(rows, seq, dtype=torch.bool),
                               anchor_pos=torch.sort(torch.randperm(seq - 8, generator=g)[:anchors])[0].repeat(rows, 1),
                               anchor_valid=torch.ones(rows, anchors, dtype=torch.bool)))
    return out


def test_slot_layout_round_trips():
    mbs = [StaticBatch.empty(2, 16, 3, pad_id=i) for i in range(2)]
    slot = encode(mbs)
    assert set(target_keys(2)) <= set(slot) and len(slot) == 2 * 6
    for i, mb in enumerate(mbs):
        assert all(torch.equal(a, b) for a, b in zip(micro_batch(slot, i).tensors().values(), mb.tensors().values()))


def test_step_outputs_round_trip(target):
    from trainer.step.step import forward_backward

    state = make_state(target)
    outs = [forward_backward(state, mb) for mb in batches(target)]
    flat = {k: v for i, o in enumerate(outs) for k, v in encode_out(i, o).items()}
    assert decode_outs(flat, 2) == outs


def sequential_runner(state, mbs, accum=2):
    return Runner(build_stepper(StepCfg(mode="eager"), state, encode(mbs), accum), accum)


def test_the_sequential_runner_trains_like_the_step_functions(target):
    """The eager stepper against the step contract driven by hand: each micro-batch copied into one static buffer,
    forward + backward at 1/accum, clip + AdamW, grads zeroed in place. Bit-identical losses, statistics and weights."""
    mbs = batches(target)
    ref = make_state(target)
    static = StaticBatch(**{k: v.clone() for k, v in mbs[0].tensors().items()})
    want = []
    for _ in range(3):
        ref.lr_.fill_(1e-3)
        for mb in mbs:
            static.copy_(mb)
            want.append(forward_backward(ref, static, 0.5))
        optimizer_step(ref)
        ref.optimizer.zero_grad(set_to_none=False)

    state = make_state(target)
    runner = sequential_runner(state, mbs)
    assert isinstance(runner.stepper, EagerStep)
    got = []
    for _ in range(3):
        state.lr_.fill_(1e-3)
        got += runner.step(mbs)
    assert len(got) == len(want) == 6
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    for (name, p), q in zip(state.drafter.named_parameters(), ref.drafter.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="expected 2 micro-batches, got 1"):
        runner.step(mbs[:1])


def test_precomputed_features_train_like_the_sequential_runner(target):
    mbs = batches(target)
    ref = make_state(target)
    runner = sequential_runner(ref, mbs)
    for _ in range(3):
        ref.lr_.fill_(1e-3)
        runner.step(mbs)

    state = make_state(target)
    slot = encode(mbs)
    for i, mb in enumerate(mbs):  # what the producer thread writes into the slot
        slot[f"{i}.feats"] = target.features(mb.input_ids, mb.position_ids, mb.doc_ids)
    seen = []
    consumer = ConsumerStep(build_stepper(StepCfg(mode="eager"), state, slot, 2, with_feats=True), 2,
                            before=lambda: state.lr_.fill_(1e-3), after=seen.append)
    for _ in range(3):
        out = consumer.step(slot)
    assert len(seen) == 3 and all(len(outs) == 2 for outs in seen)
    assert torch.equal(out["loss"], seen[-1][0].loss_)
    for (name, p), q in zip(state.drafter.named_parameters(), ref.drafter.parameters()):
        assert torch.equal(p, q), name
