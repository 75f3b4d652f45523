"""The target's forward over a static KV cache, written against the HF model's own submodules (same weights, same
norms and projections), with no Python-side shape or length state: the write position is a device tensor.

Slot = absolute position. A forward over tokens at positions p0..p0+L-1 first writes their K/V into slots
p0..p0+L-1, then lets each query at position p attend to slots <= p (and, in a sliding-window layer, only to the
`window` slots ending at p: HF's rule). Slots beyond p may hold stale K/V of rejected draft tokens; the mask hides
them and a later forward overwrites them, so "cropping" the cache costs nothing.

Rows of different prompt lengths (`padded`): each row's prompt is left-padded to a common length and starts at its
own slot `row_start[r]`; a query sees no slot before its row's start, and RoPE takes the position slot - row_start
(HF `generate`'s left padding: positions count real tokens only).

Every supported family (`check_supported`) in one layer loop, as HF computes it:
    qwen3 / qwen2 / llama / mistral   x += attn(norm(x)); x += mlp(norm(x)); q/k norms where the layer has them
    gemma2 / gemma3                   x += norm(attn(norm(x))); x += norm(mlp(norm(x))) ("sandwich" norms,
                                      (1 + w) RMSNorms); scaled embeddings (the HF embedding module scales);
                                      Gemma 2: tanh soft-capping of the attention scores and the final logits;
                                      Gemma 3: its own RoPE (base) for sliding layers, q/k norms.

Shape legend: L tokens, M cache slots, R rows, H / Hkv query / key-value heads, Dh head dim, T taps, D hidden,
V vocab.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.decode.kernels import RowInvariantRMSNorm, decode_attention, head_dim_supported, usable_for
from trainer.errors import ConfigError
from trainer.model.attention import FULL, SLIDING
from trainer.model.drafter import apply_rope
from trainer.model.target import Target, attention_kinds

# model_type -> the layer layout `forward` re-implements ("plain": pre-norm residual blocks; "sandwich": Gemma's
# pre and post norms around attention and MLP, with (1 + w) RMSNorms). Anything else computes differently (other
# layouts, MoE routing with data-dependent shapes, linear attention) and is refused.
LAYOUTS = {"qwen3": "plain", "qwen2": "plain", "llama": "plain", "mistral": "plain",
           "gemma2": "sandwich", "gemma3_text": "sandwich"}
SUPPORTED_MODEL_TYPES = tuple(LAYOUTS)
# RoPE types whose frequencies change with the sequence length: a static forward cannot recompute them.
DYNAMIC_ROPE = ("dynamic", "longrope")
HINT = "use eval.engine=hf for this target"


def _rope_types(cfg) -> set[str]:
    """The RoPE types a config names: transformers 5 `rope_parameters` (one dict, or one per layer type, Gemma 3),
    or 4.x `rope_scaling` (`rope_type` or the older `type` key)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    dicts = [params] if "rope_type" in params or "type" in params else [p for p in params.values()
                                                                        if isinstance(p, dict)]
    return {str(d.get("rope_type", d.get("type", "default"))) for d in dicts}


def check_supported(cfg) -> None:
    """Refuse, in one line and from the config alone, a target whose layers `StaticTarget.forward` would compute
    differently from HF: target-only and speculative decoding would then agree with each other while both being
    wrong."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in LAYOUTS:
        raise ConfigError(f"static decoding supports {', '.join(SUPPORTED_MODEL_TYPES)} targets, not {model_type!r}",
                          hint=HINT)
    dynamic = sorted(t for t in _rope_types(cfg) if any(d in t for d in DYNAMIC_ROPE))
    if dynamic:
        raise ConfigError(f"static decoding does not support rope_type {dynamic[0]!r} (its frequencies change with "
                          f"the sequence length)", hint=HINT)
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ConfigError(f"static decoding is causal; this {model_type} target uses bidirectional attention",
                          hint=HINT)


def _ropes_of(hf_model, kinds) -> dict[str, tuple[torch.Tensor, float]]:
    """Per layer kind: (inv_freq [Dh/2] fp32, attention_scaling) from the HF rotary module(s). Gemma 3 keeps one
    per layer type (`sliding_attention_inv_freq`, ...; transformers 4.x: a second module, `rotary_emb_local`)."""
    model = hf_model.model
    ropes = {}
    for kind in kinds:
        rotary = model.rotary_emb
        if kind == SLIDING and hasattr(model, "rotary_emb_local"):
            rotary = model.rotary_emb_local
        if hasattr(rotary, f"{kind}_inv_freq"):
            inv, scale = getattr(rotary, f"{kind}_inv_freq"), getattr(rotary, f"{kind}_attention_scaling", 1.0)
        else:
            inv, scale = rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0)
        ropes[kind] = (inv.float(), float(scale))
    return ropes


def rope_from_inv_freq(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [L] (or [R, L]) long -> cos, sin [1, 1, L, Dh] (or [R, 1, L, Dh]) in `dtype` (HF rotate_half layout,
    HF's arithmetic)."""
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
    if pos.dim() == 1:
        return cos[None, None], sin[None, None]
    return cos[:, None], sin[:, None]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                         cap: float) -> torch.Tensor:
    """HF's eager attention with soft-capped scores (Gemma 2), which SDPA cannot compute: scores * scale ->
    cap * tanh(scores / cap) -> masked -> fp32 softmax, cast back -> @ v. q [R, H, L, Dh], k / v [R, Hkv, M, Dh],
    visible [R or 1, 1, L, M] bool -> [R, L, H, Dh]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # HF's repeat_kv
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v).transpose(1, 2)


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """SDPA for grouped-query attention with a mask, without `enable_gqa`: on CUDA only SDPA's math backend takes
    a mask together with enable_gqa (it copies the K/V span per group and materializes the scores), while each KV
    head's G query heads, laid out as G x L query rows of one head, reach the memory-efficient kernel. q [R, H, L,
    Dh] (head h uses KV head h // G, HF's repeat_kv), k / v [R, Hkv, M, Dh], visible [R or 1, 1, L, M] ->
    [R, L, H, Dh]."""
    R, H, L, Dh = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    G = H // Hkv
    rows = visible.shape[0]
    mask = visible[:, :, None].expand(rows, 1, G, L, M).reshape(rows, 1, G * L, M)
    out = F.scaled_dot_product_attention(q.reshape(R, Hkv, G * L, Dh), k, v, attn_mask=mask, scale=scale)
    return out.reshape(R, H, L, Dh).transpose(1, 2)


class StaticTarget:
    """A full (untruncated) `Target` plus its static KV cache of `slots` positions for `rows` sequences that advance
    together (batch-1 decoding: rows = 1; a batch of prompts: rows = R, `padded` when their lengths differ).

    `forward` is free of host syncs and allocates nothing that depends on values, so it can run inside a CUDA graph
    capture for a fixed L (and span).

    `attention` says what computes attention: "invariant" (the row-invariant Triton kernel, asked for with
    `invariant`), "sdpa", or "eager" (soft-capped scores); `fallback` why an `invariant` request got another one."""

    def __init__(self, target: Target, slots: int, rows: int = 1, invariant: bool = False,
                 padded: bool = False) -> None:
        if target.truncated:
            raise RuntimeError("static decoding needs the full target; load it with truncate=False")
        cfg = target.hf_config
        check_supported(cfg)
        self.target = target
        self.model = target.model
        self.layers = list(self.model.model.layers)
        kinds = attention_kinds(cfg)
        self.kinds = kinds.layer_types  # per layer: FULL or SLIDING
        self.window = kinds.window
        attn0 = self.layers[0].self_attn
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = attn0.head_dim
        self.slots = slots
        self.rows = rows
        self.padded = padded
        weight = target.embed_tokens.weight
        dev = weight.device
        self.ropes = {kind: (inv.to(dev), scale) for kind, (inv, scale) in _ropes_of(self.model, kinds.kinds).items()}
        self.inv_freq, self.rope_scaling = self.ropes[self.kinds[0]]
        self.softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.sandwich = LAYOUTS[cfg.model_type] == "sandwich"
        # invariant: attention through the row-invariant Triton kernel (trainer/decode/kernels.py), so that a verify
        # computes each token bitwise as a decode step does, in bf16 too (SDPA does not: docs/quality.md, "Exact
        # bf16"). The kernel computes plain causal softmax attention with plain RMSNorms; where it cannot run, SDPA
        # (eager attention for soft-capped scores), and `fallback` says why.
        self.fallback = None
        if invariant:
            self.fallback = self._why_not_invariant(weight)
        self.attention = "invariant" if invariant and self.fallback is None else \
            "eager" if self.softcap else "sdpa"
        shape = (rows, self.kv_heads, slots, self.head_dim)
        self.k = [torch.zeros(shape, dtype=weight.dtype, device=dev) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=weight.dtype, device=dev) for _ in self.layers]
        self.slot_ids = torch.arange(slots, device=dev)
        # padded: row r's first real token sits at slot row_start[r] (the caller writes it before the prefill).
        self.row_start = torch.zeros(rows, dtype=torch.long, device=dev)
        self.taps = set(target.layer_ids)
        # Plain RMSNorms are row-invariant (trainer/decode/kernels.py): a verify forward over 16 tokens must compute
        # each token exactly as a 1-token step does. Gemma's (1 + w) norms run as HF's modules.
        def wrap(module):
            return module if self.sandwich else RowInvariantRMSNorm(module)

        self.input_norms = [wrap(layer.input_layernorm) for layer in self.layers]
        self.post_norms = [wrap(layer.post_attention_layernorm) for layer in self.layers]
        self.pre_ff_norms = [layer.pre_feedforward_layernorm if self.sandwich else None for layer in self.layers]
        self.post_ff_norms = [layer.post_feedforward_layernorm if self.sandwich else None for layer in self.layers]
        self.q_norms = [wrap(layer.self_attn.q_norm) if hasattr(layer.self_attn, "q_norm") else _identity
                        for layer in self.layers]
        self.k_norms = [wrap(layer.self_attn.k_norm) if hasattr(layer.self_attn, "k_norm") else _identity
                        for layer in self.layers]
        self.final_norm = wrap(self.model.model.norm)

    def _why_not_invariant(self, weight: torch.Tensor) -> str | None:
        if self.softcap:
            return "the target soft-caps its attention scores"
        if SLIDING in self.kinds:
            return "the target has sliding-window layers"
        if self.sandwich:
            return "the target's (1 + w) RMSNorms"
        if self.padded:
            return "rows of different prompt lengths"
        if not (head_dim_supported(self.head_dim) and self.heads % self.kv_heads == 0):
            return f"head dim {self.head_dim} (the kernel takes powers of two >= 16)"
        if not usable_for(weight):
            return "the Triton kernel cannot run here (no Triton, or not CUDA)"
        return None

    @property
    def device(self) -> torch.device:
        return self.slot_ids.device

    def _masks(self, pos: torch.Tensor, span: int) -> dict[str, torch.Tensor]:
        """Per layer kind: visible [R or 1, 1, L, span] bool. A padded row's query sees no slot before the row's
        start, except its own slot when it is padding itself (a query that sees nothing would turn into NaN, and
        NaN K/V in a masked slot still poison the rows through 0 * NaN)."""
        s = self.slot_ids[:span]
        visible = s[None, :] <= pos[:, None]  # [L, span]
        if self.padded:
            lo = torch.minimum(self.row_start[:, None], pos[None, :])  # [R, L]
            visible = visible[None] & (s[None, None, :] >= lo[:, :, None])  # [R, L, span]
        else:
            visible = visible[None]
        masks = {FULL: visible[:, None]}
        if SLIDING in self.kinds:
            masks[SLIDING] = (visible & (s > pos[:, None] - self.window))[:, None]
        return masks

    @torch.no_grad()
    def forward(self, ids_RL: torch.Tensor, pos0: torch.Tensor, want_features: bool = True,
                last_only: bool = False, logits_at: torch.Tensor | None = None, span: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [R, L] (R = rows) at slots pos0..pos0+L-1 (pos0: 0-dim long device tensor) -> (logits [R, L, V]
        fp32 -- [R, 1, V] of the last position when `last_only`, of index `logits_at` ([1] long device tensor) when
        given --, tapped features [R, L, T*D] or None). Writes their K/V into slots pos0..pos0+L-1;
        pos0 + L <= slots. span: attention reads slots 0..span-1 only (pos0 + L <= span; default: every slot), so a
        short sequence in a long cache does not pay for the whole cache."""
        R, L = ids_RL.shape
        span = self.slots if span is None else span
        pos = pos0 + torch.arange(L, device=ids_RL.device)  # [L] slots
        x = self.target.embed_tokens(ids_RL)
        rope_pos = pos[None, :] - self.row_start[:, None] if self.padded else pos
        ropes = {kind: rope_from_inv_freq(rope_pos, inv, scale, x.dtype) for kind, (inv, scale) in self.ropes.items()}
        # the invariant kernel masks by position itself (full causal attention, rows unpadded)
        masks = None if self.attention == "invariant" else self._masks(pos, span)
        H, Hkv, Dh = self.heads, self.kv_heads, self.head_dim
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            kind = self.kinds[i]
            cos, sin = ropes[kind]
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
                keys, values = self.k[i][:, :, :span], self.v[i][:, :, :span]
                if self.softcap:
                    out = softcapped_attention(q, keys, values, masks[kind], attn.scaling, self.softcap)
                elif self.padded and H != Hkv:  # the batched generator (the batch-1 decoders keep enable_gqa)
                    out = grouped_sdpa(q, keys, values, masks[kind], attn.scaling)
                else:
                    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[kind], scale=attn.scaling,
                                                         enable_gqa=H != Hkv).transpose(1, 2)
            out = attn.o_proj(out.reshape(R, L, H * Dh))
            if self.sandwich:
                x = x + self.post_norms[i](out)
                x = x + self.post_ff_norms[i](layer.mlp(self.pre_ff_norms[i](x)))
            else:
                x = x + out
                x = x + layer.mlp(self.post_norms[i](x))
            if want_features and i in self.taps:
                taps[i] = x
        # last_only: a batch prefill needs only the next token ([R, P, V] fp32 logits would be GBs); logits_at: a
        # padded prefill needs the next token after its last real one.
        if logits_at is not None:
            x_out = x.index_select(1, logits_at)
        else:
            x_out = x[:, -1:] if last_only else x
        logits = self.target.lm_head(self.final_norm(x_out))
        if self.final_softcap:  # HF's order: in the model dtype, before the fp32 cast
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        feats = self.target.join_taps(taps, self.final_norm) if want_features else None
        return logits.float(), feats
