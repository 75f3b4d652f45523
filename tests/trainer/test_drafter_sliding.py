"""Sliding-window drafter layers (`model.draft_layer_types`, `model.draft_sliding_window`): the reference rule (a
query at anchor + k sees the W positions ending at itself: causal inside its block), the same in the dense mask,
the flex tile tables and mask_mod, the training forward, both decoders, the export -- and against SpecForge's
implementation of the rule and of the model."""
from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.test_traps import two_doc_batch
from tests.trainer.tiles import assert_tiles_match
from trainer.decode.reference import DraftContextCache, draft_block_hidden
from trainer.decode.static_draft import StaticDFlashProposer
from trainer.export import ExportConfig, export_drafter, load_exported
from trainer.model.attention import FULL, SLIDING, dense_block_mask, make_layout, mask_of
from trainer.model.drafter import Drafter, DrafterConfig
from trainer.model.flex import BlockLayoutShape, FlexBlockMask, tile_states
from trainer.model.flex import dense_block_mask as flex_dense_mask
from trainer.model.loss import block_input_ids

B, W = 4, 6
KINDS = (SLIDING, FULL)


def sliding_drafter(target, seed: int = 3) -> Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(target.hf_config, num_layers=2, num_taps=len(target.layer_ids),
                                    layer_types=KINDS, sliding_window=W)
    drafter = Drafter(cfg).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return drafter


def test_the_dense_rule_is_specforges():
    from specforge.algorithms.common.dflash_family_model import create_dflash_sdpa_mask

    S, N = 40, 5
    anchor = torch.tensor([[3, 9, 17, 25, 33]])
    layout = make_layout(torch.arange(S)[None], torch.zeros(1, S, dtype=torch.long), anchor,
                         torch.ones(1, N, dtype=torch.bool), B)
    ours = dense_block_mask(layout, W)
    theirs = create_dflash_sdpa_mask(anchor, torch.ones(1, N, dtype=torch.bool), S, B, "cpu", sliding_window=W)
    assert torch.equal(ours, theirs)
    assert not torch.equal(dense_block_mask(layout), theirs)  # the window matters here


@pytest.mark.parametrize("window", [None, 1, 5, 16, 100, 128, 129, 300])  # None: the full-attention rule
def test_flex_tables_and_mask_mod_follow_the_sliding_rule(window):
    shape = BlockLayoutShape(batch=1, ctx_len=384, num_anchors=16, block_size=16)
    base = [127, 128, 129, 130, 200, 250, 255, 256, 257, 260, 300, 320, 340, 360, 380, 383]
    anchor = torch.tensor([base])
    ctx_lo = torch.zeros_like(anchor)
    ctx_lo[0, 8:] = 129
    valid = torch.ones_like(anchor, dtype=torch.bool)
    valid[0, 3] = False
    dense = flex_dense_mask(anchor, ctx_lo, valid, shape.ctx_len, shape.block_size, window)[:, 0]
    assert_tiles_match(*tile_states(anchor, ctx_lo, valid, shape, window), dense, shape.tile)
    fbm = FlexBlockMask(shape, "cpu", window)
    fbm.update_(anchor, ctx_lo, valid)
    b, qi, kv = torch.meshgrid(torch.arange(1), torch.arange(shape.q_len), torch.arange(shape.kv_len), indexing="ij")
    assert torch.equal(fbm.block_mask.mask_mod(b, None, qi, kv), dense)
    fbm.update_(anchor, ctx_lo, torch.ones_like(valid))  # the same buffers, rewritten: block 3 sees its context again
    again = flex_dense_mask(anchor, ctx_lo, torch.ones_like(valid), shape.ctx_len, shape.block_size, window)[:, 0]
    assert torch.equal(fbm.block_mask.mask_mod(b, None, qi, kv), again)
    assert window == 1 or not torch.equal(again, dense)  # a window of 1 shows no block any context


def test_the_layout_carries_one_mask_per_kind_and_each_layer_takes_its_own(target):
    batch = two_doc_batch()
    layout = make_layout(batch.position_ids, batch.doc_ids, batch.anchor_pos, batch.anchor_valid, B, window=W)
    assert torch.equal(mask_of(layout, FULL), dense_block_mask(layout))
    assert torch.equal(mask_of(layout, SLIDING), dense_block_mask(layout, W))
    assert [layer.kind for layer in sliding_drafter(target).layers] == list(KINDS)


def test_both_decoders_equal_the_training_forward(full_target):
    """One anchor at S with every earlier position as context: Drafter.forward (training layout, the sliding mask),
    the reference decoder's cached draft (two rounds), and the static proposer's draft agree."""
    drafter = sliding_drafter(full_target)
    T_D = len(full_target.layer_ids) * full_target.hf_config.hidden_size
    S = 11
    torch.manual_seed(1)
    feats = torch.randn(1, S + B, T_D)
    anchor = torch.tensor([17])
    block = full_target.embed_tokens(torch.cat([anchor, torch.full((B - 1,), full_target.mask_token_id)]))[None]
    layout = make_layout(torch.arange(S + 1)[None], torch.zeros(1, S + 1, dtype=torch.long), torch.tensor([[S]]),
                         torch.tensor([[True]]), B, window=W)
    want = drafter(feats[:, :S + 1], block, layout)
    cache = DraftContextCache(len(drafter.layers))
    draft_block_hidden(drafter, cache, feats[:, :5], block)
    got_ref = draft_block_hidden(drafter, cache, feats[:, 5:S], block)
    proposer = StaticDFlashProposer(full_target, drafter, B, slots=32)
    proposer.reset(feats[:, :S])
    proposer.append(feats[:, S:S + B] * 3, torch.tensor(S + B))  # stale slots past the block stay invisible
    got_static = proposer.draft_hidden(anchor, torch.tensor(S))
    torch.testing.assert_close(got_ref, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_static, want, rtol=1e-5, atol=1e-5)
    full = Drafter(DrafterConfig.from_target(full_target.hf_config, num_layers=2, num_taps=2))
    full.load_state_dict(drafter.state_dict())
    assert not torch.allclose(full(feats[:, :S + 1], block, make_layout(
        torch.arange(S + 1)[None], torch.zeros(1, S + 1, dtype=torch.long), torch.tensor([[S]]),
        torch.tensor([[True]]), B)), want, atol=1e-4)  # the window changes the result: the comparison can fail


def test_the_export_carries_the_layout_and_specforge_computes_the_same(target, tmp_path):
    from safetensors.torch import load_file
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import AutoConfig

    drafter = sliding_drafter(target)
    export_drafter(tmp_path / "export", drafter, ExportConfig.of(drafter.cfg, target, B), dtype=torch.float32)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["layer_types"] == list(KINDS) and config["sliding_window"] == W and config["use_sliding_window"]
    loaded, ecfg = load_exported(tmp_path / "export")
    assert ecfg.drafter == drafter.cfg and [layer.kind for layer in loaded.layers] == list(KINDS)
    hf = AutoConfig.from_pretrained(tmp_path / "export")
    hf._attn_implementation = "sdpa"
    theirs = DFlashDraftModel(hf).float().eval()
    theirs.load_state_dict(load_file(str(tmp_path / "export" / "model.safetensors")), strict=True)
    assert theirs.layer_types == KINDS and theirs.sliding_window == W
    batch = two_doc_batch()
    layout = make_layout(batch.position_ids, batch.doc_ids, batch.anchor_pos, batch.anchor_valid, B, window=W)
    feats = target.features(batch.input_ids, batch.position_ids, batch.doc_ids)
    noise = target.embed_tokens(block_input_ids(batch.input_ids, batch.anchor_pos, B, target.mask_token_id))
    with torch.no_grad():
        ours = drafter(feats, noise, layout)
        got = theirs(position_ids=torch.cat([layout.ctx_rope_pos, layout.q_rope_pos], dim=1),
                     attention_mask={FULL: mask_of(layout, FULL), SLIDING: mask_of(layout, SLIDING)},
                     noise_embedding=noise, target_hidden=feats)
    torch.testing.assert_close(got, ours, atol=1e-5, rtol=1e-5)


def test_the_config_names_a_bad_layer_layout():
    from trainer.config import load_config
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="draft_sliding_window"):
        load_config("smoke", ["model.num_draft_layers=2", "model.draft_layer_types=[sliding_attention, full_attention]"])
    with pytest.raises(ConfigError, match="for each of the 2 draft layers"):
        load_config("smoke", ["model.num_draft_layers=2", "model.draft_layer_types=[full_attention]"])


def test_a_run_with_sliding_layers_trains_exports_and_evaluates(tiny_target_dir, tmp_path):
    from tests.trainer.conftest import small_cfg
    from trainer.build import build
    from trainer.loop import TrainLoop
    from trainer.train import finish

    cfg = small_cfg(tiny_target_dir, "model.num_draft_layers=2", "model.draft_layer_types=[sliding_attention, "
                    "full_attention]", "model.draft_sliding_window=8", "optim.max_steps=2", "eval_at_end=true")
    session = build(cfg, tmp_path / "run")
    loop = TrainLoop(session)
    result = finish(session, loop, loop.run())
    assert session.state.drafter.cfg.window == 8 and 1.0 <= result.tau <= cfg.model.block_size
    exported = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert exported["layer_types"] == [SLIDING, FULL] and exported["sliding_window"] == 8
