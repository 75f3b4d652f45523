"""The refilling batch generator's step inputs as one kernel (trainer/decode/step_inputs.py) on CPU tensors under
Triton's interpreter: q and k normed and turned and the K/V cache writes equal today's torch form (the stack's q/k
norm wrappers, `partial_rope`, `AttentionLayer._write`), exactly in fp32; every other cache slot is untouched; and
the batch generator's steps take it (its answers still HF's). tests/trainer/decode/test_step_inputs_gpu.py checks
the bf16 bits on the H200."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from trainer.decode import step_inputs as si
from trainer.decode.kernels import RowInvariantRMSNorm
from trainer.decode.layers.attention import INVARIANT, AttentionLayer, Step, partial_rope, rope_from_inv_freq
from trainer.model.attention import FULL


def qk_norms(kind: str | None, head_dim: int, dtype, g: torch.Generator, device="cpu"):
    """The stack's q/k norm wrappers over HF modules with random weights: plain (Qwen3's), offset (Gemma's, the
    hybrids' rule), or none."""
    if kind is None:
        return None, None
    module = Qwen3RMSNorm if kind == "plain" else GemmaRMSNorm
    norms = []
    for eps in (1e-6, 1e-5):
        m = module(head_dim, eps=eps)
        with torch.no_grad():
            m.weight.copy_(torch.randn(head_dim, generator=g) * 0.3 + (1.0 if kind == "plain" else 0.0))
        m.to(device=device, dtype=dtype)
        norms.append(RowInvariantRMSNorm(m, offset=kind == "offset"))
    return tuple(norms)


def case(R, H, Hkv, Dh, S, dtype, norm, rot=None, seed=0, device="cpu"):
    """Projections of one token a row (q a strided view, as a gated layer's), caches of random junk, rows at
    distinct positions spread over the slots (R <= S), their cos / sin (RoPE on the first `rot` dims)."""
    g = torch.Generator().manual_seed(seed)
    rot = rot or Dh
    q = torch.randn(R, 1, H, 2 * Dh, generator=g).to(device, dtype)[..., :Dh]  # every head's first half: strided
    k, v = (torch.randn(R, 1, Hkv * Dh, generator=g).to(device, dtype) for _ in range(2))
    k_cache, v_cache = (torch.randn(R, Hkv, S, Dh, generator=g).to(device, dtype) for _ in range(2))
    pos = torch.randperm(S, generator=g)[:R].view(R, 1).to(device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, device=device).float() / rot))
    cos, sin = rope_from_inv_freq(pos, inv_freq, 1.0, dtype)
    return q, k, v, k_cache, v_cache, pos, cos, sin, qk_norms(norm, Dh, dtype, g, device)


def torch_form(q, k, v, k_cache, v_cache, pos, cos, sin, norms):
    """What AttentionLayer computes for the step without the kernel -> q [R, H, 1, Dh] and the caches written."""
    R, _, H, Dh = q.shape
    Hkv = k.shape[-1] // Dh
    q_norm, k_norm = (n or (lambda x: x) for n in norms)
    qn = partial_rope(q_norm(q).transpose(1, 2), cos, sin)
    kn = partial_rope(k_norm(k.view(R, 1, Hkv, Dh)).transpose(1, 2), cos, sin)
    layer = AttentionLayer(SimpleNamespace(), FULL, None, None, R, 1, H, Hkv, Dh, q.dtype, q.device)
    layer.k, layer.v = k_cache, v_cache
    step = Step(pos, {}, None, k_cache.shape[2], INVARIANT, None, True, rows=torch.arange(R, device=q.device))
    layer._write(step, kn, v.view(R, 1, Hkv, Dh).transpose(1, 2))
    return qn


def fused(q, k, v, k_cache, v_cache, pos, cos, sin, norms):
    R, _, H, Dh = q.shape
    Hkv = k.shape[-1] // Dh
    assert si.fits(q, k_cache, cos, *norms)
    return si.step_inputs(q[:, 0], k.view(R, Hkv, Dh), v.view(R, Hkv, Dh), k_cache, v_cache, pos, cos, sin, *norms)


def both(*args):
    """(torch form's q, k cache, v cache), (the kernel's), from the same inputs and caches."""
    q, k, v, k_cache, v_cache, pos, cos, sin, norms = args
    caches = k_cache.clone(), v_cache.clone()
    want = torch_form(q, k, v, *caches, pos, cos, sin, norms), *caches
    caches = k_cache.clone(), v_cache.clone()
    got = fused(q, k, v, *caches, pos, cos, sin, norms), *caches
    return want, got


@pytest.mark.parametrize("norm", [None, "plain", "offset"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (8, 4, 128), (8, 2, 64), (8, 2, 128)])
def test_fp32_equals_the_torch_form_exactly(interpreter, norm, heads, kv_heads, head_dim):
    """G = 1, 2, 4; head dims 64 and 128; no norm (Llama), plain (Qwen3) and offset (Gemma, the hybrids): q and
    both whole caches (the written slots and every other) bit for bit."""
    args = case(3, heads, kv_heads, head_dim, 24, torch.float32, norm, seed=heads + head_dim)
    want, got = both(*args)
    assert got[0].shape == (3, heads, 1, head_dim)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert not torch.equal(got[1], args[3])  # the kernel wrote something


@pytest.mark.parametrize("norm", [None, "plain", "offset"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 8, 64), (8, 4, 128), (8, 2, 128)])
def test_bf16_agrees_and_touches_only_the_rows_slots(interpreter, norm, heads, kv_heads, head_dim):
    """bf16: within the interpreter's rounding toward zero (an ulp or two of the terms; the H200's bits:
    test_step_inputs_gpu.py); v's copy and every slot but pos[r] of row r exactly."""
    args = case(4, heads, kv_heads, head_dim, 32, torch.bfloat16, norm, seed=heads * kv_heads)
    pos = args[5]
    want, got = both(*args)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=0.05, rtol=2 ** -6)
    written = torch.zeros(args[3].shape[0], args[3].shape[2], dtype=torch.bool)
    written[torch.arange(4), pos[:, 0]] = True
    for w, g, before in zip(want[1:], got[1:], args[3:5]):
        assert torch.equal(g.transpose(1, 2)[~written], before.transpose(1, 2)[~written])
        torch.testing.assert_close(g.float(), w.float(), atol=0.05, rtol=2 ** -6)
    assert torch.equal(got[2], want[2])  # v is copied, not computed


@pytest.mark.parametrize("norm", [None, "offset"])
def test_a_row_subset_writes_its_own_cache_rows_only(interpreter, norm):
    """The generator's compacted step: tokens of cache rows 1, 3 and 4 of six compute what the torch form computes
    over those rows, write their slots of those cache rows, and leave the other rows bit for bit as they were."""
    q, k, v, _, _, pos, cos, sin, norms = case(3, 8, 2, 64, 24, torch.float32, norm, seed=11)
    g = torch.Generator().manual_seed(12)
    k_cache, v_cache = (torch.randn(6, 2, 24, 64, generator=g) for _ in range(2))
    rows, others = torch.tensor([1, 3, 4]), torch.tensor([0, 2, 5])
    sub = k_cache[rows].clone(), v_cache[rows].clone()
    want = torch_form(q, k, v, *sub, pos, cos, sin, norms)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = si.step_inputs(q[:, 0], k.view(3, 2, 64), v.view(3, 2, 64), kc, vc, pos, cos, sin, *norms, rows=rows)
    assert torch.equal(got, want)
    for cache, before, written in ((kc, k_cache, sub[0]), (vc, v_cache, sub[1])):
        assert torch.equal(cache[rows], written) and not torch.equal(written, before[rows])
        assert torch.equal(cache[others], before[others])


def test_partial_rotary_turns_the_first_dims_only(interpreter):
    """The hybrids' gated layers: RoPE on the first quarter of a 64-dim head, offset norms; the rest passes through
    normed, fp32 exactly."""
    args = case(3, 4, 2, 64, 16, torch.float32, "offset", rot=16, seed=7)
    want, got = both(*args)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.mark.parametrize("norm, rot", [("plain", None), ("offset", 16)])
def test_a_whole_prompt_prefill_as_one_token_rows(interpreter, norm, rot):
    """A whole-prompt prefill (layers/attention.py `_fresh_inputs`): 2 prompts of 5 tokens at positions 0..4 of
    cache rows 3 and 1, their 10 tokens as one-token rows: q, the turned k (`k_out`) and both caches equal the torch
    form of the prefill over [R', L] bit for bit in fp32, cache rows 0 and 2 untouched."""
    R, L, H, Hkv, Dh = 2, 5, 4, 2, 64
    g = torch.Generator().manual_seed(21)
    q = torch.randn(R, L, H, 2 * Dh, generator=g)[..., :Dh]
    k, v = (torch.randn(R, L, Hkv * Dh, generator=g) for _ in range(2))
    k_cache, v_cache = (torch.randn(4, Hkv, 8, Dh, generator=g) for _ in range(2))
    rows, pos = torch.tensor([3, 1]), torch.arange(L).expand(R, L)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot or Dh, 2).float() / (rot or Dh)))
    cos, sin = rope_from_inv_freq(pos, inv_freq, 1.0, torch.float32)  # [R, 1, L, rot]
    norms = qk_norms(norm, Dh, torch.float32, g)
    want_q = partial_rope(norms[0](q).transpose(1, 2), cos, sin)
    want_k = partial_rope(norms[1](k.view(R, L, Hkv, Dh)).transpose(1, 2), cos, sin)
    layer = AttentionLayer(SimpleNamespace(), FULL, None, None, 4, 8, H, Hkv, Dh, torch.float32, torch.device("cpu"))
    layer.k, layer.v = k_cache.clone(), v_cache.clone()
    step = Step(pos, {}, None, 8, INVARIANT, None, True, rows=rows)
    layer._write(step, want_k, v.view(R, L, Hkv, Dh).transpose(1, 2), read=False)
    kc, vc, k_out = k_cache.clone(), v_cache.clone(), torch.empty(R * L, Hkv, Dh)
    flat_cos, flat_sin = cos.reshape(R * L, 1, 1, -1), sin.reshape(R * L, 1, 1, -1)
    assert si.fits(q.reshape(R * L, 1, H, Dh), kc, flat_cos, *norms)
    got_q = si.step_inputs(q.reshape(R * L, H, Dh), k.view(R * L, Hkv, Dh), v.view(R * L, Hkv, Dh), kc, vc,
                           pos.reshape(R * L, 1), flat_cos, flat_sin, *norms, rows=rows.repeat_interleave(L),
                           k_out=k_out)
    assert torch.equal(got_q.view(R, L, H, Dh).transpose(1, 2), want_q)
    assert torch.equal(k_out.view(R, L, Hkv, Dh).transpose(1, 2), want_k)
    assert torch.equal(kc, layer.k) and torch.equal(vc, layer.v)
    assert torch.equal(kc[[0, 2]], k_cache[[0, 2]]) and not torch.equal(kc[[1, 3]], k_cache[[1, 3]])


def test_what_the_kernel_does_not_compute_is_refused(interpreter):
    q, k, v, k_cache, v_cache, pos, cos, sin, norms = case(2, 4, 2, 64, 8, torch.float32, "plain")
    assert si.fits(q, k_cache, cos, *norms) and si.fits(q, k_cache, cos, None, None)
    assert not si.fits(q, k_cache, cos, norms[0], None)  # one norm alone
    assert not si.fits(q, k_cache, cos, norms[0].module, norms[1].module)  # an HF module, not the kernel's wrapper
    assert not si.fits(q, k_cache.double(), cos, *norms)  # another cache dtype
    assert not si.fits(q[..., :48], k_cache, cos, *norms)  # no power-of-two head dim
    with pytest.raises(ValueError, match="disagree"):
        si.step_inputs(q[:, 0], k.view(2, 2, 64), v.view(2, 2, 64), k_cache, v_cache, pos[:, 0], cos, sin, *norms)


# qwen3: plain q/k norms; llama: none; qwen3_5: offset norms, gated partial rotary, head dim 2x (a hybrid's
# full-attention layers)
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
def test_the_batch_generator_steps_through_the_kernel_as_hf_generates(interpreter, two_layer_dirs, family):
    """Three prompts of 2..9 tokens through 2 rows, the first row ending at its 4th token and taking the third
    prompt, the others running to max_new: every attention layer's one-token steps took this kernel (and the per-row
    attention kernel, trainer/decode/step_kernel.py, each row at its own position; the prefill keeps SDPA), and the
    answers are HF generate's."""
    from tests.trainer.decode.test_generate import prompts_of, stops_inside
    from tests.trainer.families import load_two_layers
    from trainer.decode.generate import BatchGenerator, Sampling, hf_generate

    target = load_two_layers(two_layer_dirs[family])  # two layers: the interpreter's cost is per layer
    prompts = prompts_of(target, (2, 9, 4), seed=5)
    stops = stops_inside(target, prompts, 9)[:1]
    gen = BatchGenerator(target, rows=2, max_len=20, stop_ids=stops)
    assert gen.static.row_kernel
    got = gen.generate(prompts, Sampling(max_new_tokens=9))
    assert got == hf_generate(target.model, prompts, Sampling(max_new_tokens=9), stops, target.tokenizer.pad_token_id)
    assert gen.refilled == 1
    attention = [m for m in gen.static.mixers if isinstance(m, AttentionLayer)]
    assert attention and all(m.fused_steps >= 5 for m in attention), [m.fused_steps for m in attention]


COMPILE_FOR_H200 = r'''
import json
from tests.trainer.cubin import sm90
from trainer.decode import step_inputs

kernel = step_inputs._kernel()
out = {}
for dt in ("bf16", "fp32"):
    sig = {**{n: "*" + dt for n in "q_ptr k_ptr v_ptr qw_ptr kw_ptr cos_ptr sin_ptr".split()}, "pos_ptr": "*i64",
           "rows_ptr": "*i64", **{n: "*" + dt for n in "qo_ptr kc_ptr vc_ptr ko_ptr".split()}, "n_cols": "i32", "q_eps": "fp32", "k_eps": "fp32",
           **{n: "i32" for n in "sq_r sq_h sk_r sk_h sv_r sv_h scos_r ssin_r sp_r sc_r sc_h sc_s".split()}}
    for name, dh, rot, offset in (("qwen3", 128, 128, False), ("qwen3_5", 256, 64, True)):
        consts = {"H": 32, "HKV": 8, "HEAD_DIM": dh, "ROT": rot, "NORM": True, "OFFSET": offset, "ASM_MUL": True,
                  "K_OUT": offset}
        compiled = sm90(kernel, sig, consts, num_warps=1, aligned_ints=True)
        out[f"{name}_{dt}"] = {"stages": sorted(compiled.asm), "ptx": compiled.asm["ptx"]}
print("COMPILED " + json.dumps(out))
'''


def test_the_kernel_compiles_for_the_h200(tmp_path):
    """Compiled for sm_90 without a GPU (what the interpreter does not check): at qwen3-8b's and Qwen3.5's heads, in
    bf16 and fp32; the RoPE products are unfusable `mul.rn.f32`, and no bf16 FMA is left (one would round once
    where torch's mul and add round twice; the fp32 FMAs left are the norm's sum of squares, as in kernels.py's)."""
    from tests.trainer.cubin import compile_for_h200

    compiled = compile_for_h200(COMPILE_FOR_H200, tmp_path)
    assert set(compiled) == {f"{n}_{dt}" for n in ("qwen3", "qwen3_5") for dt in ("bf16", "fp32")}
    assert all("cubin" in c["stages"] for c in compiled.values())
    assert all("mul.rn.f32" in c["ptx"] and "fma.rn.bf16" not in c["ptx"] for c in compiled.values())
