"""A hybrid's Gated DeltaNet layer at decode alone: `python -m bench.linear_step --shape qwen3.5-35b-a3b --rows 64`.

One Gated DeltaNet layer of a hybrid shape (bench/shapes.py), random weights, bf16, `--rows` rows of one token, each
form captured in a CUDA graph as the batch generator's step captures it (the state advancing at every replay):
  state-kernel    `trainer/decode/recurrent_kernel.py`'s step alone: the fp32 state read and written once
  layer           the layer's whole step as the batch generator runs it: the joined input projections
                  (`decode/fused.py`), `conv_step.py`'s conv and gates, the recurrent kernel, `gated_norm.py`, the
                  output projection
  layer-conv-off  the same with the kernel "conv" off (the torch ops for the conv, its state shift and the gates)
Prints one `LINEAR_BENCH {json}` line per form: us per replay (median of `--reps` between CUDA events, after 3 untimed
replays) and TB/s of the recurrent state read and written (R x Hv x dk x dv fp32, twice). `--tiles BV,WARPS[;...]`
times the state kernel and the layer at other settings of the recurrent kernel (value columns a program, warps).
CUDA only.
"""
from __future__ import annotations

import argparse
import json


def _tiles(text: str) -> list[tuple[int, int]]:
    try:
        tiles = [tuple(int(v) for v in part.split(",")) for part in text.split(";") if part.strip()]
    except ValueError:
        tiles = []
    if not tiles or any(len(t) != 2 or min(t) < 1 or t[0] & (t[0] - 1) or t[1] & (t[1] - 1) or t[1] > 16
                        for t in tiles):
        raise argparse.ArgumentTypeError(f"--tiles takes BV,WARPS[;...]: powers of two, WARPS <= 16, got {text!r}")
    return tiles


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.linear_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3.5-35b-a3b", help="a hybrid shape of bench/shapes.py (default: "
                   "qwen3.5-35b-a3b)")
    p.add_argument("--rows", type=int, default=64, help="rows, one token each (default: 64)")
    p.add_argument("--reps", type=int, default=20, help="timed replays per form (default: 20)")
    p.add_argument("--tiles", type=_tiles, default=None, help="recurrent kernel settings to time: BV,WARPS;...")
    a = p.parse_args(argv)
    from bench.shapes import SHAPES

    hybrids = sorted(n for n, s in SHAPES.items() if "linear_num_value_heads" in s)
    if a.shape not in hybrids:
        p.error(f"--shape {a.shape!r}: choose a hybrid shape, one of {hybrids}")
    if min(a.rows, a.reps) < 1:
        p.error("--rows and --reps must be >= 1")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.linear_step times CUDA kernels and this machine has no CUDA GPU")
    return _run(a, torch)


def _layer(shape: str):
    """The shape's first layer's Gated DeltaNet module, bf16 on CUDA (every hybrid shape's first layer is one)."""
    from bench.shapes import first_layer

    cfg, layer = first_layer(shape)
    if not hasattr(layer, "linear_attn"):
        raise SystemExit(f"bench.linear_step: {shape}'s first layer is not a Gated DeltaNet layer")
    return cfg, layer.linear_attn


def _run(a, torch) -> int:
    from bench.timing import graphed, median_call_ms
    from trainer.decode import recurrent_kernel
    from trainer.decode.fused import joined
    from trainer.decode.layers.linear import GatedDeltaNetDecode
    from trainer.model.linear_attention import input_projections

    cfg, inner = _layer(a.shape)
    R, Hk, Hv = a.rows, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    q, k, v = randn(R, 1, Hk, dk), randn(R, 1, Hk, dk), randn(R, 1, Hv, dv)
    g = -torch.rand(R, 1, Hv, device="cuda", generator=gen)  # a log decay
    beta = torch.rand(R, 1, Hv, device="cuda", generator=gen).bfloat16()
    state = torch.zeros(R, Hv, dk, dv, device="cuda")
    x = randn(R, 1, cfg.hidden_size)
    layers = {}
    for name, conv in (("layer", True), ("layer-conv-off", False)):
        layers[name] = GatedDeltaNetDecode(inner, R, block=1, fused=True, conv_kernel=conv)
        layers[name].joined = joined(input_projections(inner))
    calls = {"state-kernel": lambda: recurrent_kernel.gated_delta_step_(q, k, v, g, beta, state),
             **{name: (lambda layer=layer: layer.step(x)) for name, layer in layers.items()}}
    state_bytes = 2 * state.numel() * state.element_size()
    default = (recurrent_kernel.BLOCK_V, recurrent_kernel.WARPS)
    with torch.no_grad():
        for tiles in a.tiles or [None]:
            recurrent_kernel.BLOCK_V, recurrent_kernel.WARPS = tiles or default
            for name, call in calls.items():
                if tiles is not None and name == "layer-conv-off":
                    continue  # the conv's form is not the tile's: once, at the default
                try:
                    replay, _ = graphed(call)
                    ms = median_call_ms(replay, a.reps)
                except Exception as e:  # a setting the compiler refuses: the others still run
                    print("LINEAR_BENCH " + json.dumps({"form": name, "tiles": tiles, "error": repr(e)[:200]}),
                          flush=True)
                    continue
                row = {"form": name, "shape": a.shape, "rows": R, "us": round(1e3 * ms, 1),
                       "state_tb_per_s": round(state_bytes / ms / 1e9, 2), "tiles": tiles or "default",
                       "torch": torch.__version__, "device": torch.cuda.get_device_name()}
                print("LINEAR_BENCH " + json.dumps(row), flush=True)
    recurrent_kernel.BLOCK_V, recurrent_kernel.WARPS = default
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
