"""How long a stop's checkpoint takes: `python -m bench.checkpoint --shape qwen3-8b [--dir D]`.

A stopped run (SIGTERM: `dflash-ops stop`, torchrun's shutdown) writes one checkpoint before it exits
(trainer/signals.py); the grace a stopper gives it must cover that write. This builds the drafter of a shape
(bench/shapes.py: as wide as the target, `--layers` layers, as many taps) with AdamW state as training leaves it
(fp32 weights, both moments), on the GPU where there is one, and times `trainer.checkpoint.save` itself (the copy to
the host, the writes, the fsyncs, the rename) into a run directory under `--dir` (default: the system's temp
directory; pass the disk the runs live on), `--repeat` times. Prints one `CHECKPOINT {json}` line per save
(seconds, bytes, GB/s) and a summary line with the slowest.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


def build(shape: str, layers: int, device):
    """The shape's drafter and an AdamW whose state is populated (one step on zero gradients)."""
    import torch

    from bench.shapes import qwen3_config
    from trainer.model.drafter import Drafter, DrafterConfig
    from trainer.step.step import build_optimizer

    dcfg = DrafterConfig.from_target(qwen3_config(shape, 4096), num_layers=layers, num_taps=layers)
    drafter = Drafter(dcfg).to(device)
    optimizer, _lr = build_optimizer(drafter, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, device=device)
    for p in drafter.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return drafter, optimizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", help="named target shape (bench/shapes.py; default: qwen3-8b)")
    p.add_argument("--layers", type=int, default=5, help="drafter layers (default: 5, the gpu recipe's)")
    p.add_argument("--dir", default=None, help="where to write (default: the system's temp directory)")
    p.add_argument("--repeat", type=int, default=3, help="saves to time (default: 3)")
    p.add_argument("--device", default="auto", help="auto (cuda where there is one), cpu, cuda or cuda:N")
    a = p.parse_args(argv)
    from bench.shapes import SHAPES

    if a.shape not in SHAPES:
        p.error(f"unknown --shape {a.shape!r}; choose one of {sorted(SHAPES)}")
    if a.layers < 1 or a.repeat < 1:
        p.error("--layers and --repeat must be >= 1")
    if a.dir is not None and not Path(a.dir).is_dir():
        p.error(f"--dir {a.dir} is not a directory")
    import torch

    from trainer import checkpoint
    from trainer.checkpoint import Cursor
    from trainer.placement import local_device

    device = torch.device(local_device(a.device))
    drafter, optimizer = build(a.shape, a.layers, device)
    params = sum(t.numel() for t in drafter.parameters())
    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=a.dir))
    times = []
    try:
        for i in range(a.repeat):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            path = checkpoint.save(root, Cursor(step=i + 1, micro=i + 1), drafter, optimizer, keep=1, config={})
            seconds = time.perf_counter() - t0
            size = sum(f.stat().st_size for f in path.iterdir())
            times.append(seconds)
            print("CHECKPOINT " + json.dumps({"shape": a.shape, "layers": a.layers, "params": params,
                                              "device": str(device), "dir": str(root), "seconds": round(seconds, 2),
                                              "bytes": size, "gb_per_s": round(size / seconds / 1e9, 2)}),
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint of the {a.shape} drafter ({a.layers} layers, {params / 1e9:.2f}B parameters, {size / 1e9:.1f} "
          f"GB): slowest {max(times):.1f}s of {a.repeat} saves from {device} into {root.parent}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
