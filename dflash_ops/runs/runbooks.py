"""runbooks/<name>.yaml -> Runbook, and Runbook + Target -> RunSpec (placeholders by exact token substitution)."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from dflash_ops import names
from dflash_ops.errors import UsageError
from dflash_ops.spec import Liveness, Runbook, RunSpec, Target
from dflash_ops.yamlsrc import Fields, load

RUNBOOK_KEYS = {"description", "command", "workdir", "env", "pre", "liveness", "nodes"}
LIVENESS_KEYS = {"wait_s", "pattern", "timeout_s"}
PRE_STEPS = ("clear_inductor_cache",)
PLACEHOLDER_RE = re.compile(r"\{(python|run_dir|run_id|name)\}")
# The runbooks shipped with the package: dflash_ops/runbooks links to the repository's runbooks/ in a checkout, and is
# a directory of the installed package in a wheel (pyproject.toml's package-data).
BUNDLED = Path(__file__).resolve().parents[1] / "runbooks"


def default_dir() -> Path:
    """`$DFLASH_OPS_RUNBOOKS`, else ./runbooks, else the runbooks shipped next to the package."""
    env = os.environ.get("DFLASH_OPS_RUNBOOKS")
    if env:
        return Path(env)
    return Path("runbooks") if Path("runbooks").is_dir() else BUNDLED


def available(directory: Path) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else []


def load_runbook(directory: Path, name: str) -> Runbook:
    if not names.RUN_NAME_RE.fullmatch(name):
        raise UsageError(f"invalid runbook name {name!r}")
    path = directory / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(available(directory)) or "none"
        raise UsageError(f"unknown runbook {name!r} in {directory} (available: {known})")
    f = Fields.of(load(path), f"runbook {name!r}")
    f.check_keys(RUNBOOK_KEYS)
    command = f.str_list("command", required=True)
    if not command:
        raise f.require("command").fail(f"runbook {name!r}: 'command' must not be empty")
    pre = f.str_list("pre")
    for step, node in zip(pre, f.require("pre").value if pre else []):
        if step not in PRE_STEPS:
            raise node.fail(f"runbook {name!r}: unknown pre step {step!r} (known: {', '.join(PRE_STEPS)})")
    return Runbook(name=name, command=command, description=f.str("description", "") or "",
                   workdir=f.str("workdir") or None, env=f.str_map("env"), pre=pre,
                   liveness=_liveness(f, name), source=str(path), nodes=f.bool("nodes"))


def _liveness(f: Fields, name: str) -> Liveness:
    node = f.require("liveness")
    lf = Fields.of(node, f"runbook {name!r} liveness")
    lf.check_keys(LIVENESS_KEYS)
    pattern = lf.str("pattern", required=True) or ""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise lf.require("pattern").fail(f"runbook {name!r}: liveness.pattern is not a valid regex: {exc}") from None
    return Liveness(wait_s=lf.number("wait_s", 5.0, most=names.SECONDS_MAX) or 0.0, pattern=pattern,
                    timeout_s=lf.number("timeout_s", most=names.SECONDS_MAX))


def substitute(text: str, values: dict[str, str]) -> str:
    """Replace `{python}`, `{run_dir}`, `{run_id}`, `{name}` tokens; everything else is left verbatim."""
    return PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], text)


def run_spec(book: Runbook, target: Target, *, name: str, run_id: str, extra_args: tuple[str, ...] = (),
             extra_env: tuple[tuple[str, str], ...] = (), caller_dir: str | None = None) -> RunSpec:
    """Resolve a runbook on a target. `extra_args` (after `--`) are appended verbatim, never substituted.
    `extra_env` (`launch --env`) is verbatim too and replaces the inventory's or the runbook's value of a key.
    The job's working directory: the runbook's `workdir`, else `caller_dir` (given for this machine: the directory
    `launch` runs in, so that a relative path after `--` means what it means in the caller's shell), else the run
    dir."""
    runs_dir = target.runs_dir
    values = {"python": target.python, "run_dir": f"{runs_dir}/{run_id}", "run_id": run_id, "name": name}
    given = {k for k, _ in extra_env}
    env = tuple((k, substitute(v, values)) for k, v in target.env + book.env if k not in given) + tuple(extra_env)
    return RunSpec(
        run_id=run_id, name=name, runbook=book.name,
        argv=tuple(substitute(a, values) for a in book.command) + tuple(extra_args),
        workdir=substitute(book.workdir, values) if book.workdir else caller_dir or values["run_dir"], env=env,
        pre=book.pre, runs_dir=runs_dir, host=target.host.name, ct=target.container.ctid if target.container else None,
        liveness=book.liveness, extra_args=tuple(extra_args),
    )



TRAIN = ("-m", "trainer", "train")
RESUME_FLAG = "--resume"


def _train_at(argv: tuple[str, ...]) -> int | None:
    """Where the trainer's `train` arguments start in `argv` (after `-m trainer train`), or None."""
    n = len(TRAIN)
    return next((i + n for i in range(len(argv) - n + 1) if tuple(argv[i:i + n]) == TRAIN), None)


def trainer_run_dir(argv: tuple[str, ...], workdir: str) -> str | None:
    """The run directory a trainer `train` command writes (its last `--run-dir`), as a path the job's shell reads
    (a relative one joined to `workdir`); None for another command or one without `--run-dir`."""
    at = _train_at(argv)
    if at is None:
        return None
    found = None
    args = argv[at:]
    for i, arg in enumerate(args):
        if arg == "--run-dir" and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith("--run-dir="):
            found = arg.split("=", 1)[1]
    if not found:
        return None
    return found if found.startswith(("/", "~")) else f"{workdir.rstrip('/')}/{found}"


def resume_spec(book: Runbook, target: Target, meta: dict, *, run_id: str,
                extra_env: tuple[tuple[str, str], ...] = ()) -> RunSpec:
    """PURE: the run `run_id` (its run.json: `meta`), started again in its own run dir on `target`: the argv and
    working directory it recorded, with `--resume` added to a trainer `train` command that lacks it (any other
    command runs again as it was: it continues only where it continues by itself, as `regenerate` does its
    `--out`); the env, pre steps and liveness of `book` (the runbook it was launched with, as it is now) and of
    the inventory, and `extra_env` (`resume --env`). UsageError where run.json lacks what this needs, or where
    the run had a variable that neither the runbook nor the inventory sets (a `launch --env`) and `extra_env`
    does not give again: run.json keeps the names of the variables, never their values."""
    argv, workdir, keys = meta.get("argv"), meta.get("workdir"), meta.get("env_keys", [])
    if (not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv)
            or not isinstance(workdir, str) or not workdir or not isinstance(keys, list)):
        raise UsageError(f"run {run_id} has no readable run.json (its argv, workdir, env_keys): it cannot be resumed",
                         hint="launch it again with `dflash-ops launch`")
    name = meta.get("name") if isinstance(meta.get("name"), str) else names.RUN_ID_RE.fullmatch(run_id).group("name")
    spec = run_spec(book, target, name=names.run_name(name), run_id=run_id, extra_env=extra_env)
    missing = [k for k in keys if isinstance(k, str) and k not in {k2 for k2, _ in spec.env}]
    if missing:
        given = " ".join(f"--env {k}=..." for k in missing)
        raise UsageError(f"run {run_id} was launched with {', '.join(missing)} set, which neither its runbook "
                         f"{book.name!r} nor the inventory sets, and whose value is not kept", hint=f"give it again: {given}")
    argv = tuple(argv)
    if _train_at(argv) is not None and RESUME_FLAG not in argv[_train_at(argv):]:
        argv += (RESUME_FLAG,)
    return replace(spec, argv=argv, workdir=workdir, extra_args=())
