"""DFlash2's drafter pieces (trainer/model/dynconv.py, trainer/model/selector.py, drafter.Dflash2Layer): the
convolution against a plain loop of its rule for random weights, the identity at init (a fresh DFlash2 drafter
computes what the DFlash drafter with the same weights does), the selector's score, lattice and greedy walk against
loops, and gradients reaching every DFlash2 parameter."""
from __future__ import annotations

import pytest
import torch

from trainer.model.attention import make_layout
from trainer.model.drafter import Dflash2Config, Drafter, DrafterConfig
from trainer.model.dynconv import GroupedDynamicConv, grouped_conv
from trainer.model.selector import CandidateSelector, transform_unary

B, D, V = 4, 16, 40


def loop_conv(x, delta, base, block_size, group_size):
    """out[r, q, h] = sum_{t <= q mod B} (base[t, h] + delta[r, q, t, h // g]) * x[r, q - t, h], element by element."""
    R, Q, Dx = x.shape
    out = torch.zeros_like(x)
    for r in range(R):
        for q in range(Q):
            i = q % block_size
            for h in range(Dx):
                for t in range(base.shape[0]):
                    if t <= i:
                        out[r, q, h] += (base[t, h] + delta[r, q, t, h // group_size]) * x[r, q - t, h]
    return out


@pytest.mark.parametrize("taps,group", [(1, 4), (2, 4), (3, 8), (4, 1), (4, 16)])
def test_the_convolution_is_its_rule_for_random_weights(taps, group):
    g = torch.Generator().manual_seed(taps * 7 + group)
    x = torch.randn(2, 3 * B, D, generator=g, dtype=torch.float64)
    delta = torch.randn(2, 3 * B, taps, D // group, generator=g, dtype=torch.float64)
    base = torch.randn(taps, D, generator=g, dtype=torch.float64)
    assert torch.allclose(grouped_conv(x, delta, base, B, group), loop_conv(x, delta, base, B, group), atol=1e-12)


def test_the_module_projects_both_sides_kernels_from_the_sublayers_input():
    torch.manual_seed(0)
    conv = GroupedDynamicConv(D, B, 3, 4).double()
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn_like(p))
    x, y = torch.randn(2, 2 * B, D, dtype=torch.float64), torch.randn(2, 2 * B, D, dtype=torch.float64)
    delta = (x @ conv.kernel_projection.weight.t()).view(2, 2 * B, 2, 3, D // 4)
    out, kernel = conv.prepare(x)
    assert torch.allclose(out, loop_conv(x, delta[:, :, 0], conv.base_kernel[0], B, 4), atol=1e-10)
    assert torch.allclose(conv.finish(y, kernel), loop_conv(y, delta[:, :, 1], conv.base_kernel[1], B, 4), atol=1e-10)
    assert tuple(conv.base_kernel.shape) == (2, 3, D) and tuple(conv.kernel_projection.weight.shape) == (2 * 3 * 4, D)


def test_a_fresh_convolution_is_the_identity():
    conv = GroupedDynamicConv(D, B, 2, 4)
    x = torch.randn(1, 2 * B, D)
    out, kernel = conv.prepare(x)
    assert torch.equal(out, x) and torch.equal(conv.finish(x * 2, kernel), x * 2)


def test_the_convolution_refuses_what_its_shapes_cannot_hold():
    with pytest.raises(ValueError, match="must divide"):
        GroupedDynamicConv(D, B, 2, 5)
    with pytest.raises(ValueError, match="conv_kernel_size"):
        GroupedDynamicConv(D, B, B + 1, 4)
    with pytest.raises(ValueError, match="selector_top_k"):
        CandidateSelector(D, V, 4, V + 1)


class _Hf:
    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim = D, 32, 2, 1, 8
    rms_norm_eps, rope_theta, num_hidden_layers = 1e-6, 10000.0, 4


def d2(**over) -> Dflash2Config:
    return Dflash2Config(**{**dict(block_size=B, vocab_size=V, conv_kernel_size=2, conv_group_size=4,
                                   selector_rank=6, selector_top_k=5), **over})


def drafters(seed=0):
    torch.manual_seed(seed)
    base = Drafter(DrafterConfig.from_target(_Hf, num_layers=2, num_taps=2))
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.05 * torch.randn_like(p))
    two = Drafter(DrafterConfig.from_target(_Hf, num_layers=2, num_taps=2, dflash2=d2()))
    missing, unexpected = two.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing) and missing
    return base, two


def inputs(R=2, S=24, N=3):
    g = torch.Generator().manual_seed(1)
    anchor = torch.tensor([[2, 9, 15]] * R)
    layout = make_layout(torch.arange(S).expand(R, S), torch.zeros(R, S, dtype=torch.long), anchor,
                         torch.ones(R, N, dtype=torch.bool), B)
    return torch.randn(R, S, 2 * D, generator=g), torch.randn(R, N * B, D, generator=g), layout


def test_a_fresh_dflash2_drafter_computes_what_dflash_does_on_the_same_weights():
    base, two = drafters()
    feats, block, layout = inputs()
    assert torch.equal(two(feats, block, layout), base(feats, block, layout))
    # and the DFlash drafter's state dict has none of DFlash2's names (its export is unchanged)
    assert not [k for k in base.state_dict() if "conv" in k or "selector" in k]


def test_a_trained_convolution_changes_the_output_and_reads_only_its_own_block():
    _, two = drafters()
    with torch.no_grad():
        for layer in two.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.kernel_projection.weight.normal_(0, 0.3)
                conv.base_kernel.add_(0.2 * torch.randn_like(conv.base_kernel))
    feats, block, layout = inputs(R=1)
    out = two(feats, block, layout)
    _, base = drafters()
    assert not torch.allclose(out, base(feats, block, layout), atol=1e-4)
    # The blocks attend only to the context and to themselves, and the convolution never crosses a block's start:
    # changing block 2's embeddings leaves blocks 0 and 1 alone.
    changed = block.clone()
    changed[:, 2 * B:] += 1.0
    again = two(feats, changed, layout)
    assert torch.allclose(again[:, :2 * B], out[:, :2 * B], atol=1e-6) and not torch.allclose(again, out)


def test_gradients_reach_every_dflash2_parameter_once_the_zero_ones_move():
    _, two = drafters()
    feats, block, layout = inputs()
    hidden = two(feats, block, layout)
    sel = two.candidate_selector
    cand = torch.randint(0, V, (hidden.shape[0], hidden.shape[1], 5))
    pred = torch.randint(0, V, hidden.shape[:2])
    (hidden.square().sum() + sel.score(cand, torch.randn(cand.shape), hidden, pred).square().sum()).backward()
    grads = {n: p.grad for n, p in two.named_parameters() if "conv" in n or "selector" in n}
    assert all(g is not None for g in grads.values())
    # The zero-initialized factors receive gradient first (the others through them once they are non-zero).
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "kernel_projection" in n or "base_kernel" in n)
    assert grads["candidate_selector.successor_codebook"].abs().sum() > 0


def test_the_selector_scores_are_the_low_rank_transition_and_start_as_the_unary_logits():
    torch.manual_seed(0)
    sel = CandidateSelector(D, V, 6, 5).double()
    cand = torch.randint(0, V, (3, 5))
    unary, h, pred = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, D, dtype=torch.float64), torch.tensor([1, 2, 3])
    assert torch.equal(sel.score(cand, unary, h, pred), unary)  # fresh: the successor codebook is 0
    with torch.no_grad():
        sel.successor_codebook.normal_()
    want = torch.stack([torch.stack([unary[m, k] + sum(sel.predecessor_codebook[pred[m], r]
                                                       * (sel.hidden_projection.weight[r] @ h[m])
                                                       * sel.successor_codebook[cand[m, k], r] for r in range(6))
                                     for k in range(5)]) for m in range(3)])
    assert torch.allclose(sel.score(cand, unary, h, pred), want, atol=1e-10)


def test_the_greedy_walk_follows_the_best_transition_from_the_anchor():
    torch.manual_seed(0)
    sel = CandidateSelector(D, V, 6, 5)
    with torch.no_grad():
        sel.successor_codebook.normal_()
    R, L = 3, B - 1
    cand = torch.stack([torch.randperm(V)[:5] for _ in range(R * L)]).view(R, L, 5)
    unary, h, anchor = torch.randn(R, L, 5), torch.randn(R, L, D), torch.randint(0, V, (R,))
    path = sel.greedy_path(cand, unary, h, anchor)
    for r in range(R):
        prev = anchor[r]
        for pos in range(L):
            scores = sel.score(cand[r, pos], unary[r, pos], h[r, pos], prev)
            prev = cand[r, pos, scores.argmax()]
            assert path[r, pos] == prev


def test_the_unary_transform_is_the_serving_stacks():
    x = torch.tensor([-40.0, -1.0, 0.0, 3.0, 50.0])
    assert torch.equal(transform_unary(x), x)
    assert torch.allclose(transform_unary(x, 0.5, 30.0), torch.tanh(x * 0.5 / 30.0) * 30.0)


def test_the_convolution_keeps_one_input_sized_tensor_per_tap_for_its_backward():
    """What autograd saves: the input and its T - 1 shifted copies, plus the small base and dynamic kernels -- no
    full-size coefficient tensor (base + delta broadcast over the channels would be one more per tap)."""
    T, group = 2, 16
    x = torch.randn(4, 4 * 16, 256, requires_grad=True)
    delta = torch.randn(4, 4 * 16, T, 256 // group, requires_grad=True)
    base = torch.randn(T, 256, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        grouped_conv(x, delta, base, 16, group)
    assert sum(saved.values()) <= (T + 0.25) * x.numel() * x.element_size()
