"""Stand-in for the trainer in status / gpu-reset tests: prints the contract's metrics lines (docs/contracts.md
section 3) with a human line next to each, keeps fake nvidia device nodes open, optionally starts a DataLoader-like
child holding more GPU memory, and runs until killed (or for --steps intervals, then prints DFLASH_DONE).

    python fake_trainer.py [--dev PATH]... [--child GPU:MIB] [--steps N] [--interval S] [--ignore-term]
                           [--slow-term S --ckpt DIR]
GPU memory comes from FAKE_NVIDIA_HOLD in its environment (see tests/support/fake_nvidia_smi.py). With --slow-term,
SIGTERM makes it do what the trainer does, slowly: take S seconds to write a checkpoint (DIR/step_<N>/state, by
tmp + rename), print `DFLASH_STOPPED {"step": N, ...}` and exit 143.
"""
import os
import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dev", action="append", default=[])
    ap.add_argument("--child")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--ignore-term", action="store_true", help="only SIGKILL ends it (a job stuck in a collective)")
    ap.add_argument("--slow-term", type=float)
    ap.add_argument("--ckpt")
    args = ap.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    step = 0
    if args.slow_term is not None:
        def stop(*_):
            time.sleep(args.slow_term)
            done = Path(args.ckpt) / f"step_{step}"
            done.parent.mkdir(parents=True, exist_ok=True)
            part = done.with_name(done.name + ".tmp")
            part.mkdir()
            (part / "state").write_text(f"weights at step {step}\n")
            os.replace(part, done)
            print("DFLASH_STOPPED " + json.dumps({"step": step, "checkpoint": str(done)}), flush=True)
            os._exit(143)
        signal.signal(signal.SIGTERM, stop)
    held = [open(p, "rb") for p in args.dev]  # noqa: SIM115 -- held open on purpose
    if args.child:
        holder = Path(__file__).with_name("gpu_holder.py")
        ready = Path(f"/tmp/fake-trainer-child-{time.time_ns()}")
        subprocess.Popen([sys.executable, str(holder), "--hold", args.child, "--ready", str(ready),
                          *[f"--dev={d}" for d in args.dev]])
    while not args.steps or step < args.steps:
        step += 10
        m = {"step": step, "epoch": 0, "loss": round(4.0 - step / 1000, 4), "acc": round(step / 1000, 4),
             "tokens_per_s": 51234.5, "lr": 6e-4, "step_time_s": 0.41, "elapsed_s": step * 0.04}
        print(f"step {step} loss {m['loss']:.4f} acc {m['acc']:.3f}", flush=True)
        print("DFLASH_METRICS " + json.dumps(m), flush=True)
        time.sleep(args.interval)
    print("DFLASH_DONE " + json.dumps({"step": step}), flush=True)
    del held


if __name__ == "__main__":
    main()
