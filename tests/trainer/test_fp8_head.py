"""step.head_fp8 (trainer/model/fp8.py `Fp8Head`, the e4m3 dlogits of the CE chunk): the row scale is the exact
row maximum, every CE form (eager, Inductor-shaped, the Triton kernel under the interpreter) hands over the same
e4m3 gradient, and the chunked loss through the FP8 head stays close to the loss through the head's own dtype.
On CPU the FP8 products are computed in fp32 from the same quantized values the H200 multiplies
(tests/trainer/gpu/test_fp8_gpu.py checks that the tensor cores agree)."""
import pytest
import torch

from tests.trainer.test_ce_fused import chunk_case
from trainer.errors import ConfigError
from trainer.model import ce_kernel
from trainer.model.fp8 import E4M3, Fp8Head, dlogits_scale, quantize_rows
from trainer.model.loss import DPace, ce_chunk, ce_chunk_fused, chunked_lm_loss
from trainer.config import StepCfg, cuda_only, load_config
from trainer.step.policy import fp8_head, fp8_head_unmet


@pytest.fixture
def hardware_fp8_casts(interpreter, monkeypatch):
    """Triton's interpreter casts fp32 to e4m3 without carrying a rounded-up mantissa into the exponent (0.0309
    comes out 2^-6, not 0.03125); the H200 rounds to nearest even, as torch's cast does. Cast as the hardware does,
    so that the kernel's own arithmetic is what is compared."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as tri

    convert = tri._convert_float

    def cast(values, from_dtype, to_dtype, rounding_mode):
        if from_dtype == tl.float32 and to_dtype == tl.float8e4nv:
            as_torch = torch.from_numpy(np.ascontiguousarray(values).view(np.float32))
            return as_torch.to(E4M3).view(torch.uint8).numpy()
        return convert(values, from_dtype, to_dtype, rounding_mode)

    monkeypatch.setattr(tri, "_convert_float", cast)


def _dlogits(logits, y, s):
    """(softmax - onehot) * s in fp64, independent of the code under test; the label's entry p - 1 as minus the
    other entries' sum (in a confident row p - 1 cancels to 0 even in fp64)."""
    p = torch.softmax(logits.double(), dim=-1)
    rows = torch.arange(len(y))
    p[rows, y] = -p.scatter(1, y[:, None], 0.0).sum(-1)
    return p * s.double()[:, None]


def _assert_e4m3_close(q, scale, want):
    """q * scale is want within e4m3's precision: 3 mantissa bits, subnormals below 2^-6 of the scale's unit."""
    assert q.dtype == E4M3 and scale.shape == (q.shape[0], 1) and scale.dtype == torch.float32
    back = q.double() * scale.double()
    assert ((back - want).abs() <= want.abs() * 2 ** -4 + scale.double() * 2 ** -9 + 1e-30).all()


def test_the_scale_is_the_exact_row_maximum_and_zero_rows_stay_finite():
    logits, y, s = chunk_case(torch.float32)
    want = _dlogits(logits, y, s).abs().amax(dim=-1)
    rest = torch.softmax(logits.double(), dim=-1).scatter(1, y[:, None], 0.0).sum(-1)
    scale = dlogits_scale(s, rest)
    live = s > 0
    assert live.any() and (~live).any()
    torch.testing.assert_close(scale[live].double() * 448, want[live], rtol=1e-6, atol=0)
    assert torch.isfinite(scale).all() and (scale > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_ce_form_hands_over_the_same_e4m3_gradient(hardware_fp8_casts, monkeypatch, dtype):
    monkeypatch.setattr(ce_kernel, "BLOCK", 32)  # V = 97: four column blocks, the last partial
    logits, y, s = chunk_case(dtype)
    want = _dlogits(logits, y, s)
    loss_ref, correct_ref, g_ref = ce_chunk(logits, y, s, True)
    outs = {"eager": ce_chunk(logits, y, s, True, grad_fp8=True),
            "fused": ce_chunk_fused(logits, y, s, True, grad_fp8=True),
            "triton": ce_kernel.ce_chunk_triton(logits, y, s, True, grad_fp8=True)}
    for name, (loss, correct, (q, scale)) in outs.items():
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-7, msg=name)
        assert torch.equal(correct, correct_ref), name
        _assert_e4m3_close(q, scale, want)
        live = s > 0  # each live row reaches e4m3's maximum exactly once: at its label
        assert (q[live].float().abs().amax(-1) == 448).all(), name
        assert (q[~live].float() == 0).all(), name
    q0, s0 = outs["eager"][2]
    for name in ("fused", "triton"):  # the same values up to an fp32 ulp of the softmax, i.e. one e4m3 step
        q, scale = outs[name][2]
        torch.testing.assert_close(scale, s0, rtol=1e-5, atol=0)
        torch.testing.assert_close(q.float() * scale, q0.float() * s0, rtol=2 ** -3, atol=float(s0.max()) * 2 ** -9)


@pytest.mark.parametrize("gap", [10.0, 20.0, 40.0])
def test_confident_rows_keep_their_gradient_in_every_form(hardware_fp8_casts, monkeypatch, gap):
    """A label logit `gap` above the rest: from 20 up, p_label rounds to 1 in fp32 and 1 - p_label to 0. The mass off
    the label is summed instead, so the scale and the label's entry stay right."""
    monkeypatch.setattr(ce_kernel, "BLOCK", 32)
    logits, y, s = chunk_case(torch.float32)
    logits[torch.arange(len(y)), y] = logits.max() + gap
    want = _dlogits(logits, y, s)
    for name, fn in (("eager", ce_chunk), ("fused", ce_chunk_fused), ("triton", ce_kernel.ce_chunk_triton)):
        q, scale = fn(logits, y, s, True, grad_fp8=True)[2]
        back = q.double() * scale.double()
        live = s > 0
        label = back[torch.arange(len(y)), y][live]
        # rtol: fp32 rounds the tiny off-label probabilities (~1e-4 relative); 1 - p_label in fp32 is off by 100% here
        torch.testing.assert_close(label, want[torch.arange(len(y)), y][live], rtol=1e-3, atol=0, msg=name)
        assert (label < 0).all(), name
        _assert_e4m3_close(q, scale, want)


def test_the_fp8_head_computes_the_products_of_its_quantized_copies():
    torch.manual_seed(0)
    W = torch.randn(160, 64) * 0.05
    h = torch.randn(24, 64)
    head = Fp8Head(W)
    assert head.rows_q.shape == (160, 64) and head.cols_q.shape == (64, 160)
    assert head.rows_scale.shape == (1, 160) and head.cols_scale.shape == (1, 64)
    assert head.rows_q.dtype == head.cols_q.dtype == E4M3
    # per vocab row for the logits, per hidden column for the gradient: each copy comes back within e4m3's precision
    assert ((head.rows_q.float() * head.rows_scale.t() - W).abs() <= W.abs() * 2 ** -4 + 1e-9 + head.rows_scale.t()
            * 2 ** -9).all()
    assert ((head.cols_q.float() * head.cols_scale.t() - W.t()).abs() <= W.t().abs() * 2 ** -4 + 1e-9
            + head.cols_scale.t() * 2 ** -9).all()
    h_q, h_scale = quantize_rows(h)
    want = (h_q.float() * h_scale) @ (head.rows_q.float() * head.rows_scale.t()).t()
    torch.testing.assert_close(head.logits(h), want, rtol=1e-6, atol=1e-6)
    rel = float((head.logits(h) - h @ W.t()).norm() / (h @ W.t()).norm())
    assert 1e-4 < rel < 0.06, rel  # quantized (not equal), yet close
    g = torch.randn(24, 160)
    g_q, g_scale = quantize_rows(g)
    want = (g_q.float() * g_scale) @ (head.cols_q.float() * head.cols_scale.t()).t()
    torch.testing.assert_close(head.input_grad(g_q, g_scale), want, rtol=1e-6, atol=1e-6)


def _loss_case(seed=1, M=45, D=32, V=144):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, D, generator=g)
    W = torch.randn(V, D, generator=g) * 0.3
    y = torch.randint(V, (M,), generator=g)
    w = torch.rand(M, generator=g) * (torch.rand(M, generator=g) > 0.2)
    return h, W, y, w


def _chunked(h, W, bias, y, w, chunk_fn, dpace, head8):
    h1 = h.clone().requires_grad_()
    loss, correct = chunked_lm_loss(h1, W, bias, y, w, 16, chunk_fn, dpace, head8)
    loss.backward()
    return loss.detach(), correct, h1.grad


@pytest.mark.parametrize("objective", ["dflash", "dpace", "bias"])
def test_the_chunked_loss_through_the_fp8_head_stays_close_to_the_full_precision_one(objective):
    h, W, y, w = _loss_case()
    dpace = DPace(span=15, alpha=0.5) if objective == "dpace" else None  # 45 positions: three blocks of 15
    bias = torch.randn(W.shape[0]) if objective == "bias" else None
    l0, c0, d0 = _chunked(h, W, bias, y, w, None, dpace, None)
    l1, c1, d1 = _chunked(h, W, bias, y, w, None, dpace, Fp8Head(W))
    assert not torch.equal(d1, d0)  # the FP8 path ran
    torch.testing.assert_close(l1, l0, rtol=0.03, atol=0)
    cos = torch.nn.functional.cosine_similarity(d1.flatten(), d0.flatten(), dim=0)
    assert float(cos) > 0.99, float(cos)
    assert float((c1 == c0).float().mean()) >= 0.9


@pytest.mark.slow
def test_the_compiled_chunk_gives_the_eager_chunks_fp8_gradient():
    """What the compile modes run where the Triton kernel does not (D-PACE): Inductor's form of the e4m3 gradient."""
    h, W, y, w = _loss_case(seed=2)
    head8, dpace = Fp8Head(W), DPace(span=15, alpha=0.5)
    l0, c0, d0 = _chunked(h, W, None, y, w, None, dpace, head8)
    l1, c1, d1 = _chunked(h, W, None, y, w, torch.compile(ce_chunk_fused, dynamic=False), dpace, head8)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert torch.equal(c1, c0)
    # the same e4m3 values up to an fp32 ulp of the softmax, which can move one of them by one e4m3 step
    torch.testing.assert_close(d1, d0, rtol=0.02, atol=1e-4)


def _head(vocab=160, hidden=64, dtype=torch.bfloat16):
    return torch.nn.Linear(hidden, vocab, bias=False).to(dtype)


def test_true_refuses_a_head_the_tensor_cores_cannot_take_with_the_way_out():
    on = StepCfg(mode="compile+graph", head_fp8=True)
    with pytest.raises(ConfigError) as err:
        fp8_head(on, _head(vocab=97), torch.device("cpu"))  # vocabulary 97: not a multiple of 16
    assert "divisible by 16" in str(err.value) and "97" in str(err.value)
    assert "step.head_fp8=false" in err.value.hint
    with pytest.raises(ConfigError, match="a bf16 LM head .* this one is float32"):
        fp8_head(on, _head(dtype=torch.float32), torch.device("cpu"))
    with pytest.raises(ConfigError, match="FP8 tensor cores"):
        fp8_head(on, _head(), torch.device("cpu"))


@pytest.mark.parametrize("mode", ["eager", "compile", "compile+graph"])
def test_auto_and_false_stay_off_where_it_cannot_run_or_is_not_wanted(mode):
    for value in ("auto", False):
        assert fp8_head(StepCfg(mode=mode, head_fp8=value), _head(), torch.device("cpu")) is None
    assert fp8_head_unmet(_head(), torch.device("cpu")).startswith("FP8 tensor cores")
    assert fp8_head_unmet(_head(vocab=97), torch.device("cpu")).startswith("the LM head's")


def test_auto_turns_on_where_it_can_run_except_in_the_eager_reference(monkeypatch):
    """The decision itself, with the device checks answered yes (this machine has no FP8 tensor cores)."""
    from trainer.model import fp8

    monkeypatch.setattr(fp8, "fp8_supported", lambda device: True)
    monkeypatch.setattr(fp8, "rowwise_matmul_error", lambda device: None)
    cpu = torch.device("cpu")
    assert isinstance(fp8_head(StepCfg(mode="compile+graph", head_fp8="auto"), _head(), cpu), Fp8Head)
    assert isinstance(fp8_head(StepCfg(mode="graph", head_fp8="auto"), _head(), cpu), Fp8Head)
    assert isinstance(fp8_head(StepCfg(mode="eager", head_fp8=True), _head(), cpu), Fp8Head)
    assert fp8_head(StepCfg(mode="eager", head_fp8="auto"), _head(), cpu) is None
    assert fp8_head(StepCfg(mode="compile", head_fp8="auto"), _head(vocab=97), cpu) is None
    assert fp8_head(StepCfg(mode="compile", head_fp8="auto"), _head(dtype=torch.float32), cpu) is None
    monkeypatch.setattr(fp8, "rowwise_matmul_error", lambda device: "no kernel image for this GPU")
    assert fp8_head(StepCfg(mode="compile", head_fp8="auto"), _head(), cpu) is None
    with pytest.raises(ConfigError, match="row-wise FP8 matmuls.*no kernel image"):
        fp8_head(StepCfg(mode="compile", head_fp8=True), _head(), cpu)


def test_the_setting_takes_auto_true_or_false_and_only_true_is_cuda_only():
    def cfg(*sets):
        return load_config("smoke", list(sets))

    assert cfg().step.head_fp8 == "auto" and not cuda_only(cfg())
    assert cfg("step.head_fp8=true").step.head_fp8 is True
    assert ("step.head_fp8", "step.head_fp8=false") in cuda_only(cfg("step.head_fp8=true"))
    assert cfg("step.head_fp8=false").step.head_fp8 is False
    with pytest.raises(ConfigError, match="step.head_fp8 must be auto, true or false"):
        cfg("step.head_fp8=yes please")
    with pytest.raises(ConfigError, match="step.head_fp8 must be auto, true or false"):
        StepCfg(head_fp8=1)  # 1 == True: only a real bool or "auto" passes
