"""The Gated DeltaNet decode layer's gated RMSNorm kernel (trainer/decode/gated_norm.py) on CPU tensors under Triton's
interpreter: HF's module's arithmetic for the three hybrid families, in fp32 and bf16; HF's module where the kernel
does not apply; and its sm_90 build."""
from __future__ import annotations

import pytest
import torch

from trainer.decode.gated_norm import GatedRMSNorm


def hf_norm(family: str, width: int) -> torch.nn.Module:
    if family == "qwen3_5":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated as Norm
    elif family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNormGated as Norm
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated as Norm
    return Norm(width, eps=1e-6)


# bf16: Triton's interpreter casts fp32 to bf16 toward zero (the GPU rounds to nearest), and the rule casts three
# times: up to about 3 ulps (2.3%) from HF's module here
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_the_kernel_is_hfs_gated_norm(interpreter, family, dtype, tol):
    torch.manual_seed(5)
    module = hf_norm(family, 96)  # 96: not a power of two (a masked tail)
    module.weight.data.normal_(1.0, 0.3)
    module.to(dtype)
    norm = GatedRMSNorm(module)
    x, gate = (torch.randn(12, 96) * 3).to(dtype), (torch.randn(12, 96) * 2).to(dtype)
    assert norm.uses_kernel(x)
    got = norm(x, gate)
    assert got.dtype == dtype and got.shape == x.shape
    want = module(x, gate)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # the gate matters: without its SiLU the kernel's output would not be HF's
    assert not torch.allclose((got.float() / torch.nn.functional.silu(gate.float())), want.float(), rtol=tol, atol=tol)


def test_a_strided_gate_is_read_in_place(interpreter):
    """The gate as the batch generator's joined projection gives it: heads of a slice of a wider row [R, S, Hv, dv]
    (no copy made): the contiguous gate's output, bit for bit (fp32)."""
    torch.manual_seed(6)
    module = hf_norm("qwen3_5", 96)
    module.weight.data.normal_(1.0, 0.3)
    norm = GatedRMSNorm(module)
    R, S, H = 3, 2, 4
    joined = torch.randn(R, S, 40 + H * 96 + 24)  # other projections' outputs on either side
    gate = joined[..., 40:40 + H * 96].view(R, S, H, 96)
    x = torch.randn(R * S * H, 96) * 3
    assert not gate.is_contiguous() and gate.reshape(-1, H, 96).data_ptr() == gate.data_ptr()
    got = norm(x, gate)
    assert torch.equal(got, norm(x, gate.contiguous().view(-1, 96)))
    torch.testing.assert_close(got, module(x, gate.reshape(-1, 96)), rtol=1e-6, atol=1e-6)


def test_hfs_module_runs_where_the_kernel_does_not_apply(interpreter):
    module = hf_norm("qwen3_5", 64)  # fp32 weight
    norm = GatedRMSNorm(module)
    x, gate = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    assert not norm.uses_kernel(x)  # HF's product would promote to the weight's fp32
    assert torch.equal(norm(x, gate), module(x, gate))


def test_without_the_interpreter_a_cpu_tensor_takes_hfs_module():
    module = hf_norm("qwen3_next", 32)
    x, gate = torch.randn(2, 32), torch.randn(2, 32)
    norm = GatedRMSNorm(module)
    assert not norm.uses_kernel(x) and torch.equal(norm(x, gate), module(x, gate))


COMPILE_FOR_H200 = r'''
import json
from tests.trainer.cubin import sm90
from trainer.decode import gated_norm

fn = gated_norm._kernel()
out = {}
for dt in ("bf16", "fp32"):
    sig = {"x_ptr": "*" + dt, "z_ptr": "*" + dt, "w_ptr": "*" + dt, "y_ptr": "*" + dt, "n_cols": "i32", "heads": "i32",
           "stride_zo": "i32", "stride_zh": "i32", "eps": "fp32"}
    compiled = sm90(fn, sig, {"BLOCK": 128}, num_warps=1)
    out[dt] = sorted(compiled.asm)
print("COMPILED " + json.dumps(out))
'''


def test_the_kernel_compiles_for_the_h200(tmp_path):
    from tests.trainer.cubin import compile_for_h200

    compiled = compile_for_h200(COMPILE_FOR_H200, tmp_path)
    assert set(compiled) == {"bf16", "fp32"} and all("cubin" in stages for stages in compiled.values())
