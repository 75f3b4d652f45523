"""The refilling batch generator's one-token attention kernel (trainer/decode/step_kernel.py) on CPU tensors under
Triton's interpreter: each row's query over its own slots 0..p equals a float64 reference, and slots past p (junk)
are never seen."""
from __future__ import annotations

import pytest
import torch

from trainer.decode import step_kernel




def reference(q, k, v, pos, scale):
    R, H, _, Dh = q.shape
    G = H // k.shape[1]
    out = torch.empty(R, 1, H, Dh, dtype=torch.float64)
    for r in range(R):
        p = int(pos[r, 0])
        for h in range(H):
            keys, values = k[r, h // G, :p + 1].double(), v[r, h // G, :p + 1].double()
            w = torch.softmax(keys @ q[r, h, 0].double() * scale, dim=0)
            out[r, 0, h] = w @ values
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)])
def test_each_row_attends_to_its_own_slots(interpreter, dtype, tol, heads, kv_heads):
    g = torch.Generator().manual_seed(heads)
    R, S, Dh = 4, 300, 16  # three slot blocks, the last partial
    assert step_kernel.BLOCK_S < S < 3 * step_kernel.BLOCK_S
    q = torch.randn(R, heads, 1, Dh, generator=g).to(dtype)
    k, v = torch.randn(R, kv_heads, S, Dh, generator=g), torch.randn(R, kv_heads, S, Dh, generator=g)
    pos = torch.tensor([[0], [step_kernel.BLOCK_S - 1], [step_kernel.BLOCK_S], [S - 1]])
    for r in range(R):  # junk past each row's position: a leak would show
        k[r, :, int(pos[r]) + 1:], v[r, :, int(pos[r]) + 1:] = 1e3, -1e3
    k, v = k.to(dtype), v.to(dtype)
    assert step_kernel.usable_for(q, Dh)
    got = step_kernel.step_attention(q, k, v, pos, Dh ** -0.5)
    assert got.shape == (R, 1, heads, Dh) and got.dtype == dtype
    torch.testing.assert_close(got.double(), reference(q, k, v, pos, Dh ** -0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_row_subset_reads_its_own_cache_rows(interpreter, dtype, tol):
    """The generator's compacted step: queries of cache rows 0, 2 and 5 of six each read their own cache row, as the
    reference over those rows; the same queries over the gathered rows in order give the same bits."""
    g = torch.Generator().manual_seed(3)
    R, S, Dh = 6, 200, 16
    q = torch.randn(3, 8, 1, Dh, generator=g).to(dtype)
    k, v = (torch.randn(R, 2, S, Dh, generator=g).to(dtype) for _ in range(2))
    rows, pos = torch.tensor([0, 2, 5]), torch.tensor([[150], [3], [S - 1]])
    got = step_kernel.step_attention(q, k, v, pos, Dh ** -0.5, rows=rows)
    torch.testing.assert_close(got.double(), reference(q, k[rows], v[rows], pos, Dh ** -0.5), atol=tol, rtol=tol)
    assert torch.equal(got, step_kernel.step_attention(q, k[rows].clone(), v[rows].clone(), pos, Dh ** -0.5))
    with pytest.raises(ValueError, match="one query a row"):
        step_kernel.step_attention(q, k, v, pos, 1.0, rows=rows[:2])


def test_bad_shapes_are_refused(interpreter):
    q, k = torch.zeros(2, 4, 2, 16), torch.zeros(2, 2, 8, 16)
    with pytest.raises(ValueError, match="one query a row"):
        step_kernel.step_attention(q, k, k, torch.zeros(2, 1, dtype=torch.long), 1.0)
