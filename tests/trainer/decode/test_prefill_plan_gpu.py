"""The whole-prompt prefill on CUDA (run on the H200: `python3 -m pytest -m gpu tests/trainer/decode`): its attention
(causal SDPA over the forward's own keys, grouped-query heads) has a flash kernel at the serving shapes, so it never
falls back to SDPA's math backend; and prefilled whole or in masked chunks over the cache, a bf16 target and a hybrid
(fla's kernels over wide forwards) give the same caches and answers; its q/k norms, RoPE and cache writes through
step_inputs.py's kernel give the torch form's bits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.trainer.decode.test_generate import prompts_of
from trainer.decode import prefill_plan
from trainer.decode.generate import BatchGenerator, Sampling
from trainer.decode.layers.attention import AttentionLayer
from trainer.model.target import load_target

pytestmark = pytest.mark.gpu


def cuda_target(family_dirs, family: str, dtype: str):
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    return load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), device="cuda", dtype=dtype,
                       truncate=False)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (16, 2, 256), (32, 4, 128)])
def test_the_whole_prompt_attention_has_a_flash_kernel(heads, kv_heads, head_dim):
    """qwen3-8b's heads, Qwen3.5's full-attention layers', Qwen3-30B-A3B's: bf16, 4 rows of 1,000 positions."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4, 1000, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    k, v = (torch.randn(4, 1000, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16,
                        generator=gen).transpose(1, 2) for _ in range(2))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        fast = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    reps = heads // kv_heads
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(reps, 1),
                                         v.float().repeat_interleave(reps, 1), is_causal=True)
    torch.testing.assert_close(fast.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family,dtype", [("qwen3", "bfloat16"), ("qwen3_5", "float32")])
def test_whole_and_chunked_prefills_agree(family, dtype, family_dirs, monkeypatch):
    target = cuda_target(family_dirs, family, dtype)
    prompts = prompts_of(target, (200, 37, 150, 12, 90), seed=9)
    sampling = Sampling(max_new_tokens=16)
    whole = BatchGenerator(target, rows=5, max_len=256, stop_ids=[])
    assert whole.static.whole_prefill
    got = whole.generate(prompts, sampling)
    monkeypatch.setattr(prefill_plan, "PREFILL_TOKENS", 8)  # every prompt in masked chunks over the cache
    monkeypatch.setattr(prefill_plan, "PREFILL_CHUNK", 64)
    chunked = BatchGenerator(target, rows=5, max_len=256, stop_ids=[])
    want = chunked.generate(prompts, sampling)
    assert chunked.last_run.prefills > whole.last_run.prefills
    tol = dict(rtol=5e-2, atol=5e-2) if dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-4)
    for layer_w, layer_c in zip(whole.static.k, chunked.static.k):
        if layer_w is None:  # a linear layer
            continue
        for r, p in enumerate(prompts):
            torch.testing.assert_close(layer_w[r, :, :len(p)].float(), layer_c[r, :, :len(p)].float(), **tol)
    if dtype == "float32":
        assert got == want
    else:  # bf16: kernels of different summation orders may part at a near-tie; the first tokens agree
        assert sum(a[0] == b[0] for a, b in zip(got, want)) >= len(prompts) - 1


@pytest.mark.parametrize("family,dtype", [("qwen3", "bfloat16"), ("qwen3_5", "bfloat16"), ("qwen3", "float32")])
def test_the_fused_prefill_inputs_give_the_torch_forms_bits(family, dtype, family_dirs, monkeypatch):
    """Every attention layer's whole-prompt prefills through the kernel (`AttentionLayer._fresh_inputs`), then the
    same prompts through the torch form: the answers equal; in bf16 the caches' prompt slots bit for bit, in fp32
    within 1e-4 (there the torch form's q/k norms over [R', L] rows and SDPA's fp32 kernel may sum in another order)."""
    target = cuda_target(family_dirs, family, dtype)
    prompts = prompts_of(target, (200, 37, 150, 12, 90), seed=9)
    sampling = Sampling(max_new_tokens=12)
    fused = BatchGenerator(target, rows=5, max_len=256, stop_ids=[])
    got = fused.generate(prompts, sampling)
    layers = [m for m in fused.static.mixers if isinstance(m, AttentionLayer)]
    assert layers and all(m.fused_prefills >= 1 for m in layers)
    monkeypatch.setattr(AttentionLayer, "_fresh_inputs", lambda self, *args: None)  # the torch form instead
    plain = BatchGenerator(target, rows=5, max_len=256, stop_ids=[])
    assert plain.generate(prompts, sampling) == got
    for caches in (fused.static.k, plain.static.k), (fused.static.v, plain.static.v):
        for i, (a, b) in enumerate((a, b) for a, b in zip(*caches) if a is not None):
            for r, p in enumerate(prompts):
                if dtype == "bfloat16":
                    assert torch.equal(a[r, :, :len(p)], b[r, :, :len(p)]), (i, r)
                else:
                    torch.testing.assert_close(a[r, :, :len(p)], b[r, :, :len(p)], rtol=1e-4, atol=1e-4)


def test_the_whole_prompt_prefill_runs_flash_attention_not_cudnns(family_dirs):
    """cuDNN's attention builds an execution plan per new shape, and a refill's rows and width vary: the prefill asks
    for flash attention (`PREFILL_BACKENDS`)."""
    from torch.profiler import ProfilerActivity, profile

    target = cuda_target(family_dirs, "qwen3", "bfloat16")
    prompts = prompts_of(target, (40, 33, 20), seed=2)
    gen = BatchGenerator(target, rows=3, max_len=64, stop_ids=[], graphs=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen.generate(prompts, Sampling(max_new_tokens=2))
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not any("cudnn" in n.lower() for n in names) and any("flash" in n.lower() for n in names), names
