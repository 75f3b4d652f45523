"""Use case: resume a run that ended, in its own run directory, as the same tracked run (`dflash-ops resume`).
The launch's pieces (lifecycle.py: the Session, the checks, proving a job alive) with the resume script
(launch_scripts.resume_script); no typer, no rich."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dflash_ops import names, wire
from dflash_ops.errors import HostUnreachable, Refused, RemoteFailed, UsageError
from dflash_ops.runs import launch_scripts, parse, read_scripts
from dflash_ops.runs.lifecycle import LogEcho, Session, _refusal, _StartWatch, checked, pick_run, prove_alive
from dflash_ops.spec import EXITED, Launched, RunSpec, RunStatus


def resumable(s: Session, run_id: str) -> tuple[RunStatus, dict]:
    """The run `run_id` (a run id, checked before anything is sent) on the target and its run.json, if it can be
    resumed: RunNotFound where it is not there; UsageError for a multi-node run (not supported); Refused (exit 5)
    while anything of it lives, or once it exited 0 (finished: nothing to resume)."""
    check_run_id(run_id)
    s.connect()
    done = s.run(read_scripts.find_script(s.target.runs_dir, run_id), "finding the run")
    status = pick_run(parse.run_list(done.out, s.target.runs_dir), run_id, s.target)
    where = s.target.cli_args
    if status.multinode is not None:
        raise UsageError(f"run {run_id} is one node of a multi-node run: resume does not take multi-node runs",
                         hint="launch it again on its nodes with `-- --run-dir ../<run id> --resume` (docs/cli.md, "
                              "Multi-node runs)")
    if status.holds_on:
        raise _refusal(["running", run_id], s.target)
    if status.state == EXITED and status.exit_code == 0:
        raise Refused(f"run {run_id} on {s.target.label} exited 0: it finished, there is nothing to resume",
                      hint=f"`dflash-ops runs {run_id} {where}`")
    return status, parse.run_meta(done.out, run_id)


def check_run_id(ref: str) -> None:
    """`ref` is a run id (else UsageError, before anything is sent): what names one run, never a name's latest."""
    if not names.is_run_id(ref):
        raise UsageError(f"{ref!r} is not a run id (NAME-YYYYMMDDTHHMMSS-xxxx): resume takes the id of one run",
                         hint="`dflash-ops runs` (with --host/--ct) lists them")


@dataclass(frozen=True)
class Resumed:
    launched: Launched
    log_start: int          # the byte of the log where this attempt starts (after its DFLASH_RESUMED line)


def resume(s: Session, spec: RunSpec, *, checkpoints: str | None = None, wait_s: float | None = None,
           sleep: Callable[[float], None] = time.sleep, on_started: Callable[[int], None] = lambda pid: None,
           echo: LogEcho | None = None) -> Resumed:
    """Start `spec` (runbooks.resume_spec: a run that ended, in its own run dir) detached and prove it alive as
    `launch` does, from the lines of this attempt alone (launch_scripts.resume_script; `checkpoints`: the trainer's
    run dir, which must hold a checkpoint). `echo` is shown this attempt's lines while it is proven alive."""
    checked(spec)
    wait = spec.liveness.wait_s if wait_s is None else wait_s
    seen = _StartWatch(on_started)
    t0 = time.monotonic()
    try:
        done = s.run(launch_scripts.resume_script(spec, probe_after_s=wait, checkpoints=checkpoints),
                     f"resuming {spec.run_id}", timeout_s=wait + 60, on_stdout=seen.feed)
    except HostUnreachable as exc:
        where = s.target.cli_args
        hint = (f"{spec.run_id} started again (pid {seen.pid}) and goes on: `dflash-ops tail {spec.run_id} {where}`"
                if seen.pid is not None else f"{spec.run_id} may have started again: check `dflash-ops runs {where}`")
        raise HostUnreachable(exc.message, hint=hint) from None
    words, start = parse.tagged(done.out, wire.LAUNCHED), parse.tagged(done.out, wire.START)
    if not words or not names.is_digits(words[0]) or not start or not names.is_digits(start[0]):
        raise RemoteFailed(f"resume of {spec.run_id} printed no pid", detail=(done.out + done.err)[-2000:])
    deadline = t0 + max(wait, spec.liveness.timeout_s or 0.0)
    status, line = prove_alive(s, spec, parse.probe(done.stdout), deadline=deadline, sleep=sleep, echo=echo,
                               since=int(start[0]))
    return Resumed(Launched(spec=spec, target=s.target.label, pid=int(words[0]), status=status, matched_line=line,
                            verified_after_s=time.monotonic() - t0), log_start=int(start[0]))
