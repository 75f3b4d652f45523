"""The FP8 target MLP's SwiGLU quantization at a shape's width: `python -m bench.swiglu --shape qwen3-8b`.

Times the forms of silu(gate) * up -> e4m3 rows and row scales (trainer/model/fp8_target.py) on random bf16 [gate | up]
rows, the gate/up GEMM's output, `--tokens` rows (default 12,288: bench.step's 4 x 3072):
  inductor       the torch form compiled (what a compiled target layer runs without the kernel)
  row            the row kernel at the trainer's warps (`row_warps`); row-wN at N warps
  looped-bB-wN   the looped kernel with column blocks of B
Prints one `SWIGLU {json}` line per form: ms per call (median of `--reps` between CUDA events, after 3 untimed
calls), GB/s counting one read of the input and one write of the output, and the fraction of its e4m3 values equal
to the torch form's. CUDA only.
"""
from __future__ import annotations

import argparse
import json
import sys


def forms(n: int) -> dict[str, dict]:
    """name -> swiglu_e4m3_rows keyword arguments ("inductor" takes none: it is not the kernel)."""
    from trainer.model.fp8_target import ROW_KERNEL_MAX

    every: dict[str, dict] = {"inductor": {}}
    if n <= ROW_KERNEL_MAX:
        every["row"] = {}
        every.update({f"row-w{w}": {"warps": w} for w in (4, 8, 16, 32)})
    every.update({f"looped-b{b}-w{w}": {"looped_block": b, "warps": w}
                  for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16))})
    return every


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.swiglu", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", help="named target shape (bench/shapes.py; default: qwen3-8b)")
    p.add_argument("--tokens", type=int, default=12288, help="rows (default: 12288)")
    p.add_argument("--reps", type=int, default=50, help="timed calls per form (default: 50)")
    p.add_argument("--only", default="", help="comma list of form names (default: all)")
    a = p.parse_args(argv)
    from bench.shapes import SHAPES

    if a.shape not in SHAPES:
        p.error(f"unknown --shape {a.shape!r}; choose one of {sorted(SHAPES)}")
    if a.tokens < 1 or a.reps < 1:
        p.error("--tokens and --reps must be >= 1")
    n = SHAPES[a.shape]["intermediate_size"]
    every = forms(n)
    names = [name for name in a.only.split(",") if name] or list(every)
    unknown = [name for name in names if name not in every]
    if unknown:
        p.error(f"unknown --only form(s) {unknown}; choose from {list(every)}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.swiglu times CUDA kernels and this machine has no CUDA GPU")
    from bench.timing import median_call_ms
    from trainer.model.fp8_target import swiglu_e4m3_reference, swiglu_e4m3_rows

    torch.manual_seed(0)
    gu = torch.randn(a.tokens, 2 * n, device="cuda", dtype=torch.bfloat16) * 3
    want = swiglu_e4m3_reference(gu, n)[0].float()
    compiled = torch.compile(swiglu_e4m3_reference, dynamic=False)
    moved = gu.numel() * 2 + a.tokens * n + a.tokens * 4  # bytes: the bf16 input once, the e4m3 output, the scales
    env = {"shape": a.shape, "tokens": a.tokens, "intermediate": n, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__}
    for name in names:
        kwargs = every[name]

        def call(kwargs=kwargs, name=name):
            return compiled(gu, n) if name == "inductor" else swiglu_e4m3_rows(gu, n, **kwargs)

        try:
            ms = median_call_ms(call, a.reps)
            equal = float((call()[0].float() == want).float().mean())
        except Exception as e:  # noqa: BLE001 -- a form the compiler refuses (registers, shared memory) is a row
            print("SWIGLU " + json.dumps({"form": name, "error": str(e).splitlines()[0][:200], **env}), flush=True)
            continue
        print("SWIGLU " + json.dumps({"form": name, "ms": ms, "gb_per_s": round(moved / ms / 1e6, 1),
                                      "equal_to_torch": round(equal, 6), **env}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
