"""Tiny random targets of every supported family, saved to disk with the bundled tokenizer, as a user's would be.

Each is small enough for CPU tests and keeps what makes its family different: Qwen2 with sliding-window layers after
`max_window_layers`, Mistral with one window for every layer, Gemma 3 alternating sliding and full layers (scaled
embeddings, pre-attention scalar), Gemma 2 with soft-capped attention scores, Llama 3 with its RoPE scaling. The
windows (4 tokens) are shorter than the test documents, so a mask that ignores them gives different features."""
from __future__ import annotations

from pathlib import Path

WINDOW = 4
SOFTMAX_FAMILIES = ("qwen3", "qwen2", "llama", "mistral", "gemma3", "gemma2")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # Gated DeltaNet layers beside full attention
FAMILIES = SOFTMAX_FAMILIES + MOE_FAMILIES + HYBRID_FAMILIES
# what the static engine computes (StaticTarget, trainer/decode/stack.py): every family
STATIC_ENGINE_FAMILIES = FAMILIES
# a Llama whose RoPE frequencies change with the sequence length (rope_type dynamic): trained on, but refused by the
# static engine, so eval, regenerate and the bench fall back to HF for it
REFUSED_BY_STATIC = "llama_dynamic"
# two-layer targets (tests/trainer/conftest.py `two_layer_dirs`): plain q/k norms, none, biased and sliding, a hybrid
TWO_LAYER_FAMILIES = ("qwen3", "llama", "qwen2", "qwen3_5")
# 4 layers, two of each kind, so that taps (1, 3) read a linear-attention and a full-attention layer's output
HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def family_config(family: str, vocab: int, layers: int = 4):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    if family == "qwen3":
        return tf.Qwen3Config(**common, tie_word_embeddings=True)
    if family == "qwen2":
        return tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=layers // 2)
    if family == "llama":
        return tf.LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if family == REFUSED_BY_STATIC:
        return tf.LlamaConfig(**common, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=WINDOW)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    if family == "gemma2":
        return tf.Gemma2Config(**common, sliding_window=WINDOW, query_pre_attn_scalar=16)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, **moe, num_experts=4, norm_topk_prob=True)
    if family == "mixtral":
        return tf.MixtralConfig(**common, num_experts_per_tok=2, num_local_experts=4)
    if family == "gpt_oss":  # attention sinks, alternating sliding / full layers, biased experts with a clamped GLU
        return tf.GptOssConfig(**{**common, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, layer_types=HYBRID_LAYERS[:layers])
    if family == "qwen3_next":  # its linear layers project q, k, v, z interleaved per key head
        return tf.Qwen3NextConfig(**common, **moe, **linear, num_experts=4, shared_expert_intermediate_size=32)
    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(**common, **linear)
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(**{k: v for k, v in common.items() if k != "intermediate_size"}, **moe,
                                       **linear, num_experts=4, shared_expert_intermediate_size=32)
    raise ValueError(family)


def build_family_target(out_dir: Path, family: str, seed: int = 0, layers: int = 4) -> Path:
    """layers: 4 by default (taps (1, 3)); 2 keeps one layer of each kind for the tests whose cost is per layer."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    cfg = family_config(family, len(tokenizer), layers)
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, None
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_two_layers(path: Path):
    """A `two_layer_dirs` target, untruncated, its taps the two layers."""
    from trainer.model.target import load_target

    return load_target(path, num_draft_layers=2, layer_ids=(0, 1), truncate=False)


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 codes


def build_mxfp4_pair(out_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny gpt-oss twice: `bf16/` with expert weights that MXFP4 holds exactly (an FP4 value times a power of two
    per 32 values), and `mxfp4/`, the same model as OpenAI's release packs it: each expert projection as `_blocks`
    (two FP4 codes per byte, low nibble first, 32 values per group along the input dimension) and `_scales`
    (the group's exponent + 127), with `quantization_config.quant_method = "mxfp4"`. Written from the format's
    definition, not by transformers, so that loading it checks transformers' dequantizer and our use of it."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    plain = build_family_target(Path(out_dir) / "bf16", "gpt_oss", seed)
    packed_dir = Path(out_dir) / "mxfp4"
    packed_dir.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    codes = torch.tensor(FP4_VALUES)
    exact, packed = {}, {}
    for name, w in load_file(plain / "model.safetensors").items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            exact[name] = packed[name] = w
            continue
        experts, rows, cols = w.transpose(1, 2).shape  # the checkpoint groups along the model's input dim
        idx = torch.randint(0, 16, (experts, rows, cols // 32, 32), generator=gen)
        exp = torch.randint(-4, 2, (experts, rows, cols // 32), generator=gen)
        values = codes[idx] * torch.pow(2.0, exp.float())[..., None]
        exact[name] = values.reshape(experts, rows, cols).transpose(1, 2).contiguous().to(w.dtype)
        packed[f"{name}_blocks"] = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
        packed[f"{name}_scales"] = (exp + 127).to(torch.uint8)
    save_file(exact, plain / "model.safetensors", metadata={"format": "pt"})
    save_file(packed, packed_dir / "model.safetensors", metadata={"format": "pt"})
    for f in plain.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, packed_dir / f.name)
    config = json.loads((packed_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (packed_dir / "config.json").write_text(json.dumps(config))
    return plain, packed_dir
