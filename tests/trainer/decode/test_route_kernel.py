"""The MoE router and sort-by-expert kernels (trainer/decode/route_kernel.py) on CPU tensors under Triton's
interpreter: the same experts, order, sorted experts and offsets as `route` + `sort_by_expert` on tie-free logits
(weights within an ulp: the interpreter's exp is numpy's), the documented summation order bit for bit, the tie rule,
the bounds, and the decode MoE MLP unchanged by the kernel on the tiny MoE family targets."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trainer import triton_device
from trainer.decode import route_kernel
from trainer.decode.layers.moe import MoeMLP, Routing, route, routing_of, sort_by_expert

ROUTINGS = [Routing("softmax_topk", renorm=r, cast=c) for r in (True, False) for c in (True, False)]


def tie_free(T: int, E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, E] logits, each token's a permutation of E distinct values that bf16 holds exactly (multiples of 1/8 up
    to 16 for E <= 256): no two probabilities of a token tie, so torch.topk's order is the kernel's."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.stack([torch.randperm(E, generator=g) for _ in range(T)])
    return ((perm - E // 2).float() / 8).to(dtype)


def assert_routes_as_torch(logits: torch.Tensor, k: int, routing: Routing) -> None:
    E = logits.shape[1]
    assert route_kernel.usable(logits, routing, k)
    weights, experts, order, sorted_experts, offsets = route_kernel.route_and_sort(logits, k, routing)
    want_w, want_e = route(logits, k, routing)
    want_order, want_sorted, want_offsets = sort_by_expert(want_e, E)
    assert torch.equal(experts, want_e)
    assert torch.equal(order, want_order) and torch.equal(sorted_experts, want_sorted)
    assert torch.equal(offsets, want_offsets) and offsets.dtype == torch.int32
    assert weights.dtype == want_w.dtype
    ulp = 2 ** -7 if weights.dtype == torch.bfloat16 else 2 ** -22  # one ulp either way, relative
    torch.testing.assert_close(weights.float(), want_w.float(), rtol=ulp, atol=0)


@pytest.mark.parametrize("T, E, k", [(1, 8, 1), (5, 60, 2), (64, 8, 2), (5, 256, 8), (64, 256, 8), (1, 60, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_route_and_sort_as_torch(interpreter, T, E, k, dtype):
    logits = tie_free(T, E, dtype, seed=T * E + k)
    for routing in ROUTINGS if T * E <= 1280 else ROUTINGS[::3]:  # the largest shapes: renorm and cast both, neither
        assert_routes_as_torch(logits, k, routing)


@pytest.mark.parametrize("k", [1, 2])
def test_k_experts_and_tokens_beyond_one_sort_chunk(interpreter, k, monkeypatch):
    """T x k past a sort program's chunk (several chunks a pass, the last partial) with few experts: each expert
    holds copies from many chunks, and the stable order must carry across them."""
    monkeypatch.setattr(route_kernel, "SORT_CHUNK", 128)
    logits = tie_free(300, 8, torch.float32, seed=k)
    assert 300 * k % route_kernel.sort_chunk(300 * k) and 300 * k > 2 * route_kernel.sort_chunk(300 * k)
    assert_routes_as_torch(logits, k, Routing("softmax_topk", renorm=True, cast=True))


def softmax_in_cuda_order(x: np.ndarray) -> np.ndarray:
    """x [T, E] fp32 -> probabilities [T, E] in the documented order: P = E to a power of two, lanes = min(P, 32);
    each lane sums exp(x - max) over its elements x[lane + 32 i] in order, the lanes' sums add as a butterfly
    (l + 16, then + 8, ...), each exp divided by that sum."""
    T, E = x.shape
    P = 1 << (E - 1).bit_length()
    lanes = min(P, 32)
    padded = np.full((T, P), -np.inf, np.float32)
    padded[:, :E] = x
    tile = padded.reshape(T, P // lanes, lanes)
    ex = np.exp(tile - tile.max(axis=(1, 2), keepdims=True))
    acc = np.zeros((T, lanes), np.float32)
    for i in range(P // lanes):
        acc = acc + ex[:, i]
    while acc.shape[1] > 1:
        acc = acc[:, :acc.shape[1] // 2] + acc[:, acc.shape[1] // 2:]
    return (ex / acc[:, :, None]).reshape(T, P)[:, :E]


def lanes_sum(w: np.ndarray) -> np.ndarray:
    """[T, k] -> [T] in the documented order: B = k rounded down to a power of two, v[l] = w[l] + w[l + B] where
    l + B < k, then v[l] + v[l + B / 2] at halving offsets (torch's shuffles down)."""
    B = 1 << (w.shape[1].bit_length() - 1)
    v = w[:, :B].copy()
    v[:, :w.shape[1] - B] += w[:, B:]
    while v.shape[1] > 1:
        v = v[:, :v.shape[1] // 2] + v[:, v.shape[1] // 2:]
    return v[:, 0]


@pytest.mark.parametrize("E, k", [(8, 2), (60, 8), (256, 8), (256, 6), (60, 3)])
def test_the_weights_follow_the_documented_order_bit_for_bit(interpreter, E, k):
    """With the interpreter's exp (numpy's) in both, the kernel's weights equal the documented computation's bits:
    plain, renormalised, and cast to bf16 (round to nearest even, as torch casts)."""
    logits = tie_free(6, E, torch.bfloat16, seed=E + k)
    probs = softmax_in_cuda_order(logits.float().numpy())
    _, experts = route(logits, k, Routing("softmax_topk"))
    top = np.take_along_axis(probs, experts.numpy(), axis=1)
    renormed = top / lanes_sum(top)[:, None]
    for routing, want in ((Routing("softmax_topk"), torch.from_numpy(top)),
                          (Routing("softmax_topk", renorm=True), torch.from_numpy(renormed)),
                          (Routing("softmax_topk", renorm=True, cast=True), torch.from_numpy(renormed).bfloat16())):
        weights, got_experts, *_ = route_kernel.route_and_sort(logits, k, routing)
        assert torch.equal(got_experts, experts) and weights.dtype == want.dtype
        assert torch.equal(weights, want), routing


def test_a_tie_takes_the_lowest_expert_first(interpreter):
    """Equal probabilities: the lower expert index first, both in the top k and at its cut."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0, -1.0],
                           [0.5] * 8])
    weights, experts, order, sorted_experts, offsets = route_kernel.route_and_sort(logits, 4, Routing("softmax_topk"))
    assert experts.tolist() == [[1, 2, 4, 5], [0, 1, 2, 3]]
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, experts), rtol=2 ** -22, atol=0)
    assert sorted_experts.tolist() == [0, 1, 1, 2, 2, 3, 4, 5]
    assert order.tolist() == [4, 0, 5, 1, 6, 7, 2, 3]
    assert offsets.tolist() == [1, 3, 5, 6, 7, 8, 8, 8]


def test_usable_only_within_its_bounds(interpreter, monkeypatch):
    logits = torch.zeros(64, 256)
    softmax_topk = Routing("softmax_topk", renorm=True, cast=True)
    assert route_kernel.usable(logits, softmax_topk, 8)
    assert not route_kernel.usable(logits, Routing("topk_softmax"), 8)  # gpt-oss: the torch path
    assert not route_kernel.usable(torch.zeros(2, route_kernel.MAX_EXPERTS + 1), softmax_topk, 8)
    assert not route_kernel.usable(torch.zeros(route_kernel.MAX_COPIES // 8 + 1, 256), softmax_topk, 8)
    assert not route_kernel.usable(logits, softmax_topk, route_kernel.MAX_TOP_K + 1)
    assert not route_kernel.usable(torch.zeros(4, 4), softmax_topk, 5)
    monkeypatch.setattr(triton_device, "CPU_UNDER_INTERPRETER", False)
    assert not route_kernel.usable(logits, softmax_topk, 8)  # CPU outside the kernel tests: torch's ops


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_5_moe"])
def test_the_decode_moe_mlp_is_unchanged_by_the_kernel(interpreter, monkeypatch, family, family_dirs):
    """MoeMLP on the tiny family target (redrawn weights: tokens route apart): on a one-token step with the kernels
    (the interpreter on) its output equals the torch path's and the naive per-token reference; several tokens a row
    keep the torch ops."""
    from tests.trainer.decode.test_static_moe import family_target, redrawn_block
    from tests.trainer.test_moe_routing import reference, routing_rule

    target = family_target(family_dirs, family)
    config = json.loads((family_dirs[family] / "config.json").read_text())
    block, gen = redrawn_block(target)
    k = config["num_experts_per_tok"]
    mlp = MoeMLP(block, routing_of(target.hf_config), k, grouped=False, router_kernel=True)
    assert MoeMLP(block, routing_of(target.hf_config), k).router_kernel  # on unless switched off (switches.py)
    x = torch.randn(24, 1, config["hidden_size"], generator=gen)  # one token a row: a decode step
    calls = []
    kernel = route_kernel.route_and_sort
    monkeypatch.setattr(route_kernel, "route_and_sort", lambda *args: calls.append(1) or kernel(*args))
    with torch.no_grad():
        logits = torch.nn.functional.linear(x.reshape(24, -1), mlp.router.weight)
        assert route_kernel.usable(logits, mlp.routing, k)
        got = mlp(x)
        assert len(calls) == 1
        mlp(x.reshape(3, 8, -1))  # several tokens a row (a prefill): torch's ops, whose shapes do not recompile
        assert len(calls) == 1
        monkeypatch.setattr(triton_device, "CPU_UNDER_INTERPRETER", False)
        assert not route_kernel.usable(logits, mlp.routing, k)
        want = mlp(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        naive = reference(family, block, config, x.reshape(24, -1), routing_rule(family, config))
    torch.testing.assert_close(got.reshape(24, -1), naive, atol=1e-4, rtol=1e-4)
