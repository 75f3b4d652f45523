"""MoE targets on the static engine (`trainer.decode.layers.moe`, `trainer.decode.stack`): the decode MoE MLP
against the naive per-token reference of tests/trainer/test_moe_routing.py (both GEMM paths), its sort and offsets,
the layer plan, and target-only and speculative greedy decoding equal to HF's for Qwen3-MoE, Mixtral and gpt-oss.
Real tiny models of each family (tests/trainer/families.py), saved to disk and loaded through `load_target`."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.decode.test_reference import PROMPTS, _drafter, _prompt_ids
from tests.trainer.decode.test_static_decode import assert_lossless_on
from tests.trainer.test_moe_routing import reference, routing_rule
from trainer.decode.engine import StaticDecoder
from trainer.decode.layers.moe import MoeMLP, Routing, routing_of, sort_by_expert
from trainer.decode.stack import StaticTarget, layer_plan
from trainer.decode.static_draft import StaticDFlashProposer
from trainer.model.target import load_target

MOE = ("qwen3_moe", "mixtral", "gpt_oss")
ROUTED = MOE + ("qwen3_next", "qwen3_5_moe")  # the hybrids' MoE blocks (a shared expert) too


def family_target(family_dirs, family: str):
    return load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), dtype="float32", truncate=False)


def redrawn_block(target):
    """The first MoE block with its weights redrawn large enough that tokens route differently and the
    renormalisation matters (test_moe_routing's draw)."""
    block = next(layer.mlp for layer in target.model.model.layers if hasattr(layer.mlp, "experts"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "router" in name or name.startswith("gate.")
                                                            else 0.3))
    return block, gen


@pytest.mark.parametrize("grouped", [False, True], ids=["exact-rule", "grouped_mm"])
@pytest.mark.parametrize("family", ROUTED)
def test_the_decode_moe_mlp_equals_the_per_token_reference(family, grouped, family_dirs):
    """Both GEMM paths (the exact rule CPU decoding runs, and grouped_mm as CUDA runs it, here on CPU's kernel) give
    the naive reference's output: each token's top-k experts, weighted by the family's rule, plus a shared expert."""
    if grouped and not hasattr(F, "grouped_mm"):
        pytest.skip("this torch has no torch.nn.functional.grouped_mm")
    target = family_target(family_dirs, family)
    config = json.loads((family_dirs[family] / "config.json").read_text())
    block, gen = redrawn_block(target)
    mlp = MoeMLP(block, routing_of(target.hf_config), config["num_experts_per_tok"], grouped=grouped)
    x = torch.randn(3, 8, config["hidden_size"], generator=gen)
    want = reference(family, block, config, x.reshape(24, -1), routing_rule(family, config))
    torch.testing.assert_close(mlp(x).reshape(24, -1), want, atol=1e-4, rtol=1e-4)


def test_a_wrong_routing_rule_is_caught(family_dirs):
    """Without Qwen3-MoE's renormalisation, or with gpt-oss's softmax over all experts instead of over its top k,
    the output differs from the reference: the comparison above sees the rule. (A softmax over all experts, top-k,
    renormalised, is gpt-oss's rule again.)"""
    for family, wrong in (("qwen3_moe", Routing("softmax_topk", renorm=False, cast=True)),
                          ("gpt_oss", Routing("softmax_topk"))):
        target = family_target(family_dirs, family)
        config = json.loads((family_dirs[family] / "config.json").read_text())
        block, gen = redrawn_block(target)
        x = torch.randn(1, 24, config["hidden_size"], generator=gen)
        want = reference(family, block, config, x[0], routing_rule(family, config))
        got = MoeMLP(block, wrong, config["num_experts_per_tok"], grouped=False)(x)[0]
        assert (got - want).abs().max() > 1e-2, family


def test_copies_sort_by_expert_with_their_group_ends():
    experts = torch.tensor([[2, 0], [0, 3], [2, 1], [3, 0]])  # T = 4 tokens, k = 2; expert 4 of 5 unused
    order, sorted_experts, offsets = sort_by_expert(experts, 5)
    assert sorted_experts.tolist() == [0, 0, 0, 1, 2, 2, 3, 3]
    assert order.tolist() == [1, 2, 7, 5, 0, 4, 3, 6]  # stable: copies of one expert keep token order
    assert offsets.dtype == torch.int32 and offsets.tolist() == [3, 4, 6, 8, 8]


def test_the_plan_places_moe_layers_as_qwen3_moe_does(family_dirs):
    """mlp_only_layers and decoder_sparse_step leave some layers dense; the static target then runs the HF MLP there
    and equals HF's forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model.target import prepare_target
    from trainer.tiny import build_tokenizer

    cfg = AutoConfig.from_pretrained(family_dirs["qwen3_moe"])
    cfg.mlp_only_layers, cfg.decoder_sparse_step = [2], 2
    plan = layer_plan(cfg)
    assert plan.mlps == ("dense", "moe", "dense", "moe") and plan.mixers == ("attention",) * 4 and plan.top_k == 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm")
    target = prepare_target(model, build_tokenizer(), num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    static = StaticTarget(target, slots=16)
    assert [type(m).__name__ for m in static.mlps] == ["Qwen3MoeMLP", "MoeMLP", "Qwen3MoeMLP", "MoeMLP"]
    ids = torch.randint(10, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids, use_cache=False).logits.float()
    rows = StaticTarget(target, slots=16, rows=2)
    got = torch.cat([rows.forward(ids[:, :9], torch.tensor(0))[0]] +
                    [rows.forward(ids[:, p:p + 1], torch.tensor(p))[0] for p in range(9, 12)], 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", MOE)
def test_target_only_and_speculative_decoding_equal_hf(family, family_dirs):
    """The static decoder (eager on CPU: the same programs the CUDA graphs capture) against HF's greedy decoding
    with its DynamicCache: target-only, speculative with a DFlash drafter, and a table drafter wrong at block
    position 3 (every round then accepts exactly 2)."""
    target = family_target(family_dirs, family)
    B, new = 4, 19
    decoder = StaticDecoder(target, 96, StaticDFlashProposer(target, _drafter(target), B, 96), B)
    assert decoder.static.plan.mlps == ("moe",) * 4
    for text in PROMPTS[:2]:
        assert_lossless_on(target, decoder, _prompt_ids(target, text), new)


def test_the_engine_serves_moe_and_hands_what_it_refuses_to_hf(family_dirs, tmp_path):
    """decoders.engine_for: an MoE target stays on the static engine, silently, and so do the hybrids, dense and MoE;
    a target the stack refuses (dynamic RoPE) goes to hf after one note naming why."""
    from tests.trainer.families import REFUSED_BY_STATIC, build_family_target
    from trainer.decode.decoders import engine_for

    notes: list[str] = []
    for family in MOE + ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
        assert engine_for("static", family_target(family_dirs, family), notes.append) == "static", family
    assert notes == []
    refused = load_target(build_family_target(tmp_path / "refused", REFUSED_BY_STATIC), num_draft_layers=2,
                          layer_ids=(1, 3), truncate=False)
    assert engine_for("static", refused, notes.append) == "hf"
    assert len(notes) == 1 and "rope_type 'dynamic'" in notes[0]


def test_gpt_oss_without_its_sinks_or_its_window_differs_from_hf(family_dirs):
    """The family comparison (test_static_families) can fail for gpt-oss: a static target that drops the sinks, or
    computes its sliding layers as full ones, differs from HF (sinks redrawn large enough to take weight)."""
    from tests.trainer.decode.test_static_families import hf_and_static, sharp_target
    from trainer.model.attention import FULL

    for drop in ("sinks", "window"):
        target = sharp_target(family_dirs, "gpt_oss")
        with torch.no_grad():
            for layer in target.model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-2, 4, layer.self_attn.sinks.numel()))
        static = StaticTarget(target, slots=32, ring=drop != "window")  # a ring cannot compute full attention
        want, got, _, _ = hf_and_static(target, static)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if drop == "sinks":
            for mixer in static.mixers:
                mixer.sinks = None
        else:
            static.kinds = (FULL,) * len(static.kinds)
        want, got, _, _ = hf_and_static(target, static)
        assert (got - want).abs().max() > 1e-2, drop


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_hybrid_full_attention_layer_decodes_as_hf_computes_it(family, family_dirs):
    """The hybrids' output-gated attention with partial RoPE (layer 1 of the tiny hybrid; the whole stack waits for
    the linear layer): a prefill then single-token steps over the static cache give HF's attention output over the
    whole sequence."""
    from trainer.decode.layers.attention import (SDPA, AttentionLayer, Step, rope_from_inv_freq, ropes_of,
                                                 visible_masks)
    from trainer.model.attention import FULL

    target = family_target(family_dirs, family)
    model, cfg = target.model, target.hf_config
    attn = model.model.layers[1].self_attn
    inv, scale = ropes_of(model, (FULL,))[FULL]
    assert 2 * inv.numel() < attn.head_dim  # a partial RoPE: some dims pass through unturned
    layer = AttentionLayer(attn, FULL, attn.q_norm, attn.k_norm, 1, 16, cfg.num_attention_heads,
                           cfg.num_key_value_heads, attn.head_dim, torch.float32, torch.device("cpu"), gated=True)
    h = torch.randn(1, 12, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, _ = attn(hidden_states=h, position_embeddings=model.model.rotary_emb(h, torch.arange(12)[None]),
                       attention_mask=None)
        got = []
        for a, b in [(0, 9), (9, 10), (10, 11), (11, 12)]:
            pos = torch.arange(a, b)
            ropes = {FULL: rope_from_inv_freq(pos, inv, scale, h.dtype)}
            step = Step(pos, ropes, visible_masks(torch.arange(16), pos, 16, None, None), 16, SDPA, None, False)
            got.append(layer(h[:, a:b], step))
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-4, atol=1e-5)


def test_the_plan_reads_every_family_as_its_model_is_built(family_dirs):
    """From the config alone, each layer's MLP kind is what the HF model built (an experts block or a dense MLP) and
    each mixer kind what it has (softmax attention, gated in the hybrids, or a linear-attention layer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for family, path in family_dirs.items():
        cfg = AutoConfig.from_pretrained(path)
        plan = layer_plan(cfg)
        with torch.device("meta"):
            layers = AutoModelForCausalLM.from_config(cfg).model.layers
        assert plan.mlps == tuple("moe" if hasattr(layer.mlp, "experts") else "dense" for layer in layers), family
        gated = tuple(hasattr(layer, "self_attn") and layer.self_attn.q_proj.out_features == 2 *
                      cfg.num_attention_heads * layer.self_attn.head_dim for layer in layers)
        want = tuple("gated_attention" if g else "attention" if hasattr(layer, "self_attn") else "linear"
                     for g, layer in zip(gated, layers))
        assert plan.mixers == want, family
