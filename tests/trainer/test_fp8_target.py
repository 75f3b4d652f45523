"""model.target_fp8 (trainer/model/fp8.py): what the FP8 linears compute, on CPU from the same quantized values the
H200's FP8 tensor cores multiply, and the refusal (of it and of step.head_fp8) where no FP8 tensor cores are."""
import subprocess
import sys

import pytest
import torch

from tests.trainer.families import HYBRID_FAMILIES, MOE_FAMILIES
from trainer.model.fp8 import E4M3, Fp8Linear, quantize_rows
from trainer.model.fp8_target import quantize_target_layers
from trainer.model.target import load_target


def test_rows_are_scaled_to_the_e4m3_range_and_come_back_within_its_precision():
    x = torch.randn(8, 64) * torch.logspace(-3, 3, 8)[:, None]  # rows six decades apart: one scale each
    q, scale = quantize_rows(x)
    assert q.dtype == E4M3 and scale.shape == (8, 1)
    assert torch.allclose(q.float().abs().amax(-1), torch.full((8,), 448.0))
    back = q.float() * scale
    assert ((back - x).abs() <= x.abs() * 2 ** -3 + scale * 2 ** -6).all()  # e4m3: 3 mantissa bits


def test_fp8_linear_is_close_to_the_linear_it_replaces_and_drops_its_weight():
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 96, bias=False)
    x = torch.randn(2, 5, 128)
    fp8 = Fp8Linear(lin)
    with torch.no_grad():
        out, ref = fp8(x), lin(x)
    assert out.shape == ref.shape == (2, 5, 96) and not hasattr(fp8, "weight") and not list(fp8.parameters())
    rel = float((out - ref).norm() / ref.norm())
    assert 1e-4 < rel < 0.06, rel  # quantized (not equal), yet close


def test_stacked_linears_are_one_product_equal_to_each_apart():
    torch.manual_seed(0)
    gate, up = torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(3, 64)
    with torch.no_grad():
        both = Fp8Linear(gate, up)(x)
        assert both.shape == (3, 80)
        # the same quantized rows; only the GEMM's blocking may differ with the width
        torch.testing.assert_close(both, torch.cat([Fp8Linear(gate)(x), Fp8Linear(up)(x)], dim=-1), rtol=1e-6,
                                   atol=1e-6)
    with pytest.raises(ValueError, match="bias-free"):
        Fp8Linear(gate, torch.nn.Linear(64, 32))


def test_the_target_layers_run_in_fp8_with_features_close_to_the_original(tiny_target_dir):
    target = load_target(tiny_target_dir, num_draft_layers=2, device="cpu", dtype="float32")
    ids = torch.randint(10, target.embed_tokens.weight.shape[0], (1, 24))
    pos, docs = torch.arange(24)[None], torch.zeros(1, 24, dtype=torch.long)
    before = target.features(ids, pos, docs)
    n_layers = len(target.model.model.layers)
    assert quantize_target_layers(target.model.model.layers) == 7 * n_layers
    assert not any(isinstance(m, torch.nn.Linear) for layer in target.model.model.layers for m in layer.modules())
    after = target.features(ids, pos, docs)
    assert after.shape == before.shape and not torch.equal(after, before)
    cos = torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0)
    assert float(cos) > 0.99, float(cos)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["model.target_fp8", "step.head_fp8"])
def test_on_a_cpu_the_option_is_one_line_and_exit_2(tmp_path, key):
    proc = subprocess.run([sys.executable, "-m", "trainer", "train", "--recipe", "smoke", "--run-dir",
                           str(tmp_path / "run"), "--set", f"{key}=true"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{key} needs a CUDA device" in proc.stderr and f"{key}=false" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("family", MOE_FAMILIES + HYBRID_FAMILIES)
def test_the_2026_families_run_in_fp8_and_keep_their_document_boundaries(family, family_dirs):
    """Under model.target_fp8, every large projection of an MoE, sink or hybrid layer is FP8 (attention, shared
    experts, the Gated DeltaNet's input and output projections); only routers and the delta rule's beta/decay
    projections stay linears. A packed row still gives each document's own features (the FP8 model's HF forward of
    that document alone: the error of a recurrence that runs across documents is far larger), close to the
    unquantized model's."""
    from tests.trainer.test_families import LENGTHS, SEQ, hf_taps, packed_row

    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), truncate=False,
                         dtype="float32")
    layers = target.model.model.layers
    ids, pos, doc = packed_row(LENGTHS, SEQ, target.embed_tokens.weight.shape[0])
    before = target.features(ids, pos, doc)

    def linears():
        return [name.rsplit(".", 1)[-1] for name, m in layers.named_modules() if isinstance(m, torch.nn.Linear)]

    n_before = len(linears())
    replaced = quantize_target_layers(layers)
    assert replaced > 0 and replaced == n_before - len(linears())
    assert set(linears()) <= {"gate", "router", "shared_expert_gate", "in_proj_b", "in_proj_a", "in_proj_ba"}, \
        sorted(set(linears()))
    after = target.features(ids, pos, doc)
    cos = torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0)
    assert not torch.equal(after, before) and float(cos) > 0.99, float(cos)
    at = 0
    for n in LENGTHS:  # within 0.5%: a token's e4m3 rounding may flip where a document alone sums in another order
        alone = hf_taps(target, ids[:, at:at + n], (1, 3))  # (a chunk of the delta rule laid out differently)
        assert float((after[:, at:at + n] - alone).norm() / alone.norm()) < 5e-3, (n, at)
        at += n


def test_a_linear_the_fp8_tensor_cores_cannot_take_stays_as_it_is():
    """Widths not multiples of 16 (torch._scaled_mm's rule) keep their linear; the rest of the layer goes to FP8."""
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.q_proj, layer.self_attn.k_proj = torch.nn.Linear(64, 24, bias=False), torch.nn.Linear(64, 32)
    assert quantize_target_layers([layer]) == 1
    assert isinstance(layer.self_attn.q_proj, torch.nn.Linear) and isinstance(layer.self_attn.k_proj, Fp8Linear)
