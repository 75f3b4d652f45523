"""One test per correctness trap that silently gives tau ~ 1 (DFlash research notes, SpecForge PR 473)."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.conftest import make_state
from trainer.data.batching import StaticBatch
from trainer.errors import ConfigError
from trainer.model.attention import dense_block_mask, make_layout
from trainer.model.loss import block_input_ids, block_labels
from trainer.model.target import build_target_layer_ids, load_target, resolve_mask_token_id
from trainer.step.step import forward_backward, optimizer_step

B = 4


def two_doc_batch(S: int = 40, split: int = 16, vocab: int = 40, seed: int = 0) -> StaticBatch:
    """One row: doc 0 = [0, split), doc 1 = [split, S-4), then 4 padding tokens. Anchors in both docs + one pad."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (1, S), generator=g)
    doc = torch.full((1, S), -1)
    doc[0, :split] = 0
    doc[0, split:S - 4] = 1
    pos = torch.arange(S).unsqueeze(0).clone()
    pos[0, split:] -= split
    mask = doc >= 0
    anchors = torch.tensor([[3, 9, split + 2, split + 10, 0]])
    valid = torch.tensor([[True, True, True, True, False]])
    return StaticBatch(input_ids=ids, position_ids=pos, doc_ids=doc, loss_mask=mask, anchor_pos=anchors,
                       anchor_valid=valid)


def drafter_hidden(state, batch: StaticBatch, feats=None, noise=None) -> torch.Tensor:
    """-> [N, B, D] drafter outputs for row 0."""
    t = state.target
    if feats is None:
        feats = t.features(batch.input_ids, batch.position_ids, batch.doc_ids)
    if noise is None:
        noise = t.embed_tokens(block_input_ids(batch.input_ids, batch.anchor_pos, B, t.mask_token_id))
    layout = make_layout(batch.position_ids, batch.doc_ids, batch.anchor_pos, batch.anchor_valid, B)
    with torch.no_grad():
        h = state.drafter(feats, noise, layout)
    return h[0].view(batch.anchor_pos.shape[1], B, -1)


# ----------------------------------------------------------------- trap (a): same-position labels

def test_labels_are_same_position_and_position_zero_untrained():
    batch = two_doc_batch()
    labels, valid = block_labels(batch.input_ids, batch.doc_ids, batch.loss_mask, batch.anchor_pos,
                                 batch.anchor_valid, B)
    for n, a in enumerate(batch.anchor_pos[0].tolist()[:4]):
        for k in range(B):
            assert labels[0, n, k] == batch.input_ids[0, a + k]  # token AT anchor + k, not anchor + k + 1
    assert not valid[..., 0].any()
    assert valid[0, :4, 1:].all()
    assert not valid[0, 4].any()  # padded anchor


def test_labels_stop_at_document_end_and_unsupervised_tokens():
    batch = two_doc_batch()
    anchors = torch.tensor([[14, 9, 18, 22, 0]])  # 14: k=2,3 cross into doc 1
    lm = batch.loss_mask.clone()
    lm[0, 11] = False
    _, valid = block_labels(batch.input_ids, batch.doc_ids, lm, anchors, batch.anchor_valid, B)
    assert valid[0, 0].tolist() == [False, True, False, False]
    assert valid[0, 1].tolist() == [False, True, False, True]  # 9+2 = 11 is not supervised


# ----------------------------------------------------------------- trap (b): context strictly before the anchor

def test_mask_context_strictly_before_anchor():
    batch = two_doc_batch()
    layout = make_layout(batch.position_ids, batch.doc_ids, batch.anchor_pos, batch.anchor_valid, B)
    m = dense_block_mask(layout)[0, 0]  # [Q, S+Q]
    S = batch.input_ids.shape[1]
    a = 9  # anchor n=1 in doc 0
    rows = m[1 * B:(1 + 1) * B]
    assert rows[:, :a].all()  # every earlier doc-0 token
    assert not rows[:, a:S].any()  # the anchor itself and everything after: invisible


def test_perturbing_the_feature_at_the_anchor_changes_nothing(target):
    state = make_state(target, block_size=B)
    batch = two_doc_batch()
    feats = target.features(batch.input_ids, batch.position_ids, batch.doc_ids)
    base = drafter_hidden(state, batch, feats=feats)
    n, a = 1, 9
    at_anchor = feats.clone()
    at_anchor[0, a] += 5.0
    assert torch.equal(drafter_hidden(state, batch, feats=at_anchor)[n], base[n])
    before = feats.clone()
    before[0, a - 1] += 5.0
    assert not torch.allclose(drafter_hidden(state, batch, feats=before)[n], base[n])


# ----------------------------------------------------------------- trap (d): no attention across blocks / documents

def test_mask_blocks_and_documents_are_isolated():
    batch = two_doc_batch()
    layout = make_layout(batch.position_ids, batch.doc_ids, batch.anchor_pos, batch.anchor_valid, B)
    m = dense_block_mask(layout)[0, 0]
    S, N = batch.input_ids.shape[1], batch.anchor_pos.shape[1]
    blk = m[:, S:].view(N, B, N, B)
    for n in range(N):
        for j in range(N):
            assert blk[n, :, j, :].all() if n == j else not blk[n, :, j, :].any()
    doc1_rows = m[2 * B:4 * B, :S]
    assert not doc1_rows[:, :16].any()  # doc-1 blocks never see doc-0 context
    assert doc1_rows[0:B, 16:18].all() and not doc1_rows[0:B, 18:].any()
    pad_rows = m[4 * B:5 * B]
    assert not pad_rows[:, :S].any() and pad_rows.any(dim=1).all()  # padded anchor: own block only, no empty row


def test_perturbing_another_block_changes_nothing(target):
    state = make_state(target, block_size=B)
    batch = two_doc_batch()
    noise = target.embed_tokens(block_input_ids(batch.input_ids, batch.anchor_pos, B, target.mask_token_id))
    base = drafter_hidden(state, batch, noise=noise)
    other = noise.clone()
    other[0, 0:B] += 3.0  # block 0
    out = drafter_hidden(state, batch, noise=other)
    assert not torch.allclose(out[0], base[0])
    for n in range(1, 5):
        assert torch.equal(out[n], base[n])


def test_perturbing_another_document_changes_nothing_through_target_and_drafter(target):
    state = make_state(target, block_size=B)
    batch = two_doc_batch()
    base_feats = target.features(batch.input_ids, batch.position_ids, batch.doc_ids)
    base = drafter_hidden(state, batch)
    ids = batch.input_ids.clone()
    ids[0, :16] = torch.randint(10, 40, (16,), generator=torch.Generator().manual_seed(7))  # rewrite doc 0
    changed = StaticBatch(**{**batch.tensors(), "input_ids": ids})
    feats = target.features(changed.input_ids, changed.position_ids, changed.doc_ids)
    assert torch.equal(feats[0, 16:36], base_feats[0, 16:36])  # the target keeps documents apart
    out = drafter_hidden(state, changed)
    assert torch.equal(out[2], base[2]) and torch.equal(out[3], base[3])
    assert not torch.allclose(out[1], base[1])


def test_packed_document_features_equal_the_document_alone(target):
    batch = two_doc_batch()
    packed = target.features(batch.input_ids, batch.position_ids, batch.doc_ids)[0, 16:36]
    alone_ids = batch.input_ids[:, 16:36]
    alone = target.features(alone_ids, torch.arange(20)[None], torch.zeros(1, 20, dtype=torch.long))[0]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- trap (c): the target's embedding and LM head, frozen

def test_embedding_and_lm_head_are_the_targets_and_stay_frozen(target):
    state = make_state(target, block_size=B)
    emb, head = target.embed_tokens, target.lm_head
    assert emb is target.model.model.embed_tokens and head is target.model.lm_head
    assert head.weight is emb.weight  # tied target: the head IS the embedding (PR 473 trap)
    before_e, before_h = emb.weight.detach().clone(), head.weight.detach().clone()
    opt_params = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
    assert id(emb.weight) not in opt_params and id(head.weight) not in opt_params
    batch = two_doc_batch()
    for _ in range(3):
        forward_backward(state, batch)
        optimizer_step(state)
        state.optimizer.zero_grad(set_to_none=False)
    assert emb.weight.grad is None and head.weight.grad is None
    assert torch.equal(emb.weight, before_e) and torch.equal(head.weight, before_h)
    assert not any(p.requires_grad for p in target.model.parameters())
    assert all(p.grad is not None for p in state.drafter.parameters())


def test_untied_target_uses_its_own_lm_head(tmp_path):
    from trainer.tiny import build_tiny_target

    path = build_tiny_target(tmp_path / "untied", num_layers=6, tie_word_embeddings=False, train_steps=0)
    t = load_target(path, num_draft_layers=2)
    assert t.lm_head.weight is not t.embed_tokens.weight
    assert t.lm_head is t.model.lm_head


# ----------------------------------------------------------------- mask id validity

def test_mask_id_defaults_to_mask_token(target):
    assert target.tokenizer.convert_ids_to_tokens(target.mask_token_id) == "<|MASK|>"


@pytest.mark.parametrize("which, needle", [("eos", "is the (pad/)?eos token"), ("pad", "is the pad(/eos)? token"),
                                           ("big", "is not a row of the target embedding"),
                                           ("neg", "is not a row of the target embedding")])
def test_bad_mask_id_is_a_clear_error(target, which, needle):
    tok = target.tokenizer
    vocab = target.embed_tokens.weight.shape[0]
    bad = {"eos": tok.eos_token_id, "pad": tok.pad_token_id, "big": vocab, "neg": -1}[which]
    with pytest.raises(ConfigError, match=needle):
        resolve_mask_token_id(tok, vocab, bad)


def test_without_a_mask_token_the_first_spare_embedding_row_is_the_mask(capsys):
    """A tokenizer with no mask token (Qwen3's): the first row past its vocabulary, said in the log; with no spare
    row, the clear error."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<eos>": 1, "a": 2, "b": 3}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<unk>")),
                                  eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")
    assert resolve_mask_token_id(tok, 8, None) == 4
    assert "mask token: id 4, the first embedding row past the tokenizer's vocabulary" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="no spare row"):
        resolve_mask_token_id(tok, 4, None)


def test_bad_mask_id_stops_loading(tiny_target_dir):
    with pytest.raises(ConfigError, match="not a row"):
        load_target(tiny_target_dir, num_draft_layers=2, mask_token_id=10**6)


# ----------------------------------------------------------------- taps

def test_default_taps_follow_dflash_spacing():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]
    assert build_target_layer_ids(28, 1) == [14]


def test_taps_are_layer_outputs_and_decoder_is_truncated(target, full_target):
    assert target.layer_ids == (1, 3) and len(target.model.model.layers) == 4
    assert len(full_target.model.model.layers) == 6
    ids = torch.randint(10, 40, (1, 12))
    pos = torch.arange(12)[None]
    ref = full_target.model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = target.features(ids, pos, torch.zeros(1, 12, dtype=torch.long))
    torch.testing.assert_close(feats, torch.cat([ref[2], ref[4]], dim=-1), rtol=1e-5, atol=1e-5)


def test_ctx_lo_form_of_the_rule_equals_the_doc_id_form():
    """The flex backend uses [ctx_lo, anchor); it must select exactly the same context keys as the doc-id rule."""
    batch = two_doc_batch()
    layout = make_layout(batch.position_ids, batch.doc_ids, batch.anchor_pos, batch.anchor_valid, B)
    assert layout.ctx_lo[0, :4].tolist() == [0, 0, 16, 16]
    S = batch.input_ids.shape[1]
    j = torch.arange(S)
    by_range = (j >= layout.ctx_lo[0, :, None]) & (j < batch.anchor_pos[0, :, None]) & batch.anchor_valid[0, :, None]
    dense = dense_block_mask(layout)[0, 0, ::B, :S]  # one query row per block
    assert torch.equal(by_range, dense)


# ----------------------------------------------------------------- traps a mutation run found unguarded

def test_the_block_holds_the_anchor_token_then_masks():
    """Block position 0 is the anchor's real token (the verifier's last committed token), never MASK."""
    batch = two_doc_batch()
    blocks = block_input_ids(batch.input_ids, batch.anchor_pos, B, 99).view(1, -1, B)
    assert torch.equal(blocks[:, :, 0], batch.input_ids.gather(1, batch.anchor_pos))
    assert (blocks[:, :, 1:] == 99).all()


def test_no_anchor_candidate_crosses_a_document_boundary():
    from trainer.data.anchors import anchor_candidates

    lm = torch.ones(1, 6, dtype=torch.bool)  # every token supervised: only the documents separate them
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert anchor_candidates(lm, doc)[0].tolist() == [True, True, False, True, True, False]


def test_anchors_are_resampled_every_epoch_for_the_same_row():
    """The same packed row, met in two epochs, gets new anchors (not only a new position in the shuffle)."""
    from trainer.data.batching import EpochBatches
    from trainer.data.packing import pack
    from trainer.data.source import Sample

    samples = [Sample(input_ids=torch.arange(40) + 100 * i, loss_mask=torch.ones(40, dtype=torch.bool))
               for i in range(6)]
    batches = EpochBatches(pack(samples, 40, pad_id=0), 1, 8, seed=0, pad_id=0)

    def anchors_by_row(epoch: int) -> dict[int, list[int]]:
        out = {}
        for i in range(batches.per_epoch):
            b = batches.batch(epoch * batches.per_epoch + i)
            out[int(b.input_ids[0, 0])] = b.anchor_pos[0].tolist()
        return out

    first, second = anchors_by_row(0), anchors_by_row(1)
    assert first.keys() == second.keys() and len(first) == 6
    assert sum(first[k] != second[k] for k in first) >= 5  # 8 of 39 candidates: a repeat is a ~1e-8 event
    # One row: it sits at the same place in every epoch, so only the epoch can change its anchors.
    one = EpochBatches(pack(samples[:1], 40, pad_id=0), 1, 8, seed=0, pad_id=0)
    assert len({tuple(one.batch(e).anchor_pos[0].tolist()) for e in range(4)}) == 4


@pytest.mark.parametrize("edge", [-1, 0, 1])
def test_flex_tile_tables_at_tile_edges_match_the_dense_rule(edge):
    """Anchors and document starts exactly at, one before and one after tile edges: a context tile is full only
    when every key of it is visible (a tile marked full one position early would attend to the anchor itself)."""
    from tests.trainer.tiles import assert_tiles_match
    from trainer.model.flex import BlockLayoutShape, dense_block_mask, tile_states

    shape = BlockLayoutShape(batch=1, ctx_len=384, num_anchors=16, block_size=16)
    base = [128, 129, 130, 250, 256, 256, 300, 383, 128, 200, 255, 256, 257, 300, 380, 383]
    anchor = torch.tensor([sorted(max(1, min(383, a + edge)) for a in base)])
    ctx_lo = torch.zeros_like(anchor)
    ctx_lo[0, 8:] = 128 + edge  # a second document starting at a tile edge
    ctx_lo = torch.minimum(ctx_lo, anchor - 1)
    valid = torch.ones_like(anchor, dtype=torch.bool)
    partial, full = tile_states(anchor, ctx_lo, valid, shape)
    dense = dense_block_mask(anchor, ctx_lo, valid, shape.ctx_len, shape.block_size)[:, 0]
    assert_tiles_match(partial, full, dense, shape.tile)
