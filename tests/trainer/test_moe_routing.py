"""MoE layers of the tiny targets, loaded as the trainer loads them (`load_target`: HF's experts as grouped GEMMs),
against a naive reference written here from each family's routing rule: per token, a softmax over the router's
logits, the top-k experts, their weights renormalised to sum to 1 where the family does (Qwen3-MoE under
`norm_topk_prob`, Mixtral, Qwen3.5-MoE; gpt-oss: a softmax over the top-k logits alone), and the sum of each chosen
expert's output times its weight (plus the gated shared expert of Qwen3-Next and Qwen3.5-MoE). Router and expert
weights are redrawn large enough that routing differs from token to token and the renormalisation matters."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.families import build_family_target

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_next", "qwen3_5_moe")
TOKENS = 24


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_family_target(tmp_path_factory.mktemp(family), family)
        return built[family]

    return get


def routing_rule(family: str, config: dict) -> str:
    """'renorm' (softmax, top-k, renormalised), 'plain' (softmax, top-k) or 'topk_softmax' (gpt-oss)."""
    if family == "gpt_oss":
        return "topk_softmax"
    if family in ("mixtral", "qwen3_5_moe"):
        return "renorm"
    return "renorm" if config["norm_topk_prob"] else "plain"


def routed(logits: torch.Tensor, k: int, rule: str) -> list[tuple[int, float]]:
    """One token's logits [E] -> [(expert, weight)] of its top k."""
    if rule == "topk_softmax":
        top = sorted(range(len(logits)), key=lambda e: -float(logits[e]))[:k]
        z = torch.tensor([float(logits[e]) for e in top])
        return list(zip(top, (z.exp() / z.exp().sum()).tolist()))
    p = logits.double().exp() / logits.double().exp().sum()
    top = sorted(range(len(p)), key=lambda e: -float(p[e]))[:k]
    total = sum(float(p[e]) for e in top) if rule == "renorm" else 1.0
    return [(e, float(p[e]) / total) for e in top]


def expert_out(family: str, experts, e: int, x: torch.Tensor) -> torch.Tensor:
    if family == "gpt_oss":  # [H, 2I] interleaved gate/up, biases, clamped GLU
        gu = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        gate, up = gu[::2].clamp(max=experts.limit), gu[1::2].clamp(-experts.limit, experts.limit)
        return ((up + 1) * gate * torch.sigmoid(gate * experts.alpha)) @ experts.down_proj[e] \
            + experts.down_proj_bias[e]
    inter = experts.gate_up_proj.shape[1] // 2  # [2I, H]: gate rows, then up rows
    gate, up = experts.gate_up_proj[e, :inter] @ x, experts.gate_up_proj[e, inter:] @ x
    return experts.down_proj[e] @ (F.silu(gate) * up)


def reference(family: str, block, config: dict, x: torch.Tensor, rule: str) -> torch.Tensor:
    router = block.router if family == "gpt_oss" else block.gate
    k = config["num_experts_per_tok"]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = router.weight @ x[t] + (router.bias if family == "gpt_oss" else 0)
        for e, w in routed(logits, k, rule):
            out[t] += w * expert_out(family, block.experts, e, x[t])
        if hasattr(block, "shared_expert"):
            s = block.shared_expert
            shared = s.down_proj.weight @ (F.silu(s.gate_proj.weight @ x[t]) * (s.up_proj.weight @ x[t]))
            out[t] += torch.sigmoid(block.shared_expert_gate.weight @ x[t]) * shared
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_layers_route_and_weight_experts_as_the_family_defines(family, family_dir):
    from trainer.model.target import load_target

    path = family_dir(family)
    config = json.loads((path / "config.json").read_text())
    target = load_target(path, num_draft_layers=2, layer_ids=(1, 3), dtype="float32", truncate=False)
    block = next(layer.mlp for layer in target.model.model.layers if hasattr(layer.mlp, "experts"))
    assert block.experts.config._experts_implementation == "grouped_mm"  # what the trainer runs (capturable)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "router" in name or name.startswith("gate.")
                                                            else 0.3))
    x = torch.randn(TOKENS, config["hidden_size"], generator=gen)
    with torch.no_grad():
        got = block(x[None])
        got = (got[0] if isinstance(got, tuple) else got)[0]
        rule = routing_rule(family, config)
        want = reference(family, block, config, x, rule)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        chosen = {tuple(sorted(e for e, _ in routed(block_logits, config["num_experts_per_tok"], rule)))
                  for block_logits in (x @ (block.router if family == "gpt_oss" else block.gate).weight.T)}
        assert len(chosen) >= 3  # the tokens go to different experts
        if rule == "renorm":  # the renormalisation changes the answer here: a test that ignored it would fail
            assert not torch.allclose(reference(family, block, config, x, "plain"), want, atol=1e-3)
