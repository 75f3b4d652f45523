"""The top-k's second-stage kernel (trainer/model/topk_kernel.py) on CPU tensors under Triton's interpreter: the same
values bit for bit and the same indices as `select_from_maxes` (the torch reference), torch.topk's values, fast_topk
and DFlash2's candidates through it, and the kernel built for sm_90 by triton's compiler."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.test_topk import rule_topk
from trainer.model import ce_kernel
from trainer.model import topk_kernel as tk
from trainer.model.loss import chunked_lm_loss
from trainer.model.topk import CHUNK, chunk_maxes_used, fast_topk, select_from_maxes

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def maxes_of(x: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    n = x.shape[1] // chunk
    return x[:, :n * chunk].reshape(x.shape[0], n, chunk).amax(dim=-1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def check(x: torch.Tensor, k: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel against select_from_maxes (bits and indices), torch.topk (values) and the documented tie rule."""
    maxes = maxes_of(x, chunk)
    assert tk.usable(x, maxes, k, chunk)
    values, indices = tk.select(x, maxes, k, chunk)
    want_v, want_i = select_from_maxes(x, maxes, k, chunk)
    assert indices.dtype == torch.long and same_bits(values, want_v)
    assert torch.equal(indices, want_i)
    assert torch.equal(values, torch.topk(x, k).values)
    assert torch.equal(indices, rule_topk(x, k)[1])
    return values, indices


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V, k", [(40 * CHUNK + 17, 16), (40 * CHUNK, 16), (40 * CHUNK + 1, 1), (30 * CHUNK + 90, 20),
                                  (17 * CHUNK, 1), (3 * CHUNK + 5, 2)])
def test_random_rows_equal_select_from_maxes_and_torch_topk(interpreter, dtype, V, k):
    g = torch.Generator().manual_seed(V * 100 + k)
    x = (4 * torch.randn(6, V, generator=g)).to(dtype)
    values, indices = check(x, k)
    if dtype == torch.float32:  # continuous values: no ties, so torch's indices too
        assert torch.equal(indices, torch.topk(x, k).indices)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [10 * CHUNK + 37, 10 * CHUNK])
@pytest.mark.parametrize("k", [1, 8])
def test_adversarial_ties_zeros_and_minus_inf(interpreter, dtype, V, k):
    x = torch.randn(7, V, generator=torch.Generator().manual_seed(V)).to(dtype) - 10
    x[0, [V - 1, 5 + 2 * CHUNK, 3, 7 * CHUNK]] = 1.0  # equal maxima in four chunks, the last column included
    x[1, torch.arange(0, V, CHUNK) + 11] = 2.0  # every chunk's max the same value: the lowest chunks first
    x[2, 10:20] = 3.0  # ties inside one chunk
    x[3] = float("-inf")  # all -inf but three: k may exceed the finite count
    x[3, [V - 2, 400, 900]] = torch.tensor([1.0, 1.0, -5.0], dtype=dtype)
    x[4] = 0.0  # zeros of both signs tie: the lower index first, each keeps its sign
    x[4, 1::2] = -0.0
    x[5] = float("-inf")  # a row of -inf only
    x[6, :] = 5.0  # one value everywhere
    values, indices = check(x, k)
    assert indices[1].tolist() == [c * CHUNK + 11 for c in range(k)]
    assert indices[4].tolist() == list(range(k)) and indices[6].tolist() == list(range(k))
    assert indices[5].tolist() == list(range(k))
    assert same_bits(values[4], x[4, :k])  # -0.0 at the odd columns, as the gather of x gives


def test_a_narrow_chunk_and_a_wide_k(interpreter):
    """chunk 16 over 90 columns (5 whole chunks and a tail of 10), and k = 5 of its 6 chunks."""
    x = torch.randn(4, 90, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x[0, 80:90] = 9.0
    check(x, 5, chunk=16)


def test_fast_topk_routes_through_the_kernel(interpreter, monkeypatch):
    """With the kernel usable the torch second stage is never called, and the result is the torch path's."""
    x = (3 * torch.randn(5, 40 * CHUNK + 9, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    x[0, 100:140] = 7.0
    want_v, want_i = select_from_maxes(x, maxes_of(x), 16, CHUNK)

    def not_called(*a, **k):
        raise AssertionError("the torch second stage ran")

    monkeypatch.setattr("trainer.model.topk.select_from_maxes", not_called)
    values, indices = fast_topk(x, 16, select=not_called)
    assert same_bits(values, want_v) and torch.equal(indices, want_i)
    # the maxes a caller hands over (the CE kernel's) go to the kernel as they are
    values, indices = fast_topk(x, 16, select=not_called, maxes=maxes_of(x))
    assert same_bits(values, want_v) and torch.equal(indices, want_i)


def test_the_torch_path_where_the_kernel_cannot_run():
    """Without the interpreter switch a CPU tensor is not the kernel's: fast_topk takes select_from_maxes."""
    x = torch.randn(3, 40 * CHUNK)
    assert not tk.usable(x, maxes_of(x), 4, CHUNK)
    assert torch.equal(fast_topk(x, 4)[1], torch.topk(x, 4).indices)


def test_dflash2_candidates_through_the_ce_kernels_maxes_and_the_select_kernel(interpreter, monkeypatch):
    """The LM-head loss with the CE kernel: its chunk maxes go to the select kernel (neither the chunk-max kernel nor
    the torch second stage runs) and the candidates are torch.topk's."""
    g = torch.Generator().manual_seed(5)
    M, D, V, K = 24, 16, 40 * CHUNK + 9, 16
    assert chunk_maxes_used(V, K)
    h, W = torch.randn(M, D, generator=g), torch.randn(V, D, generator=g)
    labels, w = torch.randint(V, (M,), generator=g), torch.rand(M, generator=g)

    def not_called(*a, **k):
        raise AssertionError("a torch stage ran")

    monkeypatch.setattr("trainer.model.topk.chunk_max", not_called)
    monkeypatch.setattr("trainer.model.topk.select_from_maxes", not_called)
    _, _, cand = chunked_lm_loss(h, W, None, labels, w, chunk=10, chunk_fn=ce_kernel.ce_chunk_triton, top_k=K)
    assert torch.equal(cand, torch.topk(h @ W.t(), K, dim=-1).indices)


COMPILE_FOR_H200 = r'''
import json
from tests.trainer.cubin import sm90
from trainer.model import topk_kernel as tk

fn = tk._kernel()
out = {}
for dt in ("bf16", "fp16", "fp32"):
    for V, k in ((151936, 16), (151936 + 77, 20), (40 * 128, 1)):
        sig = {"x_ptr": "*" + dt, "maxes_ptr": "*" + dt, "values_ptr": "*" + dt, "indices_ptr": "*i64",
               "x_stride": "i32", "maxes_stride": "i32"}
        n_chunks = -(-V // 128)
        consts = {"V": V, "N_FULL": V // 128, "CHUNK": 128, "K": k, "K_P": tk._pow2(k), "NP": tk._pow2(n_chunks),
                  "SENT": tk.SENTINEL, "LOW": tk.LOW}
        compiled = sm90(fn, sig, consts, num_warps=8)
        out[f"{dt}-{V}-{k}"] = {"stages": sorted(compiled.asm), "ptx": compiled.asm["ptx"]}
print("COMPILED " + json.dumps(out))
'''


def test_the_kernel_compiles_for_the_h200(tmp_path):
    """Down to an sm_90 cubin by triton's compiler and its bundled ptxas, for the three dtypes, with and without a
    ragged tail, k = 1, 16, 20: the loop-carried int64 keys and the layouts the interpreter does not check."""
    from tests.trainer.cubin import compile_for_h200

    compiled = compile_for_h200(COMPILE_FOR_H200, tmp_path)
    assert len(compiled) == 9
    for name, got in compiled.items():
        assert "cubin" in got["stages"], name
        assert ".s64" in got["ptx"], name  # the 64-bit keys are compiled in, not narrowed away
