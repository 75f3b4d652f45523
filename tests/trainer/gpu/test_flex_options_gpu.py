"""The measured flex kernel_options (trainer.model.flex.SM90_KERNEL_OPTIONS) on the GPU: on Hopper they are what
the attentions run, at every head dim they are set for, and they compute the same attention as the reference; and
`python -m bench.attention` times them."""
import json

import pytest
import torch
import torch.nn.functional as F

from bench.attention import main as bench_attention
from tests.trainer.gpu.test_flex_gpu import DEV, layout, reference, rel
from trainer.model.doc_attention import DocCausalMask
from trainer.model.flex import (SM90_KERNEL_OPTIONS, BlockLayoutShape, FlexBlockMask, compiled_flex_attention,
                                dense_block_mask, flex_block_attention, tuned_options)

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def fwd_bwd(fn, go, *xs):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*xs)
    out.backward(go.to(out.dtype))
    return [out.detach()] + [x.grad for x in xs]


@pytest.mark.parametrize("head_dim", sorted(SM90_KERNEL_OPTIONS["drafter"]))
def test_drafter_options_compute_the_block_attention(head_dim):
    shape = BlockLayoutShape(batch=2, ctx_len=512, num_anchors=64, block_size=16)
    anchor, ctx_lo, valid = layout(shape, seed=5)
    mask = FlexBlockMask(shape, DEV)
    mask.update_(anchor, ctx_lo, valid)
    dense = dense_block_mask(anchor, ctx_lo, valid, shape.ctx_len, shape.block_size)
    torch.manual_seed(0)
    q = torch.randn(2, 8, shape.q_len, head_dim, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, 2, shape.kv_len, head_dim, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(2, 2, shape.kv_len, head_dim, device=DEV, dtype=torch.bfloat16)
    go = torch.randn_like(q)
    if HOPPER:
        assert tuned_options("drafter", q) == SM90_KERNEL_OPTIONS["drafter"][head_dim]
    got = fwd_bwd(lambda a, b, c: flex_block_attention(a, b, c, mask), go, q, k, v)
    low = fwd_bwd(lambda a, b, c: reference(a, b, c, dense), go, q, k, v)
    ref = fwd_bwd(lambda a, b, c: reference(a, b, c, dense), go, q.double(), k.double(), v.double())
    for name, g, lo, r in zip(["out", "dq", "dk", "dv"], got, low, ref):
        assert rel(g, r) <= max(2 * rel(lo, r), 1e-2), name


@pytest.mark.parametrize("head_dim", sorted(SM90_KERNEL_OPTIONS["target"]))
def test_target_options_compute_doc_causal_attention(head_dim):
    rows, seq = 2, 512
    doc_ids = torch.cat([torch.zeros(rows, 200), torch.ones(rows, seq - 200)], dim=1).to(DEV, torch.int32)
    block_mask = DocCausalMask(rows, seq, DEV).update_(doc_ids)
    torch.manual_seed(0)
    q = torch.randn(rows, 8, seq, head_dim, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(rows, 2, seq, head_dim, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if HOPPER:
        assert tuned_options("target", q) == SM90_KERNEL_OPTIONS["target"][head_dim]
    got = compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=True,
                                    kernel_options=tuned_options("target", q))
    pos = torch.arange(seq, device=DEV)
    dense = ((pos[None, :] <= pos[:, None]) & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    low = F.scaled_dot_product_attention(q, kk, vv, attn_mask=dense)
    ref = F.scaled_dot_product_attention(q.double(), kk.double(), vv.double(), attn_mask=dense)
    assert rel(got, ref) <= max(2 * rel(low, ref), 1e-2)


def test_bench_attention_times_the_trainer_choice(capsys):
    assert bench_attention(["--shape", "small", "--batch", "1", "--seq", "512", "--anchors", "32", "--reps", "2",
                            "--only", "tuned,f128x64s3w4,b64x64s3w4"]) == 0
    rows = [json.loads(line[5:]) for line in capsys.readouterr().out.splitlines() if line.startswith("ATTN {")]
    by = {(r["attention"], r["config"]): r for r in rows}
    assert {("drafter", "default"), ("drafter", "tuned"), ("drafter", "b64x64s3w4"), ("target", "tuned")} <= set(by)
    for r in rows:
        # the same attention and gradients, up to bf16 rounding in another summation order
        assert "error" not in r and r["fwd_ms"] > 0 and r["rel_diff_vs_default"] < 0.02, r
    assert all(r["bwd_ms"] > 0 for r in rows if r["attention"] == "drafter")
