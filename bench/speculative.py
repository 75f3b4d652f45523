"""Real speculative decoding of a trained pair at batch 1, on the prompts of a chat JSONL (no retraining): tau,
acceptance per position, identical outputs, and the speedup over target-only decoding, as the quality pipeline's
eval stage measures them.

    python -m bench.speculative --drafter DIR/drafter/export --target DIR/target --data DIR/data/eval.jsonl

Run from the repository root. Prints one `DFLASH_DECODE {json}` line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from trainer.quality.config import EvalCfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="drafter export directory (config.json + model.safetensors)")
    p.add_argument("--target", required=True, help="target HF model directory")
    p.add_argument("--data", required=True, help="chat JSONL whose user turns are the prompts")
    p.add_argument("--prompts", type=int, default=EvalCfg.prompts, help="prompts to decode (default: %(default)s)")
    p.add_argument("--max-new", type=int, default=EvalCfg.max_new_tokens,
                   help="new tokens per prompt (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    p.add_argument("--target-dtype", default=EvalCfg.target_dtype, choices=("float32", "bfloat16", "auto"))
    p.add_argument("--engine", default=EvalCfg.engine, choices=("static", "hf"),
                   help="static: static caches, CUDA-graph replay per step/round; hf: the DynamicCache reference")
    p.add_argument("--compile", default=EvalCfg.compile, choices=("none", "drafter", "all"),
                   help="static engine: torch.compile nothing, the drafter, or the drafter and the target")
    args = p.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for path in (Path(args.drafter) / "config.json", Path(args.target) / "config.json", Path(args.data)):
        if not path.is_file():
            print(f"error: {path} not found", file=sys.stderr)
            return 2
    from trainer.export import load_pair
    from trainer.placement import local_device
    from trainer.quality.evaluate import decode_benchmark, heldout_prompts

    target, drafter, ecfg = load_pair(Path(args.drafter), Path(args.target), local_device(args.device),
                                      args.target_dtype)
    cfg = EvalCfg(prompts=args.prompts, max_new_tokens=args.max_new, warmup=1, budget_s=float("inf"),
                  engine=args.engine, compile=args.compile)
    result = decode_benchmark(target, drafter, ecfg.block_size, heldout_prompts(Path(args.data)), cfg)
    print("DFLASH_DECODE " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
