"""Several variants of the quality pipeline at once, one per GPU, and one table to compare them.

  python -m trainer.quality.sweep --recipe quality_gpu --out DIR --variant base \
      --variant "layers4 drafter.model.num_draft_layers=4" [--slots 0,1]

A variant is a name and `--set` overrides (`"NAME KEY=VALUE ..."`). Each runs `trainer.quality.pipeline` into
DIR/NAME (its output in DIR/NAME.log) on its own slot: a GPU index (CUDA_VISIBLE_DEVICES), or `cpu`; `--slots cpu:2`
runs two at a time on the CPU. Default: every visible GPU, else one CPU slot. With fewer slots than variants, a
variant waits for a free slot: `--slots 0` runs them one after another on one GPU.

The drafter's architecture and optimizer are overrides too (`--variant "dflash2 drafter.model.drafter=dflash2"`,
`--variant "muon drafter.optim.name=muon"`); the table names each variant's as its quality.json records them.

Shared target: when every variant overrides what builds the target and its data (corpus, target, pretrain, regen) in
the same way (or not at all), the first variant runs the whole pipeline. The others, once its regenerate stage is
recorded, train and evaluate their drafters on its target and data (`--reuse`). Their drafters then differ by their
overrides only, not by a different target: GPU pretraining is not bitwise reproducible, and two targets from one
recipe already move τ by ~0.2. `--independent` runs every variant whole instead.

Writes DIR/sweep.json and prints a table and one line `DFLASH_SWEEP {json}`. Exit 0 when every variant finished, 1
otherwise; bad arguments: one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_ops.wire import SWEEP_PREFIX
from trainer.errors import ConfigError, run_cli

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")
# Sections that build the target and its data: a variant that changes them cannot share the first one's.
TARGET_AND_DATA = ("corpus.", "target.", "pretrain.", "regen.")
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...] = ()


def parse_variant(text: str) -> Variant:
    """"NAME KEY=VALUE ..." -> Variant (pure)."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"--variant {text!r}: {exc}") from None
    if not words or not NAME.fullmatch(words[0]):
        raise ConfigError(f"--variant {text!r}: the first word must be a name of letters, digits, '_', '-', '.' "
                          f"(at most 40)")
    bad = [w for w in words[1:] if "=" not in w or w.startswith("=")]
    if bad:
        raise ConfigError(f"--variant {words[0]}: {bad[0]!r} is not KEY=VALUE")
    return Variant(words[0], tuple(words[1:]))


def parse_slots(text: str | None, visible: list[str]) -> list[str]:
    """"0,1" / "cpu" / "cpu:2" / None (every visible GPU, else one CPU slot) -> slot names (pure). A GPU slot is
    what its pipeline gets as CUDA_VISIBLE_DEVICES; `visible` lists the GPUs this process may use, as the same
    variable names them."""
    if text is None:
        return list(visible) or ["cpu"]
    match = re.fullmatch(r"cpu(?::([1-9][0-9]?))?", text)
    if match:
        return ["cpu"] * int(match.group(1) or 1)
    gpus = text.split(",")
    if not all(g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
        raise ConfigError(f"--slots {text!r}: give distinct GPU indices (0,1), cpu, or cpu:N")
    return gpus


def shares_target(variants: list[Variant]) -> bool:
    """Whether every variant can train on the first one's target and data: they all override what builds them
    alike (pure)."""
    def target_and_data(v: Variant) -> frozenset[str]:
        return frozenset(o for o in v.overrides if o.split("=", 1)[0].startswith(TARGET_AND_DATA))

    return len({target_and_data(v) for v in variants}) == 1


@dataclass
class Job:
    variant: Variant
    reuse: Path | None
    out: Path
    log: Path
    slot: str | None = None
    proc: subprocess.Popen | None = None
    rc: int | None = None
    note: str = ""
    started: float = 0.0
    seconds: float = 0.0
    argv: list[str] = field(default_factory=list)


def pipeline_argv(recipe: str, job: Job) -> list[str]:
    argv = [sys.executable, "-m", "trainer.quality.pipeline", "--recipe", recipe, "--out", str(job.out)]
    if job.reuse is not None:
        argv += ["--reuse", str(job.reuse)]
    for item in job.variant.overrides:
        argv += ["--set", item]
    return argv


def regenerate_recorded(run_dir: Path) -> bool:
    try:
        return "regenerate" in json.loads((run_dir / "stages.json").read_text())
    except (OSError, ValueError):
        return False


def summarize(job: Job) -> dict:
    """One row of the comparison: the variant's quality.json figures, or why there are none."""
    row = {"variant": job.variant.name, "overrides": list(job.variant.overrides), "slot": job.slot,
           "reused_from": str(job.reuse) if job.reuse else None, "rc": job.rc, "seconds": round(job.seconds, 1)}
    try:
        q = json.loads((job.out / "quality.json").read_text())
    except (OSError, ValueError):
        return {**row, "status": job.note or "failed", "log": str(job.log)}
    also = q.get("also") or {}
    drafter = q.get("drafter") or {}
    return {**row, "status": "ok" if job.rc == 0 else job.note or "failed",
            "drafter": drafter.get("kind"), "optim": drafter.get("optim"), "tau": q.get("tau"),
            "replayed_tau": q.get("replayed_tau"), "simulated_tau": q.get("simulated_tau"),
            "speedup": q.get("speedup"),
            "identical": q.get("identical"), "also_tau": also.get("tau"), "also_speedup": also.get("speedup"),
            "also_identical": also.get("identical"), "drafter_steps": drafter.get("steps"),
            "drafter_acc": drafter.get("acc"), "total_s": (q.get("timings_s") or {}).get("total")}


def table(rows: list[dict]) -> str:
    cols = ("variant", "status", "drafter", "optim", "tau", "replayed_tau", "simulated_tau", "speedup", "identical",
            "also_tau", "also_speedup", "drafter_steps", "total_s")
    cells = [[str(r.get(c, "") if r.get(c) is not None else "-") for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def start(job: Job, recipe: str, slot: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           "CUDA_VISIBLE_DEVICES": "" if slot == "cpu" else slot}
    job.slot, job.argv, job.started = slot, pipeline_argv(recipe, job), time.monotonic()
    print(f"start {job.variant.name} on {'cpu' if slot == 'cpu' else 'GPU ' + slot}: {shlex.join(job.argv[1:])}",
          flush=True)
    with job.log.open("w") as log:
        # Same process group as the sweep: `dflash-ops stop` (a kill of the launched job's group) reaches the
        # pipelines too.
        job.proc = subprocess.Popen(job.argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def stop(jobs: list[Job], grace_s: float = 10.0) -> None:
    """Terminate the pipelines this sweep started and still runs (and only those), then kill what outlives grace_s."""
    alive = [job.proc for job in jobs if job.proc is not None and job.proc.poll() is None]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in alive:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def check_variants(recipe: str, variants: list[Variant], slots: list[str] = ()) -> None:
    """Every variant's overrides applied to the recipe before anything starts: a typo, or a GPU recipe given CPU
    slots, is one line now, not a failed run later."""
    from trainer.quality.config import check_drafter_fits_target, load_recipe
    from trainer.quality.pipeline import check_device_fits

    names = [v.name for v in variants]
    if not variants or len(set(names)) != len(names):
        raise ConfigError("give at least one --variant, each with its own name")
    load_recipe(recipe)
    for v in variants:
        try:
            q = load_recipe(recipe, list(v.overrides))
            check_drafter_fits_target(q)
            if "cpu" in slots:
                check_device_fits(q, recipe, "cpu")
        except ConfigError as exc:
            raise ConfigError(f"--variant {v.name}: {exc}", hint=exc.hint) from None


def run_sweep(recipe: str, out: Path, variants: list[Variant], slots: list[str], independent: bool = False,
              poll_s: float = 1.0) -> list[dict]:
    check_variants(recipe, variants, slots)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not empty; nothing was changed there")
    shared = not independent and len(variants) > 1 and shares_target(variants)
    if not independent and len(variants) > 1 and not shared:
        print("note: the variants build their targets or data differently (corpus/target/pretrain/regen): every "
              "variant runs whole", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    base = out / variants[0].name
    jobs = [Job(v, base if shared and i else None, out / v.name, out / f"{v.name}.log") for i, v in enumerate(variants)]
    waiting, running, free = list(jobs), [], list(slots)
    previous = signal.signal(signal.SIGTERM, _interrupted)  # a SIGTERM to the sweep alone still stops its pipelines
    try:
        while waiting or running:
            for job in list(running):
                if job.proc.poll() is not None:
                    job.rc, job.seconds = job.proc.returncode, time.monotonic() - job.started
                    print(f"done {job.variant.name}: rc {job.rc} after {job.seconds:.0f} s", flush=True)
                    running.remove(job)
                    free.append(job.slot)
            base_job = jobs[0]
            for job in list(waiting):
                if job.reuse is not None and not regenerate_recorded(job.reuse):
                    if base_job.rc is not None:  # the first variant ended without a target and data to share
                        job.note = f"not run: {variants[0].name} ended before its regenerate stage"
                        waiting.remove(job)
                    continue
                if not free:
                    break
                waiting.remove(job)
                start(job, recipe, free.pop(0))
                running.append(job)
            if waiting or running:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        stop(running)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    rows = [summarize(job) for job in jobs]
    result = {"recipe": recipe, "shared_target": shared, "slots": slots, "variants": rows}
    (out / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows), flush=True)
    print(SWEEP_PREFIX + json.dumps(result), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.quality.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True, help="quality_gpu, quality_cpu, or a PATH.yaml")
    p.add_argument("--out", required=True, help="output directory (must be new or empty)")
    p.add_argument("--variant", action="append", default=[], metavar='"NAME KEY=VALUE ..."',
                   help="a variant: a name, then --set overrides; repeat for each (the first shares its target)")
    p.add_argument("--slots", default=None,
                   help="GPUs as CUDA_VISIBLE_DEVICES names them (0,1), cpu, or cpu:N (default: every visible GPU)")
    p.add_argument("--independent", action="store_true", help="every variant pretrains its own target")
    args = p.parse_args(argv)

    def command() -> int:
        variants = [parse_variant(v) for v in args.variant]
        slots = parse_slots(args.slots, _visible_gpus() if args.slots is None else [])
        rows = run_sweep(args.recipe, Path(args.out), variants, slots, args.independent)
        return 0 if all(r["status"] == "ok" for r in rows) else 1

    return run_cli(command)


def _visible_gpus() -> list[str]:
    """The GPUs this process may use, named as CUDA_VISIBLE_DEVICES names them (so that a sweep started with
    CUDA_VISIBLE_DEVICES=2,3 runs its pipelines on 2 and 3, not on 0 and 1)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g.strip() for g in given.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


if __name__ == "__main__":
    sys.exit(main())
