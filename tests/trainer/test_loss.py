import math

import pytest
import torch

from tests.trainer.conftest import make_state
from tests.trainer.test_traps import two_doc_batch
from trainer.data.batching import StaticBatch
from trainer.model.loss import chunked_lm_loss, decay_weights, naive_lm_loss
from trainer.step.step import compute_loss, forward_backward, lr_at


def test_decay_weights_closed_form():
    w = decay_weights(16, 7.0)
    assert w[0] == 0
    for k in range(1, 16):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)
    assert float(w[1]) == 1.0


@pytest.mark.parametrize("chunk, with_bias", [(7, False), (64, True), (1, False)])
def test_chunked_ce_matches_naive_value_and_grad(chunk, with_bias):
    g = torch.Generator().manual_seed(0)
    M, D, V = 37, 16, 50
    h = torch.randn(M, D, generator=g, dtype=torch.float64)
    W = torch.randn(V, D, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64) if with_bias else None
    y = torch.randint(V, (M,), generator=g)
    w = torch.rand(M, generator=g, dtype=torch.float64) * (torch.rand(M, generator=g) > 0.3)
    h1 = h.clone().requires_grad_()
    loss, correct = chunked_lm_loss(h1, W, b, y, w, chunk)
    (3.0 * loss).backward()
    h2 = h.clone().requires_grad_()
    ref = naive_lm_loss(h2, W, b, y, w.float())
    (3.0 * ref).backward()
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    logits = h @ W.t() + (b if b is not None else 0)
    assert torch.equal(correct, logits.argmax(-1) == y)


def test_all_padding_gives_zero_loss_and_zero_grad(target):
    state = make_state(target)
    empty = StaticBatch.empty(2, 40, 5, pad_id=target.tokenizer.pad_token_id)
    out = forward_backward(state, empty)
    assert out.loss_.item() == 0.0 and out.valid_by_pos_.sum().item() == 0
    assert all(torch.count_nonzero(p.grad) == 0 for p in state.drafter.parameters())


def test_padding_rows_and_anchors_contribute_nothing(target):
    state = make_state(target)
    batch = two_doc_batch()
    padded = StaticBatch.empty(2, 40, 5, pad_id=target.tokenizer.pad_token_id)
    both = StaticBatch(**{k: torch.cat([v, getattr(padded, k)[:1]]) for k, v in batch.tensors().items()})
    a = forward_backward(state, batch)
    grads_a = [p.grad.clone() for p in state.drafter.parameters()]
    state.optimizer.zero_grad(set_to_none=True)
    b = forward_backward(state, both)
    torch.testing.assert_close(b.loss_, a.loss_, rtol=1e-6, atol=1e-7)
    for ga, p in zip(grads_a, state.drafter.parameters()):
        torch.testing.assert_close(p.grad, ga, rtol=1e-5, atol=1e-7)
    assert torch.equal(a.valid_by_pos_, b.valid_by_pos_)


def test_step_output_is_device_tensors_with_block_shapes(target):
    state = make_state(target)
    out = compute_loss(state, two_doc_batch())
    assert out.loss_.dim() == 0 and out.correct_by_pos_.shape == (4,) and out.valid_by_pos_.shape == (4,)
    assert out.valid_by_pos_.tolist() == [0.0, 4.0, 4.0, 4.0]


def test_lr_schedule_warmup_then_cosine():
    kw = dict(base_lr=1.0, total_steps=100, warmup_ratio=0.04, schedule="cosine")
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == 1.0
    assert abs(lr_at(52, **kw) - 0.5) < 1e-9
    assert lr_at(99, **kw) < 0.001


def test_bf16_target_under_autocast_runs_the_gpu_dtype_path(tiny_target_dir, target, monkeypatch):
    """The CUDA path (bf16 target, bf16 autocast drafter, fp32 params) exercised on CPU; close to the fp32 loss."""
    import trainer.step.step as step_mod
    from trainer.model.target import load_target

    ref = compute_loss(make_state(target), two_doc_batch()).loss_
    bf16 = load_target(tiny_target_dir, num_draft_layers=2, dtype="bfloat16")
    monkeypatch.setattr(step_mod, "_autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    state = make_state(bf16)
    out = forward_backward(state, two_doc_batch())
    assert out.loss_.dtype == torch.float32 and torch.isfinite(out.loss_)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in state.drafter.parameters())
    assert abs(out.loss_.item() - ref.item()) < 0.05 * ref.item()


def test_state_mask_fn_supplies_the_backend_mask(target):
    """The seam the flex runner uses: state.mask_fn(layout) -> the mask block_attention receives."""
    from trainer.model.attention import dense_block_mask

    state = make_state(target)
    ref = compute_loss(state, two_doc_batch()).loss_
    seen = []
    state.mask_fn = lambda layout: seen.append(layout.ctx_lo) or dense_block_mask(layout)
    assert torch.equal(compute_loss(state, two_doc_batch()).loss_, ref) and len(seen) == 1
    state.mask_fn = lambda layout: torch.ones_like(dense_block_mask(layout))  # leaks everything: must change loss
    assert not torch.equal(compute_loss(state, two_doc_batch()).loss_, ref)


def step_and_its_blocks(state, batch):
    """compute_loss + backward on `batch` -> (its outputs, the drafter's gradients), then, with the gradients
    cleared, the same drafter's hidden states [R, N*B, D] and block labels / valid [R, N, B] recomputed outside the
    step, for a reference loss to be built on."""
    from trainer.model.attention import make_layout
    from trainer.model.loss import block_input_ids, block_labels

    out = compute_loss(state, batch)
    out.loss_.backward()
    grads = {n: p.grad.clone() for n, p in state.drafter.named_parameters()}
    state.drafter.zero_grad(set_to_none=True)
    B, t = state.block_size, state.target
    feats = t.features(batch.input_ids, batch.position_ids, batch.doc_ids)
    layout = make_layout(batch.position_ids, batch.doc_ids, batch.anchor_pos, batch.anchor_valid, B)
    hidden = state.drafter(feats, t.embed_tokens(block_input_ids(batch.input_ids, batch.anchor_pos, B,
                                                                 t.mask_token_id)), layout)
    labels, valid = block_labels(batch.input_ids, batch.doc_ids, batch.loss_mask, batch.anchor_pos,
                                 batch.anchor_valid, B)
    return out, grads, hidden, labels, valid


def test_step_loss_equals_the_naive_loss_over_every_block_position(target):
    """compute_loss sends only block positions k >= 1 to the LM head; value, gradients and per-position accuracy must
    equal the naive loss over all B positions (k = 0 has weight 0 there)."""
    state, batch = make_state(target), two_doc_batch()
    out, grads, hidden, labels, valid = step_and_its_blocks(state, batch)
    B, t = state.block_size, state.target
    w = decay_weights(B, state.gamma) * valid
    h = hidden.reshape(-1, hidden.shape[-1])
    ref = naive_lm_loss(h, t.lm_head.weight, None, labels.reshape(-1), w.reshape(-1))
    ref.backward()
    assert torch.allclose(out.loss_, ref, rtol=1e-5, atol=1e-6)
    for n, p in state.drafter.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-6), n
    hits = (t.lm_head(h).argmax(-1).view_as(valid) == labels) & valid
    assert out.correct_by_pos_.tolist() == hits.float().sum(dim=(0, 1)).tolist() and out.correct_by_pos_[0] == 0
