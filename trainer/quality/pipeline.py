"""One command, end to end: pretrain a target -> regenerate answers -> train a drafter -> evaluate it.

  python -m trainer.quality.pipeline --recipe quality_gpu|quality_cpu|PATH.yaml --out DIR [--set a.b=v]...
                                     [--reuse EARLIER_DIR]

Writes into DIR: target/ (HF model + tokenizer + corpus.json), data/{train,eval}.jsonl, drafter/ (a trainer run
directory: config.json, metrics.jsonl, ckpt/, export/), stages.json (each finished stage's record, written as it
finishes), quality.json; prints per-stage timings, the trainer's DFLASH_METRICS / DFLASH_EVAL lines, and finally one
line `DFLASH_QUALITY {json}`.

--reuse EARLIER_DIR trains and evaluates a new drafter on an earlier run's target and data (its target/, data/ and
stages.json are read, never written): the pretrain and regenerate stages are skipped and the recipe's corpus /
target / pretrain / regen sections are ignored (quality.json records `reused_from`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

from dflash_ops.wire import QUALITY_PREFIX
from trainer.errors import ConfigError, run_cli
from trainer.quality.result import DrafterResult, EvalResult, QualityResult, stage_record


def log(message: str) -> None:
    print(message, flush=True)


def drafter_train_cfg(q, target_dir: Path, regen, device):
    """The recipe's drafter config + this pipeline's target and data -> TrainCfg. Compiled and captured modes
    fall back to eager off CUDA, with a printed note."""
    d = q.drafter
    step = d.step
    if not step.eager and device.type != "cuda":
        log(f"drafter: step.mode={step.mode} is not available here ({device}); training eagerly")
        step = dataclasses.replace(step, mode="eager")
    return dataclasses.replace(
        d, model=dataclasses.replace(d.model, target=str(target_dir)), step=step, eval_at_end=False,
        device=str(device), data=dataclasses.replace(d.data, paths=(regen.train_path,), eval_paths=(regen.eval_path,)))


def check_device_fits(q, recipe: str, device_type: str) -> None:
    """Before any stage: refuse a recipe whose drafter has no way to train on this device (quality_gpu on a machine
    without a GPU), in one line, instead of pretraining and regenerating on the CPU first. The graph step modes fall
    back to eager (drafter_train_cfg), so only the settings without a fallback count. Pure."""
    from trainer.config import cuda_only

    if device_type == "cuda":
        return
    d = q.drafter
    found = cuda_only(dataclasses.replace(d, step=dataclasses.replace(d.step, mode="eager")))
    if found:
        raise ConfigError(f"recipe {recipe} needs a CUDA GPU: drafter.{found[0][0]} has no CPU path, and this run is "
                          f"on the {device_type}",
                          hint="run it on a GPU machine; on a CPU the tiny variant is --recipe quality_cpu")


def drafter_budget(q, elapsed_s: float) -> float:
    """The drafter's wall-clock budget: `drafter_budget_s`, or less when `total_budget_s` is set and the stages so
    far leave less (never below 0: a drafter with no time trains no step and says so). Pure."""
    if not q.total_budget_s:
        return q.drafter_budget_s
    return max(0.0, min(q.drafter_budget_s, q.total_budget_s - elapsed_s - q.eval_reserve_s))


def train_drafter(cfg, run_dir: Path, budget_s: float) -> DrafterResult:
    """The real trainer (build -> loop -> finish/export) inside budget_s, reading the data, compilation and capture
    included: the loop's stop rule sets the LR schedule's length to the steps that fit, at every log interval once
    the step time is known, so a cut run still anneals. A graph mode that the trainer refuses with a ConfigError (not
    a crash) falls back to eager, with a note."""
    from trainer.build import build
    from trainer.loop import StopRule, TrainLoop
    from trainer.train import finish

    t0 = time.perf_counter()
    random.seed(cfg.seed)
    try:
        session = build(cfg, run_dir)
    except ConfigError as e:
        if cfg.step.eager:
            raise
        log(f"drafter: step.mode={cfg.step.mode} refused ({e}); training eagerly")
        cfg = dataclasses.replace(cfg, step=dataclasses.replace(cfg.step, mode="eager"))
        session = build(cfg, run_dir)
    loop = TrainLoop(session)
    # The budget is the stage's: what compiling and capturing took in build() is not left to the loop.
    result = finish(session, loop, loop.run(StopRule(budget_s=max(0.0, budget_s - (time.perf_counter() - t0)))))
    last = result.last
    return DrafterResult(steps=result.step, total_steps=result.horizon, mode=cfg.step.mode, loss=last.get("loss"),
                         acc=last.get("acc"), tokens_per_s=last.get("tokens_per_s"),
                         seconds=round(time.perf_counter() - t0, 1), planned_steps=result.planned_steps,
                         stopped_by=result.stopped_by, kind=cfg.model.drafter, optim=cfg.optim.name)


def heldout_rows(cfg, target_dir: Path):
    """The held-out answers packed like the trainer packs them (without re-reading the training set)."""
    from transformers import AutoTokenizer

    from trainer.data.dataset import build_datasets

    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    data = dataclasses.replace(cfg.data, paths=cfg.data.eval_paths)
    return build_datasets(data, tokenizer, len(tokenizer), cfg.seed).eval


def check_out_dir(out: Path) -> None:
    """Never overwrite a previous pipeline's results."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"output directory {out} is not empty", hint="pass a new --out directory")


def record_stage(out: Path, name: str, result: dict) -> None:
    """Add one finished stage's record to out/stages.json (atomic replace): a later crash keeps what was done, and
    `--reuse` reads it."""
    path = out / "stages.json"
    stages = json.loads(path.read_text()) if path.is_file() else {}
    stages[name] = result
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(stages, indent=1) + "\n")
    tmp.replace(path)


def _from_record(cls, record: dict):
    """A stage record -> its result dataclass (extra keys such as `reused_from` are not fields: dropped)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in record.items() if k in names})


def reused_stages(earlier: Path, out: Path):
    """An earlier run's finished pretrain + regenerate stages -> (PretrainResult, RegenResult). Refuses (one line)
    a directory without them, and an --out inside it."""
    from trainer.quality.pretrain import PretrainResult
    from trainer.quality.regenerate import RegenResult

    earlier = earlier.resolve()
    if earlier == out.resolve() or earlier in out.resolve().parents:
        raise ConfigError(f"--out {out} lies inside --reuse {earlier}", hint="pass an --out outside the reused run")
    try:
        stages = json.loads((earlier / "stages.json").read_text())
        pre, regen = (_from_record(PretrainResult, stages["pretrain"]),
                      _from_record(RegenResult, stages["regenerate"]))
        # The recorded paths may be relative to another working directory: the layout under `earlier` is fixed.
        pre = dataclasses.replace(pre, path=str(earlier / "target"))
        regen = dataclasses.replace(regen, train_path=str(earlier / "data" / "train.jsonl"),
                                    eval_path=str(earlier / "data" / "eval.jsonl"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--reuse {earlier}: no finished pretrain and regenerate stages there ({e})",
                          hint="reuse the --out of a pipeline run that got past its regenerate stage") from None
    for path in (Path(pre.path) / "config.json", Path(regen.train_path), Path(regen.eval_path)):
        if not path.is_file():
            raise ConfigError(f"--reuse {earlier}: {path} is missing")
    return pre, regen


def run_pipeline(recipe_name: str, out: Path, overrides: list[str], reuse: Path | None = None) -> QualityResult:
    """Every stage into `out` (stages.json as each finishes, then quality.json and the DFLASH_QUALITY line) -> the
    run's result. What can refuse comes before torch, and the device check before anything is written."""
    from trainer.quality.config import check_drafter_fits_target, load_recipe

    q = load_recipe(recipe_name, overrides)
    check_out_dir(out)
    reused = reused_stages(reuse, out) if reuse is not None else None
    check_drafter_fits_target(q, reused[0].path if reused else None)
    import torch
    from transformers.utils import logging as hf_logging

    from trainer.config import to_dict
    from trainer.placement import cpu_threads, free_cores, local_device
    from trainer.quality.pretrain import make_target
    from trainer.quality.regenerate import regenerate

    hf_logging.disable_progress_bar()
    device = local_device(q.device, cpu_hint="use --set device=cpu (or auto)")
    check_device_fits(q, recipe_name, device.type)
    out.mkdir(parents=True, exist_ok=True)
    threads = cpu_threads(q.threads, os.environ, free_cores())
    if threads:
        torch.set_num_threads(threads)
    reused_from = str(reuse.resolve()) if reuse else None
    (out / "recipe.json").write_text(json.dumps({"recipe": recipe_name, "overrides": overrides,
                                                "reused_from": reused_from, "quality": to_dict(q)}, indent=1) + "\n")
    timings: dict[str, float] = {}
    t_all = time.perf_counter()

    def stage(name: str, fn):
        t0 = time.perf_counter()
        log(f"== stage {name}")
        result = fn()
        timings[name] = round(time.perf_counter() - t0, 1)
        log(f"== stage {name}: {timings[name]}s")
        record_stage(out, name, stage_record(result))
        return result

    if reused is None:
        pre = stage("pretrain", lambda: make_target(out / "target", q, device, log))
        regen = stage("regenerate", lambda: regenerate(out / "target", out / "data", q, device, log))
    else:
        pre, regen = reused
        log(f"== reusing the target and data of {reuse} (pretrain and regenerate skipped; the recipe's corpus, "
            f"target, pretrain and regen sections do not apply)")
        for name, result in (("pretrain", pre), ("regenerate", regen)):
            record_stage(out, name, {**dataclasses.asdict(result), "reused_from": reused_from})
    target_dir = Path(pre.path)
    cfg = drafter_train_cfg(q, target_dir, regen, device)
    # Time spent before the drafter: this run's, or under --reuse the reused stages' own (so that a reusing run
    # gives its drafter the budget the original run's drafter had).
    used = time.perf_counter() - t_all if reused is None else pre.seconds + regen.seconds
    budget = drafter_budget(q, used)
    if q.total_budget_s:
        log(f"drafter budget: {budget:.0f}s = min(drafter_budget_s {q.drafter_budget_s:.0f}, total_budget_s "
            f"{q.total_budget_s:.0f} - {used:.0f}s used{' by the reused stages' if reused else ''} - eval_reserve_s "
            f"{q.eval_reserve_s:.0f})")
    drafted = stage("drafter", lambda: train_drafter(cfg, out / "drafter", budget))
    ev = stage("eval", lambda: evaluate_drafter(q, cfg, out / "drafter", target_dir, regen.eval_path, device))
    timings["total"] = round(time.perf_counter() - t_all, 1)
    result = QualityResult(recipe=recipe_name, reused_from=reused_from, device=str(device), torch=torch.__version__,
                           gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None, target=pre,
                           regen=regen, drafter=drafted, eval=ev, timings_s=timings)
    record = result.to_dict()
    (out / "quality.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"stage timings (s): {json.dumps(timings)}")
    log(QUALITY_PREFIX + json.dumps(record))
    return result


def evaluate_drafter(q, cfg, run_dir: Path, target_dir: Path, eval_path: str, device) -> EvalResult:
    """The eval stage: the simulated tau on the held-out rows, then real decoding of the held-out prompts at
    eval.target_dtype (and eval.also_dtype where set)."""
    from trainer.eval import evaluate_run
    from trainer.export import load_pair
    from trainer.quality.evaluate import decode_benchmark, heldout_prompts

    t0 = time.perf_counter()
    simulated = evaluate_run(run_dir, rows=heldout_rows(cfg, target_dir))
    log(f"simulated eval: {time.perf_counter() - t0:.1f}s")
    prompts = heldout_prompts(eval_path)
    decoded = {}
    for key, dtype in (("decode", q.eval.target_dtype), ("decode_also", q.eval.also_dtype)):
        if dtype:
            target, drafter, ecfg = load_pair(run_dir / "export", target_dir, device, dtype)
            decoded[key] = {"target_dtype": dtype,
                            **decode_benchmark(target, drafter, ecfg.block_size, prompts, q.eval, log)}
    return EvalResult(simulated=simulated, **decoded)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.quality.pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True, help="quality_gpu, quality_cpu, or a PATH.yaml")
    p.add_argument("--out", required=True, help="output directory (must be new or empty)")
    p.add_argument("--reuse", type=Path, default=None, metavar="EARLIER_DIR",
                   help="train and evaluate a new drafter on an earlier run's target and data (skips pretrain and "
                        "regenerate)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe leaf, e.g. --set pretrain.steps=500 or --set drafter.optim.lr=1e-3")
    args = p.parse_args(argv)
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    def command() -> int:
        run_pipeline(args.recipe, Path(args.out), args.overrides, args.reuse)
        return 0

    return run_cli(command)


if __name__ == "__main__":
    sys.exit(main())
