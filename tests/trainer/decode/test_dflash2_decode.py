"""Speculative decoding with a DFlash2 drafter (trainer/decode/drafters/dflash2.py) is lossless and proposes what the
serving stacks' greedy walk proposes: the selector's walk on a hand-computed example, the block forward with its
convolutions against the training forward, the static proposer against the reference proposer round by round, and
greedy output equal to the target's alone, token for token, through both engines.

Real components only: the session's tiny Qwen3 target and the tiny family targets (saved to disk, loaded through
`load_target`) and real DFlash2 `Drafter`s, fresh (convolutions the identity, selector transition 0) or perturbed
(every convolution, codebook and projection away from its init, so each changes the drafts).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.trainer.decode.test_reference import PROMPTS, _prompt_ids
from trainer.decode.decoders import decoders
from trainer.decode.drafters.dflash2 import StaticDFlash2Proposer, select_drafts, unary_candidates
from trainer.decode.engine import StaticDecoder
from trainer.decode.reference import (DFlashProposer, DraftContextCache, draft_block_hidden, generate_speculative,
                                      generate_target_only)
from trainer.model.attention import make_layout
from trainer.model.drafter import Dflash2Config, Drafter, DrafterConfig
from trainer.model.dynconv import GroupedDynamicConv

TRAINED_BLOCK = 4


def dflash2_drafter(target, seed: int = 0, *, perturb: bool = False, taps: int = 3, top_k: int = 8,
                    **transform) -> Drafter:
    """A DFlash2 drafter over `target` (trained block 4, `taps` conv taps, groups of 16 channels, rank 8). perturb:
    linears ~N(0, 0.3) (drafts that depend on the context), the convolutions' base kernels ~N(0, 0.5) and
    projections ~N(0, 0.1) (no longer the identity), both codebooks ~N(0, 1) (a transition that reorders the
    candidates)."""
    torch.manual_seed(seed)
    d2 = Dflash2Config(block_size=TRAINED_BLOCK, vocab_size=target.embed_tokens.weight.shape[0],
                       conv_kernel_size=taps, conv_group_size=16, selector_rank=8, selector_top_k=top_k, **transform)
    cfg = DrafterConfig.from_target(target.hf_config, num_layers=2, num_taps=len(target.layer_ids), dflash2=d2)
    drafter = Drafter(cfg).eval()
    if perturb:
        with torch.no_grad():
            for module in drafter.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, 0.3)
            for module in drafter.modules():
                if isinstance(module, GroupedDynamicConv):
                    module.base_kernel.normal_(0.0, 0.5)
                    module.kernel_projection.weight.normal_(0.0, 0.1)
            drafter.candidate_selector.predecessor_codebook.normal_(0.0, 1.0)
            drafter.candidate_selector.successor_codebook.normal_(0.0, 1.0)
    return drafter


# ------------------------------------------------------------------------------------------ the selector's walk

def _walk_drafter(**transform) -> Drafter:
    """A one-rank selector over a vocabulary of 4 whose transition is A[p] * B[c] (hidden projection reads channel 0,
    the hidden state is e_0): A = [1, -1, 2, 0], B = [0, 1, -1, 2]."""
    d2 = Dflash2Config(block_size=4, vocab_size=4, conv_kernel_size=1, conv_group_size=8, selector_rank=1,
                       selector_top_k=2, **transform)
    cfg = DrafterConfig(hidden_size=8, intermediate_size=16, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                        num_layers=1, num_taps=1, rms_norm_eps=1e-6, rope_theta=10000.0, dflash2=d2)
    drafter = Drafter(cfg).eval()
    sel = drafter.candidate_selector
    with torch.no_grad():
        sel.hidden_projection.weight.zero_()
        sel.hidden_projection.weight[0, 0] = 1.0
        sel.predecessor_codebook.copy_(torch.tensor([[1.0], [-1.0], [2.0], [0.0]]))
        sel.successor_codebook.copy_(torch.tensor([[0.0], [1.0], [-1.0], [2.0]]))
    return drafter


# Head logits at the 3 mask positions; their top 2: position 0 {1: 1.0, 2: 0.5}, 1 {3: 0.5, 1: 0.2},
# 2 {3: 0.3, 2: 0.0}. The anchor is token 0.
WALK_LOGITS = torch.tensor([[-9.0, 1.0, 0.5, -9.0], [-9.0, 0.2, -9.0, 0.5], [-9.0, -9.0, 0.0, 0.3]])


@pytest.mark.parametrize("transform, path", [
    # score(c | p) = u(c) + A[p] B[c]:
    #   0: after 0 (A = 1):  1 -> 1.0 + 1 = 2.0,  2 -> 0.5 - 1 = -0.5             => 1
    #   1: after 1 (A = -1): 3 -> 0.5 - 2 = -1.5, 1 -> 0.2 - 1 = -0.8             => 1  (the unary argmax is 3)
    #   2: after 1 (A = -1): 3 -> 0.3 - 2 = -1.7, 2 -> 0.0 + 1 = 1.0              => 2  (after 3, A = 0, it is 3)
    ({}, [1, 1, 2]),
    # unary x 4: 0: 4 + 1 = 5 vs 2 - 1 = 1 => 1; 1: 2 - 2 = 0 vs 0.8 - 1 = -0.2 => 3; 2 after 3 (A = 0): 1.2 vs 0 => 3
    ({"output_multiplier": 4.0}, [1, 3, 3]),
    # then tanh(x / 1) * 1: 0: tanh 4 + 1 vs tanh 2 - 1 => 1; 1: tanh 2 - 2 = -1.04 vs tanh 0.8 - 1 = -0.34 => 1;
    # 2 after 1: tanh 1.2 - 2 = -1.17 vs 0 + 1 => 2
    ({"output_multiplier": 4.0, "final_logit_softcapping": 1.0}, [1, 1, 2]),
])
def test_the_selector_walks_the_block_greedily_as_computed_by_hand(transform, path):
    drafter = _walk_drafter(**transform)
    hidden = torch.zeros(3, 8)
    hidden[:, 0] = 1.0
    got = select_drafts(drafter, WALK_LOGITS, hidden, torch.tensor([0]))
    assert got.tolist() == path
    assert WALK_LOGITS.argmax(-1).tolist() == [1, 3, 3]  # the unary proposal, for contrast


def test_the_candidates_are_the_raw_top_k_with_transformed_values():
    cand, unary = unary_candidates(WALK_LOGITS, _walk_drafter(output_multiplier=4.0,
                                                              final_logit_softcapping=1.0).cfg.dflash2)
    assert cand.tolist() == [[1, 2], [3, 1], [3, 2]]
    torch.testing.assert_close(unary, torch.tanh(4.0 * torch.tensor([[1.0, 0.5], [0.5, 0.2], [0.3, 0.0]])))


# ------------------------------------------------------------------------------------------ the block forward

def test_cached_block_draft_equals_the_training_forward(full_target):
    """draft_block_hidden (context K/V cached over two rounds, the convolutions over the block) == Drafter.forward
    with the training layout, for a perturbed DFlash2 drafter; and the convolutions matter (the same weights with
    identity convolutions give another hidden state)."""
    drafter = dflash2_drafter(full_target, seed=3, perturb=True)
    T_D = len(full_target.layer_ids) * full_target.hf_config.hidden_size
    S, B = 11, TRAINED_BLOCK
    torch.manual_seed(1)
    feats = torch.randn(1, S + 1, T_D)
    block = torch.randn(1, B, full_target.hf_config.hidden_size)
    cache = DraftContextCache(len(drafter.layers))
    draft_block_hidden(drafter, cache, feats[:, :5], block)
    got = draft_block_hidden(drafter, cache, feats[:, 5:S], block)
    pos = torch.arange(S + 1)[None]
    layout = make_layout(pos, torch.zeros(1, S + 1, dtype=torch.long), torch.tensor([[S]]), torch.tensor([[True]]), B)
    torch.testing.assert_close(got, drafter(feats, block, layout), rtol=1e-5, atol=1e-5)
    for module in drafter.modules():
        if isinstance(module, GroupedDynamicConv):
            module.reset_parameters()
    plain = draft_block_hidden(drafter, DraftContextCache(len(drafter.layers)), feats[:, :S], block)
    assert (plain - got).abs().max() > 1e-2


def test_static_block_under_bf16_autocast_equals_the_reference(full_target):
    """The CUDA arithmetic (bf16 autocast, bf16 copies of the linears: the convolutions' and the selector's
    projections too) on CPU's autocast: the block's hidden states equal the reference's under the same autocast
    within bf16 rounding, and the round still decodes the target's own output."""
    B, S = TRAINED_BLOCK, 9
    drafter = dflash2_drafter(full_target, seed=4, perturb=True)
    T_D = len(full_target.layer_ids) * full_target.hf_config.hidden_size
    torch.manual_seed(2)
    feats = torch.randn(1, S, T_D)
    anchor = torch.tensor([17])
    block = full_target.embed_tokens(torch.cat([anchor, torch.full((B - 1,), full_target.mask_token_id)]))[None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = draft_block_hidden(drafter, DraftContextCache(len(drafter.layers)), feats, block)
    proposer = StaticDFlash2Proposer(full_target, drafter, B, 32, autocast=True)
    assert proposer.drafter.layers[0].mlp_conv.kernel_projection.weight.dtype == torch.bfloat16
    assert proposer.drafter.candidate_selector.hidden_projection.weight.dtype == torch.bfloat16
    proposer.reset(feats)
    got = proposer.draft_hidden(anchor, torch.tensor(S))
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.03, atol=0.05)
    decoder = StaticDecoder(full_target, capacity=96, proposer=StaticDFlash2Proposer(full_target, drafter, B, 96,
                                                                                     autocast=True), block_size=B)
    ids = _prompt_ids(full_target, PROMPTS[2])
    assert decoder.generate_speculative(ids, 19).tokens == generate_target_only(full_target, ids, 19)


# ------------------------------------------------------------------------------------------ lossless decoding

class RecordingProposer(DFlashProposer):
    """The reference proposer, keeping every round's drafts and the head's argmax at the same positions."""

    def __init__(self, *args):
        super().__init__(*args)
        self.drafts: list[list[int]] = []
        self.argmax: list[list[int]] = []

    def propose(self, new_feats, committed):
        cache_length = self.cache.length
        draft = super().propose(new_feats, committed)
        self.drafts.append(draft.tolist())
        # the unary proposal of the same block, from a copy of the cache as it was before this round
        saved, self.cache = self.cache, _cache_before(self.cache, cache_length)
        self.argmax.append(self.draft_logits(new_feats, committed).argmax(-1).tolist())
        self.cache = saved
        return draft


def _cache_before(cache: DraftContextCache, length: int) -> DraftContextCache:
    out = DraftContextCache(len(cache.k))
    out.k = [k[:, :, :length] if length else None for k in cache.k]
    out.v = [v[:, :, :length] if length else None for v in cache.v]
    out.length = length
    return out


DRAFTERS = {
    "fresh": dict(seed=0),
    "perturbed": dict(seed=5, perturb=True),
    "perturbed-transformed": dict(seed=6, perturb=True, output_multiplier=0.5, final_logit_softcapping=3.0),
}


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("block_size", [2, 4, 7])
def test_speculative_equals_target_only_and_static_equals_reference(full_target, kind, block_size):
    """Greedy speculative output == the target's alone, through the reference and the static proposer; the static
    proposer drafts exactly what the reference does, round by round (blocks shorter and longer than the trained
    one: 2 takes one of the three taps)."""
    drafter = dflash2_drafter(full_target, **DRAFTERS[kind])
    decoder = StaticDecoder(full_target, capacity=128, proposer=StaticDFlash2Proposer(full_target, drafter,
                                                                                      block_size, 128),
                            block_size=block_size)
    for text in PROMPTS:
        ids = _prompt_ids(full_target, text)
        for max_new in (1, 9, 23):
            want = generate_target_only(full_target, ids, max_new)
            reference = RecordingProposer(full_target, drafter, block_size)
            got = generate_speculative(full_target, reference, ids, max_new)
            assert got.tokens == want, (kind, text, max_new)
            drafts: list[list[int]] = []
            static = decoder.generate_speculative(ids, max_new, drafts=drafts)
            assert static == got, (kind, text, max_new)
            assert drafts == reference.drafts, (kind, text, max_new)


def test_the_perturbed_selector_changes_the_drafts(full_target):
    """Guard for the test above: with a perturbed selector the walk proposes other tokens than the head's argmax in
    some rounds (so the comparison with the static proposer covers the walk), and at some block positions the same
    (which rounds and positions depends on the tiny target's random weights, which transformers' init draws)."""
    drafter = dflash2_drafter(full_target, **DRAFTERS["perturbed"])
    differ = same = 0
    for text in PROMPTS:
        reference = RecordingProposer(full_target, drafter, 7)
        generate_speculative(full_target, reference, _prompt_ids(full_target, text), 23)
        for walk, argmax in zip(reference.drafts, reference.argmax):
            differ += walk != argmax
            same += sum(w == a for w, a in zip(walk, argmax))
    assert differ > 0 and same > 0


def test_a_static_proposer_without_the_convolutions_drafts_otherwise(full_target):
    """Guard: the static proposer with the DFlash layers' plain sublayers (no convolutions) drafts differently from
    the reference, so the round-by-round equality above covers the convolutions."""
    drafter = dflash2_drafter(full_target, **DRAFTERS["perturbed"])
    proposer = StaticDFlash2Proposer(full_target, drafter, 4, 128)
    proposer.attention_input = lambda layer, x: (layer.input_layernorm(x), None)
    proposer.attention_output = lambda layer, y, kernel: y
    proposer.mlp_residual = lambda layer, x: layer.mlp(layer.post_attention_layernorm(x))
    decoder = StaticDecoder(full_target, capacity=128, proposer=proposer, block_size=4)
    ids = _prompt_ids(full_target, PROMPTS[0])
    reference = RecordingProposer(full_target, drafter, 4)
    generate_speculative(full_target, reference, ids, 23)
    drafts: list[list[int]] = []
    decoder.generate_speculative(ids, 23, drafts=drafts)
    assert drafts != reference.drafts


@pytest.mark.parametrize("engine", ["static", "hf"])
def test_the_engines_decode_a_dflash2_drafter_losslessly(full_target, engine):
    """`decoders` (what eval, bench.speculative and the quality pipeline call) takes a DFlash2 drafter: its
    speculative output is its target-only output, and the target's alone."""
    drafter = dflash2_drafter(full_target, **DRAFTERS["perturbed"])
    target_only, speculative, *_ = decoders(full_target, drafter, TRAINED_BLOCK, 128, engine=engine, log=lambda m: 0)
    for text in PROMPTS[:2]:
        ids = _prompt_ids(full_target, text)
        want = generate_target_only(full_target, ids, 17)
        assert target_only(ids, 17) == want
        assert speculative(ids, 17).tokens == want


# ------------------------------------------------------------------------------------------ the tiny families

def test_the_static_families_decode_a_dflash2_drafter_as_the_reference_does(family_dirs):
    """Every family the static engine computes (sliding windows, Gemma's norms and caps): speculative output ==
    the target's alone, the static proposer's drafts == the reference's."""
    from tests.trainer.families import STATIC_ENGINE_FAMILIES
    from trainer.model.target import load_target

    for family in STATIC_ENGINE_FAMILIES:
        target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), truncate=False)
        drafter = dflash2_drafter(target, seed=7, perturb=True)
        decoder = StaticDecoder(target, capacity=96, proposer=StaticDFlash2Proposer(target, drafter, 5, 96),
                                block_size=5)
        ids = _prompt_ids(target, PROMPTS[1])
        want = generate_target_only(target, ids, 19)
        reference = RecordingProposer(target, drafter, 5)
        assert generate_speculative(target, reference, ids, 19).tokens == want, family
        drafts: list[list[int]] = []
        assert decoder.generate_speculative(ids, 19, drafts=drafts).tokens == want, family
        assert drafts == reference.drafts, family


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss", "qwen3_moe"])
def test_hf_engine_families_decode_a_dflash2_drafter_losslessly(family_dirs, family):
    """The hybrid (recurrent state rolled back), attention-sink and MoE targets the hf engine serves."""
    from trainer.model.target import load_target

    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    ids = _prompt_ids(target, PROMPTS[0])
    want = generate_target_only(target, ids, 19)
    for drafter in (dflash2_drafter(target), dflash2_drafter(target, seed=8, perturb=True)):
        assert generate_speculative(target, DFlashProposer(target, drafter, 5), ids, 19).tokens == want, family


@pytest.mark.parametrize("engine", ["static", "hf"])
def test_eval_prompts_decodes_a_dflash2_export(tiny_target_dir, full_target, tmp_path, capsys, engine):
    """`trainer eval prompts` (in process: the CLI's own function; bench.speculative and the quality pipeline decode
    through the same decode_benchmark) on a DFlash2 export read back as one: decoded, every output equal to the
    target's alone."""
    import json
    from pathlib import Path

    from trainer.__main__ import main
    from trainer.export import ExportConfig, export_drafter, load_exported

    drafter = dflash2_drafter(full_target, **DRAFTERS["perturbed-transformed"])
    export = export_drafter(tmp_path / "export", drafter, ExportConfig.of(drafter.cfg, full_target, TRAINED_BLOCK),
                            dtype=torch.float32)
    _, ecfg = load_exported(export)
    assert ecfg.drafter.dflash2 == drafter.cfg.dflash2
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "prompts"
    files = [str(fixtures / f"{n}.jsonl") for n in ("gsm8k", "mtbench")]
    assert main(["eval", "prompts", "--drafter", str(export), "--target", str(tiny_target_dir), "--prompts", *files,
                 "--max-new", "10", "--engine", engine]) == 0
    out = capsys.readouterr().out.splitlines()
    records = [json.loads(x.split(" ", 1)[1]) for x in out if x.startswith("DFLASH_EVAL ")]
    assert [r["set"] for r in records] == ["gsm8k", "mtbench"]
    assert all(r["engine"] == engine and r["prompts"] == 2 and r["identical"] == 2 for r in records)
    assert all(1.0 <= r["tau"] <= TRAINED_BLOCK for r in records)
