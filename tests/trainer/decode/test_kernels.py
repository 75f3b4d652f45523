"""The row-invariant decode kernels (trainer/decode/kernels.py), run on CPU under Triton's interpreter: the same
kernel code the H200 compiles, checked for what it computes and for its invariance (a row's result does not depend on
how many rows are launched together). The refilling batch generator's steps through them, answering as HF generate:
tests/trainer/decode/test_step_inputs.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.decode.test_reference import PROMPTS, _prompt_ids
from trainer.decode import kernels, step_kernel
from trainer.decode.engine import StaticDecoder
from trainer.decode.static_draft import StaticDFlashProposer
from trainer.decode.stack import StaticTarget
from trainer.decode.reference import generate_target_only, new_cache, target_forward




def _cache_with_stale_slots(R, Hkv, S, Dh, dtype):
    """K/V caches whose slots beyond every query hold large junk: a mask that leaks would show."""
    k, v = torch.randn(R, Hkv, S, Dh), torch.randn(R, Hkv, S, Dh)
    k[:, :, 60:], v[:, :, 60:] = 1e3, -1e3
    return k.to(dtype), v.to(dtype)


def test_decode_attention_equals_sdpa(interpreter):
    """GQA (4 query heads on 2 KV heads), 2 sequences, queries at positions 50..54 over a 130-slot cache (three slot
    blocks, the last partial): SDPA's causal result, with the junk beyond each position unseen."""
    torch.manual_seed(0)
    R, H, Hkv, S, Dh, L = 2, 4, 2, 130, 16, 5
    q = torch.randn(R, L, H, Dh).transpose(1, 2)  # the layout the static target passes: [R, H, L, Dh] view
    k, v = _cache_with_stale_slots(R, Hkv, S, Dh, torch.float32)
    pos = torch.arange(50, 50 + L)
    got = kernels.decode_attention(q, k, v, pos, scale=0.25)
    visible = (torch.arange(S)[None, :] <= pos[:, None])[None, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.25, enable_gqa=True).transpose(1, 2)
    assert got.shape == (R, L, H, Dh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_takes_each_rows_own_position(interpreter):
    """Per-row positions ([R, L]: the refilling batch generator's step): each row's query sees its own slots <= its
    position, as SDPA with that row's mask computes, and as the kernel computes that row alone at a shared position."""
    torch.manual_seed(2)
    R, H, Hkv, S, Dh = 3, 4, 2, 130, 16
    q = torch.randn(R, 1, H, Dh).transpose(1, 2)
    k, v = _cache_with_stale_slots(R, Hkv, S, Dh, torch.float32)
    pos = torch.tensor([[3], [59], [20]])
    got = kernels.decode_attention(q, k, v, pos, scale=0.25)
    visible = (torch.arange(S)[None, None, :] <= pos[:, :, None])[:, None]  # [R, 1, 1, S]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.25, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for r in range(R):
        alone = kernels.decode_attention(q[r:r + 1], k[r:r + 1], v[r:r + 1], pos[r], scale=0.25)
        assert torch.equal(alone, got[r:r + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_rows_do_not_depend_on_the_batch(interpreter, dtype):
    """16 queries at once == each query alone, bitwise: the invariance the verify forward relies on."""
    torch.manual_seed(1)
    R, H, Hkv, S, Dh, L = 1, 4, 2, 96, 16, 16
    q = torch.randn(R, L, H, Dh).transpose(1, 2).to(dtype)
    k, v = _cache_with_stale_slots(R, Hkv, S, Dh, dtype)
    pos = torch.arange(40, 40 + L)
    together = kernels.decode_attention(q, k, v, pos, scale=0.25)
    alone = torch.cat([kernels.decode_attention(q[:, :, j:j + 1], k, v, pos[j:j + 1], scale=0.25) for j in range(L)],
                      dim=1)
    assert together.dtype == dtype and torch.equal(together, alone)


def test_rms_norm_kernel_is_hf_arithmetic_and_row_invariant(interpreter):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(2)
    module = Qwen3RMSNorm(96, eps=1e-6)
    module.weight.data.normal_(1.0, 0.2)
    norm = kernels.RowInvariantRMSNorm(module)
    x = torch.randn(2, 8, 96) * 3  # 96: a row length that is not a power of two (masked tail)
    assert norm.uses_kernel(x)
    got = norm(x)
    torch.testing.assert_close(got, module(x), rtol=1e-6, atol=1e-6)
    rows = x.view(-1, 96)
    assert torch.equal(got.view(-1, 96), torch.cat([norm(rows[r:r + 1]) for r in range(rows.shape[0])]))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_offset_rms_norm_kernel_is_hf_arithmetic_and_row_invariant(interpreter, family, dtype, tol):
    """The (1 + w) norms of the hybrids and Gemma: the kernel's offset form computes HF's module (fp32 throughout,
    one cast at the end) and a row alone as among others."""
    if family == "qwen3_5":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm as Norm
    else:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm as Norm

    torch.manual_seed(3)
    module = Norm(96, eps=1e-6)
    module.weight.data.normal_(0.0, 0.2)
    module.to(dtype)
    norm = kernels.RowInvariantRMSNorm(module, offset=True)
    x = (torch.randn(2, 8, 96) * 3).to(dtype)
    assert norm.uses_kernel(x)
    got = norm(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), module(x).float(), rtol=tol, atol=tol)
    rows = x.view(-1, 96)
    assert torch.equal(got.view(-1, 96), torch.cat([norm(rows[r:r + 1]) for r in range(rows.shape[0])]))
    # the plain form on the same module is another rule (w, not 1 + w): the test tells the two apart
    assert not torch.allclose(kernels.RowInvariantRMSNorm(module)(x).float(), module(x).float(), rtol=tol, atol=tol)


def test_invariant_static_forward_equals_hf_cache_forward(interpreter, full_target):
    """The static target with both kernels (invariant attention, Triton norms) against HF's cached forward."""
    ids = torch.tensor([_prompt_ids(full_target, PROMPTS[0])])
    static = StaticTarget(full_target, slots=64, invariant=True)
    assert static.input_norms[0].uses_kernel(full_target.embed_tokens(ids))
    cache = new_cache(full_target)
    P = ids.shape[1]
    for chunk, pos in [(ids, 0), (torch.tensor([[5, 9, 11]]), P)]:
        want_logits, want_feats = target_forward(full_target, chunk, cache, pos)
        got_logits, got_feats = static.forward(chunk, torch.tensor(pos))
        torch.testing.assert_close(got_logits, want_logits.float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_feats, want_feats, rtol=1e-4, atol=1e-4)


def test_invariant_speculative_decoding_equals_target_only(interpreter, full_target):
    """The invariant engine end to end (a random drafter, B = 4): speculative output == HF greedy output."""
    from tests.trainer.decode.test_static_decode import _sharp_drafter

    drafter = _sharp_drafter(full_target, seed=3)
    ids = _prompt_ids(full_target, PROMPTS[2])
    want = generate_target_only(full_target, ids, 10)
    decoder = StaticDecoder(full_target, 64, StaticDFlashProposer(full_target, drafter, 4, 64), 4, invariant=True)
    assert decoder.static.attention == "invariant"
    assert decoder.generate_target_only(ids, 10) == want
    assert decoder.generate_speculative(ids, 10).tokens == want


def test_invariant_decoding_refuses_a_compiled_target(full_target):
    with pytest.raises(ValueError, match="compile='drafter'"):
        StaticDecoder(full_target, 64, None, 4, compile="all", invariant=True)


def test_eval_config_refuses_invariant_with_a_compiled_target():
    from trainer.errors import ConfigError
    from trainer.quality.config import EvalCfg

    with pytest.raises(ConfigError, match="eval.invariant"):
        EvalCfg(invariant=True, compile="all")
    assert EvalCfg(invariant=True, compile="drafter").invariant


COMPILE_FOR_H200 = r'''
import json
from tests.trainer.cubin import sm90
from trainer.decode import kernels, step_kernel

_, rms_norm_rows, attention_rows = kernels._kernels()
step_attention = step_kernel._kernel()
block_for, STAGES, WARPS = step_kernel.block_for, step_kernel.STAGES, step_kernel.WARPS

def build(fn, sig, consts, num_warps):
    compiled = sm90(fn, sig, consts, num_warps, aligned_ints=True)
    return {"stages": sorted(compiled.asm), "shared": compiled.metadata.shared}

out = {}
for dt in ("bf16", "fp32"):
    attn_sig = {"q_ptr": "*" + dt, "k_ptr": "*" + dt, "v_ptr": "*" + dt, "pos_ptr": "*i64", "o_ptr": "*" + dt,
                "scale": "fp32", **{n: "i32" for n in "sq_r sq_h sq_l sk_r sk_h sk_s so_r so_h so_l sp_r".split()}}
    out["attention_" + dt] = build(attention_rows, attn_sig,
                                   {"N_SLOTS": 400, "GROUPS": 2, "HEAD_DIM": 64, "BLOCK_S": 64}, 4)
    norm_sig = {"x_ptr": "*" + dt, "w_ptr": "*" + dt, "y_ptr": "*" + dt, "n_cols": "i32", "eps": "fp32",
                "r_ptr": "*" + dt, "s_ptr": "*" + dt}
    for name, offset, residual in (("rms_norm", False, False), ("rms_norm_offset", True, False),
                                   ("rms_norm_residual", False, True), ("rms_norm_offset_residual", True, True)):
        out[f"{name}_" + dt] = build(rms_norm_rows, norm_sig, {"BLOCK": 512, "OFFSET": offset, "RESIDUAL": residual},
                                     2)
    step_sig = {"q_ptr": "*" + dt, "k_ptr": "*" + dt, "v_ptr": "*" + dt, "pos_ptr": "*i64", "rows_ptr": "*i64",
                "o_ptr": "*" + dt,
                "scale": "fp32", **{n: "i32" for n in "sq_r sq_h sk_r sk_h sk_s so_r so_h".split()}}
    # the GPU's loop to the loaded position at qwen3-8b's and Qwen3.5's head dims, and query tiles of 32 and 64
    # rows (G = 32, 64 query heads a KV head)
    for name, bound, dh, g in (("step", True, 128, 4), ("step256", True, 256, 4), ("step_g32", True, 128, 32),
                               ("step_g64", True, 256, 64)):
        out[f"{name}_" + dt] = build(step_attention, step_sig,
                                     {"N_SLOTS": 400, "G": g, "GP": step_kernel.query_rows(g), "HEAD_DIM": dh,
                                      "BLOCK": block_for(dh),
                                      "UPCAST": False, "PRECISION": "ieee" if dt == "fp32" else "tf32",
                                      "LOADED_BOUND": bound, "STAGES": STAGES}, WARPS)
print("COMPILED " + json.dumps(out))
'''


def test_kernels_compile_for_the_h200(tmp_path):
    """The interpreter does not check what only the compiler does (types of loop-carried values, layouts): the
    decode kernels (kernels.py's two, step_kernel.py's) are compiled here, without a GPU, down to a cubin for sm_90 (the H200) by triton's own compiler and its
    bundled ptxas, at the quality target's shapes, in bf16 and fp32."""
    from tests.trainer.cubin import compile_for_h200

    compiled = compile_for_h200(COMPILE_FOR_H200, tmp_path)
    assert set(compiled) == {f"{k}_{dt}" for k in ("attention", "rms_norm", "rms_norm_offset", "rms_norm_residual",
                                                  "rms_norm_offset_residual", "step", "step256",
                                                  "step_g32", "step_g64")
                             for dt in ("bf16", "fp32")}
    assert all("cubin" in c["stages"] and "ptx" in c["stages"] for c in compiled.values())
    # what one program asks of an SM's shared memory, within the H200's 227 KB (the launch would fail past it)
    assert all(0 <= c["shared"] <= 227 * 1024 for c in compiled.values()), {n: c["shared"] for n, c in compiled.items()}
    # and at most step_kernel.shared_bytes, what usable_for checks against a device's
    for dt, size in (("bf16", 2), ("fp32", 4)):
        for name, dh, g in (("step", 128, 4), ("step256", 256, 4), ("step_g32", 128, 32), ("step_g64", 256, 64)):
            assert compiled[f"{name}_{dt}"]["shared"] <= step_kernel.shared_bytes(dh, size, g), (name, dt)
    assert step_kernel.shared_bytes(128, 2) <= 101_376 < step_kernel.shared_bytes(128, 4)  # a 99 KB SM: bf16 only
