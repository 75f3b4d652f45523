"""`python -m trainer` / `dflash-train`: train, eval, export, regenerate, make-tiny-target.

  python -m trainer train --recipe NAME|PATH.yaml [--run-dir D] [--set a.b=v]...
  python -m trainer train --run-dir D --resume [--set a.b=v]...
  python -m trainer eval run --run-dir D
  python -m trainer eval export --drafter EXPORT_DIR --target T --data F [--max-bad-fraction F]
  python -m trainer eval prompts --drafter EXPORT_DIR --target T --prompts FILE... [--limit N] [--max-new N] ...
  python -m trainer export --run-dir D [--target T]
  python -m trainer regenerate --target DIR --prompts FILE... --out FILE.jsonl [options] (trainer/regen/run.py)
  python -m trainer make-tiny-target OUT_DIR [--family qwen3|llama] [--hidden H] [--layers L] [--train-steps N]

Data parallel: `python -m torch.distributed.run --standalone --nproc-per-node N -m trainer train ...` (one drafter
replica per rank; see trainer/train.py).

This module parses (trainer/cli/parser.py), dispatches, and holds the one error boundary (errors.run_cli); each
command checks its input before torch (trainer/cli/checks.py), then loads torch and runs.
"""
from __future__ import annotations

import time

_T0 = time.perf_counter()  # the console's clock starts with the program

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from trainer.errors import ConfigError, DataError, TrainerError, run_cli  # noqa: E402


def _quiet_libraries() -> None:
    """Progress bars from transformers would interleave with our log lines."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def cmd_train(args) -> int:
    from trainer import rundir
    from trainer.cli.checks import check_train
    from trainer.config import load_config, load_resumed_config
    from trainer.errors import secondary_rank
    from trainer.metrics import Console

    console = Console(quiet=secondary_rank(), t0=_T0)
    if args.resume and args.run_dir is None:
        raise ConfigError("--resume needs --run-dir D: the run directory to continue")
    if args.recipe is None and not args.resume:
        raise ConfigError("train needs --recipe NAME|PATH.yaml (or --run-dir D --resume to continue a run)")
    name = Path(args.recipe or "run").stem
    run_dir = Path(args.run_dir or f"runs/{name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}")
    resumed = rundir.run_config_file(run_dir) if args.resume else None
    if args.resume and resumed is None and args.recipe is None:
        raise ConfigError(f"--resume: {run_dir} holds no config.json (nor a checkpoint's copy of it)",
                          hint="point --run-dir at the run to continue, or pass the --recipe it started with")
    source = f"{resumed}, as the run started" if resumed else f"recipe {args.recipe}"
    if resumed and args.recipe:
        # The run's config.json is the config; a runbook's command names its recipe all the same (and a rank whose
        # run directory has no config.json reads it), so it is not refused, but it must be one, and is said unused.
        source += f"; --recipe {args.recipe} not used"
    with console.phase(f"checking the config ({source}) and the data") as notes:
        if resumed and args.recipe:
            load_config(args.recipe)
        cfg = load_resumed_config(resumed, args.overrides) if resumed else load_config(args.recipe, args.overrides)
        notes.append(check_train(cfg, run_dir, args.resume))
    with console.phase("loading torch and transformers"):
        _quiet_libraries()
        from trainer.train import train
    result = train(cfg, run_dir, resume=args.resume, console=console)
    if result.world > 1:
        _exit_rank_now(result.exit_code)
    return result.exit_code


def _exit_rank_now(code: int) -> None:
    """A finished torchrun rank (process group already destroyed, files written and flushed) leaves with os._exit.

    Under load, gloo's teardown at interpreter exit sometimes destroys a still-joinable C++ thread: "terminate called
    without an active exception", SIGABRT, and torchrun reports the successful job as failed (seen 1 run in 5 on a
    busy 2-core host). Skipping the interpreter's teardown avoids that; there is nothing left to clean up.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_eval(args) -> int:
    from trainer.cli import checks
    from trainer.cli.evalform import eval_request
    from trainer.metrics import Console

    req = eval_request(args)
    console = Console(t0=_T0)
    if req.form == "prompts":
        with console.phase(f"reading {len(req.prompts)} prompt file(s)") as notes:
            sets = checks.check_eval_prompts(req)
            notes.append(", ".join(f"{ps.name}: {len(ps.prompts)}" for ps in sets))
        from trainer.cli.evalprompts import decode_sets, warn_unreadable

        warn_unreadable(sets)
    else:
        with console.phase(f"checking {req.run_dir if req.form == 'run' else req.data}") as notes:
            if req.form == "run":
                notes.append(checks.check_eval_run(req.run_dir))
            else:
                req, summary = checks.check_eval_export(req)
                notes.append(summary)
    with console.phase("loading torch and transformers"):
        _quiet_libraries()
        from trainer.eval import evaluate_export, evaluate_run

    if req.form == "prompts":
        return decode_sets(req, sets, console)
    if req.form == "run":
        with console.phase(f"evaluating the simulated tau of {req.run_dir} on its held-out rows"):
            result = evaluate_run(req.run_dir)
    else:
        with console.phase(f"evaluating the simulated tau of {req.drafter} on {req.data}"):
            result = evaluate_export(req.drafter, req.target, req.data, max_bad_fraction=req.max_bad_fraction)
    if not result["blocks"]:  # a tau of nothing is no measurement: not a success a script could take for one
        raise DataError("no block to evaluate: the rows hold no two consecutive supervised tokens (tau undefined)",
                        hint="check data.eval_paths / data.eval_fraction" if req.form == "run" else
                        "check --data: answers of two tokens or more")
    return 0


def cmd_regenerate(args) -> int:
    from trainer.metrics import Console
    from trainer.regen.run import check_before_torch

    console = Console(t0=_T0)
    with console.phase("checking the target, --out and the prompt files") as notes:
        job = check_before_torch(args)
        notes.append(job.summary())
    with console.phase("loading torch and transformers"):
        _quiet_libraries()
        from trainer.regen.run import run
    run(job, console)
    return 0


def cmd_export(args) -> int:
    from trainer.metrics import Console, serving_lines
    from trainer.rundir import export_source

    console = Console(t0=_T0)
    with console.phase(f"checking {args.run_dir}") as notes:  # before torch: its config, target and checkpoint
        cfg, newest = export_source(Path(args.run_dir), args.target)
        notes.append(f"newest checkpoint {newest.name}")
    with console.phase("loading torch and transformers"):
        _quiet_libraries()
        from trainer.train import export_run
    export = export_run(Path(args.run_dir), args.target)
    print(f"exported {export}", flush=True)
    target = args.target or cfg.model.target
    if target:  # an empty target (a run that never resolved one) has no command
        print(serving_lines(export, target, cfg.model.block_size), flush=True)
    return 0


def cmd_tiny(args) -> int:
    from trainer.tiny import check_out_dir

    if args.hidden < 16 or args.hidden % 16 or args.layers < 4:
        raise TrainerError("--hidden must be a multiple of 16 and --layers >= 4")
    if args.train_steps < 0:
        raise TrainerError(f"--train-steps must be >= 0 (0 keeps the random weights), got {args.train_steps}")
    check_out_dir(args.out_dir)
    _quiet_libraries()
    from trainer.tiny import build_tiny_target

    path = build_tiny_target(args.out_dir, family=args.family, hidden=args.hidden, num_layers=args.layers,
                             train_steps=args.train_steps)
    print(f"tiny target written to {path}", flush=True)
    return 0


# Every command refuses bad input before torch is imported, then quiets the libraries as it loads them.
COMMANDS = {"train": cmd_train, "eval": cmd_eval, "regenerate": cmd_regenerate, "export": cmd_export,
            "make-tiny-target": cmd_tiny}


def main(argv: list[str] | None = None) -> int:
    from trainer.cli.parser import build_parser

    args = build_parser().parse_args(argv)
    return run_cli(lambda: _command(args))


def _command(args) -> int:
    """The command, after the environment's settings that every command reads are checked (before anything
    heavy starts)."""
    from trainer.decode import switches

    try:
        switches.check_environment()
    except ValueError as e:
        raise TrainerError(str(e)) from None
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
