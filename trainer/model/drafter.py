"""The DFlash drafter: N Qwen3-style layers with KV injection of fused target features. Pure torch, no I/O.

Shape legend (suffixes in names): R rows, S context tokens, T taps, D hidden, Q = N*B block queries,
H / Hkv query / key-value heads, Dh head dim, F intermediate (MLP) size.

Parameter names follow z-lab's `DFlashDraftModel` (`layers.{i}.self_attn.q_proj`, ..., `fc`, `hidden_norm`, `norm`), so
`state_dict()` is the serving checkpoint. The drafter has no embedding and no LM head: the target's frozen ones are used.
A DFlash2 drafter (`DrafterConfig.dflash2`) adds, under the serving stacks' names, `layers.{i}.attention_conv` and
`layers.{i}.mlp_conv` (trainer/model/dynconv.py) and `candidate_selector` (trainer/model/selector.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.attention import FULL, SLIDING, BlockLayout, block_attention, mask_of
from trainer.model.dynconv import GroupedDynamicConv
from trainer.model.selector import CandidateSelector


@dataclass(frozen=True, kw_only=True)
class Dflash2Config:
    """DFlash2's structure: its `dflash_config` fields, the block size the convolution runs over and the vocabulary
    the selector's codebooks span."""

    block_size: int
    vocab_size: int
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int
    num_taps: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool = False
    # Per layer full_attention | sliding_attention (empty: every layer full). A sliding layer's query at position p
    # sees the `sliding_window` positions ending at p: causal inside its block, and the context just before it.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    dflash2: Dflash2Config | None = None  # None: a DFlash drafter

    def __post_init__(self) -> None:
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {FULL, SLIDING}:
                raise ValueError(f"layer_types must name {FULL} or {SLIDING} for each of the {self.num_layers} "
                                 f"layers, got {list(self.layer_types)}")
            if SLIDING in self.layer_types and not (self.sliding_window or 0) >= 1:
                raise ValueError("sliding-window layers need sliding_window >= 1")

    def kind(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL

    @property
    def window(self) -> int | None:
        """The sliding window, when some layer uses it."""
        return self.sliding_window if SLIDING in self.layer_types else None

    @staticmethod
    def from_target(hf_cfg, *, num_layers: int, num_taps: int, layer_types: tuple[str, ...] = (),
                    sliding_window: int | None = None, dflash2: Dflash2Config | None = None) -> "DrafterConfig":
        """As wide as the target (DFlash paper section 4.2): copy its dims, RoPE theta and norm eps; a dense MLP."""
        heads = hf_cfg.num_attention_heads
        return DrafterConfig(
            hidden_size=hf_cfg.hidden_size, intermediate_size=dense_mlp_size(hf_cfg),
            num_attention_heads=heads, num_key_value_heads=getattr(hf_cfg, "num_key_value_heads", heads),
            head_dim=getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads,
            num_layers=num_layers, num_taps=num_taps, rms_norm_eps=hf_cfg.rms_norm_eps,
            rope_theta=rope_theta_of(hf_cfg), attention_bias=bool(getattr(hf_cfg, "attention_bias", False)),
            layer_types=tuple(layer_types), sliding_window=sliding_window, dflash2=dflash2)


def dense_mlp_size(hf_cfg) -> int:
    """The drafter's MLP width: the target's own where its MLPs are dense; three times the hidden size for an MoE
    target, whose `intermediate_size` (where it has one) may be an expert's (gpt-oss: 2880 at hidden 2880)."""
    moe = any(getattr(hf_cfg, key, None) for key in ("num_experts", "num_local_experts"))
    return 3 * hf_cfg.hidden_size if moe else hf_cfg.intermediate_size


def rope_theta_of(hf_cfg) -> float:
    """transformers 5 keeps theta in `rope_parameters`; 4.x had `rope_theta`."""
    params = getattr(hf_cfg, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(hf_cfg, "rope_theta", 10000.0))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 like Qwen3RMSNorm; scale and return in the input dtype. Under autocast (bf16 input) that
        # is a bf16 model's norm, its weight rounded to bf16 as autocast rounds the linears' weights; in fp32 the
        # weight cast is a no-op.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * x32.to(x.dtype)


def stream_dtype(param_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The drafter's activation dtype (residual stream, context, q/k, RoPE tables): the autocast dtype when autocast is
    on for `device_type` -- a bf16 model's numerics over fp32 master weights, as DFlash/SpecForge train, and half the
    bytes of every elementwise kernel -- else the parameter dtype (fp32 CPU runs stay fp32 throughout)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return param_dtype


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [R, L] -> cos, sin [R, 1, L, Dh] (HF "rotate_half" layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    freqs = pos.float()[..., None] * inv_freq  # [R, L, Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DraftAttention(nn.Module):
    """Q from the block only; K/V = [proj(context features); proj(block)], k_norm + RoPE on both."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        D, H, Hkv, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.Hkv, self.Dh = H, Hkv, Dh
        self.q_proj = nn.Linear(D, H * Dh, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(D, Hkv * Dh, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(D, Hkv * Dh, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * Dh, D, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps)

    def forward(self, x_RQD: torch.Tensor, ctx_RSD: torch.Tensor, rope_q, rope_k, mask, backend: str) -> torch.Tensor:
        R, Q, _ = x_RQD.shape
        q = self.q_norm(self.q_proj(x_RQD).view(R, Q, self.H, self.Dh)).transpose(1, 2)  # [R, H, Q, Dh]
        kv_in = torch.cat([ctx_RSD, x_RQD], dim=1)  # [R, S+Q, D]
        k = self.k_norm(self.k_proj(kv_in).view(R, -1, self.Hkv, self.Dh)).transpose(1, 2)  # [R, Hkv, S+Q, Dh]
        v = self.v_proj(kv_in).view(R, -1, self.Hkv, self.Dh).transpose(1, 2)
        q = apply_rope(q, *rope_q)
        k = apply_rope(k, *rope_k)
        out = block_attention(q, k, v, mask, backend)  # [R, H, Q, Dh]
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, self.H * self.Dh))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, kind: str = FULL) -> None:
        super().__init__()
        self.kind = kind
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x_RQD, ctx_RSD, rope_q, rope_k, layout: BlockLayout, backend: str) -> torch.Tensor:
        # The context features bypass input_layernorm, the Q/O projections and the MLP (z-lab DFlash layout).
        x_RQD = x_RQD + self.self_attn(self.input_layernorm(x_RQD), ctx_RSD, rope_q, rope_k,
                                       mask_of(layout, self.kind), backend)
        return x_RQD + self.mlp(self.post_attention_layernorm(x_RQD))


class Dflash2Layer(DraftLayer):
    """A DraftLayer with DFlash2's convolution around its attention and around its MLP (SGLang's and SpecForge's
    order: norm -> conv -> sublayer -> conv -> residual)."""

    def __init__(self, cfg: DrafterConfig, kind: str = FULL) -> None:
        super().__init__(cfg, kind)
        d2 = cfg.dflash2
        conv = (cfg.hidden_size, d2.block_size, d2.conv_kernel_size, d2.conv_group_size)
        self.attention_conv = GroupedDynamicConv(*conv)
        self.mlp_conv = GroupedDynamicConv(*conv)

    def forward(self, x_RQD, ctx_RSD, rope_q, rope_k, layout: BlockLayout, backend: str) -> torch.Tensor:
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x_RQD))
        h = self.self_attn(h, ctx_RSD, rope_q, rope_k, mask_of(layout, self.kind), backend)
        x_RQD = x_RQD + self.attention_conv.finish(h, kernel)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x_RQD))
        return x_RQD + self.mlp_conv.finish(self.mlp(h), kernel)


class Drafter(nn.Module):
    """forward(features [R, S, T*D], block embeddings [R, Q, D], layout) -> final-normed hidden [R, Q, D] in
    `stream_dtype` (bf16 under bf16 autocast; the parameters' dtype otherwise)."""

    def __init__(self, cfg: DrafterConfig, backend: str = "sdpa") -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        layer = DraftLayer if cfg.dflash2 is None else Dflash2Layer
        self.layers = nn.ModuleList(layer(cfg, cfg.kind(i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.dflash2 is not None:
            d2 = cfg.dflash2
            self.candidate_selector = CandidateSelector(cfg.hidden_size, d2.vocab_size, d2.selector_rank,
                                                        d2.selector_top_k)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Qwen-style init: normal(0, 0.02) linears, unit norms. Deterministic under torch.manual_seed."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.02)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        # DFlash2's additions start as no-ops (after the loop above, which drew their projections like any linear).
        for m in self.modules():
            if isinstance(m, (GroupedDynamicConv, CandidateSelector)):
                m.reset_parameters()

    def forward(self, feats_RSTD: torch.Tensor, block_RQD: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        dtype = stream_dtype(self.fc.weight.dtype, feats_RSTD.device.type)
        if not torch.is_autocast_enabled(feats_RSTD.device.type):
            # Without autocast (CPU, or a bf16 target under an fp32 drafter) match the weights. Under autocast the
            # bf16 features go straight into fc: an fp32 copy of [R, S, T*D] would cost GBs at the GPU recipe.
            feats_RSTD = feats_RSTD.to(dtype)
        ctx_RSD = self.hidden_norm(self.fc(feats_RSTD))  # in `dtype`: fc gives it, the norm keeps it
        x_RQD = block_RQD.to(dtype)  # the residual stream
        Dh, theta = self.cfg.head_dim, self.cfg.rope_theta
        # Context keys use their own (per-document) positions; block tokens use anchor_pos + k.
        rope_q = rope_cos_sin(layout.q_rope_pos, Dh, theta, dtype)
        rope_k = rope_cos_sin(torch.cat([layout.ctx_rope_pos, layout.q_rope_pos], dim=1), Dh, theta, dtype)
        for layer in self.layers:
            x_RQD = layer(x_RQD, ctx_RSD, rope_q, rope_k, layout, self.backend)
        return self.norm(x_RQD)
