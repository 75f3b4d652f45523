"""flex block attention against the dense-mask sdpa reference, and in-place mask updates under graph replay."""
import pytest
import torch
import torch.nn.functional as F

from trainer.model.flex import (SM90_KERNEL_OPTIONS, BlockLayoutShape, FlexBlockMask, dense_block_mask,
                                flex_block_attention, tuned_options)

pytestmark = pytest.mark.gpu
DEV = "cuda:0"


def layout(shape: BlockLayoutShape, seed: int):
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(shape.batch, shape.ctx_len - shape.block_size, generator=g)
    anchor = keys.topk(shape.num_anchors, dim=1).indices.sort(dim=1).values + 1
    ctx_lo = torch.zeros_like(anchor)
    ctx_lo[:, shape.num_anchors // 2 :] = anchor[:, shape.num_anchors // 2 - 1 : shape.num_anchors // 2]  # 2nd doc
    valid = torch.rand(shape.batch, shape.num_anchors, generator=g) > 0.1
    return anchor.to(DEV), ctx_lo.to(DEV), valid.to(DEV)


def reference(q, k, v, dense):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# Every head dim the trainer has measured kernel_options for (trainer.model.flex.SM90_KERNEL_OPTIONS): on Hopper
# those run here, elsewhere torch's defaults.
@pytest.mark.parametrize("head_dim", sorted({64, *SM90_KERNEL_OPTIONS["drafter"]}))
def test_flex_matches_sdpa_forward_and_backward(head_dim):
    shape = BlockLayoutShape(batch=2, ctx_len=512, num_anchors=64, block_size=16)
    anchor, ctx_lo, valid = layout(shape, seed=3)
    mask = FlexBlockMask(shape, DEV)
    mask.update_(anchor, ctx_lo, valid)
    dense = dense_block_mask(anchor, ctx_lo, valid, shape.ctx_len, shape.block_size)
    torch.manual_seed(0)
    q = torch.randn(2, 8, shape.q_len, head_dim, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, shape.kv_len, head_dim, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, shape.kv_len, head_dim, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(2, 8, shape.q_len, head_dim, device=DEV, dtype=torch.bfloat16)
    if torch.cuda.get_device_capability() == (9, 0):
        assert tuned_options("drafter", q) == SM90_KERNEL_OPTIONS["drafter"].get(head_dim)

    def fwd_bwd(fn, *xs):
        xs = [x.detach().clone().requires_grad_() for x in xs]
        out = fn(*xs)
        out.backward(go.to(out.dtype))
        return [out.detach()] + [x.grad for x in xs]

    got = fwd_bwd(lambda a, b, c: flex_block_attention(a, b, c, mask), q, k, v)
    low = fwd_bwd(lambda a, b, c: reference(a, b, c, dense), q, k, v)
    ref = fwd_bwd(lambda a, b, c: reference(a, b, c, dense), q.double(), k.double(), v.double())
    for name, g, lo, r in zip(["out", "dq", "dk", "dv"], got, low, ref):
        print(name, "flex", rel(g, r), "sdpa-bf16", rel(lo, r))
        assert rel(g, r) <= max(2 * rel(lo, r), 1e-2), name


def test_in_place_mask_update_is_seen_by_graph_replay():
    shape = BlockLayoutShape(batch=2, ctx_len=512, num_anchors=64, block_size=16)
    mask = FlexBlockMask(shape, DEV)
    a1, a2 = layout(shape, seed=1), layout(shape, seed=2)
    q = torch.randn(2, 8, shape.q_len, 64, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, 2, shape.kv_len, 64, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    static = [t.clone() for t in a1]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # compile + autotune outside the capture
            mask.update_(*static)
            flex_block_attention(q, k, v, mask)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        mask.update_(*static)  # the mask build itself is captured: device-side, no host sync
        out = flex_block_attention(q, k, v, mask)
    for lay in (a2, a1, a2):
        for dst, src in zip(static, lay):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        dense = dense_block_mask(*lay, shape.ctx_len, shape.block_size)
        want = reference(q.double(), k.double(), v.double(), dense)
        assert rel(out, want) < 1e-2
    other = reference(q.double(), k.double(), v.double(), dense_block_mask(*a1, shape.ctx_len, shape.block_size))
    assert rel(out, other) > 0.05  # layouts differ enough that a stale mask would be caught
