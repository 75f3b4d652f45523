"""The MoE experts kernels (trainer/decode/moe_kernel.py) on CPU tensors under Triton's interpreter, in fp32: the
decode MoE MLP through them equals the naive per-token reference for every SiLU-GLU family, an expert with more
copies than a block and experts with none are served, and the families they do not serve keep the other paths."""
from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.decode.test_static_moe import family_target, redrawn_block
from tests.trainer.test_moe_routing import reference, routing_rule
from trainer.decode import moe_kernel
from trainer.decode.layers.moe import MoeMLP, route, routing_of, sort_by_expert

SILU_GLU = ("qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_moe")


def assert_each_copy(got, experts, x, chosen, weights):
    """got [T, k, D]: each copy (t, j) is its expert's SiLU-GLU of x[t] times its weight, in fp32."""
    for t in range(chosen.shape[0]):
        for j in range(chosen.shape[1]):
            e = int(chosen[t, j])
            gate, up = (x[t] @ experts.gate_up_proj[e].T).chunk(2)
            want = (torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].T * weights[t, j]
            torch.testing.assert_close(got[t, j], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", SILU_GLU)
def test_the_decode_moe_mlp_through_the_kernels_equals_the_per_token_reference(interpreter, family, family_dirs):
    target = family_target(family_dirs, family)
    config = json.loads((family_dirs[family] / "config.json").read_text())
    block, gen = redrawn_block(target)
    mlp = MoeMLP(block, routing_of(target.hf_config), config["num_experts_per_tok"], kernel=True)
    assert mlp.kernel, family
    x = torch.randn(3, 5, config["hidden_size"], generator=gen)  # 15 tokens x 2 copies over 4 experts
    assert moe_kernel.few_copies(15 * mlp.top_k, mlp.num_experts)
    want = reference(family, block, config, x.reshape(15, -1), routing_rule(family, config))
    torch.testing.assert_close(mlp(x).reshape(15, -1), want, atol=1e-4, rtol=1e-4)


def test_an_expert_past_one_block_and_experts_without_copies(interpreter, family_dirs):
    """Routing skewed on purpose: expert 1 takes every token's first copy (more copies than BLOCK_M, so its program
    walks two blocks), expert 3 none; each copy's output against the exact rule, at its own index t x k + j."""
    target = family_target(family_dirs, "qwen3_moe")
    block, gen = redrawn_block(target)
    experts = block.experts
    T, k = moe_kernel.BLOCK_M + 5, 2
    x = torch.randn(T, experts.gate_up_proj.shape[-1], generator=gen)
    chosen = torch.stack([torch.ones(T, dtype=torch.long), torch.arange(T) % 2 * 2], 1)  # experts 1 and 0 / 2
    weights = torch.rand(T, k, generator=gen)
    order, sorted_experts, offsets = sort_by_expert(chosen, experts.gate_up_proj.shape[0])
    assert offsets.tolist()[1] - offsets.tolist()[0] == T > moe_kernel.BLOCK_M and offsets.tolist()[3] == 2 * T
    assert_each_copy(moe_kernel.experts_forward(experts, x, order, offsets, weights), experts, x, chosen, weights)


def test_widths_of_several_tiles_and_loop_steps(interpreter):
    """Experts whose widths span several output tiles and input loop steps of both kernels (the tiny family models'
    fit one of each), against each copy's own product in fp32."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    class Experts(torch.nn.Module):
        _apply_gate = _default_apply_gate

        def __init__(self, E, D, I, gen):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, D, generator=gen) / D ** 0.5)
            self.down_proj = torch.nn.Parameter(torch.randn(E, D, I, generator=gen) / I ** 0.5)
            self.act_fn = SiLUActivation()

    gen = torch.Generator().manual_seed(5)
    D, I = 2 * moe_kernel.UP_TILES.k, 2 * moe_kernel.DOWN_TILES.k
    assert I // moe_kernel.UP_TILES.n >= 2 and D // moe_kernel.DOWN_TILES.n >= 2
    experts = Experts(3, D, I, gen)
    assert moe_kernel.serves(experts)
    T, k = 6, 2
    x = torch.randn(T, D, generator=gen)
    chosen = torch.stack([torch.arange(T) % 3, (torch.arange(T) + 1) % 3], 1)
    weights = torch.rand(T, k, generator=gen)
    order, _, offsets = sort_by_expert(chosen, 3)
    with torch.no_grad():
        assert_each_copy(moe_kernel.experts_forward(experts, x, order, offsets, weights), experts, x, chosen,
                         weights)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_a_prefills_many_copies_take_the_grouped_gemms_and_gpt_oss_is_not_served(interpreter, family_dirs,
                                                                                  monkeypatch, family):
    """Past MAX_COPIES_PER_EXPERT an expert the experts kernels step aside (the GEMM tiles of the grouped path reuse
    each weight tile better): the grouped GEMMs run, then `combine_sorted` (weights, order back, sum, the shared
    expert) in one pass, as the torch path computes them; gpt-oss's experts (biases, clamped GLU, transposed
    weights) are not the kernels'."""
    target = family_target(family_dirs, family)
    block, gen = redrawn_block(target)
    E = block.experts.gate_up_proj.shape[0]
    assert moe_kernel.few_copies(moe_kernel.MAX_COPIES_PER_EXPERT * E, E)
    assert not moe_kernel.few_copies(moe_kernel.MAX_COPIES_PER_EXPERT * E + 1, E)
    oss = family_target(family_dirs, "gpt_oss")
    oss_block = next(layer.mlp for layer in oss.model.model.layers if hasattr(layer.mlp, "experts"))
    assert not moe_kernel.serves(oss_block.experts)
    calls = []
    for name in ("experts_forward", "combine_sorted"):
        real = getattr(moe_kernel, name)
        monkeypatch.setattr(moe_kernel, name,
                            lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    x = torch.randn(1, moe_kernel.MAX_COPIES_PER_EXPERT * E, block.experts.gate_up_proj.shape[-1], generator=gen)
    routing, k = routing_of(target.hf_config), target.hf_config.get_text_config().num_experts_per_tok
    kernel = MoeMLP(block, routing, k, kernel=True)
    grouped = MoeMLP(block, routing, k, kernel=False)
    with torch.no_grad():
        torch.testing.assert_close(kernel(x), grouped(x), atol=1e-5, rtol=1e-5)
    assert calls == ["combine_sorted"]


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared", [False, True])
def test_combine_sorted_is_the_grouped_paths_weights_order_and_sum(interpreter, shared, weight_dtype):
    """fp32 (the interpreter's bf16 casts truncate): out [S, D] in expert order -> torch's `out * w[order]`,
    `index_copy_` back to token order, `sum(dim=1)` (+ sigmoid(gate) x shared); routing weights of out's dtype (the
    products rounded to it) and wider ones (the products in the promoted dtype)."""
    g = torch.Generator().manual_seed(4)
    T, k, D = 5, 6, moe_kernel.COMBINE_BLOCK + 40
    S = T * k
    out = torch.randn(S, D, generator=g)
    order = torch.randperm(S, generator=g)
    weights = torch.rand(T, k, generator=g).to(weight_dtype)
    gate, expert = torch.randn(T, 1, generator=g), torch.randn(T, D, generator=g)
    product = out * weights.reshape(-1)[order].unsqueeze(-1)
    want = torch.empty_like(product).index_copy_(0, order, product).view(T, k, D).sum(dim=1).float()
    want = want + (torch.sigmoid(gate) * expert if shared else 0)
    got = moe_kernel.combine_sorted(out, order, weights, torch.float32, torch.sigmoid(gate) if shared else None,
                                    expert if shared else None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, moe_kernel.combine(out.view(T, k, D), torch.float32,
                                                      torch.sigmoid(gate) if shared else None,
                                                      expert if shared else None))  # the weights and order matter


def test_without_the_interpreter_cpu_keeps_the_torch_paths(family_dirs):
    target = family_target(family_dirs, "qwen3_moe")
    block, _ = redrawn_block(target)
    assert not moe_kernel.serves(block.experts)
    assert not MoeMLP(block, routing_of(target.hf_config), 2, kernel=True).kernel


def test_the_default_takes_the_kernels_unless_switched_off(interpreter, family_dirs, kernels_off):
    """MoeMLP(kernel=None) takes the kernels unless the kernel "moe" is switched off (trainer/decode/switches.py)."""
    target = family_target(family_dirs, "qwen3_moe")
    block, _ = redrawn_block(target)
    assert MoeMLP(block, routing_of(target.hf_config), 2).kernel
    assert not MoeMLP(block, routing_of(target.hf_config), 2, kernel=False).kernel
    kernels_off(["moe"])
    assert not MoeMLP(block, routing_of(target.hf_config), 2).kernel


def test_an_unknown_kernel_is_refused_whole(kernels_off):
    from trainer.decode import switches

    with pytest.raises(KeyError, match="no decode kernel 'warp'"):
        switches.switch_off(["moe", "warp"])
    assert switches.switched_off() == []
    with pytest.raises(ValueError, match="DFLASH_DECODE_KERNELS_OFF: no decode kernel 'warp'"):
        switches.parse("moe, warp")
    assert switches.parse(" moe,,conv ") == ["moe", "conv"]


def test_routing_weights_in_fp32_give_fp32_products(interpreter, family_dirs):
    """Mixtral keeps its routing weights in fp32: the grouped path's product is then fp32, and so is the kernel's."""
    target = family_target(family_dirs, "mixtral")
    block, gen = redrawn_block(target)
    x = torch.randn(4, block.experts.gate_up_proj.shape[-1], generator=gen)
    weights, chosen = route(torch.nn.functional.linear(x, block.gate.weight), 2, routing_of(target.hf_config))
    order, _, offsets = sort_by_expert(chosen, block.experts.gate_up_proj.shape[0])
    assert moe_kernel.experts_forward(block.experts, x, order, offsets, weights.float()).dtype == torch.float32


@pytest.mark.parametrize("shared", [False, True])
def test_the_combine_kernel_sums_the_copies_and_adds_the_gated_shared_expert(interpreter, shared):
    """fp32 (the interpreter's bf16 casts truncate where the GPU rounds: the GPU test compares bf16 bits): torch's
    `out.sum(dim=1) + sigmoid(gate) * shared`, over a width of two column blocks, the last partial."""
    g = torch.Generator().manual_seed(3)
    T, k, D = 3, 8, moe_kernel.COMBINE_BLOCK + 300
    out = torch.randn(T, k, D, generator=g)
    gate, expert = torch.randn(T, 1, generator=g), torch.randn(T, D, generator=g)
    want = out.sum(dim=1) + (torch.sigmoid(gate) * expert if shared else 0)
    got = moe_kernel.combine(out, torch.float32, torch.sigmoid(gate) if shared else None, expert if shared else None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


COMPILE_FOR_H200 = r'''
import json
from tests.trainer.cubin import sm90
from trainer.decode import moe_kernel, route_kernel

up, down, combine = moe_kernel._kernels()
route_topk, sort_copies = route_kernel._kernels()
E, D, I, T, K = 256, 2048, 512, 64, 8  # qwen3.5-35b-a3b's experts, a decode step of 64 rows
S = T * K
bf16 = "*bf16"
ints = lambda names: {n: "i32" for n in names.split()}
gemm = {"UPCAST": False, "PRECISION": "tf32", "LOADED_BOUND": True, "BM": moe_kernel.BLOCK_M}
kernels = {
    "experts_up": (up, {"x_ptr": bf16, "w_ptr": bf16, "order_ptr": "*i64", "ends_ptr": "*i32", "act_ptr": bf16,
                        **ints("sx swe swn sa")},
                   {**gemm, "N_COPIES": 0, "TOP_K": K, "D": D, "I": I, "BN": moe_kernel.UP_TILES.n,
                    "BK": moe_kernel.UP_TILES.k, "STAGES": moe_kernel.UP_TILES.stages, "LIBDEVICE": True},
                   moe_kernel.UP_TILES.warps),
    "experts_down": (down, {"act_ptr": bf16, "w_ptr": bf16, "order_ptr": "*i64", "ends_ptr": "*i32",
                            "weight_ptr": bf16, "out_ptr": bf16, **ints("sa swe swn so")},
                     {**gemm, "N_COPIES": 0, "D": D, "I": I, "BN": moe_kernel.DOWN_TILES.n,
                      "BK": moe_kernel.DOWN_TILES.k, "STAGES": moe_kernel.DOWN_TILES.stages},
                     moe_kernel.DOWN_TILES.warps),
    "combine": (combine, {"out_ptr": bf16, "pos_ptr": bf16, "w_ptr": bf16, "factor_ptr": bf16, "shared_ptr": bf16,
                          "y_ptr": bf16},
                {"D": D, "K": K, "BLOCK": moe_kernel.COMBINE_BLOCK, "SHARED": True, "GATHERED": False, "ROUND": True},
                4),
    "combine_sorted": (combine, {"out_ptr": bf16, "pos_ptr": "*i64", "w_ptr": bf16, "factor_ptr": bf16,
                                 "shared_ptr": bf16, "y_ptr": bf16},
                       {"D": D, "K": K, "BLOCK": moe_kernel.COMBINE_BLOCK, "SHARED": True, "GATHERED": True,
                        "ROUND": True}, 4),
    # Mixtral's fp32 routing weights: the products stay fp32, each rounded before the sum adds it (no FMA)
    "combine_sorted_fp32": (combine, {"out_ptr": bf16, "pos_ptr": "*i64", "w_ptr": "*fp32", "factor_ptr": bf16,
                                      "shared_ptr": bf16, "y_ptr": bf16},
                            {"D": D, "K": K, "BLOCK": moe_kernel.COMBINE_BLOCK, "SHARED": False, "GATHERED": True,
                             "ROUND": False}, 4),
    "route_topk": (route_topk, {"logits_ptr": bf16, "w_ptr": bf16, "e_ptr": "*i64", **ints("stride_t")},
                   {"E": E, "LANES": 32, "ITERS": E // 32, "K": K, "KP": K, "RENORM": True, "BF16_OUT": True,
                    "LIBDEVICE": True}, 1),
    "sort_copies": (sort_copies, {"experts_ptr": "*i64", "order_ptr": "*i64", "sorted_ptr": "*i64",
                                  "offsets_ptr": "*i32"},
                    {"S": S, "CHUNK": route_kernel.sort_chunk(S), "PAD": route_kernel.NO_EXPERT}, 4),
}
out = {}
for name, (fn, sig, consts, warps) in kernels.items():
    # the strides (all multiples of 16 here) as Triton's launch specializes them; each launch's options
    compiled = sm90(fn, sig, consts, warps, aligned_ints=True, **(moe_kernel.COMBINE_OPTIONS if fn is combine else {}))
    ptx = compiled.asm["ptx"]
    out[name] = {"stages": sorted(compiled.asm), "mma": "mma" in ptx, "ieee_division": "div.rn.f32" in ptx,
                 "async_copies": "cp.async" in ptx, "shared_bytes": compiled.metadata.shared,
                 "fma": "fma.rn.f32" in ptx}
print("COMPILED " + json.dumps(out))
'''


def test_the_moe_and_route_kernels_compile_for_the_h200(tmp_path):
    """What only the compiler checks (types, layouts, shared memory), at qwen3.5-35b-a3b's decode shape with the
    default tiles: each kernel down to an sm_90 cubin; the GEMM kernels' dots on the tensor cores and their weight
    tiles streamed through shared memory by asynchronous copies, at least two tiles in flight (the loop pipelined:
    a memory-bound kernel waits on each load otherwise), within a Hopper SM's 227 KB; SiLU's IEEE division."""
    from tests.trainer.cubin import compile_for_h200

    compiled = compile_for_h200(COMPILE_FOR_H200, tmp_path)
    assert set(compiled) == {"experts_up", "experts_down", "combine", "combine_sorted", "combine_sorted_fp32",
                             "route_topk", "sort_copies"}
    assert not compiled["combine_sorted_fp32"]["fma"]
    assert all("cubin" in c["stages"] for c in compiled.values())
    tile = {"experts_up": 2 * moe_kernel.UP_TILES.n * moe_kernel.UP_TILES.k * 2,  # gate and up rows, bf16
            "experts_down": moe_kernel.DOWN_TILES.n * moe_kernel.DOWN_TILES.k * 2}
    for name, bytes_ in tile.items():
        c = compiled[name]
        assert c["mma"] and c["async_copies"] and 2 * bytes_ <= c["shared_bytes"] <= 227 * 1024, (name, c)
    # what serves() checks against a device's shared memory holds what the compiler asked for
    assert moe_kernel.shared_bytes(512, 2048, 2) >= max(compiled[n]["shared_bytes"] for n in tile)
    assert compiled["experts_up"]["ieee_division"]


def test_the_shared_expert_overlap_is_inert_off_cuda(interpreter, family_dirs):
    """The "overlap" forks a CUDA stream; on CPU tensors the layer computes as without it and makes none (the
    GPU test checks the fork and join inside captured steps)."""
    target = family_target(family_dirs, "qwen3_5_moe")
    block, gen = redrawn_block(target)
    routing = routing_of(target.hf_config)
    x = torch.randn(6, 1, target.hf_config.get_text_config().hidden_size, generator=gen)
    beside = MoeMLP(block, routing, 2, kernel=True, overlap=True)
    plain = MoeMLP(block, routing, 2, kernel=True, overlap=False)
    with torch.no_grad():
        assert torch.equal(beside(x), plain(x))
    assert beside.overlap and beside.side is None


def test_the_layers_built_for_each_kernel_are_counted(interpreter, family_dirs, kernels_off):
    """`switches.layers_taking` (what bench.generate records): on Qwen3.5-MoE's tiny target with "route" and
    "overlap" switched off, every MoE layer took the experts kernels and every Gated DeltaNet layer the conv kernel;
    nothing took what was switched off."""
    from trainer.decode import switches
    from trainer.decode.stack import StaticTarget

    target = family_target(family_dirs, "qwen3_5_moe")
    kernels_off(["route", "overlap"])
    static = StaticTarget(target, 16, rows=2, padded=True, fuse=True)
    assert switches.layers_taking(StaticTarget(target, 16, rows=2, padded=True)) == dict.fromkeys(switches.KERNELS, 0)
    moe = sum(isinstance(m, MoeMLP) for m in static.mlps)
    assert moe and static.linear
    assert switches.layers_taking(static) == {"moe": moe, "route": 0, "overlap": 0, "conv": len(static.linear)}


@pytest.mark.parametrize("family, counts", [("qwen3_5_moe", "all"), ("qwen3_moe", "no shared expert"),
                                            ("gpt_oss", "none served")])
def test_the_counts_name_only_the_layers_a_kernel_serves(interpreter, family_dirs, family, counts):
    """Every kernel on (the default): "overlap" counts only the layers with a shared expert, "moe" and "route" only
    those whose experts and routing rule the kernels serve (gpt-oss: biases, a clamped GLU, top-k then softmax)."""
    from trainer.decode import switches
    from trainer.decode.stack import StaticTarget

    static = StaticTarget(family_target(family_dirs, family), 16, rows=2, padded=True, fuse=True)
    moe = sum(isinstance(m, MoeMLP) for m in static.mlps)
    want = {"all": {"moe": moe, "route": moe, "overlap": moe, "conv": len(static.linear)},
            "no shared expert": {"moe": moe, "route": moe, "overlap": 0, "conv": 0},
            "none served": dict.fromkeys(switches.KERNELS, 0)}[counts]
    assert moe and switches.layers_taking(static) == want


def test_the_kernels_serve_only_where_their_tiles_fit_in_shared_memory():
    """qwen3.5-35b-a3b's widths in bf16 need 108 KB a block: within an H100/H200's opt-in maximum (232,448 bytes) and
    an A100's (166,912), beyond a 99 KB SM's (101,376: RTX 4090/5090, L40S), where the torch path runs instead."""
    need = moe_kernel.shared_bytes(512, 2048, 2)
    assert need == 110_592
    assert need <= 166_912 and need > 101_376
    assert moe_kernel.shared_bytes(16, 32, 4) < need  # a tiny model's tiles shrink to its widths
