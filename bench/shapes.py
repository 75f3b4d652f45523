"""Benchmark shapes as HF Qwen3 configs, and the useful-FLOPs formula over (target, drafter) dims. Pure: no torch.

The formula (docs/benchmarks.md "What is measured"; a matmul m x k by k x n = 2mkn, backward = 2 x forward):
  target   T = rows*seq tokens through the layers that run (0..last tap): 2*T*P per layer with
           P = D*Hq*hd + 2*D*Hkv*hd + Hq*hd*D + 3*D*I, plus attention 4*hd*Hq*(visible causal pairs, counted from the
           batch's documents); forward only.
  drafter  Tq = rows*anchors*block drafted positions: per layer 2*Tq*P + context K/V projections 4*T*D*Hkv*hd +
           attention 4*hd*Hq*(query-key pairs the block mask allows, counted exactly); x3 (forward + backward);
           fc (taps*D -> D) on the T context positions: forward + weight grad (x2).
  LM head  the frozen head on the rows*anchors*(block-1) supervised positions: forward + input grad, 2 * 2*D*V each.
  Not counted: norms, RoPE, softmax/CE elementwise work, optimizer, recomputation, the k = 0 block position.
"""
from __future__ import annotations

from dataclasses import dataclass

PEAK_FLOPS = 989e12  # H200 SXM dense bf16, datasheet (MFU denominator)

# name -> Qwen3Config fields (random init; the drafter copies width, heads, MLP size from the target).
SHAPES: dict[str, dict] = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "small": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=64, vocab_size=151936),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=1024),
}


def check_shape(name: str) -> None:
    if name not in SHAPES:
        raise SystemExit(f"unknown --shape {name!r}; choose one of {sorted(SHAPES)} (or pass --target DIR)")


def qwen3_config(name: str, max_positions: int):
    """The HF config of a named shape (Qwen3 defaults: RoPE theta 1e6, RMSNorm eps 1e-6, untied head)."""
    from transformers import Qwen3Config

    check_shape(name)
    return Qwen3Config(**SHAPES[name], rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       max_position_embeddings=max(max_positions, 4096))


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
class FlopShape:
    target: Dims
    target_layers_run: int  # 0..last tap
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
    target_pairs: float  # causal query-key pairs inside documents, all rows
    draft_pairs: float  # query-key pairs the drafter's block mask allows, all rows


def useful_flops(s: FlopShape, c: StepCounts) -> dict[str, float]:
    """Per-step useful FLOPs by part (module docstring)."""
    t, tq = c.rows * c.seq, c.rows * c.anchors * c.block
    a, b = s.target, s.drafter
    target = s.target_layers_run * (2 * t * a.layer_params + 4 * a.head_dim * a.heads * c.target_pairs)
    per_layer = (2 * tq * b.layer_params + 4 * t * b.hidden * b.kv_heads * b.head_dim
                 + 4 * b.head_dim * b.heads * c.draft_pairs)
    drafter = 3 * s.draft_layers * per_layer + 2 * (2 * t * s.taps * b.hidden * b.hidden)
    head = 2 * (2 * c.rows * c.anchors * (c.block - 1) * a.hidden * s.vocab)
    attention = (s.target_layers_run * 4 * a.head_dim * a.heads * c.target_pairs
                 + 3 * s.draft_layers * 4 * b.head_dim * b.heads * c.draft_pairs)
    total = target + drafter + head
    # matmul: what GEMM kernels compute (total less the attention pairs), the profile's GEMM-rate numerator
    return {"target": target, "drafter": drafter, "lm_head": head, "total": total, "matmul": total - attention}
