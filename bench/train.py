"""The user's path, timed: `python -m trainer train --recipe gpu` (what the graphwarm runbooks launch) per step mode, on
a random target of a named shape saved to disk and pre-tokenized data of one document per row.

    python -m bench.train --shape small --modes graph,compile+graph [--steps 30]

Run from the repository root. Each mode is a real `trainer train` process (config, loading, capture, the loop,
metrics.jsonl); its tokens/s is the median of the logged intervals after the first (which pays for warm-up and
capture). Prints one `TRAIN_BENCH {json}` line per mode and a table. Unlike `bench.step`, which times the step
alone, this is what a user's run gets (the time outside the loop -- loading, capture, export -- is reported apart).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("eager", "compile", "graph", "compile+graph")


def make_target(out: Path, shape: str, seq: int) -> Path:
    import torch
    from transformers import Qwen3ForCausalLM

    from bench.shapes import qwen3_config
    from trainer.tiny import build_tokenizer

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_config(shape, seq)).to(torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def make_data(out: Path, rows: int, seq: int, vocab: int) -> Path:
    """One document per row: `rows` random token sequences of exactly `seq` tokens, every token supervised."""
    import random

    rng = random.Random(0)
    with out.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": [rng.randrange(10, vocab) for _ in range(seq)], "loss_mask": [1] * seq})
                    + "\n")
    return out


def run_mode(mode: str, target: Path, data: Path, run_dir: Path, steps: int, every: int, seq: int,
             extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "trainer", "train", "--recipe", "gpu", "--run-dir", str(run_dir),
           "--set", f"model.target={target}", "--set", f"data.paths=[{data}]", "--set", f"step.mode={mode}",
           "--set", f"optim.max_steps={steps}", "--set", f"log.every={every}", "--set", "ckpt.every=0",
           "--set", "eval_at_end=false", "--set", "data.eval_fraction=0.0", "--set", f"data.seq_len={seq}"]
    for item in extra:
        cmd += ["--set", item]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"mode": mode, "error": f"rc={proc.returncode}: " + " | ".join((proc.stdout + proc.stderr)
                                                                             .strip().splitlines()[-6:])[-800:]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_s"] for r in records[1:]]
    loop_s = records[-1]["elapsed_s"]
    return {"mode": mode, "tokens_per_s": round(statistics.median(steady), 1), "intervals": len(steady),
            "step_time_s": statistics.median(r["step_time_s"] for r in records[1:]),
            "peak_alloc_gib": records[-1].get("peak_mem_gib"), "loop_s": loop_s,
            "outside_loop_s": round(wall - loop_s, 1), "wall_s": round(wall, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", help="named target shape (bench/shapes.py) (default: %(default)s)")
    p.add_argument("--modes", default="graph,compile+graph",
                   help=f"comma list of {', '.join(MODES)} (default: %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per mode (default: %(default)s)")
    p.add_argument("--every", type=int, default=5, help="steps per logged interval (default: %(default)s)")
    p.add_argument("--seq", type=int, default=3072, help="tokens per row (default: the gpu recipe's %(default)s)")
    p.add_argument("--workdir", default="", help="where the target, data and runs go (default: a temp dir)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="one more trainer override for every mode (repeatable)")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        print(f"error: unknown mode(s) {bad or modes}; use {', '.join(MODES)}", file=sys.stderr)
        return 2
    if args.steps < 2 * args.every:
        print("error: --steps must be at least 2 x --every (the first interval is not counted)", file=sys.stderr)
        return 2
    from bench.shapes import SHAPES, check_shape

    check_shape(args.shape)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-train-"))
    work.mkdir(parents=True, exist_ok=True)
    seq = args.seq
    target = make_target(work / "target", args.shape, seq)
    # The gpu recipe's step: 4 rows x 4 micro-steps; enough rows for every step to see new ones.
    data = make_data(work / "data.jsonl", rows=16 * args.steps // 4 + 16, seq=seq, vocab=SHAPES[args.shape]["vocab_size"])
    results = []
    for mode in modes:
        results.append(run_mode(mode, target, data, work / f"run-{mode.replace('+', '-')}", args.steps, args.every,
                                seq, args.overrides))
        print("TRAIN_BENCH " + json.dumps(results[-1]), flush=True)
    print(f"{'mode':14} {'tok/s':>10} {'step ms':>8} {'peak GiB':>9} {'outside loop s':>15} {'wall s':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['mode']:14} FAILED: {r['error']}")
        else:
            print(f"{r['mode']:14} {r['tokens_per_s']:10.0f} {1e3 * r['step_time_s']:8.1f} "
                  f"{r['peak_alloc_gib'] or 0:9.1f} {r['outside_loop_s']:15.1f} {r['wall_s']:7.1f}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
