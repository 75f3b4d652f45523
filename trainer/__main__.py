"""`python -m trainer` / `dflash-train`: train, eval, export, make-tiny-target. The one error boundary.

  python -m trainer train --recipe NAME|PATH.yaml [--run-dir D] [--set a.b=v]...
  python -m trainer train --run-dir D --resume [--set a.b=v]...
  python -m trainer eval --run-dir D | --drafter EXPORT_DIR --target T --data F [--max-bad-fraction F]
  python -m trainer export --run-dir D [--target T]
  python -m trainer regenerate --target DIR --prompts FILE... --out FILE.jsonl [options] (trainer/regen/run.py)
  python -m trainer make-tiny-target OUT_DIR [--family qwen3|llama] [--hidden H] [--layers L] [--train-steps N]

Data parallel: `python -m torch.distributed.run --standalone --nproc-per-node N -m trainer train ...` (one drafter
replica per rank; see trainer/train.py).
"""
from __future__ import annotations

import time

_T0 = time.perf_counter()  # the console's clock starts with the program

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from dflash_ops import wire  # noqa: E402
from trainer.errors import ConfigError, TrainerError, run_cli  # noqa: E402


def _recipe_help() -> str:
    from trainer.config import PIPELINE_COMMAND, bundled_recipes

    kinds = bundled_recipes()
    train = ", ".join(n for n, k in kinds.items() if k == "train")
    pipeline = ", ".join(n for n, k in kinds.items() if k == "pipeline")
    text = f"a bundled trainer recipe ({train}) or a PATH.yaml"
    if pipeline:
        text += f"; {pipeline}: quality-pipeline recipes, for {PIPELINE_COMMAND}"
    return text


PROMPT_DEFAULTS = {"limit": 64, "max_new": 256, "engine": "static", "target_dtype": "auto"}
PROMPT_OPTIONS = ("--limit", "--max-new", "--engine", "--target-dtype")  # eval --prompts only
EVAL_USAGE = "eval needs --run-dir D, or --drafter EXPORT_DIR --target T with --data F or --prompts FILE..."


def _parser() -> argparse.ArgumentParser:
    from trainer.config import DTYPES, DataCfg, user_path
    from trainer.rundir import RESUME_MAY_CHANGE, RESUME_MAY_MOVE

    p = argparse.ArgumentParser(prog="python -m trainer", description="DFlash drafter trainer")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a drafter")
    t.add_argument("--recipe", default=None,
                   help="required unless --resume (which reads the run's config.json, and the recipe only where the "
                        "run directory holds none): " + _recipe_help())
    t.add_argument("--run-dir", type=user_path, default=None,
                   help="run directory (default: runs/<recipe>-<utc time>)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config leaf, e.g. --set optim.lr=3e-4 (repeatable)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --run-dir, with the config.json it started with "
                        f"(--set may change only {', '.join(RESUME_MAY_CHANGE)}; and {', '.join(RESUME_MAY_MOVE)} "
                        "where the target or the data moved: the same weights and file sizes are checked, and "
                        "config.json then names the new places)")
    t.epilog = (f"SIGTERM or Ctrl-C stops a run at its next log step with a checkpoint, prints "
                f"{wire.STOPPED_PREFIX.strip()} and the resume command, and exits {wire.EXIT_TERMINATED} / "
                f"{wire.EXIT_INTERRUPTED}; a second Ctrl-C ends it at once (a second SIGTERM is ignored).")
    e = sub.add_parser("eval", help="simulated tau on held-out data, or real decoding on prompt files",
                       description="--run-dir D: simulated tau on the run's held-out split. --drafter EXPORT --target "
                                   "T --data F: simulated tau on a training-format JSONL. --drafter EXPORT --target "
                                   "T --prompts FILE...: real batch-1 speculative decoding of each prompt file "
                                   "(GSM8K, MATH-500, HumanEval, MBPP, MT-Bench, chat, ShareGPT or plain lines): "
                                   "tau, acceptance per position, speedup over the target alone, per file.")
    e.add_argument("--run-dir", type=user_path, default=None)
    e.add_argument("--drafter", type=user_path, default=None,
                   help="export dir (with --target and --data, or --prompts)")
    e.add_argument("--target", type=user_path, default=None, help="the target's HF directory")
    e.add_argument("--data", type=user_path, default=None, help="a training-format JSONL (simulated tau)")
    e.add_argument("--max-bad-fraction", type=float, default=None,
                   help=f"with --data: malformed lines tolerated (default: the training data's, "
                        f"{DataCfg().max_bad_fraction})")
    e.add_argument("--prompts", type=user_path, nargs="+", default=None, metavar="FILE",
                   help="prompt files (real decoding)")
    # Defaults of the --prompts options are applied in eval_prompts (PROMPT_DEFAULTS): None here tells a flag the user
    # gave, which the other forms refuse, from one they did not.
    e.add_argument("--limit", type=int, default=None,
                   help=f"with --prompts: prompts per file (default: {PROMPT_DEFAULTS['limit']})")
    e.add_argument("--max-new", type=int, default=None,
                   help=f"with --prompts: new tokens per prompt (default: {PROMPT_DEFAULTS['max_new']})")
    e.add_argument("--engine", default=None, choices=("static", "hf"),
                   help="with --prompts: static: static caches, CUDA-graph replays; hf: the HF-cache reference "
                        "(default: static)")
    e.add_argument("--target-dtype", default=None, choices=DTYPES,
                   help="with --prompts: the target's dtype while decoding (default: bf16 on CUDA, fp32 on CPU)")
    _regenerate_parser(sub)
    x = sub.add_parser("export", help="(re)write <run-dir>/export from the newest checkpoint")
    x.add_argument("--run-dir", type=user_path, required=True)
    x.add_argument("--target", type=user_path, default=None,
                   help="the run's target where it is now, if it moved since the run (default: the run's model.target)")
    m = sub.add_parser("make-tiny-target", help="build and save a tiny Qwen3 or Llama 3 target + tokenizer",
                       description="A target + tokenizer (with a chat template) built offline: by default the tiny "
                                   "Qwen3 the tests use, briefly trained on the bundled chat data; --family llama: "
                                   "a Llama 3 of the same size (or of --hidden / --layers).")
    m.add_argument("out_dir", help="a new or empty directory (one holding anything is refused)")
    m.add_argument("--family", default="qwen3", choices=("qwen3", "llama"), help="(default: %(default)s)")
    m.add_argument("--hidden", type=int, default=64, help="hidden size (default: %(default)s)")
    m.add_argument("--layers", type=int, default=6, help="decoder layers (default: %(default)s)")
    m.add_argument("--train-steps", type=int, default=100,
                   help="steps on the bundled chat data; 0 keeps the random weights (default: %(default)s)")
    return p


def _regenerate_parser(sub) -> None:
    from trainer.config import DTYPES, user_path
    from trainer.regen.plan import ENGINES

    r = sub.add_parser("regenerate", help="answer prompt files with the target: the drafter's training data",
                       description="Answer every prompt of the prompt files with the target itself, into a training "
                                   "JSONL of token lines (the target's exact tokens, loss on the answer) and a "
                                   "FILE.meta.json of what made them. A restarted job with the same --out continues "
                                   "where it stopped. Formats: chat (conversations / messages), ShareGPT, GSM8K, "
                                   "MATH-500, HumanEval, MBPP, MT-Bench, Alpaca, {\"prompt\": ...}, plain text lines; a "
                                   "conversation is answered after its last user turn.")
    r.add_argument("--target", type=user_path, required=True, help="the target's local Hugging Face directory")
    r.add_argument("--prompts", type=user_path, required=True, nargs="+", metavar="FILE", help="prompt files")
    r.add_argument("--out", type=user_path, required=True,
                   help="the training JSONL to write (appended to when it is resumed)")
    r.add_argument("--max-new", type=int, default=512, help="new tokens per answer at most (default: %(default)s)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    r.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: %(default)s)")
    r.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    r.add_argument("--continuations", type=int, default=1, metavar="N",
                   help="answers per prompt; N > 1 needs --temperature > 0 (default: %(default)s)")
    r.add_argument("--batch", type=int, default=64, help="prompts generated together (default: %(default)s)")
    r.add_argument("--limit", type=int, default=0, help="the first N distinct prompts only (default: all)")
    r.add_argument("--enable-thinking", choices=("on", "off"), default=None,
                   help="the chat template's enable_thinking (serve the drafter the same way)")
    r.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="""keyword arguments for the chat template, e.g. '{"enable_thinking": false}'""")
    r.add_argument("--system", default=None, help="a system turn for the prompts that have none")
    r.add_argument("--engine", default="static", choices=ENGINES,
                   help="static: static cache, one CUDA graph replay per token (falls back to hf, with a note, "
                        "where it cannot serve the target); hf: HF generate (default: %(default)s)")
    r.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the target's dtype (default: bf16 on CUDA, fp32 on CPU)")
    r.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    r.add_argument("--max-bad-fraction", type=float, default=0.01,
                   help="malformed prompt lines tolerated, as for training data (default: %(default)s)")


def _quiet_libraries() -> None:
    """Progress bars from transformers would interleave with our log lines."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def check_before_torch(cfg, run_dir: Path, resume: bool) -> str:
    """Everything about a start that needs neither torch nor a tokenizer: the empty-target and empty-data rules, the
    target directory (its family, weights and tokenizer files; the taps and the mask id fit its config.json; a
    resumed run's where it moved), the tracking backends' packages, the run directory and the tracking directory (not
    a file, checkpoints, a resumed config and its target and data, another run's tracking), every data file
    (exists, readable, each line UTF-8 JSON in one of the formats, the malformed-line limit). Raises ConfigError /
    DataError -> a summary."""
    from trainer import rundir
    from trainer.targetdir import check_target_dir
    from trainer.data.source import BadLineFile, scan
    from trainer.placement import dist_env
    from trainer.tracking import check_installed

    if resume:  # before the generic check: a resumed run's target may have moved, and may be named anew
        rundir.check_target_there(cfg, run_dir)
    check_target_dir(cfg)
    check_installed(cfg.track)
    env = dist_env(os.environ)
    if env.is_main:
        rundir.check_start(rundir.with_target(cfg, run_dir), run_dir, resume, env.world)
    bad_file = BadLineFile(rundir.bad_lines_path(run_dir)) if env.is_main else None
    counts = [scan(paths, cfg.data.max_bad_fraction, bad_file).lines
              for paths in (cfg.data.paths, cfg.data.eval_paths) if paths]
    files = len(cfg.data.paths) + len(cfg.data.eval_paths)
    return f"{sum(counts)} data lines in {files} file(s)"


def cmd_train(args) -> int:
    from trainer import rundir
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
        notes.append(check_before_torch(cfg, run_dir, args.resume))
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


def eval_form(args) -> str:
    """Which eval the flags ask for (--run-dir, --data or --prompts), or one ConfigError naming the flags that do
    not fit it: a flag that is dropped silently would run an eval the user did not ask for. Pure, before torch."""
    given = {flag for flag, value in (("--run-dir", args.run_dir), ("--drafter", args.drafter),
                                      ("--target", args.target), ("--data", args.data), ("--prompts", args.prompts),
                                      ("--limit", args.limit), ("--max-new", args.max_new),
                                      ("--engine", args.engine), ("--target-dtype", args.target_dtype),
                                      ("--max-bad-fraction", args.max_bad_fraction))
             if value is not None}
    forms = [f for f in ("--run-dir", "--data", "--prompts") if f in given]
    if not forms:
        raise ConfigError(EVAL_USAGE)
    if len(forms) > 1:
        raise ConfigError(f"eval takes one of --run-dir, --data and --prompts, not {' and '.join(forms)} together: "
                          f"{EVAL_USAGE}")
    form = forms[0]
    extra = [f for f in PROMPT_OPTIONS if f in given]
    if form != "--prompts" and extra:
        raise ConfigError(f"{', '.join(extra)} {'applies' if len(extra) == 1 else 'apply'} only to eval --prompts, "
                          f"not to eval {form}")
    if form != "--data" and "--max-bad-fraction" in given:
        raise ConfigError(f"--max-bad-fraction applies only to eval --data, not to eval {form}")
    if args.max_bad_fraction is not None and not 0.0 <= args.max_bad_fraction <= 1.0:
        raise ConfigError(f"--max-bad-fraction must be in [0, 1], got {args.max_bad_fraction}")
    pair = [f for f in ("--drafter", "--target") if f in given]
    if form == "--run-dir" and pair:
        raise ConfigError(f"eval --run-dir evaluates the run's own export against the run's own target: drop "
                          f"{' and '.join(pair)}, or evaluate an export with --drafter EXPORT_DIR --target T --data F")
    missing = [f for f in ("--drafter", "--target") if f not in given]
    if form != "--run-dir" and missing:
        raise ConfigError(f"eval {form} needs {' and '.join(missing)}: eval --drafter EXPORT_DIR --target T {form} "
                          f"{'F' if form == '--data' else 'FILE...'}")
    if form == "--prompts":
        for flag, value in (("--limit", args.limit), ("--max-new", args.max_new)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
    return form


def cmd_eval(args) -> int:
    from trainer.metrics import Console

    form = eval_form(args)
    console = Console(t0=_T0)
    if form == "--prompts":
        return eval_prompts(args, console)
    with console.phase(f"checking {args.run_dir if form == '--run-dir' else args.data}") as notes:  # before torch
        notes.append(check_eval_run(args.run_dir) if form == "--run-dir" else check_eval_data(args))
    with console.phase("loading torch and transformers"):
        _quiet_libraries()
        from trainer.eval import evaluate_export, evaluate_run

    if form == "--run-dir":
        with console.phase(f"evaluating the simulated tau of {args.run_dir} on its held-out rows"):
            evaluate_run(args.run_dir)
    else:
        with console.phase(f"evaluating the simulated tau of {args.drafter} on {args.data}"):
            evaluate_export(args.drafter, args.target, args.data, max_bad_fraction=args.max_bad_fraction)
    return 0


def check_eval_pair(drafter, target) -> None:
    """eval's export and target, before torch: the export's files (rundir.read_export_config) and a target
    directory this trainer can load (targetdir.read_target_dir: family, weights, tokenizer), as train checks its."""
    from trainer.rundir import read_export_config
    from trainer.targetdir import read_target_dir

    read_export_config(Path(drafter))
    read_target_dir(target)


def check_eval_data(args) -> str:
    """eval --data before torch: the pair, then every line of the file (its errors name eval's flags)."""
    from trainer.config import DataCfg
    from trainer.data.source import EVAL_HINT, EVAL_KNOB, scan

    check_eval_pair(args.drafter, args.target)
    if args.max_bad_fraction is None:
        args.max_bad_fraction = DataCfg().max_bad_fraction
    return f"{scan([args.data], args.max_bad_fraction, knob=EVAL_KNOB, hint=EVAL_HINT).lines} lines"


def check_eval_run(run_dir) -> str:
    """eval --run-dir before torch: the run's config.json, its export, its held-out data and its target, each refused
    in one line as train refuses them."""
    from trainer import rundir
    from trainer.data.source import scan
    from trainer.targetdir import check_target_loads

    run_dir = Path(run_dir)
    cfg = rundir.load_run_config(run_dir)
    export = rundir.require_export(run_dir)
    if not cfg.data.eval_paths and cfg.data.eval_fraction == 0:
        raise ConfigError("no held-out data: the run has data.eval_fraction 0 and no data.eval_paths",
                          hint=f"evaluate its export on a file: python -m trainer eval --drafter {export} --target "
                               f"{cfg.model.target} --data FILE")
    if not (Path(cfg.model.target) / "config.json").is_file():
        raise ConfigError(f"the run's target {cfg.model.target} is not there (moved or removed since the run)",
                          hint=f"evaluate its export with the target where it is now: python -m trainer eval "
                               f"--drafter {export} --target DIR --data FILE")
    check_target_loads(cfg.model, cfg.model.target)
    lines = sum(scan(paths, cfg.data.max_bad_fraction).lines for paths in (cfg.data.paths, cfg.data.eval_paths)
                if paths)
    return f"{lines} data lines"


def eval_prompts(args, console) -> int:
    """Real decoding of each prompt file: its phases and DFLASH_PROGRESS lines as a job (`eval`, in prompts), one
    DFLASH_EVAL line and its human lines per set, then DFLASH_DONE. The prompt files are read before torch is
    imported. Every answer ends at the stop rule's first stop id (trainer/decode/stops.py, as regenerate's and a
    server's) or at --max-new."""
    import json

    from dflash_ops.wire import EVAL_PREFIX
    from trainer.metrics import JobProgress
    from trainer.prompts import read_prompt_set

    for key, value in PROMPT_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    with console.phase(f"reading {len(args.prompts)} prompt file(s)") as notes:
        sets = [read_prompt_set(p) for p in args.prompts]
        check_eval_pair(args.drafter, args.target)
        notes.append(", ".join(f"{ps.name}: {len(ps.prompts)}" for ps in sets))
    for ps in sets:
        if ps.bad_lines:
            print(f"warning: {ps.name}: {len(ps.bad_lines)} unreadable lines skipped (lines "
                  f"{', '.join(map(str, ps.bad_lines[:10]))}{', ...' if len(ps.bad_lines) > 10 else ''})",
                  file=sys.stderr, flush=True)
    with console.phase("loading torch and transformers"):
        _quiet_libraries()
        from trainer.decode.decoders import engine_for
        from trainer.decode.lossless import describe
        from trainer.export import load_pair
        from trainer.placement import local_device
        from trainer.quality.config import EvalCfg
        from trainer.quality.evaluate import decode_benchmark

    device = local_device("auto")
    with console.phase(f"loading the drafter {args.drafter} and the target {args.target} on {device}"):
        target, drafter, ecfg = load_pair(Path(args.drafter), args.target, device, args.target_dtype)
    # The serving-like configuration the quality recipe measures: the row-invariant attention and norms (lossless by
    # construction where the family allows it; a note and SDPA where not) and the compiled drafter.
    cfg = EvalCfg(prompts=args.limit, max_new_tokens=args.max_new, warmup=1, budget_s=float("inf"),
                  engine=engine_for(args.engine, target, lambda m: print(m, flush=True)), invariant=True,
                  compile="drafter")
    total = sum(min(args.limit, len(ps.prompts)) for ps in sets)
    progress = JobProgress("eval", total, "prompts", console)
    done = tokens = 0
    for ps in sets:
        n = min(args.limit, len(ps.prompts))
        with console.phase(f"decoding {ps.name}: {n} prompts, target alone then speculative ({cfg.engine} engine)"):
            r = decode_benchmark(target, drafter, ecfg.block_size, list(ps.prompts), cfg, log=lambda m: None,
                                 progress=lambda k, t: progress.update(done + k, tokens + t))
        done, tokens = done + r["prompts"], tokens + r["tokens"]
        keep = ("tau", "accept_by_pos", "speedup", "identical", "prompts", "tokens", "rounds", "target_tok_s",
                "speculative_tok_s", "engine", "attention", "norms", "device", "lossless", "stop_ids",
                "ended_on_stop")
        record = {"set": ps.name, "formats": list(ps.formats), **{k: r[k] for k in keep}}
        console.write(f"{EVAL_PREFIX}{json.dumps(record)}\n"
                      f"eval {ps.name}: tau {r['tau']}, speedup {r['speedup']}x at batch 1 ({r['target_tok_s']} -> "
                      f"{r['speculative_tok_s']} tokens/s), {r['identical']}/{r['prompts']} outputs equal the "
                      f"target's, {r['ended_on_stop']}/{r['prompts']} ended on a stop id (the others at --max-new "
                      f"{args.max_new})\n"
                      f"eval {ps.name}: {describe(r['lossless'])}\n")
    progress.done({"done": done, "total": total, "tokens": tokens, "sets": [ps.name for ps in sets]},
                  f"evaluated {done} prompts of {len(sets)} set(s) ({tokens:,} new tokens each way)")
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
    args = _parser().parse_args(argv)
    return run_cli(lambda: COMMANDS[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
