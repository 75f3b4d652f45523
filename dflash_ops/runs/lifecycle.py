"""Use cases: launch, prove alive, list, find, stop (resume: runs/resume.py). The scripts (shellcmd, *_scripts) + transport + parse; no
typer, no rich.

Every function takes a Session (a Target and the Transport that reaches it), returns values, raises OpsError.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from dflash_ops import names, wire
from dflash_ops.errors import HostUnreachable, OpsError, Refused, RemoteFailed, RunFailed, RunNotFound, UsageError
from dflash_ops.runs import launch_scripts, parse, read_scripts, shellcmd, stop_scripts
from dflash_ops.runs import prune as prune_mod
from dflash_ops.runs.runbooks import run_spec
from dflash_ops.spec import EXITED, LOCAL, LOST, Completed, Launched, Runbook, RunSpec, RunStatus, Target
from dflash_ops.ssh.transport import Transport

LAST_LINES = 20
POLL_S = 0.25


@dataclass(frozen=True)
class Session:
    target: Target
    transport: Transport

    @classmethod
    def of(cls, target: Target) -> "Session":
        """A Session for `target` through the transport its host needs; no connection is made yet."""
        from dflash_ops.ssh import transport

        return cls(target, transport.for_host(target.host))

    def argv(self, script: str) -> list[str]:
        return shellcmd.target_argv(self.target, script)

    def connect(self) -> None:
        """Reach the target now (a no-op for this machine), so that an unreachable host fails before any script."""
        try:
            self.transport.connect()
        except HostUnreachable as exc:
            raise self._hinted(exc) from None

    def _hinted(self, exc: HostUnreachable) -> HostUnreachable:
        if exc.hint is None:
            exc.hint = f"check that {self.target.host.name} is up and accepts SSH, then retry with {self.target.cli_args}"
        return exc

    def run(self, script: str, what: str, *, timeout_s: float = 60.0, ok: tuple[int, ...] = (0,),
            on_stdout: Callable[[bytes], None] | None = None) -> Completed:
        """Run `script` on the target; an exit code outside `ok` (and not a known refusal) is RemoteFailed."""
        kwargs = {"on_stdout": on_stdout} if on_stdout is not None else {}
        try:
            done = self.transport.run(self.argv(script), timeout_s=timeout_s, **kwargs)
        except HostUnreachable as exc:
            raise self._hinted(exc) from None
        if done.exit_code in ok:
            return done
        if done.exit_code == wire.EXIT_MISSING and parse.tagged(done.out, wire.MISSING) is not None:
            raise RunNotFound(f"no such run on {self.target.label} ({what})")
        refused = parse.tagged(done.out, wire.REFUSED)
        if done.exit_code == wire.EXIT_REFUSED and refused:
            raise _refusal(refused, self.target)
        error = next((ln.split(" ", 1)[1] for ln in done.out.splitlines() if ln.startswith(wire.ERROR + " ")), None)
        if error is not None:   # one of our scripts said what failed
            raise RemoteFailed(f"{what} on {self.target.label} failed: {error}",
                               hint="check free space and permissions there; a launch that fails leaves no run "
                                    "dir behind")
        last = "\n".join((done.err + done.out).strip().splitlines()[-LAST_LINES:])
        raise RemoteFailed(f"{what} on {self.target.label} failed with exit code {done.exit_code}",
                           hint="check the host, the container (`pct status CT`) and the runs dir",
                           detail=last or None)


def _refusal(words: list[str], target: Target) -> Refused:
    kind, run = (words + ["-", "-"])[:2]
    where = target.cli_args
    if kind == "alive":
        return Refused(f"run {run} of that name is alive on {target.label}",
                       hint=f"stop it (`dflash-ops stop {run} {where}`) or pass --force, or choose another --name")
    if kind == "cache":
        return Refused(f"not clearing the inductor cache: run {run} is alive on {target.label}",
                       hint=f"wait for it or `dflash-ops stop {run} {where}` first")
    if kind == "running":
        return Refused(f"run {run} is still running on {target.label}: only a run that ended can be resumed",
                       hint=f"stop it first (`dflash-ops stop {run} {where}`)")
    if kind == "nockpt":
        return Refused(f"run {run} on {target.label} holds no checkpoint to resume from (it ended before its first)",
                       hint=f"launch it again: `dflash-ops launch RUNBOOK {where} -- ...`")
    return Refused(f"another launch holds the lock on {target.label}", hint="retry in a few seconds")


# -- listing and lookup ---------------------------------------------------------------------------------------
def list_runs(s: Session) -> list[RunStatus]:
    done = s.run(read_scripts.list_script(s.target.runs_dir), "listing runs")
    return parse.run_list(done.out, s.target.runs_dir)


def list_newest(s: Session, newest: int) -> tuple[list[RunStatus], int]:
    """The runs a process of which lives and the `newest` newest others (read_scripts.list_script's limit), and
    how many older runs were left out, unread."""
    done = s.run(read_scripts.list_script(s.target.runs_dir, newest=newest), "listing runs")
    runs = parse.run_list(done.out, s.target.runs_dir)
    others = [r for r in runs if prune_mod.finished(r)]      # the live ones are all kept
    cut = others[:max(0, len(others) - newest)]
    return [r for r in runs if r not in cut], len(cut) + parse.older_count(done.out)


def prune(s: Session, run_ids: list[str]) -> "prune_mod.Pruned":
    """Remove the run dirs of `run_ids` on the target (prune.prune_script: never a live run), in batches."""
    removed: list[str] = []
    spared: list[str] = []
    for i in range(0, len(run_ids), prune_mod.BATCH):
        done = s.run(prune_mod.prune_script(s.target.runs_dir, run_ids[i:i + prune_mod.BATCH]), "pruning runs",
                      timeout_s=300)
        got = prune_mod.pruned(done.out)
        removed += got.removed
        spared += got.spared
    return prune_mod.Pruned(tuple(removed), tuple(spared))


def find_run(s: Session, ref: str | None) -> RunStatus:
    """`ref` is a run id, a run name (its latest run), or None (the latest run of the target)."""
    check_ref(ref)
    done = s.run(read_scripts.find_script(s.target.runs_dir, ref), "finding the run")
    return pick_run(parse.run_list(done.out, s.target.runs_dir), ref, s.target)


def check_ref(ref: str | None) -> None:
    """A run reference is a run id or a valid run name (else UsageError, before anything is sent)."""
    if ref is not None and not names.is_run_id(ref):
        names.run_name(ref)


def pick_run(runs: list[RunStatus], ref: str | None, target: Target) -> RunStatus:
    """PURE: the run `ref` names among `runs` (oldest first, as listed on `target`): the run of that id, or the
    latest of that name, or the latest run for None; RunNotFound when there is none."""
    if ref is not None:
        runs = [r for r in runs if r.run_id == ref or r.name == ref]
    if not runs:
        what = f"run {ref!r}" if ref else "any run"
        raise RunNotFound(f"no {what} on {target.label} (runs dir {target.runs_dir})",
                          hint=f"`dflash-ops runs {target.cli_args}` lists its runs")
    return runs[-1]


# -- launch ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DryRun:
    spec: RunSpec
    command: str


def plan(s: Session, book: Runbook, *, name: str | None, extra_args: tuple[str, ...] = (),
         extra_env: tuple[tuple[str, str], ...] = (), run_id: str | None = None) -> RunSpec:
    """The run `book` makes on the target; `run_id` is new unless given (the nodes of a multi-node run share one)."""
    name = names.run_name(book.name if name is None else name)
    here = s.target.host.transport == LOCAL and s.target.container is None
    spec = run_spec(book, s.target, name=name, run_id=run_id or names.new_run_id(name), extra_args=extra_args,
                    extra_env=extra_env, caller_dir=os.getcwd() if here else None)
    return checked(spec)


def checked(spec: RunSpec) -> RunSpec:
    """`spec`, or UsageError where it could not run as a tracked job: a NUL byte in an argument or value, or an
    environment that sets dflash-ops's own variables."""
    if any("\0" in v for v in spec.argv + tuple(v for _, v in spec.env)):
        raise UsageError("arguments and environment values cannot contain NUL bytes")
    for key in (wire.MARKER_VAR, wire.RUN_DIR_VAR):
        if any(k == key for k, _ in spec.env):
            # What `stop` and the refusals find a run's processes by: a job that could overwrite it could not be
            # stopped, and its name could be launched twice.
            raise UsageError(f"{key} is set by dflash-ops itself; it cannot be given in an environment")
    return spec


def dry_run(s: Session, spec: RunSpec, *, wait_s: float | None = None) -> DryRun:
    script = launch_scripts.launch_script(spec, probe_after_s=spec.liveness.wait_s if wait_s is None else wait_s)
    return DryRun(spec=spec, command=s.transport.describe(s.argv(script)))


def check_launch(s: Session, spec: RunSpec, *, forced: bool = False) -> None:
    """Raise the Refused (exit 5) that launching `spec` would meet now, changing nothing (a multi-node launch asks
    every node before it starts any). `forced`: what is left to refuse once the live runs of its name are stopped."""
    s.run(launch_scripts.launch_check_script(spec, forced=forced), f"checking {spec.run_id} can start")


def launch(s: Session, spec: RunSpec, *, force: bool = False, wait_s: float | None = None,
           grace_s: float = wire.STOP_GRACE_S, sleep: Callable[[float], None] = time.sleep,
           on_started: Callable[[int], None] = lambda pid: None, echo: LogEcho | None = None) -> Launched:
    """Start `spec` detached and prove it alive (see `prove_alive`). Refused (exit 5) if a run of that name lives,
    unless `force`, which stops those runs first. Launch and the first liveness probe are ONE remote call;
    `on_started(pid)` is called as soon as that call reports the job started (never for a refused launch); `echo`
    is shown the log's lines while the run is proven alive."""
    s.connect()                # unreachable: nothing was sent (the hint names --host/--ct)
    stopped: tuple[str, ...] = ()
    if force:
        alive = [r for r in list_runs(s) if r.name == spec.name and r.holds_on]
        if alive:
            check_launch(s, spec, forced=True)  # a launch refused anyway must not cost the user their run
        for r in alive:
            stop(s, r, grace_s=grace_s)
        stopped = tuple(r.run_id for r in alive)
    try:
        return _start(s, spec, wait_s=wait_s, sleep=sleep, on_started=on_started, stopped=stopped, echo=echo)
    except OpsError as exc:
        if stopped:  # what --force did stays said, whatever came after it
            exc.hint = "; ".join(x for x in (exc.hint, f"stopped first (--force): {', '.join(stopped)}") if x)
        raise


def _start(s: Session, spec: RunSpec, *, wait_s: float | None, sleep: Callable[[float], None],
           on_started: Callable[[int], None], stopped: tuple[str, ...], echo: LogEcho | None) -> Launched:
    wait = spec.liveness.wait_s if wait_s is None else wait_s
    seen = _StartWatch(on_started)
    t0 = time.monotonic()
    try:
        done = s.run(launch_scripts.launch_script(spec, probe_after_s=wait), f"launching {spec.run_id}",
                     timeout_s=wait + 60, on_stdout=seen.feed)
    except HostUnreachable as exc:  # the connection dropped while the launch script ran
        where = s.target.cli_args
        hint = (f"{spec.run_id} started (pid {seen.pid}) and goes on: `dflash-ops tail {spec.run_id} {where}`"
                if seen.pid is not None else f"{spec.run_id} may have started: check `dflash-ops runs {where}`")
        raise HostUnreachable(exc.message, hint=hint) from None
    words = parse.tagged(done.out, wire.LAUNCHED)
    if not words or not names.is_digits(words[0]):
        raise RemoteFailed(f"launch of {spec.run_id} printed no pid", detail=(done.out + done.err)[-2000:])
    deadline = t0 + max(wait, spec.liveness.timeout_s or 0.0)
    status, line = prove_alive(s, spec, parse.probe(done.stdout), deadline=deadline, sleep=sleep, echo=echo)
    return Launched(spec=spec, target=s.target.label, pid=int(words[0]), status=status,
                    matched_line=line, verified_after_s=time.monotonic() - t0, stopped_first=stopped)


class _StartWatch:
    """Watches the launch script's stdout for its `DFLASH_LAUNCHED <pid>` line and reports it once."""

    def __init__(self, on_started: Callable[[int], None]) -> None:
        self.on_started, self.pid, self._buf = on_started, None, b""

    def feed(self, chunk: bytes) -> None:
        if self.pid is not None:
            return
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            words = line.decode("utf-8", "replace").split()
            if words[:1] == [wire.LAUNCHED] and len(words) == 2 and names.is_digits(words[1]):
                self.pid = int(words[1])
                self.on_started(self.pid)
                return


class LogEcho:
    """The log's complete lines, shown (`emit`, one line at a time) as each liveness probe brings them, from the
    log's start: `launch --follow` shows a run's start-up while it is being proven alive. `shown` is the byte offset
    where following goes on. A probe holds the log's last LOG_TAIL_BYTES only: once the log is longer, where its
    window starts is unknown, so nothing more is shown here and following takes over from `shown`."""

    def __init__(self, emit: Callable[[bytes], None]) -> None:
        self.emit, self.shown, self.blind = emit, 0, False

    def feed(self, log_tail: bytes) -> None:
        if self.blind or len(log_tail) >= read_scripts.LOG_TAIL_BYTES:
            self.blind = True
            return
        new = log_tail[self.shown:]
        complete = new[:new.rfind(b"\n") + 1]
        for line in complete.splitlines(keepends=True):
            self.emit(line)
        self.shown += len(complete)


def prove_alive(s: Session, spec: RunSpec, probe: parse.Probe, *, deadline: float,
                sleep: Callable[[float], None] = time.sleep, echo: LogEcho | None = None,
                since: int | None = None) -> tuple[RunStatus, str | None]:
    """The run must still be alive and some log line must match the liveness pattern; re-probed every POLL_S
    until `deadline` (monotonic). A run that already exited 0 counts as proven. Else RunFailed (exit 4). `echo`
    is fed every probe's log. `since`: the probes read the log from that byte (a resumed attempt's lines)."""
    pattern = re.compile(spec.liveness.pattern)
    while True:
        if probe.raw is None:
            raise RemoteFailed(f"run dir of {spec.run_id} is unreadable on {s.target.label}")
        if echo is not None:
            echo.feed(probe.log_tail)
        status = parse.status(probe.raw, {"name": spec.name, "runbook": spec.runbook}, probe.now, spec.runs_dir)
        lines = probe.log_tail.decode("utf-8", "replace").splitlines()
        matched = next((ln for ln in lines if pattern.search(ln)), None)
        # lost (no live process, no exit code) is looked at again within the deadline: the launch script's own
        # probe, in the shell whose child the wrapper is, was seen to read neither the pid nor the exit code of a
        # job that had just ended at once, both files there (1 launch in ~50); the next probe reads them
        in_time = time.monotonic() < deadline
        transient = status.state == LOST and in_time
        if status.state != "running" and not transient:
            if status.state == EXITED and status.exit_code == 0:
                return status, matched
            paths = relative_paths(spec.extra_args)
            where = (f"; {paths[0]!r} and every relative path after `--` is relative to the job's working directory,"
                     f" {spec.workdir} on {s.target.label}" if paths else "")
            raise RunFailed(f"run {spec.run_id} {status.state_text} during its liveness check",
                            hint=f"log: {spec.log_path}{where}",
                            detail="\n".join(lines[-LAST_LINES:]) or "(log is empty)")
        if matched is not None and not transient:
            return status, matched
        if not in_time:
            where = s.target.cli_args
            raise RunFailed(f"run {spec.run_id} is alive (pid {status.pid}) but no log line matched "
                            f"/{spec.liveness.pattern}/ in time",
                            hint=f"it goes on; `dflash-ops tail {spec.run_id} {where}` or "
                                 f"`dflash-ops stop {spec.run_id} {where}`",
                            detail="\n".join(lines[-LAST_LINES:]) or "(log is empty)")
        sleep(POLL_S)
        probe = parse.probe(s.run(read_scripts.probe_script(spec.run_dir, since=since), "checking the run").stdout)


_PATH_PIECE = re.compile(r"[^\s=,\[\]'\"]+")
_FILE_SUFFIXES = (".jsonl", ".json", ".yaml", ".yml", ".txt", ".safetensors", ".pt", ".bin")


def relative_paths(args: tuple[str, ...]) -> list[str]:
    """PURE: the pieces of `args` (`--out x`, `--set k=v`, `data.paths=["a.jsonl"]`) that look like relative paths:
    with a `/`, or a file suffix, and not absolute nor `~`-relative. For a hint only: it may miss a bare name."""
    found = []
    for arg in args:
        for piece in _PATH_PIECE.findall(arg):
            if piece.startswith(("/", "~", "-")) or "://" in piece:
                continue
            if "/" in piece or piece.endswith(_FILE_SUFFIXES):
                found.append(piece)
    return found


# -- stop -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stopped:
    how: str            # terminated | killed | killed_now | not_running | fenced
    status: RunStatus


def signal_text(how: str) -> str:
    """What ended a run, as `stop` says it (a Stopped's `how`: terminated, killed, killed_now)."""
    return {"terminated": "SIGTERM", "killed_now": "SIGKILL at once (--now)"}.get(how, "SIGKILL after the grace "
                                                                                       "period")


@dataclass(frozen=True)
class _StopAnswer:
    how: str
    raw: parse.RawState | None
    procs: int | None
    kept_step: int | None         # the checkpoint the job wrote before it exited (its DFLASH_STOPPED line)


def _stop_call(s: Session, run_id: str, grace_s: float, *, fence: bool, now: bool = False) -> _StopAnswer:
    done = s.run(stop_scripts.stop_script(s.target.runs_dir, run_id, grace_s, fence=fence, now=now),
                 f"stopping {run_id}", timeout_s=(0 if now else grace_s) + (60 if fence else 30))
    how = (parse.tagged(done.out, wire.STOP) or ["?"])[0]
    left = parse.tagged(done.out, wire.LEFT) or []
    raw = next((r for r in map(parse.state_line, done.out.splitlines()) if r is not None), None)
    return _StopAnswer(how, raw, int(left[0]) if left and names.is_digits(left[0]) else None,
                       parse.kept_steps(done.out).get(run_id))


def stop(s: Session, run: RunStatus, *, grace_s: float = wire.STOP_GRACE_S, now: bool = False) -> Stopped:
    """SIGTERM, then SIGKILL after `grace_s`, every process of the run (stop_scripts.stop_script); the default grace
    lets the trainer write its checkpoint first. `now`: SIGKILL at once (the work since the last checkpoint is
    lost)."""
    a = _stop_call(s, run.run_id, grace_s, fence=False, now=now)
    return Stopped(how=a.how, status=parse.updated(run, a.raw, time.time(), a.procs, a.kept_step) if a.raw else run)


def fence(s: Session, run_id: str, *, grace_s: float = wire.STOP_GRACE_S) -> Stopped:
    """`stop` for a run whose launch may still be on its way to the target (stop_scripts.stop_script's `fence`): it
    is stopped once that launch has started it, or, where it never started, kept from starting (`fenced`)."""
    a = _stop_call(s, run_id, grace_s, fence=True)
    if a.raw is None:
        raise RemoteFailed(f"stopping {run_id} on {s.target.label} printed no state")
    status = parse.status(a.raw, {}, time.time(), s.target.runs_dir, a.kept_step)
    return Stopped(how=a.how, status=replace(status, procs=a.procs or 0))


def mark_stopped(s: Session, run: RunStatus) -> None:
    """Mark `run` stopped, if it runs, without signalling it: a multi-node stop's first phase."""
    s.run(stop_scripts.mark_stopped_script(s.target.runs_dir, run.run_id), f"marking {run.run_id} stopped")
