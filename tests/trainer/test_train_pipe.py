"""The pipeline's drafter side on CPU (the threads themselves need CUDA: tests/trainer/gpu): one ring slot (the step's
micro-batches + the target features a producer computed) through `slot_step` + `EagerStep` must train exactly like
the sequential `EagerRunner`, which runs the target itself."""
import torch

from tests.trainer.conftest import make_state
from trainer.data.batching import StaticBatch
from trainer.pipeline.train_pipe import ConsumerStep
from trainer.step.graph import EagerStep, slot_step
from trainer.step.slots import decode_outs, encode, encode_out, micro_batch, target_keys
from trainer.step.step import EagerRunner


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


def test_precomputed_features_train_like_the_sequential_runner(target):
    mbs = batches(target)
    ref = make_state(target)
    for _ in range(3):
        ref.lr_.fill_(1e-3)
        static = StaticBatch(**{k: v.clone() for k, v in mbs[0].tensors().items()})  # own buffers, as on a device
        EagerRunner(ref, static, accum_steps=2).step(mbs)

    state = make_state(target)
    fwd_bwd, opt_step = slot_step(state, 2, with_feats=True)
    seen = []
    consumer = ConsumerStep(EagerStep(fwd_bwd, opt_step, state.optimizer), 2,
                            before=lambda: state.lr_.fill_(1e-3), after=seen.append)
    for _ in range(3):
        slot = encode(mbs)
        for i, mb in enumerate(mbs):  # what the producer thread writes into the slot
            slot[f"{i}.feats"] = target.features(mb.input_ids, mb.position_ids, mb.doc_ids)
        out = consumer.step(slot)
    assert len(seen) == 3 and all(len(outs) == 2 for outs in seen)
    assert torch.equal(out["loss"], seen[-1][0].loss_)
    for (name, p), q in zip(state.drafter.named_parameters(), ref.drafter.parameters()):
        assert torch.equal(p, q), name
