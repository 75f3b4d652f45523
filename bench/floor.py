"""The floor of one batched decode step: the least time a token step of `rows` rows can take on the GPU. Pure: no
torch.

    memory   every weight the step multiplies by, read once (the LM head whole; the input embedding not: a gather of
             `rows` rows), MoE experts counted as those `rows` tokens touch in expectation (E x (1 - (1 - k/E)^rows)
             per layer for k of E experts), plus each row's KV cache up to its context (a sliding-window layer up to
             its window), plus a Gated DeltaNet layer's recurrent state read and written, at HBM_BYTES_PER_S
    compute  the GEMMs: 2 x rows x the active weights (bench.shapes.target_layer_costs) + the LM head, and
             attention's 4 x head dim x heads x context per row and softmax layer, at GEMM_FLOPS_PER_S
    floor    max(memory, compute): the two overlap at best
Not counted: norms, RoPE, sampling, launch gaps, the recurrent layers' convolution. The context is the workload's
mean (prompt + half the answer: the mean over an answer's steps).
"""
from __future__ import annotations

from bench.shapes import target_layer_costs

HBM_BYTES_PER_S = 4.8e12  # H200 SXM HBM3e, datasheet
GEMM_FLOPS_PER_S = 790e12  # the bf16 GEMM ceiling measured on the H200 (docs/benchmarks.md, "MFU")


def experts_touched(experts: int, top_k: int, rows: int) -> float:
    """Distinct experts `rows` tokens route to in expectation, each picking `top_k` of `experts` uniformly."""
    return experts * (1 - (1 - top_k / experts) ** rows)


def step_floor(cfg, rows: int, context: float, dtype_bytes: int = 2,
               bandwidth: float = HBM_BYTES_PER_S, gemm_flops: float = GEMM_FLOPS_PER_S) -> dict:
    """cfg: an HF config (attribute access). -> bytes, flops and the floor in ms (module docstring)."""
    layers = target_layer_costs(cfg, cfg.num_hidden_layers)
    d = cfg.hidden_size
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    top_k = getattr(cfg, "num_experts_per_tok", 0) or 0
    expert = 3 * d * (getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size) if experts else 0
    touched = experts_touched(experts, top_k, rows) if experts else 0
    head = d * cfg.vocab_size
    weights = head + sum(layer.params - top_k * expert + touched * expert for layer in layers)
    cache = state = attention = 0.0
    for layer in layers:
        if layer.heads:
            seen = min(context, layer.window) if layer.window else context
            cache += rows * seen * 2 * kv * layer.head_dim * dtype_bytes
            attention += 4 * layer.head_dim * layer.heads * seen * rows
        else:  # Gated DeltaNet: its fp32 state, read and written
            state += 2 * rows * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    read = weights * dtype_bytes + cache + state
    flops = 2 * rows * (head + sum(layer.params for layer in layers)) + attention
    memory_ms, compute_ms = 1e3 * read / bandwidth, 1e3 * flops / gemm_flops
    return {"weight_bytes": weights * dtype_bytes, "kv_bytes": cache, "state_bytes": state, "flops": flops,
            "memory_ms": memory_ms, "compute_ms": compute_ms, "floor_ms": max(memory_ms, compute_ms),
            "bandwidth": bandwidth, "gemm_flops": gemm_flops}
