"""The refilling generator's step inputs as one kernel (trainer/decode/step_inputs.py) on the H200: the same bits as
today's torch form (the q/k norm kernels, `partial_rope`, the `index_put_` cache writes) at the served models' head
shapes (run: `python3 -m pytest -m gpu tests/trainer/decode/test_step_inputs_gpu.py`)."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_step_inputs import both, case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, rot, norm", [
    (32, 8, 128, None, "plain"),  # qwen3-8b
    (32, 8, 128, None, None),  # a Llama: no q/k norms
    (16, 2, 256, 64, "offset"),  # Qwen3.5's gated full-attention layers: offset norms, RoPE on a quarter of the head
    (16, 4, 256, None, "offset"),  # a 256-dim head turned whole
])
def test_the_kernel_computes_the_torch_forms_bits(heads, kv_heads, head_dim, rot, norm, dtype):
    """256 rows at distinct positions spread over 512 slots: q and both whole caches (the written slot of each row,
    and every other, untouched) equal bit for bit."""
    args = case(256, heads, kv_heads, head_dim, 512, dtype, norm, rot=rot, seed=head_dim + heads, device="cuda")
    want, got = both(*args)
    for name, w, g in zip(("q", "k cache", "v cache"), want, got):
        assert torch.equal(w, g), (name, (w != g).sum().item())
    assert not torch.equal(got[1], args[3])  # the kernel wrote something
