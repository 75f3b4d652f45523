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


@pytest.mark.parametrize("looped_block", [0, 2048])
def test_the_swiglu_kernel_casts_to_e4m3_as_torch_does(looped_block):
    """trainer/model/fp8_target.py at the 8B-like width: the e4m3 values and row scales of the torch form (the CPU tests
    check the values before the cast: Triton's interpreter casts differently)."""
    from trainer.model.fp8_target import swiglu_e4m3_reference, swiglu_e4m3_rows

    torch.manual_seed(0)
    n = 12288
    gu = torch.randn(2048, 2 * n, device="cuda", dtype=torch.bfloat16) * 3
    q, scale = swiglu_e4m3_rows(gu, n, looped_block=looped_block)
    q_ref, scale_ref = swiglu_e4m3_reference(gu, n)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    # Triton's sigmoid and torch's may part by an ulp, moving a value across an e4m3 rounding boundary now and then
    assert float((q.float() == q_ref.float()).float().mean()) > 0.999


@pytest.mark.parametrize("looped_block", [0, 2048])
def test_a_nan_in_gate_reaches_the_e4m3_output(looped_block):
    """Triton's max and min drop a NaN by default on the GPU: the kernel asks them to keep it, so that a NaN in the
    target's activations reaches the loss (which stops the run) instead of becoming -448."""
    from trainer.model.fp8_target import swiglu_e4m3_rows

    gu = torch.randn(4, 2 * 12288, device="cuda", dtype=torch.bfloat16)
    gu[0, 5] = float("nan")
    q, _ = swiglu_e4m3_rows(gu, 12288, looped_block=looped_block)
    assert torch.isnan(q[0, 5].float()) and torch.isfinite(q[1:].float()).all()


def test_the_gated_fp8_mlp_on_the_tensor_cores_is_close_to_one_fp8_linear_per_projection():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    from trainer.model.fp8_target import Fp8GatedMlp, gated_silu_mlp

    torch.manual_seed(0)
    mlp = Qwen3MLP(Qwen3Config(hidden_size=4096, intermediate_size=12288)).to("cuda", torch.bfloat16)
    assert gated_silu_mlp(mlp)
    gated = Fp8GatedMlp(mlp)
    assert gated.kernel
    single = [Fp8Linear(getattr(mlp, name)) for name in ("gate_proj", "up_proj", "down_proj")]
    x = torch.randn(4, 1024, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = single[2](torch.nn.functional.silu(single[0](x)) * single[1](x))
        got = gated(x)
        compiled = torch.compile(gated, fullgraph=True, dynamic=False)(x)
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert got.shape == want.shape and rel < 0.02, rel  # h in fp32 here, in bf16 there: one more rounding apart
    same = float((compiled.float() - got.float()).norm() / got.float().norm())
    assert same < 5e-3, same  # Inductor's input quantization may round a value or two the other way
