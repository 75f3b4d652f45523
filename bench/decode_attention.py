"""The batch generator's one-token attention alone: `python -m bench.decode_attention --shape qwen3-8b`.

One query per row at its own position over a [rows, KV heads, slots, head dim] cache, at a shape's heads, bf16:
  sdpa    SDPA with each row's mask and `enable_gqa` (what the steps run without the kernel; it reads every slot of
          the span for every row)
  kernel  `trainer/decode/step_kernel.py` (each row reads its own slots up to its position, a KV head once for its
          query heads)
Positions are seeded, uniform in [--min-pos, --slots). Prints one `DECODE_ATTN {json}` line per form: us per call
(median of `--reps` between CUDA events, after 3 untimed calls), TB/s counting the K/V each row needs (slots 0..p,
once), and the largest difference from SDPA's output. CUDA only.
"""
from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", help="named target shape (bench/shapes.py; default: qwen3-8b)")
    p.add_argument("--rows", type=int, default=256, help="rows, one query each (default: 256)")
    p.add_argument("--slots", type=int, default=512, help="cache slots a row (default: 512)")
    p.add_argument("--min-pos", type=int, default=128, help="the lowest row position (default: 128)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per form (default: 20)")
    a = p.parse_args(argv)
    from bench.shapes import SHAPES

    if a.shape not in SHAPES:
        p.error(f"unknown --shape {a.shape!r}; choose one of {sorted(SHAPES)}")
    if min(a.rows, a.slots, a.reps) < 1 or not 0 <= a.min_pos < a.slots:
        p.error("--rows, --slots and --reps must be >= 1 and 0 <= --min-pos < --slots")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.decode_attention times CUDA kernels and this machine has no CUDA GPU")
    import torch.nn.functional as F

    from bench.timing import median_call_ms
    from trainer.decode.step_kernel import step_attention

    shape = SHAPES[a.shape]
    heads, kv_heads, dh = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(a.rows, heads, 1, dh, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(a.rows, kv_heads, a.slots, dh, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(k.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.randint(a.min_pos, a.slots, (a.rows, 1), device="cuda", generator=g)
    mask = torch.arange(a.slots, device="cuda").view(1, 1, 1, -1) <= pos.view(-1, 1, 1, 1)
    scale = dh ** -0.5
    forms = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                              enable_gqa=True).transpose(1, 2),
             "kernel": lambda: step_attention(q, k, v, pos, scale)}
    reference = forms["sdpa"]().float()
    needed = float((pos + 1).sum()) * kv_heads * dh * 2 * k.element_size()  # K and V, slots 0..p of each row
    for name, call in forms.items():
        ms = median_call_ms(call, a.reps)
        row = {"form": name, "shape": a.shape, "rows": a.rows, "slots": a.slots, "min_pos": a.min_pos,
               "us": round(1e3 * ms, 1), "tb_per_s": round(needed / ms / 1e9, 2),
               "max_diff": float((call().float() - reference).abs().max()), "torch": torch.__version__,
               "device": torch.cuda.get_device_name()}
        print("DECODE_ATTN " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
