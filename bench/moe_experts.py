"""An MoE layer at decode alone: `python -m bench.moe_experts --shape qwen3.5-35b-a3b --rows 64`.

One sparse MoE block of a shape (bench/shapes.py), random weights (the router's drawn wide, so that the rows route
apart as a trained router's do), bf16, `--rows` tokens, each form captured in a CUDA graph as the batch generator's
step captures it:
  grouped  the experts as `grouped_mm` GEMMs (`trainer/decode/layers/moe.py`, the kernels off)
  kernel   `trainer/decode/moe_kernel.py`'s two kernels (what the step runs where they serve the experts)
for the whole block (router, sort, experts, shared expert) and for each half of the experts alone, given the sorted
copies: `up-*` (gate/up GEMM and SiLU x up) and `down-*` (down GEMM, routing weight, copies back in token order), and
for the router and the sort alone: `route-torch` (softmax, top-k, renorm, the stable sort by expert) against
`route-kernel` (`trainer/decode/route_kernel.py`), compared on the routing weights. The whole-block `kernel` form
takes both kernels (as the batch generator's step does), with the shared expert where the shape has one.
Prints one `MOE_BENCH {json}` line per form: us per replay (median of `--reps` between CUDA events, after 3 untimed
replays), TB/s counting the expert weights the form streams (each touched expert's once), and the largest difference
from the grouped form's output. `--tiles BN,BK,STAGES,WARPS[;...]` times the kernel forms at other tile settings
(`moe_kernel.Tiles`, both kernels at once; each half's line shows which suits it). CUDA only.
"""
from __future__ import annotations

import argparse
import json


def _tiles(text: str) -> list[tuple[int, int, int, int]]:
    try:
        tiles = [tuple(int(v) for v in part.split(",")) for part in text.split(";") if part.strip()]
    except ValueError:
        tiles = []
    if not tiles or any(len(t) != 4 or min(t) < 1 for t in tiles):
        raise argparse.ArgumentTypeError(f"--tiles takes BN,BK,STAGES,WARPS[;...] of positive ints, got {text!r}")
    return tiles


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe_experts", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3.5-35b-a3b", help="an MoE shape of bench/shapes.py (default: "
                   "qwen3.5-35b-a3b)")
    p.add_argument("--rows", type=int, default=64, help="tokens, one a row (default: 64)")
    p.add_argument("--reps", type=int, default=20, help="timed replays per form (default: 20)")
    p.add_argument("--tiles", type=_tiles, default=None, help="kernel tile settings to time: BN,BK,STAGES,WARPS;...")
    a = p.parse_args(argv)
    from bench.shapes import SHAPES

    if a.shape not in SHAPES or "moe_intermediate_size" not in SHAPES[a.shape]:
        p.error(f"--shape {a.shape!r}: choose an MoE shape, one of "
                f"{sorted(n for n, s in SHAPES.items() if 'moe_intermediate_size' in s)}")
    if min(a.rows, a.reps) < 1:
        p.error("--rows and --reps must be >= 1")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.moe_experts times CUDA kernels and this machine has no CUDA GPU")
    return _run(a, torch)


def _block(shape: str):
    """The shape's first MoE block, bf16 on CUDA, the router drawn wide."""
    import torch

    from bench.shapes import first_layer

    cfg, layer = first_layer(shape)
    block = layer.mlp
    router = getattr(block, "gate", None) or block.router
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0, generator=g)
        for name in ("gate_up_proj", "down_proj"):
            getattr(block.experts, name).normal_(0.0, 0.02, generator=g)
    return cfg, block


def _run(a, torch) -> int:
    from bench.timing import graphed, median_call_ms
    from trainer.decode import moe_kernel, route_kernel
    from trainer.decode.layers.moe import MoeMLP, grouped_linear, route, routing_of, sort_by_expert

    cfg, block = _block(a.shape)
    k, routing = cfg.num_experts_per_tok, routing_of(cfg)
    experts = block.experts
    E = experts.gate_up_proj.shape[0]
    x = torch.randn(a.rows, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(1))
    flat = x.view(a.rows, -1)
    router = getattr(block, "gate", None) or block.router
    logits = torch.nn.functional.linear(flat, router.weight)
    weights, chosen = route(logits, k, routing)
    order, sorted_experts, offsets = sort_by_expert(chosen, E)
    touched = int(torch.unique(chosen).numel())
    up_bytes, down_bytes = (touched * experts.gate_up_proj[0].numel() * 2, touched * experts.down_proj[0].numel() * 2)
    act = moe_kernel.experts_up(experts, flat, order, offsets, k)

    def up_grouped():
        return experts._apply_gate(grouped_linear(flat[order // k], experts.gate_up_proj, False, offsets,
                                                  sorted_experts, True))

    def down_grouped():
        out = grouped_linear(act, experts.down_proj, False, offsets, sorted_experts, True)
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.empty_like(out).index_copy_(0, order, out).view(a.rows, k, -1)

    def route_torch():
        routed, picked = route(logits, k, routing)
        sort_by_expert(picked, E)
        return routed

    grouped_mlp = MoeMLP(block, routing, k, kernel=False, router_kernel=False)
    kernel_mlp = MoeMLP(block, routing, k, kernel=True, router_kernel=True)
    if not kernel_mlp.kernel:
        raise SystemExit(f"moe_kernel does not serve {a.shape}'s experts here")
    # form -> (its reference form, the expert weight bytes it streams)
    forms = {"grouped": ("grouped", up_bytes + down_bytes), "kernel": ("grouped", up_bytes + down_bytes),
             "up-grouped": ("up-grouped", up_bytes), "up-kernel": ("up-grouped", up_bytes),
             "down-grouped": ("down-grouped", down_bytes), "down-kernel": ("down-grouped", down_bytes),
             "route-torch": ("route-torch", None), "route-kernel": ("route-torch", None)}
    calls = {"grouped": lambda: grouped_mlp(x), "kernel": lambda: kernel_mlp(x), "up-grouped": up_grouped,
             "up-kernel": lambda: moe_kernel.experts_up(experts, flat, order, offsets, k),
             "down-grouped": down_grouped,
             "route-torch": route_torch,
             "route-kernel": lambda: route_kernel.route_and_sort(logits, k, routing)[0],
             "down-kernel": lambda: moe_kernel.experts_down(experts, act, order, offsets, weights)}
    captured = {name: (None, *graphed(calls[name]))
                for name in ("grouped", "up-grouped", "down-grouped", "route-torch", "route-kernel")}
    rows = list(captured.items())
    default = (moe_kernel.UP_TILES, moe_kernel.DOWN_TILES)
    for tiles in a.tiles or [None]:
        if tiles is not None:
            setting = moe_kernel.Tiles(*tiles)
            I, D = experts.down_proj.shape[2], experts.down_proj.shape[1]
            if not (moe_kernel.divides(I, D, setting) and moe_kernel.divides(D, I, setting)):
                # unmasked weight loads past a tile that does not divide the widths would read out of bounds
                print("MOE_BENCH " + json.dumps({"form": "kernel", "tiles": tiles, "error": "tiles that do not divide "
                                                 f"the widths (D {D}, I {I}) into powers of two >= 16"}), flush=True)
                continue
            moe_kernel.UP_TILES = moe_kernel.DOWN_TILES = setting
        for name in ("kernel", "up-kernel", "down-kernel"):
            try:
                rows.append((name, (tiles, *graphed(calls[name]))))
            except Exception as e:  # a tile setting the compiler refuses (shared memory): the others still run
                print("MOE_BENCH " + json.dumps({"form": name, "tiles": tiles, "error": repr(e)[:200]}), flush=True)
    moe_kernel.UP_TILES, moe_kernel.DOWN_TILES = default
    for name, (tiles, replay, out) in rows:
        reference, weight_bytes = forms[name]
        ms = median_call_ms(replay, a.reps)
        row = {"form": name, "shape": a.shape, "rows": a.rows, "experts_touched": touched, "experts": E,
               "us": round(1e3 * ms, 1),
               "expert_tb_per_s": None if weight_bytes is None else round(weight_bytes / ms / 1e9, 2),
               "max_diff": float((out.float() - captured[reference][2].float()).abs().max()),
               "tiles": tiles or ("default" if name in ("kernel", "up-kernel", "down-kernel") else None),
               "torch": torch.__version__, "device": torch.cuda.get_device_name()}
        print("MOE_BENCH " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
