"""CandidateSelector.score's codebook gathers (F.embedding, for its CUDA backward) against plain indexing."""
import torch

from trainer.model.selector import CandidateSelector


def test_the_embedding_gathers_score_and_train_as_indexing_does():
    torch.manual_seed(0)
    M, D, V, K, r = 300, 16, 500, 8, 32
    sel = CandidateSelector(D, V, r, K)
    with torch.no_grad():
        sel.successor_codebook.normal_()
    h, unary = torch.randn(M, D), torch.randn(M, K)
    cand, pred = torch.randint(0, 20, (M, K)), torch.randint(0, 10, (M,))  # ids repeat, as common tokens do
    got = sel.score(cand, unary, h, pred)
    got.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in sel.named_parameters()}
    sel.zero_grad(set_to_none=True)
    context = sel.predecessor_codebook[pred] * sel.hidden_projection(h)
    want = unary + torch.einsum("mr,mkr->mk", context, sel.successor_codebook[cand])
    want.square().sum().backward()
    assert torch.equal(got, want)
    assert torch.equal(grads["predecessor_codebook"], sel.predecessor_codebook.grad)
    assert torch.equal(grads["hidden_projection.weight"], sel.hidden_projection.weight.grad)
    # the [M, K] ids' repeated rows are summed in another order: equal up to fp32 rounding
    torch.testing.assert_close(grads["successor_codebook"], sel.successor_codebook.grad, rtol=1e-6, atol=1e-6)
    assert int((sel.successor_codebook.grad.abs().sum(dim=1) > 0).sum()) == 20
