"""What each command refuses before torch is imported: one ConfigError / DataError line (and a hint) for a bad
config, run directory, target directory, export or data file, so that nothing heavy starts on input that cannot
work. Each check returns the summary its phase prints."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from trainer.cli.evalform import EvalRequest
from trainer.errors import ConfigError


def check_train(cfg, run_dir: Path, resume: bool) -> str:
    """Everything about a start that needs neither torch nor a tokenizer: the empty-target and empty-data rules, the
    target directory (its family, weights and tokenizer files; the taps and the mask id fit its config.json; a
    resumed run's where it moved), the tracking backends' packages, the run directory and the tracking directory (not
    a file, checkpoints, a resumed config and its target and data, another run's tracking), every data file
    (exists, readable, each line UTF-8 JSON in one of the formats, the malformed-line limit). Raises ConfigError /
    DataError -> a summary."""
    from trainer import rundir
    from trainer.data.source import BadLineFile, scan
    from trainer.placement import dist_env
    from trainer.targetdir import check_target_dir
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


def check_eval_pair(drafter, target):
    """An export and a target, for eval export / eval prompts: the export's files (rundir.read_export_config) and a
    target directory this trainer can load (targetdir.read_target_dir: family, weights, tokenizer), as train checks
    its -> the target's TargetDir."""
    from trainer.rundir import read_export_config
    from trainer.targetdir import read_target_dir

    read_export_config(Path(drafter))
    return read_target_dir(target)


def check_eval_export(req: EvalRequest) -> tuple[EvalRequest, str]:
    """eval export: the pair, then every line of the file (its errors name eval's flags) -> the request with its
    malformed-line limit (the training data's default where --max-bad-fraction was not given), and a summary."""
    from trainer.config import DataCfg
    from trainer.data.source import EVAL_HINT, EVAL_KNOB, scan

    check_eval_pair(req.drafter, req.target)
    if req.max_bad_fraction is None:
        req = dataclasses.replace(req, max_bad_fraction=DataCfg().max_bad_fraction)
    return req, f"{scan([req.data], req.max_bad_fraction, knob=EVAL_KNOB, hint=EVAL_HINT).lines} lines"


def check_eval_run(run_dir) -> str:
    """eval run: the run's config.json, its export, its held-out data and its target, each refused in one line as
    train refuses them, and the data files and target the run recorded in data.json (sizes, fingerprint) as a
    resume checks them."""
    from trainer import rundir
    from trainer.data.source import scan
    from trainer.targetdir import check_target_loads

    run_dir = Path(run_dir)
    cfg = rundir.load_run_config(run_dir)
    export = rundir.require_export(run_dir)
    if not cfg.data.eval_paths and cfg.data.eval_fraction == 0:
        raise ConfigError("no held-out data: the run has data.eval_fraction 0 and no data.eval_paths",
                          hint=f"evaluate its export on a file: python -m trainer eval export --drafter {export} "
                               f"--target {cfg.model.target} --data FILE")
    if not (Path(cfg.model.target) / "config.json").is_file():
        raise ConfigError(f"the run's target {cfg.model.target} is not there (moved or removed since the run)",
                          hint=f"evaluate its export with the target where it is now: python -m trainer eval export "
                               f"--drafter {export} --target DIR --data FILE")
    check_target_loads(cfg.model, cfg.model.target)
    # the held-out split is a seeded draw over the samples: other data (or another target) would evaluate rows the
    # drafter trained on
    rundir.check_same_inputs(cfg, run_dir, {}, what="eval run")
    lines = sum(scan(paths, cfg.data.max_bad_fraction).lines for paths in (cfg.data.paths, cfg.data.eval_paths)
                if paths)
    return f"{lines} data lines"


def check_eval_prompts(req: EvalRequest) -> list:
    """eval prompts: every prompt file read (prompts.read_prompt_set: a missing or unreadable file is refused; files
    of one stem named apart by prompts.set_names), then the pair, and a target that answers rendered prompts with
    room for --max-new (regenerate's rule: targetdir.check_answers_fit) -> the prompt sets, in the order given."""
    from trainer.prompts import read_prompt_set, set_names
    from trainer.targetdir import check_answers_fit

    sets = [read_prompt_set(p, name) for p, name in zip(req.prompts, set_names(req.prompts))]
    check_answers_fit(check_eval_pair(req.drafter, req.target), req.target, "eval prompts", req.max_new)
    return sets
