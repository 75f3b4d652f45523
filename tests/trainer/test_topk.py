"""The two-stage top-k (trainer/model/topk.py) against torch.topk, its tie rule, and DFlash2's objective with it."""
import pytest
import torch

from trainer.model.loss import chunked_lm_loss
from trainer.model.selector import CandidateSelector
from trainer.model.selector_loss import selector_loss
from trainer.model.topk import CHUNK, compiled_select, fast_topk


def rule_topk(x: torch.Tensor, k: int):
    """The documented order: value descending, then index ascending (a stable sort of the whole row)."""
    values, indices = torch.sort(x.double(), dim=-1, descending=True, stable=True)
    return values[:, :k].to(x.dtype), indices[:, :k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V,k", [(V, k) for V in (5, CHUNK, 200, 3 * CHUNK, 5000, 4 * CHUNK + 1)
                                  for k in (1, 3, 16, CHUNK) if k <= V])
def test_values_equal_torch_topk_and_indices_follow_the_tie_rule(dtype, V, k):
    g = torch.Generator().manual_seed(V * 1000 + k)
    x = (4 * torch.randn(9, V, generator=g)).to(dtype)
    values, indices = fast_topk(x, k)
    want_v, want_i = torch.topk(x, k)
    assert values.dtype == dtype and indices.dtype == torch.long
    assert torch.equal(values, want_v)
    assert torch.equal(x.gather(1, indices), values)
    assert torch.equal(indices, rule_topk(x, k)[1])
    if dtype == torch.float32:  # continuous values: no ties, torch's indices too
        assert torch.equal(indices, want_i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planted_ties_rank_by_the_lower_index_across_chunks_and_at_the_cut(dtype):
    V, k = 10 * CHUNK + 37, 8
    x = torch.randn(4, V).to(dtype) - 10
    x[0, [V - 1, 5 + 2 * CHUNK, 3, 7 * CHUNK]] = 1.0  # four equal maxima in four chunks, the tail chunk included
    # row 1: every chunk's max is the same value: the chunk stage must pick the lowest chunks
    x[1, torch.arange(0, V, CHUNK) + 11] = 2.0
    # row 2: ties inside one chunk, and -0.0 against +0.0
    x[2, 10:20] = 3.0
    x[2, [CHUNK + 1, 4]] = torch.tensor([-0.0, 0.0], dtype=dtype)
    # row 3: all -inf but three, k > the finite count
    x[3] = float("-inf")
    x[3, [V - 2, 400, 900]] = torch.tensor([1.0, 1.0, -5.0], dtype=dtype)
    values, indices = fast_topk(x, k)
    want_v, want_i = rule_topk(x, k)
    assert torch.equal(values, want_v) and torch.equal(values, torch.topk(x, k).values)
    assert torch.equal(indices, want_i)
    assert indices[0, :4].tolist() == [3, 5 + 2 * CHUNK, 7 * CHUNK, V - 1]
    assert indices[1].tolist() == [c * CHUNK + 11 for c in range(k)]
    assert indices[2].tolist() == list(range(10, 18))
    assert indices[3, :3].tolist() == [400, V - 2, 900] and indices[3, 3:].tolist() == [0, 1, 2, 3, 4]


def test_zeros_of_both_signs_tie():
    x = torch.tensor([[-0.0, 0.0, -1.0] + [-2.0] * (2 * CHUNK)])
    assert fast_topk(x, 2)[1].tolist() == [[0, 1]]


def test_fp64_and_bad_k():
    x = torch.randn(3, 700, dtype=torch.float64)
    values, indices = fast_topk(x, 5)
    assert torch.equal(values, torch.topk(x, 5).values) and torch.equal(indices, torch.topk(x, 5).indices)
    with pytest.raises(ValueError, match="1 <= k <= 700"):
        fast_topk(x, 701)


def test_it_traces_as_one_graph_and_the_compiled_form_is_the_eager_one():
    compiled = torch.compile(fast_topk, fullgraph=True)
    x = (3 * torch.randn(6, 7 * CHUNK + 5)).to(torch.bfloat16)
    x[:, 100] = x[:, 3 * CHUNK + 1] = 50.0
    values, indices = compiled(x, 16)
    want_v, want_i = fast_topk(x, 16)
    assert torch.equal(values, want_v) and torch.equal(indices, want_i)
    assert indices[:, :2].tolist() == [[100, 3 * CHUNK + 1]] * 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_second_stage_the_compile_modes_install_picks_the_eager_ids(dtype):
    """compiled_select (compile_step's, fullgraph) after the eager chunk maxes: the same values and ids bit for bit,
    a ragged tail chunk, whole chunks only, and a row of fewer chunks than k (one selection); ties across chunks."""
    select = compiled_select()
    g = torch.Generator().manual_seed(5)
    for V in (9 * CHUNK + 37, 12 * CHUNK, 5 * CHUNK + 1):
        x = (3 * torch.randn(7, V, generator=g)).to(dtype)
        x[:, [2, 4 * CHUNK + 1, V - 1]] = 40.0
        want_v, want_i = fast_topk(x, 6)
        values, indices = fast_topk(x, 6, select=select)
        assert torch.equal(values, want_v) and torch.equal(indices, want_i)
        assert indices[:, :3].tolist() == [[2, 4 * CHUNK + 1, V - 1]] * 7


def test_dflash2s_objective_with_the_ce_chunks_top_k_is_the_one_with_torch_topk():
    """The CE chunks' candidates feed the selector term: loss and every gradient equal those from torch.topk's
    candidates (fp32, as the tiny CPU step runs: no tied logits)."""
    g = torch.Generator().manual_seed(0)
    M, D, V, K = 40, 16, 3 * CHUNK + 9, 6
    h = torch.randn(M, D, generator=g)
    W = torch.randn(V, D, generator=g)
    labels = torch.randint(V, (M,), generator=g)
    labels[::2] = (h @ W.t()).topk(K, dim=-1).indices[::2, 2]
    pred = torch.randint(V, (M,), generator=g)
    w = torch.rand(M, generator=g)
    torch.manual_seed(0)
    sel = CandidateSelector(D, V, 4, K)
    with torch.no_grad():
        sel.successor_codebook.normal_()

    def objective(cand=None):
        sel.zero_grad(set_to_none=True)
        h1 = h.clone().requires_grad_(True)
        loss, correct, got = chunked_lm_loss(h1, W, None, labels, w, chunk=16, top_k=K)
        term = selector_loss(sel, h1, W, None, got if cand is None else cand, labels, pred, w / w.sum(), chunk=16)
        (loss + 0.5 * term.loss).backward()
        return got, loss + 0.5 * term.loss, h1.grad, {n: p.grad for n, p in sel.named_parameters()}

    got, loss, grad_h, grads = objective()
    want = torch.topk(h @ W.t(), K, dim=-1).indices
    assert torch.equal(got, want)
    _, loss2, grad_h2, grads2 = objective(want)
    assert torch.equal(loss, loss2) and torch.equal(grad_h, grad_h2)
    assert all(torch.equal(grads[n], grads2[n]) for n in grads) and grads["successor_codebook"].abs().sum() > 0
