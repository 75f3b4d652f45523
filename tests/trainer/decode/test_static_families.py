"""The static target computes every supported family as HF does: a prefill and single-token decode steps past the
sliding window (and through a hybrid's recurrent state) give HF's own logits and tapped features. Real tiny models of each family (tests/trainer/families.py),
saved to disk and loaded through `load_target`; their attention sharpened so that soft-capping and windows change
the result (at the init's tiny scores tanh(s / cap) * cap is s, and attention is nearly uniform)."""
from __future__ import annotations

import re

import pytest
import torch

from tests.trainer.families import STATIC_ENGINE_FAMILIES as FAMILIES
from trainer.decode.stack import StaticTarget, check_supported
from trainer.errors import ConfigError
from trainer.model.attention import FULL, SLIDING
from trainer.model.target import load_target

PROMPT, STEPS = 9, 5  # the steps reach position 13, three windows past the start


def sharp_target(family_dirs, family: str):
    """The family's tiny target with q/k projections x8 (attention scores ~64x larger; Gemma 2 x40, scores of tens,
    where its cap of 50 bends them) and the embedding and LM head x100 (logits ~100x larger, past Gemma 2's final
    cap of 30)."""
    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    qk = 40 if family == "gemma2" else 8
    with torch.no_grad():
        for layer in (layer for layer in target.model.model.layers if hasattr(layer, "self_attn")):
            layer.self_attn.q_proj.weight.mul_(qk)
            layer.self_attn.k_proj.weight.mul_(qk)
        for weight in {id(w): w for w in (target.embed_tokens.weight, target.lm_head.weight)}.values():
            weight.mul_(100)  # once, tied or not
    return target


def hf_and_static(target, static: StaticTarget):
    """HF's own forward over the whole sequence vs the static prefill then STEPS one-token steps:
    (HF logits, static logits, HF taps, static taps), all [1, PROMPT + STEPS, ...]."""
    ids = torch.randint(10, target.embed_tokens.weight.shape[0], (1, PROMPT + STEPS),
                        generator=torch.Generator().manual_seed(0))
    out = target.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    want_feats = torch.cat([out.hidden_states[i + 1] for i in target.layer_ids], dim=-1)
    chunks = [(0, PROMPT)] + [(p, p + 1) for p in range(PROMPT, PROMPT + STEPS)]
    got = [static.forward(ids[:, a:b], torch.tensor(a)) for a, b in chunks]
    return (out.logits.float(), torch.cat([g[0] for g in got], 1), want_feats, torch.cat([g[1] for g in got], 1))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_steps_equal_hf_past_the_window(family, family_dirs):
    target = sharp_target(family_dirs, family)
    static = StaticTarget(target, slots=32)
    assert static.attention == ("eager" if family in ("gemma2", "gpt_oss") else "sdpa")
    want_logits, got_logits, want_feats, got_feats = hf_and_static(target, static)
    assert want_logits.abs().max() > 10  # sharpened: the final cap (Gemma 2) is not a no-op
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_feats, want_feats, rtol=1e-4, atol=1e-4)


def _no_window(static):
    static.ropes[FULL] = static.ropes[static.kinds[0]]
    static.kinds = (FULL,) * len(static.kinds)


def _global_rope(static):
    static.ropes[SLIDING] = static.ropes[FULL]


@pytest.mark.parametrize("family, break_it", [
    ("mistral", _no_window), ("gemma3", _global_rope),
    ("gemma2", lambda s: setattr(s, "softcap", None)), ("gemma2", lambda s: setattr(s, "final_softcap", None)),
])
def test_a_family_feature_left_out_would_be_caught(family, break_it, family_dirs):
    """The comparison above can fail: a static target without the window, Gemma 3's local RoPE, or Gemma 2's caps
    differs from HF."""
    target = sharp_target(family_dirs, family)
    static = StaticTarget(target, slots=32, ring=break_it is not _no_window)  # a ring cannot compute full attention
    break_it(static)
    want, got, _, _ = hf_and_static(target, static)
    assert (got - want).abs().max() > 1e-2


@pytest.mark.parametrize("family, reason", [("mistral", "sliding-window layers"), ("gemma3", "sliding-window"),
                                            ("gemma2", "soft-caps its attention scores"),
                                            ("qwen3", "cannot run here")])
def test_invariant_attention_says_why_it_fell_back(family, reason, family_dirs):
    """Only a plain causal target gets the row-invariant kernel; the others say why (speculative decoding of them
    is not bitwise its decode steps). On this CPU even Qwen3's falls back (no interpreter here)."""
    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    static = StaticTarget(target, slots=16, invariant=True)
    assert static.attention == ("eager" if family == "gemma2" else "sdpa")
    assert reason in static.fallback


@pytest.mark.parametrize("model_type, extra, needle", [
    ("phi3", {}, "static decoding supports qwen3, qwen2, llama, mistral, qwen3_moe, mixtral, gpt_oss, gemma2, "
                 "gemma3_text, qwen3_next, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text targets, not 'phi3'"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional attention"),
])
def test_what_is_not_implemented_is_refused_from_the_config(model_type, extra, needle):
    from transformers import AutoConfig

    with pytest.raises(ConfigError, match=re.escape(needle)) as e:
        check_supported(AutoConfig.for_model(model_type, num_hidden_layers=2, **extra))
    assert "\n" not in str(e.value) and "eval.engine=hf" in e.value.hint


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_passes_the_check(family, family_dirs):
    from transformers import AutoConfig

    check_supported(AutoConfig.from_pretrained(family_dirs[family]))
