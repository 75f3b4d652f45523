"""The target's doc-causal flex fast path (trainer/model/doc_attention.py) against the dense sdpa reference."""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.trainer.tiles import assert_tiles_match
from trainer.model.doc_attention import DocCausalMask, doc_tile_states
from trainer.model.target import load_target, packed_causal_mask

TILE = 128


def packed_doc_ids(lengths_per_row: list[list[int]], seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of contiguous documents (ids 0, 1, ...) then padding (-1); positions restart per document."""
    doc = torch.full((len(lengths_per_row), seq), -1, dtype=torch.long)
    pos = torch.arange(seq).repeat(len(lengths_per_row), 1)
    for r, lengths in enumerate(lengths_per_row):
        at = 0
        for d, n in enumerate(lengths):
            doc[r, at:at + n] = d
            pos[r, at:at + n] = torch.arange(n)
            at += n
    return doc, pos


ROWS = [[384], [100, 28, 200, 56], [128, 128, 100], [5, 300]]  # one doc; mid-tile cuts; tile-aligned; padding tail


@pytest.mark.parametrize("window", [None, 5, 127, 128, 129, 200, 256, 300])
def test_tile_tables_never_drop_a_visible_pair_and_skip_only_invisible_tiles(window):
    """Tile edges included: windows just under, at and over one and two tiles."""
    doc, _ = packed_doc_ids(ROWS, 384)
    partial, full = doc_tile_states(doc, TILE, window)
    dense = packed_causal_mask(doc, window)[:, 0]  # [R, S, S]
    assert_tiles_match(partial, full, dense, TILE)
    if window is None:
        assert full[0, 0].sum() == 3 and partial[0, 0].sum() == 3  # one document: causal tiles only


@pytest.fixture(scope="module")
def targets(tiny_target_dir):
    ref = load_target(tiny_target_dir, num_draft_layers=2, dtype="float32")
    fast = load_target(tiny_target_dir, num_draft_layers=2, dtype="float32", attn="flex")
    return ref, fast


def test_flex_features_equal_the_dense_reference_and_follow_each_new_batch(targets):
    ref, fast = targets
    vocab = ref.embed_tokens.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    for rows in (ROWS, [[200, 184], [384], [50, 50, 50, 50], [383]]):  # the same static mask, rewritten in place
        doc, pos = packed_doc_ids(rows, 384)
        ids = torch.randint(0, vocab, doc.shape, generator=g)
        want = ref.features(ids, pos, doc)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex on CPU warns that it is the unfused reference
            got = fast.features(ids, pos, doc)
        assert got.shape == want.shape == (4, 384, 2 * ref.hf_config.hidden_size)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert len(fast._doc_masks) == 1  # one static mask per shape


def test_rows_not_a_multiple_of_the_tile_use_the_reference_mask(targets):
    _, fast = targets
    doc, _ = packed_doc_ids([[50, 46]], 96)
    assert isinstance(fast.attention_mask(doc), torch.Tensor)


def test_doc_causal_mask_refuses_a_wrong_shape():
    mask = DocCausalMask(2, 256, "cpu")
    with pytest.raises(ValueError, match="expected"):
        mask.update_(torch.zeros(2, 128, dtype=torch.long))


@pytest.mark.slow
def test_compiled_target_layers_take_the_block_mask_and_follow_new_layouts(tiny_target_dir, targets):
    """What step.mode=compile does to the target (trainer.step.policy.compile_step): every kept decoder layer
    torch.compile'd, tap hooks traced along, the BlockMask an input (no recompile for a new layout)."""
    ref, _ = targets
    fast = load_target(tiny_target_dir, num_draft_layers=2, dtype="float32", attn="flex")
    for layer in fast.model.model.layers:
        layer.compile(dynamic=False)
    vocab = ref.embed_tokens.weight.shape[0]
    for rows in ([[100, 28, 128], [256]], [[256], [10, 246]]):
        doc, pos = packed_doc_ids(rows, 256)
        ids = torch.randint(0, vocab, doc.shape)
        torch.testing.assert_close(fast.features(ids, pos, doc), ref.features(ids, pos, doc), atol=2e-5, rtol=1e-4)


def test_sliding_window_flex_features_equal_the_dense_reference(tmp_path):
    """A sliding-window family (Qwen2, window 4 on its upper layers) through the flex path: the windowed BlockMask
    gives HF's features."""
    from tests.trainer.families import build_family_target

    path = build_family_target(tmp_path / "qwen2", "qwen2")
    ref = load_target(path, num_draft_layers=2, layer_ids=(1, 3), dtype="float32")
    fast = load_target(path, num_draft_layers=2, layer_ids=(1, 3), dtype="float32", attn="flex")
    doc, pos = packed_doc_ids([[100, 28, 128], [256]], 256)
    ids = torch.randint(0, ref.embed_tokens.weight.shape[0], doc.shape, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fast.features(ids, pos, doc)
    torch.testing.assert_close(got, ref.features(ids, pos, doc), atol=2e-5, rtol=1e-4)
    assert {key[3] for key in fast._doc_masks} == {None, 4}  # one static mask per kind of layer
