"""Pure (CPU) checks of the flex tile tables and the input validation of StepGraph. Runs in CI (no gpu mark)."""
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from trainer.model.flex import BlockLayoutShape, FlexBlockMask, dense_block_mask
from trainer.step.graph import InputSpec, check_inputs


def random_layout(shape: BlockLayoutShape, seed: int):
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(shape.batch, shape.ctx_len - shape.block_size, generator=g)
    anchor = keys.topk(shape.num_anchors, dim=1).indices.sort(dim=1).values + 1
    ctx_lo = torch.zeros_like(anchor)
    ctx_lo[0, shape.num_anchors // 2 :] = anchor[0, shape.num_anchors // 2 - 1]
    valid = torch.rand(shape.batch, shape.num_anchors, generator=g) > 0.2
    return anchor, ctx_lo, valid


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tile_tables_match_create_block_mask(seed):
    shape = BlockLayoutShape(batch=2, ctx_len=384, num_anchors=32, block_size=16)
    anchor, ctx_lo, valid = random_layout(shape, seed)
    fbm = FlexBlockMask(shape, "cpu")
    fbm.update_(anchor, ctx_lo, valid)
    dense = dense_block_mask(anchor, ctx_lo, valid, shape.ctx_len, shape.block_size)
    ref = create_block_mask(
        lambda b, h, q, kv: dense[b, 0, q, kv], shape.batch, None, shape.q_len, shape.kv_len, device="cpu"
    )
    got = fbm.block_mask
    assert torch.equal(got.to_dense(), ref.to_dense())
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    # The mask_mod reads the same static buffers: evaluated densely it reproduces the reference rule.
    b, q, kv = torch.meshgrid(
        torch.arange(shape.batch), torch.arange(shape.q_len), torch.arange(shape.kv_len), indexing="ij"
    )
    assert torch.equal(got.mask_mod(b, None, q, kv), dense[:, 0])


def test_update_is_in_place():
    shape = BlockLayoutShape(batch=1, ctx_len=256, num_anchors=16, block_size=16)
    fbm = FlexBlockMask(shape, "cpu")
    ptrs = [fbm.block_mask.kv_indices.data_ptr(), fbm.anchor.data_ptr(), fbm.block_mask.full_q_indices.data_ptr()]
    before = fbm.block_mask.to_dense().clone()
    early = torch.arange(1, 17).view(1, 16)  # every anchor in the first tile: no full context tile any more
    fbm.update_(early, torch.zeros_like(early), torch.ones(1, 16, dtype=torch.bool))
    assert ptrs == [fbm.block_mask.kv_indices.data_ptr(), fbm.anchor.data_ptr(), fbm.block_mask.full_q_indices.data_ptr()]
    assert not torch.equal(before, fbm.block_mask.to_dense())


def test_layout_shape_rejects_straddling_tiles():
    with pytest.raises(ValueError, match="multiples of tile"):
        BlockLayoutShape(batch=1, ctx_len=300, num_anchors=16, block_size=16)


def test_check_inputs_names_the_bad_field():
    specs = {"x": InputSpec((2, 3), torch.float32, torch.device("cuda:0"))}
    with pytest.raises(ValueError, match="'x'.*captured for"):
        check_inputs(specs, {"x": torch.empty(2, 4)})
    with pytest.raises(ValueError, match="missing \\['x'\\]"):
        check_inputs(specs, {"y": torch.empty(2, 3)})
    with pytest.raises(ValueError, match="float64"):
        check_inputs(specs, {"x": torch.empty(2, 3, dtype=torch.float64)})
    check_inputs(specs, {"x": torch.empty(2, 3)})  # a host tensor is fine: the copy into the buffer is explicit


def test_flex_layout_hook_matches_the_trainer_rule():
    """build_block_mask (the flex mask_fn) reproduces trainer.model.attention.dense_block_mask on packed rows."""
    from trainer.model import flex
    from trainer.model.attention import dense_block_mask as trainer_dense, make_layout

    g = torch.Generator().manual_seed(7)
    r, s, n, bs = 2, 256, 16, 16
    doc_ids = torch.zeros(r, s, dtype=torch.long)
    doc_ids[0, 100:] = 1
    doc_ids[0, 200:] = 2
    doc_ids[1, 60:] = 1
    doc_ids[1, 240:] = -1  # padding tail
    position_ids = torch.zeros_like(doc_ids)
    for row in range(r):
        for d in doc_ids[row].unique():
            sel = doc_ids[row] == d
            position_ids[row, sel] = torch.arange(int(sel.sum()))
    anchor = torch.stack([torch.randperm(230, generator=g)[:n].sort().values + 1 for _ in range(r)])
    valid = torch.ones(r, n, dtype=torch.bool)
    valid[1, -3:] = False
    anchor[1, -3:] = 0  # padded anchors point at 0 (StaticBatch convention)
    layout = make_layout(position_ids, doc_ids, anchor, valid, bs, backend="flex", mask_fn=flex.build_block_mask)
    got = layout.mask
    want = trainer_dense(layout)
    assert torch.equal(got.to_dense(), create_block_mask(
        lambda b, h, q, kv: want[b, 0, q, kv], r, None, n * bs, s + n * bs, device="cpu").to_dense())
    b, q, kv = torch.meshgrid(torch.arange(r), torch.arange(n * bs), torch.arange(s + n * bs), indexing="ij")
    assert torch.equal(got.mask_mod(b, None, q, kv), want[:, 0])
    assert got is flex.static_mask_for(flex.BlockLayoutShape(r, s, n, bs), torch.device("cpu")).block_mask


def test_doc_start_fallback_equals_the_trainer_ctx_lo():
    from trainer.model.attention import make_layout
    from trainer.model.flex import doc_start_of_anchor

    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 10 + [-1] * 6])
    position_ids = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)]).view(1, -1)
    position_ids = torch.cat([position_ids, torch.cat([torch.arange(10), torch.zeros(6, dtype=torch.long)])[None]])
    anchor = torch.tensor([[1, 6, 11, 13], [2, 4, 9, 0]])
    valid = torch.tensor([[True] * 4, [True, True, True, False]])
    layout = make_layout(position_ids, doc_ids, anchor, valid, 4, backend="sdpa")
    got = doc_start_of_anchor(doc_ids, anchor)
    assert got.tolist() == [[0, 5, 5, 12], [0, 0, 0, 0]]
    assert torch.equal(got[valid], layout.ctx_lo[valid])
