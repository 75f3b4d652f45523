"""model.target_fp8 on the H200: the FP8 tensor-core product equals the dequantized fp32 product (what the CPU form
computes), compiled too."""
import pytest
import torch

from trainer.model.fp8 import Fp8Linear

pytestmark = pytest.mark.gpu


def test_scaled_mm_equals_the_dequantized_product_eager_and_compiled():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Linear(lin)
    x = torch.randn(3, 256, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = fp8(x)
        ref_q = ((x.reshape(-1, 4096).float().abs().amax(-1, keepdim=True) / 448.0))  # the input scales
        from trainer.model.fp8 import quantize_rows

        xq, xs = quantize_rows(x.reshape(-1, 4096))
        deq = (xq.float() * xs) @ (fp8.weight_q.float() * fp8.weight_scale.t()).t()
        compiled = torch.compile(fp8, dynamic=False)(x)
    assert torch.allclose(xs, ref_q)
    torch.testing.assert_close(out.reshape(-1, 1024).float(), deq, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(compiled.float(), out.float(), rtol=2e-2, atol=2e-2)
    rel = float((out.float() - lin(x).float()).norm() / lin(x).float().norm())
    assert rel < 0.06
