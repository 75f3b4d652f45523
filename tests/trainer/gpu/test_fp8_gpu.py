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


def test_the_fp8_head_on_the_tensor_cores_equals_its_dequantized_products():
    from trainer.model.fp8 import Fp8Head, quantize_rows

    torch.manual_seed(0)
    W = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    head = Fp8Head(W)
    hq, hs = quantize_rows(h)
    want = (hq.float() * hs) @ (head.rows_q.float() * head.rows_scale.t()).t()
    torch.testing.assert_close(head.logits(h).float(), want, rtol=2e-2, atol=2e-2)
    g = torch.randn(512, 8192, device="cuda") * 1e-3
    gq, gs = quantize_rows(g)
    want = (gq.float() * gs) @ (head.cols_q.float() * head.cols_scale.t()).t()
    torch.testing.assert_close(head.input_grad(gq, gs).float(), want, rtol=2e-2, atol=2e-5)


def test_the_loss_through_the_fp8_head_and_kernel_stays_close_to_the_bf16_loss():
    """The trainer's path at a real vocabulary: Triton CE writing e4m3 dlogits, both head GEMMs on the FP8 tensor
    cores, against the same chunked loss in bf16 (the Triton CE writing bf16)."""
    from trainer.model import ce_kernel
    from trainer.model.fp8 import Fp8Head
    from trainer.model.loss import chunked_lm_loss

    torch.manual_seed(0)
    M, D, V = 6144, 1024, 151936
    W = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.03
    h = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(V, (M,), device="cuda")
    h[: M // 4] *= 20  # logits 20x as spread: confident rows, whose 1 - p_label cancels in fp32
    y[: M // 2] = (h[: M // 2].float() @ W.float().t()).argmax(-1)  # half the rows predicted right
    w = torch.rand(M, device="cuda") * (torch.rand(M, device="cuda") > 0.1)
    results = []
    for head8 in (None, Fp8Head(W)):
        h1 = h.clone().requires_grad_()
        loss, correct = chunked_lm_loss(h1, W, None, y, w, 4096, ce_kernel.ce_chunk_triton, None, head8)
        loss.backward()
        results.append((float(loss), correct, h1.grad.float()))
    (l0, c0, d0), (l1, c1, d1) = results
    assert abs(l1 - l0) / l0 < 0.01, (l0, l1)
    assert float(torch.nn.functional.cosine_similarity(d1.flatten(), d0.flatten(), dim=0)) > 0.99
    # Random logits over 152K tokens have near-ties at the top (measured: 95% of argmaxes agree); a wrong row
    # order or scale would agree on ~0%.
    assert float((c1 == c0).float().mean()) > 0.9
