"""The drafter's activation dtype: bf16 everywhere under bf16 autocast (the CUDA step), fp32 without it (CPU runs)."""
from __future__ import annotations

import torch

import trainer.model.drafter as drafter_mod
from tests.trainer.test_traps import B, two_doc_batch
from trainer.model.attention import make_layout
from trainer.model.drafter import Drafter, DrafterConfig, RMSNorm, stream_dtype

CFG = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    num_layers=2, num_taps=2, rms_norm_eps=1e-6, rope_theta=10000.0)


def inputs(dtype):
    batch = two_doc_batch()
    g = torch.Generator().manual_seed(1)
    S, Q = batch.input_ids.shape[1], batch.anchor_pos.shape[1] * B
    feats = torch.randn(1, S, CFG.num_taps * CFG.hidden_size, generator=g).to(dtype)
    block = torch.randn(1, Q, CFG.hidden_size, generator=g).to(dtype)
    layout = make_layout(batch.position_ids, batch.doc_ids, batch.anchor_pos, batch.anchor_valid, B)
    return feats, block, layout


def record_dtypes(drafter, monkeypatch) -> list[tuple[str, torch.dtype]]:
    """(where, dtype) of every norm / linear input and of q, k, v at the attention call."""
    seen = []
    for name, m in drafter.named_modules():
        if isinstance(m, (RMSNorm, torch.nn.Linear)) and name != "fc":  # fc takes the target's features
            m.register_forward_pre_hook(lambda mod, args, name=name: seen.append((name, args[0].dtype)))
    real = drafter_mod.block_attention

    def spy(q, k, v, layout, backend):
        seen.extend([("q", q.dtype), ("k", k.dtype), ("v", v.dtype)])
        return real(q, k, v, layout, backend)

    monkeypatch.setattr(drafter_mod, "block_attention", spy)
    return seen


def test_under_bf16_autocast_every_activation_is_bf16_and_grads_stay_fp32(monkeypatch):
    torch.manual_seed(0)
    drafter = Drafter(CFG)
    seen = record_dtypes(drafter, monkeypatch)
    feats, block, layout = inputs(torch.bfloat16)  # a bf16 target's features and embeddings, as on CUDA
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = drafter(feats, block, layout)
    assert out.dtype == torch.bfloat16
    assert len(seen) > 20 and {d for _, d in seen} == {torch.bfloat16}, [w for w, d in seen if d != torch.bfloat16]
    out.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in drafter.parameters())


def test_bf16_stream_stays_close_to_the_fp32_drafter():
    torch.manual_seed(0)
    drafter = Drafter(CFG)
    feats, block, layout = inputs(torch.float32)
    with torch.no_grad():
        ref = drafter(feats, block, layout)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = drafter(feats.bfloat16(), block.bfloat16(), layout)
    assert ref.dtype == torch.float32
    rel = (got.float() - ref).norm() / ref.norm()
    assert rel < 3e-2, rel


def test_without_autocast_the_stream_is_the_parameter_dtype(monkeypatch):
    torch.manual_seed(0)
    drafter = Drafter(CFG)
    seen = record_dtypes(drafter, monkeypatch)
    with torch.no_grad():
        out = drafter(*inputs(torch.float32))
    assert out.dtype == torch.float32 and {d for _, d in seen} == {torch.float32}
    assert stream_dtype(torch.float32, "cpu") == torch.float32


def test_rmsnorm_in_fp32_is_the_qwen3_formula_bit_for_bit():
    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 16)
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(norm(x), want)
