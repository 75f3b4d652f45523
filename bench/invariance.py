"""Which operation of the static target's forward computes a row differently when it comes with others: for each op,
its output on L = 16 rows against the same op on each row alone, over real activations of a quality-shaped random
target (8 blocks of 16 tokens x every layer). Lossless speculative decoding in a dtype needs 0 for every op the engine
runs (docs/quality.md, "Exact bf16").

    python -m bench.invariance                  # the H200: bf16 and fp32
    python -m bench.invariance --device cpu --blocks 1

Prints one `INVARIANCE {json}` line: per dtype, per op, "differing outputs / outputs".
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def _row_by_row(fn, x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat([fn(x.narrow(dim, r, 1)) for r in range(x.shape[dim])], dim)


def count(dtype: torch.dtype, device: torch.device, blocks: int) -> dict[str, str]:
    from trainer.decode import kernels
    from bench.decode import random_pair
    from trainer.decode.layers.attention import rope_from_inv_freq
    from trainer.decode.stack import StaticTarget
    from trainer.model.drafter import apply_rope

    target = random_pair(device, 16, dtype, num_layers=8)[0]
    static = StaticTarget(target, slots=512)
    H, Hkv, Dh = static.heads, static.kv_heads, static.head_dim
    tally: dict[str, list[int]] = {}

    def compare(name: str, together: torch.Tensor, alone: torch.Tensor) -> None:
        seen = tally.setdefault(name, [0, 0])
        seen[0] += int((together != alone).sum())
        seen[1] += together.numel()

    def op(name: str, fn, x: torch.Tensor, dim: int = 1) -> None:
        compare(name, fn(x), _row_by_row(fn, x, dim))

    torch.manual_seed(0)
    prompt = torch.randint(0, target.embed_tokens.weight.shape[0] - 1, (1, 100 + 16 * blocks), device=device)
    static.forward(prompt, torch.tensor(0, device=device))  # fills the caches with real K/V
    kernel_attention = kernels.usable_for(prompt)
    for b in range(blocks):
        p0 = 100 + 16 * b
        pos = p0 + torch.arange(16, device=device)
        x = target.embed_tokens(prompt[:, p0:p0 + 16])
        cos, sin = rope_from_inv_freq(pos, static.inv_freq, static.rope_scaling, x.dtype)
        visible = (static.slot_ids[None, :] <= pos[:, None])[None, None]
        for i, layer in enumerate(static.layers):
            attn = layer.self_attn
            op("rmsnorm (HF module)", layer.input_layernorm, x)
            op("rmsnorm (engine)", static.input_norms[i], x)
            h = static.input_norms[i](x)
            op("q_proj", attn.q_proj, h)
            op("k_proj", attn.k_proj, h)
            q = static.q_norms[i](attn.q_proj(h).view(1, 16, H, Dh))
            q = apply_rope(q.transpose(1, 2), cos, sin)
            k_cache, v_cache = static.k[i], static.v[i]

            def sdpa(qq, rows, k=k_cache, v=v_cache, gqa=H != Hkv):
                return F.scaled_dot_product_attention(qq, k, v, attn_mask=visible[:, :, rows], scale=attn.scaling,
                                                      enable_gqa=gqa)

            rows = range(16)
            compare("sdpa (GQA)", sdpa(q, slice(None)), torch.cat([sdpa(q[:, :, r:r + 1], slice(r, r + 1))
                                                                   for r in rows], 2))
            if kernel_attention:
                def triton_attention(qq, at):
                    return kernels.decode_attention(qq, k_cache, v_cache, at, attn.scaling)

                compare("attention (Triton kernel)", triton_attention(q, pos),
                        torch.cat([triton_attention(q[:, :, r:r + 1], pos[r:r + 1]) for r in rows], 1))
            out = sdpa(q, slice(None)).transpose(1, 2).reshape(1, 16, H * Dh)
            op("o_proj", attn.o_proj, out)
            x = x + attn.o_proj(out)
            op("mlp", layer.mlp, static.post_norms[i](x))
            x = x + layer.mlp(static.post_norms[i](x))
        op("lm_head", target.lm_head, static.final_norm(x))
    return {name: f"{a}/{b}" for name, (a, b) in tally.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.invariance", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--blocks", type=int, default=8, help="blocks of 16 tokens (1..20)")
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not 1 <= args.blocks <= 20 or any(d not in ("bfloat16", "float32") for d in dtypes) or not dtypes:
        p.error("--blocks must be 1..20 and --dtypes a comma list of bfloat16, float32")
    from trainer.placement import local_device

    device = local_device(args.device)
    with torch.no_grad():
        result = {d: count(getattr(torch, d), device, args.blocks) for d in dtypes}
    print("INVARIANCE " + json.dumps({"device": str(device), "torch": torch.__version__, **result}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
