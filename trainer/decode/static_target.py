"""The target's forward over a static KV cache, written against the HF model's own submodules (same weights, same
norms and projections), with no Python-side shape or length state: the write position is a device tensor.

Slot = absolute position. A forward over tokens at positions p0..p0+L-1 first writes their K/V into slots
p0..p0+L-1, then lets each query at position p attend to slots <= p. Slots beyond p may hold stale K/V of rejected
draft tokens; the mask hides them and a later forward overwrites them, so "cropping" the cache costs nothing.

Shape legend: L tokens, M cache slots, H / Hkv query / key-value heads, Dh head dim, T taps, D hidden, V vocab.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.decode.kernels import RowInvariantRMSNorm, decode_attention, head_dim_supported, usable_for
from trainer.errors import ConfigError
from trainer.model.drafter import apply_rope
from trainer.model.target import Target


def _rope_of(hf_model) -> tuple[torch.Tensor, float]:
    """(inv_freq [Dh/2] fp32, attention_scaling) from the HF rotary module; only position-independent RoPE types."""
    rotary = hf_model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type == "dynamic" or "longrope" in str(rope_type):
        raise ConfigError(f"static decoding does not support rope_type {rope_type!r}",
                          hint="use eval.engine=hf for this target")
    return rotary.inv_freq.float(), float(getattr(rotary, "attention_scaling", 1.0))


def rope_from_inv_freq(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [L] long -> cos, sin [1, 1, L, Dh] in `dtype` (HF rotate_half layout, HF's arithmetic)."""
    freqs = pos.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype)[None, None], (emb.sin() * scaling).to(dtype)[None, None]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")  # the layer layout `forward` re-implements


def check_supported(cfg) -> None:
    """Refuse a target whose layers `StaticTarget.forward` would compute differently from HF (sliding windows,
    soft-capping, other layer layouts): target-only and speculative decoding would then agree with each other while
    both being wrong."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"static decoding supports {', '.join(SUPPORTED_MODEL_TYPES)} targets, not {model_type!r}",
                          hint="use eval.engine=hf for this target")
    sliding = (getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)) or \
        "sliding_attention" in (getattr(cfg, "layer_types", None) or ())
    if sliding:
        raise ConfigError("static decoding does not support sliding-window attention",
                          hint="use eval.engine=hf for this target")


class StaticTarget:
    """A full (untruncated) `Target` plus its static KV cache of `slots` positions for `rows` sequences that advance
    together (batch-1 decoding: rows = 1; equal-length prompts generated as a batch: rows = R).

    `forward` is free of host syncs and allocates nothing that depends on values, so it can run inside a CUDA graph
    capture for a fixed L."""

    def __init__(self, target: Target, slots: int, rows: int = 1, invariant: bool = False) -> None:
        if target.truncated:
            raise RuntimeError("static decoding needs the full target; load it with truncate=False")
        check_supported(target.hf_config)
        cfg = target.hf_config
        self.target = target
        self.model = target.model
        self.layers = list(self.model.model.layers)
        attn0 = self.layers[0].self_attn
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", self.heads)
        self.head_dim = attn0.head_dim
        self.slots = slots
        self.inv_freq, self.rope_scaling = _rope_of(self.model)
        weight = target.embed_tokens.weight
        self.inv_freq = self.inv_freq.to(weight.device)
        self.rows = rows
        # invariant: attention through the row-invariant Triton kernel (trainer/decode/kernels.py), so that a verify
        # computes each token bitwise as a decode step does, in bf16 too (SDPA does not: docs/quality.md, "Exact
        # bf16"). Where the kernel cannot run (no Triton, CPU without the interpreter, a head dim it does not take),
        # SDPA; `attention` says which.
        kernel_ok = usable_for(weight) and head_dim_supported(self.head_dim) and self.heads % self.kv_heads == 0
        self.attention = "invariant" if invariant and kernel_ok else "sdpa"
        shape = (rows, self.kv_heads, slots, self.head_dim)
        self.k = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in self.layers]
        self.slot_ids = torch.arange(slots, device=weight.device)
        self.taps = set(target.layer_ids)
        # Every norm is row-invariant (trainer/decode/kernels.py): a verify forward over 16 tokens must compute each
        # token exactly as a 1-token step does. Qwen3 also normalizes q and k per head; Llama/Qwen2 layers do not.
        norm = RowInvariantRMSNorm
        self.input_norms = [norm(layer.input_layernorm) for layer in self.layers]
        self.post_norms = [norm(layer.post_attention_layernorm) for layer in self.layers]
        self.q_norms = [norm(layer.self_attn.q_norm) if hasattr(layer.self_attn, "q_norm") else _identity
                        for layer in self.layers]
        self.k_norms = [norm(layer.self_attn.k_norm) if hasattr(layer.self_attn, "k_norm") else _identity
                        for layer in self.layers]
        self.final_norm = norm(self.model.model.norm)

    @property
    def device(self) -> torch.device:
        return self.slot_ids.device

    @torch.no_grad()
    def forward(self, ids_RL: torch.Tensor, pos0: torch.Tensor, want_features: bool = True,
                last_only: bool = False, logits_at: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [R, L] (R = rows) at positions pos0..pos0+L-1 (pos0: 0-dim long device tensor) -> (logits [R, L, V]
        fp32 -- [R, 1, V] of the last position when `last_only`, of index `logits_at` ([1] long device tensor) when
        given --, tapped features [R, L, T*D] or None). Writes their K/V into slots pos0..pos0+L-1;
        pos0 + L <= slots."""
        R, L = ids_RL.shape
        pos = pos0 + torch.arange(L, device=ids_RL.device)  # [L]
        x = self.target.embed_tokens(ids_RL)
        cos, sin = rope_from_inv_freq(pos, self.inv_freq, self.rope_scaling, x.dtype)
        # SDPA's mask (the invariant kernel masks by position itself)
        visible = None if self.attention == "invariant" else (self.slot_ids[None, :] <= pos[:, None])[None, None]
        H, Hkv, Dh = self.heads, self.kv_heads, self.head_dim
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = self.input_norms[i](x)
            q = self.q_norms[i](attn.q_proj(h).view(R, L, H, Dh)).transpose(1, 2)
            k = self.k_norms[i](attn.k_proj(h).view(R, L, Hkv, Dh)).transpose(1, 2)
            v = attn.v_proj(h).view(R, L, Hkv, Dh).transpose(1, 2)
            self.k[i].index_copy_(2, pos, apply_rope(k, cos, sin))
            self.v[i].index_copy_(2, pos, v)
            q = apply_rope(q, cos, sin)
            if self.attention == "invariant":
                out = decode_attention(q, self.k[i], self.v[i], pos, attn.scaling)  # [R, L, H, Dh]
            else:
                out = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=visible, scale=attn.scaling,
                                                     enable_gqa=H != Hkv).transpose(1, 2)
            x = x + attn.o_proj(out.reshape(R, L, H * Dh))
            x = x + layer.mlp(self.post_norms[i](x))
            if want_features and i in self.taps:
                taps[i] = x
        # last_only: a batch prefill needs only the next token ([R, P, V] fp32 logits would be GBs); logits_at: a
        # padded prefill needs the next token after its last real one.
        if logits_at is not None:
            x_out = x.index_select(1, logits_at)
        else:
            x_out = x[:, -1:] if last_only else x
        logits = self.target.lm_head(self.final_norm(x_out)).float()
        feats = self.target.join_taps(taps, self.final_norm) if want_features else None
        return logits, feats
