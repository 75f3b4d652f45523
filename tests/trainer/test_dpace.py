"""The D-PACE loss (`loss.kind: dpace`): its weights by hand, the chunked loss and its gradient against the paper's
formula written out here, the training step, and a short run through the real trainer."""
import json
import math

import pytest
import torch

from tests.trainer.conftest import make_state, small_cfg
from tests.trainer.test_traps import two_doc_batch
from trainer.model.loss import DPace, ce_chunk, ce_chunk_fused, chunked_lm_loss, dpace_scale, dpace_weights


def reference_weights(q: list[float], valid: list[bool], alpha: float) -> list[float]:
    """w_k = sum over valid j >= k of prod over valid i <= j of ((1 - alpha) q_i + alpha); 0 where invalid."""
    out = []
    for k in range(len(q)):
        if not valid[k]:
            out.append(0.0)
            continue
        total = 0.0
        for j in range(k, len(q)):
            if valid[j]:
                total += math.prod((1 - alpha) * q[i] + alpha for i in range(j + 1) if valid[i])
        out.append(total)
    return out


def test_weights_by_hand():
    ce = -torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64))
    both = torch.tensor([[True, True]])
    # c = 0.75, 0.625: w_1 = 0.75 + 0.75 * 0.625, w_2 = 0.75 * 0.625
    assert dpace_weights(ce, both, 0.5).tolist() == [[1.21875, 0.46875]]
    gap = torch.tensor([[True, False, True]])
    ce3 = -torch.log(torch.tensor([[0.5, 1e-30, 0.25]], dtype=torch.float64))
    assert dpace_weights(ce3, gap, 0.5).tolist() == [[1.21875, 0.0, 0.46875]]  # an invalid position is a no-op
    assert dpace_weights(ce3, gap, 1.0).tolist() == [[2.0, 0.0, 1.0]]  # alpha 1: valid positions from k on
    assert dpace_weights(ce3, gap, 0.0).tolist() == [[0.625, 0.0, 0.125]]  # alpha 0: prefix products of q


def test_scale_counts_rows_or_positions():
    valid = torch.zeros(3, 2, 4, dtype=torch.bool)
    valid[0, 0, 1:3] = True
    valid[2, 1, 1:] = True  # rows 0 and 2 hold 2 + 3 valid positions; row 1 is padding
    assert dpace_scale(valid, "rows")[valid].unique().tolist() == [0.5]  # 2 rows
    assert dpace_scale(valid, "positions")[valid].unique().tolist() == [pytest.approx(0.2)]  # 5 positions
    assert dpace_scale(valid, "rows")[~valid].abs().sum() == 0
    assert dpace_scale(torch.zeros_like(valid), "rows").abs().sum() == 0  # all padding: loss 0, not NaN


def direct_loss(h, W, y, valid_GK, base, alpha):
    """The D-PACE loss on full logits, the weights from `reference_weights` as constants."""
    ce = torch.nn.functional.cross_entropy(h @ W.t(), y, reduction="none").view(valid_GK.shape)
    q = torch.exp(-ce).detach()
    w = torch.tensor([reference_weights(q[g].tolist(), valid_GK[g].tolist(), alpha) for g in range(len(q))],
                     dtype=h.dtype)
    return (ce * w * base.view(valid_GK.shape)).sum()


@pytest.mark.parametrize("chunk, chunk_fn, norm", [(7, ce_chunk, "rows"), (1, ce_chunk, "positions"),
                                                   (100, ce_chunk_fused, "rows")])
def test_chunked_loss_and_gradient_equal_the_direct_formula(chunk, chunk_fn, norm):
    g = torch.Generator().manual_seed(0)
    R, N, B, D, V = 2, 3, 4, 8, 29  # 2 x 3 blocks of k = 1..3
    valid = torch.rand(R, N, B, generator=g) > 0.25
    valid[:, :, 0] = False
    valid[1, 2] = False  # a padded anchor
    base = dpace_scale(valid, norm)[:, :, 1:].reshape(-1).double()
    M = R * N * (B - 1)
    h = torch.randn(M, D, generator=g, dtype=torch.float64)
    W = torch.randn(V, D, generator=g, dtype=torch.float64)
    y = torch.randint(V, (M,), generator=g)
    h1 = h.clone().requires_grad_()
    loss, _ = chunked_lm_loss(h1, W, None, y, base, chunk, chunk_fn, DPace(span=B - 1, alpha=0.3))
    (2.0 * loss).backward()
    h2 = h.clone().requires_grad_()
    ref = direct_loss(h2, W, y, valid[:, :, 1:].reshape(-1, B - 1), base, 0.3)
    (2.0 * ref).backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    # and it is not the DFlash loss under another name
    flat, _ = chunked_lm_loss(h, W, None, y, base, chunk)
    assert abs(float(flat) - float(ref.detach())) > 1e-3


def test_a_block_split_across_positions_is_refused():
    h, W = torch.zeros(5, 4), torch.zeros(7, 4)
    with pytest.raises(ValueError, match="whole blocks"):
        chunked_lm_loss(h, W, None, torch.zeros(5, dtype=torch.long), torch.ones(5), 4, None, DPace(3, 0.5))


def test_compiled_chunk_gives_the_eager_dpace_loss():
    """What compile_step installs (Inductor, CPU here), specialized on the DPace constant."""
    g = torch.Generator().manual_seed(2)
    M, D, V = 30, 16, 61
    h, W = torch.randn(M, D, generator=g), torch.randn(V, D, generator=g)
    y = torch.randint(V, (M,), generator=g)
    base = (torch.rand(M, generator=g) > 0.3).float() / 4
    dp = DPace(span=5, alpha=0.5)
    h_c, h_e = h.clone().requires_grad_(), h.clone().requires_grad_()
    loss_c, correct_c = chunked_lm_loss(h_c, W, None, y, base, 12, torch.compile(ce_chunk_fused, dynamic=False), dp)
    loss_e, correct_e = chunked_lm_loss(h_e, W, None, y, base, 12, None, dp)
    loss_c.backward()
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h_c.grad, h_e.grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(correct_c, correct_e)


def test_the_step_trains_on_the_dpace_loss_of_its_blocks(target):
    """compute_loss with loss_kind dpace: value and drafter gradients equal the direct formula over its blocks."""
    from tests.trainer.test_loss import step_and_its_blocks

    state, batch = make_state(target), two_doc_batch()
    state.loss_kind, state.dpace_alpha = "dpace", 0.5
    out, grads, hidden, labels, valid = step_and_its_blocks(state, batch)
    B, t = state.block_size, state.target
    rows = int(valid.flatten(1).any(1).sum())
    h = hidden.view(*valid.shape, -1)[:, :, 1:].reshape(-1, hidden.shape[-1])
    kept = valid[:, :, 1:].reshape(-1, B - 1)
    ref = direct_loss(h, t.lm_head.weight, labels[:, :, 1:].reshape(-1), kept, kept.float() / rows, 0.5)
    ref.backward()
    torch.testing.assert_close(out.loss_, ref, rtol=1e-5, atol=1e-6)
    for n, p in state.drafter.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_a_short_training_run_with_dpace(tmp_path, tiny_target_dir):
    from trainer.build import build
    from trainer.loop import TrainLoop

    cfg = small_cfg(tiny_target_dir, "loss.kind=dpace", "optim.max_steps=12", "optim.lr=3e-3", "log.every=4")
    TrainLoop(build(cfg, tmp_path / "run")).run()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["loss"] == {
        "kind": "dpace", "dpace_alpha": 0.5, "dpace_norm": "rows", "selector_alpha": None,
        "selector_warmup_ratio": None, "selector_ramp_ratio": None, "selector_stop_gradient": None}
    loss = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert sorted(loss) == [4, 8, 12] and all(math.isfinite(v) for v in loss.values())
    assert loss[12] < loss[4], loss
