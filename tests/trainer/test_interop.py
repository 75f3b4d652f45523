"""The export loads, with strict=True, into a DFlash drafter written elsewhere -- SpecForge's `DFlashDraftModel`
(PyPI `specforge==0.2.0`, installed without its dependencies by .ci/run) -- and computes what the project's drafter
computes, in fp32, in the training layout (packed rows, anchors, the block mask) and in the inference layout (a
cached context, one block, no mask). Architecture deviations made the same way in training and in decoding (e.g.
the context keys without k_norm, the fused context without its RMSNorm) pass every in-house test; only this one can
see them."""
from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.conftest import make_state
from tests.trainer.test_traps import two_doc_batch
from trainer.decode.reference import DraftContextCache, draft_block_hidden
from trainer.export import ExportConfig, export_drafter, load_exported
from trainer.model.attention import dense_block_mask, make_layout
from trainer.model.loss import block_input_ids

B = 4


@pytest.fixture()
def exported(target, tmp_path):
    """A drafter with non-trivial weights (norm weights and biases away from their init), exported in fp32."""
    state = make_state(target, block_size=B, seed=3)
    with torch.no_grad():
        for p in state.drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export_drafter(tmp_path / "export", state.drafter, ExportConfig.of(state.drafter.cfg, target, B),
                   dtype=torch.float32)
    return state, tmp_path / "export"


def specforge_drafter(export_dir):
    from safetensors.torch import load_file
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(export_dir)
    config._attn_implementation = "sdpa"
    model = DFlashDraftModel(config).float().eval()
    missing, unexpected = model.load_state_dict(load_file(str(export_dir / "model.safetensors")), strict=True)
    assert not missing and not unexpected
    return model


def test_specforge_reads_the_dflash_fields(exported):
    state, export_dir = exported
    model = specforge_drafter(export_dir)
    assert model.target_layer_ids == list(state.target.layer_ids)
    assert model.mask_token_id == state.target.mask_token_id and model.block_size == B
    assert model.layer_types == ("full_attention",) * state.drafter.cfg.num_layers and model.sliding_window is None


def test_training_layout_equals_specforge(exported):
    state, export_dir = exported
    model = specforge_drafter(export_dir)
    t, batch = state.target, two_doc_batch()
    layout = make_layout(batch.position_ids, batch.doc_ids, batch.anchor_pos, batch.anchor_valid, B)
    feats = t.features(batch.input_ids, batch.position_ids, batch.doc_ids)
    noise = t.embed_tokens(block_input_ids(batch.input_ids, batch.anchor_pos, B, t.mask_token_id))
    with torch.no_grad():
        ours = state.drafter(feats, noise, layout)
        theirs = model(position_ids=torch.cat([layout.ctx_rope_pos, layout.q_rope_pos], dim=1),
                       attention_mask=dense_block_mask(layout), noise_embedding=noise, target_hidden=feats)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_inference_layout_equals_specforge(exported):
    state, export_dir = exported
    model = specforge_drafter(export_dir)
    t = state.target
    ids = torch.randint(10, 40, (1, 9), generator=torch.Generator().manual_seed(5))
    zeros = torch.zeros_like(ids)
    feats = t.features(ids, torch.arange(9)[None], zeros)  # the context: 9 tokens, all of one document
    block = torch.full((1, B), t.mask_token_id)
    block[0, 0] = 17  # the anchor (the last committed token)
    emb = t.embed_tokens(block)
    with torch.no_grad():
        ours = draft_block_hidden(state.drafter, DraftContextCache(len(state.drafter.layers)), feats, emb)
        theirs = model(position_ids=torch.arange(9 + B)[None], noise_embedding=emb, target_hidden=feats,
                       is_causal=False)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_the_export_round_trips_and_is_readable_by_another_user(exported):
    state, export_dir = exported
    config = json.loads((export_dir / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": state.drafter.cfg.rope_theta}
    assert config["dflash_config"]["mask_token"] == "<|MASK|>" and config["dflash_config"]["num_target_layers"] == 6
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in export_dir.iterdir())
    drafter, ecfg = load_exported(export_dir)
    assert ecfg == ExportConfig.from_json(config) and ecfg.mask_token == "<|MASK|>"
