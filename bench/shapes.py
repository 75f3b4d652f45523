"""Benchmark shapes as HF configs, and the useful-FLOPs formula over (target, drafter) dims. Pure: no torch.

The formula (docs/benchmarks.md "What is measured"; a matmul m x k by k x n = 2mkn, backward = 2 x forward):
  target   T = rows*seq tokens through the layers that run (0..last tap): per layer 2*T*P, P = the weights every
           token multiplies by (an MoE layer's experts: the top-k share, the router and shared experts whole; the
           active parameters), plus attention 4*hd*Hq*(visible causal pairs, counted from the batch's documents,
           inside the window for sliding layers), or for a Gated DeltaNet layer its chunked delta rule,
           Hv*(6*dk*dv + L*(dk + dv)) per token at chunk length L; forward only.
  drafter  Tq = rows*anchors*block drafted positions: per layer 2*Tq*P + context K/V projections 4*T*D*Hkv*hd +
           attention 4*hd*Hq*(query-key pairs the block mask allows, counted exactly); x3 (forward + backward);
           fc (taps*D -> D) on the T context positions: forward + weight grad (x2).
  LM head  the frozen head on the rows*anchors*(block-1) supervised positions: forward + input grad, 2 * 2*D*V each.
  Not counted: norms, RoPE, softmax/CE elementwise work, gates and convolutions (a DFlash2 drafter's too), a DFlash2
  drafter's candidate selector, optimizer, recomputation, the k = 0 block position.
"""
from __future__ import annotations

from dataclasses import dataclass

PEAK_FLOPS = 989e12  # H200 SXM dense bf16, datasheet (MFU denominator)

# name -> HF config fields (random init; the drafter copies width and heads from the target, a dense MLP). Shapes of
# the public configs; `model_type` picks the family (transformers' defaults for what is not listed).
SHAPES: dict[str, dict] = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "small": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=151936),
    "tiny": dict(model_type="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024),
    # Qwen3.5-9B's language model: 3 Gated DeltaNet layers to 1 full-attention layer (output gate, partial RoPE)
    "qwen3.5-9b": dict(model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4),
    # Qwen3.5-35B-A3B's language model: the 3 : 1 hybrid with 256 experts (top 8) and a gated shared expert
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256, vocab_size=248320,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, linear_num_key_heads=16, linear_num_value_heads=32,
                            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    # gpt-oss-20b: attention sinks, sliding (128) and full layers alternating, 32 biased experts, top 4
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128),
}


def check_shape(name: str) -> None:
    if name not in SHAPES:
        raise SystemExit(f"unknown --shape {name!r}; choose one of {sorted(SHAPES)} (or pass --target DIR)")


def target_config(name: str, max_positions: int):
    """The HF config of a named shape. Qwen3 shapes: RoPE theta 1e6, RMSNorm eps 1e-6, untied head; the others
    their family's defaults (untied heads)."""
    from transformers import AutoConfig

    check_shape(name)
    fields = dict(SHAPES[name])
    model_type = fields.pop("model_type")
    if model_type == "qwen3":
        fields.update(rope_theta=1_000_000.0, rms_norm_eps=1e-6)
    return AutoConfig.for_model(model_type, **fields, tie_word_embeddings=False,
                                max_position_embeddings=max(max_positions, 4096))


def qwen3_config(name: str, max_positions: int):
    """The Qwen3Config of a named Qwen3 shape (the programs that build a Qwen3ForCausalLM)."""
    check_shape(name)
    if SHAPES[name]["model_type"] != "qwen3":
        raise SystemExit(f"--shape {name!r} is a {SHAPES[name]['model_type']} target; this program takes a Qwen3 "
                         f"shape ({', '.join(n for n, f in SHAPES.items() if f['model_type'] == 'qwen3')})")
    return target_config(name, max_positions)


@dataclass(frozen=True)
class Dims:
    """Transformer layer dims: hidden, query heads, key/value heads, head dim, MLP intermediate."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def layer_params(self) -> int:
        d, hd = self.hidden, self.head_dim
        return d * self.heads * hd + 2 * d * self.kv_heads * hd + self.heads * hd * d + 3 * d * self.intermediate


@dataclass(frozen=True)
class TargetLayer:
    """One target layer that runs: the weights each token multiplies by and what mixes its tokens."""

    params: float  # active weights (MoE experts: the top-k share)
    heads: int = 0  # softmax attention: query heads (0: none)
    head_dim: int = 0
    window: int | None = None  # sliding-window attention
    recurrent: float = 0.0  # Gated DeltaNet: FLOPs per token of the chunked delta rule


def delta_rule_flops(value_heads: int, key_dim: int, value_dim: int, chunk: int = 64) -> float:
    """Per token, one Gated DeltaNet layer's chunked delta rule (module docstring)."""
    return value_heads * (6 * key_dim * value_dim + chunk * (key_dim + value_dim))


# Families whose full-attention layers gate their output by a second half of q_proj
GATED_ATTENTION = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def target_layer_costs(cfg, layers_run: int) -> tuple[TargetLayer, ...]:
    """The first `layers_run` layers of an HF config (attribute access; its text config for a multimodal one) as
    TargetLayers: attention (an output gate doubles q_proj), Gated DeltaNet projections, a dense MLP or the
    active share of the experts (+ router, + shared expert)."""
    d = cfg.hidden_size
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    hd = getattr(cfg, "head_dim", None) or d // heads
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        expert = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        mlp = cfg.num_experts_per_tok * 3 * d * expert + d * experts + 3 * d * (
            getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    else:
        mlp = 3 * d * cfg.intermediate_size
    gate = 2 if cfg.model_type in GATED_ATTENTION else 1
    attention = gate * d * heads * hd + 2 * d * kv * hd + heads * hd * d
    window = getattr(cfg, "sliding_window", None)
    out = []
    for kind in types[:layers_run]:
        if kind == "linear_attention":
            hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            projections = d * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * d
            out.append(TargetLayer(params=projections + mlp, recurrent=delta_rule_flops(hv, dk, dv)))
        else:
            out.append(TargetLayer(params=attention + mlp, heads=heads, head_dim=hd,
                                   window=window if kind == "sliding_attention" else None))
    return tuple(out)


@dataclass(frozen=True)
class FlopShape:
    target_layers: tuple[TargetLayer, ...]  # 0..last tap
    target_hidden: int
    drafter: Dims
    draft_layers: int
    taps: int
    vocab: int


@dataclass(frozen=True)
class StepCounts:
    """What one optimizer step (all micro-batches) holds."""

    rows: int
    seq: int
    anchors: int
    block: int
    target_pairs: dict  # attention window (None: full) -> causal query-key pairs inside documents, all rows
    draft_pairs: float  # query-key pairs the drafter's block mask allows, all rows


def useful_flops(s: FlopShape, c: StepCounts) -> dict[str, float]:
    """Per-step useful FLOPs by part (module docstring)."""
    t, tq = c.rows * c.seq, c.rows * c.anchors * c.block
    b = s.drafter
    target_attention = sum(4 * layer.head_dim * layer.heads * c.target_pairs[layer.window] + t * layer.recurrent
                           for layer in s.target_layers)
    target = sum(2 * t * layer.params for layer in s.target_layers) + target_attention
    per_layer = (2 * tq * b.layer_params + 4 * t * b.hidden * b.kv_heads * b.head_dim
                 + 4 * b.head_dim * b.heads * c.draft_pairs)
    drafter = 3 * s.draft_layers * per_layer + 2 * (2 * t * s.taps * b.hidden * b.hidden)
    head = 2 * (2 * c.rows * c.anchors * (c.block - 1) * s.target_hidden * s.vocab)
    attention = target_attention + 3 * s.draft_layers * 4 * b.head_dim * b.heads * c.draft_pairs
    total = target + drafter + head
    # matmul: what GEMM kernels compute (total less the attention pairs), the profile's GEMM-rate numerator
    return {"target": target, "drafter": drafter, "lm_head": head, "total": total, "matmul": total - attention}


def first_layer(name: str):
    """(the HF config, the first decoder layer) of a one-layer model of a named shape, random weights, bf16 on CUDA:
    what the kernel benches time a layer's modules on (its first layer's kind, where the shape has several)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = target_config(name, 4096)
    cfg.num_hidden_layers = 1
    if hasattr(cfg, "layer_types"):
        cfg.layer_types = cfg.layer_types[:1]
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return cfg, model.to("cuda").model.layers[0]  # .to: a no-op where the device context was honoured
