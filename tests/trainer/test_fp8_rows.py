"""The row quantization kernel (trainer/model/fp8_rows.py), run on CPU under Triton's interpreter (the code the H200
compiles), bit for bit against the torch form as CUDA computes it: bf16 and fp32 rows, zeros, huge values, a NaN,
widths that are not a power of two, one block and looped; the kernel compiles to an sm_90 cubin without a GPU, with
IEEE division; `project_shared` gives what each linear gives alone."""
import pytest
import torch

from trainer.model.fp8 import Fp8Linear, project_shared
from trainer.model.fp8_rows import (E4M3_MAX, INV_E4M3_MAX, ROW_BLOCK_MAX, quantize_rows, quantize_rows_kernel,
                                    quantize_rows_torch)



def _rows(K: int, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(K)
    x = torch.randn(6, K) * 3
    x[1] = 0  # the scale's floor, not a division by zero
    x[2] *= 1e30 if dtype == torch.float32 else 1e3  # far from the others: its own scale
    x[3, K // 2] = float("nan")  # the whole row NaN, as in torch
    x[4, ::7] = 1e-3  # small values of one row
    return x.to(dtype)


def _torch_form_on_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_torch` before the cast, with the scale as CUDA computes `amax / 448` (times the fp32
    reciprocal; CPU divides exactly)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax * INV_E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX), scale


# Triton's interpreter casts to e4m3 by rounding half up (triton 3.6; the GPU rounds to nearest even, as torch does):
# on CPU the kernel's values are compared before the cast (out_dtype float32); the cast itself on the H200
# (tests/trainer/decode/test_generate_fp8_gpu.py).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K, block", [(100, 0), (4096, 0), (14336, 0), (300, 64), (ROW_BLOCK_MAX + 1000, 0)])
def test_the_kernel_equals_the_torch_form_bit_for_bit(interpreter, dtype, K, block):
    x = _rows(K, dtype)
    values, scale = quantize_rows_kernel(x, block=block, out_dtype=torch.float32)
    want_values, want_scale = _torch_form_on_cuda(x)
    finite = [0, 1, 2, 4, 5]
    assert torch.equal(scale[finite], want_scale[finite]) and torch.equal(values[finite], want_values[finite])
    assert torch.isnan(scale[3]).all() and torch.isnan(values[3]).all()
    assert torch.isnan(quantize_rows_torch(x)[0][3].float()).all()  # the torch form's NaN row, the same
    assert float(scale[1]) == pytest.approx(1e-12 / E4M3_MAX) and not values[1].any()
    q, q_scale = quantize_rows_kernel(x, block=block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and torch.equal(q_scale[finite], scale[finite])


def test_the_scale_differs_from_cpus_exact_division_in_the_last_bit_only():
    """Why the reference above multiplies: the kernel follows CUDA's torch form, which CPU's exact division can miss
    by one ulp of the scale."""
    amax = torch.rand(100_000) * 1000 + 1
    exact, times_reciprocal = amax / E4M3_MAX, amax * INV_E4M3_MAX
    assert not torch.equal(exact, times_reciprocal)
    assert torch.allclose(exact, times_reciprocal, rtol=2 ** -23, atol=0)


def test_rows_at_a_stride_are_read_in_place(interpreter):
    wide = _rows(72, torch.bfloat16)
    values, scale = quantize_rows_kernel(wide[:, :64], out_dtype=torch.float32)
    want_values, want_scale = _torch_form_on_cuda(wide[:, :64].contiguous())
    assert torch.equal(scale[[0, 1, 2]], want_scale[[0, 1, 2]]) and torch.equal(values[[0, 1]], want_values[[0, 1]])


def test_off_cuda_quantize_rows_is_the_torch_form():
    x = _rows(64, torch.bfloat16)[[0, 1, 2]]
    q, scale = quantize_rows(x)
    want_q, want_scale = quantize_rows_torch(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


def test_project_shared_equals_each_linear_alone():
    torch.manual_seed(0)
    lins = [torch.nn.Linear(64, n, bias=False, dtype=torch.bfloat16) for n in (32, 16, 48)]
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    fp8 = [Fp8Linear(lin) for lin in lins]
    for shared, alone in zip(project_shared(x, fp8), [f(x) for f in fp8]):
        assert shared.shape == alone.shape and torch.equal(shared, alone)
    for shared, alone in zip(project_shared(x, [fp8[0], lins[1]]), [fp8[0](x), lins[1](x)]):  # mixed: each alone
        assert torch.equal(shared, alone)
    assert all(torch.equal(a, b) for a, b in zip(project_shared(x, lins), [lin(x) for lin in lins]))


COMPILE_FOR_H200 = r'''
import json
from tests.trainer.cubin import sm90
from trainer.model import fp8_rows

fn = fp8_rows._kernel()
out = {}
for dt in ("bf16", "fp32"):
    for K in (4096, 14336, 30000):
        sig = {"x_ptr": "*" + dt, "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "x_stride": "i32", "q_stride": "i32"}
        block = fp8_rows.row_block(K)
        consts = {"K": K, "FP8_MAX": fp8_rows.E4M3_MAX, "INV_FP8_MAX": fp8_rows.INV_E4M3_MAX, "BLOCK": block}
        compiled = sm90(fn, sig, consts, num_warps=fp8_rows.row_warps(block))
        out[f"{dt}-{K}"] = {"stages": sorted(compiled.asm), "ptx": compiled.asm["ptx"]}
print("COMPILED " + json.dumps(out))
'''


def test_the_kernel_compiles_for_the_h200_with_ieee_division(tmp_path):
    """Down to an sm_90 cubin by triton's compiler and its bundled ptxas, bf16 and fp32 rows, one block (4096, 14336)
    and looped (30000); its divisions round to nearest (`div.rn.f32`: `/` would be the approximate `div.full`), its
    e4m3 cast is the saturating round-to-nearest one, and its NaN handling is compiled in."""
    from tests.trainer.cubin import compile_for_h200

    compiled = compile_for_h200(COMPILE_FOR_H200, tmp_path)
    assert len(compiled) == 6
    for name, got in compiled.items():
        assert "cubin" in got["stages"], name
        assert "div.rn.f32" in got["ptx"] and "div.full" not in got["ptx"], name
        assert "cvt.rn.satfinite.e4m3x2.f32" in got["ptx"], name
        # the NaN test (x != x) is not folded away, and the clamp keeps a NaN
        assert "setp.nan." in got["ptx"] and "min.NaN.f32" in got["ptx"] and "max.NaN.f32" in got["ptx"], name
