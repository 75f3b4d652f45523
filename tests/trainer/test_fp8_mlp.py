"""The FP8 target's gated MLP (trainer/model/fp8_target.py): the row kernel, run on CPU under Triton's interpreter (the
code the H200 compiles), against its torch form; the module against one FP8 linear per projection, through the
families' own forwards; and a compiled layer calling the kernel as one op."""
import re

import pytest
import torch

from trainer.model import fp8_target
from trainer.model.fp8 import Fp8Linear
from trainer.model.fp8_target import (LINEAR_NAMES, Fp8GatedMlp, gated_silu_mlp, quantize_target_layers,
                                      swiglu_e4m3_reference, swiglu_e4m3_rows)
from trainer.model.target import load_target


def _gate_up(rows: int, n: int) -> torch.Tensor:
    torch.manual_seed(0)
    gu = torch.randn(rows, 2 * n) * 3
    gu[1] = 0  # a row of zeros: the scale's floor, not a division by zero
    gu[2] *= 1e3  # a row far from the others: its own scale
    return gu.to(torch.bfloat16)


def _scaled(gu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's values before their e4m3 cast, and its scales."""
    h = torch.nn.functional.silu(gu[:, :n].float()) * gu[:, n:].float()
    scale = swiglu_e4m3_reference(gu, n)[1]
    return (h / scale).clamp(-448.0, 448.0), scale


# Triton's interpreter casts to e4m3 by rounding half up and loses a carry into the exponent (31.1 -> 16; triton 3.6,
# runtime/interpreter.py `_convert_float`); the GPU's cast rounds to nearest even, as torch does. So on CPU the kernel
# writes its values before the cast (out_dtype float32), and the cast itself is checked on the H200
# (tests/trainer/gpu/test_fp8_gpu.py).
@pytest.mark.parametrize("looped_block", [0, 32])  # 0: the row kernel (the trainer's); 32: four looped blocks
def test_the_kernel_equals_the_torch_form(interpreter, looped_block):
    gu = _gate_up(5, 100)  # 100: not a power of two, the block's tail masked
    values, scale = swiglu_e4m3_rows(gu, 100, looped_block=looped_block, out_dtype=torch.float32)
    want_values, want_scale = _scaled(gu, 100)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-5)
    assert float(scale[1]) == pytest.approx(1e-12 / 448.0) and not values[1].any()
    assert float(values.abs().amax()) == pytest.approx(448.0)
    q, q_scale = swiglu_e4m3_rows(gu, 100, looped_block=looped_block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 100) and torch.equal(q_scale, scale)


@pytest.mark.parametrize("looped_block", [0, 32])
def test_the_kernel_reads_rows_at_their_stride(interpreter, looped_block):
    wide = _gate_up(4, 64 + 8)
    gu = wide[:, :128]  # rows of 128 inside rows of 144: a view, not a copy
    values, scale = swiglu_e4m3_rows(gu, 64, looped_block=looped_block, out_dtype=torch.float32)
    want_values, want_scale = _scaled(gu.contiguous(), 64)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-5)


def test_a_nan_reaches_the_output_as_in_torch(interpreter):
    """The interpreter's max and min keep a NaN whatever the kernel asks; the GPU's drop it unless told not to, which
    tests/trainer/gpu/test_fp8_gpu.py checks."""
    gu = _gate_up(3, 64)
    gu[0, 5] = float("nan")  # in gate: the row's other values stay finite, and the NaN must not become -448
    values, _ = swiglu_e4m3_rows(gu, 64, out_dtype=torch.float32)
    assert torch.isnan(values[0, 5]) and torch.isfinite(values[1:]).all()
    assert torch.isnan(swiglu_e4m3_reference(gu, 64)[0][0, 5].float())


@pytest.mark.parametrize("shape, n, why", [((4, 100), 64, "[M, 128]"), ((2, 4, 128), 64, "[M, 128]"),
                                           ((4, 128), 64, "unit column stride")])
def test_rows_of_another_shape_or_layout_are_refused_before_any_launch(shape, n, why):
    gu = torch.zeros(shape, dtype=torch.bfloat16)
    if why == "unit column stride":
        gu = torch.zeros(shape[::-1], dtype=torch.bfloat16).t()
    with pytest.raises(ValueError, match=re.escape(why)):
        swiglu_e4m3_rows(gu, n)


def test_the_row_kernel_refuses_rows_wider_than_it_holds():
    n = fp8_target.ROW_KERNEL_MAX + 16
    with pytest.raises(ValueError, match="at most"):
        swiglu_e4m3_rows(torch.zeros(1, 2 * n, dtype=torch.bfloat16), n)


def test_the_op_passes_torch_library_checks(interpreter):
    """The fake (shapes and dtypes for torch.compile) agrees with the kernel, on a contiguous and a strided input."""
    gu = _gate_up(4, 64 + 8)
    for rows in (gu[:, :128].contiguous(), gu[:, :128]):
        torch.library.opcheck(torch.ops.dflash.swiglu_e4m3.default, (rows, 64))


def _one_fp8_linear_each(layers) -> None:
    for layer in layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in LINEAR_NAMES:
                if isinstance(getattr(parent, name, None), torch.nn.Linear):
                    setattr(parent, name, Fp8Linear(getattr(parent, name)))


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma2"])  # gemma2: a GELU MLP, one Fp8Linear per linear
def test_the_gated_mlp_computes_what_one_fp8_linear_per_projection_computes(family_dirs, family):
    fused = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), dtype="float32")
    single = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), dtype="float32")
    layers = fused.model.model.layers
    assert quantize_target_layers(layers) == 7 * len(layers)
    _one_fp8_linear_each(single.model.model.layers)
    gated = [isinstance(layer.mlp, Fp8GatedMlp) for layer in layers]
    assert all(gated) if family != "gemma2" else not any(gated)
    ids = torch.randint(10, fused.embed_tokens.weight.shape[0], (2, 24))
    pos, docs = torch.arange(24).repeat(2, 1), torch.zeros(2, 24, dtype=torch.long)
    torch.testing.assert_close(fused.features(ids, pos, docs), single.features(ids, pos, docs), rtol=1e-5, atol=1e-5)


class _Capped(torch.nn.Module):
    """silu, except past 50: equal to silu on unit-scale inputs only."""

    def forward(self, x):
        return torch.nn.functional.silu(x).clamp(max=50.0)


class _Pair(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x):
        return self.mlp(x), x


def test_an_mlp_of_another_form_is_not_taken_for_a_gated_one(family_dirs):
    target = load_target(family_dirs["qwen3"], num_draft_layers=2, layer_ids=(1, 3), dtype="float32")
    layers = target.model.model.layers
    mlp = layers[0].mlp
    assert gated_silu_mlp(mlp)
    assert not gated_silu_mlp(_Pair(mlp))  # a forward that returns more than the product
    layers[1].mlp.act_fn = torch.nn.GELU()
    layers[2].mlp.act_fn = _Capped()  # only a large input shows it
    layers[3].mlp.up_proj.bias = torch.nn.Parameter(torch.zeros(layers[3].mlp.up_proj.out_features))
    assert not any(gated_silu_mlp(layer.mlp) for layer in layers[1:4])
    with pytest.raises(ValueError, match="does not compute"):
        Fp8GatedMlp(layers[3].mlp)
    quantize_target_layers(layers[:4])
    assert isinstance(layers[0].mlp, Fp8GatedMlp)
    assert all(isinstance(layer.mlp.up_proj, Fp8Linear) and not isinstance(layer.mlp, Fp8GatedMlp)
               for layer in layers[1:4])
    assert layers[3].mlp.up_proj.bias is not None  # the bias kept, in the linear that has it


@pytest.mark.slow
def test_a_compiled_layer_calls_the_kernel_as_one_op_and_matches_eager(family_dirs, interpreter):
    target = load_target(family_dirs["qwen3"], num_draft_layers=2, layer_ids=(1, 3), dtype="bfloat16")
    quantize_target_layers(target.model.model.layers)
    layer, rotary = target.model.model.layers[0], target.model.model.rotary_emb
    assert layer.mlp.kernel  # built while the interpreter stands in for the GPU
    x = torch.randn(2, 16, target.hf_config.hidden_size, dtype=torch.bfloat16)
    pos = torch.arange(16).repeat(2, 1)
    kwargs = dict(attention_mask=None, position_ids=pos, position_embeddings=rotary(x, pos))
    with torch.no_grad():
        eager = layer(x, **kwargs)
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(x, **kwargs)
    first = (lambda out: out[0] if isinstance(out, tuple) else out)
    torch.testing.assert_close(first(compiled), first(eager), rtol=2e-2, atol=2e-2)


def test_without_the_interpreter_the_kernel_is_not_used_on_cpu():
    assert not fp8_target.kernel_usable(torch.device("cpu"), 64)
    assert not fp8_target.kernel_usable(torch.device("cuda"), fp8_target.ROW_KERNEL_MAX + 16)
